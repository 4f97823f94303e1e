"""The Kinesis source's reading rules with a fake Kinesis client (what moto cannot
do: trimming, throttle limits): the per-shard pacing, trimmed checkpoints stopping
loudly, closed shards ending, parents before children, tableName filtering, and
the whole reader (PartitionReader) over it."""
from __future__ import annotations

import json

import pytest
from botocore.exceptions import ClientError

from ddb2bt.pipeline.source.kinesis import (KinesisStreamsClient, ShardPacer, kinesis_stream_arn,
                                            parse_kinesis_stream_arn)
from ddb2bt.pipeline.testing.kinesis_cdc import FakeKinesis
from ddb2bt.pipeline.source.stream_source import LocalTracker, PartitionReader, ReaderOptions, StreamPartition, drain
from ddb2bt.transforms.errors import ChangesLostError
from ddb2bt.transforms.model import ShardClosed


def doc(table, pk, n, created=1_700_000_000_000):
    return {"eventName": "INSERT", "tableName": table, "eventID": f"e{pk}{n}",
            "dynamodb": {"ApproximateCreationDateTime": created + n, "Keys": {"pk": {"S": pk}},
                         "NewImage": {"pk": {"S": pk}, "n": {"N": str(n)}}, "SizeBytes": 10}}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_pacer_keeps_each_shard_within_five_calls_and_two_mb_per_second():
    clock = Clock()
    pacer = ShardPacer(clock=clock, sleep=clock.sleep)
    for _ in range(10):
        pacer.before_call("s", "a")
        pacer.after_call("s", "a", 0)
    assert clock.now == pytest.approx(9 * 0.2)  # 10 calls: 5 per second
    pacer.before_call("s", "b")  # another shard has its own budget
    assert clock.now == pytest.approx(9 * 0.2)
    pacer.after_call("s", "b", 4 * 1024 * 1024)  # a 4 MB page: the next call waits 2 s
    start = clock.now
    pacer.before_call("s", "b")
    assert clock.now - start == pytest.approx(2.0)


NOW_MS = 1_700_000_100_000  # "now" for the records of doc(): a little after them


def reader_over(fake, table="Catalog", options=ReaderOptions(), checkpoints=None, precision="auto"):
    clock = Clock()
    client = KinesisStreamsClient(fake, "cdc", table, precision, pacer=ShardPacer(clock=clock, sleep=clock.sleep),
                                  now_ms=lambda: NOW_MS)
    arn = kinesis_stream_arn(table, "cdc")
    reader = PartitionReader(client, StreamPartition(arn, 0, 1), options, lambda *_: dict(checkpoints or {}),
                             sleep=lambda s: None)
    return reader, arn


def test_reads_parents_before_children_keeps_its_table_and_ends_closed_shards():
    fake = FakeKinesis()
    fake.add("p", [doc("Catalog", "a", 1), doc("Orders", "x", 1), doc("Catalog", "a", 2)], closed=True)
    fake.add("c", [doc("Catalog", "a", 3)], parent="p", first_seq=10)
    reader, arn = reader_over(fake)
    tracker = LocalTracker()
    first, _ = drain(reader.read_round(tracker))
    keys = [(r.keys["pk"]["S"], r.new_image["n"]["N"]) for r in first if not isinstance(r, ShardClosed)]
    assert keys == [("a", "1"), ("a", "2")]  # only Catalog's, the child not yet (its parent is open)
    assert isinstance(first[-1], ShardClosed) and first[-1].shard_id == "p"
    assert all(r.change_us == r.change_ms * 1000 for r in first if not isinstance(r, ShardClosed))
    assert parse_kinesis_stream_arn(arn) == ("Catalog", "cdc")


def test_the_services_behind_latest_reaches_the_readers_catch_up_rule():
    """Kinesis says how far behind the tip a page is (MillisBehindLatest): the
    adapter passes it on, and the reader's lag tracker keeps it (control/catchup.py)."""
    from prometheus_client import CollectorRegistry

    from ddb2bt.pipeline.observe.metrics import PipelineMetrics

    fake = FakeKinesis()
    fake.add("a", [doc("Catalog", "a", 1)])
    clock = Clock()
    client = KinesisStreamsClient(fake, "cdc", "Catalog", "auto", pacer=ShardPacer(clock=clock, sleep=clock.sleep),
                                  now_ms=lambda: NOW_MS)
    it = client.get_shard_iterator(StreamArn="x", ShardId="a", ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
    assert client.get_records(ShardIterator=it)["MillisBehindLatest"] == 0
    metrics = PipelineMetrics(CollectorRegistry())
    arn = kinesis_stream_arn("Catalog", "cdc")
    reader = PartitionReader(client, StreamPartition(arn, 0, 1), ReaderOptions(), lambda *_: {}, metrics,
                             sleep=lambda s: None)
    drain(reader.read_round(LocalTracker()))
    assert metrics.lag.view(arn, "a").behind_ms == 0


def test_a_trimmed_checkpoint_stops_loudly():
    from ddb2bt.pipeline.control.state import ShardCheckpoint

    fake = FakeKinesis()
    fake.add("s", [doc("Catalog", "a", n) for n in range(1, 6)])
    fake.trimmed["s"] = 3  # records 1..3 expired; the checkpoint is after record 2
    reader, arn = reader_over(fake, checkpoints={"s": ShardCheckpoint(kinesis_stream_arn("Catalog", "cdc"), "s", "2")})
    with pytest.raises(ChangesLostError, match="LOST"):
        drain(reader.read_round(LocalTracker()))


def test_a_kept_checkpoint_resumes_right_after_it():
    from ddb2bt.pipeline.control.state import ShardCheckpoint

    fake = FakeKinesis()
    fake.add("s", [doc("Catalog", "a", n) for n in range(1, 6)])
    fake.trimmed["s"] = 1  # record 1 expired, the checkpoint (record 2) is still there
    reader, arn = reader_over(fake, checkpoints={"s": ShardCheckpoint(kinesis_stream_arn("Catalog", "cdc"), "s", "2")})
    out, _ = drain(reader.read_round(LocalTracker()))
    assert [r.new_image["n"]["N"] for r in out] == ["3", "4", "5"]


def test_empty_pages_at_a_kept_checkpoint_are_followed_not_taken_for_trimming():
    """Kinesis may answer GetRecords with empty pages before the records at an
    iterator (MillisBehindLatest above 0): the check of the checkpointed record
    follows NextShardIterator, and the restart resumes right after it."""
    from ddb2bt.pipeline.control.state import ShardCheckpoint

    fake = FakeKinesis()
    fake.add("s", [doc("Catalog", "a", n) for n in range(1, 6)])
    fake.empty_pages["s"] = 3
    reader, arn = reader_over(fake, checkpoints={"s": ShardCheckpoint(kinesis_stream_arn("Catalog", "cdc"), "s", "2")})
    out = []
    tracker = LocalTracker()
    for _ in range(8):  # the reading itself also gets the empty pages first: a few rounds
        got, _ = drain(reader.read_round(tracker))
        out += got
    assert [r.new_image["n"]["N"] for r in out] == ["3", "4", "5"]


def test_a_checkpoint_trimmed_behind_empty_pages_still_stops_loudly():
    from ddb2bt.pipeline.control.state import ShardCheckpoint

    fake = FakeKinesis()
    fake.add("s", [doc("Catalog", "a", n) for n in range(1, 6)])
    fake.trimmed["s"] = 3
    fake.empty_pages["s"] = 3
    reader, arn = reader_over(fake, checkpoints={"s": ShardCheckpoint(kinesis_stream_arn("Catalog", "cdc"), "s", "2")})
    with pytest.raises(ChangesLostError, match="LOST"):
        drain(reader.read_round(LocalTracker()))


def test_trimmed_restart_continues_from_the_oldest_record():
    from ddb2bt.pipeline.control.state import ShardCheckpoint

    fake = FakeKinesis()
    fake.add("s", [doc("Catalog", "a", n) for n in range(1, 6)])
    fake.trimmed["s"] = 3
    reader, arn = reader_over(fake, options=ReaderOptions(on_trimmed="restart"),
                              checkpoints={"s": ShardCheckpoint(kinesis_stream_arn("Catalog", "cdc"), "s", "2")})
    out, _ = drain(reader.read_round(LocalTracker()))
    assert [r.new_image["n"]["N"] for r in out] == ["4", "5"]


def test_other_errors_are_not_taken_for_trimming():
    class Broken(FakeKinesis):
        def get_shard_iterator(self, **kw):
            if kw.get("ShardIteratorType") == "AT_SEQUENCE_NUMBER":
                raise ClientError({"Error": {"Code": "AccessDeniedException", "Message": "no"}}, "GetShardIterator")
            return super().get_shard_iterator(**kw)

    fake = Broken()
    fake.add("s", [doc("Catalog", "a", 1)])
    client = KinesisStreamsClient(fake, "cdc", "Catalog", pacer=ShardPacer(sleep=lambda s: None))
    with pytest.raises(ClientError, match="AccessDenied"):
        client.get_shard_iterator(StreamArn="x", ShardId="s", ShardIteratorType="AFTER_SEQUENCE_NUMBER",
                                  SequenceNumber="1")


def test_the_guarded_sink_checkpoints_after_its_writes_and_counts_stale_changes():
    """GuardedBatchingWriter: out-of-order changes of one shard, one flush: the
    target holds the newest state, the checkpoint is the last position read, and
    the older change is counted stale."""
    from prometheus_client import CollectorRegistry

    from ddb2bt.pipeline.observe.metrics import PipelineMetrics
    from ddb2bt.pipeline.sink.guarded import GuardedBatchingWriter
    from ddb2bt.pipeline.sink.sink import SinkConfig
    from ddb2bt.pipeline.control.state import StateStore
    from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
    from ddb2bt.transforms.config import load_mapping
    from ddb2bt.transforms.dofns import map_record_guarded
    from ddb2bt.transforms.model import INSERT, MODIFY, ChangeRecord, MappedBatch, StreamPosition

    mapping = load_mapping("examples/product_catalog.yaml")
    arn = kinesis_stream_arn("ProductCatalog", "cdc")
    key = {"pk": {"S": "hats"}, "sk": {"S": "b"}}
    v1, v2 = dict(key, Price={"N": "1"}), dict(key, Price={"N": "2"})
    newer = ChangeRecord(MODIFY, key, v2, v1, 2000, StreamPosition(arn, "s", "1"), change_us=2_000_000)
    older = ChangeRecord(INSERT, key, v1, None, 1000, StreamPosition(arn, "s", "2"), change_us=1_000_000)
    bt = InMemoryBigtable()
    store = StateStore(bt, "job", lambda: 5000)
    metrics = PipelineMetrics(CollectorRegistry()).for_table("job")
    writer = GuardedBatchingWriter(bt, store, SinkConfig(ordering_guard=True), metrics)
    writer.add(MappedBatch(tuple(map_record_guarded(mapping, r, lambda: 0) for r in (newer, older))))
    assert writer.flush() == []
    row = bt.latest("product_catalog")[b"hats#b"]
    assert row[("SKU", b"Price")] == (2).to_bytes(8, "big")
    assert store.load_checkpoints(arn)["s"].sequence_number == "2"
    assert (writer.stats.applied, writer.stats.stale) == (1, 1)
    assert metrics.ordering_guard.labels("stale")._value.get() == 1


@pytest.mark.parametrize("created, precision, why", [
    (1_700_000_050, "auto", "before Kinesis Data Streams for DynamoDB existed"),  # seconds, read as ms: 1970
    (1_700_000_050, "millisecond", "before Kinesis Data Streams for DynamoDB existed"),
    (NOW_MS - 49 * 3600 * 1000 - 3_600_001, "auto", "older than the stream's retention"),  # FakeKinesis: 48 h
    (NOW_MS + 301_000, "auto", "ahead of this host's clock"),
    ((NOW_MS - 1000) // 1000, "microsecond", "before Kinesis Data Streams for DynamoDB existed"),  # ms read as µs
])
def test_a_record_stamped_at_an_impossible_time_stops_the_reader_before_anything_is_written(created, precision,
                                                                                             why):
    """Given ApproximateCreationDateTime in seconds, `precision: auto` read it as
    milliseconds (January 1970): cells written then, and every later change
    dropped as older. A time before the source could exist, older than its
    retention, or ahead of the clock is an error naming the record and the
    precision setting, raised before the page reaches the sink."""
    from ddb2bt.transforms.errors import ConfigError

    fake = FakeKinesis()
    valid = (NOW_MS - 10_000) * (1000 if precision == "microsecond" else 1)
    fake.add("s", [doc("Catalog", "a", 1, created=valid), doc("Catalog", "a", 2, created=created - 2)])
    reader, _ = reader_over(fake, precision=precision)
    emitted = []
    with pytest.raises(ConfigError) as err:
        for element in reader.read_round(LocalTracker()):
            emitted.append(element)
    message = str(err.value)
    assert "source.kinesis.precision" in message and f"precision {precision!r}" in message
    assert "record 2 of shard s" in message and why in message and str(created) in message
    assert emitted == [], "nothing of the page reaches the sink"


def test_records_within_the_retention_and_the_skew_are_read():
    fake = FakeKinesis()
    fake.add("s", [doc("Catalog", "a", 1, created=NOW_MS - 48 * 3600 * 1000), doc("Catalog", "a", 2,
                                                                                  created=NOW_MS + 60_000)])
    reader, _ = reader_over(fake)
    out, _ = drain(reader.read_round(LocalTracker()))
    assert len(out) == 2


class SharedStream:
    """A Kinesis stream shared with another table, on one simulated clock: every
    call takes ``call_s``; ``on_call`` runs before each (it sees the reader's
    state after the page before). Reads ``Catalog`` through the adapter."""

    def __init__(self, fake, call_s: float, hand_back: bool = False, behind_figure: bool = True,
                 tip_ms: int = 0) -> None:
        from prometheus_client import CollectorRegistry

        from ddb2bt.pipeline.clients.dynamodb import ShardPacer as ReaderPacer
        from ddb2bt.pipeline.observe.metrics import PipelineMetrics

        self.fake, self.clock, self.call_s, self.behind_figure, self.tip_ms = fake, Clock(), call_s, behind_figure, tip_ms
        self.pages: list = []
        self.on_call = lambda: None
        self.metrics = PipelineMetrics(CollectorRegistry(), clock=self.clock)  # the catch-up rule's clock too
        client = KinesisStreamsClient(self, "cdc", "Catalog", "auto",
                                      pacer=ShardPacer(clock=self.clock, sleep=self.clock.sleep), now_ms=lambda: NOW_MS)
        self.arn = kinesis_stream_arn("Catalog", "cdc")
        pacer = ReaderPacer(clock=self.clock, sleep=self.clock.sleep) if hand_back else None
        self.reader = PartitionReader(client, StreamPartition(self.arn, 0, 1), ReaderOptions(), lambda *_: {},
                                      self.metrics, now_ms=self.now_ms, sleep=lambda s: None, pacer=pacer,
                                      hand_back_pacing=hand_back)

    def now_ms(self) -> int:
        return int(self.clock.now * 1000)

    def __getattr__(self, name):
        return getattr(self.fake, name)

    def get_records(self, **kw):
        self.on_call()
        self.clock.now += self.call_s
        page = self.fake.get_records(**kw)
        self.pages.append(len(page["Records"]))
        if not self.behind_figure:  # an endpoint that does not say how far behind the tip a page is
            page.pop("MillisBehindLatest", None)
        elif page.get("MillisBehindLatest") == 0:  # at the tip, as a busy stream may still say it
            page["MillisBehindLatest"] = self.tip_ms
        return page

    def view(self):
        return self.metrics.lag.view(self.arn, "s")


@pytest.mark.parametrize("behind_figure,behind_ms", [(True, 60_000), (False, 60_000), (True, 5)],
                         ids=["behind-the-tip", "no-figure", "full-pages-saying-near-the-tip"])
def test_a_page_of_only_another_tables_records_behind_the_tip_is_not_taken_for_the_head(behind_figure, behind_ms):
    """A stream shared by two tables: this table's records wait behind the other
    table's backlog, which fills page after page for longer than the head rule's
    window (control/catchup.py). Those pages come back without records of ours,
    behind the tip: not one of them may count as empty — no head proof (it would
    say every record created before its first page was read), no step toward the
    catch-up rule's head — and the round is not at the head (a run until idle
    would end early). Kinesis says so (MillisBehindLatest > 0); where a page
    lacks the figure, the adapter's count of the records it passed over does;
    and a full page is behind the tip whatever its figure (moto's is the spread
    of the records' creation times: a backlog written within a second says less
    than TIP_SLACK_MS)."""
    from ddb2bt.pipeline.control.catchup import HEAD_EMPTY_PAGES, HEAD_EMPTY_S, at_head

    pages_of_backlog = HEAD_EMPTY_PAGES + 2
    limit = 1000  # the reader's Limit per call
    fake = FakeKinesis()
    ours = [doc("Catalog", "a", n) for n in range(1, 4)]  # created before any page of the backlog is read
    fake.add("s", [doc("Orders", "x", n) for n in range(pages_of_backlog * limit)] + ours)
    fake.behind_ms = behind_ms
    stream = SharedStream(fake, call_s=HEAD_EMPTY_S, behind_figure=behind_figure)  # pages span the window
    looked: list = []

    def before_each_call():  # the reader's state after every page before this call
        view = stream.view()
        looked.append((stream.reader.heads(), view.empty_pages, at_head(view, stream.now_ms())))

    stream.on_call = before_each_call
    read: list = []
    rounds: list = []
    while not read:
        out, result = drain(stream.reader.read_round(LocalTracker()))
        read += [r for r in out if not isinstance(r, ShardClosed)]
        rounds.append(result.at_head)
    assert [r.new_image["n"]["N"] for r in read] == ["1", "2", "3"]
    assert stream.pages[:pages_of_backlog] == [limit] * pages_of_backlog  # the other table's backlog, page by page
    assert looked[1:pages_of_backlog + 1] == [({}, 0, False)] * pages_of_backlog
    assert rounds == [False]  # the backlog and ours in one round: pages behind the tip take another turn


def test_a_round_of_another_tables_backlog_hands_its_pacing_back_and_is_not_idle():
    """Paced as on AWS (the runner gets the wait): a round that read only the
    other table's records behind the tip is not idle — it hands the wait back
    (``paced_s``), and the shard's oldest unread record is as old as the page
    says (MillisBehindLatest), not "at the head"."""
    fake = FakeKinesis()
    fake.add("s", [doc("Orders", "x", n) for n in range(3000)] + [doc("Catalog", "a", 1)])
    stream = SharedStream(fake, call_s=0.01, hand_back=True)
    tracker = LocalTracker()
    out, result = drain(stream.reader.read_round(tracker))
    assert [r for r in out if not isinstance(r, ShardClosed)] == []
    assert result.paced_s is not None and not result.at_head
    assert stream.reader.idle_decision(tracker, result) == "continue"
    assert stream.reader.pending_since() == {"s": stream.now_ms() - fake.behind_ms}  # as old as the page says


@pytest.mark.parametrize("tip_ms", [0, 7], ids=["exactly-at-the-tip", "a-few-ms-behind"])
def test_at_the_tip_pages_of_only_another_tables_records_count_toward_the_head(tip_ms):
    """A quiet table on a busy shared stream: every page holds the other table's
    newest record and reaches the tip (MillisBehindLatest 0). Nothing of this
    table can be waiting behind such a page, so it counts as empty: the head is
    proven (a trimmed checkpoint's restart can rely on it, docs/design.md §8.2),
    the catch-up rule sees it, and a run until idle can end. Under constant
    writes a page at the tip may say a few ms (within TIP_SLACK_MS): the same,
    the head's time then that much earlier."""
    from ddb2bt.pipeline.control.catchup import HEAD_EMPTY_PAGES, HEAD_EMPTY_S, at_head

    fake = FakeKinesis()
    fake.add("s", [doc("Orders", "x", 0)])
    stream = SharedStream(fake, call_s=HEAD_EMPTY_S, tip_ms=tip_ms)
    n = iter(range(1, 1000))
    page_ms = []

    def the_other_table_writes():
        fake.shards["s"].append({"SequenceNumber": str(len(fake.shards["s"]) + 1),
                                 "Data": json.dumps(doc("Orders", "x", next(n))).encode()})

    def on_call():
        page_ms.append(stream.now_ms() + int(HEAD_EMPTY_S * 1000))  # when the page comes back
        the_other_table_writes()

    stream.on_call = on_call
    results = [drain(stream.reader.read_round(LocalTracker()))[1] for _ in range(HEAD_EMPTY_PAGES + 1)]
    assert all(stream.pages) and all(r.at_head for r in results)  # a record of the other table on every page
    proven = stream.reader.heads().get("s")
    assert proven in [t - tip_ms for t in page_ms]  # a page's time, dated back by what it said
    view = stream.view()
    assert view.empty_pages == HEAD_EMPTY_PAGES + 1 and at_head(view, stream.now_ms())
    assert view.empty_since_ms == page_ms[0] - tip_ms


def test_an_empty_page_behind_the_tip_is_not_a_step_toward_the_head():
    """Kinesis documents empty pages mid-shard; one that says it is behind the
    tip (MillisBehindLatest > 0) has records ahead: another turn, and no step
    toward the head however many come in a row."""
    from ddb2bt.pipeline.control.catchup import HEAD_EMPTY_PAGES, HEAD_EMPTY_S

    fake = FakeKinesis()
    fake.add("s", [doc("Catalog", "a", n) for n in range(1, 3)])
    fake.empty_pages["s"] = HEAD_EMPTY_PAGES + 2  # a new iterator's first pages are empty, records ahead
    stream = SharedStream(fake, call_s=HEAD_EMPTY_S)
    looked: list = []
    stream.on_call = lambda: looked.append((stream.reader.heads(), stream.view().empty_pages))
    out, result = drain(stream.reader.read_round(LocalTracker()))
    assert [r.new_image["n"]["N"] for r in out if not isinstance(r, ShardClosed)] == ["1", "2"]
    assert stream.pages[:HEAD_EMPTY_PAGES + 2] == [0] * (HEAD_EMPTY_PAGES + 2)
    assert looked[1:HEAD_EMPTY_PAGES + 3] == [({}, 0)] * (HEAD_EMPTY_PAGES + 2)


def test_a_round_of_only_pages_behind_the_tip_is_not_at_the_head():
    """A round that read PAGES_PER_ROUND pages of another table's backlog, none of
    them ours, is not idle: the next round comes at once."""
    from ddb2bt.pipeline.source.stream_source import GET_RECORDS_LIMIT, PAGES_PER_ROUND

    fake = FakeKinesis()
    fake.add("s", [doc("Orders", "x", n) for n in range((PAGES_PER_ROUND + 2) * GET_RECORDS_LIMIT)])
    stream = SharedStream(fake, call_s=0.01)
    tracker = LocalTracker()
    out, result = drain(stream.reader.read_round(tracker))
    assert out == [] and len(stream.pages) == PAGES_PER_ROUND and not result.at_head
    assert stream.reader.idle_decision(tracker, result) == "continue"


def test_a_page_behind_the_tip_ends_the_catch_up_rules_run_of_empty_pages():
    """Steps toward the head at the tip, then a page that says records are ahead
    (an empty one, as Kinesis may answer a new iterator): the run starts over."""
    fake = FakeKinesis()
    fake.add("s", [doc("Orders", "x", 0)])
    stream = SharedStream(fake, call_s=0.2)
    for _ in range(3):
        drain(stream.reader.read_round(LocalTracker()))
    assert stream.view().empty_pages == 3
    fake.empty_pages["s"] = 1  # the next iterator's first page: empty, records ahead
    fake.shards["s"].append({"SequenceNumber": "2", "Data": json.dumps(doc("Orders", "x", 1)).encode()})
    stream.reader._iterators.clear()  # a new iterator (as after an expired one), from the start
    drain(stream.reader.read_round(LocalTracker()))
    assert stream.pages[-2:] == [0, 2] and stream.view().empty_pages == 1  # broken, then the tip again


def test_a_page_of_ours_behind_the_tip_takes_another_turn():
    """A page with fewer than 1,000 of this table's records (the rest another
    table's) that says records are ahead is read on at once, in the same round."""
    from ddb2bt.pipeline.source.stream_source import GET_RECORDS_LIMIT

    fake = FakeKinesis()
    n = GET_RECORDS_LIMIT + 6
    fake.add("s", [doc("Catalog" if i % 2 else "Orders", "a", i) for i in range(n)])
    stream = SharedStream(fake, call_s=0.01, behind_figure=True)
    out, _ = drain(stream.reader.read_round(LocalTracker()))
    assert len([r for r in out if not isinstance(r, ShardClosed)]) == n // 2 and len(stream.pages) == 2


def test_without_the_figure_a_round_of_another_tables_backlog_is_not_idle_either():
    """An endpoint that gives no MillisBehindLatest: a page of only another
    table's records is taken for one behind the tip — paced, the round hands the
    wait back and the shard counts as not at its head (its oldest unread record
    no older than now: the page cannot say more)."""
    fake = FakeKinesis()
    fake.add("s", [doc("Orders", "x", n) for n in range(3000)] + [doc("Catalog", "a", 1)])
    stream = SharedStream(fake, call_s=0.01, hand_back=True, behind_figure=False)
    tracker = LocalTracker()
    out, result = drain(stream.reader.read_round(tracker))
    assert out == [] and result.paced_s is not None and not result.at_head
    assert stream.reader.idle_decision(tracker, result) == "continue"
    assert stream.reader.pending_since() == {"s": stream.now_ms()}
