"""The Beam splittable DoFn around ``stream_source.PartitionReader``."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import apache_beam as beam
from apache_beam.io.watermark_estimators import WalltimeWatermarkEstimator
from apache_beam.transforms.core import RestrictionProvider, WatermarkEstimatorProvider
from apache_beam.utils.timestamp import Duration

from ddb2bt.pipeline.clients.dynamodb import DESCRIBE_STREAM_SHARED_PER_S, shard_directory, table_of_stream
from ddb2bt.pipeline.control.catchup import CatchUpReport, summarize
from ddb2bt.pipeline.control.coordinator import coordinator_for
from ddb2bt.pipeline.control.shared_rate import SharedRate, describe_rate_name
from ddb2bt.pipeline.observe.metrics import default_metrics
from ddb2bt.pipeline.source.restriction import CheckpointOnlyTracker
from ddb2bt.pipeline.source.records import batch_records
from ddb2bt.pipeline.control.state import stream_label
from ddb2bt.pipeline.source.stream_source import (
    ClaimEnd,
    PartitionReader,
    PartitionRestriction,
    ReaderOptions,
    StreamPartition,
    apply_claim,
    stop_requested,
)
from ddb2bt.transforms.model import StreamElement

__all__ = ["PartitionTracker", "PartitionRestrictionProvider", "StreamSource", "read_stream_partitions"]

log = logging.getLogger(__name__)
# How often a partition saves what it saw of its shards (lag, at head) for
# `status`, which so reads no shard records itself (a third reader next to a
# Lambda trigger would be throttled): one small state write per partition.
READER_REPORT_S = 30.0
# While the lease is unproven a partition looks again this often (FnApiRunner
# ignores deferral delays, so it also sleeps that long: no spinning core).
UNPROVEN_WAIT_S = 1.0
# Local runs: rounds a call may read after a sleep before it ends (and its bundle
# with it): each saves the runner's pass over every stage between a wait and its read.
READS_AFTER_SLEEP = 1


class PartitionTracker(CheckpointOnlyTracker):
    """Tracks a PartitionRestriction. Only checkpoint splits (fraction 0) are
    allowed: splitting a shard's reading across workers would break per-row order
    and could exceed the 2-readers-per-shard limit."""

    bounded = False
    what = "partition restriction"

    def __init__(self, restriction: PartitionRestriction) -> None:
        super().__init__(restriction, apply_claim)


class PartitionRestrictionProvider(RestrictionProvider):
    def initial_restriction(self, element: StreamPartition) -> PartitionRestriction:
        return PartitionRestriction()

    def create_tracker(self, restriction: PartitionRestriction) -> PartitionTracker:
        return PartitionTracker(restriction)

    def restriction_size(self, element, restriction) -> int:
        return 1

    def split(self, element, restriction):
        yield restriction

    def truncate(self, element, restriction):
        # Dataflow drain: stop reading. Everything emitted so far is written and
        # checkpointed by the sink; a later job resumes from the checkpoints.
        return None


class _WalltimeProvider(WatermarkEstimatorProvider):
    def initial_estimator_state(self, element, restriction):
        return None

    def create_watermark_estimator(self, state):
        return WalltimeWatermarkEstimator(state)


@dataclass(frozen=True)
class StreamSource:
    """One table's stream as the reader sees it: the stream, how to read it, the
    client to read it with, and whose checkpoints to resume from (its StateSpec, a
    factory of the state store). A multi-table job has one per table."""

    stream_arn: str
    options: ReaderOptions
    client_factory: Callable
    state_factory: Callable
    partitions: int = 1


class _StreamContext:
    """A worker's per-stream reading state: its job's coordinator (who may read,
    where to report), its client, its state store, one PartitionReader per
    partition, its migration tick."""

    def __init__(self, source: StreamSource, metrics) -> None:
        self.source = source
        self.options = source.options
        lease = source.options.lease
        self.coordinator = coordinator_for(lease or source.state_factory, source.state_factory)
        self.coordinator.join_readers(lease)
        self.client = source.client_factory()
        self.state = self.coordinator.guard(source.state_factory())
        # Series labelled by the table's name in the job (its state key).
        self.metrics = metrics.for_table(getattr(source.state_factory, "job", None)
                                         or table_of_stream(source.stream_arn))
        # AWS's DescribeStream limit is the stream's: on Dataflow (a shared lease: many
        # worker processes) one schedule in the state table for every process and job
        # that lists it, so a start of many workers queues instead of bursting; a
        # local run's one process keeps its own.
        shared = lease is not None and getattr(lease, "shared", False)
        self.describe_rate = SharedRate(self.state if shared else None,
                                        describe_rate_name(stream_label(source.stream_arn)),
                                        DESCRIBE_STREAM_SHARED_PER_S)
        self.readers: dict = {}
        self.keeper = None  # whether this stream reports to its job's cutover keeper (None: not asked yet)
        self.reported: dict = {}  # partition -> monotonic time of its last reader report

    def report(self, partition: StreamPartition, reader: PartitionReader, force: bool = False) -> None:
        """Save the partition's view of its shards for `status`, at most every
        READER_REPORT_S (and when it ends); a failure only delays the next one."""
        now = time.monotonic()
        if not force and now - self.reported.get(partition, -1e9) < READER_REPORT_S:
            return
        self.reported[partition] = now
        try:
            self.state.save_reader_report(partition.stream_arn, f"{partition.index}-{partition.count}",
                                          reader.pending_since(), ended=force, heads=reader.heads())
        except Exception as exc:  # reading goes on; status shows the report's age
            log.warning("cannot save the reader report of %s (%s: %s)", table_of_stream(partition.stream_arn),
                        type(exc).__name__, exc)

    def reader(self, partition: StreamPartition) -> PartitionReader:
        reader = self.readers.get(partition)
        if reader is None:
            reader = self.readers[partition] = PartitionReader(
                self.client, partition, self.options, self.state.load_checkpoints, self.metrics,
                directory=shard_directory(),  # one shard listing per stream per process
                hand_back_pacing=True,  # a paced shard's wait goes to the runner (RoundResult.paced_s)
                load_heads=self.state.load_shard_heads,  # what proves a trimmed checkpoint harmless
                between_attempts=self.coordinator.check_held,  # no retry loop outlives a lost lease
                describe_slot=self.describe_rate.take)  # the stream's DescribeStream calls, every process's
        return reader

    def close(self) -> None:
        if self.keeper:
            self.coordinator.release_keeper()
            self.keeper = None
        close = getattr(self.client, "close", None)
        if close:
            close()
        self.state.close()


class _ReadStreamPartitionsFn(beam.DoFn):
    """StreamPartition → RecordBatch | ShardClosed, unbounded, for one stream or
    several (a multi-table job: every partition names its stream, and each stream
    keeps its own options, lease, checkpoints and migration phase)."""

    def __init__(self, sources) -> None:
        self._sources = tuple(sources)
        arns = [s.stream_arn for s in self._sources]
        if not arns or len(set(arns)) != len(arns):
            raise ValueError(f"one source per stream, at least one: got {arns}")
        # Local readers sleep only once every partition of the job had to wait in a
        # row: one busy table must not wait for the others' sleeps (_wait).
        self._partitions_total = sum(s.partitions for s in self._sources)

    def setup(self) -> None:
        self._metrics = default_metrics()
        self._contexts: dict = {}
        for source in self._sources:
            self._contexts[source.stream_arn] = _StreamContext(source, self._metrics)
        # Partitions in a row whose round ended waiting (paced or idle), and the
        # shortest of their waits: what a local reader sleeps (_wait).
        self._waiting_streak, self._shortest_wait_s = 0, float("inf")

    @beam.DoFn.unbounded_per_element()
    def process(
        self,
        partition: StreamPartition,
        tracker=beam.DoFn.RestrictionParam(PartitionRestrictionProvider()),
        watermark=beam.DoFn.WatermarkEstimatorParam(_WalltimeProvider()),
    ):
        # Locally a round that sleeps (the runner ignores deferral delays) reads
        # again in the same call, right after its sleep: deferring first would add
        # the runner's pass over every stage (~15 ms here) to each wait, so to
        # every change's lag. Once: a call still ends, and with it the bundle
        # (after read, sleep, read — and a last sleep, if that read was idle).
        for _ in range(READS_AFTER_SLEEP + 1):
            read_again = yield from self._round(partition, tracker)
            if not read_again:
                return
        tracker.defer_remainder(Duration.of(0))

    def _round(self, partition: StreamPartition, tracker):
        """One round of ``partition``'s reading; returns True where it slept and
        the next round may start at once (its remainder not deferred)."""
        if tracker.current_restriction().done:
            return False
        ctx = self._contexts[partition.stream_arn]
        options = ctx.options
        # Told, not deciding: the coordinator raises LeaseLost once the job's lease
        # is lost (this process stops), and says no while the lease is unproven
        # (a blip, a pause) or another worker owns the partition.
        if not ctx.coordinator.may_read(partition):
            # FnApiRunner ignores deferral delays, so it also sleeps: no spinning core.
            time.sleep(UNPROVEN_WAIT_S)
            tracker.defer_remainder(Duration.of(UNPROVEN_WAIT_S))
            return False
        if stop_requested(options.stop_token):
            tracker.try_claim(ClaimEnd())
            return False
        reader = ctx.reader(partition)
        # While the round runs (it may back off on throttling for minutes) the
        # partition's lease is in use, not idle (PARTITION_IDLE_RELEASE_S); so
        # while its report is saved (a write that may be slow under Bigtable
        # throttling): what the round read is committed after it.
        with ctx.coordinator.reading(partition):
            result = yield from batch_records(reader.read_round(tracker))
            if result.stopped:
                return False
            decision = None if result.paced_s is not None else reader.idle_decision(tracker, result)
            ctx.report(partition, reader, force=decision == "end")
        if result.paced_s is not None:
            # Every shard of the partition was read a moment ago (5 GetRecords/s
            # per shard): the wait goes back to the runner, which reads the other
            # partitions meanwhile, instead of this thread sleeping through it.
            self._tick_cutover(ctx, partition, reader)
            return self._wait(tracker, options, result.paced_s)
        if decision == "end":
            self._tick_cutover(ctx, partition, reader, ended_idle=True)
            log.info("partition %d/%d of %s idle for %ss: done", partition.index, partition.count,
                     partition.stream_arn, options.until_idle_s)
            tracker.try_claim(ClaimEnd())
            return False
        self._tick_cutover(ctx, partition, reader)
        if decision == "poll":
            return self._wait(tracker, options,
                              options.poll_interval_s if result.idle_wait_s is None else result.idle_wait_s)
        self._waiting_streak, self._shortest_wait_s = 0, float("inf")
        tracker.defer_remainder(Duration.of(0))
        return False

    def _wait(self, tracker, options: ReaderOptions, wait_s: float) -> bool:
        """A round after which its partition waits ``wait_s`` (paced, or an idle
        poll). On Dataflow the runner waits: the remainder is deferred that long.
        The local FnApiRunner ignores deferral delays, so the reader sleeps — once
        every partition of the job in a row had to wait (one busy table must not
        wait for the others' sleeps; an idle job must not spin a core), for the
        shortest of their waits, never longer. True: the wait slept was this
        partition's own — it reads again at once, in the same call."""
        if not options.sleep_when_idle:
            tracker.defer_remainder(Duration.of(wait_s))
            return False
        self._waiting_streak += 1
        self._shortest_wait_s = min(self._shortest_wait_s, wait_s)
        if self._waiting_streak >= self._partitions_total:
            slept = self._shortest_wait_s
            time.sleep(slept)
            self._waiting_streak, self._shortest_wait_s = 0, float("inf")
            if wait_s <= slept:
                return True
        tracker.defer_remainder(Duration.of(0))
        return False

    def _tick_cutover(self, ctx: _StreamContext, partition: StreamPartition, reader: PartitionReader,
                      ended_idle: bool = False) -> None:
        """Tell the cutover keeper where this partition is: its shards' lag and
        applied position in time (control/catchup.py), not whether this round
        found something new. The keeper — not this reader — moves the migration
        on (phase, finish) on a thread of its own (ddb2bt.pipeline.control.keeper),
        told through the job's coordinator (ddb2bt.pipeline.control.coordinator):
        on Dataflow, or next to a separate batch backfill, no controller does."""
        if ctx.keeper is None:
            ctx.keeper = ctx.coordinator.use_keeper(ctx.options.promote_live)
        if ctx.keeper:
            now_ms = time.time_ns() // 1_000_000
            shards = reader.shard_ids()
            if ended_idle:  # nothing new for all of --until-idle: at the head now
                report = CatchUpReport(0, now_ms)
            elif shards:
                lag = ctx.metrics.lag
                report = summarize([lag.view(partition.stream_arn, s) for s in shards], now_ms)
            else:  # a partition that owns no shard (more partitions than shards) has nothing to catch up
                report = CatchUpReport(None, None) if reader.waiting else CatchUpReport(0, now_ms)
            # Recorded only while this process owns the partition (the coordinator's fence).
            ctx.coordinator.report(stream_label(ctx.source.stream_arn), partition, report, ended_idle=ended_idle)

    def teardown(self) -> None:
        for ctx in getattr(self, "_contexts", {}).values():
            ctx.close()


def read_stream_partitions(sources) -> beam.ParDo:
    """The reading stage: ``StreamPartition`` → ``RecordBatch | ShardClosed`` of
    the ``sources`` (``StreamSource``), each partition's shards in order. A ParDo,
    not a composite around it: the step names stay as they are (Dataflow updates
    a running job in place by step name)."""
    return beam.ParDo(_ReadStreamPartitionsFn(sources)).with_output_types(StreamElement)
