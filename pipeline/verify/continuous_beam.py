"""The continuous check as a branch of the streaming job, so it runs where the
job runs (Dataflow workers):

  CheckTicks (PeriodicImpulse, one tick per STEP_INTERVAL_S) → CheckStep (one
  ContinuousCheck step of the read budget's worth of items)

per table, next to ``ReplicateToBigtable`` and joined to it by nothing: the
ordered path ReadStream → WriteToBigtable keeps no shuffle (docs/design.md
§4.3). Where the check stands lives in the state table (``StoredPosition``), not
in the worker, so a restarted or rebalanced worker goes on from there; the
counts reach Prometheus through the Pushgateway when the job pushes, and the
Beam metrics (Dataflow's UI) always.

The local FnApiRunner runs the check as a thread instead
(``continuous.start_continuous_check``): it ignores a deferred restriction's
resume time, so PeriodicImpulse spins a core between ticks, and a
PeriodicImpulse never ends, so a local ``run --until-idle`` would never finish.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Sequence

import apache_beam as beam
from apache_beam.transforms.periodicsequence import PeriodicImpulse, RebaseMode
from apache_beam.utils.timestamp import Timestamp

from ddb2bt.pipeline.verify.continuous import (STEP_INTERVAL_S, ContinuousCheck, ContinuousOptions, connect_check,
                                                step_items)
from ddb2bt.pipeline.observe.metrics import start_pusher

__all__ = ["CheckContinuously"]

log = logging.getLogger(__name__)

# A tick older than this many intervals is dropped, not caught up: after a long
# step (a slow tail wait) or a worker restart the backlog of ticks would
# otherwise run back to back, over the read budget.
LATE_TICKS = 2


def _connect(job, options: ContinuousOptions) -> ContinuousCheck:
    """The check of a LiveJob's table against the real services."""
    return connect_check(job.mapping, job.state.store(), options, job.stream_arn, job.client_factory)


class _ContinuousCheckStepFn(beam.DoFn):
    """One tick → one step of ``job``'s check (``items`` items at most). A step
    that fails is logged and the next tick tries again: the check never fails
    the job nor holds the replication up. Clients are made in setup().
    ``pusher``: (Pushgateway URL, job) of the process's one metrics pusher — the
    sink's own (the first table's), so no series is pushed twice."""

    def __init__(self, job, options: ContinuousOptions, items: int, interval_s: float,
                 connect: Callable = _connect, wall_s: Callable[[], float] = time.time,
                 pusher: Optional[tuple] = None) -> None:
        self._job, self._options, self._items, self._interval_s = job, options, items, interval_s
        self._connect, self._wall_s, self._pusher = connect, wall_s, pusher
        self._check: Optional[ContinuousCheck] = None

    def setup(self) -> None:
        if self._pusher is not None:  # Dataflow workers cannot be scraped: they push

            url, job = self._pusher
            start_pusher(url, job=job)
        self._check = self._connect(self._job, self._options)

    def process(self, tick):
        at_s = tick.micros / 1e6 if isinstance(tick, Timestamp) else float(tick)
        late_s = self._wall_s() - at_s
        if late_s > LATE_TICKS * self._interval_s:
            log.debug("continuous check of %s: tick %.0f s late, skipped", self._job.name, late_s)
            return
        try:
            checked = self._check.step(self._items)
        except Exception as exc:  # noqa: BLE001 — logged; the next tick retries, the tail goes on
            log.warning("continuous check step of %s failed (%s: %s); the next tick retries", self._job.name,
                        type(exc).__name__, exc)
            return
        yield checked

    def teardown(self) -> None:
        store = getattr(self._check, "store", None)
        close = getattr(store, "close", None)
        if close is not None:
            close()


class CheckContinuously(beam.PTransform):
    """PBegin → PCollection of ints (items checked per step): every table of
    ``jobs`` (``LiveJob``s, as ``ReplicateToBigtable.from_jobs`` takes them)
    checked continuously, ``options.items_per_s`` items a second, one step
    every ``interval_s`` seconds (``verify/continuous.py``). Apply it to the
    same pipeline as the replication of those jobs; it adds a branch of its own
    per table (``ContinuousCheck[name]``) and touches nothing of theirs."""

    def __init__(self, jobs: Sequence, options: ContinuousOptions, *, interval_s: float = STEP_INTERVAL_S,
                 connect: Callable = _connect) -> None:
        super().__init__()
        if not jobs:
            raise ValueError("CheckContinuously needs at least one job")
        if not isinstance(options, ContinuousOptions):
            raise TypeError(f"options must be a ContinuousOptions, got {type(options).__name__}")
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        self._jobs, self._options, self._interval_s = tuple(jobs), options, interval_s
        self._connect = connect

    def expand(self, pbegin):
        items = step_items(self._options, self._interval_s)
        first = self._jobs[0]  # whose pusher the sink starts (WriteToBigtableOrdered._of_jobs)
        pusher = (first.pushgateway, f"ddb2bt-{first.name}") if getattr(first, "pushgateway", None) else None
        outputs = [pbegin | f"ContinuousCheck[{job.name}]" >> _CheckTable(
            _ContinuousCheckStepFn(job, self._options, items, self._interval_s, self._connect, pusher=pusher),
            self._interval_s) for job in self._jobs]
        return outputs[0] if len(outputs) == 1 else tuple(outputs) | "MergeCheckSteps" >> beam.Flatten()


class _CheckTable(beam.PTransform):
    """One table's branch: ticks, and a step per tick."""

    def __init__(self, fn: _ContinuousCheckStepFn, interval_s: float) -> None:
        super().__init__()
        self._fn, self._interval_s = fn, interval_s

    def expand(self, pbegin):
        # Ticks from when the job starts (REBASE_START), not from when its graph
        # was built (a Flex Template launch starts the job minutes later).
        return (pbegin
                | "CheckTicks" >> PeriodicImpulse(fire_interval=self._interval_s, rebase=RebaseMode.REBASE_START)
                | "CheckStep" >> beam.ParDo(self._fn).with_output_types(int))
