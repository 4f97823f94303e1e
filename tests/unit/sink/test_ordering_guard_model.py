"""Model test of the ordering guard (docs/design.md §10): random histories of a
few items, delivered in a random order with random duplicates, in random
batches, through the real guard (``apply_guarded``) into the in-memory Bigtable.
The target must equal the mapping of the final table exactly, and at no moment
may a row hold a state the item's applied history did not produce (checked at
the end: nothing resurrected, nothing lost).

A control shows the test can fail: the same deliveries through the ordinary
(ordered-source) path resurrect or lose data.
"""
from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from ddb2bt.pipeline.verify.compare import expected_layout
from ddb2bt.pipeline.sink.guarded import apply_guarded
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.mapping import map_change
from ddb2bt.transforms.model import INSERT, MODIFY, REMOVE, ChangeRecord
from ddb2bt.transforms.ordering import CLOCK_FAMILY, guarded_rows
from tests.unit.cutover.cutover_common import catalog_item, item, video_item

VIDEOS = load_mapping("examples/videos.yaml")
CATALOG = load_mapping("examples/product_catalog.yaml")
START_US = 1_700_000_000_000_000


CASES = {
    "videos": (VIDEOS, ["0123", "0124"], ["Video", "VideoStatsLikes", "VideoComment#1", "VideoComment#2"],
               video_item),
    "catalog": (CATALOG, ["hats", "shoes"], ["a#1", "b"], catalog_item),
}


def history(ops, precision_us):
    """The records of ``ops`` and the final table. ``precision_us``: 1 (MICROSECOND)
    or 1000 (MILLISECOND: two consecutive changes of an item may share a timestamp).

    The documented limit (design §10.3): changes of one item that share a
    timestamp are ordered by their images, which is unambiguous for two changes
    unless they undo each other (X→Y, Y→X). With MICROSECOND precision no two
    changes of an item share one (an item's writes take far longer than 1 µs)."""
    items: dict = {}
    records = []
    now = START_US
    last: dict = {}  # item -> (ts, count at ts, the previous record)
    for pk, sk, kind, n, advance_us in ops:
        k = (pk, sk)
        key = item(pk=pk, sk=sk)
        old = items.get(k)
        if kind == "delete":
            if old is None:
                continue
            new = None
        else:
            new = make_item(pk, sk, n)
            if new == old:
                continue  # DynamoDB writes no record for an update that changes nothing
        now += advance_us
        ts = now - now % precision_us
        prev = last.get(k)
        if prev is not None and prev[0] == ts and (
                precision_us == 1 or prev[1] >= 2 or prev[2].old_image == new):
            now += precision_us
            ts = now - now % precision_us
        count = prev[1] + 1 if prev is not None and prev[0] == ts else 1
        event = REMOVE if new is None else (MODIFY if old else INSERT)
        record = ChangeRecord(event, key, new, old, ts // 1000, change_us=ts)
        records.append(record)
        last[k] = (ts, count, record)
        if new is None:
            del items[k]
        else:
            items[k] = new
    return records, items


make_item = None  # set per example (hypothesis draws the case)


def deliveries(data, records):
    """A delivery order: shuffled within a window, some records twice, sometimes
    a replay of an earlier stretch (a restart from an old checkpoint)."""
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    return shuffled_deliveries(rng, records, data.draw(st.integers(1, 8), label="window"))


def shuffled_deliveries(rng: random.Random, records: list, window: int) -> list:
    """``records`` shuffled within windows of ``window``, some twice, sometimes a
    replay of an earlier stretch; the difference model draws from it too."""
    order = list(records)
    for start in range(0, len(order), window):
        part = order[start:start + window]
        rng.shuffle(part)
        order[start:start + window] = part
    out = []
    for r in order:
        out.append(r)
        if rng.random() < 0.2:
            out.insert(rng.randrange(len(out) + 1), r)  # a duplicate, anywhere before or after
    if out and rng.random() < 0.3:
        a = rng.randrange(len(out))
        out.extend(out[a:a + rng.randrange(1, 6)])  # a replay
    return out


def target_state(bt, table):
    have = bt.versions(table)
    out = {}
    for row, cols in have.items():
        cols = {c: v for c, v in cols.items() if c[0] != CLOCK_FAMILY}
        if cols:
            out[row] = cols
    return out


def converged(mapping, bt, items):
    expected = expected_layout(mapping, items.values())[mapping.target.table]
    have = target_state(bt, mapping.target.table)
    if set(have) != set(expected):
        return False
    for row, cols in expected.items():
        if set(have[row]) != set(cols):
            return False
        for col, want in cols.items():
            versions = have[row][col]
            if want.kind == "single":
                if versions[max(versions)] != want.value:
                    return False
            elif versions != want.value:
                return False
    return True


def draw_ops(data, pks, sks):
    return data.draw(st.lists(st.tuples(st.sampled_from(pks), st.sampled_from(sks),
                                        st.sampled_from(["put", "put", "delete"]), st.integers(0, 59),
                                        st.sampled_from([0, 1, 999, 1000, 250_000])), min_size=1, max_size=30),
                     label="ops")


@settings(max_examples=250, deadline=None)
@given(st.sampled_from(sorted(CASES)), st.sampled_from([1, 1000]), st.data())
def test_guard_converges_under_any_delivery_order(case, precision_us, data):
    global make_item
    mapping, pks, sks, make = CASES[case]
    make_item = make
    records, final = history(draw_ops(data, pks, sks), precision_us)
    order = deliveries(data, records)
    bt = InMemoryBigtable()
    batch = data.draw(st.integers(1, 7), label="batch size")
    concurrency = data.draw(st.sampled_from([1, 4]), label="slots swapped at once")
    for start in range(0, len(order), batch):
        rows = [row for record in order[start:start + batch] for row in guarded_rows(mapping, record)]
        stats = apply_guarded(bt, rows, concurrency=concurrency)
        assert not stats.rejected
    assert converged(mapping, bt, final), "the target is not the mapping of the final table"
    # A second delivery of everything (a full replay) changes nothing.
    before = bt.versions(mapping.target.table)
    apply_guarded(bt, [row for record in records for row in guarded_rows(mapping, record)])
    assert bt.versions(mapping.target.table) == before


def test_a_late_older_change_after_a_delete_does_not_resurrect():
    global make_item
    make_item = catalog_item
    records, final = history([("hats", "b", "put", 1, 0), ("hats", "b", "put", 3, 1000),
                              ("hats", "b", "delete", 0, 1000)], 1000)
    bt = InMemoryBigtable()
    for record in (records[2], records[0], records[1], records[1]):
        apply_guarded(bt, guarded_rows(CATALOG, record))
    assert final == {} and target_state(bt, CATALOG.target.table) == {}
    # The clock stays as the tombstone that kept the older changes out.
    assert any(c[0] == CLOCK_FAMILY for cols in bt.versions(CATALOG.target.table).values() for c in cols)


def test_without_the_guard_the_same_delivery_resurrects():
    """The control: the ordinary path (diffs applied as delivered) fails the same
    case, so the model test above can fail."""
    global make_item
    make_item = catalog_item
    records, final = history([("hats", "b", "put", 1, 0), ("hats", "b", "put", 3, 1000),
                              ("hats", "b", "delete", 0, 1000)], 1000)
    bt = InMemoryBigtable()
    for record in (records[2], records[0], records[1]):
        bt.mutate_rows(CATALOG.target.table, [(c.row_key, c.mutations) for c in map_change(CATALOG, record)])
    assert not converged(CATALOG, bt, final)


def test_changes_lost_in_a_row_are_written_whole_by_the_next_applied_one():
    """A newer change that touches none of a cell still carries it: an older change
    that set the cell and arrives later is stale, yet the cell is there."""
    global make_item
    make_item = catalog_item
    records, final = history([("hats", "b", "put", 3, 0), ("hats", "b", "put", 9, 1000)], 1)
    bt = InMemoryBigtable()
    for record in (records[1], records[0]):
        apply_guarded(bt, guarded_rows(CATALOG, record))
    assert converged(CATALOG, bt, final)


def test_two_items_on_one_cell_version_are_not_refused_on_this_path_the_later_overwrites():
    # What docs/kinesis.md and docs/mapping.md (Version clashes) both say: the
    # version registry is not consulted behind the guard (docs/design.md §10.5).
    a = video_item("0123", "VideoComment#1", 5)
    b = dict(video_item("0123", "VideoComment#2", 6), CreatedAt=a["CreatedAt"])  # one second, one version
    bt = InMemoryBigtable()
    stats = None
    for n, image in enumerate((a, b)):
        keys = {k: image[k] for k in ("pk", "sk")}
        stats = apply_guarded(bt, guarded_rows(VIDEOS, ChangeRecord(INSERT, keys, image, None, START_US // 1000 + n,
                                                                     change_us=START_US + n * 1000)), stats)
    assert not stats.rejected
    (versions,) = [v for (family, _), v in target_state(bt, VIDEOS.target.table)[b"0123"].items()
                   if family == "comments"]
    assert list(versions.values()) == [b"c6"]  # one value per version: the later item's
