"""Writes guarded by the per-item clock (docs/design.md §10): the I/O half of
``ddb2bt.transforms.ordering``.

For a batch of GuardedRows: one ReadRows per table reads the clock cells of every
row in the batch; then each row whose change is newer than its clock is written
with one CheckAndMutateRow that applies the difference from the state the clock
records to the new state, and the new clock, only if the clock still holds what
was read (a compare-and-swap). A swap that
lost a race (another writer moved the clock) re-reads that one clock and
decides again. Rows are independent, so their order within a batch does not
matter for correctness, only for how many swaps are needed.

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
# Swaps in flight at once in a sink (different rows): CheckAndMutateRow is one
# round trip per row and cannot be batched; 16 keeps a worker's gRPC channel busy
# without a thread per row of a 1,000-row batch.
GUARD_CONCURRENCY = 16


class ClockWriter(Protocol):
    """What the guard needs from Bigtable (GrpcMutationWriter; InMemoryBigtable)."""

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
    written (the caller dead-letters their change)."""
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
    # Rows of one item in one row ("slot") are decided one after the other, with
    # the clock each swap left; different slots are independent (design §10.2),
    # so they are swapped concurrently: CheckAndMutateRow cannot be batched, and
    # one at a time leaves the sink waiting on round trips.
    slots: dict = {}
    for row in rows:
        slots.setdefault((row.table, row.row_key, row.item), []).append(row)
    if len(slots) == 1 or concurrency <= 1:
        for slot, slot_rows in slots.items():
            _apply_slot(writer, slot, slot_rows, clocks.get(slot), stats)
        return stats
    parts = []
    with ThreadPoolExecutor(max_workers=min(concurrency, len(slots))) as pool:
        futures = []
        for slot, slot_rows in slots.items():
            part = GuardStats()
            parts.append(part)
            futures.append(pool.submit(_apply_slot, writer, slot, slot_rows, clocks.get(slot), part))
        for future in futures:
            future.result()  # re-raises a slot's failure (the batch is retried whole: idempotent)
    for part in parts:
        stats.applied += part.applied
        stats.stale += part.stale
        stats.lost_races += part.lost_races
        stats.rejected.extend(part.rejected)
    return stats


def _apply_slot(writer: ClockWriter, slot: tuple, rows: list, raw: Optional[bytes], stats: GuardStats) -> None:
    table, row_key, item = slot
    if len(rows) > 1:
        done, raw = _apply_together(writer, slot, rows, raw, stats)
        if done:
            return
    for row in rows:
        for attempt in range(MAX_SWAP_ATTEMPTS):
            mutations = row_mutations(row, decode_clock(raw) if raw is not None else None)
            if mutations is None:
                stats.stale += 1
                break
            expected, prefix = swap_expectation(raw) if raw is not None else (None, False)
            try:
                checked_size(row_key, mutations)
                # A fixed-size predicate (the clock's token); the writer still
                # refuses one over Bigtable's limit (a clock written before the
                # token), which is this change's dead letter, not a wedged bundle.
                swapped = writer.swap_row(table, row_key, CLOCK_FAMILY, item, expected, mutations, prefix=prefix)
            except MappingError as exc:
                stats.rejected.append((row, exc))
                break
            if swapped:
                raw = _new_clock_value(mutations, row)
                stats.applied += 1
                break
            stats.lost_races += 1
            raw = writer.read_family(table, [row_key], CLOCK_FAMILY).get(row_key, {}).get(item)
        else:
            raise SwapContention(f"the clock of a row in {table} moved {MAX_SWAP_ATTEMPTS} times under this "
                                 "writer; another process writes the same rows")


def _apply_together(writer: ClockWriter, slot: tuple, rows: list, raw: Optional[bytes],
                    stats: GuardStats) -> tuple:
    """Several changes of one item to one row in a batch, as one swap
    (``slot_mutations``): one round trip instead of one per change. (done, the
    clock value last read): not done when the combined mutations break a
    Bigtable limit, so that the caller applies them one at a time and only the
    change at fault becomes a dead letter."""
    table, row_key, item = slot
    for attempt in range(MAX_SWAP_ATTEMPTS):
        mutations, applied = slot_mutations(rows, decode_clock(raw) if raw is not None else None)
        if mutations is None:
            stats.stale += len(rows)
            return True, raw
        expected, prefix = swap_expectation(raw) if raw is not None else (None, False)
        try:
            checked_size(row_key, mutations)
            swapped = writer.swap_row(table, row_key, CLOCK_FAMILY, item, expected, mutations, prefix=prefix)
        except MappingError:
            return False, raw
        if swapped:
            stats.applied += applied
            stats.stale += len(rows) - applied
            return True, raw
        stats.lost_races += 1
        raw = writer.read_family(table, [row_key], CLOCK_FAMILY).get(row_key, {}).get(item)
    raise SwapContention(f"the clock of a row in {table} moved {MAX_SWAP_ATTEMPTS} times under this "
                         "writer; another process writes the same rows")


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
    guard, so there is no per-row ordering to keep and no overlap to manage."""

    ordering_guard = True  # what redrive checks it writes through

    def __init__(self, *args, **kwargs) -> None:
        kwargs["overlap"] = False
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
