"""The first `migrate` of a busy table goes LIVE (issue 33, item 1): a writer
that never pauses, at 25+ changes a second, and LIVE (caught up in time, past
the handoff, for the settling period: docs/design.md §7.8) within two minutes
of the start; the target equals the table once the writer stops."""
from __future__ import annotations

import random
import threading
import time

import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.control.phases import Migration
from ddb2bt.pipeline.local import workload
from tests.e2e.test_cutover import (_kill, _spawn, _wait, assert_target_is_exactly_the_mapping, identical, preload,
                                    setup, store_of)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ITEMS = 2_000
RATE = 30  # changes a second the writer aims at (the table took 26-35)
MIN_RATE = 25  # what it must have kept up until LIVE
LIVE_WITHIN_S = 120.0


class Writer(threading.Thread):
    """Updates, deletes and re-inserts at RATE a second, never pausing, until stopped."""

    def __init__(self, ddb, table, items) -> None:
        super().__init__(daemon=True)
        self.ddb, self.table = ddb, table
        self.keys = [{"pk": i["pk"], "sk": i["sk"]} for i in items]
        self.stop = threading.Event()
        self.done = 0
        self.error = None

    def run(self) -> None:
        rng = random.Random(7)
        start = time.monotonic()
        try:
            while not self.stop.is_set():
                key = rng.choice(self.keys)
                roll = rng.random()
                if roll < 0.6:
                    op = workload.Op("update", key, set_attrs={"Price": {"N": str(rng.randint(1, 999))}})
                elif roll < 0.8:
                    op = workload.Op("delete", key)
                else:
                    op = workload.Op("put", key, item=workload.random_item(rng, key))
                workload.apply_quietly(self.ddb, self.table, op)
                self.done += 1
                ahead = start + self.done / RATE - time.monotonic()
                if ahead > 0:
                    self.stop.wait(ahead)  # pacing the writer, not waiting for another process
        except BaseException as exc:  # reported by the test
            self.error = exc


def test_migrate_of_a_table_that_never_goes_quiet_goes_live(stack, tmp_path, unique, capsys):
    path, mapping, ddb = setup(tmp_path, unique)
    items = preload(ddb, mapping.source.table, ITEMS, seed=41)
    assert len(items) >= ITEMS * 0.99
    store = store_of(mapping)
    writer = Writer(ddb, mapping.source.table, items)
    writer.start()
    proc = None
    try:
        started = time.monotonic()
        proc = _spawn(["migrate", "--mapping", str(path), "--segments", "4", "--poll-interval", "0.2"])
        _wait(lambda: Migration(store).phase == "LIVE", timeout=LIVE_WITHIN_S, what="LIVE under a steady writer")
        elapsed = time.monotonic() - started
        assert writer.is_alive() and writer.error is None
        assert writer.done / elapsed >= MIN_RATE, f"the writer made {writer.done / elapsed:.1f} changes/s"
        capsys.readouterr()
        ddb2bt(["status", "--mapping", str(path)])
        out = capsys.readouterr().out
        assert "phase: LIVE" in out or "LIVE" in out
        assert "still catching up" not in out
    finally:
        writer.stop.set()
        writer.join()
    assert writer.error is None
    try:
        # The writer stopped: the running tail brings the target to the table.
        _wait(lambda: identical(mapping, ddb)[0], timeout=60, what="the tail to apply the last changes")
        assert_target_is_exactly_the_mapping(mapping, ddb)
        assert ddb2bt(["verify", "--mapping", str(path)]) == 0
        capsys.readouterr()
        # READY while the tail runs (a job nobody runs is never READY)
        assert ddb2bt(["status", "--mapping", str(path)]) == 0, capsys.readouterr().out
    finally:
        if proc is not None:
            _kill(proc)


def test_a_tail_run_shorter_than_a_keeper_step_promotes_a_finished_backfill(stack, tmp_path, unique):
    """`backfill` alone leaves the migration CATCHING_UP (its tail runs
    elsewhere); `run --until-idle 2`, shorter than the keeper's 10 s step,
    still moves it LIVE once caught up (issue 33, item 9's last clause)."""
    path, mapping, ddb = setup(tmp_path, unique)
    preload(ddb, mapping.source.table, 200, seed=42)
    store = store_of(mapping)
    assert ddb2bt(["backfill", "--mapping", str(path), "--segments", "2"]) == 0
    assert Migration(store).phase == "CATCHING_UP"
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "2", "--poll-interval", "0.2"]) == 0
    assert Migration(store).phase == "LIVE"
    assert_target_is_exactly_the_mapping(mapping, ddb)
