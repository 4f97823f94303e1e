"""The bounded-memory verify (hash buckets spilled to disk, spill.py) and its
live re-check (recheck.py), against in-memory fakes of both sides: it reports
what the in-memory comparison reports, whatever the bucket sizes; a difference
caused by a change in flight is re-checked away once the tail applied it, a
real one stays."""
from __future__ import annotations

import gc
import pickle
import weakref

from ddb2bt.pipeline.verify import spill as spill_mod
from ddb2bt.pipeline.verify.compare import compare_mapping
from ddb2bt.pipeline.verify.recheck import CONFIRMATIONS, STAMP_SLACK_MS, RecheckOptions, stream_watermark
from ddb2bt.pipeline.verify.spill import Spill, SpillDir, paired_groups
from ddb2bt.pipeline.verify.verify import REDACTED, Rechecker, verify
from ddb2bt.pipeline.observe.redaction import KEY_REDACTED
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.mapping import MARKER_FAMILY, map_change
from ddb2bt.transforms.model import INSERT, MODIFY, REMOVE, ChangeRecord, SetCell

from tests.unit.cutover.cutover_common import CATALOG, T, VIDEOS, item

KINDS = ("missing_rows", "extra_rows", "missing_cells", "extra_cells", "different_cells", "version_clashes")


class FakeDynamo:
    """Scan (segments by position) and GetItem over a dict; ``before_scan`` runs
    once, at the first Scan call: what changes between the target read and the
    source scan."""

    def __init__(self, items, before_scan=lambda: None):
        self.items = {self.key(i): i for i in items}
        self.before_scan = before_scan

    @staticmethod
    def key(i):
        return (i["pk"]["S"], i["sk"]["S"])

    def scan(self, TableName, ConsistentRead, ReturnConsumedCapacity, Segment=0, TotalSegments=1, **kw):
        hook, self.before_scan = self.before_scan, lambda: None
        hook()
        items = sorted(self.items.values(), key=self.key)
        return {"Items": [it for n, it in enumerate(items) if n % TotalSegments == Segment]}

    def get_item(self, keys):
        return self.items.get((keys["pk"]["S"], keys["sk"]["S"]))


def apply(bt, mapping, record):
    for ch in map_change(mapping, record):
        bt.mutate_rows(ch.table, [(ch.row_key, ch.mutations)])


def reader(bt):
    def read(table):
        return {k: {c: sorted(v.items(), reverse=True) for c, v in cols.items()}
                for k, cols in bt.versions(table).items()}
    return read


def run(mapping, ddb, bt, tmp_path, rechecker=None, sample_rate=1.0, segments=3):
    read = reader(bt)
    return verify(mapping, ddb, lambda table: sorted(read(table).items()),
                  lambda table, keys: {k: v for k, v in read(table).items() if k in set(keys)},
                  segments=segments, sample_rate=sample_rate, workdir=str(tmp_path), recheck_with=rechecker)


def counts(report, table):
    return {k: report.tables[table][k]["count"] for k in KINDS}


def catalog_world(n=60):
    items = [item(pk=f"p{i % 7}", sk=f"s{i}", Price=i, Description=f"d{i}") for i in range(n)]
    bt = InMemoryBigtable()
    for it in items:
        apply(bt, CATALOG, ChangeRecord(INSERT, {"pk": it["pk"], "sk": it["sk"]}, it, None, T))
    return items, bt


def plant(bt):
    """A missing row, an extra row, a stale cell, a foreign cell."""
    bt.tables["product_catalog"].pop(b"p1#s1")
    bt.mutate_rows("product_catalog", [(b"zz#ghost", [SetCell("SKU", b"Price", b"\0" * 8, T)])])
    bt.mutate_rows("product_catalog", [(b"p2#s2", [SetCell("SKU", b"Description", b"stale", T + 1)])])
    bt.mutate_rows("product_catalog", [(b"p3#s3", [SetCell(MARKER_FAMILY, b"t#x", b"", T)])])


def test_bounded_verify_reports_what_the_in_memory_comparison_finds(tmp_path, monkeypatch):
    items, bt = catalog_world()
    report = run(CATALOG, FakeDynamo(items), bt, tmp_path)
    assert report.identical and report.items == 60 and report.rows_expected == 60
    plant(bt)
    want = compare_mapping(CATALOG, items, reader(bt))["product_catalog"]
    expected = {k: len(getattr(want, k)) for k in KINDS}
    assert expected == {"missing_rows": 1, "extra_rows": 1, "missing_cells": 0, "extra_cells": 1,
                        "different_cells": 1, "version_clashes": 0}
    report = run(CATALOG, FakeDynamo(items), bt, tmp_path)
    assert not report.identical and counts(report, "product_catalog") == expected
    ex = report.tables["product_catalog"]["different_cells"]["examples"][0]
    assert ex == {"row": KEY_REDACTED, "column": "SKU:Description", "expected": REDACTED, "actual": REDACTED}
    # groups far smaller than the table: every bucket split again, the same report
    monkeypatch.setattr(spill_mod, "MAX_GROUP_BYTES", 300)
    split = run(CATALOG, FakeDynamo(items), bt, tmp_path, segments=5)
    assert split.to_json()["tables"] == report.to_json()["tables"]
    assert list(tmp_path.iterdir()) == [], "the spill directory is removed"


def test_bounded_verify_finds_version_clashes_across_items_of_one_row(tmp_path, monkeypatch):
    c1 = item(pk="0001", sk="VideoComment#1", Content="one", CreatedAt="2023-09-10T10:00:00")
    c2 = item(pk="0001", sk="VideoComment#2", Content="two", CreatedAt="2023-09-10T10:00:00")
    c3 = item(pk="0002", sk="VideoComment#3", Content="three", CreatedAt="2023-09-10T10:00:01")
    bt = InMemoryBigtable()
    for c in (c1, c3):
        apply(bt, VIDEOS, ChangeRecord(INSERT, {"pk": c["pk"], "sk": c["sk"]}, c, None, T))
    monkeypatch.setattr(spill_mod, "MAX_GROUP_BYTES", 100)  # contributions to one row stay in one group
    report = run(VIDEOS, FakeDynamo([c1, c2, c3]), bt, tmp_path)
    assert counts(report, "videos")["version_clashes"] == 1 and not report.identical
    assert report.tables["videos"]["version_clashes"]["examples"][0]["items"] == [KEY_REDACTED, KEY_REDACTED]
    assert run(VIDEOS, FakeDynamo([c1, c3]), bt, tmp_path).identical


def test_paired_groups_bound_every_group_and_lose_nothing(tmp_path):
    with SpillDir(str(tmp_path)) as d:
        left, right = Spill(d.path, "l", 2), Spill(d.path, "r", 2)
        for i in range(2000):
            left.add("t", b"row%05d" % i, ("x" * 20, i))
            if i % 3:
                right.add("t", b"row%05d" % i, i)
        left.flush(), right.flush()
        limit = 8_000
        seen_left, seen_right = [], []
        for lrecs, rrecs in paired_groups(left, right, limit):
            size = sum(len(pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL)) for r in lrecs + rrecs)
            assert size <= limit
            assert {r[1] for r in rrecs} <= {r[1] for r in lrecs}, "a row's two sides share a group"
            seen_left += [r[1] for r in lrecs]
            seen_right += [r[1] for r in rrecs]
        assert sorted(seen_left) == [b"row%05d" % i for i in range(2000)]
        assert len(seen_right) == len(set(seen_right)) == sum(1 for i in range(2000) if i % 3)


def test_sampled_bounded_verify_reads_only_sampled_rows(tmp_path):
    items, bt = catalog_world()
    plant(bt)
    report = run(CATALOG, FakeDynamo(items), bt, tmp_path, sample_rate=0.5)
    assert report.sampled and 0 < report.items < 60
    assert counts(report, "product_catalog")["extra_rows"] == 0, "extra rows are not seen in sampled mode"


class Tail:
    """Changes written to the source while verify runs reach Bigtable only when
    the tail applies them: at the first ``passed`` call after ``lag`` polls."""

    def __init__(self, bt, mapping, lag=0, never=False):
        self.bt, self.mapping, self.pending, self.lag, self.never, self.polls = bt, mapping, [], lag, never, 0

    def passed(self, t):
        self.polls += 1
        if self.never or self.polls <= self.lag:
            return False
        for record in self.pending:
            apply(self.bt, self.mapping, record)
        self.pending = []
        return True


def live_world():
    items, bt = catalog_world(20)
    ddb = FakeDynamo(items)
    tail = Tail(bt, CATALOG, lag=2)
    keys = lambda it: {"pk": it["pk"], "sk": it["sk"]}
    new = item(pk="p9", sk="new", Price=1)
    changed = item(pk="p2", sk="s2", Price=99, Description="changed")
    gone = items[5]

    def writer():  # between the target read and the scan: insert, update, delete
        ddb.items[FakeDynamo.key(new)] = new
        ddb.items[FakeDynamo.key(changed)] = changed
        ddb.items.pop(FakeDynamo.key(gone))
        tail.pending += [ChangeRecord(INSERT, keys(new), new, None, T + 10),
                         ChangeRecord(MODIFY, keys(changed), changed, items[2], T + 10),
                         ChangeRecord(REMOVE, keys(gone), None, gone, T + 10)]

    ddb.before_scan = writer
    return ddb, bt, tail


def test_changes_in_flight_are_rechecked_away(tmp_path):
    ddb, bt, tail = live_world()
    rechecker = Rechecker(CATALOG, ddb.get_item, lambda table, keys: {
        k: v for k, v in reader(bt)(table).items() if k in set(keys)}, tail.passed, sleep=lambda s: None)
    report = run(CATALOG, ddb, bt, tmp_path, rechecker)
    assert report.identical, report.to_json()
    assert report.recheck["rows"] == 3 and report.recheck["resolved"] == 3 and tail.polls == 3


def test_without_recheck_changes_in_flight_are_differences(tmp_path):
    ddb, bt, tail = live_world()
    report = run(CATALOG, ddb, bt, tmp_path)
    assert not report.identical and report.recheck is None
    c = counts(report, "product_catalog")
    assert (c["missing_rows"], c["extra_rows"], c["different_cells"]) == (1, 1, 2)


def test_a_real_divergence_survives_the_recheck_and_a_stuck_tail_confirms_nothing(tmp_path):
    items, bt = catalog_world(20)
    plant(bt)
    read_rows = lambda table, keys: {k: v for k, v in reader(bt)(table).items() if k in set(keys)}
    tail = Tail(bt, CATALOG)
    report = run(CATALOG, FakeDynamo(items), bt, tmp_path,
                 Rechecker(CATALOG, FakeDynamo(items).get_item, read_rows, tail.passed, sleep=lambda s: None))
    # found different twice, each time after the tail had passed: reported
    assert not report.identical and report.recheck["resolved"] == 0 and report.recheck["rounds"] == CONFIRMATIONS
    assert counts(report, "product_catalog") == {"missing_rows": 1, "extra_rows": 1, "missing_cells": 0,
                                                 "extra_cells": 1, "different_cells": 1, "version_clashes": 0}
    stuck = Tail(bt, CATALOG, never=True)
    report = run(CATALOG, FakeDynamo(items), bt, tmp_path,
                 Rechecker(CATALOG, FakeDynamo(items).get_item, read_rows, stuck.passed,
                           RecheckOptions(wait_s=0.05), sleep=lambda s: None))
    assert not report.identical and report.recheck["timed_out"] and report.recheck["resolved"] == 0
    assert counts(report, "product_catalog")["extra_rows"] == 1


def test_a_row_whose_item_changes_on_every_look_is_unsettled_not_a_difference(tmp_path):
    items, bt = catalog_world(10)
    bt.mutate_rows("product_catalog", [(b"p2#s2", [SetCell("SKU", b"Description", b"old", T + 1)])])
    read_rows = lambda table, keys: {k: v for k, v in reader(bt)(table).items() if k in set(keys)}
    looks = [0]

    def busy(keys):  # a hot item: another value at every read
        looks[0] += 1
        return item(pk=keys["pk"]["S"], sk=keys["sk"]["S"], Price=looks[0], Description=f"v{looks[0]}")

    rechecker = Rechecker(CATALOG, busy, read_rows, lambda t: True, RecheckOptions(rounds=3), sleep=lambda s: None)
    report = run(CATALOG, FakeDynamo(items), bt, tmp_path, rechecker)
    assert report.identical and report.recheck["unsettled"] == 1 and report.recheck["rounds"] == 3
    assert looks[0] == 6, "the owner is read before and after each of the three rounds"


def test_an_extra_row_of_an_item_deleted_and_created_again_meanwhile_is_resolved(tmp_path):
    items, bt = catalog_world(10)
    ddb = FakeDynamo(items)
    again = items[3]
    tail = Tail(bt, CATALOG)

    def writer():  # deleted before the scan reaches it, created again after: the scan never sees it
        ddb.items.pop(FakeDynamo.key(again))
        tail.pending.append(ChangeRecord(MODIFY, {"pk": again["pk"], "sk": again["sk"]}, again, again, T + 10))

    ddb.before_scan = writer
    read_rows = lambda table, keys: {k: v for k, v in reader(bt)(table).items() if k in set(keys)}

    def get_item(keys):  # the item is back by the time verify re-checks
        return again if (keys["pk"], keys["sk"]) == (again["pk"], again["sk"]) else ddb.get_item(keys)

    report = run(CATALOG, ddb, bt, tmp_path, Rechecker(CATALOG, get_item, read_rows, tail.passed,
                                                      sleep=lambda s: None))
    assert report.identical and report.recheck["resolved"] == 1, report.to_json()


def test_a_tail_that_makes_no_progress_ends_the_wait_early(tmp_path):
    items, bt = catalog_world(10)
    plant(bt)
    read_rows = lambda table, keys: {k: v for k, v in reader(bt)(table).items() if k in set(keys)}
    never = lambda t: False
    never.stalled_s = lambda: 31.0  # no checkpoint moved for longer than TAIL_STALLED_S
    report = run(CATALOG, FakeDynamo(items), bt, tmp_path,
                 Rechecker(CATALOG, FakeDynamo(items).get_item, read_rows, never, RecheckOptions(wait_s=3600),
                           sleep=lambda s: None))
    assert report.recheck["timed_out"] and not report.identical


def test_a_difference_gone_a_round_later_is_not_reported(tmp_path):
    """One round can say "the tail passed" too early (a record stamped after its
    change became readable): the row is looked at again after a fresh wait, and a
    row that matches then was in flight, not a divergence."""
    ddb, bt, tail = live_world()
    early = [0]

    def passed(t):  # the first wait ends before the tail applied anything
        early[0] += 1
        return True if early[0] == 1 else tail.passed(t)

    rechecker = Rechecker(CATALOG, ddb.get_item, lambda table, keys: {
        k: v for k, v in reader(bt)(table).items() if k in set(keys)}, passed, sleep=lambda s: None)
    report = run(CATALOG, ddb, bt, tmp_path, rechecker)
    assert report.identical, report.to_json()
    assert report.recheck["resolved"] == 3 and report.recheck["rounds"] == 2


def _watermark_world(created_ms):
    from ddb2bt.pipeline.control.state import ShardCheckpoint, StateStore
    from ddb2bt.pipeline.testing.fakes import FakeStreamsClient

    streams = FakeStreamsClient()
    streams.add_shard("s0")
    applied = streams.put("s0", "INSERT", {"pk": {"S": "a"}}, {"pk": {"S": "a"}}, created_ms=created_ms - 5_000)
    streams.put("s0", "REMOVE", {"pk": {"S": "a"}}, None, {"pk": {"S": "a"}}, created_ms=created_ms)
    store = StateStore(InMemoryBigtable(), "job", lambda: created_ms)
    store.save_checkpoints([ShardCheckpoint(streams.stream_arn, "s0", applied, change_ms=created_ms - 5_000)])
    return streams, store


def test_the_tail_has_not_passed_a_record_stamped_just_after_the_time():
    """A change readable at t can carry a stream record time a little after t:
    such a record pending means the tail has not passed t."""
    t = 1_800_000_000_000
    streams, store = _watermark_world(created_ms=t + STAMP_SLACK_MS)
    passed = stream_watermark(streams, streams.stream_arn, store, now_ms=lambda: t + 10_000)
    assert passed(t) is False
    streams, store = _watermark_world(created_ms=t + STAMP_SLACK_MS + 1)
    assert stream_watermark(streams, streams.stream_arn, store, now_ms=lambda: t + 10_000)(t) is True


def test_a_shard_position_that_cannot_be_read_is_not_passed():
    from ddb2bt.pipeline.testing.fakes import client_error

    t = 1_800_000_000_000
    streams, store = _watermark_world(created_ms=t + 60_000)
    passed = stream_watermark(streams, streams.stream_arn, store, now_ms=lambda: t + 10_000)
    streams.faults = [None, client_error("InternalServerError", "try again", "GetShardIterator")]
    assert passed(t) is False, "a failed read is not 'nothing pending'"
    assert passed(t) is True


class _Item(dict):
    """An item the test can hold weakly: it sees when verify let go of it."""


class PagingDynamo:
    """Scan in pages of ``page`` fresh item objects; at every call after the
    first, counts the items of earlier pages still alive somewhere."""

    def __init__(self, items, page):
        self.items, self.page = sorted(items, key=FakeDynamo.key), page
        self.handed_out: list = []  # weak references to every item returned
        self.alive_at_fetch: list = []

    def scan(self, TableName, ConsistentRead, ReturnConsumedCapacity, ExclusiveStartKey=None, **kw):
        gc.collect()
        if ExclusiveStartKey is not None:
            self.alive_at_fetch.append(sum(ref() is not None for ref in self.handed_out))
        start = 0 if ExclusiveStartKey is None else int(ExclusiveStartKey["n"]["N"])
        page = [_Item(it) for it in self.items[start:start + self.page]]
        self.handed_out += [weakref.ref(it) for it in page]
        out = {"Items": page}
        if start + self.page < len(self.items):
            out["LastEvaluatedKey"] = {"n": {"N": str(start + self.page)}}
        return out


def test_the_scan_holds_no_page_while_it_fetches_the_next(tmp_path):
    """A segment thread holds one decoded page at most: a page (and each of its
    items, once spilled) is let go before the next one is fetched. Holding the
    previous page through the fetch (the pager's frame and the loop variable did)
    kept up to three 1 MB pages per thread alive (docs/benchmarks.md, Verify)."""
    items, bt = catalog_world(30)
    ddb = PagingDynamo(items, page=7)
    report = run(CATALOG, ddb, bt, tmp_path, segments=1)
    assert report.identical and report.items == 30
    assert len(ddb.alive_at_fetch) == 4 and ddb.alive_at_fetch == [0, 0, 0, 0]


def test_a_sampled_verify_of_a_folded_mapping_agrees_with_the_full_one(tmp_path):
    """hr_orders folds an employee's job history (one item per job) into the
    employee's row: the sample is drawn by row, so a sampled row is compared
    against every item that maps into it, never against a sampled few (which
    reported the others' cells as extra)."""
    from ddb2bt.transforms.config import load_mapping

    hr = load_mapping("examples/hr_orders.yaml")
    items = []
    for e in range(60):
        pk = f"HR-EMPLOYEE#{e}"
        items.append(item(PK=pk, SK="EMPLOYEE", Name=f"n{e % 7}", Warehouse=f"w{e % 3}", JobTitle="t"))
        items += [item(PK=pk, SK=f"JH#2020-0{j + 1}", Job={"Title": f"t{j}"}) for j in range(3)]
    bt = InMemoryBigtable()
    for it in items:
        apply(bt, hr, ChangeRecord(INSERT, {"PK": it["PK"], "SK": it["SK"]}, it, None, T))
    full = run(hr, FakeDynamo2(items), bt, tmp_path)
    assert full.identical, full.to_json()
    for rate in (0.1, 0.5):
        report = run(hr, FakeDynamo2(items), bt, tmp_path, sample_rate=rate)
        assert report.sampled and report.identical, (rate, report.to_json()["tables"])
        assert 0 < report.rows_expected < full.rows_expected
    # and a sampled verify still finds what is there: a tampered job-history cell of every employee
    for e in range(60):
        bt.mutate_rows("hr_orders", [(f"emp#{e}".encode(), [SetCell("jobs", b"2020-01", b"{}", T + 1)])])
    report = run(hr, FakeDynamo2(items), bt, tmp_path, sample_rate=0.1)
    assert not report.identical and counts(report, "hr_orders")["different_cells"] > 0


class FakeDynamo2(FakeDynamo):
    """FakeDynamo for a table keyed PK, SK."""

    @staticmethod
    def key(i):
        return (i["PK"]["S"], i["SK"]["S"])

    def get_item(self, keys):
        return self.items.get((keys["PK"]["S"], keys["SK"]["S"]))


def test_the_beam_verify_rechecks_a_bundles_divergent_rows_in_one_batch():
    """One wait for the tail per batch (RECHECK_BATCH_ROWS), not Beam's adaptive
    batches of 1, 2, 4 ...: each waited seconds, one after another, and a Beam
    verify of a busy table took minutes."""
    import apache_beam as beam
    from apache_beam.testing.util import assert_that, equal_to

    from ddb2bt.pipeline.verify.beam_verify import RECHECK_BATCH_ROWS, batch_divergent_rows

    rows = 2 * RECHECK_BATCH_ROWS + 7
    with beam.Pipeline() as p:  # the local runner: one bundle
        sizes = p | beam.Create(range(rows), reshuffle=False) | batch_divergent_rows() | beam.Map(len)
        assert_that(sizes, equal_to([RECHECK_BATCH_ROWS, RECHECK_BATCH_ROWS, 7]))


class MeteredDynamo(FakeDynamo):
    """Each Scan page reports the capacity it consumed, as DynamoDB does."""

    def __init__(self, items, units_per_page):
        super().__init__(items)
        self.units_per_page = units_per_page

    def scan(self, **kw):
        page = super().scan(**kw)
        page["ConsumedCapacity"] = {"CapacityUnits": self.units_per_page}
        return page


def test_verify_and_the_recopy_sweep_scan_within_max_rcu(tmp_path):
    """The Scans of verify and of the re-copy sweep are charged to a read budget
    (--max-rcu) like the backfill's: pages that consumed 3 x 100 units at 50 per
    second wait ~6 s (less the bucket's first second)."""
    from ddb2bt.pipeline.clients.dynamodb import TokenBucket
    from ddb2bt.pipeline.cutover.recopy import sweep
    items, bt = catalog_world(12)
    read = reader(bt)
    for run_scan in (
        lambda ddb, bucket: verify(CATALOG, ddb, lambda table: sorted(read(table).items()),
                                   lambda table, keys: {}, segments=3, workdir=str(tmp_path), bucket=bucket),
        lambda ddb, bucket: sweep(CATALOG, ddb, lambda table: sorted(read(table).items()), lambda column: True,
                                  T, segments=3, workdir=str(tmp_path), bucket=bucket),
    ):
        now, slept = [0.0], []

        def sleep(s):
            slept.append(s)
            now[0] += s
        bucket = TokenBucket(50.0, clock=lambda: now[0], sleep=sleep)
        run_scan(MeteredDynamo(items, 100.0), bucket)
        assert sum(slept) >= (3 * 100.0 - 50.0) / 50.0 - 1e-6
