"""The continuous check in a running job (`run --continuous-check`): no false
alarm under a writer with deletes and attribute removals; a cell corrupted in
Bigtable behind its back is counted within a pass, recorded, repaired by
`ddb2bt repair`, and the count settles."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.verify.continuous import POSITION_META, CheckPosition
from ddb2bt.pipeline.local.local_stack import free_port
from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
from ddb2bt.pipeline.clients.bigtable.reads import read_rows
from ddb2bt.transforms.model import SetCell
from tests.conftest import ROOT
from tests.e2e.test_cutover import _kill, preload, random_changes, setup, store_of
from tests.e2e.test_metrics_e2e import scrape, total

pytestmark = pytest.mark.e2e
PASS_TIMEOUT_S = 180  # generous bound for one pass of 55 items on a loaded box (typically seconds)


def _passes(port):
    samples = scrape(port)
    return total(samples, "ddb2bt_verify_last_full_pass_timestamp_seconds"), samples


def _wait_for_pass_after(port, after_s):
    deadline = time.monotonic() + PASS_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            last, samples = _passes(port)
            if last > after_s:
                return samples
        except OSError:
            pass  # the metrics server is not up yet
        time.sleep(0.5)
    raise AssertionError("no full pass of the continuous check finished in time")


def test_continuous_check_finds_a_corruption_repair_fixes_it_and_no_false_alarm(stack, tmp_path, unique, capsys):
    path, mapping, ddb = setup(tmp_path, unique)
    items = preload(ddb, mapping.source.table, 50, seed=21)
    quiet = preload(ddb, mapping.source.table, 5, seed=22)
    key = lambda i: (i["pk"]["S"], i["sk"]["S"])
    busy = [i for i in items if key(i) not in {key(q) for q in quiet}]
    # the migration's own check threads wait for LIVE, then stop with the command
    assert ddb2bt(["migrate", "--mapping", str(path), "--segments", "2", "--until-idle", "1",
                   "--poll-interval", "0.2", "--continuous-check", "100", "--continuous-check-segments", "2"]) == 0
    port = free_port()
    log = open(os.environ.get("DDB2BT_TEST_JOB_LOG", tmp_path / "job.log"), "wb")
    job = subprocess.Popen([sys.executable, "-m", "ddb2bt.pipeline.app.cli", "run", "--mapping", str(path),
                            "--poll-interval", "0.2", "--metrics-port", str(port), "--continuous-check", "100",
                            "--continuous-check-segments", "2"], cwd=ROOT, env=dict(os.environ), stdout=log,
                           stderr=subprocess.STDOUT, start_new_session=True)
    stop = threading.Event()
    writer = threading.Thread(target=lambda: random_changes(ddb, mapping.source.table, busy, 400, seed=23,
                                                            stop=stop), daemon=True)
    try:
        samples = _wait_for_pass_after(port, 0)
        # where the check stands is in the state table (a restarted job goes on from there)
        stored = CheckPosition.from_json(store_of(mapping).load_meta(POSITION_META))
        assert stored.segments == 2 and stored.passes >= 1
        writer.start()
        writer.join(timeout=300)
        stop.set()
        # two more passes once the writes are done: nothing divergent
        samples = _wait_for_pass_after(port, time.time())
        samples = _wait_for_pass_after(port, time.time())
        assert total(samples, "ddb2bt_verify_checked_total") > 0
        assert total(samples, "ddb2bt_verify_divergent_total") == 0
        # behind the job's back: a tampered cell of a quiet item
        t = mapping.target
        row = f"{quiet[0]['pk']['S']}#{quiet[0]['sk']['S']}".encode()
        now_ms = time.time_ns() // 1_000_000 - 1000
        GrpcMutationWriter(t.project, t.instance).mutate_rows(t.table, [
            (row, [SetCell("SKU", b"Description", b"tampered", now_ms)])])
        samples = _wait_for_pass_after(port, time.time())
        # reported once the next pass finds it still different (the pass that ends
        # first may have checked the item's segment before the tampering)
        samples = _wait_for_pass_after(port, time.time())
        samples = _wait_for_pass_after(port, time.time())
        assert total(samples, "ddb2bt_verify_divergent_total", kind="different_cells") == 1
        assert len(store_of(mapping).list_dead_letters(reason="divergent")) == 1
        capsys.readouterr()
        assert ddb2bt(["repair", "--mapping", str(path)]) == 0
        assert store_of(mapping).list_dead_letters(reason="divergent") == []
        assert read_rows(t.project, t.instance, t.table, [row])[row][("SKU", b"Description")][0][1] != b"tampered"
        samples = _wait_for_pass_after(port, time.time())
        samples = _wait_for_pass_after(port, time.time())
        assert total(samples, "ddb2bt_verify_divergent_total") == 1, "settled: no new divergence after repair"
    except AssertionError:
        print(open(log.name, errors="replace").read()[-5000:])  # the job side of a failure
        raise
    finally:
        stop.set()
        _kill(job)
        log.close()
