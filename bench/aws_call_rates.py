"""DynamoDB Streams call rates of the live readers against AWS's limits
(docs/operations.md "Within AWS's limits"), in simulated time over the fake
stream (pipeline/testing/fakes.py), so the numbers are the code's, not the
machine's:

* DescribeStream calls per minute, one stream in one process, for 1, 4 and 8
  partitions, over 1 and 1,000 shards (10 s discovery interval, rounds every 3 s);
* the most GetRecords calls on one backlogged shard in any one second;
* the Streams calls `status` makes (the readers report, it lists shards only).

    .venv/bin/python bench/aws_call_rates.py
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prometheus_client import CollectorRegistry  # noqa: E402

ROUND_S = 3.0
MINUTE_S = 60.0


class SimClock:
    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def __call__(self) -> float:
        return self.t

    def ms(self) -> int:
        return int(self.t * 1000)

    def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)


def _reader(client, clock, index, count, directory):
    from ddb2bt.pipeline.clients.dynamodb import ShardPacer
    from ddb2bt.pipeline.observe.metrics import PipelineMetrics
    from ddb2bt.pipeline.clients.retry import RetryPolicy
    from ddb2bt.pipeline.source.stream_source import PartitionReader, ReaderOptions, StreamPartition
    from ddb2bt.pipeline.control.state import StateStore
    from ddb2bt.pipeline.testing.fakes import InMemoryBigtable

    state = StateStore(InMemoryBigtable(), "job", clock.ms)
    return PartitionReader(client, StreamPartition(client.stream_arn, index, count),
                           ReaderOptions(retry=RetryPolicy(0.001, 0.001, 5.0), discovery_interval_s=10.0),
                           state.load_checkpoints, PipelineMetrics(CollectorRegistry()), now_ms=clock.ms,
                           sleep=clock.sleep, directory=directory, pacer=ShardPacer(clock=clock, sleep=clock.sleep))


def describe_per_minute(shards: int, partitions: int) -> int:
    from ddb2bt.pipeline.clients.dynamodb import ShardDirectory
    from ddb2bt.pipeline.source.stream_source import LocalTracker, drain_round
    from ddb2bt.pipeline.testing.fakes import FakeStreamsClient

    client = FakeStreamsClient()
    for i in range(shards):
        client.add_shard(f"shardId-{i:05d}")
    clock = SimClock()
    directory = ShardDirectory(clock)
    readers = [(_reader(client, clock, i, partitions, directory), LocalTracker()) for i in range(partitions)]
    end = clock() + MINUTE_S
    while clock() < end:
        for reader, tracker in readers:
            drain_round(reader, tracker)
        clock.sleep(ROUND_S)
    return client.calls.count("DescribeStream")


def max_get_records_per_second(records: int = 12_000) -> int:
    from ddb2bt.pipeline.clients.dynamodb import ShardDirectory
    from ddb2bt.pipeline.source.stream_source import LocalTracker, drain_round
    from ddb2bt.pipeline.testing.fakes import FakeStreamsClient

    client = FakeStreamsClient()
    client.add_shard("s0")
    for i in range(records):
        client.put("s0", "INSERT", {"pk": {"S": f"k{i}"}}, {"pk": {"S": f"k{i}"}})
    clock = SimClock()
    times: list = []
    get_records = client.get_records

    def timed(**kw):
        times.append(clock())
        return get_records(**kw)

    client.get_records = timed
    reader, tracker = _reader(client, clock, 0, 1, ShardDirectory(clock)), LocalTracker()
    read = 0
    while read < records:
        read += drain_round(reader, tracker)[1].records
    return max(sum(1 for t in times[i:] if t < start + 1.0) for i, start in enumerate(times))


def status_calls() -> list:
    from ddb2bt.pipeline.cutover.status import gather
    from ddb2bt.pipeline.control.state import StateStore
    from ddb2bt.pipeline.testing.fakes import FakeStreamsClient, InMemoryBigtable

    client = FakeStreamsClient()
    client.add_shard("s0")
    client.put("s0", "INSERT", {"pk": {"S": "k"}}, {"pk": {"S": "k"}})
    gather(StateStore(InMemoryBigtable(), "job", lambda: 1), client, client.stream_arn, now_ms=1)
    return sorted(set(client.calls))


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    for shards in (1, 1_000):
        for partitions in (1, 4, 8):
            print(f"DescribeStream calls/min: {shards:>5} shard(s), {partitions} partition(s): "
                  f"{describe_per_minute(shards, partitions)}")
    print(f"most GetRecords calls on one backlogged shard in one second: {max_get_records_per_second()}")
    print(f"Streams calls made by status: {', '.join(status_calls())}")


if __name__ == "__main__":
    main()
