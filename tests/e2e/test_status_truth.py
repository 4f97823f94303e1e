"""`status` READY only while a running tail holds the job and is caught up
(docs/cutover.md, "Status and READY"): a LIVE job SIGKILLed, and then one
stopped with Ctrl-C, while writes go on, is NOT READY within 30 s saying why
and how to resume; READY again only once a tail runs and has caught up."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.control.phases import Migration
from ddb2bt.pipeline.local import workload
from tests.e2e.test_cutover import store_of
from tests.e2e.test_live_replication import check_identical, setup_tables
from tests.e2e.test_ops import kill, spawn, wait_for, wait_until_signals_caught

pytestmark = pytest.mark.e2e
NOT_READY_WITHIN_S = 30.0


def status(path, capsys) -> tuple:
    capsys.readouterr()
    code = ddb2bt(["status", "--mapping", str(path)])
    return code, capsys.readouterr().out


def ready(path, capsys) -> bool:
    code, out = status(path, capsys)
    return code == 0 and "READY for cutover" in out


def not_ready_within(path, capsys, since: float) -> str:
    """The NOT READY line, asserted to come within NOT_READY_WITHIN_S of ``since``."""
    while True:
        code, out = status(path, capsys)
        line = out.strip().splitlines()[-1]
        if code == 1 and "the tail is not running" in line:
            assert time.monotonic() - since <= NOT_READY_WITHIN_S, line
            return line
        assert time.monotonic() - since <= NOT_READY_WITHIN_S, f"still {line!r}"
        time.sleep(1.0)


def test_status_is_not_ready_once_the_tail_is_killed_or_stopped_and_ready_again_once_it_runs(
        stack, tmp_path, unique, capsys):
    path, mapping, ddb = setup_tables(stack, tmp_path, unique)
    for op in workload.operations(1, 150, 60):
        workload.apply_quietly(ddb, mapping.source.table, op)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    migrate = spawn(["migrate", "--mapping", str(path)], tmp_path / "migrate.err")
    stop, writing, procs = threading.Event(), threading.Event(), [migrate]

    def writer():
        for op in workload.operations(2, 100_000, 60):
            if stop.is_set():
                return
            writing.wait()
            workload.apply_quietly(ddb, mapping.source.table, op)
            time.sleep(0.05)

    threading.Thread(target=writer, daemon=True).start()
    writing.set()  # a table that never goes quiet, as in production
    try:
        wait_for(lambda: Migration(store_of(mapping)).phase == "LIVE", 300, "the migration LIVE")
        writing.clear()  # paused for the verify (IDENTICAL needs a quiet table and a tail caught up)
        time.sleep(3)
        assert ddb2bt(["verify", "--mapping", str(path)]) == 0
        writing.set()  # writes go on from here
        wait_for(lambda: ready(path, capsys), 120, "READY with the migrate's tail running", step=1.0)

        # 1. the tail killed: its lease lapses (TTL 20 s); its reports are still fresh
        os.killpg(migrate.pid, signal.SIGKILL)
        migrate.wait()
        line = not_ready_within(path, capsys, time.monotonic())
        assert "since 20" in line and f"resume it with ddb2bt run --mapping {path}" in line, line
        time.sleep(3)
        assert not ready(path, capsys)  # nobody tails: it stays NOT READY

        # 2. a tail runs again: READY once it holds the job and has caught up
        run = spawn(["run", "--mapping", str(path)], tmp_path / "run.err")
        procs.append(run)
        wait_for(lambda: ready(path, capsys), 180, "READY again with a tail running", step=1.0)

        # 3. stopped with Ctrl-C: its lease released at once
        wait_until_signals_caught(run.pid)
        os.killpg(run.pid, signal.SIGINT)
        since = time.monotonic()
        assert run.wait(timeout=60) == 130
        last = (tmp_path / "run.err").read_text().strip().splitlines()[-1]
        assert last.endswith(f"resume with: ddb2bt run --mapping {path}"), last
        not_ready_within(path, capsys, since)

        run = spawn(["run", "--mapping", str(path)], tmp_path / "run2.err")
        procs.append(run)
        wait_for(lambda: ready(path, capsys), 180, "READY again after the Ctrl-C", step=1.0)
    finally:
        stop.set()
        writing.set()
        kill(*procs)
    # what the writer did while nobody tailed is replicated, not lost
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "2", "--poll-interval", "0.2"]) == 0
    check_identical(mapping, ddb)
