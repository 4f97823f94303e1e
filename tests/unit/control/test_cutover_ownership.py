"""Who may move the cutover and when (docs/design.md, "Ownership" and "Clock
assumptions"): phase moves are compare-and-set, so a reader that decided on a
stale phase cannot undo a `backfill --restart`; LIVE waits for every partition;
a redrive during a backfill marks what it writes; markers are never stripped
while a backfill may run; reserved family names are refused; a cutover refuses
a clock too far from AWS's."""
from __future__ import annotations

import email.utils

import pytest

from ddb2bt.pipeline.control.clock import CLOCK_SKEW_MARGIN_S, ClockSkewError, check_clock, read_skew
from ddb2bt.pipeline.control.phases import (BACKFILLING, CATCHING_UP, LIVE, MARKING_WAIT_S, Migration, PhaseMoved,
                                            advance, parse_phase)
from ddb2bt.pipeline.recover.redrive import redrive
from ddb2bt.pipeline.clients.bigtable.errors import BigtableRetryable
from ddb2bt.pipeline.sink.sink import BatchingWriter
from ddb2bt.pipeline.control.state import BackfillCheckpoint, StateStore
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.dofns import map_record
from ddb2bt.transforms.errors import ConfigError
from ddb2bt.transforms.mapping import MARKER_FAMILY, backfill_record
from ddb2bt.transforms.model import INSERT, REMOVE, BackfillPosition, ChangeRecord, DeadLetter

from ddb2bt.pipeline.control.catchup import LIVE_SETTLE_S, CatchUpReport
from tests.unit.cutover.cutover_common import CATALOG, FAST, T, item

# A partition caught up (applied up to now, no lag) and one far behind.
UP = CatchUpReport(0, 1 << 62)
BEHIND = CatchUpReport(600_000, 0)
from tests.unit.control.test_cutover_phases import world

SPEC = {"kind": "scan", "parts": 2}
TABLES = ("t", "t_idx")


# --- phase moves: compare-and-set ---------------------------------------------------

def _all_parts_done(store):
    store.save_backfill_progress([BackfillCheckpoint("scan", p, None, 1, done=True) for p in ("a", "b")])


def test_a_reader_that_saw_every_part_done_cannot_overwrite_a_restarted_backfill():
    clock, store, admin, bk, m = world()
    m.begin_backfill(SPEC, bk, TABLES)
    _all_parts_done(store)
    reader = Migration(store, clock.now_ms, clock.sleep)  # a tail reader on another worker
    decided = reader.backfill_complete

    def complete_then_restart():
        done = decided()
        m.resume_or_begin(SPEC, True, bk, TABLES)  # `backfill --restart` lands right after the reader looked
        return done

    reader.backfill_complete = complete_then_restart
    assert reader.finish_backfill() is False
    assert m.phase == BACKFILLING and not m.backfill_complete()
    # the readers' next steps leave the new backfill alone: markers stay
    clock.sleep(MARKING_WAIT_S * 3)
    assert advance(Migration(store, clock.now_ms, clock.sleep), bk, True, True) == BACKFILLING
    assert all(MARKER_FAMILY in f for f in admin.tables.values())


def test_every_move_changes_the_stored_value_and_a_stale_expected_value_is_refused():
    clock, store, admin, bk, m = world()
    m.begin_backfill(SPEC, bk, TABLES)
    first = m.phase_value()
    m.begin_backfill(SPEC, bk, TABLES)  # BACKFILLING -> BACKFILLING (a restart)
    assert parse_phase(m.phase_value()) == BACKFILLING and m.phase_value() != first
    with pytest.raises(PhaseMoved):
        m.transition(CATCHING_UP, first, based_on_read=True)
    assert m.phase == BACKFILLING


def test_live_waits_for_every_partition_at_the_head():
    clock, store, admin, bk, m = world()
    m.begin_backfill(SPEC, bk, TABLES)
    _all_parts_done(store)
    assert m.finish_backfill()
    clock.sleep(MARKING_WAIT_S)
    m.report_heads("s1", {0: True, 1: True, 2: False})  # partition 2 lags
    assert not m.all_at_head("s1", 3)
    assert advance(m, bk, m.all_at_head("s1", 3), True) == CATCHING_UP
    m.report_heads("s1", {2: True})
    assert not m.all_at_head("s1", 3), "caught up, but not yet for the settling period"
    clock.sleep(LIVE_SETTLE_S)
    m.report_heads("s1", {0: True, 1: True, 2: True})
    assert m.all_at_head("s1", 3)
    assert advance(m, bk, True, True) == LIVE
    clock.sleep(60)  # reports that stopped coming count for nothing
    assert not m.all_at_head("s1", 3)


def test_a_break_in_being_caught_up_starts_the_settling_period_again():
    clock, store, admin, bk, m = world()
    m.report_heads("s1", {0: True})
    clock.sleep(LIVE_SETTLE_S / 2)
    m.report_heads("s1", {0: False})  # a backlog between two good looks
    clock.sleep(LIVE_SETTLE_S / 2)
    m.report_heads("s1", {0: True})
    assert not m.all_at_head("s1", 1)
    clock.sleep(LIVE_SETTLE_S)
    m.report_heads("s1", {0: True})
    assert m.all_at_head("s1", 1)


# --- markers: kept while a backfill may run --------------------------------------

def test_markers_are_not_stripped_while_a_backfill_runs_and_are_once_it_finished():
    bt = InMemoryBigtable(families={"product_catalog": {"SKU"}, "__state__": {"ckpt", "dlq", "meta"}})
    store = StateStore(bt, "job", lambda: T)
    store.save_meta("phase", "BACKFILLING")
    sink = BatchingWriter(bt, store, FAST, sleep=lambda s: None)
    new = item(pk="hats", sk="a", Price=3)
    sink.add(map_record(CATALOG, ChangeRecord(INSERT, item(pk="hats", sk="a"), new, None, T), lambda: T, True))
    with pytest.raises(BigtableRetryable, match="touch markers"):
        sink.flush()
    assert "product_catalog" not in bt.tables, "nothing written without its marker"
    # the family appears (the backfill's begin creates it after writing the phase)
    bt.families["product_catalog"].add(MARKER_FAMILY)
    sink.add(map_record(CATALOG, ChangeRecord(INSERT, item(pk="hats", sk="a"), new, None, T), lambda: T, True))
    assert sink.flush() == []
    assert any(f == MARKER_FAMILY for f, _ in bt.latest("product_catalog")[b"hats#a"])
    # after the finish: a late marker write is stripped, never a dead letter
    store.save_meta("phase", "CATCHING_UP")
    bt.families["product_catalog"].discard(MARKER_FAMILY)
    sink.add(map_record(CATALOG, ChangeRecord(INSERT, item(pk="hats", sk="b"), new, None, T), lambda: T, True))
    assert sink.flush() == []
    assert b"hats#b" in bt.latest("product_catalog")


# --- dlq redrive during a backfill --------------------------------------------------

class Table:
    def __init__(self, items):
        self.items = {(i["pk"]["S"], i["sk"]["S"]): i for i in items}

    def get(self, keys):
        return self.items.get((keys["pk"]["S"], keys["sk"]["S"]))


def test_a_redrive_during_a_backfill_marks_so_a_late_backfill_batch_cannot_resurrect():
    bt = InMemoryBigtable()
    clock = [T + 10_000]
    store = StateStore(bt, "job", lambda: clock[0])
    store.save_meta("phase", "BACKFILLING")
    keys = item(pk="hats", sk="a")
    old = item(pk="hats", sk="a", Price=1)
    # a change of the item was dead-lettered; the item has been deleted since
    store.save_dead_letters([DeadLetter("encoding", "MappingError", "m", "map",
                                        ChangeRecord(INSERT, keys, old, None, T + 1000), T + 1000)])
    batcher = BatchingWriter(bt, None, FAST, sleep=lambda s: None)
    result = redrive(CATALOG, store, batcher, Table([]), now_ms=lambda: clock[0],
                     sleep=lambda s: clock.__setitem__(0, clock[0] + int(s * 1000)))
    assert result.resolved == 1
    # a backfill batch that scanned the item before it was deleted lands now
    backfill = BatchingWriter(bt, store, FAST, sleep=lambda s: None)
    backfill.add(map_record(CATALOG, backfill_record(keys, old, T, BackfillPosition("scan", "p", "x", 1)),
                            lambda: T))
    assert backfill.flush() == []
    rows = {k: {c: v for c, v in cells.items() if c[0] != MARKER_FAMILY}
            for k, cells in bt.latest("product_catalog").items()}
    assert not any(rows.values()), "the redrive's delete must hold against the backfill"


def test_a_redrive_outside_a_backfill_writes_no_marker():
    bt = InMemoryBigtable()
    clock = [T + 10_000]
    store = StateStore(bt, "job", lambda: clock[0])
    store.save_meta("phase", "LIVE")
    now = item(pk="hats", sk="a", Price=2)
    store.save_dead_letters([DeadLetter("encoding", "MappingError", "m", "map",
                                        ChangeRecord(INSERT, item(pk="hats", sk="a"), now, None, T), T)])
    redrive(CATALOG, store, BatchingWriter(bt, None, FAST, sleep=lambda s: None), Table([now]),
            now_ms=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + int(s * 1000)))
    assert all(f != MARKER_FAMILY for f, _ in bt.latest("product_catalog")[b"hats#a"])


# --- reserved family names ------------------------------------------------------------

def _mapping_with_family(tmp_path, family):
    text = open("examples/product_catalog.yaml").read().replace("SKU", family)
    path = tmp_path / "m.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("family", ["ddb2bt_touch", "ddb2bt_mine", "DDB2BT_x"])
def test_a_mapping_with_a_ddb2bt_family_is_refused(tmp_path, family):
    with pytest.raises(ConfigError, match="reserved") as info:
        load_mapping(_mapping_with_family(tmp_path, family))
    assert f"families.{family}" in str(info.value), "the error names the field"


def test_the_cli_refuses_it_in_validate_and_lint(tmp_path, capsys):
    from ddb2bt.pipeline.app.cli import main

    path = _mapping_with_family(tmp_path, "ddb2bt_touch")
    for command in ("validate", "lint"):
        assert main([command, "--mapping", str(path)]) != 0
        assert "reserved" in capsys.readouterr().err


# --- the clock check ---------------------------------------------------------------

def _response(aws_s: float) -> dict:
    return {"ResponseMetadata": {"HTTPHeaders": {"date": email.utils.formatdate(aws_s, usegmt=True)}}}


def test_the_clock_check_refuses_a_cutover_on_a_clock_ahead_of_aws():
    aws = 1_700_000_000.0
    local = aws + CLOCK_SKEW_MARGIN_S + 2.5
    with pytest.raises(ClockSkewError, match="ahead of DynamoDB"):
        check_clock(lambda: _response(aws), "DynamoDB", now=lambda: local)
    with pytest.raises(ClockSkewError, match="behind"):
        check_clock(lambda: _response(aws), "DynamoDB", now=lambda: aws - 30)
    # within the margin (and the Date header's one-second resolution): accepted
    for offset in (0.0, 0.9, CLOCK_SKEW_MARGIN_S, -2.0):
        assert check_clock(lambda: _response(aws), "DynamoDB", now=lambda: aws + offset) is not None
    reading = read_skew(lambda: _response(aws), now=lambda: aws + 10.4)
    assert reading.low_s == pytest.approx(9.4) and reading.high_s == pytest.approx(10.4)


def test_a_skewed_clock_refuses_the_backfill_before_anything_is_recorded(monkeypatch):
    from ddb2bt.pipeline.cutover import controller

    clock, store, admin, bk, m = world()
    monkeypatch.setattr(controller, "backfill_source", lambda options, mapping: (None, SPEC, None, 0))

    def skewed(mapping):
        check_clock(lambda: _response(1_700_000_000.0), "DynamoDB", now=lambda: 1_700_000_010.0)

    monkeypatch.setattr(controller, "check_source_clock", skewed)
    with pytest.raises(ClockSkewError):
        controller._begin(CATALOG, m, controller.BackfillOptions())
    assert m.phase is None and m.handoff_ms is None and admin.calls == []


# --- the keeper: the one component that moves the phase where no controller runs ---

def test_the_keeper_moves_the_phase_and_waits_for_every_partition_at_the_head():
    from ddb2bt.pipeline.control.keeper import CutoverKeeper

    clock, store, admin, bk, m = world()
    m.begin_backfill(SPEC, bk, TABLES)
    _all_parts_done(store)
    keeper = CutoverKeeper(lambda: store, lambda: bk, promote_live=True,
                           migration_factory=lambda s: Migration(s, clock.now_ms, clock.sleep))
    keeper.report("s1", 0, 2, UP, start=False)
    keeper.report("s1", 1, 2, BEHIND, start=False)  # partition 1 lags
    assert keeper.step() == CATCHING_UP
    clock.sleep(MARKING_WAIT_S)
    keeper.report("s1", 0, 2, UP, start=False)  # readers report every round
    keeper.report("s1", 1, 2, BEHIND, start=False)
    assert keeper.step() == CATCHING_UP, "held back: one partition lags"
    assert not any(MARKER_FAMILY in f for f in admin.tables.values()), "the keeper ran the finish"
    keeper.report("s1", 0, 2, UP, start=False)
    keeper.report("s1", 1, 2, UP, start=False)
    assert keeper.step() == CATCHING_UP, "caught up on one step: not yet for the settling period"
    clock.sleep(LIVE_SETTLE_S)
    keeper.report("s1", 1, 2, BEHIND, start=False)  # a bad look between two steps counts
    keeper.report("s1", 1, 2, UP, start=False)
    keeper.report("s1", 0, 2, UP, start=False)
    assert keeper.step() == CATCHING_UP
    for _ in range(2):
        clock.sleep(LIVE_SETTLE_S)
        keeper.report("s1", 0, 2, UP, start=False)
        keeper.report("s1", 1, 2, UP, start=False)
        phase = keeper.step()
    assert phase == LIVE


def test_the_keeper_wants_every_partition_past_the_handoff():
    from ddb2bt.pipeline.control.keeper import CutoverKeeper

    clock, store, admin, bk, m = world()
    m.begin_backfill(SPEC, bk, TABLES)
    _all_parts_done(store)
    assert m.finish_backfill()
    keeper = CutoverKeeper(lambda: store, lambda: bk, promote_live=True,
                           migration_factory=lambda s: Migration(s, clock.now_ms, clock.sleep))
    before = CatchUpReport(0, m.handoff_ms - 5_000)  # no lag, but applied only up to before the handoff
    for _ in range(4):
        clock.sleep(LIVE_SETTLE_S)
        keeper.report("s1", 0, 1, before, start=False)
        assert keeper.step() == CATCHING_UP


def test_a_reader_that_ended_idle_moves_a_caught_up_migration_live_on_the_last_step():
    """`run --until-idle 5` ends before a keeper step and before a settling
    period: its idle end is the proof, and the keeper's last step uses it."""
    from ddb2bt.pipeline.control.keeper import CutoverKeeper

    clock, store, admin, bk, m = world()
    m.begin_backfill(SPEC, bk, TABLES)
    _all_parts_done(store)
    assert m.finish_backfill()
    clock.sleep(MARKING_WAIT_S)
    keeper = CutoverKeeper(lambda: store, lambda: bk, promote_live=True,
                           migration_factory=lambda s: Migration(s, clock.now_ms, clock.sleep))
    keeper.report("s1", 0, 1, BEHIND, start=False)
    assert keeper.step() == CATCHING_UP
    keeper.report("s1", 0, 1, CatchUpReport(0, clock.now_ms()), start=False, ended_idle=True)
    assert keeper.step() == LIVE


def test_the_keeper_records_no_report_of_a_partition_this_process_no_longer_owns():
    from ddb2bt.pipeline.control.keeper import CutoverKeeper
    from ddb2bt.pipeline.control.lease import LeaseLost

    clock, store, admin, bk, m = world()
    m.begin_backfill(SPEC, bk, TABLES)
    _all_parts_done(store)
    assert m.finish_backfill()  # CATCHING_UP: where the partitions are matters now
    keeper = CutoverKeeper(lambda: store, lambda: bk, promote_live=True,
                           migration_factory=lambda s: Migration(s, clock.now_ms, clock.sleep))

    def moved():
        raise LeaseLost("partition 0 moved to another worker")

    keeper.report("s1", 0, 2, UP, start=False, fence=moved)  # reported just before a SIGSTOP
    keeper.report("s1", 1, 2, UP, start=False)
    keeper.step()
    assert store.load_meta("head#s1#0") is None and store.load_meta("head#s1#1") is not None


def test_the_last_stream_context_done_with_a_keeper_stops_it():
    from dataclasses import dataclass

    from ddb2bt.pipeline.control.coordinator import coordinator_for

    @dataclass(frozen=True)
    class Spec:  # a StateSpec stand-in: where the state lives
        bigtable: object
        job: str = "j"
        table: str = "state"

    class Bt:
        project, instance = "p", "i"

    spec = Spec(Bt())
    coordinator = coordinator_for(spec, spec)
    assert coordinator_for(spec) is coordinator  # one per job in the process, found again by each DoFn
    assert coordinator.use_keeper(True) and coordinator.use_keeper(True)  # two stream contexts
    keeper = coordinator._keeper
    coordinator.release_keeper()
    assert not keeper._stop.is_set() and coordinator._keeper is keeper
    coordinator.release_keeper()
    assert keeper._stop.is_set() and coordinator._keeper is None
