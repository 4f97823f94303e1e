"""The recovery's boundary sweep (pipeline/recover/straddle.py, docs/design.md
§8.1.1), piece by piece; the model test (test_recover_model.py) drives it whole."""
from __future__ import annotations

from ddb2bt.pipeline.source.exports import ExportManifest
from ddb2bt.pipeline.recover.recover import ExportChange, IncrementalExport, inexact_features
from ddb2bt.pipeline.recover.straddle import BoundarySweep, sweep_inexact_features, swept_windows
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.sink.sink import BatchingWriter, SinkConfig
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.config import load_mapping, parse_mapping
from ddb2bt.transforms.mapping import backfill_cell_ms, backfill_record, map_change
from ddb2bt.transforms.model import INSERT, ChangeRecord, MappedChange, SetCell

S = 1_700_000_000  # a window's start, seconds
FAST = SinkConfig(retry=RetryPolicy(0.001, 0.001, 1.0))


def export(from_s, to_s, lines=()):
    manifest = ExportManifest("INCREMENTAL_EXPORT", "DYNAMODB_JSON", "arn:aws:dynamodb:us-east-1:1:table/T", None,
                              len(lines))
    return IncrementalExport(f"mem://{from_s}", manifest, from_s * 1000, to_s * 1000, "NEW_AND_OLD_IMAGES",
                             (("data/a.json.gz", len(lines)),))


def test_only_windows_before_the_boundary_that_end_after_the_earliest_stop_are_swept():
    a, b, c, d = export(S, S + 900), export(S + 900, S + 1800), export(S + 1800, S + 2700), export(S + 2700, S + 3600)
    # The earliest trimmed shard stopped inside b; the boundary is c's end.
    assert swept_windows([a, b, c, d], (S + 1000) * 1000, (S + 2700) * 1000) == [b, c]
    # A stop on a window's last millisecond: its lost change is after that window.
    assert swept_windows([a, b, c, d], (S + 900) * 1000 - 1, (S + 2700) * 1000) == [a, b, c]


def test_what_the_sweep_cannot_list_is_named_before_anything_is_written():
    for example in ("product_catalog", "videos", "hr_orders"):
        assert sweep_inexact_features(load_mapping(f"examples/{example}.yaml")) == [], example
    hooked = parse_mapping({"version": 1, "name": "h", "source": {"table": "Things", "key": {"partition": "pk"}},
                            "target": {"project": "p", "instance": "i", "table": "t"}, "families": {"n": {}},
                            "rules": [{"hook": "tests.hooks.sample_hooks:split_name"}]})
    (why,) = sweep_inexact_features(hooked)
    assert "is a hook" in why and "§8.1.1" in why
    assert why in inexact_features(hooked)  # what `recover` and `validate` say
    mixed = parse_mapping({"version": 1, "name": "m", "source": {"table": "Things", "key": {"partition": "pk"}},
                           "target": {"project": "p", "instance": "i", "table": "t"}, "families": {"c": {}},
                           "rules": [{"name": "r", "row_key": "{pk}", "other_attributes": {"mode": "column",
                                                                                           "family": "c"},
                                      "columns": {"Body": {"column": "c:{At}", "encoding": "utf8",
                                                           "timestamp": {"attribute": "At", "format": "iso8601"}}}}]})
    (why,) = sweep_inexact_features(mixed)
    assert "family 'c' holds both" in why


def test_a_backfills_cells_and_claims_are_never_taken_for_a_lost_changes():
    """In the swept window: an item no line lists (unchanged in it) whose cells
    carry the backfill's timestamp keeps them, as does its version claim; a cell
    at a change's time that no line's new image owns is deleted."""
    mapping = load_mapping("examples/product_catalog.yaml")
    table = mapping.target.table
    bt = InMemoryBigtable()
    store = StateStore(bt, "job", lambda: (S + 5000) * 1000)
    handoff = (S + 100) * 1000 + 400
    stamp = backfill_cell_ms(handoff)
    bt.mutate_rows(table, [
        (b"hats#backfilled", [SetCell("SKU", b"Price", b"1", stamp)]),  # the backfill's: kept
        (b"hats#stale", [SetCell("SKU", b"Price", b"2", (S + 200) * 1000)]),  # a change's, owned by no line: deleted
        (b"hats#kept", [SetCell("SKU", b"Price", b"3", (S + 300) * 1000)]),  # owned by the line below: kept
    ])
    versions = store.versions()
    versions.claim(versions.key(table, b"x", "SKU", b"v", 5), b'{"M":{"pk":{"S":"b"}}}', stamp)
    line = ExportChange({"pk": {"S": "hats"}, "sk": {"S": "kept"}},
                        {"pk": {"S": "hats"}, "sk": {"S": "kept"}, "Price": {"N": "3"}}, None, (S + 300) * 1_000_000)
    w = export(S, S + 900, [line])
    batcher = BatchingWriter(bt, None, FAST, sleep=lambda s: None, versions=versions)
    sweep = BoundarySweep(mapping, bt, batcher, versions, lambda e, rel: iter([line]), backfill_ms=stamp)
    assert sweep.release_versions(S * 1000, [(w, "data/a.json.gz")]) == 0
    result = sweep.run([(w, "data/a.json.gz")], S * 1000, (S + 900) * 1000)
    assert set(bt.latest(table)) == {b"hats#backfilled", b"hats#kept"}
    assert result.cells_deleted == 1
    assert versions.claimed_since(S * 1000) == [(table, b"x", "SKU", b"v", 5, b'{"M":{"pk":{"S":"b"}}}')]
    assert versions.claimed_since(S * 1000, skip_ms=stamp) == []


def test_cells_stamped_just_before_the_first_swept_window_are_judged_by_the_state_at_its_start():
    """A change inside the window may carry a record time before its start (the
    stream's clock behind PITR's): the sweep reads from SWEEP_LOOKBACK_MS earlier.
    A cell there of an item no line lists was created inside the window and
    deleted by a lost change: deleted. One of an item the window before lists,
    written there (its state at the window's start), is an unchanged item's: kept;
    reading earlier without that window's lines would delete it. An item the
    window lists is judged by its line there alone. What is stamped before the
    look-back is not read."""
    from ddb2bt.pipeline.recover.recover import SWEEP_LOOKBACK_MS

    mapping = load_mapping("examples/product_catalog.yaml")
    table = mapping.target.table
    bt = InMemoryBigtable()
    store = StateStore(bt, "job", lambda: (S + 5000) * 1000)
    lo = S * 1000
    bt.mutate_rows(table, [
        (b"hats#lost", [SetCell("SKU", b"Price", b"1", lo - 1000)]),  # in no line: deleted
        (b"hats#unchanged", [SetCell("SKU", b"Price", b"2", lo - 1000)]),  # the look-back's state owns it: kept
        (b"hats#gone", [SetCell("SKU", b"Price", b"3", lo - 1000)]),  # the look-back's state: deleted, and so here
        (b"hats#older", [SetCell("SKU", b"Price", b"4", lo - SWEEP_LOOKBACK_MS - 1000)]),  # not read: kept
        # listed by the window too: its line there decides, not its state at the start
        # (Description stamped inside the window by its change after it; the line's
        # new image has none)
        (b"hats#listed", [SetCell("SKU", b"Price", b"5", lo - 1000), SetCell("SKU", b"Description", b"d", lo + 500)]),
    ])

    def keys(sk):
        return {"pk": {"S": "hats"}, "sk": {"S": sk}}

    written = (lo - 500) * 1000  # by PITR's clock, inside the look-back
    listed = {**keys("listed"), "Price": {"N": "5"}}
    before = [ExportChange(keys("unchanged"), {**keys("unchanged"), "Price": {"N": "2"}}, None, written),
              ExportChange(keys("gone"), None, {**keys("gone"), "Price": {"N": "3"}}, written),
              ExportChange(keys("listed"), {**listed, "Description": {"S": "d"}}, None, written)]
    inside = [ExportChange(keys("listed"), listed, {**listed, "Description": {"S": "d"}}, (lo + 100) * 1000)]
    w0, w = export(S - 900, S, before), export(S, S + 900, inside)
    lines = {w0.location: before, w.location: inside}
    batcher = BatchingWriter(bt, None, FAST, sleep=lambda s: None, versions=store.versions())
    sweep = BoundarySweep(mapping, bt, batcher, store.versions(), lambda e, rel: iter(lines[e.location]))
    result = sweep.run([(w, "data/a.json.gz")], lo, (S + 900) * 1000, lookback_files=[(w0, "data/a.json.gz")],
                       read_from_ms=lo - SWEEP_LOOKBACK_MS)
    assert set(bt.latest(table)) == {b"hats#unchanged", b"hats#older", b"hats#listed"}
    assert set(bt.latest(table)[b"hats#listed"]) == {("SKU", b"Price")}
    assert result.cells_deleted == 3


# List columns: elements are stamped below their change's time (design §3.2).
LISTS = parse_mapping({"version": 1, "name": "l", "source": {"table": "Things", "key": {"partition": "pk"}},
                   "target": {"project": "p", "instance": "i", "table": "t"}, "families": {"h": {}},
                   "rules": [{"name": "r", "row_key": "{pk}",
                              "columns": {"History": {"column": "h:History", "as": "list_versions",
                                                      "encoding": "utf8"}}}]})
X = {"pk": {"S": "x"}}
IMG = {"pk": {"S": "x"}, "History": {"L": [{"S": "a"}, {"S": "b"}, {"S": "c"}]}}


def list_world():
    bt = InMemoryBigtable()
    store = StateStore(bt, "job", lambda: (S + 5000) * 1000)
    return bt, store, BatchingWriter(bt, None, FAST, sleep=lambda s: None, versions=store.versions())


def test_a_list_written_after_the_window_keeps_its_lower_elements_inside_it():
    """An intact shard applied X's change at second S+900 (the swept window's end):
    its list's lower elements sit at S+900 s - 2 ms .. - 1 ms, inside [S, S+900)."""
    bt, store, w = list_world()
    for ch in map_change(LISTS, ChangeRecord(INSERT, X, IMG, None, (S + 900) * 1000)):
        w.add(MappedChange(ChangeRecord(INSERT, X, IMG, None, (S + 900) * 1000), (ch,)))
    w.flush()
    before = bt.versions("t")[b"x"][("h", b"History")]
    sweep = BoundarySweep(LISTS, bt, w, store.versions(), lambda e, rel: iter([]))
    e = export(S, S + 900)
    sweep.run([(e, "data/a.json.gz")], S * 1000, (S + 900) * 1000)
    after = bt.versions("t").get(b"x", {}).get(("h", b"History"))
    assert after == before, (before, after)


def test_a_backfilled_list_is_kept():
    """Only its newest element carries the backfill's timestamp: judged on it."""
    bt, store, w = list_world()
    handoff = (S + 100) * 1000 + 400
    rec = backfill_record(X, IMG, handoff)
    for ch in map_change(LISTS, rec):
        w.add(MappedChange(rec, (ch,)))
    w.flush()
    before = bt.versions("t")[b"x"][("h", b"History")]
    sweep = BoundarySweep(LISTS, bt, w, store.versions(), lambda e, rel: iter([]), backfill_ms=backfill_cell_ms(handoff))
    e = export(S, S + 900)
    sweep.run([(e, "data/a.json.gz")], S * 1000, (S + 900) * 1000)
    after = bt.versions("t").get(b"x", {}).get(("h", b"History"))
    assert after == before, (before, after)
