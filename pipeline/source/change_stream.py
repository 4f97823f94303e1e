"""The Beam reader of a Bigtable table's change stream: ``ReadBigtableChanges``
outputs one ``RowChange`` per committed change (commit time as its event time).

One splittable DoFn element per table. Its restriction is the table's frontier
(every partition's continuation tokens and low watermark, ``Frontier`` of
``clients/bigtable/changestream.py``; the least mark is the output's watermark): each call reads every partition up to
the present (a bounded ReadChangeStream each, retried by the client policy
from the partition's last token), claims the new frontier, outputs the changes
and defers the rest, so a runner checkpoints between calls. Splits and merges
are followed: a closed partition's new partitions are read from the tokens its
CloseStream gave.

With ``state`` (a factory of the job's StateStore, e.g. a ``StateSpec``), the
frontier a call starts from is saved in the job's state table first: it
covers only changes output by earlier calls, which the runner has committed
with their checkpoint. A new job (a restart after SIGKILL) resumes from the
saved frontier, so it reads again at most what the last call read: the
delivery is at least once, and a consumer must make a replayed change harmless
(the way back writes to DynamoDB conditionally on the version it replaces).
Without a saved frontier the job starts at ``start_time_us`` (None: now).

``until_idle_s`` ends the read once no change arrived for that long (tests,
a catch-up); without it the read follows the stream for ever, a call every
``poll_s`` when it is quiet.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import apache_beam as beam
from apache_beam.io.watermark_estimators import ManualWatermarkEstimator
from apache_beam.transforms.core import RestrictionProvider
from apache_beam.utils.timestamp import Duration, Timestamp

from ddb2bt.pipeline.clients.bigtable.changestream import (ChangeStreamClient, Frontier, data_api_client,
                                                          initial_frontier, read_pass, table_name)
from ddb2bt.pipeline.clients.bigtable.channel import close_bounded
from ddb2bt.pipeline.source.restriction import CheckpointOnlyTracker

log = logging.getLogger(__name__)

US_PER_S = 1_000_000
DEFAULT_POLL_S = 1.0
# The state-table meta row a table's frontier is saved under (one per job and table).
FRONTIER_META = "change-stream-frontier:"


def wall_clock_us() -> int:
    return int(time.time() * US_PER_S)


def frontier_meta(table: str) -> str:
    return FRONTIER_META + table


@dataclass(frozen=True)
class ChangeRestriction:
    """What is left to read of one table's change stream: from ``frontier``
    (its JSON; empty before the first call); ``idle_since_us``: wall time since
    which no change arrived."""

    frontier: str = ""
    idle_since_us: int = 0
    done: bool = False


def _apply(restriction: ChangeRestriction, claim: ChangeRestriction) -> ChangeRestriction:
    return claim


class ChangeTracker(CheckpointOnlyTracker):
    """Checkpoints only: one table's partitions are read by one call at a time
    (per-row order across a split: a parent is read to its end before its halves)."""

    bounded = False
    what = "change-stream restriction"

    def __init__(self, restriction: ChangeRestriction) -> None:
        super().__init__(restriction, _apply)


class ChangeRestrictionProvider(RestrictionProvider):
    def initial_restriction(self, element) -> ChangeRestriction:
        return ChangeRestriction()

    def create_tracker(self, restriction: ChangeRestriction) -> ChangeTracker:
        return ChangeTracker(restriction)

    def restriction_size(self, element, restriction) -> int:
        return 1

    def split(self, element, restriction):
        yield restriction

    def truncate(self, element, restriction):
        return None  # drain: stop; the saved frontier resumes a later job


class ReadChangesFn(beam.DoFn):
    """Reads one table's change stream (the element: its full name)."""

    def __init__(self, app_profile: Optional[str], start_time_us: Optional[int], state: Optional[Callable],
                 until_idle_s: Optional[float], poll_s: float = DEFAULT_POLL_S,
                 wall_us: Optional[Callable[[], int]] = None) -> None:
        self._app_profile, self._start_time_us = app_profile, start_time_us
        self._state_factory, self._until_idle_s, self._poll_s = state, until_idle_s, poll_s
        self._wall_us = wall_us or wall_clock_us

    def setup(self) -> None:
        self._api = data_api_client()
        self._state = self._state_factory() if self._state_factory is not None else None

    def teardown(self) -> None:
        close_bounded(self._api.transport.close, "Bigtable data-API client")
        if self._state is not None:
            self._state.close()

    def _frontier(self, stream: ChangeStreamClient, restriction: ChangeRestriction) -> Frontier:
        if restriction.frontier:
            return Frontier.from_json(restriction.frontier)
        saved = self._state.load_meta(frontier_meta(stream.table)) if self._state is not None else None
        if saved:
            log.info("change stream of %s: resuming from the saved frontier", stream.table)
            return Frontier.from_json(saved)
        start = self._start_time_us if self._start_time_us is not None else self._wall_us()
        return initial_frontier(stream, start)

    def process(self, table: str, tracker=beam.DoFn.RestrictionParam(ChangeRestrictionProvider()),
                watermark=beam.DoFn.WatermarkEstimatorParam(ManualWatermarkEstimator.default_provider())):
        restriction = tracker.current_restriction()
        stream = ChangeStreamClient(self._api, table, self._app_profile)
        frontier = self._frontier(stream, restriction)
        if self._state is not None:  # what earlier calls output, and the runner committed
            self._state.save_meta(frontier_meta(table), frontier.to_json())
        now = self._wall_us()
        changes = read_pass(stream, frontier, now)
        idle_since = now if changes or not restriction.idle_since_us else restriction.idle_since_us
        done = (self._until_idle_s is not None and not changes
                and now - idle_since >= self._until_idle_s * US_PER_S)
        if not tracker.try_claim(ChangeRestriction(frontier.to_json(), idle_since, done)):
            return
        for change in changes:
            yield beam.window.TimestampedValue(change, Timestamp(micros=change.commit_time_us))
        low = frontier.low_watermark_us()
        current = watermark.current_watermark()
        if low is not None and (current is None or Timestamp(micros=low) > current):
            watermark.set_watermark(Timestamp(micros=low))  # the partitions' least mark (heartbeats, finished reads)
        if done:
            if self._state is not None:
                self._state.save_meta(frontier_meta(table), frontier.to_json())
            return
        if not changes:
            time.sleep(self._poll_s)  # local runners ignore the deferral's delay: no spinning core
        tracker.defer_remainder(Duration.of(self._poll_s))


class ReadBigtableChanges(beam.PTransform):
    """Every change to a Bigtable table, from its change stream, as ``RowChange``."""

    def __init__(self, project: str, instance: str, table: str, app_profile: Optional[str] = None,
                 start_time_us: Optional[int] = None, state: Optional[Callable] = None,
                 until_idle_s: Optional[float] = None, poll_s: float = DEFAULT_POLL_S) -> None:
        super().__init__()
        self._table = table_name(project, instance, table)
        self._fn = ReadChangesFn(app_profile, start_time_us, state, until_idle_s, poll_s)

    def expand(self, pbegin):
        return (pbegin
                | "Table" >> beam.Create([self._table])
                | "ReadChangeStream" >> beam.ParDo(self._fn))
