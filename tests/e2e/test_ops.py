"""Operability end to end (issue 17), with `python -m ddb2bt.pipeline.app.cli ...`
subprocesses as a user runs them: one writer per job (lease, fencing, standby),
failures that name Bigtable within seconds, and Ctrl-C that always ends."""
from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.connect.connections import dynamodb_client
from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.local.local_stack import LocalStack
from ddb2bt.pipeline.services.jobs import resume_command
from ddb2bt.pipeline.signals import INTERRUPTED, INTERRUPTED_NO_JOB, interrupted_line
from tests.conftest import ROOT, wait_for, write_mapping
from tests.e2e.test_live_replication import check_identical, setup_tables

pytestmark = pytest.mark.e2e
FAST_LEASE = ["--lease-ttl", "4", "--lease-renew", "1"]


def wait_until_signals_caught(pid: int, timeout_s: float = 30.0) -> None:
    """Until the process catches SIGINT and SIGTERM (SigCgt in /proc/PID/status)."""
    wanted = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
        if caught & wanted == wanted:
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not install its SIGINT/SIGTERM handling within {timeout_s:.0f} s")


def spawn(args: list, err: Path, env: dict = None, write_log: Path = None) -> subprocess.Popen:
    """The ddb2bt command in its own process (and session); with ``write_log``
    through the test runner that records every write RPC it sends."""
    if write_log is not None:
        argv = [sys.executable, "-m", "ddb2bt.pipeline.testing.faults", "--log-writes", str(write_log), "", "--", *args]
    else:
        argv = [sys.executable, "-m", "ddb2bt.pipeline.app.cli", *args]
    return subprocess.Popen(argv, cwd=ROOT, env=env or dict(os.environ), stdout=subprocess.DEVNULL,
                            stderr=open(err, "wb"), start_new_session=True)


def writes(path: Path) -> list:
    if not path.exists():
        return []
    return [float(line.split()[0]) for line in path.read_text().splitlines() if line.strip()]


def kill(*procs) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


@pytest.mark.slow
def test_one_writer_per_job_and_a_paused_holder_never_writes_again(stack, tmp_path, unique):
    path, mapping, ddb = setup_tables(stack, tmp_path, unique)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    table = mapping.source.table
    for op in workload.operations(21, 300, 60):
        workload.apply_quietly(ddb, table, op)
    run = ["run", "--mapping", str(path), "--poll-interval", "0.2", *FAST_LEASE]
    logs = {n: (tmp_path / f"{n}.err", tmp_path / f"{n}.writes") for n in ("a", "b", "s")}
    procs = {n: spawn(run, logs[n][0], write_log=logs[n][1]) for n in ("a", "b")}  # started together
    try:
        loser = wait_for(lambda: next((n for n, p in procs.items() if p.poll() is not None), None), 90,
                         "one of two runs of one job to be refused")
        holder = "b" if loser == "a" else "a"
        err = logs[loser][0].read_text()
        assert procs[loser].returncode == 1, err
        assert "is already running" in err and f"pid {procs[holder].pid}" in err and "--take-over" in err, err
        assert writes(logs[loser][1]) == [], "the refused process wrote"
        assert procs[holder].poll() is None
        wait_for(lambda: writes(logs[holder][1]), 60, "the holder's first write")

        # A standby for the same job applies nothing while the holder lives.
        standby = spawn([*run, "--standby", "--until-idle", "4"], logs["s"][0], write_log=logs["s"][1])
        procs["s"] = standby
        wait_for(lambda: "standby:" in logs["s"][0].read_text(), 60, "the standby to wait")
        done = threading.Event()

        def workload_writer():  # concurrent changes, attribute removals among them
            try:
                for op in workload.operations(22, 700, 60):
                    workload.apply_quietly(ddb, table, op)
            finally:
                done.set()

        threading.Thread(target=workload_writer, daemon=True).start()
        time.sleep(2.0)
        assert writes(logs["s"][1]) == [], "the standby wrote while the holder was alive"

        # The holder freezes (SIGSTOP) past its lease; the standby takes over.
        stopped_at = time.time()
        os.kill(procs[holder].pid, signal.SIGSTOP)
        wait_for(lambda: "standby over" in logs["s"][0].read_text(), 30, "the standby to take over")
        wait_for(lambda: writes(logs["s"][1]), 30, "the new holder's first write")
        # The old lease (TTL 4 s from its last renewal, sent at most a second or
        # two before the SIGSTOP under load) had to run out first.
        assert min(writes(logs["s"][1])) > stopped_at + 2, "the new holder wrote before the old lease ended"
        time.sleep(1.0)
        resumed_at = time.time()
        os.kill(procs[holder].pid, signal.SIGCONT)
        # The resumed process notices, writes nothing more, and exits naming why.
        procs[holder].wait(30)
        err = logs[holder][0].read_text()
        assert procs[holder].returncode not in (0, None), err
        assert "stops before writing anything more" in err or "taken over" in err, err
        assert [t for t in writes(logs[holder][1]) if t >= resumed_at] == [], "the paused holder wrote after SIGCONT"
        assert [t for t in writes(logs[holder][1]) if t >= stopped_at] == []

        assert done.wait(180)
        assert standby.wait(180) == 0, logs["s"][0].read_text()
    finally:
        kill(*procs.values())
    # A last catch-up run (it takes the released lease at once), then compare.
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", "--poll-interval", "0.2"]) == 0
    check_identical(mapping, ddb)


def test_take_over_replaces_a_running_holder(stack, tmp_path, unique):
    path, mapping, ddb = setup_tables(stack, tmp_path, unique)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    run = ["run", "--mapping", str(path), "--poll-interval", "0.2", *FAST_LEASE]
    first = spawn(run, tmp_path / "first.err")
    try:
        wait_for(lambda: "holding the tail lease" in (tmp_path / "first.err").read_text(), 60, "the first holder")
        second = spawn([*run, "--take-over", "--until-idle", "1"], tmp_path / "second.err")
        assert second.wait(90) == 0, (tmp_path / "second.err").read_text()
        assert "took over the tail lease" in (tmp_path / "second.err").read_text()
        first.wait(30)
        err = (tmp_path / "first.err").read_text()
        assert first.returncode == 1 and "taken over" in err, err
        assert "Traceback" not in err
    finally:
        kill(first)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_bigtable_killed_during_run_warns_within_seconds_and_stops_naming_it(tmp_path):
    with LocalStack(log_dir=tmp_path / "logs") as own:
        env = dict(os.environ)
        env.update(own.env())
        previous = own.apply_env()
        try:
            path = write_mapping(tmp_path, name="killed_job")
            ddb = dynamodb_client()
            workload.create_table(ddb, "ProductCatalog")
            for op in workload.operations(31, 200, 40):
                workload.apply_quietly(ddb, "ProductCatalog", op)
            assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
        finally:
            for k, v in previous.items():  # back to the session stack's variables
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        err = tmp_path / "run.err"
        proc = spawn(["run", "--mapping", str(path), "--poll-interval", "0.2", "--bigtable-deadline", "20"], err, env)
        try:
            wait_for(lambda: "replicating" in err.read_text(), 60, "the run to start")
            time.sleep(2.0)
            os.killpg(own.pids["bigtable"], signal.SIGKILL)
            killed = time.monotonic()
            endpoint = f"127.0.0.1:{own.bigtable_port}"
            warned = wait_for(lambda: re.search(rf"WARNING .*{re.escape(endpoint)}", err.read_text()), 10,
                              "a WARNING naming the endpoint")
            assert warned
            # --bigtable-deadline: writes pause once the lease is unproven (ttl 20 - 5)
            # and the job gives up when no renewal succeeded for the deadline.
            proc.wait(20 + 15)
            elapsed = time.monotonic() - killed
            text = err.read_text()
            assert proc.returncode == 1, text
            last = text.strip().splitlines()[-1]
            assert last.startswith("ddb2bt: error:") and "Bigtable" in last and endpoint in last, last
            assert elapsed < 20 + 10, elapsed
            assert "Traceback" not in text
        finally:
            kill(proc)


# The channel's warning while it waits for Bigtable: "... no connection for 2s; retrying, ...".
PROBE_WARNING = re.compile(r"Bigtable .*: no connection for (\d+(?:\.\d+)?)s")


def test_read_only_commands_fail_within_30s_when_bigtable_is_unreachable(stack, tmp_path, unique):
    path, mapping, ddb = setup_tables(stack, tmp_path, unique)
    env = dict(os.environ)
    env["BIGTABLE_EMULATOR_HOST"] = f"127.0.0.1:{free_port()}"  # nothing listens there
    for args in (["status", "--mapping", str(path)], ["dlq", "list", "--mapping", str(path)],
                 ["create-table", "--mapping", str(path)]):
        # The promise is about the time spent on an unreachable service, not the
        # interpreter's start and imports (Beam's, gRPC's: half a minute of wall time
        # at a load of 15 on two cores). So the clock starts when the command starts
        # waiting for Bigtable, which its first warning dates ("no connection for Ns"),
        # and stops at its error line; each line is timed as it arrives.
        proc = subprocess.Popen([sys.executable, "-m", "ddb2bt.pipeline.app.cli", *args], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        lines, waiting_since, gave_up = [], None, None
        try:
            for line in proc.stderr:
                now = time.monotonic()
                lines.append(line)
                waited = PROBE_WARNING.search(line)
                if waited and waiting_since is None:
                    waiting_since = now - float(waited.group(1))
                if "ddb2bt: error:" in line:
                    gave_up = now
            proc.wait(timeout=90)
        finally:
            kill(proc)
        err = "".join(lines)
        assert waiting_since is not None, (args, err)  # it said so while it waited
        assert gave_up is not None, (args, err)
        assert gave_up - waiting_since < 30, (args, gave_up - waiting_since, err)
        assert proc.returncode != 0, (args, proc.stdout.read())
        last = err.strip().splitlines()[-1]
        assert "Bigtable" in last and env["BIGTABLE_EMULATOR_HOST"] in last, (args, last)
        assert "Traceback" not in err


def test_ctrl_c_at_random_points_always_ends_quickly_and_cleanly(stack, tmp_path, unique):
    path, mapping, ddb = setup_tables(stack, tmp_path, unique)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    table = mapping.source.table
    done = threading.Event()

    def workload_writer():
        try:
            for op in workload.operations(41, 3000, 120):
                if done.is_set():
                    return
                workload.apply_quietly(ddb, table, op)
        finally:
            done.set()

    writer = threading.Thread(target=workload_writer, daemon=True)
    writer.start()
    rng = random.Random(int(unique, 16))
    run = ["run", "--mapping", str(path), "--poll-interval", "0.2"]
    exits = []
    for i in range(20):
        err = tmp_path / f"int{i}.err"
        proc = spawn(run, err)
        # A signal before the interpreter runs ddb2bt's first line can be handled by
        # no program; from the moment ddb2bt catches it (its first import), any time:
        wait_until_signals_caught(proc.pid)
        time.sleep(rng.uniform(0.0, 3.5))  # imports, preflight, lease, reading, writing, checkpointing
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM if i % 5 == 4 else signal.SIGINT)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            kill(proc)
            raise AssertionError(f"run {i} did not exit within 5 s of the signal: {err.read_text()}")
        exits.append(time.monotonic() - sent)
        text = err.read_text()
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
        assert proc.returncode == 130, (i, proc.returncode, text)
        # Once the command runs, the line names the command that resumes it; before
        # (a signal during the imports: no job yet), a bare "interrupted".
        assert text.strip().splitlines()[-1] in (interrupted_line(resume_command(run)), INTERRUPTED,
                                                 INTERRUPTED_NO_JOB), text
    done.set()
    writer.join(30)
    assert max(exits) < 5
    # Restarts converge: one more run to the head, then the table equals the source.
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1.5", "--poll-interval", "0.2"]) == 0
    check_identical(mapping, ddb)
