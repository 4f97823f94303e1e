"""The continuous check (verify/continuous.py) against in-memory fakes: a cell
corrupted behind the tail's back is counted by kind and recorded as a dead
letter, `repair` (the redrive of those) fixes it and the count settles; a
correct table under deletes and attribute removals stays at 0. Steps of a
slice resume from the position in the state store (a restarted worker goes on);
the Dataflow step (continuous_beam.py) drives the same check per tick."""
from __future__ import annotations

import zlib

from prometheus_client import CollectorRegistry

from apache_beam.utils.timestamp import Timestamp

from ddb2bt.pipeline.verify.continuous import (DIVERGENT, POSITION_META, CheckPosition, ContinuousCheck,
                                                ContinuousOptions)
from ddb2bt.pipeline.verify.continuous_beam import _ContinuousCheckStepFn
from ddb2bt.pipeline.recover.redrive import RedriveOptions, redrive
from ddb2bt.pipeline.observe.metrics import PipelineMetrics
from ddb2bt.pipeline.sink.sink import BatchingWriter
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.model import INSERT, MODIFY, REMOVE, ChangeRecord, SetCell

from tests.unit.cutover.cutover_common import CATALOG, FAST, T, item
from tests.unit.verify.test_verify_bounded import FakeDynamo, apply, reader

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

    def scan_segment(segment, total, start_key=None):
        # segments by a hash of the key, as DynamoDB's: an item stays in its segment
        after = FakeDynamo.key(start_key) if start_key else None
        return [it for it in sorted(ddb.items.values(), key=FakeDynamo.key)
                if zlib.crc32(repr(FakeDynamo.key(it)).encode()) % total == segment
                and (after is None or FakeDynamo.key(it) > after)]

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


def position(store):
    return CheckPosition.from_json(store.load_meta(POSITION_META))


def restarted(check):
    """A new check on the same store: what a restarted process or worker builds."""
    return ContinuousCheck(check.mapping, check.scan_segment, check.get_item, check.read_rows, check.tail_passed,
                           check.store, check.metrics, check.options, check.now_ms, check.sleep)


def test_slices_resume_where_the_last_step_stopped_even_after_a_restart():
    bt, ddb, store, metrics, check, clock, sleep = world()
    counts, positions = [], []
    while position(store).passes == 0 and len(counts) < 50:
        counts.append(restarted(check).step(5))
        positions.append(position(store))
    # every item of the table checked exactly once in the pass, 5 at most per step
    assert sum(counts) == 24 and max(counts) == 5 and len(counts) >= 5
    assert any(p.resume for p in positions), "a step stopped inside a segment and saved where"
    assert positions[-1] == CheckPosition(SEGMENTS, 0, None, 1, ())
    assert value(metrics, "ddb2bt_verify_checked_total", table="job") == 24
    assert value(metrics, "ddb2bt_verify_last_full_pass_timestamp_seconds", table="job") == clock[0] / 1000


def test_nothing_is_checked_while_a_migration_is_not_live():
    bt, ddb, store, metrics, check, clock, sleep = world()
    store.save_meta("phase", "CATCHING_UP")
    assert check.step(5) == 0 and store.load_meta(POSITION_META) is None
    assert value(metrics, "ddb2bt_verify_checked_total", table="job") == 0
    store.save_meta("phase", "LIVE")
    assert check.step(5) == 5 and position(store).segments == SEGMENTS


class Job:
    """What the step reads of a LiveJob."""
    name = "job"


def test_the_dataflow_step_records_a_divergent_item_and_advances_the_stored_position():
    bt, ddb, store, metrics, check, clock, sleep = world()
    wall = [1_000_000.0]
    fn = _ContinuousCheckStepFn(Job(), check.options, 10, 10.0, connect=lambda job, options: restarted(check),
                                wall_s=lambda: wall[0])
    fn.setup()
    bt.mutate_rows("product_catalog", [(b"p1#s4", [SetCell("SKU", b"Description", b"tampered", T + 5)])])
    ticks = []
    while not store.list_dead_letters(reason=DIVERGENT) and len(ticks) < 30:
        wall[0] += 10
        ticks.append(list(fn.process(Timestamp.of(wall[0]))))
        if len(ticks) == 1:
            assert position(store) != CheckPosition(), "the first tick moved the stored position"
    (letter,) = store.list_dead_letters(reason=DIVERGENT)
    assert letter["stage"] == "verify"
    assert value(metrics, "ddb2bt_verify_divergent_total", table="job", kind="different_cells") == 1
    assert all(len(out) == 1 and 0 < out[0] <= 10 for out in ticks)  # each tick: one step of 10 items at most
    assert position(store).passes >= 1  # found on one pass, confirmed on the next
    # a tick far behind the wall clock (a backlog after a long step) is dropped, not caught up
    before = store.load_meta(POSITION_META)
    assert list(fn.process(Timestamp.of(wall[0] - 100))) == [] and store.load_meta(POSITION_META) == before
    # a failing step is logged; the job goes on and the next tick retries
    fn._check.scan_segment = lambda *a: (_ for _ in ()).throw(ConnectionError("DynamoDB unreachable"))
    assert list(fn.process(Timestamp.of(wall[0]))) == [] and store.load_meta(POSITION_META) == before


def _world_check(job, options):
    return world()[4]


def test_a_step_in_a_beam_job_reports_its_counts_as_beam_metrics():
    """What Dataflow's UI shows: the step's counts as Beam metrics (the same DoFn
    in a real, bounded Beam job on the local runner: pickled, set up, one tick)."""
    import apache_beam as beam
    from apache_beam.metrics.metric import MetricsFilter

    from ddb2bt.pipeline.graph import make_pipeline

    tick = 1_000_000.0
    fn = _ContinuousCheckStepFn(Job(), ContinuousOptions(items_per_s=1000, segments=SEGMENTS), 10, 10.0,
                                connect=_world_check, wall_s=lambda: tick)
    p = make_pipeline([])
    p | beam.Create([Timestamp.of(tick)]) | beam.ParDo(fn)
    result = p.run()
    result.wait_until_finish()
    counters = {r.key.metric.name: r.committed
                for r in result.metrics().query(MetricsFilter().with_namespace("ddb2bt"))["counters"]}
    assert counters.get("verify_checked_job") == 10
