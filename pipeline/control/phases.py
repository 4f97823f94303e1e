"""The migration's phase machine, handoff time and marking policy.

Phases (stored in the state table, ``{job}#meta#phase``)::

  (none) ──begin──▶ BACKFILLING ──every part done──▶ CATCHING_UP ──finish + tail caught up──▶ LIVE
                        ▲   │                            │                                  │
                        └───┴──── begin (a new backfill, --restart) ─────────────────────────┘

  BACKFILLING  the tail runs and marks the items it touches (``ddb2bt_touch``);
               the backfill copies the table with cells one millisecond older
               than the handoff second, guarded by those markers
  CATCHING_UP  every backfill part is written; the tail catches up. Once the tail
               has had time to stop marking, the *finish* drops the marker family
               (``bookkeeping.Bookkeeping``): the target then holds only cells the
               mapping owns
  LIVE         finished and the tail caught up in time (control/catchup.py: past
               the handoff, lag under a bound for a settling period): ready for
               `verify` and cutover

This module is the only code that writes the phase (``Migration.transition``
checks every move against ``TRANSITIONS`` and raises ``PhaseError`` otherwise).
Every move is a compare-and-set against the exact value the decision was based
on: the stored value is ``PHASE@nonce`` (a fresh nonce per move, so even a
restarted backfill's BACKFILLING → BACKFILLING changes it), and a process that
decided "every part is done" just before a ``backfill --restart`` cleared the
progress loses its compare-and-set instead of writing CATCHING_UP over the new
BACKFILLING (``PhaseMoved``).
The mapping stage only *reads* it, through ``MarkingPolicy``, which is fail-safe:
whenever the phase cannot be read, the tail marks.

The handoff time T is recorded once per backfill, after the phase says
BACKFILLING and the tails have had time to notice (``MARKING_WAIT_S``), so every
tail change at or after T's second carries a touch marker.
"""
from __future__ import annotations

import enum
import json
import logging
import time
import uuid
from typing import Callable, Optional, Sequence

from ddb2bt.transforms.errors import ConfigError, PermanentError
from ddb2bt.pipeline.control.catchup import LIVE_SETTLE_S
from ddb2bt.pipeline.control.clock import CLOCK_SKEW_MARGIN_S
from ddb2bt.pipeline.observe.logs import table_logger
from ddb2bt.pipeline.observe.metrics import default_metrics, UNNAMED_TABLE

log = logging.getLogger(__name__)


class Phase(enum.StrEnum):
    # A trimmed tail being recovered from incremental exports (recover/recover.py);
    # the tail is stopped (recover holds its lease), so nothing marks. First: a job
    # of several tables is as far as its least advanced table (controller._overall).
    RECOVERING = "RECOVERING"
    BACKFILLING = "BACKFILLING"
    CATCHING_UP = "CATCHING_UP"
    LIVE = "LIVE"
    # Cut over: the forward tail stopped (`ddb2bt rollback run` took its lease from a
    # LIVE job and holds it) and the application writes to Bigtable; the way back
    # (rollback) writes DynamoDB. A forward run refuses to start (it would copy the
    # rollback's writes back): after switching back, a new migration begins anew.
    CUT_OVER = "CUT_OVER"


BACKFILLING, CATCHING_UP, LIVE = Phase.BACKFILLING, Phase.CATCHING_UP, Phase.LIVE
CUT_OVER = Phase.CUT_OVER
RECOVERING = Phase.RECOVERING
PHASES = tuple(Phase)
# Allowed moves. BACKFILLING → BACKFILLING is a restarted backfill (new handoff);
# CATCHING_UP/LIVE → BACKFILLING a new backfill after the first one.
TRANSITIONS = {
    None: frozenset({BACKFILLING}),
    BACKFILLING: frozenset({BACKFILLING, CATCHING_UP}),
    CATCHING_UP: frozenset({BACKFILLING, LIVE}),
    LIVE: frozenset({BACKFILLING}),
}
# Recovery of a trimmed tail: from a replicating job (no phase, CATCHING_UP, LIVE),
# resumed as itself, and back to LIVE once the exports are applied.
for _p in (None, CATCHING_UP, LIVE):
    TRANSITIONS[_p] = TRANSITIONS[_p] | {RECOVERING}
# A re-copy (`migrate --restart`, §7.7) supersedes a recovery given up half-way:
# its backfill restores what the recovery was to restore.
TRANSITIONS[RECOVERING] = frozenset({RECOVERING, LIVE, BACKFILLING})
# The cutover: only from LIVE (verified, caught up); after it only a new migration.
TRANSITIONS[LIVE] = TRANSITIONS[LIVE] | {CUT_OVER}
TRANSITIONS[CUT_OVER] = frozenset({BACKFILLING})
# The tail re-reads the phase this often; the backfill waits for two refreshes
# plus a second before fixing T, so no change at or after T's second goes unmarked.
PHASE_CACHE_S = 2.0
MARKING_WAIT_S = 2 * PHASE_CACHE_S + 1.0
# A partition's "caught up" report counts this long: keepers record every step
# (10 s), so three missed reports mean it lags or stopped.
HEAD_FRESH_S = 30.0


class PhaseError(PermanentError):
    """A phase move the machine does not allow, or a phase value it does not know."""


class PhaseMoved(PhaseError):
    """The phase changed between reading it and moving it (another process moved
    it first): the move was not made; decide again from the new phase."""


# Meta cell: "1" while the recorded backfill owes the re-copy sweep (§7.7).
RECOPY_META = "recopy"
# The stored value is "PHASE@nonce": readers take the part before this.
NONCE_SEP = "@"
# How often a move re-reads and retries when another process moved the phase
# first (only for moves that are right from any phase: a new backfill).
CAS_ATTEMPTS = 3


def check_transition(current: Optional[Phase], target: Phase) -> None:
    if target not in TRANSITIONS.get(current, frozenset()):
        raise PhaseError(f"migration phase cannot move from {current or '(none)'} to {target}")


def parse_phase(value: Optional[str]) -> Optional[Phase]:
    if not value:
        return None
    try:
        return Phase(value.split(NONCE_SEP, 1)[0])
    except ValueError:
        raise PhaseError(f"unknown migration phase {value!r} in the state table") from None


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class MarkingPolicy:
    """Whether the live tail must set touch markers: while a backfill runs, and
    whenever that cannot be known (fail-safe: a marker too many costs a cell
    until the finish drops the family; a marker too few can resurrect a deleted
    item). Only reads the state table: the mapping stage never writes state.

    ``store_factory`` builds the state store on the worker (``setup``); ``now`` is
    a monotonic clock. Both injected for tests."""

    def __init__(self, store_factory, now: Callable[[], float] = time.monotonic) -> None:
        self._factory = store_factory
        self._now = now

    def setup(self) -> None:
        self._store = None
        self._checked: Optional[float] = None
        self._active = True  # until the first successful read

    def active(self) -> bool:
        now = self._now()
        if self._checked is not None and now - self._checked < PHASE_CACHE_S:
            return self._active
        self._checked = now
        try:
            if self._store is None:
                self._store = self._factory()
            self._active = parse_phase(self._store.load_meta("phase")) == BACKFILLING
        except Exception as exc:  # unreadable: mark (see the class docstring)
            if not self._active:
                table_logger(log, getattr(self._factory, "job", "")).warning(
                    "cannot read the migration phase (%s): marking until it can be read",
                            type(exc).__name__)
            self._active = True
        return self._active


PhaseMarking = MarkingPolicy  # the former name


def backfill_may_run(store) -> bool:
    """Whether a backfill may be running now (phase BACKFILLING, or unknown): then
    touch markers must never be stripped: a backfill batch that scanned the item
    earlier could land after a change and bring back what it removed. Read afresh
    each time (the sink asks only when a marker write failed for good)."""
    try:
        return parse_phase(store.load_meta("phase")) == BACKFILLING
    except Exception:  # unreadable: fail safe
        return True


class Migration:
    """The migration's durable facts, read from and written to the state table.
    ``now_ms`` and ``sleep`` are injected for tests."""

    def __init__(self, store, now_ms: Callable[[], int] = _wall_ms,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.store = store
        self._now_ms = now_ms
        self._sleep = sleep

    def now_ms(self) -> int:
        return self._now_ms()

    @property
    def log(self):
        """The module's logger naming this migration's table (its job) on every line."""
        return table_logger(log, getattr(self.store, "job", ""))

    def _metrics(self):
        return default_metrics().for_table(getattr(self.store, "job", "") or UNNAMED_TABLE)

    def publish(self, progress: bool = True) -> None:
        """What the state table holds, on this process's metrics from its start:
        the phase (set otherwise only when it changes), and with ``progress`` the
        backfill's stored progress and item estimate (a resumed backfill goes on
        from there, not from 0 of the whole table)."""
        metrics, phase = self._metrics(), self.phase
        if phase is not None:
            metrics.set_phase(str(phase), PHASES, backfill_over=phase not in (BACKFILLING, RECOVERING))
        if progress:
            counts: dict = {}
            for (source, _), ckpt in self.store.load_backfill_progress().items():
                counts[source] = counts.get(source, 0) + ckpt.count
            expected = self.store.load_meta("backfill_expected")
            metrics.seed_backfill(counts, int(expected) if expected else None)

    # -- reading
    @property
    def phase(self) -> Optional[Phase]:
        return parse_phase(self.store.load_meta("phase"))

    @property
    def handoff_ms(self) -> Optional[int]:
        value = self.store.load_meta("handoff_ms")
        return int(value) if value else None

    @property
    def phase_changed_ms(self) -> Optional[int]:
        value = self.store.load_meta("phase_changed_ms")
        return int(value) if value else None

    @property
    def recopy_pending(self) -> bool:
        """The recorded backfill re-copies a table migrated before: the re-copy
        sweep (cutover/recopy.py) is still owed once its parts are written."""
        return self.store.load_meta(RECOPY_META) == "1"

    def recopy_done(self) -> None:
        self.store.save_meta(RECOPY_META, "")

    @property
    def finished_ms(self) -> Optional[int]:
        """When the bookkeeping (marker family) was last dropped; None while it may exist."""
        value = self.store.load_meta("finished_ms")
        return int(value) if value else None

    # -- where the tail's partitions are (LIVE needs every one caught up, §7.8)
    def _head(self, stream: str, index: int) -> tuple:
        """(caught up since ms or 0, reported at ms) of a partition; (0, 0) when none.
        A value of one number is an older worker's "at the head at" time."""
        value = self.store.load_meta(f"head#{stream}#{index}")
        if not value:
            return 0, 0
        since, _, reported = value.partition(":")
        return int(since), int(reported or since)

    def report_heads(self, stream: str, heads: dict, settled: frozenset = frozenset()) -> None:
        """Record, per partition index of a stream, whether it is caught up now
        (``catchup.caught_up``: applied past the handoff, lag under the bound),
        keeping since when it has been without a break. A partition in
        ``settled`` (its reader ended idle: nothing new for all of --until-idle)
        counts as caught up for the whole settling period."""
        now = self._now_ms()
        for index, ok in heads.items():
            since = 0
            if ok and index in settled:
                since = now - int(LIVE_SETTLE_S * 1000)
            elif ok:
                prev_since, reported = self._head(stream, index)
                since = prev_since if prev_since and now - reported <= HEAD_FRESH_S * 1000 else now
            self.store.save_meta(f"head#{stream}#{index}", f"{since}:{now}")

    def all_at_head(self, stream: str, partitions: int, settle_s: Optional[float] = None) -> bool:
        """Every one of the stream's ``partitions`` reported caught up within
        ``HEAD_FRESH_S``, and has been without a break for the settling period
        (``catchup.LIVE_SETTLE_S``): a partition that lags, or whose reader
        stopped reporting, holds LIVE back."""
        settle_ms = (LIVE_SETTLE_S if settle_s is None else settle_s) * 1000
        now = self._now_ms()
        for index in range(partitions):
            since, reported = self._head(stream, index)
            if not since or now - reported > HEAD_FRESH_S * 1000 or now - since < settle_ms:
                return False
        return True

    def source_spec(self) -> Optional[dict]:
        value = self.store.load_meta("backfill_source")
        return json.loads(value) if value else None

    def marker_tables(self) -> list:
        value = self.store.load_meta("marker_tables")
        return json.loads(value) if value else []

    def backfill_complete(self) -> bool:
        """Every part of the recorded backfill is done (recorded by the sink after
        the part's writes and guard repairs were acknowledged)."""
        spec = self.source_spec()
        if not spec or self.handoff_ms is None:
            return False
        parts = spec.get("parts", 0)
        done = sum(1 for p in self.store.load_backfill_progress().values() if p.done)
        return parts > 0 and done >= parts

    def phase_value(self) -> Optional[str]:
        """The stored phase exactly as read (with its nonce): what a later
        ``transition(..., expected=...)`` compares against."""
        return self.store.load_meta("phase")

    # -- the one place the phase is written
    def transition(self, target: Phase, expected: Optional[str] = None, *, based_on_read: bool = False) -> None:
        """Move to ``target`` by compare-and-set. With ``based_on_read`` the move
        is made only if the phase is still exactly ``expected`` (the value the
        caller's decision was based on), else PhaseMoved; without it the current
        value is read here (and re-read if another process moves it meanwhile)."""
        for _ in range(1 if based_on_read else CAS_ATTEMPTS):
            current = expected if based_on_read else self.phase_value()
            check_transition(parse_phase(current), target)
            new = f"{target}{NONCE_SEP}{uuid.uuid4().hex[:12]}"
            if self.store.swap_meta("phase", current, new) or self.phase_value() == new:
                break  # (a retried swap whose first attempt was applied reads back our own value)
        else:
            raise PhaseMoved(f"the migration phase changed (another process moved it) before it could move to "
                             f"{target}")
        self.store.save_meta("phase_changed_ms", str(self._now_ms()))
        self._metrics().set_phase(str(target), PHASES, backfill_over=target not in (BACKFILLING, RECOVERING))
        self.log.info("migration phase: %s", target)

    def begin_backfill(self, source_spec: dict, bookkeeping, tables: Sequence[str],
                       handoff_ms: Optional[int] = None) -> int:
        """Start a new backfill: phase BACKFILLING, marker family in every table,
        wait for the tails to mark, fix T. ``handoff_ms`` is given for an export
        (its ExportTime). The phase is written before the family is created: a
        finish racing this (it re-reads the phase after dropping) then re-creates it."""
        self.store.clear_backfill_progress()
        # A table migrated (or back-filled) before may hold rows of items that are
        # gone: this backfill ends with the re-copy sweep (docs/design.md §7.7),
        # recorded so that a resume after a crash still runs it.
        # Recorded before the move: a crash right after it still owes the sweep
        # (a sweep is safe at any time; one too many costs a read).
        self.store.save_meta(RECOPY_META, "1" if self.phase is not None else "")
        self.transition(BACKFILLING)
        self.store.save_meta("finished_ms", "")
        self.store.save_meta("marker_tables", json.dumps(sorted(set(tables) | set(self.marker_tables()))))
        bookkeeping.ensure(tables)
        # T is set back by the clock margin (control/clock.py: this clock may run
        # that much ahead of AWS's), so the wait covers the margin too: every
        # tail marks from T on.
        self._sleep(MARKING_WAIT_S + (CLOCK_SKEW_MARGIN_S if handoff_ms is None else 0.0))
        handoff = handoff_ms if handoff_ms is not None else self._now_ms() - int(CLOCK_SKEW_MARGIN_S * 1000)
        self.store.save_meta("backfill_source", json.dumps(source_spec, sort_keys=True))
        self.store.save_meta("handoff_ms", str(handoff))
        self.store.save_meta("backfill_done_ms", "")
        return handoff

    def resume_or_begin(self, source_spec: dict, restart: bool, bookkeeping, tables: Sequence[str],
                        handoff_ms: Optional[int] = None) -> int:
        """T of the backfill to run: the recorded one when resuming the same backfill."""
        recorded = self.source_spec()
        if not restart and recorded is not None and self.handoff_ms is not None and self.phase == BACKFILLING:
            if recorded != source_spec:
                raise ConfigError(
                    f"a backfill with {recorded} is in progress; rerun with the same source options to resume "
                    "it, or add --restart to begin a new one", "backfill")
            bookkeeping.ensure(tables)  # idempotent: a crash may have come before it
            self.log.info("resuming the backfill with handoff time %d", self.handoff_ms)
            return self.handoff_ms
        return self.begin_backfill(source_spec, bookkeeping, tables, handoff_ms)

    def finish_backfill(self) -> bool:
        """BACKFILLING → CATCHING_UP once every part is done; idempotent (False when
        another process moved it already, or parts are missing)."""
        seen = self.phase_value()
        if parse_phase(seen) != BACKFILLING or not self.backfill_complete():
            return False
        try:
            # Only if nobody moved the phase since it was read: a `backfill
            # --restart` meanwhile cleared the progress this decision was based on.
            self.transition(CATCHING_UP, seen, based_on_read=True)
        except PhaseMoved:
            log.info("the phase moved while finishing the backfill (a new backfill began?): left as it is")
            return False
        self.store.save_meta("backfill_done_ms", str(self._now_ms()))
        return True

    def finish(self, bookkeeping, tables: Sequence[str] = (), wait: bool = True) -> bool:
        """The clean finish: drop the marker family from every table that may hold
        it. Only once the backfill is complete (CATCHING_UP or LIVE) and, with
        ``wait``, ``MARKING_WAIT_S`` after the phase left BACKFILLING, so the tails
        have stopped marking (one that still marks after the drop has its marker
        mutations stripped by the sink: never a dead letter). Idempotent. Returns
        True when nothing of ours is left."""
        phase = self.phase
        if phase not in (CATCHING_UP, LIVE):
            return False
        changed = self.phase_changed_ms or 0
        if wait:
            left = MARKING_WAIT_S - (self._now_ms() - changed) / 1000
            if left > 0:
                self._sleep(left)
        targets = sorted(set(tables) | set(self.marker_tables()))
        bookkeeping.drop(targets)
        if self.phase == BACKFILLING:  # a new backfill began meanwhile: it needs the markers
            bookkeeping.ensure(targets)
            return False
        self.store.save_meta("finished_ms", str(self._now_ms()))
        self.log.info("migration bookkeeping removed from %s", ", ".join(targets) or "(no table)")
        return True

    def go_live(self) -> None:
        """CATCHING_UP → LIVE; only after the finish (nothing of ours left)."""
        seen = self.phase_value()
        if parse_phase(seen) == LIVE:
            return
        if self.finished_ms is None:
            raise PhaseError("the migration cannot go LIVE before its bookkeeping is removed (finish)")
        self.transition(LIVE, seen, based_on_read=True)

    @property
    def cutover_ms(self) -> Optional[int]:
        """When the job was cut over (the forward tail stopped), or None."""
        value = self.store.load_meta("cutover_ms")
        return int(value) if value else None

    def cut_over(self) -> int:
        """LIVE → CUT_OVER, by a caller holding the tail's lease (so no forward tail
        runs: it holds that lease while it writes, and a tail that lost it is
        fenced). Returns the cutover time in ms; idempotent once cut over."""
        seen = self.phase_value()
        phase = parse_phase(seen)
        if phase == CUT_OVER and self.cutover_ms is not None:
            return self.cutover_ms
        if phase != LIVE:
            raise PhaseError(f"the migration is {phase or 'not started'}, not LIVE: the way back begins only after a "
                             "migration that went LIVE and was verified (ddb2bt status, ddb2bt verify)")
        now = self._now_ms()
        self.store.save_meta("cutover_ms", str(now))
        self.transition(CUT_OVER, seen, based_on_read=True)
        return now


def refuse_forward_after_cutover(migration: Migration, table: str) -> None:
    """The forward tail never runs after the cutover: it would copy the rollback's
    writes to DynamoDB back to Bigtable (a loop). Only a new migration begins."""
    if migration.phase == CUT_OVER:
        raise ConfigError(f"{table} was cut over: the application writes to Bigtable and `ddb2bt rollback` writes "
                          "its changes back to DynamoDB, so forward replication must not run again (it would copy "
                          "them back). To migrate anew, `ddb2bt migrate --restart` copies the table again",
                          "--mapping")


def advance(migration: Migration, bookkeeping, at_head: bool, promote_live: bool) -> Optional[Phase]:
    """One step of the machine for a process without a controller (the tail's
    readers on Dataflow, or next to a separate batch backfill): BACKFILLING →
    CATCHING_UP when every part is done; then the finish once the tails had time
    to stop marking; then LIVE (``promote_live``) once ``at_head``: every
    partition caught up and settled (the keeper decides, catchup.py).
    Every step is idempotent, so several readers may run it. Returns the phase."""
    phase = migration.phase
    if phase == BACKFILLING and migration.finish_backfill():
        phase = CATCHING_UP
    if phase == CATCHING_UP and migration.finished_ms is None:
        changed = migration.phase_changed_ms or 0
        if (migration.now_ms() - changed) / 1000 >= MARKING_WAIT_S:
            migration.finish(bookkeeping, wait=False)
    if phase == CATCHING_UP and promote_live and at_head and migration.finished_ms is not None:
        migration.go_live()
        phase = LIVE
    return phase
