"""The sink's part of the cutover: a marker write racing the finish (the family
dropped) is written again without markers, never dead-lettered; two items
mapping to one cell version are never silent (versions.py)."""
from __future__ import annotations

from ddb2bt.pipeline.sink.sink import BatchingWriter
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.dofns import map_record
from ddb2bt.transforms.mapping import MARKER_FAMILY, backfill_record
from ddb2bt.transforms.model import INSERT, MODIFY, REMOVE, ChangeRecord

from tests.unit.cutover.cutover_common import CATALOG, FAST, T, VIDEOS, item  # noqa: E402


def writer_for(bt, versions=True):
    store = StateStore(bt, "job", lambda: T)
    return BatchingWriter(bt, store, FAST, sleep=lambda s: None, versions=store.versions() if versions else None)


def apply(batcher, mapping, *records, mark=False):
    for r in records:
        batcher.add(map_record(mapping, r, lambda: T, mark))
    return batcher.flush()


def test_a_marker_write_racing_the_finish_is_stripped_not_dead_lettered():
    # the target without the marker family: it was dropped by the finish
    bt = InMemoryBigtable(families={"product_catalog": {"SKU"}, "__state__": {"ckpt", "dlq", "meta"}})
    batcher = writer_for(bt)
    new = item(pk="hats", sk="a", Price=3)
    dead = apply(batcher, CATALOG, ChangeRecord(INSERT, item(pk="hats", sk="a"), new, None, T), mark=True)
    assert dead == []
    assert bt.latest("product_catalog") == {b"hats#a": {("SKU", b"Price"): (3).to_bytes(8, "big", signed=True)}}
    # a real unknown family is still a dead letter
    bt.families["product_catalog"] = set()
    dead = apply(batcher, CATALOG, ChangeRecord(MODIFY, item(pk="hats", sk="a"), new, new, T + 1000), mark=True)
    assert [d.reason for d in dead] == ["unknown_family"]


def comment(n, content, created="2023-09-10T10:00:00"):
    return item(pk="0001", sk=f"VideoComment#{n}", Content=content, CreatedAt=created)


def keys(it):
    return {"pk": it["pk"], "sk": it["sk"]}


def comments(bt):
    row = bt.versions("videos").get(b"0001", {})
    return row.get(("comments", b"UserComments"), {})


def test_two_comments_in_one_second_the_later_is_refused_and_deleting_it_keeps_the_first():
    bt = InMemoryBigtable()
    batcher = writer_for(bt)
    a, b = comment(1, "first"), comment(2, "second")
    assert apply(batcher, VIDEOS, ChangeRecord(INSERT, keys(a), a, None, T)) == []
    dead = apply(batcher, VIDEOS, ChangeRecord(INSERT, keys(b), b, None, T + 1000))
    assert [d.reason for d in dead] == ["version_clash"]
    assert "VideoComment#1" in dead[0].message and "VideoComment#2" in dead[0].message, "names both keys"
    assert list(comments(bt).values()) == [b"first"]
    # an edit of the owner and a replay of its insert go through
    a2 = comment(1, "first, edited")
    assert apply(batcher, VIDEOS, ChangeRecord(MODIFY, keys(a), a2, a, T + 2000),
                 ChangeRecord(INSERT, keys(a), a, None, T), ChangeRecord(MODIFY, keys(a), a2, a, T + 2000)) == []
    assert list(comments(bt).values()) == [b"first, edited"]
    # deleting the refused comment never removes the other's version
    assert apply(batcher, VIDEOS, ChangeRecord(REMOVE, keys(b), None, b, T + 3000)) == []
    assert list(comments(bt).values()) == [b"first, edited"]
    # deleting the owner removes it and releases the version: the other may take it
    assert apply(batcher, VIDEOS, ChangeRecord(REMOVE, keys(a), None, a2, T + 4000),
                 ChangeRecord(INSERT, keys(b), b, None, T + 5000)) == []
    assert list(comments(bt).values()) == [b"second"]


def test_a_clash_in_one_batch_and_from_the_backfill_is_refused_too():
    bt = InMemoryBigtable()
    batcher = writer_for(bt)
    a, b, c = comment(1, "a"), comment(2, "b"), comment(3, "c", created="2023-09-10T10:00:01")
    dead = apply(batcher, VIDEOS, ChangeRecord(INSERT, keys(a), a, None, T), ChangeRecord(INSERT, keys(b), b, None, T),
                 ChangeRecord(INSERT, keys(c), c, None, T))
    assert [d.reason for d in dead] == ["version_clash"] and dead[0].record.keys == keys(b)
    assert sorted(comments(bt).values()) == [b"a", b"c"]
    # a backfilled item (conditional write) that clashes is refused the same way
    handoff = T + 10_000
    dead = apply(batcher, VIDEOS, backfill_record(keys(b), b, handoff))
    assert [d.reason for d in dead] == ["version_clash"]
    assert sorted(comments(bt).values()) == [b"a", b"c"]


def test_without_a_registry_nothing_is_refused():
    bt = InMemoryBigtable()
    batcher = writer_for(bt, versions=False)
    a, b = comment(1, "first"), comment(2, "second")
    assert apply(batcher, VIDEOS, ChangeRecord(INSERT, keys(a), a, None, T), ChangeRecord(INSERT, keys(b), b, None, T)) == []
    assert list(comments(bt).values()) == [b"second"], "the collapse the registry exists to prevent"
    assert MARKER_FAMILY not in {f for f, _ in bt.versions("videos")[b"0001"]}


def test_the_sink_asks_whether_to_mark_and_never_reads_the_phase_itself():
    """Whether a backfill may run is its job's coordinator's to say (marking):
    the state here says BACKFILLING, yet the sink told "no backfill" strips the
    markers of a write that failed for the missing family."""
    bt = InMemoryBigtable(families={"product_catalog": {"SKU"}, "__state__": {"ckpt", "dlq", "meta"}})
    store = StateStore(bt, "job", lambda: T)
    store.save_meta("phase", "BACKFILLING")
    asked = []
    batcher = BatchingWriter(bt, store, FAST, sleep=lambda s: None, marking=lambda: asked.append(1) or False)
    new = item(pk="hats", sk="a", Price=3)
    dead = apply(batcher, CATALOG, ChangeRecord(INSERT, item(pk="hats", sk="a"), new, None, T), mark=True)
    assert dead == [] and asked
    assert bt.latest("product_catalog") == {b"hats#a": {("SKU", b"Price"): (3).to_bytes(8, "big", signed=True)}}
