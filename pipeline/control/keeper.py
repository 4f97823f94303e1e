"""The one component that moves a migration on where no controller runs (the
tail's workers on Dataflow, or a `run` next to a separate batch `backfill`).

The stream readers only *report* where their partitions are (``report``, in
memory); the keeper, on a thread of its own, records those reports, moves the
phase (``phases.advance``: every move a compare-and-set) and runs the finish,
the one schema change of the target (dropping the marker family). So no record
reader writes the phase or changes a table's schema, and a slow admin call never
holds up reading. One keeper per process and state job, held by the job's
coordinator (coordinator.py); keepers of several processes are safe side by
side because every step is a compare-and-set or idempotent (docs/design.md
§7.4.2).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from ddb2bt.pipeline.control.catchup import caught_up, worst
from ddb2bt.pipeline.control.phases import CATCHING_UP, Migration, advance

log = logging.getLogger(__name__)

# How often the keeper steps (the phase cache and LIVE's freshness are sized to it).
KEEPER_INTERVAL_S = 10.0


class CutoverKeeper:
    """``store_factory`` builds its state store, ``bookkeeping_factory`` its
    ``Bookkeeping`` (admin client), both on its own thread, lazily."""

    def __init__(self, store_factory: Callable, bookkeeping_factory: Callable, promote_live: bool,
                 interval_s: float = KEEPER_INTERVAL_S, migration_factory: Optional[Callable] = None) -> None:
        self._store_factory = store_factory
        self._bookkeeping_factory = bookkeeping_factory
        self._promote_live = promote_live
        self._interval_s = interval_s
        self._migration_factory = migration_factory  # store -> Migration (clocks injected in tests)
        self._reports: dict = {}  # stream label -> (partition count, {index: at head}) since the last step
        self._counts: dict = {}  # stream label -> partition count (every stream ever reported)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._store = None
        self._bookkeeping = None

    def report(self, stream: str, index: int, count: int, report, start: bool = True,
               fence: Optional[Callable[[], object]] = None, ended_idle: bool = False) -> None:
        """Where a reader's partition is (a ``catchup.CatchUpReport``: its lag and
        applied position); starts the keeper's thread (``start``; tests step it
        by hand). The worst report since the last step is kept, so one good look
        between two bad ones does not count. ``fence`` raises when this process
        no longer owns the partition (its lease): the report is then not
        recorded (a worker woken after its partition moved writes nothing).
        ``ended_idle``: the reader ended after --until-idle without a record, so
        it was caught up for all of that time: it counts as settled."""
        with self._lock:
            _, heads = self._reports.get(stream, (count, {}))
            previous = heads.get(index)
            # An ended reader's last report stands alone: it had nothing new for
            # all of --until-idle, whatever the backlog before it showed.
            merged = report if ended_idle else worst(previous[0] if previous else None, report)
            heads[index] = (merged, fence, ended_idle)
            self._reports[stream] = (count, heads)
            self._counts[stream] = count
            if start and self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="ddb2bt-cutover-keeper")
                self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.step()

    def step(self):
        """One step: record the reports, then let the phase machine move. Returns
        the phase (None when it could not be read; it is tried again next step)."""
        make_migration = self._migration_factory or Migration

        with self._lock:
            # Only what the readers reported since the last step is recorded: a
            # worker that stopped reading a partition (it moved, or the worker
            # was paused) must not keep reporting it at the head.
            reports, self._reports = self._reports, {}
            counts = dict(self._counts)
        try:
            if self._store is None:
                self._store = self._store_factory()
            if self._bookkeeping is None:
                self._bookkeeping = self._bookkeeping_factory()
            migration = make_migration(self._store)
            at_head = False
            if migration.phase == CATCHING_UP:  # only then does LIVE depend on where the partitions are
                handoff = migration.handoff_ms
                for stream, (_, heads) in reports.items():
                    owned = {i: h for i, h in heads.items() if _owned(h[1])}
                    migration.report_heads(stream, {i: caught_up(rep, handoff) for i, (rep, _, _) in owned.items()},
                                           settled={i for i, (_, _, ended) in owned.items() if ended})
                # LIVE only once EVERY partition of every stream has caught up and
                # stayed so for the settling period (docs/design.md §7.8).
                at_head = bool(counts) and all(migration.all_at_head(s, count) for s, count in counts.items())
            return advance(migration, self._bookkeeping, at_head, self._promote_live)
        except Exception as exc:  # the phase moves on at the next step; reading goes on regardless
            log.warning("cannot advance the migration phase of %s (%s: %s)", getattr(self._store, "job", "?"),
                        type(exc).__name__, exc)
            return None

    def stop(self) -> None:
        self._stop.set()
        close = getattr(self._store, "close", None)
        if close is not None:
            close()


def _owned(fence: Optional[Callable[[], object]]) -> bool:
    if fence is None:
        return True
    try:
        fence()
        return True
    except Exception:  # lost or unproven: not this process's to report
        return False
