"""One coordinator per job and stream in each process: the one home of this
process's ownership state.

Modelled on the Kinesis Client Library, where a lease coordinator takes, renews
and drops leases and a record processor owns only records and is *told* when it
lost its lease. Here the readers (``source/``) and the sink (``sink/``) own
nothing; they only ask their job's coordinator:

* ``may_read(partition)``: before a reading round. False while the partition is
  not this process's to read (another worker of a shared job holds it, or the
  lease is unproven: a blip, a pause); raises ``LeaseLost`` when the job's lease
  is lost for good (the reader is told: it stops).
* ``reading(partition)``: while a round runs, its partition's lease is in use.
* ``report(partition, report)``: where a partition is (its catch-up report), for
  the cutover keeper, which moves the migration on (``keeper.py``).
* ``fence(writer, spec)``, ``partition_fence(spec)``: the sink's writer with every
  write checked against the lease first, and the check that this process owns
  the partitions of what it writes and checkpoints.
* ``marking()``: whether touch markers are needed now (a backfill may run); the
  sink never reads the phase itself.
* ``check_held``: passed to retry loops as their between-attempts check, so no
  retry loop outlives a lost lease.

What it holds: the job's leases this process holds or joined (``lease.py``), the
partition leases of a shared job (``partitions.py``) and the cutover keeper
(``keeper.py``). A job's state follows one stream (a job of several tables is one
job per table, each with its own stream), so one coordinator per job is one per
(job, stream). The process's coordinators are found again by the DoFns through
``coordinator_for`` (a DoFn is pickled; its coordinator is not): this module's
directory is the only per-process ownership state (tests/unit/project/test_house.py).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

from ddb2bt.pipeline.clients.retry import DEFAULT_DEADLINE_S, RetryPolicy
from ddb2bt.pipeline.control.keeper import CutoverKeeper
from ddb2bt.pipeline.control.lease import (DATAFLOW_START_GRACE_S, Lease, LeaseLost, LeaseOptions, LeaseSpec,
                                           LeaseUnproven, dataflow_holder, fence as fence_writer, lease_cell)
from ddb2bt.pipeline.control.partitions import PartitionOwners
from ddb2bt.pipeline.control.phases import backfill_may_run
from ddb2bt.pipeline.control.markers import Bookkeeping

log = logging.getLogger(__name__)

# A command's lease calls retry with these (failures logged, bounded by the job's
# --bigtable-deadline): quick first retries for a blip, capped so a standby does
# not wait long past a free lease.
HOLD_RETRY_INITIAL_S = 0.2
HOLD_RETRY_MAX_BACKOFF_S = 5.0


@dataclass(frozen=True)
class JobKey:
    """Which job a coordinator is for: its state table and job name."""

    project: str
    instance: str
    table: str
    job: str

    @classmethod
    def of(cls, spec) -> "JobKey":
        """Of a StateSpec or a LeaseSpec (both name ``bigtable``, ``table``, ``job``)."""
        b = getattr(spec, "bigtable", None)  # tests' state stand-ins may name none
        return cls(getattr(b, "project", ""), getattr(b, "instance", ""), getattr(spec, "table", ""),
                   getattr(spec, "job", "") or "")


class Coordinator:
    """The ownership of one job in this process (see the module docstring).
    ``state_spec`` (a StateSpec) builds the state store it reads the phase from
    and its keeper's; ``partitions`` and ``keeper_factory`` are injected in tests."""

    def __init__(self, key: JobKey, state_spec=None, *, partitions: Optional[PartitionOwners] = None,
                 keeper_factory: Optional[Callable[[bool], Optional[CutoverKeeper]]] = None) -> None:
        self.key = key
        self._state_spec = state_spec
        self._lock = threading.Lock()
        # DoFns of one worker set up at once: one of them joins, the others find it.
        self._join_lock = threading.Lock()
        self._leases: dict = {}  # (role, holder) -> Lease held or joined by this process
        self._readers_lease: Optional[Lease] = None  # the lease the stream readers joined (the tail's)
        self.partitions = partitions or PartitionOwners()  # a shared job's partition leases
        self._keeper_factory = keeper_factory or self._default_keeper
        self._keeper: Optional[CutoverKeeper] = None
        self._keeper_users = 0  # stream contexts reporting to the keeper
        self._phase_store = None  # built on first use, for marking()

    # -- the leases --------------------------------------------------------------
    def holders(self) -> set:
        return {holder for _, holder in list(self._leases)}

    def register(self, lease: Lease) -> Lease:
        """A lease this process holds: found again by ``join`` and checked by ``check_held``."""
        with self._lock:
            self._leases[(lease.spec.role, lease.spec.holder)] = lease
        lease.on_release = self._forget
        return lease

    def _forget(self, lease: Lease) -> None:
        with self._lock:
            key = (lease.spec.role, lease.spec.holder)
            if self._leases.get(key) is lease:
                del self._leases[key]

    def held(self, spec: LeaseSpec) -> Optional[Lease]:
        return self._leases.get((spec.role, spec.holder))

    def join(self, spec: Optional[LeaseSpec]) -> Optional[Lease]:
        """The lease a DoFn fences with: the one this process holds (local runs:
        the command took it), else joined as a worker of the job (Dataflow)."""
        if spec is None:
            return None
        with self._join_lock:
            return self._join(spec)

    def _join(self, spec: LeaseSpec) -> Lease:
        lease = self._leases.get((spec.role, spec.holder))
        if lease is not None and spec.shared and lease.lost:
            # A Dataflow worker's lease that was lost (taken over, or the cell
            # gone) is joined again by the next DoFn set up after the failed
            # bundles, as a new worker would: it holds again only if its job
            # still does (else LeaseLost, naming the holder).
            lease.release()  # gives nothing up (it holds nothing): forgotten here, closes its channel
            lease = None
        if lease is None:
            lease = Lease(spec, lease_cell(spec), command="worker", own_holders=process_holders)
            lease.join()
            self.register(lease)
        return lease

    def guard(self, store):
        """``store`` (a job's StateStore) with this coordinator's lease check run
        between the attempts of its retried calls."""
        check = getattr(store, "check_between_attempts", None)
        if check is not None:
            check(self.check_held)
        return store

    def check_held(self) -> None:
        """Every lease of this job this process holds must still be valid (raises
        LeaseLost): passed to retry loops as their between-attempts check."""
        for lease in list(self._leases.values()):
            if lease.active:
                try:
                    lease.check()
                except LeaseUnproven:
                    pass  # the retry loop goes on waiting; its own write re-checks

    # -- the readers -------------------------------------------------------------
    def join_readers(self, spec: Optional[LeaseSpec]) -> Optional[Lease]:
        """The stream readers' lease (the tail's), checked by ``may_read``."""
        self._readers_lease = self.join(spec)
        return self._readers_lease

    def may_read(self, partition) -> bool:
        """Whether this process may read ``partition`` (a StreamPartition) now.
        Raises LeaseLost once the job's lease is lost: the reader stops."""
        lease = self._readers_lease
        if lease is None:
            return True
        if lease.spec.shared:
            self.partitions.touch(partition.stream_arn, partition.index)
        try:
            lease.check()  # raises LeaseLost once the table's lease is lost: this process stops
        except LeaseUnproven:
            # Ownership unproven (a Bigtable blip, or this worker was paused):
            # read nothing until the heartbeat proves it again, then go on
            # without a restart (docs/design.md, "Ownership").
            return False
        if lease.spec.shared:
            # A worker of a shared (Dataflow) job reads a partition only while it
            # owns it: another worker may hold it (Dataflow moved the work, or
            # this worker was paused meanwhile).
            owner = self.partitions.claim(lease.spec, partition.stream_arn, partition.index, partition.count)
            if owner is None:
                return False
            try:
                owner.check()
            except (LeaseUnproven, LeaseLost):
                return False
        return True

    @contextlib.contextmanager
    def reading(self, partition):
        """A reading round of ``partition`` runs: while it does (it may back off
        on throttling for minutes) the partition's lease is in use, not idle."""
        lease = self._readers_lease
        if lease is None or not lease.spec.shared:
            yield
            return
        with self.partitions.round(partition.stream_arn, partition.index):
            yield

    def _partition_check(self, partition) -> Optional[Callable[[], object]]:
        """What proves this process still owns ``partition`` (None: no lease)."""
        lease = self._readers_lease
        if lease is None:
            return None
        if lease.spec.shared:
            return lambda: self.partitions.check_partition(partition.stream_arn, partition.index)
        return lease.check

    def use_keeper(self, promote_live: bool) -> bool:
        """A stream context reports to this job's keeper from now on (False: no
        keeper, a state store without a Bigtable target)."""
        with self._lock:
            if self._keeper is None:
                self._keeper = self._keeper_factory(promote_live)
            if self._keeper is None:
                return False
            self._keeper_users += 1
            return True

    def report(self, stream: str, partition, report, ended_idle: bool = False) -> None:
        """Where ``partition`` of ``stream`` (its label) is: a catch-up report,
        recorded by the keeper only while this process owns the partition."""
        keeper = self._keeper
        if keeper is not None:
            keeper.report(stream, partition.index, partition.count, report,
                          fence=self._partition_check(partition), ended_idle=ended_idle)

    def release_keeper(self) -> None:
        """A stream context is done with the keeper (DoFn teardown): the last one
        stops it, so a pipeline that ended leaves no thread behind."""
        with self._lock:
            keeper = self._keeper
            if keeper is None:
                return
            self._keeper_users -= 1
            if self._keeper_users > 0:
                return
            self._keeper = None
        # One last step with the readers' last reports: a tail that ends sooner than
        # a keeper step (`run --until-idle 5`) still moves a caught-up migration on.
        keeper.step()
        keeper.stop()

    def _default_keeper(self, promote_live: bool) -> Optional[CutoverKeeper]:
        bigtable = getattr(self._state_spec, "bigtable", None)
        if bigtable is None:
            return None

        state_spec = self._state_spec
        return CutoverKeeper(lambda: self.guard(state_spec()),
                             lambda: Bookkeeping.for_target(bigtable.project, bigtable.instance), promote_live)

    # -- the sink ----------------------------------------------------------------
    def fence(self, writer, spec: Optional[LeaseSpec]):
        """``writer`` with every write checked against the job's ``spec`` lease
        first: data writes, dead letters and checkpoints alike."""
        return fence_writer(writer, self.join(spec))

    def partition_fence(self, spec: Optional[LeaseSpec]) -> Optional[Callable]:
        """For a shared (Dataflow) job: the check that this process owns the
        partitions of ``positions`` ((stream_arn, shard_id) pairs) before it
        writes or checkpoints them; None otherwise."""
        return self.partitions.check if spec is not None and spec.shared else None

    def marking(self) -> bool:
        """Whether touch markers are needed now: a backfill may run (fail-safe:
        True when the phase cannot be read)."""
        if self._state_spec is None:
            return False
        try:
            with self._lock:
                if self._phase_store is None:
                    self._phase_store = self.guard(self._state_spec.store())
        except Exception:  # unreadable: fail safe
            return True
        return backfill_may_run(self._phase_store)

    def close(self) -> None:
        store, self._phase_store = self._phase_store, None
        if store is not None:
            store.close()


# --- this process's coordinators ---------------------------------------------------

_COORDINATORS: dict = {}  # JobKey -> Coordinator
_LOCK = threading.Lock()


def coordinator_for(spec, state_spec=None) -> Coordinator:
    """This process's coordinator of the job ``spec`` (a StateSpec or LeaseSpec)
    names; made on first use. ``state_spec`` (the job's StateSpec) tells it where
    the job's state lives, for its keeper and ``marking``."""
    key = JobKey.of(spec)
    with _LOCK:
        coordinator = _COORDINATORS.get(key)
        if coordinator is None:
            coordinator = _COORDINATORS[key] = Coordinator(key, state_spec)
        elif state_spec is not None:
            coordinator._state_spec = state_spec  # the same job's: the latest names where its state lives
        return coordinator


def process_holders() -> set:
    """The holders of every lease this process holds: a lease whose holder is this
    very process is free unless one of them holds it (lease.is_free)."""
    with _LOCK:
        coordinators = list(_COORDINATORS.values())
    return set().union(*(c.holders() for c in coordinators))


def join(spec: Optional[LeaseSpec]) -> Optional[Lease]:
    """The lease of ``spec`` this process holds or joins (None for no spec)."""
    return coordinator_for(spec).join(spec) if spec is not None else None


def hold(state_spec, role: str, options: LeaseOptions, *, command: str,
         dataflow_job: Optional[str] = None) -> tuple:
    """Take the job's ``role`` lease for a command: (Lease, LeaseSpec for the
    DoFns). Locally the lease is renewed by this process until ``release()``; for
    a Dataflow launch (``dataflow_job``) it is taken for the job with a start-up
    grace and handed over to the workers."""
    holder = dataflow_holder(dataflow_job) if dataflow_job else f"{command}:{uuid.uuid4().hex[:12]}"
    deadline = state_spec.bigtable.deadline_s
    spec = LeaseSpec(state_spec.bigtable, state_spec.table, state_spec.job, role, holder, options.ttl_s,
                     options.renew_s, shared=dataflow_job is not None,
                     give_up_s=deadline if deadline is not None else DEFAULT_DEADLINE_S)

    lease = Lease(spec, lease_cell(spec), command=command, own_holders=process_holders)
    retry = RetryPolicy(initial_s=HOLD_RETRY_INITIAL_S, max_backoff_s=HOLD_RETRY_MAX_BACKOFF_S, **(
        {"deadline_s": deadline} if deadline is not None else {}))
    if dataflow_job:
        lease.acquire(options.mode, ttl_s=options.ttl_s + DATAFLOW_START_GRACE_S, heartbeat=False, retry=retry)
        lease.detach()
        return lease, spec
    coordinator = coordinator_for(state_spec, state_spec)
    coordinator.register(lease)
    try:
        lease.acquire(options.mode, retry=retry, between_attempts=coordinator.check_held)
    except BaseException:
        lease.release()  # forgotten by its coordinator; closes its channel (it holds nothing to give up)
        raise
    return lease, spec


__all__ = ["Coordinator", "JobKey", "coordinator_for", "hold", "join", "process_holders"]
