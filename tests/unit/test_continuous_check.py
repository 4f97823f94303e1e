"""The continuous check (cutover/continuous.py) against in-memory fakes: a cell
corrupted behind the tail's back is counted by kind and recorded as a dead
letter, `repair` (the redrive of those) fixes it and the count settles; a
correct table under deletes and attribute removals stays at 0."""
from __future__ import annotations

from prometheus_client import CollectorRegistry

from ddb2bt.pipeline.cutover.continuous import DIVERGENT, ContinuousCheck, ContinuousOptions
from ddb2bt.pipeline.cutover.redrive import RedriveOptions, redrive
from ddb2bt.pipeline.metrics import PipelineMetrics
from ddb2bt.pipeline.sink.sink import BatchingWriter
from ddb2bt.pipeline.state import StateStore
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.model import INSERT, MODIFY, REMOVE, ChangeRecord, SetCell

from tests.unit.cutover_common import CATALOG, FAST, T, item
from tests.unit.test_verify_bounded import FakeDynamo, apply, reader

SEGMENTS = 4


class Reader:
    def __init__(self, ddb):
        self.ddb = ddb

    def get(self, keys):
        return self.ddb.get_item(keys)


def world():
    bt = InMemoryBigtable()
    items = [item(pk=f"p{i % 3}", sk=f"s{i}", Price=i, Description=f"d{i}", Thumbnail="t") for i in range(24)]
    ddb = FakeDynamo(items)
    for it in items:
        apply(bt, CATALOG, ChangeRecord(INSERT, {"pk": it["pk"], "sk": it["sk"]}, it, None, T))
    clock = [T + 60_000]
    store = StateStore(bt, "job", lambda: clock[0])
    metrics = PipelineMetrics(CollectorRegistry()).for_table("job")

    def scan_segment(segment, total):
        return [it for n, it in enumerate(sorted(ddb.items.values(), key=FakeDynamo.key)) if n % total == segment]

    def read_rows(table, keys):
        return {k: v for k, v in reader(bt)(table).items() if k in set(keys)}

    def sleep(seconds):
        clock[0] += int(seconds * 1000)

    check = ContinuousCheck(CATALOG, scan_segment, ddb.get_item, read_rows, lambda t: True, store, metrics,
                            ContinuousOptions(items_per_s=1000, segments=SEGMENTS), now_ms=lambda: clock[0],
                            sleep=sleep)
    return bt, ddb, store, metrics, check, clock, sleep


def value(metrics, name, **labels):
    v = metrics.registry.get_sample_value(name, labels)
    return 0 if v is None else v


def full_pass(check):
    return sum(check.step() for _ in range(SEGMENTS))


def test_a_corrupted_cell_is_counted_recorded_and_repaired(tmp_path):
    bt, ddb, store, metrics, check, clock, sleep = world()
    assert full_pass(check) == 24 and value(metrics, "ddb2bt_verify_checked_total", table="job") == 24
    assert value(metrics, "ddb2bt_verify_divergent_total", table="job", kind="different_cells") == 0
    assert value(metrics, "ddb2bt_verify_last_full_pass_timestamp_seconds", table="job") == clock[0] / 1000
    # behind the tail's back: a tampered cell
    bt.mutate_rows("product_catalog", [(b"p1#s4", [SetCell("SKU", b"Description", b"tampered", T + 5)])])
    full_pass(check)  # found once: checked again on the next pass before it is reported
    assert value(metrics, "ddb2bt_verify_divergent_total", table="job", kind="different_cells") == 0
    full_pass(check)
    assert value(metrics, "ddb2bt_verify_divergent_total", table="job", kind="different_cells") == 1
    (letter,) = store.list_dead_letters(reason=DIVERGENT)
    assert letter["stage"] == "verify"
    # repair: the redrive of the divergent dead letters rewrites the item's current state
    batcher = BatchingWriter(bt, None, FAST, sleep=lambda s: None)
    result = redrive(CATALOG, store, batcher, Reader(ddb), RedriveOptions(reason=DIVERGENT),
                     now_ms=lambda: clock[0], sleep=sleep)
    assert result.resolved == 1 and store.list_dead_letters(reason=DIVERGENT) == []
    assert bt.latest("product_catalog")[b"p1#s4"][("SKU", b"Description")] == b"d4"
    full_pass(check)
    assert value(metrics, "ddb2bt_verify_divergent_total", table="job", kind="different_cells") == 1, "settled"


def test_no_false_alarm_under_deletes_and_attribute_removals():
    bt, ddb, store, metrics, check, clock, sleep = world()
    keys = lambda it: {"pk": it["pk"], "sk": it["sk"]}
    for n, it in enumerate(sorted(ddb.items.values(), key=FakeDynamo.key)[:12]):
        if n % 2:
            ddb.items.pop(FakeDynamo.key(it))
            apply(bt, CATALOG, ChangeRecord(REMOVE, keys(it), None, it, T + 1000))
        else:
            new = {k: v for k, v in it.items() if k != "Thumbnail"}
            ddb.items[FakeDynamo.key(it)] = new
            apply(bt, CATALOG, ChangeRecord(MODIFY, keys(it), new, it, T + 1000))
        full_pass(check)
    assert value(metrics, "ddb2bt_verify_checked_total", table="job") > 12 * 18
    for kind in ("missing_rows", "missing_cells", "extra_cells", "different_cells", "extra_rows"):
        assert value(metrics, "ddb2bt_verify_divergent_total", table="job", kind=kind) == 0
    assert store.list_dead_letters(reason=DIVERGENT) == []


def test_a_difference_gone_by_the_next_pass_is_never_reported():
    """One pass sees a difference (a race of the check against the tail, say), the
    next finds the item equal: nothing counted, nothing recorded."""
    bt, ddb, store, metrics, check, clock, sleep = world()
    row = b"p1#s4"
    original = bt.latest("product_catalog")[row][("SKU", b"Description")]
    bt.mutate_rows("product_catalog", [(row, [SetCell("SKU", b"Description", b"tampered", T + 5)])])
    full_pass(check)
    assert check.suspected  # noticed, held back
    bt.mutate_rows("product_catalog", [(row, [SetCell("SKU", b"Description", original, T + 6)])])
    full_pass(check)
    full_pass(check)
    assert not check.suspected
    for kind in ("missing_rows", "missing_cells", "extra_cells", "different_cells", "extra_rows"):
        assert value(metrics, "ddb2bt_verify_divergent_total", table="job", kind=kind) == 0
    assert store.list_dead_letters(reason=DIVERGENT) == []
