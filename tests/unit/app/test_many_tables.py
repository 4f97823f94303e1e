"""Many tables in one job, the parts without services: routing by stream, the
per-stream DoFn, what makes two mappings clash, --mapping expansion, the job's
phase, the per-table status lines, and the idle rule of the shared reader."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from ddb2bt.pipeline.cutover.controller import _overall
from ddb2bt.pipeline.cutover.status import Facts, ShardStatus, render_tables
from ddb2bt.pipeline.io import LiveJob, ReplicateToBigtable
from ddb2bt.transforms.dofns import PerStreamFn
from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec
from ddb2bt.pipeline.services.jobs import load_all, mapping_sources
from ddb2bt.pipeline.source.stream_source import ReaderOptions
from ddb2bt.transforms.config import check_distinct_tables, load_mapping
from ddb2bt.transforms.errors import ConfigError
from ddb2bt.transforms.model import (ChangeRecord, MappedBatch, MappedChange, RecordBatch, ShardClosed,
                                     StreamPosition, stream_of)
from tests.conftest import ROOT

ARN = "arn:aws:dynamodb:us-east-1:000000000000:table/{}/stream/2024-01-01T00:00:00.000"
CATALOG = load_mapping(ROOT / "examples/product_catalog.yaml")
INVOICES = load_mapping(ROOT / "examples/invoices.yaml")


def record(table: str, seq: int) -> ChangeRecord:
    return ChangeRecord("INSERT", {"pk": {"S": "a"}}, {"pk": {"S": "a"}}, None, 1,
                        position=StreamPosition(ARN.format(table), "shardId-1", str(seq)))


def test_every_live_path_element_names_its_stream():
    a, b = record("A", 1), record("B", 2)
    assert stream_of(RecordBatch((a,))) == ARN.format("A")
    assert stream_of(MappedBatch((MappedChange(b),))) == ARN.format("B")
    assert stream_of(ShardClosed(ARN.format("C"), "shardId-1")) == ARN.format("C")
    assert stream_of(a) == ARN.format("A") and stream_of(MappedChange(b)) == ARN.format("B")
    for unroutable in (RecordBatch(()), dataclasses.replace(a, position=None)):
        with pytest.raises(ValueError, match="carries no stream position"):
            stream_of(unroutable)


class Recorder:
    """A DoFn's lifecycle, recorded."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def setup(self):
        self.log.append((self.name, "setup"))

    def start_bundle(self):
        self.log.append((self.name, "start"))

    def process(self, element):
        self.log.append((self.name, element.records[0].position.sequence_number))
        yield (self.name, element)

    def finish_bundle(self):
        self.log.append((self.name, "finish"))
        return iter([(self.name, "flushed")])

    def teardown(self):
        self.log.append((self.name, "teardown"))


def test_each_element_goes_to_its_own_tables_dofn_in_order():
    log: list = []
    fn = PerStreamFn({ARN.format("A"): Recorder("A", log), ARN.format("B"): Recorder("B", log)})
    fn.setup()
    fn.start_bundle()
    elements = [RecordBatch((record(t, i),)) for i, t in enumerate("ABBAB")]
    out = [o for e in elements for o in fn.process(e)]
    assert [name for name, _ in out] == list("ABBAB") and [e for _, e in out] == elements
    assert [o for o in fn.finish_bundle()] == [("A", "flushed"), ("B", "flushed")]
    fn.teardown()
    assert [x for x in log if x[0] == "A"] == [("A", "setup"), ("A", "start"), ("A", "0"), ("A", "3"),
                                               ("A", "finish"), ("A", "teardown")]
    assert [x[1] for x in log if x[0] == "B"] == ["setup", "start", "1", "2", "4", "finish", "teardown"]
    with pytest.raises(KeyError):  # a stream the job does not replicate is a bug, never silently dropped
        list(fn.process(RecordBatch((record("C", 9),))))


def renamed(mapping, name, source=None, target=None):
    return dataclasses.replace(mapping.with_overrides(table=target or mapping.target.table), name=name,
                               source=dataclasses.replace(mapping.source, table=source or mapping.source.table))


@pytest.mark.parametrize("second,what", [
    (renamed(INVOICES, "catalog_job", "Other", "other"), "the same state name (catalog_job)"),
    (renamed(INVOICES, "x", CATALOG.source.table, "other"), "the same source table (ProductCatalog)"),
    (renamed(INVOICES, "x", "Other", "t1"), "the same target table (local-project/local-instance/t1)"),
])
def test_two_mappings_of_one_job_may_share_no_name_source_or_target(second, what):
    first = renamed(CATALOG, "catalog_job", target="t1")
    check_distinct_tables([first, renamed(INVOICES, "x", "Other", "other")], ["a.yaml", "b.yaml"])
    with pytest.raises(ConfigError, match="a.yaml and b.yaml have " + what.replace("(", r"\(").replace(")", r"\)")):
        check_distinct_tables([first, second], ["a.yaml", "b.yaml"])


def test_mapping_values_expand_directories_and_lists(tmp_path):
    (tmp_path / "b.yaml").write_text((ROOT / "examples/invoices.yaml").read_text())
    (tmp_path / "a.yml").write_text((ROOT / "examples/product_catalog.yaml").read_text())
    (tmp_path / "notes.txt").write_text("not a mapping")
    assert mapping_sources([str(tmp_path)]) == [str(tmp_path / "a.yml"), str(tmp_path / "b.yaml")]
    assert mapping_sources(["x.yaml,example:videos", "y.yaml"]) == ["x.yaml", "example:videos", "y.yaml"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="--mapping: the directory .*empty holds no mapping files"):
        mapping_sources([str(empty)])
    with pytest.raises(ConfigError, match=r"--mapping: named more than once: .*a\.yml"):
        mapping_sources([str(tmp_path), str(tmp_path / "a.yml")])


def args(*mappings, **extra):
    base = dict(mapping=list(mappings), project=None, instance=None, table=None, job_name=None, command="run")
    return SimpleNamespace(**{**base, **extra})


def test_per_table_overrides_are_refused_with_several_mappings():
    two = ("example:product_catalog", "example:invoices")
    assert [m.name for m in load_all(args(*two))] == ["product_catalog", "invoices"]
    with pytest.raises(ConfigError, match="--bigtable-table: names one table but 2 mappings are given"):
        load_all(args(*two, table="t"))
    with pytest.raises(ConfigError, match="--job-name: names one job's state but 2 mappings are given"):
        load_all(args(*two, job_name="j"))
    assert load_all(args("example:product_catalog", table="t"))[0].target.table == "t"  # one: fine


def job(mapping, table: str) -> LiveJob:
    return LiveJob(mapping=mapping, stream_arn=ARN.format(table), reader=ReaderOptions(),
                   state=StateSpec(BigtableSpec("p", "i"), job=mapping.name))


def test_one_replication_of_several_jobs_refuses_a_stream_read_twice():
    a, b = job(CATALOG, "A"), job(INVOICES, "B")
    assert len(ReplicateToBigtable.from_jobs([a, b]).jobs) == 2
    with pytest.raises(ValueError, match="both read stream"):
        ReplicateToBigtable.from_jobs([a, dataclasses.replace(b, stream_arn=a.stream_arn)])
    with pytest.raises(ValueError, match="with several mappings build LiveJobs"):
        ReplicateToBigtable([CATALOG, INVOICES], stream_arn=a.stream_arn)


@pytest.mark.parametrize("phases,overall", [
    (["LIVE", "LIVE"], "LIVE"),
    (["LIVE", "CATCHING_UP"], "CATCHING_UP"),
    (["BACKFILLING", "LIVE", "CATCHING_UP"], "BACKFILLING"),
    (["LIVE", None], None),
])
def test_a_job_is_live_when_every_table_is(phases, overall):
    assert _overall(phases) == overall


def facts(phase, dead=0, lag_ms=0) -> Facts:
    now = 1_700_000_000_000
    return Facts(now_ms=now, phase=phase, handoff_ms=None, backfill_parts=4, backfill_done_parts=4,
                 backfill_items=10, backfill_expected=None, backfill_done_ms=now - 1000, dead_letters=dead, tail_held=True,
                 last_verify={"identical": True, "checked_at_ms": now},
                 shards=[ShardStatus("s1", "1", False, now - lag_ms if lag_ms else None, None)])


def test_status_of_several_tables_is_a_line_each_and_the_total():
    lines = render_tables([("orders", facts("LIVE")), ("carts", facts("CATCHING_UP", dead=2, lag_ms=3100))])
    assert lines[0] == "orders: READY  phase LIVE, backfill 4/4 parts, lag 0.0s, 0 dead letter(s)"
    assert lines[1].startswith("carts: NOT READY  phase CATCHING_UP, backfill 4/4 parts, lag 3.1s, 2 dead letter(s) — ")
    assert "the tail is still catching up" in lines[1] and "2 dead letter(s): inspect" in lines[1]
    assert lines[2] == "total: 1 of 2 table(s) READY, 1 LIVE, 2 dead letter(s); NOT READY"
    assert render_tables([("orders", facts("LIVE"))])[-1].endswith("; READY for cutover")


class Tracker:
    def __init__(self):
        from ddb2bt.pipeline.source.stream_source import PartitionRestriction, apply_claim

        self.r, self._apply, self.deferred = PartitionRestriction(), apply_claim, 0
        self.delays: list = []  # seconds of each deferral

    def current_restriction(self):
        return self.r

    def try_claim(self, claim):
        self.r = self._apply(self.r, claim)
        return True

    def defer_remainder(self, delay):
        self.deferred += 1
        self.delays.append(delay.micros / 1e6)


class NoState:
    def load_checkpoints(self, stream_arn, shard_ids=None):
        return {}

    def load_shard_heads(self, stream_arn):
        return {}

    def load_shared_rate(self, name):  # the DescribeStream schedule: always free
        return None

    def swap_shared_rate(self, name, expected, value):
        return True

    def close(self):
        pass


def test_an_idle_local_reader_sleeps_once_per_round_of_every_partition(monkeypatch):
    """One busy table must not wait for the other tables' idle sleeps: the shared
    reader sleeps only after every partition of the job had an idle round in a row."""
    from ddb2bt.pipeline.source import stream_sdf
    from ddb2bt.pipeline.source.stream_sdf import StreamSource, _ReadStreamPartitionsFn
    from ddb2bt.pipeline.source.stream_source import StreamPartition
    from ddb2bt.pipeline.testing.fakes import FakeStreamsClient

    clients = {t: FakeStreamsClient(table=t) for t in "AB"}
    for c in clients.values():
        c.add_shard("shardId-1")
    sleeps: list = []
    monkeypatch.setattr(stream_sdf.time, "sleep", sleeps.append)
    # The readers' GetRecords pacing on the same simulated time: time passes only
    # in the sleeps (a real idle sleep of 0.25 s outlasts the 200 ms pacing gap).
    from ddb2bt.pipeline.source import stream_source

    paced = stream_source.ShardPacer
    monkeypatch.setattr(stream_source, "ShardPacer", lambda **kw: paced(clock=lambda: sum(sleeps), **kw))
    options = ReaderOptions(poll_interval_s=0.25, sleep_when_idle=True)
    fn = _ReadStreamPartitionsFn([StreamSource(c.stream_arn, options, lambda c=c: c, NoState) for c in clients.values()])
    fn.setup()
    parts = {t: StreamPartition(c.stream_arn, 0, 1) for t, c in clients.items()}
    trackers = {t: Tracker() for t in "AB"}

    def round_of(table):
        list(fn.process(parts[table], tracker=trackers[table]))

    round_of("A")
    round_of("B")
    assert sleeps == [0.25]  # both idle: one sleep for the round of both
    clients["A"].put("shardId-1", "INSERT", {"pk": {"S": "k"}}, {"pk": {"S": "k"}}, None)
    round_of("A")  # busy: the idle streak starts again
    round_of("B")  # idle, but A was not: no sleep
    assert sleeps == [0.25]
    # A's early round is paced, not idle (its last page had a change: read again at
    # AWS's pace): every partition waited in a row, so one sleep, the shortest
    # wait — A's 0.2 s, not B's idle 0.25 s; then A reads again in the same call.
    round_of("A")
    assert sleeps == [0.25, pytest.approx(0.2)]
    clients["B"].put("shardId-1", "INSERT", {"pk": {"S": "j"}}, {"pk": {"S": "j"}}, None)
    # B is idle (its last page was empty): its idle poll is due 0.25 s after its
    # last call, not 0.2 s — B waits the 0.05 s left and reads in the same call.
    out = list(fn.process(parts["B"], tracker=trackers["B"]))
    assert [r.position.stream_arn for e in out for r in e.records] == [clients["B"].stream_arn]
    assert sleeps == [0.25, pytest.approx(0.2), pytest.approx(0.05)]
    # Next to a busy table an idle one is still polled at the idle poll, never at
    # AWS's pace: over many rounds A's calls are 0.25 s apart, B's 0.2 s.
    times: dict = {t: [] for t in "AB"}
    for t, c in clients.items():
        c.get_records = lambda get=c.get_records, t=t, **kw: (times[t].append(sum(sleeps)), get(**kw))[1]
    for i in range(40):
        clients["B"].put("shardId-1", "INSERT", {"pk": {"S": f"b{i}"}}, {"pk": {"S": f"b{i}"}}, None)
        round_of("B")
        round_of("A")
    gaps = {t: [b - a for a, b in zip(v, v[1:])] for t, v in times.items()}
    assert len(gaps["A"]) >= 10 and len(gaps["B"]) >= 20
    assert gaps["A"] == [pytest.approx(0.25)] * len(gaps["A"])
    assert gaps["B"] == [pytest.approx(0.2)] * len(gaps["B"])
    fn.teardown()


def one_table_reader(monkeypatch, clock, sleep, sleep_when_idle: bool) -> tuple:
    """The reading DoFn over one table's fake stream (one shard, one partition):
    its pacer on ``clock``, its sleeps through ``sleep``. (client, fn, call,
    tracker): ``call()`` is one process call, the keys it emitted."""
    from ddb2bt.pipeline.source import stream_sdf, stream_source
    from ddb2bt.pipeline.source.stream_sdf import StreamSource, _ReadStreamPartitionsFn
    from ddb2bt.pipeline.source.stream_source import StreamPartition
    from ddb2bt.pipeline.testing.fakes import FakeStreamsClient

    client = FakeStreamsClient(table="A")
    client.add_shard("shardId-1")
    monkeypatch.setattr(stream_sdf.time, "sleep", sleep)
    paced = stream_source.ShardPacer
    monkeypatch.setattr(stream_source, "ShardPacer", lambda **kw: paced(clock=clock, **kw))
    options = ReaderOptions(poll_interval_s=0.25, sleep_when_idle=sleep_when_idle)
    fn = _ReadStreamPartitionsFn([StreamSource(client.stream_arn, options, lambda: client, NoState)])
    fn.setup()
    part, tracker = StreamPartition(client.stream_arn, 0, 1), Tracker()

    def call() -> list:
        return [r.keys["pk"]["S"] for e in fn.process(part, tracker=tracker) for r in e.records]

    return client, fn, call, tracker


def test_a_local_reader_reads_right_after_its_sleep_in_the_same_call(monkeypatch):
    """Locally (the runner ignores deferral delays) a round that has to wait
    sleeps, then reads at once in the same call, instead of deferring first: the
    runner's pass over every stage between a deferral and the next call would add
    to each wait, and so to every change's lag. At most one read after a sleep per
    call: the call, and its bundle, still ends."""
    sleeps: list = []
    client, fn, call, tracker = one_table_reader(monkeypatch, lambda: sum(sleeps), sleeps.append,
                                                 sleep_when_idle=True)
    calls: list = []
    get_records = client.get_records
    client.get_records = lambda **kw: (calls.append(sum(sleeps)), get_records(**kw))[1]
    assert call() == []  # idle: a read, the idle sleep, a read right after it, one more sleep
    assert sleeps == [0.25, 0.25] and calls == [0, 0.25] and tracker.deferred == 1
    client.put("shardId-1", "INSERT", {"pk": {"S": "a"}}, {"pk": {"S": "a"}}, None)
    assert call() == ["a"] and tracker.deferred == 2  # read at once: the last sleep was after the last read
    client.put("shardId-1", "INSERT", {"pk": {"S": "b"}}, {"pk": {"S": "b"}}, None)
    # The shard had a change: AWS's pace, 0.2 s after the last call; the sleep and
    # the read in one call, the remainder deferred once, after the read.
    assert call() == ["b"] and tracker.deferred == 3
    assert sleeps == [0.25, 0.25, pytest.approx(0.2)] and calls[-1] == pytest.approx(calls[-2] + 0.2)
    fn.teardown()


def test_the_python_api_refuses_two_tables_with_one_name_or_one_marking():
    """Two mappings under one name would share state: refused even through the API."""
    a = job(CATALOG, "A")
    twin = job(renamed(INVOICES, CATALOG.name, "Other", "other"), "B")
    with pytest.raises(ConfigError, match=r"mapping 'product_catalog' \(#1\) and mapping 'product_catalog' \(#2\) "
                                          r"have the same state name"):
        ReplicateToBigtable.from_jobs([a, twin])
    with pytest.raises(ValueError, match="marking are one table's"):
        ReplicateToBigtable([CATALOG, INVOICES], marking=object())


def test_only_the_first_table_pushes_metrics():
    from ddb2bt.pipeline.cutover.controller import BackfillOptions, _one_pusher

    opts = BackfillOptions(pushgateway="http://gw:9091")
    assert _one_pusher(opts, 0).pushgateway == "http://gw:9091"
    assert _one_pusher(opts, 1).pushgateway is None and _one_pusher(opts, 2).sink == opts.sink


def test_a_refused_lease_releases_the_ones_already_taken(monkeypatch):
    """All or none: table 2's lease is held elsewhere, so table 1's is given back."""
    import ddb2bt.pipeline.services.jobs as jobs
    from ddb2bt.pipeline.control.lease import LeaseHeld

    released = []

    class Held:
        def __init__(self, name):
            self.name = name

        def release(self):
            released.append(self.name)

    def fake(args, state, role, taken=None):
        if state == "second":
            raise LeaseHeld("held by another process")
        taken.append(Held(state))
        return f"spec-{state}"

    monkeypatch.setattr(jobs, "acquire_lease", fake)
    assert jobs.acquire_leases(None, ["first", "third"], "tail") == ["spec-first", "spec-third"]
    assert released == []
    with pytest.raises(LeaseHeld):
        jobs.acquire_leases(None, ["first", "second", "third"], "tail")
    assert released == ["first"]


def test_on_dataflow_the_reader_never_sleeps_and_defers_by_the_wait(monkeypatch):
    """On Dataflow (sleep_when_idle off: the runner honours a deferral's delay) a
    waiting round defers its remainder by the wait — AWS's 0.2 s after a page with
    changes, the idle poll after an empty one, what is left of it for a round that
    came early — and the reader never sleeps: a deferral of 0 there would bring
    the partition straight back, a spinning core."""
    now = [0.0]
    client, fn, call, tracker = one_table_reader(monkeypatch, lambda: now[0],
                                                 lambda s: pytest.fail(f"the reader slept {s} s"),
                                                 sleep_when_idle=False)
    assert call() == [] and tracker.delays == [0.25]  # an empty page: the idle poll
    now[0] += 0.1
    assert call() == [] and tracker.delays[-1] == pytest.approx(0.15)  # early: the rest of it
    now[0] += 0.15
    client.put("shardId-1", "INSERT", {"pk": {"S": "a"}}, {"pk": {"S": "a"}}, None)
    assert call() == ["a"] and tracker.delays[-1] == 0  # a page with changes: come back now...
    assert call() == [] and tracker.delays[-1] == pytest.approx(0.2)  # ...to be told AWS's wait
    fn.teardown()

