"""The job lease on injected clocks and the in-memory Bigtable: one writer at a
time, whatever the pauses, races, renewal failures and take-overs."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from ddb2bt.pipeline.control.lease import (FAIL, STANDBY, TAKE_OVER, FencedWriter, Lease, LeaseCell, LeaseHeld, LeaseLost,
                                           LeaseOptions, LeaseSpec, LeaseState, LeaseUnproven, fence, margin_s)
from ddb2bt.pipeline.control.coordinator import Coordinator, JobKey
from ddb2bt.pipeline.control.partitions import (PARTITION_IDLE_RELEASE_S, PARTITION_ROUND_MAX_S, PartitionOwners,
                                                partition_index)
from ddb2bt.pipeline.clients.bigtable.errors import BigtableRetryable, EntryStatus
from ddb2bt.pipeline.sink.sink import BatchingWriter, SinkConfig
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.model import ChangeRecord, MappedChange, RowChange, SetCell, StreamPosition

TTL, RENEW = 20.0, 5.0


@dataclass
class Bt:  # a BigtableSpec stand-in: only the key fields are read
    project: str = "p"
    instance: str = "i"
    app_profile: str = None


class World:
    """One shared time line: wall clock (ms) and every process's boot-time clock."""

    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def wall(self) -> int:
        return int(self.t * 1000)

    def clock(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def make(world, bt, name, *, pid=None, node="nodeA", holder=None, alive=lambda pid: True, shared=False, ttl=TTL,
         renew=RENEW, give_up=300.0) -> Lease:
    spec = LeaseSpec(Bt(), "state", "job", "tail", holder or f"run:{name}", ttl, renew, shared=shared,
                     give_up_s=give_up)
    return Lease(spec, LeaseCell(bt, "state", spec.row_key), command="run", wall=world.wall, clock=world.clock,
                 sleep=world.sleep, host=f"host-{name}", pid=pid or abs(hash(name)) % 30000 + 2, node=node,
                 alive=alive)


def test_a_second_process_is_refused_with_the_holder_named():
    world, bt = World(), InMemoryBigtable()
    a, b = make(world, bt, "a", pid=4242), make(world, bt, "b")
    a.acquire(FAIL, heartbeat=False)
    with pytest.raises(LeaseHeld) as err:
        b.acquire(FAIL, heartbeat=False)
    msg = str(err.value)
    assert "host-a" in msg and "pid 4242" in msg and "started 2023-11-14" in msg
    assert "--take-over" in msg and "--standby" in msg
    assert a.check() == pytest.approx(TTL - margin_s(TTL))
    with pytest.raises(LeaseLost):
        b.check()


def test_racing_acquisitions_leave_exactly_one_holder():
    world, bt = World(), InMemoryBigtable()
    a, b = make(world, bt, "a"), make(world, bt, "b")
    # Both read "free" before either writes: the compare-and-set lets one win.
    stale = LeaseCell(bt, "state", a.spec.row_key)
    orig_read = stale.read
    reads = []

    def read_then_interleave():
        value = orig_read()
        if not reads:
            reads.append(value)
            assert b.try_acquire() is None  # b wins between a's read and a's swap
        return value

    a._cell.read = read_then_interleave
    other = a.try_acquire()
    assert other is not None and other.holder == b.spec.holder
    assert not a.holding and b.holding


def test_a_paused_holder_stops_before_the_standby_can_take_over():
    world, bt = World(), InMemoryBigtable()
    a, b = make(world, bt, "a"), make(world, bt, "b")
    a.acquire(heartbeat=False)
    for _ in range(3):
        world.sleep(RENEW)
        assert a.renew()
    last_renewal = world.t
    # a is SIGSTOPped: no renewals. b polls as a standby.
    taken_at = None
    while taken_at is None:
        world.sleep(1.0)
        if world.t < last_renewal + TTL - margin_s(TTL):
            assert a.check() > 0  # still a's: b cannot have it yet
        if b.try_acquire() is None:
            taken_at = world.t
    assert taken_at >= last_renewal + TTL
    # a resumes (SIGCONT): its own clock says the lease may be gone: no write.
    with pytest.raises(LeaseUnproven, match="paused"):
        a.check()
    assert not a.renew()  # the cell changed hands: lost for good
    with pytest.raises(LeaseLost):
        a.check()
    assert b.check() > 0


def test_random_schedules_never_let_two_processes_write_at_once():
    """Two processes with random pauses and renewal failures race for one lease;
    every successful fence check (a write) must belong to the process holding
    the cell at that instant, and the cell's holder must be the only one writing."""
    rng = random.Random(17)
    for trial in range(30):
        world = World()
        flaky = {"on": False}
        bt = InMemoryBigtable(fault=lambda t, e, n: [EntryStatus(14, "down")] if flaky["on"] else None)
        procs = [make(world, bt, n, node=f"node-{n}") for n in "ab"]
        paused_until = {p: 0.0 for p in procs}
        next_renew = {p: 0.0 for p in procs}
        writes = []
        for _ in range(400):
            world.sleep(rng.uniform(0.1, 1.5))
            flaky["on"] = rng.random() < 0.1
            for p in procs:
                if world.t < paused_until[p]:
                    continue
                if rng.random() < 0.03:
                    paused_until[p] = world.t + rng.uniform(5, 40)  # SIGSTOP / frozen VM
                    continue
                def renew_or_acquire():
                    if p.holding and world.t >= next_renew[p]:
                        try:
                            p.renew()
                        except BigtableRetryable:
                            pass
                        next_renew[p] = world.t + RENEW
                    elif p._raw is None:
                        try:
                            if p.try_acquire() is None:
                                next_renew[p] = world.t + RENEW
                        except BigtableRetryable:
                            pass

                def write():
                    try:
                        p.check()
                    except LeaseUnproven:
                        return
                    except LeaseLost:
                        if p._raw is not None and p._lost:
                            p._raw, p._lost = None, None  # a stopped process restarts (as a new run would)
                        return
                    cur = LeaseState.parse(bt.read_cell("state", p.spec.row_key, "meta", b"lease"))
                    writes.append((world.t, p.spec.holder, cur.holder))

                # After a pause the writer may run before the heartbeat, or after it.
                steps = [renew_or_acquire, write]
                rng.shuffle(steps)
                for step in steps:
                    step()
        assert writes, trial
        assert all(writer == holder for _, writer, holder in writes), trial


def test_take_over_waits_for_the_old_lease_and_the_old_holder_stops():
    world, bt = World(), InMemoryBigtable()
    a, b = make(world, bt, "a"), make(world, bt, "b")
    a.acquire(heartbeat=False)
    expiry = world.wall() + int(TTL * 1000)
    assert b.try_acquire(take_over=True) is None  # the swap is immediate...
    world.sleep(1.0)
    assert not a.renew()  # ...a's next renewal finds the lease taken
    with pytest.raises(LeaseLost, match="taken over"):
        a.check()
    b._sleep = lambda s: (world.sleep(s), b.renew())  # b's heartbeat, during its wait
    b.acquire(TAKE_OVER, heartbeat=False)  # ...and b writes only once a's lease has run out
    assert world.wall() >= expiry
    assert b.check() > 0


def test_standby_applies_nothing_until_the_holder_releases():
    world, bt = World(), InMemoryBigtable()
    a, b = make(world, bt, "a"), make(world, bt, "b")
    a.acquire(heartbeat=False)
    sleeps = []
    real_sleep = world.sleep

    def sleep(s):
        sleeps.append(s)
        if len(sleeps) == 3:
            a.release()
        real_sleep(s)

    b._sleep = sleep
    b.acquire(STANDBY, heartbeat=False)
    assert len(sleeps) == 3 and b.holding
    with pytest.raises(LeaseLost):
        a.check()


def test_a_dead_holder_on_this_machine_is_replaced_at_once():
    world, bt = World(), InMemoryBigtable()
    a = make(world, bt, "a", pid=111)
    a.acquire(heartbeat=False)
    b = make(world, bt, "b", pid=222, alive=lambda pid: pid != 111)  # a was SIGKILLed
    assert b.try_acquire() is None
    c = make(world, bt, "c", pid=333, node="another-machine", alive=lambda pid: False)
    assert c.try_acquire() is not None  # pids of other machines prove nothing


def held_until_failing(status):
    """A lease "a" held on a state table whose writes fail with ``status`` once
    the returned switch is on."""
    world = World()
    failing = {"on": False}
    bt = InMemoryBigtable(fault=lambda t, e, n: [status] if failing["on"] else None)
    a = make(world, bt, "a")
    a.acquire(heartbeat=False)
    return world, a, failing


def test_renewal_failures_stop_writes_after_ttl_minus_margin():
    world, a, down = held_until_failing(EntryStatus(14, "unavailable"))
    down["on"] = True
    start = world.t
    while True:
        world.sleep(1.0)
        assert not a.renew()
        try:
            a.check()
        except LeaseUnproven:
            break
    assert world.t - start == pytest.approx(TTL - margin_s(TTL), abs=1.0)


def test_a_renewal_that_fails_permanently_loses_the_lease_at_once():
    """The state table gone (NOT_FOUND) is no blip: the process stops at its
    next write instead of pausing for the give-up time."""
    world, a, gone = held_until_failing(EntryStatus(5, "table not found"))
    gone["on"] = True
    world.sleep(1.0)
    assert not a.renew()
    with pytest.raises(LeaseLost, match="no retry can succeed"):
        a.check()


@pytest.mark.parametrize("shared", [False, True], ids=["local", "dataflow-shared"])
def test_a_blip_shorter_than_the_deadline_is_ridden_through_without_a_restart(shared):
    """Bigtable unreachable for 25 s (longer than the TTL): writes pause while
    ownership is unproven, and resume once a renewal's compare-and-set proves
    nobody took over; a retry loop waiting meanwhile is not stopped by the fence.
    Then a blip longer than the give-up deadline stops the holder for good."""
    world = World()
    down = {"on": False}
    bt = InMemoryBigtable(fault=lambda t, e, n: [EntryStatus(14, "unavailable")] if down["on"] else None)
    a = make(world, bt, "a", holder="dataflow:j" if shared else None, shared=shared, give_up=60.0)
    if shared:
        a.acquire(heartbeat=False)
        a = make(world, bt, "w1", holder="dataflow:j", shared=True, node="vm1", give_up=60.0)
        a.try_acquire()
    else:
        a.acquire(heartbeat=False)
    a.active = True
    coordinator = Coordinator(JobKey.of(a.spec))
    coordinator.register(a)
    try:
        down["on"] = True
        for _ in range(25):
            world.sleep(1.0)
            a.renew()
        with pytest.raises(LeaseUnproven):
            a.check()
        coordinator.check_held()  # between retry attempts: unproven is no reason to leave the retry loop
        down["on"] = False
        world.sleep(1.0)
        assert a.renew() and a.check() > 0 and a.holding
        down["on"] = True
        for _ in range(90):
            world.sleep(1.0)
            a.renew()
        if shared:  # a Dataflow worker never gives up for good: Dataflow retries its bundles meanwhile
            with pytest.raises(LeaseUnproven):
                a.check()
            down["on"] = False
            assert a.renew() and a.check() > 0
        else:  # a local process stops, naming why (its command fails)
            with pytest.raises(LeaseLost, match="no renewal succeeded for more than 60s"):
                a.check()
            down["on"] = False
            assert not a.renew(), "given up is final: a restart re-acquires"
    finally:
        a.release()


def test_a_paused_dataflow_worker_resumes_only_if_nobody_took_the_job_over():
    world, bt = World(), InMemoryBigtable()
    w1 = make(world, bt, "w1", holder="dataflow:j", shared=True, node="vm1")
    w1.acquire(heartbeat=False)
    world.sleep(TTL + 5)  # SIGSTOPped; the job's lease expired meanwhile and another job took it
    other = make(world, bt, "other", holder="dataflow:k", shared=True, node="vm9")
    assert other.try_acquire() is None
    with pytest.raises(LeaseUnproven):
        w1.check()
    assert not w1.renew()
    with pytest.raises(LeaseLost, match="taken over"):
        w1.check()


def test_a_renewal_that_landed_after_its_timeout_is_adopted():
    world, bt = World(), InMemoryBigtable()
    a = make(world, bt, "a")
    a.acquire(heartbeat=False)
    # The server applied a renewal whose answer timed out: the cell moved on.
    moved = a._state(world.wall()).to_bytes()
    assert bt.swap_cell("state", a.spec.row_key, "meta", b"lease", a._raw, moved, world.wall())
    world.sleep(RENEW)
    assert a.renew() and a.check() > 0


def test_workers_of_one_dataflow_job_share_the_lease():
    world, bt = World(), InMemoryBigtable()
    launcher = make(world, bt, "launcher", holder="dataflow:job-1", shared=True)
    launcher.acquire(ttl_s=TTL + 900, heartbeat=False)
    w1 = make(world, bt, "w1", holder="dataflow:job-1", shared=True, node="vm1")
    w2 = make(world, bt, "w2", holder="dataflow:job-1", shared=True, node="vm2")
    w1.join(), w2.join()
    for _ in range(10):
        world.sleep(RENEW)
        assert w1.renew() and w2.renew()  # each other's renewals are not a loss
        assert w1.check() > 0 and w2.check() > 0
    other = make(world, bt, "other")
    with pytest.raises(LeaseHeld, match="dataflow:job-1"):
        other.acquire(heartbeat=False)
    for w in (w1, w2):
        w._stop.set()


def test_options_are_checked():
    LeaseOptions()
    with pytest.raises(ValueError, match="at least"):
        LeaseOptions(ttl_s=1)
    with pytest.raises(ValueError, match="renewal interval"):
        LeaseOptions(ttl_s=20, renew_s=10)
    with pytest.raises(ValueError):
        LeaseOptions(mode="steal")


def _change(seq: str) -> MappedChange:
    record = ChangeRecord("INSERT", {"pk": "a"}, {"pk": "a"}, None, 1_000,
                          StreamPosition("arn:aws:dynamodb:r:1:table/T/stream/x", "shard-1", seq))
    return MappedChange(record=record, rows=(RowChange("t", b"a", (SetCell("f", b"q", b"v", 1_000),)),))


def test_the_sink_writes_nothing_and_checkpoints_nothing_once_the_lease_is_lost():
    world, bt = World(), InMemoryBigtable()
    lease = make(world, bt, "a")
    lease.acquire(heartbeat=False)
    fenced = fence(bt, lease)
    assert isinstance(fenced, FencedWriter)
    state = StateStore(fenced, "job", world.wall)  # checkpoints go through the same fence
    sink = BatchingWriter(fenced, state, SinkConfig(retry=RetryPolicy(0.001, 0.001, 0.05)))
    sink.add(_change("1"))
    sink.flush()
    assert bt.latest("t") and state.load_checkpoints("arn:aws:dynamodb:r:1:table/T/stream/x")
    world.sleep(TTL)  # paused past the lease
    sink.add(_change("2"))
    calls = len(bt.calls)
    with pytest.raises((LeaseUnproven, LeaseLost)):
        sink.flush()
    assert len(bt.calls) == calls  # not one RPC after the fence said no
    ck = state.load_checkpoints("arn:aws:dynamodb:r:1:table/T/stream/x")
    assert ck["shard-1"].sequence_number == "1"


def test_a_dataflow_launch_holds_the_lease_for_the_job_and_its_workers_join(monkeypatch):
    import argparse

    from ddb2bt.pipeline.control import coordinator as coordinator_mod, lease as lease_mod
    from ddb2bt.pipeline.app.cli import acquire_lease
    from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec

    bt = InMemoryBigtable()
    monkeypatch.setattr(coordinator_mod, "lease_cell", lambda spec: LeaseCell(bt, spec.table, spec.row_key))
    state = StateSpec(BigtableSpec("p", "i"), job="orders_v2")
    args = argparse.Namespace(dry=False, lease_ttl=20.0, lease_renew=5.0, take_over=False, standby=False,
                              command="run", beam_args=["--runner=DataflowRunner", "--project=proj-1"])
    spec = acquire_lease(args, state, "tail")
    job_name = [a for a in args.beam_args if a.startswith("--job_name=")][0].split("=", 1)[1]
    assert job_name.startswith("ddb2bt-orders-v2-")  # a valid Dataflow job name, passed on to Beam
    assert spec.shared and spec.holder == f"dataflow:{job_name}"
    cur = LeaseState.parse(bt.read_cell(state.table, spec.row_key, "meta", b"lease"))
    assert cur.holder == spec.holder and cur.expires_ms > lease_mod.wall_ms() + 800_000  # start-up grace
    assert coordinator_mod.coordinator_for(spec).held(spec) is None  # the launcher renews nothing: the workers do
    worker = coordinator_mod.join(spec)  # a worker's DoFn.setup
    try:
        assert worker.check() > 0
        # Another Dataflow job (or process) for the same job name is refused.
        args2 = argparse.Namespace(**{**vars(args), "beam_args": ["--runner=DataflowRunner", "--job_name=other"]})
        with pytest.raises(LeaseHeld, match=f"dataflow:{job_name}"):
            acquire_lease(args2, state, "tail")
    finally:
        worker.release()


# --- per-partition owners inside a shared (Dataflow) job -----------------------------

STREAM = "arn:aws:dynamodb:r:1:table/T/stream/x"


def owners(world, bt, name):
    return PartitionOwners(lambda spec: LeaseCell(bt, "state", spec.row_key), worker=f"worker:{name}",
                           heartbeat=False, wall=world.wall, clock=world.clock, sleep=world.sleep,
                           host=f"host-{name}", pid=abs(hash(name)) % 30000 + 2, node=f"vm-{name}")


def test_a_paused_worker_whose_partition_moved_writes_nothing_when_woken():
    """Dataflow moves a partition's work off a SIGSTOPped worker; the new owner
    takes the partition once the old lease has run out by the cell's clock; the
    old one, woken, cannot prove ownership (its own monotonic clock ran on) and
    its renewal's compare-and-set fails against the new owner's value: its sink
    writes and checkpoints nothing more, and it never resumes."""
    world, bt = World(), InMemoryBigtable()
    job = LeaseSpec(Bt(), "state", "job", "tail", "dataflow:job-1", TTL, RENEW, shared=True)
    w1, w2 = owners(world, bt, "w1"), owners(world, bt, "w2")
    shard = next(f"shard-{i}" for i in range(100) if partition_index(f"shard-{i}", 2) == 0)
    assert w1.claim(job, STREAM, 0, 2) is not None
    assert w2.claim(job, STREAM, 0, 2) is None, "one owner per partition"
    assert w2.claim(job, STREAM, 1, 2) is not None, "partitions are owned independently"
    w1.check([(STREAM, shard)])
    sink = BatchingWriter(bt, StateStore(bt, "job", world.wall), SinkConfig(retry=RetryPolicy(0.001, 0.001, 0.05)),
                          partition_fence=w1.check)
    sink.add(_change("1"))
    sink.flush()
    assert bt.latest("t")
    # w1 is SIGSTOPped; Dataflow gives partition 0 to w2, which takes it at expiry.
    world.sleep(TTL + 1)
    assert w2.claim(job, STREAM, 0, 2) is not None
    # w1 wakes with a buffered change of partition 0: nothing is written.
    sink.add(_change("2"))
    calls = len(bt.calls)
    with pytest.raises((LeaseUnproven, LeaseLost)):
        sink.flush()
    assert len(bt.calls) == calls, "not one write RPC"
    assert not w1.held(STREAM, 0).renew(), "its renewal fails: the cell holds w2's value"
    with pytest.raises(LeaseLost):
        w1.check([(STREAM, shard)])
    assert w1.claim(job, STREAM, 0, 2) is None, "and it cannot take the partition back while w2 holds it"
    w2.check([(STREAM, shard)])


def test_a_worker_paused_between_two_attempts_of_a_data_write_does_not_retry_it_when_woken():
    """The first MutateRows of a batch fails retryably (entries applied but
    reported failed: the e2e's injected fault) and the worker is SIGSTOPped in the
    back-off; the partition moves to w2, which may apply later changes. Woken, w1
    must not send the retry: it carries old images, and Bigtable keeps no
    tombstone to stop one landing after w2's delete (docs/design.md §6.5)."""
    world, bt = World(), InMemoryBigtable()
    job = LeaseSpec(Bt(), "state", "job", "tail", "dataflow:job-1", TTL, RENEW, shared=True)
    w1, w2 = owners(world, bt, "w1"), owners(world, bt, "w2")
    assert w1.claim(job, STREAM, 0, 1) is not None

    bt.fault = lambda table, entries, call_no: [EntryStatus(14, "unavailable") for _ in entries] \
        if table == "t" and not [c for c in bt.calls[:call_no] if c[0] == "t"] else None

    moved: list = []

    def paused_in_the_back_off(seconds):
        if not moved:
            world.sleep(TTL + 1)  # SIGSTOPped; Dataflow gives the partition to w2
            moved.append(w2.claim(job, STREAM, 0, 1))
            assert moved[0] is not None

    sink = BatchingWriter(bt, StateStore(bt, "job", world.wall), SinkConfig(retry=RetryPolicy(0.001, 0.001, 0.05)),
                          partition_fence=w1.check, sleep=paused_in_the_back_off)
    sink.add(_change("1"))
    with pytest.raises((LeaseUnproven, LeaseLost)):
        sink.flush()
    assert [t for t, _ in bt.calls if t == "t"] == ["t"], "one attempt, no retry after the partition moved"


def test_a_partition_a_worker_no_longer_processes_is_released_for_the_next_owner():
    world, bt = World(), InMemoryBigtable()
    job = LeaseSpec(Bt(), "state", "job", "tail", "dataflow:job-1", TTL, RENEW, shared=True)
    w1, w2 = owners(world, bt, "w1"), owners(world, bt, "w2")
    lease = w1.claim(job, STREAM, 0, 1)
    world.sleep(PARTITION_IDLE_RELEASE_S + 1)
    assert lease.renew()  # still renewed by its heartbeat ...
    assert world.clock() - lease.last_used > lease.idle_release_s  # ... which releases it when idle
    lease.release()
    assert w2.claim(job, STREAM, 0, 1) is not None, "taken at once, not after a TTL"


def test_a_renewal_held_by_the_network_and_applied_after_the_blip_is_not_a_take_over():
    """A renewal sent during a blip is delivered late (a proxy or a congested
    link held it), after its own expiry: the holder's next renewal finds its own
    expired value in the cell — nobody else wrote it — and renews from it."""
    world, bt = World(), InMemoryBigtable()
    a = make(world, bt, "a")
    a.acquire(heartbeat=False)
    late = a._state(world.wall()).to_bytes()  # the held renewal, stamped now ...
    world.sleep(TTL + 5)  # ... applied after the blip, already expired
    assert bt.swap_cell("state", a.spec.row_key, "meta", b"lease", a._raw, late, world.wall())
    with pytest.raises(LeaseUnproven):
        a.check()
    assert a.renew() and a.check() > 0, "ridden through, not taken over by itself"
    b = make(world, bt, "b", node="other")
    assert b.try_acquire() is not None, "and held again: a contender is refused"


def test_a_dataflow_worker_rides_through_a_renewal_refused_as_permanent():
    """A brief PERMISSION_DENIED (an IAM binding being edited) is classified
    permanent; a Dataflow worker must not lose the job's lease for good over it
    (every later bundle would fail until the worker is replaced): its writes
    pause while unproven and resume once a renewal succeeds."""
    world, bt = World(), InMemoryBigtable()
    denied = {"on": False}
    bt.fault = lambda t, e, n: [EntryStatus(7, "permission denied")] if denied["on"] else None
    launcher = make(world, bt, "launcher", holder="dataflow:j", shared=True)
    launcher.acquire(heartbeat=False)
    worker = make(world, bt, "w1", holder="dataflow:j", shared=True, node="vm1")
    assert worker.try_acquire() is None
    denied["on"] = True
    for _ in range(int(TTL)):
        world.sleep(1.0)
        assert not worker.renew()
    with pytest.raises(LeaseUnproven, match="permission denied"):
        worker.check()
    denied["on"] = False
    world.sleep(1.0)
    assert worker.renew() and worker.check() > 0 and worker.holding


def test_a_local_process_still_stops_at_once_on_a_renewal_refused_as_permanent():
    world, a, denied = held_until_failing(EntryStatus(7, "permission denied"))
    denied["on"] = True
    world.sleep(1.0)
    assert not a.renew()
    with pytest.raises(LeaseLost, match="no retry can succeed"):
        a.check()


def test_a_lost_dataflow_lease_is_joined_again_by_the_next_dofn(monkeypatch):
    """A worker's job lease lost (here: another job took it over, then ended)
    is not kept in the process for good: the next DoFn set up joins again, and
    holds only while its job may."""
    from ddb2bt.pipeline.control import coordinator as lease_module

    world, bt = World(), InMemoryBigtable()
    monkeypatch.setattr(lease_module, "lease_cell", lambda spec: LeaseCell(bt, "state", spec.row_key))
    monkeypatch.setattr(lease_module, "Lease", lambda spec, cell, **kw: Lease(
        spec, cell, wall=world.wall, clock=world.clock, sleep=world.sleep, node="vm1", **kw))
    # Renewed by hand: the heartbeat thread a join starts waits longer than the test.
    spec = LeaseSpec(Bt(), "state", "job", "tail", "dataflow:j", TTL, 3600.0, shared=True)
    launcher = make(world, bt, "launcher", holder="dataflow:j", shared=True)
    launcher.acquire(heartbeat=False)
    first = lease_module.join(spec)
    try:
        other = make(world, bt, "other", holder="dataflow:k", shared=True, node="vm9")
        other.acquire(TAKE_OVER, heartbeat=False)  # waits out this job's lease ...
        assert other.renew()  # ... and renews its own
        assert not first.renew()
        with pytest.raises(LeaseLost):
            first.check()
        with pytest.raises(LeaseLost, match="held by dataflow:k"):
            lease_module.join(spec)  # the other job holds it: still refused, naming it
        other.release()
        second = lease_module.join(spec)
        assert second is not first and second.check() > 0
        second.release()
    finally:
        first.release()


def test_a_partition_whose_round_is_backing_off_is_not_released_as_idle():
    """A reading round stuck in GetRecords throttling back-off claims nothing for
    longer than PARTITION_IDLE_RELEASE_S: its partition stays owned (the sink
    would otherwise raise LeaseLost for what the round read); once the round
    ends and nothing uses the partition, it is released (the heartbeat thread
    runs; the test waits on conditions, with a deadline)."""
    import time

    world, bt = World(), InMemoryBigtable()
    job = LeaseSpec(Bt(), "state", "job", "tail", "dataflow:job-1", TTL, 0.01, shared=True)  # renew every 10 ms
    w1 = PartitionOwners(lambda spec: LeaseCell(bt, "state", spec.row_key), worker="worker:w1", heartbeat=True,
                         wall=world.wall, clock=world.clock, sleep=world.sleep, host="host-w1", pid=4321,
                         node="vm-w1")

    def wait_for(condition, what):
        deadline = time.monotonic() + 10.0
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.005)

    lease = w1.claim(job, STREAM, 0, 1)
    try:
        with w1.round(STREAM, 0):
            world.sleep(PARTITION_IDLE_RELEASE_S + 1)  # the round backs off, claiming nothing
            calls = len(bt.calls)
            wait_for(lambda: len(bt.calls) >= calls + 5, "the heartbeat kept renewing")
            assert lease.holding, "a running round is not idle"
        w1.check([(STREAM, "shard-0")])  # the sink writes what the round read
        world.sleep(PARTITION_IDLE_RELEASE_S + 1)
        wait_for(lambda: not lease.holding, "released once no round runs and nothing uses it")
        # A round whose generator was dropped unclosed (its count leaked) stops
        # holding the partition after PARTITION_ROUND_MAX_S.
        leaked = w1.claim(job, STREAM, 0, 1)
        dropped = w1.round(STREAM, 0)  # entered, never exited (kept referenced: not closed by the GC)
        dropped.__enter__()
        world.sleep(PARTITION_IDLE_RELEASE_S + 1)
        assert not leaked.idle()
        world.sleep(PARTITION_ROUND_MAX_S)
        wait_for(lambda: not leaked.holding, "a leaked round does not hold the partition for ever")
    finally:
        w1.release_all()
