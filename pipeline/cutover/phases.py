"""Backfill + live tail cutover: phases, handoff time, and the local controller.

Phases (stored in the state table, ``{job}#meta#phase``):

  BACKFILLING  the tail runs and marks the items it touches; the backfill copies
               the table with cells one millisecond older than the handoff second
  CATCHING_UP  the backfill is complete; the tail catches up with the stream
  LIVE         the tail is at the stream head: ready for `verify` and cutover

The handoff time T is recorded once, after the phase says BACKFILLING and the
tail has had time to notice (``MARKING_WAIT_S``), so every tail change at or
after T's second carries a touch marker. A restart resumes every part: the tail
from its shard checkpoints, the backfill from its segment/file checkpoints with
the recorded T. A backfill that runs for days is fine: the tail keeps running
alongside, never more than minutes behind, so the 24 h retention never matters.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ddb2bt.transforms.errors import ConfigError

log = logging.getLogger(__name__)

BACKFILLING, CATCHING_UP, LIVE = "BACKFILLING", "CATCHING_UP", "LIVE"
PHASES = (BACKFILLING, CATCHING_UP, LIVE)
# The tail re-reads the phase this often; the backfill waits for two refreshes
# plus a second before fixing T, so no change at or after T's second goes unmarked.
PHASE_CACHE_S = 2.0
MARKING_WAIT_S = 2 * PHASE_CACHE_S + 1.0


class PhaseMarking:
    """Whether the live tail must set touch markers: while a backfill runs. Also
    moves BACKFILLING → CATCHING_UP once every backfill part is recorded done
    (after its writes: the sink records a part done only then)."""

    def __init__(self, state_spec, now: Callable[[], float] = time.monotonic) -> None:
        self._spec = state_spec
        self._now = now

    def setup(self) -> None:
        self._store = self._spec.store()
        self._checked = None
        self._active = True  # until the first read: marking is never wrong, only extra work

    def _backfill_complete(self) -> bool:
        spec = self._store.load_meta("backfill_source")
        if not spec or not self._store.load_meta("handoff_ms"):
            return False
        parts = json.loads(spec).get("parts", 0)
        done = sum(1 for p in self._store.load_backfill_progress().values() if p.done)
        return parts > 0 and done >= parts

    def active(self) -> bool:
        now = self._now()
        if self._checked is None or now - self._checked >= PHASE_CACHE_S:
            try:
                self._active = self._store.load_meta("phase") == BACKFILLING
                if self._active and self._backfill_complete():
                    Migration(self._store).finish_backfill()  # no controller on Dataflow: the tail moves it
                    self._active = False
                self._checked = now
            except Exception as exc:  # keep the last answer; marking stays safe
                log.warning("cannot read the migration phase (%s); keeping %s", type(exc).__name__, self._active)
        return self._active


@dataclass
class Migration:
    """The migration's durable facts, read from and written to the state table."""

    store: object

    @property
    def phase(self) -> Optional[str]:
        return self.store.load_meta("phase")

    def set_phase(self, phase: str) -> None:
        from ddb2bt.pipeline.metrics import default_metrics

        self.store.save_meta("phase", phase)
        self.store.save_meta("phase_changed_ms", str(time.time_ns() // 1_000_000))
        default_metrics().set_phase(phase)
        log.info("migration phase: %s", phase)

    @property
    def handoff_ms(self) -> Optional[int]:
        value = self.store.load_meta("handoff_ms")
        return int(value) if value else None

    def source_spec(self) -> Optional[dict]:
        value = self.store.load_meta("backfill_source")
        return json.loads(value) if value else None

    def begin_backfill(self, source_spec: dict, handoff_ms: Optional[int] = None,
                       sleep: Callable[[float], None] = time.sleep) -> int:
        """Start a new backfill: phase BACKFILLING, wait for the tail to mark, fix T.
        ``handoff_ms`` is given for an export (its ExportTime)."""
        self.store.clear_backfill_progress()
        self.set_phase(BACKFILLING)
        sleep(MARKING_WAIT_S)
        handoff = handoff_ms if handoff_ms is not None else time.time_ns() // 1_000_000
        self.store.save_meta("backfill_source", json.dumps(source_spec, sort_keys=True))
        self.store.save_meta("handoff_ms", str(handoff))
        self.store.save_meta("backfill_done_ms", "")
        return handoff

    def resume_or_begin(self, source_spec: dict, restart: bool, handoff_ms: Optional[int] = None,
                        sleep: Callable[[float], None] = time.sleep) -> int:
        """T of the backfill to run: the recorded one when resuming the same backfill."""
        recorded = self.source_spec()
        if not restart and recorded is not None and self.handoff_ms is not None and self.phase == BACKFILLING:
            if recorded != source_spec:
                raise ConfigError(
                    f"a backfill with {recorded} is in progress; rerun with the same source options to resume "
                    "it, or add --restart to begin a new one", "backfill")
            log.info("resuming the backfill with handoff time %d", self.handoff_ms)
            return self.handoff_ms
        return self.begin_backfill(source_spec, handoff_ms, sleep)

    def finish_backfill(self) -> None:
        self.store.save_meta("backfill_done_ms", str(time.time_ns() // 1_000_000))
        self.set_phase(CATCHING_UP)


class Worker(threading.Thread):
    """Runs a pipeline function in a thread and keeps its exception."""

    def __init__(self, name: str, fn: Callable[[], None]) -> None:
        super().__init__(name=name, daemon=True)
        self._fn = fn
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self._fn()
        except BaseException as exc:  # re-raised by the controller
            self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise self.error
