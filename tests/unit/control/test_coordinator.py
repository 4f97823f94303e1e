"""The coordinator: one per job in each process, the one home of its ownership
state (issue 32). Two jobs in one process keep apart what they own, and no other
module keeps ownership state of the process."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddb2bt.pipeline.clients.bigtable.errors import EntryStatus
from ddb2bt.pipeline.clients.retry import RetryPolicy, retrying
from ddb2bt.pipeline.control.coordinator import Coordinator, JobKey, coordinator_for
from ddb2bt.pipeline.control.lease import Lease, LeaseCell, LeaseLost, LeaseSpec
from ddb2bt.pipeline.control.partitions import PartitionOwners
from ddb2bt.pipeline.control.state import BigtableStateBackend, StateStore
from ddb2bt.pipeline.source.stream_source import StreamPartition
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.errors import RetryableError
from tests.unit.control.test_lease import World  # one simulated time line for every lease test

ROOT = Path(__file__).resolve().parents[3]
TTL, RENEW = 20.0, 5.0
STREAM_A = "arn:aws:dynamodb:r:1:table/A/stream/x"
STREAM_B = "arn:aws:dynamodb:r:1:table/B/stream/x"


@dataclass(frozen=True)
class Bt:  # a BigtableSpec stand-in: only the key fields are read
    project: str = "p"
    instance: str = "i"
    app_profile: str = None


@dataclass(frozen=True)
class State:  # a StateSpec stand-in: which job, where its state lives
    job: str
    bigtable: Bt = Bt()
    table: str = "state"


def job(world, bt, name: str, shared: bool = False):
    """A coordinator of job ``name`` holding its tail lease (renewed by hand)."""
    spec = LeaseSpec(Bt(), "state", name, "tail", f"dataflow:{name}" if shared else f"run:{name}", TTL, 3600.0,
                     shared=shared)
    lease = Lease(spec, LeaseCell(bt, "state", spec.row_key), command="run", wall=world.wall, clock=world.clock,
                  sleep=world.sleep, node="vm1")
    lease.acquire(heartbeat=False)
    lease.active = True  # as with its heartbeat running: check_held looks at it
    coordinator = Coordinator(JobKey.of(State(name)), State(name), partitions=PartitionOwners(
        lambda s: LeaseCell(bt, "state", s.row_key), worker="worker:w1", heartbeat=False,
        wall=world.wall, clock=world.clock, sleep=world.sleep, node="vm1"))
    coordinator.register(lease)
    coordinator._readers_lease = lease  # as join_readers does with the lease this process holds
    return coordinator, lease


def take_over(world, bt, lease: Lease) -> None:
    """Another process takes ``lease`` over: its next renewal finds out."""
    rival = Lease(LeaseSpec(Bt(), "state", lease.spec.job, "tail", "run:rival", TTL, RENEW), LeaseCell(
        bt, "state", lease.spec.row_key), command="run", wall=world.wall, clock=world.clock, sleep=world.sleep,
        node="vm9")
    rival.try_acquire(take_over=True)
    assert not lease.renew()


def test_two_jobs_in_one_process_do_not_share_ownership():
    world, bt = World(), InMemoryBigtable()
    a, a_lease = job(world, bt, "a", shared=True)
    b, b_lease = job(world, bt, "b", shared=True)
    assert a.holders() == {"dataflow:a"} and b.holders() == {"dataflow:b"}

    # Partition 0 of each job's stream: claimed by each job's own coordinator only.
    assert a.may_read(StreamPartition(STREAM_A, 0, 2))
    assert a.partitions.held(STREAM_A, 0) is not None and b.partitions.held(STREAM_A, 0) is None
    assert b.may_read(StreamPartition(STREAM_B, 0, 2))
    assert a.partitions.held(STREAM_B, 0) is None

    # Job a loses its lease: a's readers and retry loops are told, b's go on.
    take_over(world, bt, a_lease)
    with pytest.raises(LeaseLost):
        a.check_held()
    with pytest.raises(LeaseLost):
        a.may_read(StreamPartition(STREAM_A, 1, 2))
    b.check_held()
    assert b.may_read(StreamPartition(STREAM_B, 1, 2))

    calls = []

    def failing():
        calls.append(1)
        raise RetryableError("unavailable")

    policy = RetryPolicy(0.1, 1.0, 60.0)
    with pytest.raises(LeaseLost):  # a's loop ends at the first retry ...
        retrying(policy, "a", sleep=world.sleep, clock=world.clock, between_attempts=a.check_held)(failing)
    assert len(calls) == 1
    with pytest.raises(RetryableError, match="gave up"):  # ... b's runs to its deadline
        retrying(policy, "b", sleep=world.sleep, clock=world.clock, between_attempts=b.check_held)(failing)
    assert len(calls) > 10

    # A keeper each: a's stops when its last stream is done, b's keeps running.
    started = []
    for coordinator in (a, b):
        coordinator._keeper_factory = lambda promote_live: started.append(Keeper()) or started[-1]
        assert coordinator.use_keeper(True)
    a.release_keeper()
    assert started[0].stopped and not started[1].stopped
    b.release_keeper()


class Keeper:  # a CutoverKeeper stand-in: what release_keeper does to it
    stopped = False

    def step(self):
        return None

    def stop(self):
        self.stopped = True


def test_a_state_store_a_coordinator_guards_stops_retrying_once_the_lease_is_lost():
    """The readers' and the sink's state calls are retried for up to the
    deadline; once the job's lease is lost they stop at the next retry (a `run`
    whose Bigtable died stops when its lease lapses, not a deadline later)."""
    world, bt = World(), InMemoryBigtable()
    a, lease = job(world, bt, "a")
    unavailable = InMemoryBigtable(fault=lambda table, entries, n: [EntryStatus(14, "unavailable")] * len(entries))
    store = a.guard(StateStore(BigtableStateBackend(unavailable, "p", "i", "state", deadline_s=3600.0), "a",
                               world.wall))
    take_over(world, bt, lease)
    with pytest.raises(LeaseLost):
        store.save_meta("phase", "LIVE")
    assert unavailable.calls and len(unavailable.calls) == 1  # one attempt, then told


def test_a_process_finds_each_jobs_coordinator_again_by_its_key():
    a, b = State("job-a"), State("job-b")
    assert coordinator_for(a) is coordinator_for(State("job-a"))  # each DoFn of job a: the same one
    assert coordinator_for(a) is not coordinator_for(b)
    lease_spec = LeaseSpec(Bt(), "state", "job-a", "tail", "run:x")
    assert coordinator_for(lease_spec) is coordinator_for(a)  # the lease's job is the state's job


def test_a_released_lease_is_forgotten_by_its_coordinator():
    world, bt = World(), InMemoryBigtable()
    a, lease = job(world, bt, "a")
    assert a.held(lease.spec) is lease
    lease.release()
    assert a.held(lease.spec) is None and a.holders() == set()


# Module-level names of per-process ownership state, by what they hold.
OWNERSHIP_TYPES = {"Lease", "PartitionOwners", "PartitionLease", "CutoverKeeper", "Coordinator"}
OWNERSHIP_WORDS = ("LEASE", "OWNER", "KEEPER", "REGISTRY", "COORDINATOR", "BETWEEN_ATTEMPTS")


def module_state(source: str) -> list:
    """Module-level assignments that hold ownership state: an instance of an
    ownership class, or a mutable container named for one."""
    found = []
    for node in ast.parse(source).body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        value = node.value
        called = value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else None
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set)) or called in ("dict", "list", "set")
        for name in names:
            if called in OWNERSHIP_TYPES or (mutable and any(w in name.upper() for w in OWNERSHIP_WORDS)):
                found.append(name)
    return found


def test_exactly_one_module_holds_the_process_ownership_state():
    holders = {}
    for folder in ("pipeline", "transforms"):
        for path in (ROOT / folder).rglob("*.py"):
            found = module_state(path.read_text())
            if found:
                holders[str(path.relative_to(ROOT))] = found
    assert holders == {"pipeline/control/coordinator.py": ["_COORDINATORS"]}


def test_the_ownership_state_check_can_fail():
    assert module_state("_REGISTRY: dict = {}\nOWNERS = PartitionOwners()\n_KEEPERS = dict()\n") == [
        "_REGISTRY", "OWNERS", "_KEEPERS"]
    assert module_state("BETWEEN_ATTEMPTS: list = []\nTAIL = 'tail'\n") == ["BETWEEN_ATTEMPTS"]
