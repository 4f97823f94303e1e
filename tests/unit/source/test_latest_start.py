"""A fresh ``--start latest`` job: only the first GetShardIterator of a shard's
LATEST position is LATEST. Its time goes into the restriction before anything
is read from it; any later iterator of a position that never advanced (another
DoFn instance, a worker failover, a rebalanced partition, an iterator expired
after 15 minutes) reads from TRIM_HORIZON and skips only what is older than the
first iterator (less a margin): nothing written after the job started is lost."""
from prometheus_client import CollectorRegistry

from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.observe.metrics import PipelineMetrics
from ddb2bt.pipeline.source.stream_source import (LATEST, LATEST_REREAD_MARGIN_MS, LocalTracker, PartitionReader,
                                                  ReaderOptions, ShardPos, StreamPartition, drain_round)
from ddb2bt.pipeline.testing.fakes import FakeStreamsClient, InMemoryBigtable
from ddb2bt.transforms.model import ChangeRecord

FAST = RetryPolicy(initial_s=0.001, max_backoff_s=0.002, deadline_s=5.0)
START_MS = 1_700_000_000_000  # the fake stream stamps its records from here on


def reader_for(client, state, now_ms=lambda: START_MS):
    return PartitionReader(client, StreamPartition(client.stream_arn, 0, 1),
                           ReaderOptions(start="latest", retry=FAST, discovery_interval_s=0), state.load_checkpoints,
                           PipelineMetrics(CollectorRegistry()), now_ms=now_ms, sleep=lambda s: None)


def keys(elements):
    return [e.keys["pk"]["S"] for e in elements if isinstance(e, ChangeRecord)]


def put(client, key, created_ms=None):
    return client.put("s", "INSERT", {"pk": {"S": key}}, {"pk": {"S": key}}, created_ms=created_ms)


def fresh():
    client = FakeStreamsClient()
    client.add_shard("s")
    return client, StateStore(InMemoryBigtable(), "job", lambda: 1)


def test_the_first_latest_iterator_is_recorded_before_anything_is_read():
    client, state = fresh()
    tracker = LocalTracker()
    drain_round(reader_for(client, state), tracker)
    assert dict(tracker.current_restriction().positions)["s"] == ShardPos(mode=LATEST, since_ms=START_MS)
    assert client.calls.count("GetShardIterator") == 1 and "GetRecords" not in client.calls


def test_another_instance_reads_what_was_written_after_the_first_latest_iterator():
    client, state = fresh()
    put(client, "before-the-job", created_ms=START_MS - LATEST_REREAD_MARGIN_MS - 1000)
    tracker = LocalTracker()
    drain_round(reader_for(client, state), tracker)  # instance 1: LATEST, its time claimed
    put(client, "k1", created_ms=START_MS + 5)  # written after the job started
    out, _ = drain_round(reader_for(client, state), tracker)  # instance 2, same committed restriction
    assert keys(out) == ["k1"]  # and not the change older than the start (less the margin)
    assert tracker.current_restriction().position_map()["s"].after is not None  # a concrete position now


def test_an_expired_latest_iterator_is_renewed_where_the_first_one_started():
    client, state = fresh()
    tracker = LocalTracker()
    reader = reader_for(client, state)
    drain_round(reader, tracker)
    put(client, "k1", created_ms=START_MS + 5)
    client.expire_iterators()
    out, _ = drain_round(reader, tracker)
    assert keys(out) == ["k1"]


def test_the_same_instance_reads_on_from_its_latest_iterator():
    client, state = fresh()
    put(client, "before", created_ms=START_MS - 10)  # within the margin, but before the LATEST iterator
    tracker = LocalTracker()
    reader = reader_for(client, state)
    drain_round(reader, tracker)
    put(client, "k1", created_ms=START_MS + 5)
    out, _ = drain_round(reader, tracker)
    assert keys(out) == ["k1"]
    assert client.calls.count("GetShardIterator") == 1


class AtTimestampStream(FakeStreamsClient):
    """A stream that has AT_TIMESTAMP (as the Kinesis adapter does): asked for it, not for TRIM_HORIZON."""

    reads_at_timestamp = True

    def __init__(self):
        super().__init__()
        self.asked = []

    def get_shard_iterator(self, StreamArn, ShardId, ShardIteratorType, SequenceNumber=None, Timestamp=None):
        self.asked.append((ShardIteratorType, Timestamp))
        if ShardIteratorType == "AT_TIMESTAMP":
            ShardIteratorType = "TRIM_HORIZON"  # the fake has no times to seek by
        return super().get_shard_iterator(StreamArn, ShardId, ShardIteratorType, SequenceNumber)


def test_a_stream_with_at_timestamp_renews_a_latest_position_at_its_time():
    client = AtTimestampStream()
    client.add_shard("s")
    state = StateStore(InMemoryBigtable(), "job", lambda: 1)
    tracker = LocalTracker()
    drain_round(reader_for(client, state), tracker)
    put(client, "k1", created_ms=START_MS + 5)
    out, _ = drain_round(reader_for(client, state), tracker)
    assert keys(out) == ["k1"]
    assert [t for t, _ in client.asked] == ["LATEST", "AT_TIMESTAMP"]
    assert client.asked[1][1].timestamp() * 1000 == START_MS - LATEST_REREAD_MARGIN_MS
