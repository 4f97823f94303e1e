"""The Bigtable sink: ``BatchingWriter`` (pure logic, writer and clock passed in)
and ``_WriteToBigtableFn`` (the thin DoFn around it).

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

import logging
import time
import uuid
from operator import itemgetter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Optional

from ddb2bt.transforms.limits import MAX_MUTATIONS_PER_REQUEST, MAX_REQUEST_BYTES
from ddb2bt.transforms.model import (BackfillPosition, DeadLetter, MappedBatch, MappedChange, PartDone,
                                     ShardClosed, mutations_size)
from ddb2bt.pipeline.sink.bigtable_io import (FATAL_CODES, INVALID_ARGUMENT, BigtablePermanent, BigtableRetryable,
                                              EntryStatus, MutationWriter, bigtable_endpoint, code_name)
from ddb2bt.pipeline.cutover.bookkeeping import has_markers, strip_markers
from ddb2bt.pipeline.cutover.guards import encode_intent, repair_intents, repair_touched, write_conditional
from ddb2bt.pipeline.metrics import UNNAMED_TABLE, PipelineMetrics
from ddb2bt.pipeline.sink.versions import VersionOwners, resolve
from ddb2bt.transforms.mapping import MARKER_FAMILY
from ddb2bt.pipeline.retry import DEFAULT_POLICY, RetryPolicy, retrying
from ddb2bt.pipeline.state import BackfillCheckpoint, ShardCheckpoint, StateStore

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# A mutation's column family: field 0 of SetCell and of DeleteCells (NamedTuples).
_FAMILY_OF = itemgetter(0)


@dataclass(frozen=True)
class SinkConfig:
    # 1,000 entries ≈ 1 MB of 1 KB rows: large enough to amortise the RPC, small
    # enough that a retry resends little.
    max_batch_rows: int = 1000
    max_batch_bytes: int = 16 * MIB
    max_batch_mutations: int = MAX_MUTATIONS_PER_REQUEST
    retry: RetryPolicy = DEFAULT_POLICY
    # Write a full batch on a background thread while the next one is mapped and
    # buffered (the wait for MutateRows was ~20 % of a worker's time).
    overlap_writes: bool = True
    # The job's lease (ddb2bt.pipeline.lease.LeaseSpec): when set, every write and
    # checkpoint is fenced by it (a process that lost it writes nothing more).
    lease: Optional[object] = None
    # Writes go through the per-item ordering guard (a source that may deliver out
    # of order: Kinesis; docs/design.md §10): sink/guarded.GuardedBatchingWriter.
    ordering_guard: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.max_batch_mutations <= MAX_MUTATIONS_PER_REQUEST:
            raise ValueError(f"max_batch_mutations must be in 1..{MAX_MUTATIONS_PER_REQUEST}")
        if not 0 < self.max_batch_bytes <= MAX_REQUEST_BYTES:
            raise ValueError(f"max_batch_bytes must be in 1..{MAX_REQUEST_BYTES}")
        if self.max_batch_rows <= 0:
            raise ValueError("max_batch_rows must be positive")


@dataclass
class _Row:
    table: str
    row_key: bytes
    mutations: list = field(default_factory=list)
    parts: list = field(default_factory=list)  # [(MappedChange, RowChange)] in stream order
    size: int = 0  # bytes, summed as changes are added (not recomputed per request)


@dataclass
class _Batch:
    """Everything buffered since the last flush; written and checkpointed as one."""

    rows: dict = field(default_factory=dict)  # (table, row_key) -> _Row
    mutations: int = 0
    bytes: int = 0
    dead: list = field(default_factory=list)
    positions: dict = field(default_factory=dict)  # (stream, shard) -> (sequence number, change ms)
    applied: dict = field(default_factory=dict)  # (stream, shard) -> [count, max change ms]
    closed: list = field(default_factory=list)
    elements: list = field(default_factory=list)  # every MappedChange, in order
    conditional: list = field(default_factory=list)  # [(MappedChange, RowChange)] for CheckAndMutateRow
    guarded: list = field(default_factory=list)  # backfill RowChanges to repair if the tail touched them
    guard_parts: dict = field(default_factory=dict)  # (source, part) -> its guarded RowChanges (the journal)
    backfill: dict = field(default_factory=dict)  # (source, part) -> BackfillCheckpoint

    def empty(self) -> bool:
        return not (self.rows or self.dead or self.positions or self.closed or self.conditional or self.backfill)


class _StillFailing(BigtableRetryable):
    pass




def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


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
    ) -> None:
        self._writer = writer
        self._routes_transactional = bool(getattr(writer, "routes_transactional", False))
        self._state = state
        self._config = config
        # The table's view of the metrics: every series of this sink is labelled
        # by the name its state is kept under (its mapping's name).
        self._metrics = metrics.for_table(getattr(state, "job", None) or UNNAMED_TABLE) \
            if isinstance(metrics, PipelineMetrics) else metrics
        self._known_families = known_families or (lambda table: None)
        self._now_ms = now_ms
        self._sleep = sleep
        # Who owns each versioned cell (sink/versions.py); None: not tracked.
        self._versions = versions
        self._settle_stamps: dict = {}  # {version key: its new owner's change time}, per batch
        # A shared (Dataflow) job: this process must own the partitions of the
        # changes it writes (ddb2bt.pipeline.lease.PartitionOwners.check).
        self._partition_fence = partition_fence
        self._reset()
        # overlap: a full batch is written on this one thread while add() goes on;
        # (batch, future) of the one in flight, if any.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ddb2bt-sink") if overlap else None
        self._in_flight: Optional[tuple] = None

    def _reset(self) -> None:
        self._buf = _Batch()

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
        rows = self._prevalidate(element)
        # One pass over the rows for the limits (this runs once per change).
        size = count = new_rows = 0
        buffered = self._buf.rows
        for r in rows:
            size += r.size_bytes
            count += len(r.mutations)
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
                pending = buf.rows[key] = _Row(row.table, row.row_key)
            elif self._metrics:
                self._metrics.coalesced(self._metrics.table)
            pending.mutations.extend(row.mutations)
            pending.parts.append((element, row))
            pending.size += row.size_bytes
        buf.bytes += size
        buf.mutations += count
        self._track(element)
        buf.elements.append(element)
        return flushed

    def _prevalidate(self, element: MappedChange) -> tuple:
        """Dead-letter changes that name a family the table lacks: the emulator
        reports them as INTERNAL (which looks retryable) and the service rejects
        them — either way they must not be retried."""
        if element.dead_letter is not None:
            self._buf.dead.append(element.dead_letter)
            return ()
        for row in element.rows:
            families = self._known_families(row.table)
            if families is None:
                continue
            # The marker family comes and goes with a backfill (cutover.bookkeeping);
            # a cached family list may be stale, so only the write itself decides
            # (a marker write that fails is stripped and retried, see _commit).
            if not isinstance(families, (set, frozenset)):
                families = frozenset(families)
            used = set(map(_FAMILY_OF, row.mutations))  # C-level: this runs for every row
            if used <= families:
                continue
            missing = sorted(f for f in used - families if f != MARKER_FAMILY)
            refresh = getattr(self._known_families, "refresh", None)
            if missing and refresh is not None:
                # The list may predate a create-table: ask again (a recent listing
                # will do) before dead-lettering the change.
                fresh = refresh(row.table)
                missing = [f for f in missing if fresh is not None and f not in fresh]
            if missing:
                self._buf.dead.append(self._dead_letter(
                    element, "unknown_family",
                    f"table {row.table} has no column family {', '.join(missing)} (run ddb2bt create-table)",
                    "UnknownFamily",
                ))
                return ()
        return element.rows

    def _track(self, element: MappedChange) -> None:
        pos = element.record.position
        if pos is None:
            return
        if isinstance(pos, BackfillPosition):
            self._buf.backfill[(pos.source, pos.part)] = BackfillCheckpoint(pos.source, pos.part, pos.resume, pos.count)
            return
        # Per change only the latest position is kept (cheap); the checkpoint value
        # is built once per shard at flush time.
        key = (pos.stream_arn, pos.shard_id)
        change_ms = element.record.change_ms
        self._buf.positions[key] = (pos.sequence_number, change_ms)
        counts = self._buf.applied.get(key)
        if counts is None:
            self._buf.applied[key] = [1, change_ms]
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

    def _take(self) -> Optional[_Batch]:
        batch = self._buf
        if batch.empty():
            return None
        self._reset()
        return batch

    def _commit(self, batch: _Batch) -> tuple:
        """Write a batch, store its dead letters, then checkpoint: (dead, ack ms).
        Touches only the batch, the writer and the state store (and thread-safe
        Prometheus metrics), so it may run on the sink thread."""
        self._fence_partitions(batch)
        dead = list(batch.dead)
        # Recorded before anything is written (guards.py: the repair's crash window).
        intents = self._record_intents(batch)
        settle: dict = {}
        if self._versions is not None:
            dead += self._resolve_versions(batch, settle)
        by_table: dict = {}
        for row in batch.rows.values():
            by_table.setdefault(row.table, []).append(row)
        for table, rows in by_table.items():
            for row, status in self._write_split(table, rows):
                # The emulator says "unknown family", the service NOT_FOUND or
                # INVALID_ARGUMENT: any permanent failure of a row with markers is
                # tried once more without them; a real error fails again and is isolated.
                if has_markers(row.mutations):
                    failed = self._write_marked(table, row)
                    if not failed:
                        continue
                    row, status = failed[0]
                dead.extend(self._isolate(row, status))
        dead.extend(self._write_conditional(batch.conditional))
        self._repair_touched(batch.guarded)
        intents += self._repair_left_over(batch, intents)
        if settle:
            self._versions.settle(settle, self._settle_stamps)
        self._settle_stamps.clear()
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
            self._state.save_checkpoints(_merge_checkpoints(checkpoints))
            if batch.backfill:
                self._state.save_backfill_progress(list(batch.backfill.values()))
            if intents:  # repaired and checkpointed: a crash before this only repeats a repair
                self._state.clear_repair_intents(intents)
        return dead, ack_ms

    def _report(self, batch: _Batch, dead: list, ack_ms: int) -> list:
        """Metrics of a committed batch, on the caller's thread (Beam's metric
        mirrors count only there). Returns the dead letters."""
        m = self._metrics
        if m is None:
            return dead
        dead_ids = {id(d.record) for d in dead}
        table = m.table
        applied: dict = {}  # event -> count: one counter update per label set
        skipped = 0
        lags: list = []  # observed once for the batch
        for element in batch.elements:
            record = element.record
            if dead_ids and id(record) in dead_ids:
                continue
            if not element.rows:
                skipped += 1
                continue
            applied[record.event_name] = applied.get(record.event_name, 0) + 1
            lags.append(ack_ms - record.change_ms)
        if lags:
            m.observe_lags(lags)
        for event, count in applied.items():
            m.applied(table, event, count)
        if skipped:
            m.changes_skipped.labels(table).inc(skipped)
        for d in dead:
            m.dead_lettered(table, d.stage, d.reason)
        for (stream, shard), (count, change_ms) in batch.applied.items():
            m.lag.on_applied(stream, shard, change_ms, count)
        for c in batch.closed:  # read to its end and recorded finished: no lag of its own any more
            m.lag.forget(c.stream_arn, c.shard_id)
        m.checkpoint_time.set(ack_ms / 1000)
        m.lag.on_checkpoint(table, ack_ms / 1000)
        m.publish_lag()
        return dead

    def _requests(self, rows: list) -> Iterable:
        """Split rows into requests within the entry/byte/mutation limits; a row is
        never split across requests."""
        batch: list = []
        size = mutations = 0
        for row in rows:
            row_size = row.size or mutations_size(row.row_key, row.mutations)
            if batch and (len(batch) >= self._config.max_batch_rows
                          or size + row_size > self._config.max_batch_bytes
                          or mutations + len(row.mutations) > self._config.max_batch_mutations):
                yield batch
                batch, size, mutations = [], 0, 0
            batch.append(row)
            size += row_size
            mutations += len(row.mutations)
        if batch:
            yield batch

    def _write_split(self, table: str, rows: list) -> list:
        """Like _write_all; with a separate state app profile (a replicated
        instance), the rows a conditional check must see — the tail's touch
        markers, the backfill's guarded rows — go through that profile's single
        cluster, the rest through the data profile (docs/operations.md#ha-instances-app-profiles)."""
        if not self._routes_transactional:
            return self._write_all(table, rows)
        pinned: list = []
        plain: list = []
        for r in rows:
            must_see = has_markers(r.mutations) or any(c.guard is not None for _, c in r.parts)
            (pinned if must_see else plain).append(r)
        return self._write_all(table, plain) + self._write_all(table, pinned, transactional=True)

    def _write_all(self, table: str, rows: list, transactional: bool = False) -> list:
        """[(row, permanent EntryStatus)] for rows that failed for good."""
        failed: list = []
        for batch in self._requests(rows):
            failed.extend(self._write_with_retry(table, batch, transactional))
        return failed

    def _write_with_retry(self, table: str, rows: list, transactional: bool = False) -> list:
        pending = list(rows)
        permanent: list = []

        def attempt() -> None:
            nonlocal pending
            started = time.perf_counter()
            sent = len(pending)
            try:
                entries = [(r.row_key, r.mutations) for r in pending]
                statuses = self._writer.mutate_rows(table, entries, transactional=True) if transactional \
                    else self._writer.mutate_rows(table, entries)
            except BigtablePermanent as exc:
                if getattr(exc, "code", "") in FATAL_CODES:
                    raise  # table missing or no permission: nothing can succeed, stop loudly
                rejected, pending = pending, []
                if len(rejected) == 1:
                    permanent.append((rejected[0], EntryStatus(INVALID_ARGUMENT, exc.message)))
                    return
                # The request as a whole was rejected: find the culprit row by row.
                for row in rejected:
                    permanent.extend(self._write_with_retry(table, [row], transactional))
                return
            finally:
                if self._metrics:
                    self._metrics.mutate_latency.observe(time.perf_counter() - started)
                    self._metrics.batch_rows.observe(sent)
            retry = []
            first: Optional[EntryStatus] = None
            for row, status in zip(pending, statuses):
                if status.ok:
                    continue
                if status.retryable:
                    retry.append(row)
                    first = first or status
                    if self._metrics:
                        self._metrics.bigtable_retries.labels(code_name(status.code)).inc()
                else:
                    permanent.append((row, status))
            pending = retry
            if pending:
                raise _StillFailing(f"{len(pending)} of {sent} entries failed: {code_name(first.code)}: "
                                    f"{first.message}", code=code_name(first.code))

        def count_rpc_retry(exc: BaseException) -> None:
            if self._metrics and not isinstance(exc, _StillFailing):
                self._metrics.bigtable_retries.labels(getattr(exc, "code", "RPC")).inc(len(pending))

        where = f"Bigtable ({bigtable_endpoint()})"
        try:
            retrying(self._config.retry, f"MutateRows on {table}", count_rpc_retry, self._sleep,
                     where=where)(attempt)
        except BigtableRetryable as exc:
            cause = exc.__cause__ or exc
            raise BigtableRetryable(
                f"gave up writing to {table} after {self._config.retry.deadline_s:.0f}s (--bigtable-deadline): "
                f"{where} kept failing: {cause}", code=getattr(cause, "code", "")) from exc
        return permanent

    def _fence_partitions(self, batch: _Batch) -> None:
        """Wait (retry policy) while this process cannot prove it owns the batch's
        partitions; LeaseLost (the partition moved to another worker) stops it."""
        if self._partition_fence is None or not (batch.positions or batch.closed):
            return
        keys = list(batch.positions) + [(c.stream_arn, c.shard_id) for c in batch.closed]
        retrying(self._config.retry, "partition ownership", None, self._sleep)(lambda: self._partition_fence(keys))

    def _record_intents(self, batch: _Batch) -> list:
        """Durably record the batch's guarded rows, per part, before they are
        written; returns the records' keys (cleared after the checkpoint)."""
        if self._state is None or not batch.guard_parts:
            return []
        batch_id = uuid.uuid4().hex
        return [self._state.save_repair_intent(source, part, batch_id, encode_intent(rows))
                for (source, part), rows in batch.guard_parts.items()]

    def _repair_left_over(self, batch: _Batch, own: list) -> list:
        """Before a part is marked done: repair what an earlier attempt recorded
        and may have written without repairing (it crashed in between); returns
        the records' keys, cleared with the batch's own."""
        if self._state is None:
            return []
        keys: list = []
        payloads: list = []
        mine = set(own)
        for (source, part), ckpt in batch.backfill.items():
            if not ckpt.done:
                continue
            for key, payload in self._state.load_repair_intents(source, part).items():
                if key not in mine:
                    keys.append(key)
                    payloads.append(payload)
        if payloads:
            log.warning("repairing %d backfill batch(es) whose write was interrupted before its repair", len(payloads))
            repair_intents(self._writer, payloads, self._config.retry, self._sleep,
                           lambda table, rows: self._write_all(table, [_Row(table, k, m) for k, m in rows]),
                           self._metrics)
        return keys

    def _repair_touched(self, guarded: list) -> None:
        if guarded:
            repair_touched(self._writer, guarded, self._config.retry, self._sleep,
                           lambda table, rows: self._write_all(table, [_Row(table, k, m) for k, m in rows],
                                                               self._routes_transactional),
                           self._metrics)

    def _write_conditional(self, conditional: list) -> list:
        return write_conditional(self._writer, conditional, self._config.retry, self._sleep, self._dead_letter,
                                 self._metrics)

    def _resolve_versions(self, batch: _Batch, settle: dict) -> list:
        """Refuse changes whose versioned cells another item owns and drop deletes
        of other items' versions (sink/versions.py), before anything is written.
        Fills ``settle`` with the ownership to record once the batch is written."""
        entries = [(e, c) for row in batch.rows.values() for e, c in row.parts if c.versioned]
        entries += [(e, c) for e, c in batch.conditional if c.versioned]
        if not entries:
            return []
        dead, dead_ids, replaced, final, stamps = resolve(
            self._versions, entries, lambda e, reason, msg: self._dead_letter(e, reason, msg, "VersionClash"))
        settle.update(final)
        self._settle_stamps.update(stamps)
        if dead and self._metrics:
            self._metrics.version_clashes.inc(len(dead))
        if not (dead_ids or replaced):
            return dead
        for key, row in list(batch.rows.items()):
            if not any(id(e) in dead_ids or id(c) in replaced for e, c in row.parts):
                continue
            parts = [(e, replaced.get(id(c), c)) for e, c in row.parts if id(e) not in dead_ids]
            parts = [(e, c) for e, c in parts if c.mutations]  # only another item's version to delete: nothing
            if not parts:
                del batch.rows[key]
                continue
            row.parts = parts
            row.mutations = [m for _, c in parts for m in c.mutations]
            row.size = sum(c.size_bytes for _, c in parts)
        batch.conditional = [(e, c) for e, c in ((e, replaced.get(id(c), c)) for e, c in batch.conditional
                                                 if id(e) not in dead_ids) if c.mutations]
        return dead

    def _markers_needed(self) -> bool:
        """Whether a backfill may be running (phase BACKFILLING, or unknown): then
        touch markers must never be stripped — a backfill batch that scanned the
        item earlier could land after this change and bring back what it removed."""
        if self._state is None:
            return False
        from ddb2bt.pipeline.cutover.phases import BACKFILLING, parse_phase

        try:
            return parse_phase(self._state.load_meta("phase")) == BACKFILLING
        except Exception:  # unreadable: fail safe
            return True

    def _write_marked(self, table: str, row: _Row) -> list:
        """A row with touch markers failed for good (the marker family is missing).
        After the finish it is written again without them; while a backfill may run
        it is retried with them until the family exists (a new backfill writes the
        phase before it creates the family), up to the deadline."""
        def attempt() -> list:
            if not self._markers_needed():
                return self._write_with_retry(table, [self._without_markers(row)])
            failed = self._write_with_retry(table, [row])
            if failed:
                raise _StillFailing(f"a change with touch markers to {table} failed while a backfill may be "
                                    f"running ({failed[0][1].message}); retrying until the marker family exists")
            return failed
        return retrying(self._config.retry, f"MutateRows with touch markers on {table}", None, self._sleep,
                        where=f"Bigtable ({bigtable_endpoint()})")(attempt)

    def _without_markers(self, row: _Row) -> _Row:
        """A row whose write raced the finish (the marker family was dropped): the
        same changes without their touch markers, which are needed only while a
        backfill runs (and then the family exists)."""
        parts = [(element, replace(change, mutations=tuple(strip_markers(change.mutations))))
                 for element, change in row.parts]
        if self._metrics:
            self._metrics.markers_stripped.inc()
        return _Row(row.table, row.row_key, strip_markers(row.mutations), parts, row.size)

    def _isolate(self, row: _Row, status: EntryStatus) -> list:
        """A coalesced entry failed for good: apply its changes one by one, in
        order, and dead-letter only those that fail."""
        reason = status.permanent_reason or "write_failed"
        if len(row.parts) == 1:
            element, _ = row.parts[0]
            return [self._dead_letter(element, reason, status.message or reason, "BigtableWriteError")]
        dead = []
        for element, change in row.parts:
            single = _Row(row.table, row.row_key, list(change.mutations), [(element, change)])
            for failed_row, failed_status in self._write_split(row.table, [single]):
                dead.append(self._dead_letter(element, failed_status.permanent_reason or "write_failed",
                                              failed_status.message, "BigtableWriteError"))
        return dead


def _merge_checkpoints(checkpoints: list) -> list:
    merged: dict = {}
    for c in checkpoints:
        key = (c.stream_arn, c.shard_id)
        prev = merged.get(key)
        if prev is None:
            merged[key] = c
        else:
            merged[key] = ShardCheckpoint(
                c.stream_arn, c.shard_id, c.sequence_number or prev.sequence_number,
                finished=prev.finished or c.finished, change_ms=c.change_ms or prev.change_ms,
            )
    return list(merged.values())


# --- Beam ------------------------------------------------------------------------

import apache_beam as beam  # noqa: E402  (kept below the pure part on purpose)
from apache_beam.transforms.window import GlobalWindows  # noqa: E402

FAMILY_CACHE_S = 60.0
# A change naming a family the cached list lacks makes the process list again,
# at most this often: a family added by create-table is used at once, and a
# stream of changes to a truly missing family costs one listing per 5 s.
FAMILY_RECHECK_S = 5.0


class _FamilyCache:
    """Column families per table, refreshed at most once a minute, so a family
    added by `create-table` while the job runs is picked up. Looked up per row
    without a lock; on expiry it asks the process's shared listing
    (``process_families``): one admin client and one listing per table per
    minute per process, however many sink DoFns it runs."""

    def __init__(self, spec, now: Callable[[], float] = time.monotonic) -> None:
        self._project, self._instance = spec.project, spec.instance
        self._now = now
        self._cache: dict = {}

    def __call__(self, table: str) -> Optional[frozenset]:
        from ddb2bt.pipeline.sink.bigtable_io import process_families

        cached = self._cache.get(table)
        if cached is not None and self._now() - cached[0] < FAMILY_CACHE_S:
            return cached[1]
        families = process_families(self._project, self._instance, table, FAMILY_CACHE_S, self._now)
        self._cache[table] = (self._now(), families)
        return families

    def refresh(self, table: str) -> Optional[frozenset]:
        """The families again, from a listing at most FAMILY_RECHECK_S old: asked
        when a change names a family the cached list lacks (one added since)."""
        from ddb2bt.pipeline.sink.bigtable_io import process_families

        families = process_families(self._project, self._instance, table, FAMILY_RECHECK_S, self._now)
        self._cache[table] = (self._now(), families)
        return families


class _WriteToBigtableFn(beam.DoFn):
    """MappedChange | ShardClosed → (writes, checkpoints) → DeadLetter output."""

    def __init__(self, bigtable, state_spec, config: SinkConfig = SinkConfig(),
                 check_families: bool = True, pushgateway: Optional[str] = None) -> None:
        self._bigtable = bigtable
        self._state_spec = state_spec
        self._config = config
        self._check_families = check_families
        self._pushgateway = pushgateway

    def setup(self) -> None:
        from ddb2bt.pipeline.metrics import default_metrics, start_pusher

        if self._pushgateway:  # Dataflow workers cannot be scraped: they push
            start_pusher(self._pushgateway, job=f"ddb2bt-{self._state_spec.job if self._state_spec else 'job'}")

        from ddb2bt.pipeline.lease import fence, join

        # The fence goes on the writer, so data writes, dead letters and
        # checkpoints are all checked right before their RPC.
        self._writer = fence(self._bigtable.writer(), join(self._config.lease))
        self._state = self._state_spec.store(self._writer) if self._state_spec else None
        self._families = _FamilyCache(self._bigtable) if self._check_families else None
        if self._config.ordering_guard:
            # No partition fence needed: every guarded write is a compare-and-set on
            # the item's clock, so a zombie's older change loses (docs/design.md §10).
            from ddb2bt.pipeline.sink.guarded import GuardedBatchingWriter

            self._batcher = GuardedBatchingWriter(self._writer, self._state, self._config, default_metrics(),
                                                  self._families)
            return
        from ddb2bt.pipeline.lease import OWNERS

        shared = self._config.lease is not None and self._config.lease.shared
        self._batcher = BatchingWriter(self._writer, self._state, self._config, default_metrics(), self._families,
                                       overlap=self._config.overlap_writes,
                                       versions=self._state.versions() if self._state is not None else None,
                                       partition_fence=OWNERS.check if shared else None)

    def process(self, element):
        yield from self._batcher.add(element)

    def finish_bundle(self):
        for dead in self._batcher.flush():
            yield GlobalWindows.windowed_value(dead)

    def teardown(self) -> None:
        batcher = getattr(self, "_batcher", None)
        if batcher is not None:
            batcher.close()
        state = getattr(self, "_state", None)
        if state is not None:
            state.close()
        writer = getattr(self, "_writer", None)
        if writer is not None:
            writer.close()
