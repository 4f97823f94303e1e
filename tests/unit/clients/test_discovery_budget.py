"""Shard discovery within AWS's DescribeStream limit (10 calls per second per
stream) whatever the shard and worker counts: each process's full listings are
spaced so that all the job's processes together stay within
DESCRIBE_STREAM_BUDGET_PER_S, and a closed shard's children are asked for alone
(ShardFilter CHILD_SHARDS), not by listing the stream again."""
import pytest

from ddb2bt.pipeline.clients.dynamodb import (DESCRIBE_STREAM_BUDGET_PER_S, ShardDirectory, list_shards,
                                              listing_spacing_s)
from ddb2bt.pipeline.testing.fakes import FakeStreamsClient


class Clock:
    def __init__(self):
        self.t = 1_000.0

    def __call__(self):
        return self.t


def call(operation, fn):
    return fn()


def stream_of(shards):
    client = FakeStreamsClient()
    for i in range(shards):
        client.add_shard(f"shardId-{i:05d}")
    return client


def test_the_spacing_keeps_every_lister_together_within_the_budget():
    assert listing_spacing_s(2_000, 16) == pytest.approx(20 * 16 / DESCRIBE_STREAM_BUDGET_PER_S)
    assert listing_spacing_s(50, 1) == pytest.approx(1 / DESCRIBE_STREAM_BUDGET_PER_S)  # one page
    assert listing_spacing_s(0, 0) == pytest.approx(1 / DESCRIBE_STREAM_BUDGET_PER_S)


@pytest.mark.parametrize("shards,workers", [(2_000, 16), (300, 4)])
def test_sixteen_workers_of_a_2000_shard_stream_stay_within_aws_limit(shards, workers):
    """Each worker process has its own directory; its 2 partitions ask it every
    second of 10 simulated minutes (the readers' discovery when due)."""
    client, clock = stream_of(shards), Clock()
    partitions = 2 * workers
    directories = [ShardDirectory(clock) for _ in range(workers)]
    start, minutes = clock.t, 10
    for second in range(60 * minutes):
        clock.t = start + second
        for d in directories:
            for _ in range(2):
                d.listing(client, client.stream_arn, call, 10.0, listers=partitions)
    per_s = client.calls.count("DescribeStream") / (60 * minutes)
    assert per_s <= DESCRIBE_STREAM_BUDGET_PER_S * 1.1  # the first listings of all start together
    assert per_s <= 10  # AWS's limit, summed over every worker


def test_a_closed_shards_children_are_added_without_listing_the_stream_again():
    client, clock = stream_of(250), Clock()
    directory = ShardDirectory(clock)
    directory.listing(client, client.stream_arn, call, 10.0)
    listed = client.calls.count("DescribeStream")
    client.split("shardId-00007", "shardId-child-a", "shardId-child-b")
    listing = directory.children(client, client.stream_arn, ["shardId-00007"], call, 1.0)
    assert client.calls.count("DescribeStream") == listed + 1
    assert listing.shards["shardId-child-a"] == listing.shards["shardId-child-b"] == "shardId-00007"
    assert "shardId-00007" in listing.closed_ids
    # every partition of the process sees them from now on, without a call
    assert "shardId-child-a" in directory.listing(client, client.stream_arn, call, 10.0).shards
    assert client.calls.count("DescribeStream") == listed + 1


class NoShardFilter(FakeStreamsClient):
    """An endpoint without ShardFilter (an emulator, the Kinesis adapter)."""

    def describe_stream(self, StreamArn, Limit=100, ExclusiveStartShardId=None):
        return super().describe_stream(StreamArn, Limit, ExclusiveStartShardId)


def test_without_shard_filter_the_children_come_from_a_new_listing():
    client, clock = NoShardFilter(), Clock()
    client.add_shard("p")
    directory = ShardDirectory(clock)
    directory.listing(client, client.stream_arn, call, 10.0)
    client.split("p", "c")
    clock.t += 2.0
    listing = directory.children(client, client.stream_arn, ["p"], call, 1.0)
    assert listing.shards["c"] == "p"
    assert list_shards(client, client.stream_arn, call).shards == listing.shards
