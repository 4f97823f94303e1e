"""A shared (Dataflow) job's sink commits a bundle's last batch in finish_bundle,
after the reading round ended. The commit keeps its partitions' leases in use
however long it takes (MutateRows under throttling, many CheckAndMutateRow), so
the heartbeat does not release them as idle mid-commit and the commit's own
checkpoint finds them owned; the per-row re-sends after a rejected request are
fenced like every other first attempt."""
import pytest

from ddb2bt.pipeline.clients.bigtable.errors import BigtablePermanent, EntryStatus
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.control.coordinator import Coordinator, JobKey
from ddb2bt.pipeline.control.lease import LeaseCell, LeaseLost, LeaseSpec
from ddb2bt.pipeline.control.partitions import PARTITION_IDLE_RELEASE_S, PartitionOwners
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.sink.batch import Row
from ddb2bt.pipeline.sink.batching import BatchingWriter
from ddb2bt.pipeline.sink.config import SinkConfig
from ddb2bt.pipeline.sink.requests import RequestWriter
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.model import ChangeRecord, MappedChange, RowChange, SetCell, StreamPosition
from tests.unit.control.test_lease import Bt, World

STREAM = "arn:aws:dynamodb:r:1:table/T/stream/x"
FAST = RetryPolicy(0.001, 0.002, 5.0)


class SlowBigtable(InMemoryBigtable):
    """MutateRows to the target takes longer than the idle release (world time), as
    under throttling; meanwhile the heartbeat looks (what Lease's heartbeat does)."""

    def __init__(self, world):
        super().__init__()
        self.world = world
        self.heartbeat = lambda: None

    def mutate_rows(self, table_id, entries, **kw):
        if table_id == "target":
            self.world.sleep(PARTITION_IDLE_RELEASE_S + 2)
            self.heartbeat()
        return super().mutate_rows(table_id, entries, **kw)


def change(key: str, seq: str) -> MappedChange:
    rec = ChangeRecord("INSERT", {"pk": {"S": key}}, {"pk": {"S": key}}, None, 1_700_000_000_000,
                       StreamPosition(STREAM, "shard-0", seq))
    return MappedChange(rec, (RowChange("target", key.encode(), (SetCell("cf", b"q", b"v", 1_700_000_000_000),)),))


def owners_with_partition(world, bt):
    owners = PartitionOwners(lambda spec: LeaseCell(bt, "state", spec.row_key), worker="worker:w1", heartbeat=False,
                             wall=world.wall, clock=world.clock, sleep=world.sleep, host="h", pid=4321, node="vm")
    job = LeaseSpec(Bt(), "state", "job", "tail", "dataflow:job-1", 20.0, 0.01, shared=True)
    lease = owners.claim(job, STREAM, 0, 1)

    def beat():  # the heartbeat's step (lease.Heartbeat._beat)
        if lease.idle():
            lease.release()
    bt.heartbeat = beat
    with owners.round(STREAM, 0):
        pass  # the round read a page and ended; the sink flushes in finish_bundle
    return owners


@pytest.mark.parametrize("coordinator", [False, True], ids=["owners", "coordinator"])
def test_the_last_commit_outlives_the_idle_release(coordinator):
    world = World()
    bt = SlowBigtable(world)
    owners = owners_with_partition(world, bt)
    fence = owners.check
    if coordinator:  # the fence the sink is given on Dataflow, over these partitions
        job = Coordinator(JobKey("p", "i", "state", "job"), partitions=owners)
        fence = job.partition_fence(LeaseSpec(Bt(), "state", "job", "tail", "dataflow:job-1", 20.0, 0.01,
                                              shared=True))
    state = StateStore(bt, "job", world.wall)
    sink = BatchingWriter(bt, state, SinkConfig(overlap_writes=False, retry=FAST), partition_fence=fence,
                          sleep=world.sleep)
    sink.add(change("a", "100"))
    try:
        sink.flush()  # raised LeaseLost when the lease was released mid-commit
    finally:
        owners.release_all()
    assert state.load_checkpoints(STREAM)["shard-0"].sequence_number == "100"


def test_after_the_commit_an_unused_partition_is_released_as_idle_again():
    world = World()
    bt = SlowBigtable(world)
    owners = owners_with_partition(world, bt)
    sink = BatchingWriter(bt, StateStore(bt, "job", world.wall), SinkConfig(overlap_writes=False, retry=FAST),
                          partition_fence=owners.check, sleep=world.sleep)
    sink.add(change("a", "100"))
    sink.flush()
    lease = owners.held(STREAM, 0)
    world.sleep(PARTITION_IDLE_RELEASE_S + 1)
    lease.renew()  # the heartbeat renews it meanwhile
    assert lease.idle()
    owners.release_all()


class RejectingWriter:
    """Rejects any request of several rows as a whole (INVALID_ARGUMENT); a single row is written."""

    def __init__(self):
        self.sent = []

    def mutate_rows(self, table, entries, **kw):
        self.sent.append([e[0] for e in entries])
        if len(entries) > 1:
            raise BigtablePermanent("request rejected", code="INVALID_ARGUMENT")
        return [EntryStatus(0, "")]


def test_each_per_row_resend_after_a_rejected_request_is_fenced():
    writer = RejectingWriter()
    requests = RequestWriter(writer, SinkConfig(retry=FAST), None, lambda s: None, lambda *a: None)
    checks = []

    def still_owner():
        checks.append(len(writer.sent))
        if len(checks) == 2:
            raise LeaseLost("the partition moved to another worker")
    requests.still_owner = still_owner
    rows = [Row("target", k, [SetCell("cf", b"q", b"v", 1)], []) for k in (b"a", b"b", b"c")]
    with pytest.raises(LeaseLost):
        requests.write_with_retry("target", rows)
    assert writer.sent == [[b"a", b"b", b"c"], [b"a"]]  # b and c were not sent once ownership was lost
