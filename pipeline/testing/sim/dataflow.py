"""Dataflow's runner as the simulation plays it, one bundle at a time on the
simulated clock: every partition's restriction is handed to a DoFn instance of
some worker when its deferral is due (usually where it ran last, sometimes any
other instance of any worker); work rebalancing splits a running bundle and
moves the residual to another worker; a bundle that fails in ``process`` or
after ``finish_bundle`` is retried from its restriction before the bundle, on
a new instance; workers are lost and come back; a drain ends every restriction.
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Optional

from ddb2bt.pipeline.testing.sim.clock import SimClock
from ddb2bt.pipeline.testing.sim.workers import SimTracker, SimWorker

__all__ = ["DataflowChaos", "InjectedFailure", "PartitionRun", "SimDataflow"]


@dataclass(frozen=True)
class DataflowChaos:
    workers: int = 3
    instances: int = 3  # DoFn instances (threads) per worker
    stickiness: float = 0.9  # a bundle runs on the instance its restriction's last bundle ran on
    rebalance_share: float = 0.02  # bundles split mid-way, the residual moved to another worker
    process_failure_share: float = 0.005  # bundles that fail in process (after some elements)
    finish_failure_share: float = 0.005  # bundles that fail after finish_bundle wrote (not committed)
    worker_losses_per_hour: float = 0.5  # across the job
    restart_s: float = 120.0
    retry_s: float = 5.0  # a failed bundle is retried after this
    # A bundle's own time on the runner: its partition's next bundle comes at least
    # this much later (without it a 0 s deferral spins). Only its partition waits:
    # other threads and workers run bundles meanwhile.
    bundle_s: float = 0.002


class InjectedFailure(Exception):
    """A failure the simulated runner injects into a bundle."""


@dataclass
class PartitionRun:
    """A partition's restriction as the runner holds it between bundles."""

    partition: object
    restriction: object
    ready_at: float = 0.0
    where: Optional[tuple] = None  # (worker, instance) of its last bundle
    bundles: int = 0
    failures: int = 0
    last_error: str = ""
    done: bool = False
    seq: int = field(default=0, compare=False)


class SimDataflow:
    """Runs ``runs`` (PartitionRun) on ``workers`` (SimWorker) under ``chaos``."""

    def __init__(self, clock: SimClock, rng: random.Random, chaos: DataflowChaos, workers: list, runs: list) -> None:
        self.clock, self.rng, self.chaos = clock, rng, chaos
        self.workers, self.runs = workers, runs
        self._queue: list = []
        self._seq = 0
        self.bundles = self.failures = self.rebalances = self.moves = self.dead_letters = 0
        self.errors: dict = {}  # error class -> count
        for run in runs:
            self._push(run, run.ready_at)

    def _push(self, run: PartitionRun, at: float) -> None:
        self._seq += 1
        run.ready_at = at
        heapq.heappush(self._queue, (at, self._seq, id(run), run))

    def next_at(self) -> float:
        return self._queue[0][0] if self._queue else float("inf")

    def _place(self, run: PartitionRun) -> tuple:
        alive = [w for w in self.workers if w.alive]
        if not alive:
            return None
        if run.where is not None and self.workers[run.where[0]].alive and self.rng.random() < self.chaos.stickiness:
            return run.where
        worker = self.rng.choice(alive)
        where = (worker.number, self.rng.randrange(len(worker.instances)))
        if run.where is not None and where != run.where:
            self.moves += 1
        return where

    def step(self) -> None:
        """Runs the bundle that is due first."""
        _, _, _, run = heapq.heappop(self._queue)
        self.clock.advance_to(run.ready_at)
        where = self._place(run)
        if where is None:  # every worker down: wait for one
            self._push(run, min(w.down_until for w in self.workers))
            return
        self._bundle(run, *where)

    def _bundle(self, run: PartitionRun, w: int, i: int) -> None:
        chaos, rng, worker = self.chaos, self.rng, self.workers[w]
        run.where, run.bundles = (w, i), run.bundles + 1
        self.bundles += 1
        fail_at = rng.randrange(1, 4) if rng.random() < chaos.process_failure_share else None
        split_at = rng.randrange(1, 4) if rng.random() < chaos.rebalance_share else None
        fail_after_finish = rng.random() < chaos.finish_failure_share
        tracker = SimTracker(run.restriction)
        try:
            instance = worker.instance(i)
            with worker.active():
                n = 0
                for element in instance.reader.process(run.partition, tracker=tracker):
                    n += 1
                    self.dead_letters += len(instance.sink.add(element))
                    if n == split_at and tracker.split_now():
                        self.rebalances += 1
                    if n == fail_at:
                        raise InjectedFailure("in process")
                if fail_at is not None:  # a bundle of fewer elements fails at its end
                    raise InjectedFailure("in process")
                self.dead_letters += len(instance.sink.finish())
                if fail_after_finish:
                    raise InjectedFailure("after finish_bundle")
                residual, delay = tracker.end_of_call()
        except Exception as exc:  # the runner retries the bundle, from where it began
            self._failed(run, w, i, exc)
            return
        if residual is None:
            run.done = True
            return
        run.restriction = residual
        if tracker.moved:  # the residual goes to another worker, at once
            others = [x for x in self.workers if x.alive and x.number != w] or [worker]
            other = rng.choice(others)
            run.where = (other.number, rng.randrange(len(other.instances)))
        self._push(run, self.clock.now_s + max(delay, chaos.bundle_s))

    def _failed(self, run: PartitionRun, w: int, i: int, exc: BaseException) -> None:
        self.failures += 1
        run.failures += 1
        name = type(exc).__name__
        self.errors[name] = self.errors.get(name, 0) + 1
        run.last_error = f"{name}: {exc}"[:300]
        self.workers[w].discard(i)
        run.where = None  # retried on any instance
        self._push(run, self.clock.now_s + self.chaos.retry_s)

    def lose_worker(self) -> Optional[int]:
        alive = [w for w in self.workers if w.alive]
        if len(alive) < 2:
            return None
        worker = self.rng.choice(alive)
        worker.lose(self.chaos.restart_s)
        return worker.number

    def restart_due(self) -> None:
        for worker in self.workers:
            if not worker.alive and worker.down_until <= self.clock.now_s:
                worker.restart()

    def drain(self) -> None:
        """Every restriction ends (the reading DoFn's truncate: nothing more is
        read); what the last bundles wrote is flushed and checkpointed."""
        for worker in self.workers:
            for i, inst in enumerate(worker.instances):
                if inst is not None:
                    worker.discard(i)
        self._queue.clear()
