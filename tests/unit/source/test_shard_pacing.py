"""A shard's pace (AWS allows 5 GetRecords per second per shard) follows the
shard, not the DoFn instance: the time of the partition's latest call travels
in the restriction, so a residual resumed by another instance or worker waits
from the last call its previous holder made instead of calling at once."""
import pytest
from prometheus_client import CollectorRegistry

from ddb2bt.pipeline.clients.dynamodb import ShardPacer
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.observe.metrics import PipelineMetrics
from ddb2bt.pipeline.source.stream_source import (LocalTracker, PartitionReader, ReaderOptions, StreamPartition,
                                                  drain_round)
from ddb2bt.pipeline.testing.fakes import FakeStreamsClient, InMemoryBigtable

FAST = RetryPolicy(initial_s=0.001, max_backoff_s=0.002, deadline_s=5.0)


class Time:
    def __init__(self):
        self.s = 1_700_000_000.0

    def ms(self):
        return int(self.s * 1000)


def instance(client, state, time):
    """A reader as a DoFn instance holds one: its own pacer and iterators."""
    return PartitionReader(client, StreamPartition(client.stream_arn, 0, 1),
                           ReaderOptions(retry=FAST, discovery_interval_s=0), state.load_checkpoints,
                           PipelineMetrics(CollectorRegistry()), now_ms=time.ms, sleep=lambda s: None,
                           pacer=ShardPacer(clock=lambda: time.s), hand_back_pacing=True)


def busy_stream():
    client = FakeStreamsClient()
    client.add_shard("s")
    for i in range(3):
        client.put("s", "INSERT", {"pk": {"S": f"k{i}"}}, {"pk": {"S": f"k{i}"}})
    return client, StateStore(InMemoryBigtable(), "job", lambda: 1)


def test_a_residual_on_another_instance_waits_for_the_shards_pace():
    client, state = busy_stream()
    time, tracker = Time(), LocalTracker()
    drain_round(instance(client, state, time), tracker)  # instance 1 reads a page with changes: busy
    assert client.calls.count("GetRecords") == 1
    time.s += 0.05
    client.put("s", "INSERT", {"pk": {"S": "k9"}}, {"pk": {"S": "k9"}})
    out, result = drain_round(instance(client, state, time), tracker)  # instance 2, 50 ms later
    assert client.calls.count("GetRecords") == 1  # no call within 200 ms of the shard's last one
    # The new instance does not know the shard was busy: it waits for the idle poll
    # (0.25 s after the last call), never less than the pace.
    wait = result.paced_s if result.paced_s is not None else result.idle_wait_s
    assert wait == pytest.approx(0.2)
    time.s += wait
    out, _ = drain_round(instance(client, state, time), tracker)  # once the pace allows it, read
    assert client.calls.count("GetRecords") == 2 and len(out) == 1


def test_the_reader_that_made_the_call_keeps_its_own_pace():
    client, state = busy_stream()
    time, tracker = Time(), LocalTracker()
    reader = instance(client, state, time)
    drain_round(reader, tracker)
    time.s += 0.2
    client.put("s", "INSERT", {"pk": {"S": "k9"}}, {"pk": {"S": "k9"}})
    out, result = drain_round(reader, tracker)
    assert result.paced_s is None and len(out) == 1
