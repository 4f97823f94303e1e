"""The cutover's phase machine, its finish and the marking policy, with an
injected clock, an in-memory state store and a fake admin: no emulators."""
from __future__ import annotations

import itertools

import pytest

from ddb2bt.pipeline.control import phases
from ddb2bt.pipeline.control.clock import CLOCK_SKEW_MARGIN_S
from ddb2bt.pipeline.control.markers import Bookkeeping
from ddb2bt.pipeline.control.phases import (BACKFILLING, CATCHING_UP, LIVE, MARKING_WAIT_S, PHASE_CACHE_S,
                                            MarkingPolicy, Migration, Phase, PhaseError, advance,
                                            check_transition)
from ddb2bt.pipeline.control.state import BackfillCheckpoint, StateStore
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.mapping import MARKER_FAMILY


class Clock:
    def __init__(self, ms: int = 1_700_000_000_000) -> None:
        self.ms = ms
        self.slept: list = []

    def now_ms(self) -> int:
        return self.ms

    def now_s(self) -> float:
        return self.ms / 1000

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.ms += int(seconds * 1000)


class FakeAdmin:
    def __init__(self, tables: dict) -> None:
        self.tables = {t: set(f) for t, f in tables.items()}
        self.calls: list = []
        self.on_drop = lambda: None

    def exists(self, table):
        return table in self.tables

    def families(self, table):
        return set(self.tables[table])

    def add_family(self, table, family):
        self.calls.append(("add", table, family.name))
        self.tables[table].add(family.name)

    def drop_family(self, table, name):
        self.calls.append(("drop", table, name))
        self.tables[table].discard(name)
        self.on_drop()


def world(tables=("t", "t_idx")):
    clock = Clock()
    store = StateStore(InMemoryBigtable(), "job", clock.now_ms)
    admin = FakeAdmin({t: {"f"} for t in tables})
    return clock, store, admin, Bookkeeping(admin), Migration(store, clock.now_ms, clock.sleep)


STATES = (None, BACKFILLING, CATCHING_UP, LIVE, Phase.RECOVERING, Phase.CUT_OVER)
ALLOWED = {(None, BACKFILLING), (BACKFILLING, BACKFILLING), (BACKFILLING, CATCHING_UP), (CATCHING_UP, LIVE),
           (CATCHING_UP, BACKFILLING), (LIVE, BACKFILLING),
           # recovery of a trimmed tail (recover/recover.py): from a replicating job, resumed, back to LIVE
           (None, Phase.RECOVERING), (CATCHING_UP, Phase.RECOVERING), (LIVE, Phase.RECOVERING),
           (Phase.RECOVERING, Phase.RECOVERING), (Phase.RECOVERING, LIVE),
           # a re-copy (migrate --restart) supersedes a recovery given up half-way
           (Phase.RECOVERING, BACKFILLING),
           # the cutover (rollback run takes the stopped tail's lease), then only a new migration
           (LIVE, Phase.CUT_OVER), (Phase.CUT_OVER, BACKFILLING)}


@pytest.mark.parametrize("current,target", list(itertools.product(STATES, tuple(Phase))))
def test_only_the_listed_transitions_are_allowed(current, target):
    if (current, target) in ALLOWED:
        check_transition(current, target)
    else:
        with pytest.raises(PhaseError):
            check_transition(current, target)


def test_a_transition_is_checked_against_the_stored_phase():
    clock, store, admin, bk, m = world()
    with pytest.raises(PhaseError):
        m.transition(LIVE)  # never straight from nothing to LIVE
    assert m.phase is None
    m.transition(BACKFILLING)
    with pytest.raises(PhaseError):
        m.go_live()
    store.save_meta("phase", "SOMETHING_ELSE")
    with pytest.raises(PhaseError):
        _ = m.phase


def test_begin_creates_the_marker_family_then_waits_for_the_tails_then_fixes_the_handoff():
    clock, store, admin, bk, m = world()
    start = clock.ms
    handoff = m.begin_backfill({"kind": "scan", "parts": 2}, bk, ("t", "t_idx"))
    assert m.phase == BACKFILLING
    assert all(MARKER_FAMILY in f for f in admin.tables.values())
    # T is set back by the clock margin (this clock may run that much ahead of
    # AWS's), and the wait covers it: the tails mark from T's second on.
    assert clock.slept == [MARKING_WAIT_S + CLOCK_SKEW_MARGIN_S]
    assert handoff == start + MARKING_WAIT_S * 1000 == m.handoff_ms
    assert m.marker_tables() == ["t", "t_idx"]
    # resuming the same backfill keeps T; other options refuse; --restart begins anew
    assert m.resume_or_begin({"kind": "scan", "parts": 2}, False, bk, ("t",)) == handoff
    with pytest.raises(Exception, match="--restart"):
        m.resume_or_begin({"kind": "scan", "parts": 4}, False, bk, ("t",))
    assert m.resume_or_begin({"kind": "scan", "parts": 4}, True, bk, ("t",)) > handoff


def test_catching_up_only_once_every_part_is_done_then_finish_then_live():
    clock, store, admin, bk, m = world()
    m.begin_backfill({"kind": "scan", "parts": 2}, bk, ("t", "t_idx"))
    store.save_backfill_progress([BackfillCheckpoint("scan", "a", None, 5, done=True)])
    assert not m.finish_backfill() and m.phase == BACKFILLING
    assert not m.finish(bk, ("t",)), "no finish while backfilling: the guards need the markers"
    assert all(MARKER_FAMILY in f for f in admin.tables.values())
    store.save_backfill_progress([BackfillCheckpoint("scan", "b", None, 5, done=True)])
    assert m.finish_backfill() and m.phase == CATCHING_UP
    assert not m.finish_backfill(), "idempotent"
    with pytest.raises(PhaseError):
        m.go_live()  # markers still there
    clock.slept.clear()
    assert m.finish(bk, ("t",))
    assert clock.slept == [pytest.approx(MARKING_WAIT_S)], "the tails get their phase-cache time to stop marking"
    assert all(MARKER_FAMILY not in f for f in admin.tables.values()), "dropped in every recorded table"
    assert bk.remaining(("t", "t_idx")) == []
    m.go_live()
    assert m.phase == LIVE
    m.go_live()  # idempotent
    assert m.finish(bk, ("t",)) and sum(1 for c in admin.calls if c[0] == "drop") == 2, "drop only what exists"


def test_a_backfill_beginning_while_the_finish_drops_gets_its_family_back():
    clock, store, admin, bk, m = world()
    m.begin_backfill({"kind": "scan", "parts": 1}, bk, ("t",))
    store.save_backfill_progress([BackfillCheckpoint("scan", "a", None, 1, done=True)])
    m.finish_backfill()
    other = Migration(store, clock.now_ms, lambda s: None)
    admin.on_drop = lambda: (store.save_meta("phase", str(BACKFILLING)) if m.phase != BACKFILLING else None)
    assert not m.finish(bk, ("t",), wait=False)
    assert other.phase == BACKFILLING and MARKER_FAMILY in admin.tables["t"]
    assert m.finished_ms is None


def test_advance_moves_a_migration_without_a_controller():
    clock, store, admin, bk, m = world()
    m.begin_backfill({"kind": "scan", "parts": 1}, bk, ("t",))
    assert advance(m, bk, at_head=True, promote_live=True) == BACKFILLING
    store.save_backfill_progress([BackfillCheckpoint("scan", "a", None, 1, done=True)])
    assert advance(m, bk, at_head=True, promote_live=True) == CATCHING_UP
    assert MARKER_FAMILY in admin.tables["t"], "the tails may still mark: no drop yet"
    clock.ms += int(MARKING_WAIT_S * 1000)
    assert advance(m, bk, at_head=False, promote_live=True) == CATCHING_UP
    assert MARKER_FAMILY not in admin.tables["t"] and m.finished_ms is not None
    assert advance(m, bk, at_head=True, promote_live=False) == CATCHING_UP
    assert advance(m, bk, at_head=True, promote_live=True) == LIVE


class ReadOnlyStore:
    """A store that answers a phase (or fails) and refuses every write."""

    def __init__(self, phase=None) -> None:
        self.phase = phase
        self.fail = False
        self.reads = 0

    def load_meta(self, name):
        self.reads += 1
        if self.fail:
            raise ConnectionError("state table unreachable")
        return self.phase

    def save_meta(self, name, value):
        raise AssertionError("the marking policy must never write state")


def test_marking_policy_is_fail_safe_and_read_only():
    clock = Clock()
    store = ReadOnlyStore("CATCHING_UP")
    policy = MarkingPolicy(lambda: store, now=clock.now_s)
    policy.setup()
    assert policy.active() is False
    store.phase = "BACKFILLING"
    assert policy.active() is False, "cached for PHASE_CACHE_S"
    clock.ms += int(PHASE_CACHE_S * 1000)
    assert policy.active() is True
    store.phase = "LIVE"
    clock.ms += int(PHASE_CACHE_S * 1000)
    assert policy.active() is False
    # the last answer was "not marking" and now the phase cannot be read: mark
    store.fail = True
    clock.ms += int(PHASE_CACHE_S * 1000)
    assert policy.active() is True
    store.fail = False
    clock.ms += int(PHASE_CACHE_S * 1000)
    assert policy.active() is False
    store.phase = "GARBAGE"
    clock.ms += int(PHASE_CACHE_S * 1000)
    assert policy.active() is True, "an unknown phase is an unreadable phase"


def test_marking_policy_marks_before_its_first_read_and_when_the_store_cannot_be_built():
    clock = Clock()

    def broken():
        raise ConnectionError("no Bigtable")

    policy = MarkingPolicy(broken, now=clock.now_s)
    policy.setup()
    assert policy.active() is True
    clock.ms += int(PHASE_CACHE_S * 1000)
    assert policy.active() is True


def test_only_the_cutover_and_recover_packages_write_the_phase():
    """No module outside pipeline/cutover/, pipeline/recover/ (a recovery moves
    a LIVE table to RECOVERING and back) and the phase machine itself
    (control/phases.py, and control/keeper.py that moves it where no controller
    runs) writes the phase meta key or calls the machine's writers."""
    import pathlib

    root = pathlib.Path(phases.__file__).resolve().parents[2]
    offenders = []
    for path in list((root / "pipeline").rglob("*.py")) + list((root / "transforms").rglob("*.py")):
        if {"cutover", "recover", "testing"} & set(path.parts):
            continue
        if path.parent.name == "control" and path.name in ("phases.py", "keeper.py"):
            continue
        text = path.read_text()
        for needle in ('save_meta("phase"', ".transition(", ".set_phase(", ".go_live(", ".finish_backfill("):
            if needle in text:
                offenders.append(f"{path.relative_to(root)}: {needle}")
    assert offenders == []


def test_the_cutover_is_taken_only_from_live_once_and_records_its_time():
    clock, store, admin, bk, m = world()
    with pytest.raises(PhaseError, match="not LIVE"):
        m.cut_over()
    m.transition(BACKFILLING)
    m.transition(CATCHING_UP)
    with pytest.raises(PhaseError, match="CATCHING_UP, not LIVE"):
        m.cut_over()
    m.transition(LIVE)
    at = m.cut_over()
    assert m.phase == Phase.CUT_OVER and m.cutover_ms == at
    clock.sleep(5)
    assert m.cut_over() == at  # idempotent: a restarted rollback keeps the first cutover time
