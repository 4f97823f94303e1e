"""The job's leases in the simulation: the product's own ``Lease`` and
``PartitionLease`` (control/lease.py, control/partitions.py), their cells in
the simulated Bigtable's state table, and their heartbeats run by the
simulation on its clock instead of a thread each (``SimHeartbeats``): every
``renew_s`` the heartbeat's step — released when idle, else renewed — runs in
its worker's process. A lost worker's heartbeats stop with it: its leases run
out, as a dead VM's do."""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Optional

from ddb2bt.pipeline.control.lease import (DATAFLOW_START_GRACE_S, FAIL, Heartbeat, Lease, LeaseCell, LeaseSpec,
                                           dataflow_holder)
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.control.coordinator import HOLD_RETRY_INITIAL_S, HOLD_RETRY_MAX_BACKOFF_S
from ddb2bt.pipeline.testing.sim.clock import SimClock

__all__ = ["SimBigtableSpec", "SimHeartbeats", "job_lease"]

# Where the product makes a lease's cell (a gRPC writer): the simulation's instead.
CELL_MAKERS = ("ddb2bt.pipeline.control.lease", "ddb2bt.pipeline.control.coordinator",
               "ddb2bt.pipeline.control.partitions")


@dataclass(frozen=True)
class SimBigtableSpec:
    """What a LeaseSpec names as its Bigtable (only named: the cells are the simulation's)."""

    project: str = "sim"
    instance: str = "sim"
    app_profile: Optional[str] = None
    deadline_s: float = 60.0


@dataclass
class Beat:
    lease: Lease
    stop: object
    worker: object
    next_s: float


class SimHeartbeats:
    """Every lease's heartbeat, on the simulated clock (see the module docstring)."""

    def __init__(self, clock: SimClock, bigtable) -> None:
        self.clock, self.bigtable = clock, bigtable
        self.beats: list = []
        self.current = None  # the worker whose code runs now (set by SimWorker.active)
        self.released_idle = 0
        self._running = False
        clock.while_asleep.append(self.run_due)  # a heartbeat thread runs while a bundle waits

    def cell(self, spec: LeaseSpec) -> LeaseCell:
        return LeaseCell(self.bigtable, spec.table, spec.row_key, "Bigtable (simulated)")

    @contextlib.contextmanager
    def installed(self):
        """Leases' cells and heartbeats are the simulation's while inside."""
        saved = []
        for name in CELL_MAKERS:
            module = importlib.import_module(name)
            saved.append((module, "lease_cell", module.lease_cell))
            module.lease_cell = self.cell
        saved.append((Heartbeat, "start", Heartbeat.start))
        beats = self

        def start(heartbeat) -> bool:
            if getattr(heartbeat, "sim_started", False):
                return False
            heartbeat.sim_started = True
            lease = heartbeat._lease  # the heartbeat's own lease and stop event
            beats.beats.append(Beat(lease, heartbeat._stop, beats.current, beats.clock.now_s + lease.spec.renew_s))
            return True

        Heartbeat.start = start
        try:
            yield self
        finally:
            for target, attribute, value in reversed(saved):
                setattr(target, attribute, value)

    def next_at(self) -> float:
        return min((b.next_s for b in self.beats), default=float("inf"))

    def run_due(self) -> None:
        """The heartbeats' steps that are due (the step of Heartbeat's thread)."""
        if self._running:  # a renewal's own call waits: the other heartbeats wait for the next turn
            return
        self._running = True
        try:
            self._run_due()
        finally:
            self._running = False

    def _run_due(self) -> None:
        now = self.clock.now_s
        for beat in [b for b in self.beats if b.next_s <= now]:
            worker, lease = beat.worker, beat.lease
            if beat.stop.is_set() or (worker is not None and not worker.alive) or lease.lost:
                self.beats.remove(beat)
                continue
            with (worker.active() if worker is not None else contextlib.nullcontext()):
                if lease.idle():
                    lease.release()
                    self.released_idle += 1
                    self.beats.remove(beat)
                    continue
                ok = lease.renew()
            if lease.lost:
                self.beats.remove(beat)
                continue
            beat.next_s = self.clock.now_s + (lease.spec.renew_s if ok else min(1.0, lease.spec.renew_s))

    def forget(self, worker) -> None:
        """A lost worker's heartbeats are gone with it."""
        self.beats = [b for b in self.beats if b.worker is not worker]


def job_lease(heartbeats: SimHeartbeats, state_table: str, job: str, role: str = "tail") -> LeaseSpec:
    """What the launcher does on Dataflow: take the job's lease for the job (with
    its start-up grace) and hand it to the workers; the spec the DoFns fence with."""
    spec = LeaseSpec(SimBigtableSpec(), state_table, job, role, dataflow_holder(job), shared=True, give_up_s=60.0)
    lease = Lease(spec, heartbeats.cell(spec), command="run")
    # retried as the launcher retries it (coordinator.hold): Bigtable may refuse a call here too
    retry = RetryPolicy(initial_s=HOLD_RETRY_INITIAL_S, max_backoff_s=HOLD_RETRY_MAX_BACKOFF_S, deadline_s=60.0)
    lease.acquire(FAIL, ttl_s=spec.ttl_s + DATAFLOW_START_GRACE_S, heartbeat=False, retry=retry)
    lease.detach()
    return spec
