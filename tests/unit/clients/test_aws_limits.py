"""Within AWS's published limits (issue 22, docs/operations.md "Within AWS's
limits"): GetRecords paced to 5 calls/s per shard, one DescribeStream listing per
stream per process shared by its partitions (calls per minute independent of the
partition count, 8 partitions over 1,000 shards), `status` reading no shard
records, the API-call metric, and Streams calls that fail within seconds when a
silent network partition swallows them.

The fake stream (pipeline/testing/fakes.py) stands in for what moto cannot show:
thousands of shards and per-call accounting. Time is a fake clock: the pacing
and the per-minute counts are asserted on simulated time, never on wall time."""
from __future__ import annotations

import logging
import socket
import threading

import pytest
from prometheus_client import CollectorRegistry

from ddb2bt.pipeline.cutover.status import assess, gather, render
from ddb2bt.pipeline.clients.dynamodb import (GET_RECORDS_PER_SHARD_PER_S, STREAMS_CONNECT_TIMEOUT_S, STREAMS_READ_TIMEOUT_S,
                                      ShardDirectory, ShardPacer)
from ddb2bt.pipeline.observe.metrics import PipelineMetrics
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.source import stream_source
from ddb2bt.pipeline.source.stream_source import (LocalTracker, PartitionReader, ReaderOptions, StreamPartition,
                                                  drain_round)
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.testing.fakes import FakeStreamsClient, InMemoryBigtable

FAST = RetryPolicy(initial_s=0.001, max_backoff_s=0.002, deadline_s=5.0)
LISTING_PAGE = 100  # DescribeStream's maximum shards per page


class SimClock:
    """Simulated time: ``sleep`` moves it on."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def ms(self) -> int:
        return int(self.t * 1000)

    def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)


def reader_for(client, clock, index=0, count=1, directory=None, metrics=None, hand_back=False, **options):
    """A reader on simulated time; ``hand_back``: the splittable DoFn's (a paced
    round ends with its wait instead of sleeping)."""
    state = StateStore(InMemoryBigtable(), "job", clock.ms)
    opts = ReaderOptions(retry=FAST, **options)
    reader = PartitionReader(client, StreamPartition(client.stream_arn, index, count), opts, state.load_checkpoints,
                             metrics or PipelineMetrics(CollectorRegistry()), now_ms=clock.ms, sleep=clock.sleep,
                             directory=directory or ShardDirectory(clock),
                             pacer=ShardPacer(clock=clock, sleep=clock.sleep), hand_back_pacing=hand_back)
    return reader, state


def call_times(client, clock) -> dict:
    """{shard id: simulated times of its GetRecords calls}, filled as they are made."""
    calls: dict = {}
    get_records = client.get_records

    def timed(**kw):
        calls.setdefault(kw["ShardIterator"].split("|")[0], []).append(clock())
        return get_records(**kw)

    client.get_records = timed
    return calls


def test_a_backlogged_shard_gets_at_most_5_get_records_calls_per_second(monkeypatch):
    monkeypatch.setattr(stream_source, "GET_RECORDS_LIMIT", 100)  # smaller pages, same rule: cheaper
    client = FakeStreamsClient()
    client.add_shard("s0")
    for i in range(1_200):  # 12 full pages: one round reads PAGES_PER_ROUND of them back to back
        client.put("s0", "INSERT", {"pk": {"S": f"k{i}"}}, {"pk": {"S": f"k{i}"}})
    clock = SimClock()
    times = call_times(client, clock)
    reader, _ = reader_for(client, clock)
    tracker = LocalTracker()
    read = 0
    while read < 1_200:
        elements, result = drain_round(reader, tracker)
        read += result.records
    calls = times["s0"]
    assert len(calls) >= 12
    # every window of one second holds at most 5 calls
    for i, t in enumerate(calls):
        in_window = [c for c in calls[i:] if c < t + 1.0]
        assert len(in_window) <= GET_RECORDS_PER_SHARD_PER_S, (t, in_window)


def test_a_paced_shard_does_not_hold_up_the_others_of_its_partition(monkeypatch):
    """Four shards in a backlog, one reader: the shards take turns a page each,
    so the pacing of one shard overlaps the others' calls. Four shards drain in
    the simulated time of about one (was four: each shard's pages back to back,
    a pacing sleep between every two), and every shard stays at 5 calls/s."""
    monkeypatch.setattr(stream_source, "GET_RECORDS_LIMIT", 100)
    shards = ("s0", "s1", "s2", "s3")
    pages = stream_source.PAGES_PER_ROUND
    client = FakeStreamsClient()
    for shard in shards:
        client.add_shard(shard)
        for i in range(pages * 100):
            client.put(shard, "INSERT", {"pk": {"S": f"{shard}-{i}"}}, {"pk": {"S": f"{shard}-{i}"}})
    clock = SimClock()
    calls = call_times(client, clock)
    reader, _ = reader_for(client, clock)
    start = clock()
    elements, result = drain_round(reader, LocalTracker())
    assert result.records == len(shards) * pages * 100
    one_shard = (pages - 1) / GET_RECORDS_PER_SHARD_PER_S
    assert clock() - start <= one_shard + 1e-9, "four shards take the time of one"
    for shard, times in calls.items():
        for i, t in enumerate(times):
            assert len([c for c in times[i:] if c < t + 1.0]) <= GET_RECORDS_PER_SHARD_PER_S, (shard, t)
    # each shard's records still in order
    for shard in shards:
        mine = [e.keys["pk"]["S"] for e in elements if getattr(e, "keys", None) and
                e.keys["pk"]["S"].startswith(shard)]
        assert mine == [f"{shard}-{i}" for i in range(pages * 100)]


def test_a_reader_of_the_splittable_dofn_hands_the_pacing_wait_back_to_the_runner(monkeypatch):
    """In the pipeline a reader never sleeps for the pacer: when every shard of
    its partition was read a moment ago the round ends with the wait
    (RoundResult.paced_s), which the DoFn defers, so other partitions of the
    process read meanwhile. No call is ever made early."""
    monkeypatch.setattr(stream_source, "GET_RECORDS_LIMIT", 100)
    client = FakeStreamsClient()
    for shard in ("s0", "s1"):
        client.add_shard(shard)
        for i in range(300):
            client.put(shard, "INSERT", {"pk": {"S": f"{shard}-{i}"}}, {"pk": {"S": f"{shard}-{i}"}})
    clock = SimClock()
    slept: list = []
    state = StateStore(InMemoryBigtable(), "job", clock.ms)
    reader = PartitionReader(client, StreamPartition(client.stream_arn, 0, 1), ReaderOptions(retry=FAST),
                             state.load_checkpoints, PipelineMetrics(CollectorRegistry()), now_ms=clock.ms,
                             sleep=lambda s: slept.append(s), directory=ShardDirectory(clock),
                             pacer=ShardPacer(clock=clock, sleep=lambda s: slept.append(s)), hand_back_pacing=True)
    tracker = LocalTracker()
    elements, result = drain_round(reader, tracker)
    assert result.records == 200 and result.paced_s == pytest.approx(1 / GET_RECORDS_PER_SHARD_PER_S)
    assert not result.at_head and slept == [], "a page of each shard, then the wait handed back"
    read, rounds = result.records, 1
    while result.paced_s is not None:
        clock.sleep(result.paced_s)  # the runner comes back when asked
        elements, result = drain_round(reader, tracker)
        read, rounds = read + result.records, rounds + 1
    assert read == 600 and result.at_head and slept == [], "never a sleep in the reader"
    assert rounds == 4  # three full pages per shard, then the empty ones at the head
    # An idle poll that comes early (every shard at its head when last read) is an
    # idle round, not a paced one: no call, and the runner's idle poll spaces the next.
    calls = len([c for c in client.calls if c == "GetRecords"])
    elements, result = drain_round(reader, tracker)
    assert result.at_head and result.paced_s is None and result.records == 0
    assert len([c for c in client.calls if c == "GetRecords"]) == calls


def test_a_shard_under_steady_writes_is_read_at_aws_pace_not_at_the_idle_poll(monkeypatch):
    """A shard whose last page had changes — not a full page: it reached the head —
    is read again as soon as AWS allows (the wait handed back, 0.2 s after the
    previous call), not after the idle poll: under steady writes every page
    reaches the head, and the idle poll after each would add to every change's
    lag. One empty page and the shard is idle again: an early round makes no call
    and says how long until its idle poll (4 calls a second) is due."""
    monkeypatch.setattr(stream_source, "GET_RECORDS_LIMIT", 100)
    client = FakeStreamsClient()
    client.add_shard("s0")
    clock = SimClock()
    calls = call_times(client, clock).setdefault("s0", [])
    reader, _ = reader_for(client, clock, hand_back=True)
    tracker = LocalTracker()
    drain_round(reader, tracker)  # discovery and the first (empty) page
    clock.sleep(ReaderOptions().poll_interval_s)  # the runner's idle poll
    written = 0
    for _ in range(5):  # steady writes: 40 changes between two calls, far from a full page
        for _ in range(40):
            client.put("s0", "INSERT", {"pk": {"S": f"k{written}"}}, {"pk": {"S": f"k{written}"}})
            written += 1
        elements, result = drain_round(reader, tracker)
        while result.paced_s is not None:  # the runner comes back when asked
            clock.sleep(result.paced_s)
            elements, result = drain_round(reader, tracker)
        assert result.records == 40 and not result.at_head
        # At the head, but with changes: the next round is paced, not an idle one.
        before = len(calls)
        _, early = drain_round(reader, tracker)
        assert early.paced_s == pytest.approx(1 / GET_RECORDS_PER_SHARD_PER_S) and len(calls) == before
    gaps = [b - a for a, b in zip(calls[1:], calls[2:])]
    assert gaps == [pytest.approx(1 / GET_RECORDS_PER_SHARD_PER_S)] * 4, "AWS's pace, no more, no less"
    clock.sleep(early.paced_s)
    _, empty = drain_round(reader, tracker)  # the writes stopped: an empty page
    assert empty.records == 0 and empty.at_head and empty.paced_s is None
    before = len(calls)
    _, idle = drain_round(reader, tracker)  # idle again: an early round is an idle round, no call
    assert idle.at_head and idle.paced_s is None and len(calls) == before
    assert idle.idle_wait_s == pytest.approx(ReaderOptions().poll_interval_s), "the idle poll, from its last call"


def test_an_idle_shard_is_polled_at_the_idle_poll_next_to_a_busy_one(monkeypatch):
    """Two shards in one partition, one under steady writes, one idle: the busy
    one is read every 0.2 s (AWS's pace), the idle one every poll interval, not
    each time the busy one's round comes round."""
    client = FakeStreamsClient()
    for shard in ("busy", "idle"):
        client.add_shard(shard)
    clock = SimClock()
    calls = call_times(client, clock)
    options = ReaderOptions()
    reader, _ = reader_for(client, clock, hand_back=True)
    tracker = LocalTracker()
    for i in range(80):  # the runner comes back when asked, as the SDF tells it (stream_sdf._round)
        client.put("busy", "INSERT", {"pk": {"S": f"k{i}"}}, {"pk": {"S": f"k{i}"}})
        _, result = drain_round(reader, tracker)
        if result.paced_s is not None:
            clock.sleep(result.paced_s)
        elif result.at_head:  # an idle round: the idle poll, or what is left of it
            clock.sleep(options.poll_interval_s if result.idle_wait_s is None else result.idle_wait_s)
    gaps = {s: [b - a for a, b in zip(t, t[1:])] for s, t in calls.items()}
    assert len(gaps["busy"]) >= 20 and len(gaps["idle"]) >= 10
    assert gaps["busy"] == [pytest.approx(1 / GET_RECORDS_PER_SHARD_PER_S)] * len(gaps["busy"])
    assert min(gaps["idle"]) >= options.poll_interval_s - 1e-9 and max(gaps["idle"]) <= 0.4, gaps["idle"]


def test_the_pacer_waits_only_for_the_same_shard():
    clock = SimClock()
    pacer = ShardPacer(clock=clock, sleep=clock.sleep)
    pacer.wait("a")
    pacer.wait("b")  # another shard: no wait
    assert clock() == 1_000.0
    pacer.wait("a")
    assert clock() == pytest.approx(1_000.0 + 1 / GET_RECORDS_PER_SHARD_PER_S)


def describe_calls_per_minute(partitions: int, shards: int = 1_000) -> tuple:
    """DescribeStream calls in one simulated minute with ``partitions`` readers of
    one stream in one process (one shared ShardDirectory), and the metric's count."""
    client = FakeStreamsClient(describe_page=LISTING_PAGE)
    for i in range(shards):
        client.add_shard(f"shardId-{i:05d}")
    clock = SimClock()
    directory = ShardDirectory(clock)
    metrics = PipelineMetrics(CollectorRegistry())
    readers = [(reader_for(client, clock, i, partitions, directory, metrics, discovery_interval_s=10.0)[0],
                LocalTracker()) for i in range(partitions)]
    start = clock()
    while clock() < start + 60.0:
        for reader, tracker in readers:
            drain_round(reader, tracker)
        clock.sleep(3.0)  # the partitions' rounds, every 3 s (staggered against the 10 s interval)
    owned = sum(len(t.current_restriction().positions) for _, t in readers)
    counted = metrics.aws_api_calls.labels("Fake", "DescribeStream")._value.get()
    return client.calls.count("DescribeStream"), counted, owned


def test_describe_stream_calls_per_minute_do_not_grow_with_the_partitions():
    from ddb2bt.pipeline.clients.dynamodb import DESCRIBE_STREAM_BUDGET_PER_S
    one, counted_one, owned_one = describe_calls_per_minute(1)
    eight, counted_eight, owned_eight = describe_calls_per_minute(8)
    assert owned_one == owned_eight == 1_000  # every shard read, by exactly one partition
    pages = 1_000 // LISTING_PAGE
    # at most one listing (10 pages) per 10 s discovery interval — 6 a minute (5 with
    # rounds every 3 s: at 0, 12, 24, 36, 48 s) — however many partitions
    assert 5 * pages <= one <= 6 * pages
    # 8 partitions may be 8 processes listing the stream: each keeps to its eighth of
    # the stream's budget (listings spaced 16 s apart), never more than one alone
    assert eight <= one and eight <= 60 * DESCRIBE_STREAM_BUDGET_PER_S / 8 + pages
    assert counted_one == one and counted_eight == eight  # the metric counts every call


def test_partitions_in_one_process_share_one_listing_even_when_a_shard_closes():
    client = FakeStreamsClient(describe_page=LISTING_PAGE)
    for i in range(200):
        client.add_shard(f"shardId-{i:05d}")
    clock = SimClock()
    directory = ShardDirectory(clock)
    readers = [(reader_for(client, clock, i, 8, directory, discovery_interval_s=10.0)[0], LocalTracker())
               for i in range(8)]
    for reader, tracker in readers:
        drain_round(reader, tracker)
    assert client.calls.count("DescribeStream") == 2  # 200 shards: two pages, once for all 8
    filters = []
    describe = client.describe_stream
    client.describe_stream = lambda **kw: (filters.append(kw.get("ShardFilter")), describe(**kw))[1]
    for shard in list(client.shards)[:8]:
        client.close_shard(shard)  # each closed shard makes its reader ask for its children next round
    closed = list(client.shards)[:8]
    client.add_shard("shardId-child", parent_id=closed[0])
    clock.sleep(0.1)
    for _ in range(2):
        for reader, tracker in readers:
            drain_round(reader, tracker)
    # the closes never list the whole stream again: one CHILD_SHARDS call per closed shard
    assert sorted(f["ShardId"] for f in filters) == sorted(closed)
    assert all(f["Type"] == "CHILD_SHARDS" for f in filters)
    # and the child is seen by every partition of the process: the one owning it waits
    # for its parent to be recorded finished (no sink here), then starts it
    from ddb2bt.pipeline.control.partitions import partition_index
    assert [i for i, (r, _) in enumerate(readers) if "shardId-child" in r.waiting] == [
        partition_index("shardId-child", 8)]


def test_every_describe_stream_attempt_waits_for_its_slot_of_the_shared_schedule():
    """A listing's pages, a retried page and a closed shard's CHILD_SHARDS call each
    take one slot of the stream's schedule shared by every process
    (control/shared_rate.py); GetShardIterator and GetRecords take none."""
    from botocore.exceptions import ClientError

    client = FakeStreamsClient(describe_page=LISTING_PAGE)
    for i in range(250):
        client.add_shard(f"shardId-{i:05d}")
    clock = SimClock()
    order: list = []
    describe, throttled = client.describe_stream, []

    def describe_once_throttled(**kw):
        order.append("DescribeStream")
        if not throttled:  # the first page is throttled once, then retried
            throttled.append(kw)
            raise ClientError({"Error": {"Code": "LimitExceededException", "Message": "slow down"}},
                              "DescribeStream")
        return describe(**kw)

    client.describe_stream = describe_once_throttled
    state = StateStore(InMemoryBigtable(), "job", clock.ms)
    reader = PartitionReader(client, StreamPartition(client.stream_arn, 0, 1), ReaderOptions(retry=FAST),
                             state.load_checkpoints, PipelineMetrics(CollectorRegistry()), now_ms=clock.ms,
                             sleep=clock.sleep, directory=ShardDirectory(clock),
                             pacer=ShardPacer(clock=clock, sleep=clock.sleep),
                             describe_slot=lambda: order.append("slot"))
    tracker = LocalTracker()
    drain_round(reader, tracker)
    # three pages, the first attempted twice: each attempt right after its slot
    assert order == ["slot", "DescribeStream"] * 4
    client.close_shard("shardId-00000")
    clock.sleep(1.0)
    order.clear()
    drain_round(reader, tracker)
    drain_round(reader, tracker)
    assert order == ["slot", "DescribeStream"]  # the closed shard's children: one call, one slot


def test_status_reads_no_shard_records_and_takes_the_lag_from_the_readers_reports():
    client = FakeStreamsClient()
    for shard in ("s0", "s1"):
        client.add_shard(shard)
    for i in range(1_500):
        client.put("s0", "INSERT", {"pk": {"S": f"k{i}"}}, {"pk": {"S": f"k{i}"}})
    clock = SimClock(start=1_700_000_100.0)
    reader, state = reader_for(client, clock)
    drain_round(reader, LocalTracker())  # read to the head of both shards
    state.save_reader_report(client.stream_arn, "0-1", reader.pending_since())
    client.calls.clear()
    facts = gather(state, client, client.stream_arn, now_ms=clock.ms())
    assert "GetRecords" not in client.calls and "GetShardIterator" not in client.calls
    assert set(client.calls) == {"DescribeStream"}
    by_id = {s.shard_id: s for s in facts.shards}
    assert set(by_id) == {"s0", "s1"}
    assert all(s.pending_since_ms is None and s.reported_ago_ms == 0 for s in by_id.values())
    # a reader's report of a backlog shows as lag
    state.save_reader_report(client.stream_arn, "0-1", {"s0": clock.ms() - 120_000, "s1": None})
    lagging = gather(state, client, client.stream_arn, now_ms=clock.ms())
    ready, reasons = assess(lagging)
    assert any("1 shard(s) behind by up to 120s" in r for r in reasons)
    # a stream nobody reports on is NOT READY, saying why
    silent = gather(StateStore(InMemoryBigtable(), "job", clock.ms), client, client.stream_arn, now_ms=clock.ms())
    ready, reasons = assess(silent)
    assert not ready and any("without a report from a running reader" in r for r in reasons)
    assert any("no reader report" in line for line in render(silent))


def test_a_full_page_is_reported_as_pending_since_its_last_record(monkeypatch):
    monkeypatch.setattr(stream_source, "PAGES_PER_ROUND", 1)  # a round ends after one full page
    client = FakeStreamsClient()
    client.add_shard("s0")
    for i in range(1_500):
        client.put("s0", "INSERT", {"pk": {"S": f"k{i}"}}, {"pk": {"S": f"k{i}"}}, created_ms=1_000 + i)
    clock = SimClock()
    reader, _ = reader_for(client, clock)
    tracker = LocalTracker()
    drain_round(reader, tracker)
    assert reader.pending_since() == {"s0": 1_000 + 999}  # the last record of the full page
    drain_round(reader, tracker)
    assert reader.pending_since() == {"s0": None}  # a short page: at the head


def test_streams_calls_are_sized_to_fail_well_within_15_seconds():
    from ddb2bt.pipeline.connect.connections import StreamsClientFactory

    client = StreamsClientFactory(region="us-east-1")()
    config = client.meta.config
    assert config.read_timeout == STREAMS_READ_TIMEOUT_S and config.connect_timeout == STREAMS_CONNECT_TIMEOUT_S
    assert STREAMS_CONNECT_TIMEOUT_S + STREAMS_READ_TIMEOUT_S < 15


class _Stop(Exception):
    pass


def test_a_silent_network_partition_is_named_at_the_first_timeout(monkeypatch, caplog):
    """An endpoint that accepts connections and never answers (what a silent
    partition looks like): the first DescribeStream fails after the read timeout
    and is logged as a WARNING naming the call, the endpoint and the timeout."""
    from ddb2bt.pipeline.connect.connections import StreamsClientFactory

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list = []
    done = threading.Event()

    def swallow() -> None:
        server.settimeout(0.2)
        while not done.is_set():
            try:
                held.append(server.accept()[0])  # never read, never answered
            except OSError:
                continue

    threading.Thread(target=swallow, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_DYNAMODB_STREAMS", endpoint)  # the spelling botocore reads
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    client = StreamsClientFactory(region="us-east-1")()
    arn = "arn:aws:dynamodb:us-east-1:000000000000:table/T/stream/2024-01-01T00:00:00.000"

    def stop(seconds):  # the first backoff: the warning is out, that is all this test needs
        raise _Stop()

    reader = PartitionReader(client, StreamPartition(arn, 0, 1), ReaderOptions(retry=RetryPolicy(0.1, 1.0, 60.0)),
                             lambda a: {}, None, sleep=stop)
    try:
        with caplog.at_level(logging.WARNING, logger="ddb2bt.pipeline.clients.retry"), pytest.raises(_Stop):
            reader.discover(LocalTracker())
    finally:
        done.set()
        for conn in held:
            conn.close()
        server.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "DescribeStream" in warnings[0] and endpoint in warnings[0] and "ReadTimeout" in warnings[0]
    assert "(1 attempt)" in warnings[0]


def test_partitions_can_follow_the_shard_count():
    import argparse

    from ddb2bt.pipeline.options import (MAX_AUTO_PARTITIONS, SHARDS_PER_PARTITION, auto_partitions,
                                         partitions_arg)

    assert auto_partitions(0) == 1 and auto_partitions(1) == 1
    assert auto_partitions(SHARDS_PER_PARTITION) == 1 and auto_partitions(SHARDS_PER_PARTITION + 1) == 2
    assert auto_partitions(1_000) == min(MAX_AUTO_PARTITIONS, 125)
    assert auto_partitions(10 ** 6) == MAX_AUTO_PARTITIONS
    assert partitions_arg("auto") == "auto" and partitions_arg("3") == 3
    with pytest.raises(argparse.ArgumentTypeError):
        partitions_arg("0")


class CountingState(InMemoryBigtable):
    """The in-memory state table, counting the checkpoint rows each read returns."""

    def __init__(self) -> None:
        super().__init__()
        self.rows_read = []

    def read_prefix(self, prefix, limit=None):
        out = super().read_prefix(prefix, limit)
        if b"#ckpt#" in prefix:
            self.rows_read.append(len(out))
        return out

    def read_keys(self, keys):
        out = super().read_keys(keys)
        self.rows_read.append(len(out))
        return out


def test_discovery_reads_the_checkpoints_of_its_own_shards_not_the_streams_history():
    """A stream that ran for months has a checkpoint row for every shard it ever
    had (finished). A partition's discovery reads only the rows it plans with —
    its shards and their parents — not the thousands of the stream's past."""
    from ddb2bt.pipeline.control.state import ShardCheckpoint

    client = FakeStreamsClient(describe_page=LISTING_PAGE)
    for i in range(40):
        client.add_shard(f"shardId-{i:05d}")
    clock = SimClock()
    backend = CountingState()
    state = StateStore(backend, "job", clock.ms)
    state.save_checkpoints(ShardCheckpoint(client.stream_arn, f"shardId-old-{i:05d}", "1", finished=True)
                           for i in range(3_000))
    readers = [PartitionReader(client, StreamPartition(client.stream_arn, i, 8), ReaderOptions(retry=FAST),
                               state.load_checkpoints, now_ms=clock.ms, sleep=clock.sleep,
                               directory=ShardDirectory(clock), pacer=ShardPacer(clock=clock, sleep=clock.sleep))
               for i in range(8)]
    trackers = [LocalTracker() for _ in readers]
    for reader, tracker in zip(readers, trackers):
        drain_round(reader, tracker)
    assert sorted(s for r in readers for s in r.shard_ids()) == sorted(client.shards)  # every shard read
    assert max(backend.rows_read) == 0  # nothing checkpointed yet among the 40 (the old rows never read)
    state.save_checkpoints(ShardCheckpoint(client.stream_arn, s, "5") for s in list(client.shards)[:20])
    client.close_shard("shardId-00000")
    client.add_shard("shardId-child", parent_id="shardId-00000")
    state.save_checkpoints([ShardCheckpoint(client.stream_arn, "shardId-00000", "9", finished=True)])
    backend.rows_read.clear()
    clock.sleep(30.0)
    for _ in range(2):
        for reader, tracker in zip(readers, trackers):
            drain_round(reader, tracker)
    assert "shardId-child" in {s for r in readers for s in r.shard_ids()}  # started: its parent is finished
    assert backend.rows_read and max(backend.rows_read) <= 2  # the child's parent, the closed shard: not 3,000


def test_a_launch_asks_whether_the_job_ran_before_with_one_row_not_the_streams_history():
    from ddb2bt.pipeline.connect.preflight import settle_start
    from ddb2bt.pipeline.control.state import ShardCheckpoint

    backend = CountingState()
    state = StateStore(backend, "job", lambda: 1)
    arn = "arn:aws:dynamodb:us-east-1:1:table/T/stream/2024-01-01T00:00:00.000"
    state.save_checkpoints(ShardCheckpoint(arn, f"shardId-{i:05d}", "1", finished=True) for i in range(500))
    assert settle_start(state, arn, "trim_horizon", 1).fresh is False  # it ran before: not a fresh start
    assert backend.rows_read == [1]
