"""Writes guarded by the per-item clock (docs/design.md §10): the I/O half of
``ddb2bt.transforms.ordering``.

For a batch of GuardedRows: one ReadRows per table reads the clock cells of every
row in the batch; then each row whose change is newer than its clock is written
with one CheckAndMutateRow that applies the difference from the state the clock
records to the new state, and the new clock, only if the clock still holds what
was read (a compare-and-swap); the batch's swaps go out together, up to
GUARD_CONCURRENCY on the wire at once. The swaps that lost a race (another
writer moved the clock) have their clocks read again, in one ReadRows per table,
and are decided again. Rows are independent, so their order within a batch does
not matter for correctness, only for how many swaps are needed.

On a replicated instance CheckAndMutateRow needs an app profile with
single-cluster routing (docs/design.md §10.4): the guard's reads and swaps go
through that profile, so every decision is made on one cluster.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

from ddb2bt.pipeline.clients.retry import retrying
from ddb2bt.pipeline.clients.bigtable.channel import bigtable_endpoint
from ddb2bt.pipeline.clients.bigtable.errors import BigtableRetryable
from ddb2bt.pipeline.sink.sink import BatchingWriter
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.model import DeadLetter, MappedChange
from ddb2bt.transforms.limits import checked_size
from ddb2bt.transforms.ordering import (CLOCK_FAMILY, GuardedRow, decode_clock, row_mutations, slot_mutations,
                                        swap_expectation)

__all__ = ["ClockWriter", "GuardStats", "GuardedBatchingWriter", "apply_guarded"]

# Swaps of one row that may lose to concurrent writers before the batch fails
# (retryably): each loss means another writer advanced the clock, so this bounds
# only pathological contention, not correctness.
MAX_SWAP_ATTEMPTS = 20
# Swaps on the wire at once in a sink (different slots): CheckAndMutateRow is one
# round trip per row and cannot be batched, so a batch's swaps go out together as
# gRPC futures on the writer's one channel (no thread per call). 64 stays under
# the 100 concurrent streams a server commonly allows on one HTTP/2 connection,
# so none wait in the channel's queue. On the emulator 16 and 64 cost the same CPU
# per swap; the service's round trips (milliseconds, not the emulator's
# microseconds) are what more in flight overlaps.
GUARD_CONCURRENCY = 64


class ClockWriter(Protocol):
    """What the guard needs from Bigtable (GrpcMutationWriter; InMemoryBigtable).
    A writer may also have ``swap_rows(table_id, swaps, in_flight)``, many swaps
    at once (GrpcMutationWriter: gRPC futures); without it the guard calls
    ``swap_row`` from threads (``_swap_all``)."""

    def read_family(self, table_id: str, row_keys: Sequence, family: str) -> dict: ...

    def swap_row(self, table_id: str, row_key: bytes, family: str, qualifier: bytes, expected: Optional[bytes],
                 mutations: Sequence, prefix: bool = False) -> bool: ...


@dataclass
class GuardStats:
    applied: int = 0  # rows written (the change was newer than the row's clock)
    stale: int = 0  # rows left alone: an older or duplicate change
    lost_races: int = 0  # swaps that found the clock moved and were decided again
    rejected: list = field(default_factory=list)  # [(GuardedRow, MappingError)]: over a Bigtable limit


class SwapContention(BigtableRetryable):
    """A row's clock kept moving under this writer: retryable."""


def apply_guarded(writer: ClockWriter, rows: Sequence[GuardedRow], stats: Optional[GuardStats] = None,
                  concurrency: int = 1) -> GuardStats:
    """Apply ``rows`` (any order) through the clock guard, ``concurrency`` slots
    (an item's cells in one row) at a time. Returns the counts;
    rows whose mutations break a Bigtable limit are in ``stats.rejected`` and not
    written (the caller dead-letters their change).

    In rounds: every slot still to decide is decided from the clock last read
    (a stale change sends nothing), the round's swaps go out together (up to
    ``concurrency`` on the wire at once), and the slots whose swap lost a race
    have their clocks read again, one ReadRows per table for all of them, and
    are decided again in the next round. A slot's rows are decided one after
    the other (``_Slot``); different slots are independent (design §10.2)."""
    stats = stats if stats is not None else GuardStats()
    if not rows:
        return stats
    clocks: dict = {}  # (table, row, item) -> newest clock value or None
    by_table: dict = {}
    for row in rows:
        by_table.setdefault(row.table, set()).add(row.row_key)
    for table, keys in by_table.items():
        found = writer.read_family(table, sorted(keys), CLOCK_FAMILY)
        for key in keys:
            for qualifier, value in found.get(key, {}).items():
                clocks[(table, key, qualifier)] = value
    slots: dict = {}
    for row in rows:
        slots.setdefault((row.table, row.row_key, row.item), []).append(row)
    active = [_Slot(slot, slot_rows, clocks.get(slot)) for slot, slot_rows in slots.items()]
    while active:
        requests: dict = {}  # table -> [(_Slot, swap)]
        for slot in active:
            swap = slot.next_swap(stats)
            if swap is not None:
                requests.setdefault(slot.table, []).append((slot, swap))
        lost: dict = {}  # table -> [_Slot] whose clock moved under their swap
        for table, pending in requests.items():
            outcomes = _swap_all(writer, table, [swap for _, swap in pending], concurrency)
            for (slot, _), outcome in zip(pending, outcomes):
                if slot.settle(outcome, stats):
                    lost.setdefault(table, []).append(slot)
        for table, moved in lost.items():
            found = writer.read_family(table, sorted({slot.row_key for slot in moved}), CLOCK_FAMILY)
            for slot in moved:
                slot.raw = found.get(slot.row_key, {}).get(slot.item)
        active = [slot for slot in active if not slot.done]
    return stats


def _swap_all(writer: ClockWriter, table: str, swaps: list, concurrency: int) -> list:
    """Outcomes of ``swaps`` on ``table`` (True, False, or the MappingError
    that refused one): through the writer's own ``swap_rows`` where it has one
    (gRPC futures), else ``swap_row`` by ``concurrency`` threads. Looked up on
    the class: a wrapper that forwards unknown names (lease.FencedWriter) must
    not bypass its own fenced ``swap_row``."""
    many = getattr(type(writer), "swap_rows", None)
    if many is not None:
        return many(writer, table, swaps, max(1, concurrency))

    def one(swap) -> object:
        row_key, family, qualifier, expected, mutations, prefix = swap
        try:
            return writer.swap_row(table, row_key, family, qualifier, expected, mutations, prefix=prefix)
        except MappingError as exc:
            return exc

    if concurrency <= 1 or len(swaps) == 1:
        return [one(swap) for swap in swaps]
    with ThreadPoolExecutor(max_workers=min(concurrency, len(swaps))) as pool:
        futures = [pool.submit(one, swap) for swap in swaps]
        # re-raises a swap's failure once all have answered (the batch is retried whole: idempotent)
        return [future.result() for future in futures]


class _Slot:
    """One item's rows in one row of a batch, decided in delivery order from the
    clock last read (``raw``): first all together, as one swap
    (``slot_mutations``: one round trip instead of one per change); if that
    swap breaks a Bigtable limit, one change at a time, so only the change at
    fault becomes a dead letter. ``next_swap`` gives the swap to send (None:
    nothing more to send), ``settle`` takes its outcome."""

    __slots__ = ("table", "row_key", "item", "rows", "raw", "together", "next_row", "attempts", "done", "_sent")

    def __init__(self, slot: tuple, rows: list, raw: Optional[bytes]) -> None:
        self.table, self.row_key, self.item = slot
        self.rows = rows
        self.raw = raw
        self.together = len(rows) > 1
        self.next_row = 0  # one at a time: the next row to decide
        self.attempts = 0  # swaps of the current decision that lost a race
        self.done = False
        self._sent: Optional[tuple] = None  # (mutations, applied count) of the swap in flight

    def next_swap(self, stats: GuardStats) -> Optional[tuple]:
        clock = decode_clock(self.raw) if self.raw is not None else None
        expected, prefix = swap_expectation(self.raw) if self.raw is not None else (None, False)
        if self.together:
            mutations, applied = slot_mutations(self.rows, clock)
            if mutations is None:
                stats.stale += len(self.rows)
                self.done = True
                return None
            try:
                checked_size(self.row_key, mutations)
            except MappingError:
                self.together, self.attempts = False, 0  # apply them one at a time, from the same clock
            else:
                self._sent = (mutations, applied)
                return (self.row_key, CLOCK_FAMILY, self.item, expected, mutations, prefix)
        while self.next_row < len(self.rows):
            row = self.rows[self.next_row]
            mutations = row_mutations(row, clock)
            if mutations is None:
                stats.stale += 1
                self._next_row()
                continue
            try:
                checked_size(self.row_key, mutations)
            except MappingError as exc:
                stats.rejected.append((row, exc))
                self._next_row()
                continue
            # A fixed-size predicate (the clock's token); the writer still
            # refuses one over Bigtable's limit (a clock written before the
            # token), which is this change's dead letter, not a wedged bundle.
            self._sent = (mutations, 1)
            return (self.row_key, CLOCK_FAMILY, self.item, expected, mutations, prefix)
        self.done = True
        return None

    def settle(self, outcome, stats: GuardStats) -> bool:
        """Takes the outcome of the swap ``next_swap`` gave; True when it lost a
        race (the clock must be read again before the next decision)."""
        mutations, applied = self._sent
        self._sent = None
        if isinstance(outcome, MappingError):
            if self.together:
                self.together, self.attempts = False, 0  # the writer refused them together: one at a time
            else:
                stats.rejected.append((self.rows[self.next_row], outcome))
                self._next_row()
            return False
        if outcome:
            if self.together:
                stats.applied += applied
                stats.stale += len(self.rows) - applied
                self.done = True
            else:
                stats.applied += 1
                self.raw = _new_clock_value(mutations, self.rows[self.next_row])
                self._next_row()
            return False
        stats.lost_races += 1
        self.attempts += 1
        if self.attempts >= MAX_SWAP_ATTEMPTS:
            raise SwapContention(f"the clock of a row in {self.table} moved {MAX_SWAP_ATTEMPTS} times under this "
                                 "writer; another process writes the same rows")
        return True

    def _next_row(self) -> None:
        self.next_row += 1
        self.attempts = 0
        self.done = self.next_row >= len(self.rows)


def _new_clock_value(mutations: tuple, row: GuardedRow) -> bytes:
    for m in mutations:
        if m.family == CLOCK_FAMILY and m.qualifier == row.item and hasattr(m, "value"):
            return m.value
    raise AssertionError("row_mutations always sets the clock")  # pragma: no cover




class GuardedBatchingWriter(BatchingWriter):
    """The sink for a source that may deliver out of order: MappedChanges whose
    rows are GuardedRows are buffered and, at each flush, written through the
    guard (``apply_guarded``); dead letters are stored and checkpoints advanced
    exactly as by ``BatchingWriter`` (the same ``_commit``), only after every
    guarded write of the batch is acknowledged. Rows are independent under the
    guard, so there is no per-row ordering to keep. With ``overlap`` (the sink
    passes ``SinkConfig.overlap_writes``) a full batch is written on the sink
    thread while the next is mapped and buffered; the next one's clocks are read
    only once it is acknowledged, so no swap of it races one of the batch before."""

    ordering_guard = True  # what redrive checks it writes through

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("overlap", False)  # a flush without a thread unless asked (tests, redrive)
        kwargs["versions"] = None  # the clock's owned cells replace the version registry (docs/design.md §10.5)
        super().__init__(*args, **kwargs)
        self.stats = GuardStats()

    def _add_change(self, element: MappedChange) -> list:
        flushed: list = []
        buf = self._buf
        if buf.conditional and len(buf.conditional) + len(element.rows) > self._config.max_batch_rows:
            flushed = self._flush_full()
            buf = self._buf
        if element.dead_letter is not None:
            buf.dead.append(element.dead_letter)
        else:
            buf.conditional.extend((element, row) for row in element.rows)
        self._track(element)
        buf.elements.append(element)
        return flushed

    def _write_conditional(self, conditional: list) -> list:
        if not conditional:
            return []
        rows = [row for _, row in conditional]
        changes = {id(row): element for element, row in conditional}
        stats = GuardStats()

        def attempt() -> None:
            stats.rejected.clear()
            apply_guarded(self._writer, rows, stats, GUARD_CONCURRENCY)

        where = f"Bigtable ({bigtable_endpoint()})"
        retrying(self._config.retry, "guarded writes", None, self._sleep, where=where)(attempt)
        self.stats.applied += stats.applied
        self.stats.stale += stats.stale
        self.stats.lost_races += stats.lost_races
        if self._metrics is not None and hasattr(self._metrics, "ordering_guard"):
            for outcome, count in (("applied", stats.applied), ("stale", stats.stale),
                                   ("lost_race", stats.lost_races)):
                if count:
                    self._metrics.ordering_guard.labels(outcome).inc(count)
        dead = []
        seen: set = set()
        for row, exc in stats.rejected:
            element = changes[id(row)]
            if id(element) in seen:
                continue
            seen.add(id(element))
            dead.append(DeadLetter(reason=exc.reason, error_class=type(exc).__name__, message=exc.message,
                                   stage="write", record=element.record, failed_at_ms=self._now_ms()))
        return dead
