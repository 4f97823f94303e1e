"""The sink's batching and commit order: ``BatchingWriter`` (writer and clock passed
in; the DoFn around it is ``sink._WriteToBigtableFn``). It buffers and coalesces,
and commits each batch in this order; the jobs of a commit live beside it
(``requests``: MutateRows and isolation; ``markers``; ``claims``: version claims;
``repairs``: guarded backfill writes and repair intents; ``report``: metrics).

Per flush, in this order:
  1. Coalesce: all changes to one (table, row key) in the buffer become ONE
     MutateRows entry with their mutations in stream order — Bigtable applies the
     entries of a request in any order, even for the same row, but the mutations
     of one entry in order.
  2. Write: MutateRows in requests bounded by entries, bytes and the 100,000-
     mutation limit; retry only the entries that failed with a retryable code,
     with jittered exponential backoff and a total deadline. At most one batch
     is in flight, and the next is sent only once it is acknowledged, so a row's
     next change is never sent while its previous one is unacknowledged or being
     retried. (With ``overlap_writes`` the DoFn maps and buffers the next batch
     while one is being written; the bundle ends only when both are done.)
  3. Isolate: an entry that failed permanently and holds several changes is
     re-sent one change at a time, in order, so only the bad change is
     dead-lettered and its neighbours still apply.
  4. Dead letters are stored durably, then each shard's checkpoint advances to the
     last record the flush covered, then closed shards are marked finished.
If the deadline passes with retryable failures left, the flush raises (the bundle
fails, nothing is checkpointed, the runner or a restart replays: no loss).
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from ddb2bt.transforms.model import BackfillPosition, DeadLetter, MappedBatch, MappedChange, PartDone, ShardClosed
from ddb2bt.pipeline.clients.bigtable.writer import MutationWriter
from ddb2bt.pipeline.clients.retry import retrying
from ddb2bt.pipeline.control.phases import backfill_may_run
from ddb2bt.pipeline.observe.metrics import UNNAMED_TABLE, PipelineMetrics
from ddb2bt.pipeline.control.versions import VersionOwners
from ddb2bt.pipeline.control.state import BackfillCheckpoint, ShardCheckpoint, StateStore
from ddb2bt.pipeline.sink.batch import Batch, Row, merge_checkpoints
from ddb2bt.pipeline.sink.claims import VersionClaims
from ddb2bt.pipeline.sink.config import SinkConfig
from ddb2bt.pipeline.sink.families import FamilyCheck
from ddb2bt.pipeline.sink.markers import MarkedWrites
from ddb2bt.pipeline.sink.repairs import GuardedWrites
from ddb2bt.pipeline.sink.report import report_batch
from ddb2bt.pipeline.sink.requests import RequestWriter

__all__ = ["BatchingWriter"]

def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


def _marking_of(state: Optional[StateStore]) -> Callable[[], bool]:
    """A writer without a coordinator (tests, tools): markers are needed while
    its state's phase says a backfill may run; never without a state."""
    if state is None:
        return lambda: False
    return lambda: backfill_may_run(state)


class BatchingWriter:
    """Buffers mapped changes, writes them, and checkpoints. Not thread-safe: one
    per DoFn instance, as Beam uses them."""

    def __init__(
        self,
        writer: MutationWriter,
        state: Optional[StateStore],
        config: SinkConfig = SinkConfig(),
        metrics: Optional[PipelineMetrics] = None,
        known_families: Optional[Callable[[str], Optional[frozenset]]] = None,
        now_ms: Callable[[], int] = _wall_ms,
        sleep: Callable[[float], None] = time.sleep,
        overlap: bool = False,
        versions: Optional[VersionOwners] = None,
        partition_fence: Optional[Callable] = None,
        marking: Optional[Callable[[], bool]] = None,
    ) -> None:
        self._writer = writer
        self._state = state
        self._config = config
        # The table's view of the metrics: every series of this sink is labelled
        # by the name its state is kept under (its mapping's name).
        self._metrics = metrics.for_table(getattr(state, "job", None) or UNNAMED_TABLE) \
            if isinstance(metrics, PipelineMetrics) else metrics
        self._families = FamilyCheck(known_families or (lambda table: None), self._dead_letter)
        self._now_ms = now_ms
        self._sleep = sleep
        # The jobs of a commit, each in its own class (see the module docstring).
        self._requests = RequestWriter(writer, config, self._metrics, sleep, self._dead_letter)
        # Whether a backfill may run: the job's coordinator tells (sink.py); alone,
        # the state's phase, read through the control floor.
        self._markers = MarkedWrites(self._requests, marking or _marking_of(state), config, self._metrics, sleep)
        self._guarded = GuardedWrites(writer, self._requests, state, config, self._metrics, sleep, self._dead_letter)
        # Who owns each versioned cell (versions.py); None: not tracked.
        self._claims = VersionClaims(versions, self._metrics, self._dead_letter) if versions is not None else None
        # A shared (Dataflow) job: this process must own the partitions of the
        # changes it writes (ddb2bt.pipeline.control.partitions.PartitionOwners.check).
        self._partition_fence = partition_fence
        self._reset()
        # overlap: a full batch is written on this one thread while add() goes on;
        # (batch, future) of the one in flight, if any.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ddb2bt-sink") if overlap else None
        self._in_flight: Optional[tuple] = None

    def _reset(self) -> None:
        self._buf = Batch()
        self._families.new_batch()

    @property
    def pending_rows(self) -> int:
        return len(self._buf.rows)

    # -- adding ---------------------------------------------------------------------
    def add(self, element) -> list:
        """Buffer one element; returns dead letters of any flush it caused."""
        if type(element) is MappedBatch:
            flushed: list = []
            add_change = self._add_change
            for change in element.changes:
                dead = add_change(change) if type(change) is MappedChange else self.add(change)
                if dead:
                    flushed += dead
            return flushed
        if isinstance(element, ShardClosed):
            self._buf.closed.append(element)
            return []
        if isinstance(element, PartDone):
            self._buf.backfill[(element.source, element.part)] = BackfillCheckpoint(
                element.source, element.part, None, element.count, done=True)
            return []
        if not isinstance(element, MappedChange):
            raise TypeError(f"sink got {type(element).__name__}, expected MappedChange(s) or a marker")
        return self._add_change(element)

    def _add_change(self, element: MappedChange) -> list:
        flushed: list = []
        rows = self._families.rows(element, self._buf.dead)
        # One pass over the rows for the limits (this runs once per change).
        size = count = new_rows = 0
        buffered = self._buf.rows
        for r in rows:
            size += r.size_bytes
            count += r.mutation_count
            if (r.table, r.row_key) not in buffered:
                new_rows += 1
        config = self._config
        if buffered and (
            len(buffered) + new_rows > config.max_batch_rows
            or self._buf.bytes + size > config.max_batch_bytes
            or self._buf.mutations + count > config.max_batch_mutations
        ):
            flushed = self._flush_full()
        buf = self._buf  # a new one if that flushed
        for row in rows:
            guard = row.guard
            if guard is not None:
                if guard.conditional:
                    buf.conditional.append((element, row))
                    continue
                buf.guarded.append(row)
                pos = element.record.position
                if isinstance(pos, BackfillPosition):
                    buf.guard_parts.setdefault((pos.source, pos.part), []).append(row)
            key = (row.table, row.row_key)
            pending = buf.rows.get(key)
            if pending is None:
                buf.rows[key] = Row.of_change(row.table, row.row_key, element, row)
            else:
                buf.coalesced += 1
                pending.add(element, row)
        buf.bytes += size
        buf.mutations += count
        self._track(element)
        buf.elements.append(element)
        return flushed

    def _track(self, element: MappedChange) -> None:
        record = element.record
        pos = record.position
        if pos is None:
            return
        buf = self._buf
        if isinstance(pos, BackfillPosition):
            buf.backfill[(pos.source, pos.part)] = BackfillCheckpoint(pos.source, pos.part, pos.resume, pos.count)
            return
        # Per change only the latest position is kept (cheap); the checkpoint value
        # is built once per shard at flush time.
        key = (pos.stream_arn, pos.shard_id)
        change_ms = record.change_ms
        buf.positions[key] = (pos.sequence_number, change_ms)
        counts = buf.applied.get(key)
        if counts is None:
            buf.applied[key] = [1, change_ms]
        else:
            counts[0] += 1
            if change_ms > counts[1]:
                counts[1] = change_ms

    def _dead_letter(self, element: MappedChange, reason: str, message: str, error_class: str) -> DeadLetter:
        return DeadLetter(reason=reason, error_class=error_class, message=message, stage="write",
                          record=element.record, failed_at_ms=self._now_ms())

    # -- flushing -------------------------------------------------------------------
    def flush(self) -> list:
        """Write everything buffered (and wait for a batch in flight), store dead
        letters, checkpoint. Returns the dead letters (also stored)."""
        dead = self._wait_in_flight()
        batch = self._take()
        if batch is not None:
            dead += self._report(batch, *self._commit(batch))
        return dead

    def close(self) -> None:
        # Never wait here for a batch still being written (a teardown after a
        # failure or an interruption must not block on an RPC): flush() is what
        # waits for acknowledgements, and an unflushed batch is not checkpointed.
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._requests.close()

    def _flush_full(self) -> list:
        """A batch is full. Without overlap: flush. With it: wait for the batch in
        flight (so this one is sent only after it is acknowledged: per-row order),
        then write this one on the sink thread and return at once. Returns the
        dead letters of the batch that completed."""
        if self._executor is None:
            return self.flush()
        dead = self._wait_in_flight()
        batch = self._take()
        if batch is not None:
            self._in_flight = (batch, self._executor.submit(self._commit, batch))
        return dead

    def _wait_in_flight(self) -> list:
        if self._in_flight is None:
            return []
        batch, future = self._in_flight
        self._in_flight = None
        return self._report(batch, *future.result())  # re-raises the write's failure here

    def _take(self) -> Optional[Batch]:
        batch = self._buf
        if batch.coalesced and self._metrics:  # counted as they were added, told once a batch
            self._metrics.coalesced(self._metrics.table, batch.coalesced)
            batch.coalesced = 0
        if batch.empty():
            return None
        self._reset()
        return batch

    def _commit(self, batch: Batch) -> tuple:
        """Write a batch, store its dead letters, then checkpoint: (dead, ack ms).
        Touches only the batch, the writer and the state store (and thread-safe
        Prometheus metrics), so it may run on the sink thread."""
        # Ownership re-proven before each retry too: a worker woken in a back-off after its partition
        # moved must not land old images (docs/design.md §6.5). One batch commits at a time.
        self._requests.still_owner = lambda: self._fence_partitions(batch)
        try:
            # The partitions are in use while the commit runs (it may outlast the idle
            # release: the last batch commits in finish_bundle, after the reading round).
            with self._partitions_in_use(batch):
                return self._commit_owned(batch)
        finally:
            self._requests.still_owner = None

    def _partitions_in_use(self, batch: Batch):
        """The fence's ``in_use(positions)`` hold, if it has one: the fence is
        PartitionOwners.check (coordinator.partition_fence), its owner's."""
        fence = self._partition_fence
        hold = getattr(getattr(fence, "__self__", fence), "in_use", None)
        if hold is None or not (batch.positions or batch.closed):
            return contextlib.nullcontext()
        return hold(list(batch.positions) + [(c.stream_arn, c.shard_id) for c in batch.closed])

    def _commit_owned(self, batch: Batch) -> tuple:
        self._fence_partitions(batch)
        dead = list(batch.dead)
        # Recorded before anything is written (guards.py: the repair's crash window).
        intents = self._guarded.record_intents(batch)
        settle: dict = {}
        if self._claims is not None:
            dead += self._claims.resolve(batch, settle)
        by_table: dict = {}
        for row in batch.rows.values():
            by_table.setdefault(row.table, []).append(row)
        for table, rows in by_table.items():
            for row, status in self._requests.write_split(table, rows):
                # The emulator says "unknown family", the service NOT_FOUND or
                # INVALID_ARGUMENT: any permanent failure of a row with markers is
                # tried once more without them; a real error fails again and is isolated.
                if row.has_markers():
                    failed = self._markers.write(table, row)
                    if not failed:
                        continue
                    row, status = failed[0]
                dead.extend(self._requests.isolate(row, status))
        dead.extend(self._write_conditional(batch.conditional))
        self._guarded.repair_touched(batch.guarded)
        intents += self._guarded.repair_left_over(batch, intents)
        if self._claims is not None:
            self._claims.settle(settle)
        ack_ms = self._now_ms()
        self._fence_partitions(batch)  # the writes may have taken long: still the owner before checkpointing?
        if self._state is not None:
            if dead:
                self._state.save_dead_letters(dead)
            checkpoints = [ShardCheckpoint(stream_arn=stream, shard_id=shard, sequence_number=seq, change_ms=ms)
                           for (stream, shard), (seq, ms) in batch.positions.items()] + [
                ShardCheckpoint(c.stream_arn, c.shard_id, c.last_sequence_number, finished=True)
                for c in batch.closed
            ]
            # Re-proven before each retry too: a worker paused mid-write (or cut
            # off) may wake after its partition moved, and must not checkpoint.
            self._state.save_checkpoints(merge_checkpoints(checkpoints),
                                         still_owner=lambda: self._fence_partitions(batch))
            if batch.backfill:
                self._state.save_backfill_progress(list(batch.backfill.values()))
            if intents:  # repaired and checkpointed: a crash before this only repeats a repair
                self._state.clear_repair_intents(intents)
        return dead, ack_ms

    def _report(self, batch: Batch, dead: list, ack_ms: int) -> list:
        return report_batch(self._metrics, batch, dead, ack_ms)

    def _fence_partitions(self, batch: Batch) -> None:
        """Wait (retry policy) while this process cannot prove it owns the batch's
        partitions; LeaseLost (the partition moved to another worker) stops it."""
        if self._partition_fence is None or not (batch.positions or batch.closed):
            return
        keys = list(batch.positions) + [(c.stream_arn, c.shard_id) for c in batch.closed]
        retrying(self._config.retry, "partition ownership", None, self._sleep)(lambda: self._partition_fence(keys))

    def _write_conditional(self, conditional: list) -> list:
        # A method of its own: the ordering guard's writer (guarded.py) replaces it.
        return self._guarded.write_conditional(conditional)
