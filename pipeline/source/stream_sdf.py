"""The Beam splittable DoFn around ``stream_source.PartitionReader``."""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable

import apache_beam as beam
from apache_beam.io.iobase import RestrictionProgress, RestrictionTracker
from apache_beam.io.watermark_estimators import WalltimeWatermarkEstimator
from apache_beam.transforms.core import RestrictionProvider, WatermarkEstimatorProvider
from apache_beam.utils.timestamp import Duration

from ddb2bt.pipeline.metrics import default_metrics
from ddb2bt.pipeline.source.records import batch_records
from ddb2bt.pipeline.source.stream_source import (
    ClaimEnd,
    PartitionReader,
    PartitionRestriction,
    ReaderOptions,
    StreamPartition,
    apply_claim,
    stop_requested,
)

log = logging.getLogger(__name__)
PHASE_CHECK_S = 10.0  # how often an idle reader looks at the migration phase


class PartitionTracker(RestrictionTracker):
    """Tracks a PartitionRestriction. Only checkpoint splits (fraction 0) are
    allowed: splitting a shard's reading across workers would break per-row order
    and could exceed the 2-readers-per-shard limit."""

    def __init__(self, restriction: PartitionRestriction) -> None:
        self._r = restriction
        self._split = False

    def current_restriction(self) -> PartitionRestriction:
        return self._r

    def try_claim(self, claim) -> bool:
        if self._split or self._r.done:
            return False
        self._r = apply_claim(self._r, claim)
        return True

    def try_split(self, fraction_of_remainder):
        if self._split or self._r.done or fraction_of_remainder != 0:
            return None
        self._split = True
        residual = self._r
        self._r = replace(self._r, done=True)
        return self._r, residual

    def check_done(self) -> None:
        if not self._r.done:
            raise ValueError(f"partition restriction not finished: {self._r}")

    def is_bounded(self) -> bool:
        return False

    def current_progress(self) -> RestrictionProgress:
        return RestrictionProgress(completed=0, remaining=0 if self._r.done else 1)


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


class _ReadStreamPartitionsFn(beam.DoFn):
    """StreamPartition → RecordBatch | ShardClosed, unbounded."""

    def __init__(self, options: ReaderOptions, client_factory: Callable, state_factory: Callable) -> None:
        self._options = options
        self._client_factory = client_factory
        self._state_factory = state_factory

    def setup(self) -> None:
        from ddb2bt.pipeline.lease import join

        self._lease = join(self._options.lease)
        self._client = self._client_factory()
        self._state = self._state_factory()
        self._metrics = default_metrics()
        self._readers: dict = {}

    def _reader(self, partition: StreamPartition) -> PartitionReader:
        reader = self._readers.get(partition)
        if reader is None:
            reader = self._readers[partition] = PartitionReader(
                self._client, partition, self._options, self._state.load_checkpoints, self._metrics)
        return reader

    @beam.DoFn.unbounded_per_element()
    def process(
        self,
        partition: StreamPartition,
        tracker=beam.DoFn.RestrictionParam(PartitionRestrictionProvider()),
        watermark=beam.DoFn.WatermarkEstimatorParam(_WalltimeProvider()),
    ):
        if tracker.current_restriction().done:
            return
        if self._lease is not None:
            self._lease.check()  # raises once the job's lease is lost: this process stops
        if stop_requested(self._options.stop_token):
            tracker.try_claim(ClaimEnd())
            return
        reader = self._reader(partition)
        result = yield from batch_records(reader.read_round(tracker))
        if result.stopped:
            return
        decision = reader.idle_decision(tracker, result)
        if decision == "end":
            log.info("partition %d/%d of %s idle for %ss: done", partition.index, partition.count,
                     partition.stream_arn, self._options.until_idle_s)
            tracker.try_claim(ClaimEnd())
            return
        self._tick_cutover(at_head=decision == "poll")
        if decision == "poll":
            if self._options.sleep_when_idle:
                # FnApiRunner ignores deferral delays; sleeping here keeps an idle
                # local job from spinning a core.
                time.sleep(self._options.poll_interval_s)
                tracker.defer_remainder(Duration.of(0))
            else:
                tracker.defer_remainder(Duration.of(self._options.poll_interval_s))
            return
        tracker.defer_remainder(Duration.of(0))

    def _tick_cutover(self, at_head: bool) -> None:
        """Let the cutover machine take its next step (the phase is the cutover
        module's to write): without a local controller — on Dataflow, or next to a
        separate batch backfill — the readers are what moves a migration on."""
        from ddb2bt.pipeline.cutover.bookkeeping import Bookkeeping
        from ddb2bt.pipeline.cutover.phases import Migration, advance

        now = time.monotonic()
        if now - getattr(self, "_phase_checked", -1e9) < PHASE_CHECK_S:
            return
        self._phase_checked = now
        spec = getattr(self._state_factory, "bigtable", None)
        if spec is None:  # a state store without a Bigtable target (tests)
            return
        try:
            if getattr(self, "_bookkeeping", None) is None:
                self._bookkeeping = Bookkeeping.for_target(spec.project, spec.instance)
            advance(Migration(self._state), self._bookkeeping, at_head, self._options.promote_live)
        except Exception as exc:  # the phase moves on at the next tick; reading must go on
            log.warning("cannot advance the migration phase (%s: %s)", type(exc).__name__, exc)

    def teardown(self) -> None:
        close = getattr(self._client, "close", None)
        if close:
            close()
        state = getattr(self, "_state", None)
        if state is not None:
            state.close()
