"""Caught up means caught up in time (docs/design.md §7.8), with a fake clock:
the real PartitionReader reads a fake stream, the real lag tracker sees what it
reads and what the sink applies, and the catch-up rule decides. A table under
steady writes is caught up; a lagging shard is not; an empty page in the middle
of a shard is not the head; a quiet shard is, once its empty pages last."""
from __future__ import annotations

from prometheus_client import CollectorRegistry

from ddb2bt.pipeline.control.catchup import (HEAD_EMPTY_PAGES, HEAD_EMPTY_S, LIVE_LAG_BOUND_S, LIVE_SETTLE_S,
                                             CatchUpReport, Settling, ShardView, caught_up, summarize, worst)
from ddb2bt.pipeline.observe.metrics import PipelineMetrics
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.source.stream_source import (LocalTracker, PartitionReader, ReaderOptions, StreamPartition,
                                                  drain_round)
from ddb2bt.pipeline.testing.fakes import FakeStreamsClient
from ddb2bt.transforms.model import ChangeRecord

START_MS = 1_800_000_000_000
HANDOFF_MS = START_MS - 60_000  # the backfill began a minute before
POLL_MS = 1_000  # the reader polls about once a second


class World:
    """A fake stream with shards, a reader of them, a wall clock, and a sink that
    applies what was read after ``apply_delay_ms``."""

    def __init__(self, shards=("s",)) -> None:
        self.now_ms = START_MS
        self.client = FakeStreamsClient()
        for shard in shards:
            self.client.add_shard(shard)
        self.metrics = PipelineMetrics(CollectorRegistry(), clock=lambda: self.now_ms / 1000)
        self.reader = PartitionReader(self.client, StreamPartition(self.client.stream_arn, 0, 1),
                                      ReaderOptions(retry=RetryPolicy(0.001, 0.001, 1.0), discovery_interval_s=3600),
                                      lambda *_: {}, self.metrics, now_ms=lambda: self.now_ms,
                                      sleep=lambda s: None)
        self.tracker = LocalTracker()
        self.n = 0

    def write(self, shard: str, created_ms: int) -> None:
        self.n += 1
        key = {"pk": {"S": f"k{self.n}"}}
        self.client.put(shard, "INSERT", key, key, created_ms=created_ms)

    def round(self, apply: bool = True) -> None:
        """One read round; what it read is applied (the sink) unless ``apply`` is False."""
        elements, _ = drain_round(self.reader, self.tracker)
        if apply:
            for rec in (e for e in elements if isinstance(e, ChangeRecord)):
                self.metrics.lag.on_applied(rec.position.stream_arn, rec.position.shard_id, rec.change_ms, 1)

    def report(self) -> CatchUpReport:
        stream = self.client.stream_arn
        return summarize([self.metrics.lag.view(stream, s) for s in self.reader.shard_ids()], self.now_ms)

    def tick(self, ms: int = POLL_MS) -> None:
        self.now_ms += ms


def test_a_table_under_steady_writes_is_caught_up_and_settles():
    """26 changes a second that never pause: the old rule ("the last round
    found nothing new") never held; in time, the tail is seconds behind."""
    w = World()
    settling = Settling()
    live_at = None
    for second in range(60):
        for i in range(26):  # AWS stamps to the whole second
            w.write("s", w.now_ms - w.now_ms % 1000)
        w.round()
        assert w.reader.shard_ids() == ["s"]
        report = w.report()
        assert report.lag_ms is not None and report.lag_ms <= 2_000
        if settling.observe(caught_up(report, HANDOFF_MS), w.now_ms) and live_at is None:
            live_at = second
        w.tick()
    assert live_at is not None and live_at <= LIVE_SETTLE_S + 1


def test_a_lagging_shard_holds_the_table_back():
    w = World(shards=("fast", "slow"))
    for _ in range(30):
        w.write("fast", w.now_ms)
        w.write("slow", w.now_ms - int(LIVE_LAG_BOUND_S * 1000) - 30_000)  # its changes are a minute old
        w.round()
        w.tick()
    report = w.report()
    assert report.lag_ms > LIVE_LAG_BOUND_S * 1000
    assert not caught_up(report, HANDOFF_MS)


def test_changes_read_but_not_applied_count_as_lag():
    w = World()
    w.write("s", w.now_ms - 45_000)
    w.round(apply=False)
    w.tick()
    assert not caught_up(w.report(), HANDOFF_MS)


def test_an_empty_page_mid_shard_is_not_the_head():
    """A shard that was busy an hour ago (a backlog just drained up to there)
    and returns one empty page: its lag is still an hour, not 0."""
    w = World()
    w.write("s", w.now_ms - 3_600_000)
    w.round()
    w.tick()
    w.round()  # an empty page
    report = w.report()
    assert report.lag_ms >= 3_600_000
    assert not caught_up(report, HANDOFF_MS)


def test_a_quiet_shard_is_at_the_head_once_its_empty_pages_last():
    w = World()
    w.write("s", HANDOFF_MS - 600_000)  # its last change is old: the table went quiet
    w.round()
    pages = 0
    while pages < HEAD_EMPTY_PAGES or pages * POLL_MS < HEAD_EMPTY_S * 1000:
        w.tick()
        w.round()
        pages += 1
        if pages == 1:
            assert not caught_up(w.report(), HANDOFF_MS), "one empty page is not the head"
    w.tick()
    w.round()
    report = w.report()
    assert report.lag_ms == 0 and report.position_ms >= HANDOFF_MS
    assert caught_up(report, HANDOFF_MS)
    # ... until a change arrives: the run of empty pages is over.
    w.write("s", w.now_ms - 120_000)
    w.round(apply=False)
    assert not caught_up(w.report(), HANDOFF_MS)


def test_a_shard_not_yet_past_the_handoff_is_not_caught_up():
    report = summarize([ShardView(last_applied_ms=HANDOFF_MS - 5_000)], HANDOFF_MS - 4_000)
    assert report.lag_ms == 1_000
    assert not caught_up(report, HANDOFF_MS)
    assert caught_up(summarize([ShardView(last_applied_ms=HANDOFF_MS + 1)], HANDOFF_MS + 500), HANDOFF_MS)


def test_the_service_behind_latest_figure_is_the_lag_where_given():
    view = ShardView(last_applied_ms=START_MS - 3_600_000, behind_ms=0)  # Kinesis: at the tip
    assert summarize([view], START_MS).lag_ms == 0
    assert summarize([ShardView(last_applied_ms=START_MS, behind_ms=90_000)], START_MS).lag_ms == 90_000


def test_unknown_is_never_caught_up_and_the_worst_report_wins():
    assert not caught_up(summarize([], START_MS), HANDOFF_MS)
    assert not caught_up(summarize([ShardView()], START_MS), HANDOFF_MS)
    assert worst(CatchUpReport(0, START_MS), CatchUpReport(50_000, HANDOFF_MS)) == CatchUpReport(50_000, HANDOFF_MS)
    assert worst(CatchUpReport(0, START_MS), CatchUpReport(None, START_MS)).lag_ms is None


def test_settling_restarts_after_a_break():
    s = Settling(settle_s=10)
    assert not s.observe(True, 0)
    assert not s.observe(False, 5_000)
    assert not s.observe(True, 6_000)
    assert not s.observe(True, 15_000)
    assert s.observe(True, 16_000)
