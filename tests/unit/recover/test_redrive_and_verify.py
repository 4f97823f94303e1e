"""Redrive's outcomes (resolved, still failing, stored without keys, dry run) and
verify's view of cells the mapping does not own and of version clashes."""
from __future__ import annotations

from ddb2bt.pipeline.verify.compare import compare_mapping
from ddb2bt.pipeline.recover.redrive import RedriveOptions, redrive
from ddb2bt.pipeline.sink.sink import BatchingWriter
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.mapping import MARKER_FAMILY, map_change
from ddb2bt.transforms.model import INSERT, ChangeRecord, DeadLetter, SetCell

from tests.unit.cutover.cutover_common import CATALOG, FAST, T, VIDEOS, item  # noqa: E402


class Table:
    def __init__(self, items):
        self.items = {(i["pk"]["S"], i["sk"]["S"]): i for i in items}
        self.reads = 0

    def get(self, keys):
        self.reads += 1
        return self.items.get((keys["pk"]["S"], keys["sk"]["S"]))


def setup(records, include_values=True):
    bt = InMemoryBigtable()
    clock = [T + 10_000]
    store = StateStore(bt, "job", lambda: clock[0], include_values=include_values)
    store.save_dead_letters([DeadLetter("encoding", "MappingError", "m", "map", r, T) for r in records])
    batcher = BatchingWriter(bt, None, FAST, sleep=lambda s: None)

    def sleep(seconds):
        clock[0] += int(seconds * 1000)

    return bt, store, batcher, clock, sleep


def test_redrive_outcomes():
    good = item(pk="hats", sk="a", Price=3, Description="now")
    stale = item(pk="hats", sk="a", Price=1, Description="then", Thumbnail="x")
    gone = item(pk="hats", sk="gone", Price=2)
    bad = item(pk="hats", sk="bad", Price=1.5)  # int64 cannot hold 1.5: still failing
    records = [ChangeRecord(INSERT, item(pk="hats", sk=sk), img, None, T)
               for sk, img in (("a", stale), ("gone", gone), ("bad", bad))]
    bt, store, batcher, clock, sleep = setup(records)
    # a stale cell the dead-lettered image owned, written by an earlier life
    bt.mutate_rows("product_catalog", [(b"hats#a", [SetCell("SKU", b"Thumbnail", b"x", T - 5000)]),
                                       (b"hats#gone", [SetCell("SKU", b"Price", b"\0" * 8, T - 5000)])])
    table = Table([good, bad])
    dry = redrive(CATALOG, store, batcher, table, RedriveOptions(dry_run=True), now_ms=lambda: clock[0], sleep=sleep)
    assert (dry.resolved, dry.still_failing) == (2, 1) and store.count_dead_letters() == 3
    assert bt.latest("product_catalog")[b"hats#a"] == {("SKU", b"Thumbnail"): b"x"}, "a dry run writes nothing"
    result = redrive(CATALOG, store, batcher, table, RedriveOptions(), now_ms=lambda: clock[0], sleep=sleep)
    assert (result.items, result.resolved, result.still_failing, result.unstable) == (3, 2, 1, 0)
    assert [e["reason"] for e in store.list_dead_letters()] == ["encoding"]
    rows = bt.latest("product_catalog")
    assert b"hats#gone" not in rows
    assert rows[b"hats#a"] == {("SKU", b"Price"): (3).to_bytes(8, "big"), ("SKU", b"Description"): b"now"}


def rows_of(bt):
    def read(table, keys):
        return {k: {c: sorted(v.items(), reverse=True) for c, v in cols.items()}
                for k, cols in bt.versions(table).items() if k in set(keys)}
    return read


def checked(bt):
    """redrive()'s row check, against the in-memory Bigtable."""
    return {"read_rows": rows_of(bt), "delete_cells": lambda table, row, muts: bt.mutate_rows(table, [(row, muts)])}


def test_a_dead_letter_stored_without_values_is_redriven_by_its_keys_and_its_rows_checked():
    """Dataflow's default (--no-dlq-include-values): the letter keeps the keys,
    not the images. The item is re-read and written; a cell of an attribute
    removed while its change was lost (no image names it) is found by reading
    the row back and removed, because the row is the item's alone."""
    records = [ChangeRecord(INSERT, item(pk="hats", sk="a"), item(pk="hats", sk="a", Price=1, Color="red"), None, T)]
    bt, store, batcher, clock, sleep = setup(records, include_values=False)
    assert "red" not in store.list_dead_letters()[0]["record"], "no item value is stored"
    bt.mutate_rows("product_catalog", [(b"hats#a", [SetCell("SKU", b"Color", b"\"red\"", T - 5000)])])
    table = Table([item(pk="hats", sk="a", Price=2)])
    unchecked = redrive(CATALOG, store, batcher, table, RedriveOptions(dry_run=False), now_ms=lambda: clock[0],
                        sleep=sleep)
    assert (unchecked.unproven, unchecked.resolved) == (1, 0), "nothing checked: not proven"
    result = redrive(CATALOG, store, batcher, table, now_ms=lambda: clock[0], sleep=sleep, **checked(bt))
    assert (result.resolved, result.cleaned, result.kept) == (1, 1, 0)
    assert bt.latest("product_catalog")[b"hats#a"] == {("SKU", b"Price"): (2).to_bytes(8, "big")}


def test_a_letter_of_an_earlier_version_with_redacted_keys_is_found_through_the_stream():
    import json

    from ddb2bt.pipeline.testing.fakes import FakeStreamsClient

    streams = FakeStreamsClient(table="ProductCatalog")
    streams.add_shard("s0")
    old, new = item(pk="hats", sk="a", Price=1, Thumbnail="t"), item(pk="hats", sk="a", Price=1)
    streams.put("s0", "MODIFY", item(pk="hats", sk="a"), new, old)
    seq = streams.shards["s0"].records[0]["dynamodb"]["SequenceNumber"]
    bt, store, batcher, clock, sleep = setup([])
    letter = {"eventName": "MODIFY", "eventID": "e", "changeMs": T, "ttlDelete": False,
              "keys": {"pk": "<redacted>", "sk": "<redacted>"},
              "position": {"streamArn": streams.stream_arn, "shardId": "s0", "sequenceNumber": seq}}
    raw = {"id": "job#dlq#1", "reason": "encoding", "record": json.dumps(letter)}

    class Store:  # the stored letter as an earlier version wrote it
        def list_dead_letters(self, reason=None, since_ms=None):
            return [raw]

        def delete_dead_letters(self, ids):
            self.deleted = ids

        def load_meta(self, name):
            return store.load_meta(name)

    earlier = Store()
    bt.mutate_rows("product_catalog", [(b"hats#a", [SetCell("SKU", b"Thumbnail", b"t", T - 5000)])])
    table = Table([new])
    result = redrive(CATALOG, earlier, batcher, table, now_ms=lambda: clock[0], sleep=sleep, streams=streams,
                     **checked(bt))
    assert (result.resolved, result.redacted) == (1, 0) and earlier.deleted == [raw["id"]]
    assert bt.latest("product_catalog")[b"hats#a"] == {("SKU", b"Price"): (1).to_bytes(8, "big")}
    # the stream no longer holds it: nothing to find the item by
    streams.shards["s0"].trimmed_before = 1
    again = redrive(CATALOG, earlier, batcher, table, now_ms=lambda: clock[0], sleep=sleep, streams=streams,
                    **checked(bt))
    assert (again.redacted, again.resolved, again.kept) == (1, 0, 1)


def test_repair_removes_a_cell_a_mapping_change_left_and_says_what_it_cannot_prove():
    """The continuous check's divergent letters (repair): a cell of an owned
    family the mapping no longer produces (a renamed column) is removed where the
    row is the item's alone; in a row several items share (hr_orders folds job
    history into the employee's row) it is not judged: kept, not proven."""
    from ddb2bt.transforms.config import load_mapping

    hr = load_mapping("examples/hr_orders.yaml")
    emp = item(PK="HR-EMPLOYEE#1", SK="EMPLOYEE", Name="n", Warehouse="w")
    records = [ChangeRecord(INSERT, item(pk="hats", sk="a"), item(pk="hats", sk="a", Price=1), None, T)]
    bt, store, batcher, clock, sleep = setup(records)
    bt.mutate_rows("product_catalog", [(b"hats#a", [SetCell("SKU", b"OldName", b"x", T - 5000)])])
    result = redrive(CATALOG, store, batcher, Table([item(pk="hats", sk="a", Price=1)]), now_ms=lambda: clock[0],
                     sleep=sleep, **checked(bt))
    assert (result.resolved, result.cleaned) == (1, 1)
    assert set(bt.latest("product_catalog")[b"hats#a"]) == {("SKU", b"Price")}
    # a folded row
    bt2 = InMemoryBigtable()
    store2 = StateStore(bt2, "job", lambda: clock[0])
    store2.save_dead_letters([DeadLetter("divergent", "Divergence", "rows differ", "verify",
                                         ChangeRecord(INSERT, item(PK="HR-EMPLOYEE#1", SK="EMPLOYEE"), emp, None, T),
                                         T)])
    bt2.mutate_rows("hr_orders", [(b"emp#1", [SetCell("emp", b"state", b"x", T - 5000)])])

    class HrTable:
        def get(self, keys):
            return emp if keys == item(PK="HR-EMPLOYEE#1", SK="EMPLOYEE") else None

    result = redrive(hr, store2, BatchingWriter(bt2, None, FAST, sleep=lambda s: None), HrTable(),
                     now_ms=lambda: clock[0], sleep=sleep, **checked(bt2))
    assert (result.unproven, result.resolved, result.kept) == (1, 0, 1)
    assert ("emp", b"state") in bt2.latest("hr_orders")[b"emp#1"], "a shared row is not judged"


def test_redrive_gives_up_on_an_item_that_keeps_changing():
    records = [ChangeRecord(INSERT, item(pk="hats", sk="a"), item(pk="hats", sk="a", Price=1), None, T)]
    bt, store, batcher, clock, sleep = setup(records)

    class Changing:
        n = 0

        def get(self, keys):
            self.n += 1
            return item(pk="hats", sk="a", Price=self.n)

    result = redrive(CATALOG, store, batcher, Changing(), RedriveOptions(max_rounds=3), now_ms=lambda: clock[0],
                     sleep=sleep)
    assert (result.unstable, result.resolved) == (1, 0) and store.count_dead_letters() == 1


def test_verify_counts_foreign_cells_marker_rows_and_version_clashes():
    a = item(pk="hats", sk="a", Price=3)
    bt = InMemoryBigtable()
    for ch in map_change(CATALOG, ChangeRecord(INSERT, item(pk="hats", sk="a"), a, None, T)):
        bt.mutate_rows(ch.table, [(ch.row_key, ch.mutations)])
    read = lambda table: {k: {c: sorted(v.items(), reverse=True) for c, v in cols.items()}
                          for k, cols in bt.versions(table).items()}
    assert compare_mapping(CATALOG, [a], read)["product_catalog"].identical
    bt.mutate_rows("product_catalog", [(b"zz#deleted", [SetCell(MARKER_FAMILY, b"t#x", b"", T)])])
    diff = compare_mapping(CATALOG, [a], read)["product_catalog"]
    assert diff.extra_rows == [b"zz#deleted"] and not diff.identical
    bt.tables["product_catalog"].pop(b"zz#deleted")
    bt.mutate_rows("product_catalog", [(b"hats#a", [SetCell(MARKER_FAMILY, b"t#x", b"", T)])])
    diff = compare_mapping(CATALOG, [a], read)["product_catalog"]
    assert diff.extra_cells == [(b"hats#a", MARKER_FAMILY, b"t#x")] and not diff.identical
    # two comments with one CreatedAt: the layout cannot hold both, verify says so
    c1 = item(pk="0001", sk="VideoComment#1", Content="one", CreatedAt="2023-09-10T10:00:00")
    c2 = item(pk="0001", sk="VideoComment#2", Content="two", CreatedAt="2023-09-10T10:00:00")
    for ch in map_change(VIDEOS, ChangeRecord(INSERT, {"pk": c1["pk"], "sk": c1["sk"]}, c1, None, T)):
        bt.mutate_rows(ch.table, [(ch.row_key, ch.mutations)])
    diff = compare_mapping(VIDEOS, [c1, c2], read)["videos"]
    assert len(diff.version_clashes) == 1 and not diff.identical
    assert "VideoComment#1" in diff.version_clashes[0].keys[0] and "VideoComment#2" in diff.version_clashes[0].keys[1]
    assert compare_mapping(VIDEOS, [c1], read)["videos"].identical


def test_an_empty_list_is_no_cell_so_verify_expects_none():
    """A list column of no elements is written as its old elements deleted and no
    cell (mapping._write): verify must not call the row missing a cell."""
    from ddb2bt.pipeline.verify.compare import diff_layout, expected_layout
    from ddb2bt.transforms.config import parse_mapping

    lists = parse_mapping({
        "version": 1, "name": "lists", "source": {"table": "Lists", "key": {"partition": "pk"}},
        "target": {"project": "p", "instance": "i", "table": "lists"}, "families": {"h": {}, "d": {}},
        "rules": [{"name": "r", "row_key": "{pk}",
                   "columns": {"History": {"column": "h:History", "as": "list_versions", "encoding": "utf8"}},
                   "other_attributes": {"mode": "column", "family": "d"}}]})
    only_list = {"pk": {"S": "a"}, "History": {"L": []}}
    with_more = {"pk": {"S": "b"}, "History": {"L": []}, "Price": {"N": "1"}}
    layout = expected_layout(lists, [only_list, with_more])["lists"]
    assert layout.keys() == {b"b"} and set(layout[b"b"]) == {("d", b"Price")}
    actual = {b"b": {("d", b"Price"): [(1000, b"1")]}}
    assert diff_layout(layout, actual).identical


def _shared_cell_lost():
    """videos.yaml: VideoStats (rule views_legacy) and VideoStatsViews (rule
    views) share cell stats:Views of row {pk}; VideoStatsViews' REMOVE deleted
    it around VideoStats' clock, which still records its value 5 (docs/design.md
    §10.2). (mapping with a Kinesis source, Bigtable, keys, item)"""
    import dataclasses

    from ddb2bt.pipeline.sink.guarded import apply_guarded
    from ddb2bt.transforms.attrs import from_plain
    from ddb2bt.transforms.config import KinesisSourceConfig, load_mapping
    from ddb2bt.transforms.model import REMOVE
    from ddb2bt.transforms.ordering import guarded_rows

    mapping = load_mapping("examples/videos.yaml")
    mapping = dataclasses.replace(mapping,
                                  source=dataclasses.replace(mapping.source, kinesis=KinesisSourceConfig("cdc")))
    legacy_keys = {"pk": from_plain("v1"), "sk": from_plain("VideoStats")}
    views_keys = {"pk": from_plain("v1"), "sk": from_plain("VideoStatsViews")}
    legacy = {**legacy_keys, "ViewCount": from_plain(5)}
    views = {**views_keys, "Count": from_plain(10)}
    bt = InMemoryBigtable()
    for n, (event, keys, new, old) in enumerate([(INSERT, legacy_keys, legacy, None), (INSERT, views_keys, views, None),
                                                 (REMOVE, views_keys, None, views)]):
        apply_guarded(bt, guarded_rows(mapping, ChangeRecord(event, keys, new, old, T + n * 1000,
                                                             change_us=(T + n * 1000) * 1000)))
    assert ("stats", b"Views") not in bt.latest("videos")[b"v1"]
    return mapping, bt, legacy_keys, legacy


def _repair(mapping, bt, keys, item, read_rows):
    import dataclasses

    from ddb2bt.pipeline.sink.guarded import GuardedBatchingWriter

    clock = [T + 60_000]
    store = StateStore(bt, "job", lambda: clock[0])
    store.save_dead_letters([DeadLetter("divergent", "Divergent", "stats:Views missing", "verify",
                                        ChangeRecord(INSERT, keys, item, None, T), T + 50_000)])

    class Table:
        def get(self, k):
            return item if k == keys else None

    batcher = GuardedBatchingWriter(bt, None, dataclasses.replace(FAST, ordering_guard=True), sleep=lambda s: None)
    result = redrive(mapping, store, batcher, Table(), now_ms=lambda: clock[0],
                     sleep=lambda s: clock.__setitem__(0, clock[0] + int(s * 1000)),
                     read_rows=read_rows, delete_cells=lambda t, r, m: bt.mutate_rows(t, [(r, m)]))
    return result, store


def _read_rows(bt):
    def read_rows(table, keys):
        return {k: {c: sorted(v.items()) for c, v in bt.versions(table).get(k, {}).items()} for k in keys}
    return read_rows


def test_repair_through_the_guard_writes_a_cell_the_clock_says_the_row_holds():
    """`repair` (the redrive of `divergent` dead letters) writes the item's
    whole state through the guard, not the difference from its clock: the cell
    another item's REMOVE deleted is back, and only then is it resolved."""
    mapping, bt, keys, item = _shared_cell_lost()
    result, store = _repair(mapping, bt, keys, item, _read_rows(bt))
    assert result.resolved == 1 and store.list_dead_letters() == []
    assert bt.latest("videos")[b"v1"][("stats", b"Views")] == (5).to_bytes(8, "big", signed=True)


def test_repair_does_not_resolve_a_divergence_whose_owned_cell_it_reads_back_missing():
    """The row check of a repair reads the item's rows back: an owned cell still
    missing there (the write went around, or something deleted it since) keeps
    the dead letter, reported unproven."""
    mapping, bt, keys, item = _shared_cell_lost()
    read = _read_rows(bt)

    def read_without_views(table, row_keys):
        rows = read(table, row_keys)
        for cols in rows.values():
            cols.pop(("stats", b"Views"), None)
        return rows

    result, store = _repair(mapping, bt, keys, item, read_without_views)
    assert result.resolved == 0 and result.unproven == 1 and len(store.list_dead_letters()) == 1
