"""Dataflow's worker behaviours, played against the emulators (issue 21): several
worker processes of one job in shared ownership (the job's lease, a lease per
stream partition), a worker SIGSTOPped while its partition moves to another and
then woken, and a 25 s network blip toward Bigtable and DynamoDB Streams (a
loopback proxy that stops forwarding: no answer, no reset) ridden through by
every process without a restart — the job's workers and a local `run` of another
job side by side, so one blip covers both. A workload of puts, updates,
attribute removals and deletes runs throughout; after each fault the tables
equal the mapping of a Scan. Writes go through an injected partial-failure fault
(entries applied but reported failed), so retried partial writes are part of it."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.clients.bigtable.reads import read_table
from ddb2bt.pipeline.control.state import DEFAULT_STATE_TABLE
from ddb2bt.pipeline.testing.proxy import PausableProxy
from tests.conftest import ROOT
from tests.e2e.test_live_replication import check_identical, setup_tables
from tests.e2e.test_ops import kill, wait_for, writes

pytestmark = pytest.mark.e2e

# Short enough for a quick move, long enough that a loaded machine's stalls do
# not make the healthy worker's leases expire (which would be a legitimate move).
FAST_LEASE = ["--lease-ttl", "8", "--lease-renew", "2"]
TTL_S, RENEW_S = 8.0, 2.0
# A zombie writes at once when woken (its buffered batch): watched this long.
WOKEN_WATCH_S = 5.0
BLIP_S = 25.0  # longer than the lease TTL: only riding through keeps the jobs alive
WARN_WITHIN_S = 15.0
PARTIAL_WRITES = "entry_unavailable=0.05,seed=3"  # applied but reported failed: retried


def worker(job: str, args: list, err, write_log, env) -> subprocess.Popen:
    argv = [sys.executable, "-m", "ddb2bt.pipeline.testing.dataflow_worker", job, "--log-writes", str(write_log),
            PARTIAL_WRITES, "--", *args]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(err, "wb"),
                            start_new_session=True)


def local_run(args: list, err, env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ddb2bt.pipeline.app.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(err, "wb"), start_new_session=True)


def partition_owners(mapping) -> dict:
    """{partition index: pid of the worker holding its live lease}."""
    rows = read_table(mapping.target.project, mapping.target.instance, DEFAULT_STATE_TABLE,
                      prefix=f"{mapping.name}#lease#tail#p#".encode(), latest_only=True)
    now_ms = time.time() * 1000
    out = {}
    for key, cells in rows.items():
        state = json.loads(cells[("meta", b"lease")][0][1])
        if not state.get("released") and state["expires_ms"] > now_ms:
            out[int(key.decode().rsplit("#", 1)[1])] = int(state["holder"].split(":")[2])
    return out


def apply_ops(ddb, table: str, seed: int, count: int) -> threading.Thread:
    def run():
        for op in workload.operations(seed, count, 40):
            workload.apply_quietly(ddb, table, op)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def converged(mapping, ddb, timeout: float, what: str) -> None:
    def identical():
        try:
            check_identical(mapping, ddb)
            return True
        except AssertionError:
            return False
    wait_for(identical, timeout, what, step=1.0)
    check_identical(mapping, ddb)


def test_workers_of_one_job_ride_out_a_pause_a_partition_move_and_a_25s_blip(stack, tmp_path, unique):
    (tmp_path / "b").mkdir()
    path_a, job_a, ddb = setup_tables(stack, tmp_path, unique)
    path_b, job_b, _ = setup_tables(stack, tmp_path / "b", f"{unique}b")
    for path in (path_a, path_b):
        assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    with PausableProxy(stack.bigtable_port) as bigtable, PausableProxy(stack.moto_port) as streams:
        env = dict(os.environ)
        env["BIGTABLE_EMULATOR_HOST"] = bigtable.address
        env_b = dict(env)
        for name in ("AWS_ENDPOINT_URL_DYNAMODBSTREAMS", "AWS_ENDPOINT_URL_DYNAMODB_STREAMS"):
            env_b[name] = f"http://{streams.address}"
        run_a = ["run", "--mapping", str(path_a), "--partitions", "2", "--poll-interval", "0.2", *FAST_LEASE]
        logs = {n: (tmp_path / f"{n}.err", tmp_path / f"{n}.writes") for n in ("w1", "w2")}
        procs = {n: worker(f"job-{unique}", run_a, logs[n][0], logs[n][1], env) for n in ("w1", "w2")}
        procs["b"] = local_run(["run", "--mapping", str(path_b), "--poll-interval", "0.2", *FAST_LEASE],
                               tmp_path / "b.err", env_b)
        pids = {p.pid: n for n, p in procs.items()}
        try:
            # 1. Two workers of one job share it: each partition has one owner.
            for t in (apply_ops(ddb, job_a.source.table, 41, 150), apply_ops(ddb, job_b.source.table, 42, 100)):
                t.join(120)
            owners = wait_for(lambda: (o := partition_owners(job_a)) and len(o) == 2 and o, 90,
                              "both partitions owned")
            assert set(owners.values()) <= {procs["w1"].pid, procs["w2"].pid}, owners
            converged(job_a, ddb, 90, "job A to converge (two workers)")
            converged(job_b, ddb, 90, "job B to converge")

            # 2. A worker is paused (SIGSTOP) while Dataflow moves its partition to
            #    the other worker; woken, it writes nothing more.
            victim = pids[owners[0]]
            other = "w2" if victim == "w1" else "w1"
            stopped_at = time.time()
            os.kill(procs[victim].pid, signal.SIGSTOP)
            changes = apply_ops(ddb, job_a.source.table, 43, 150)
            wait_for(lambda: partition_owners(job_a) == {0: procs[other].pid, 1: procs[other].pid}, 60,
                     "the other worker to own every partition")
            moved_at = time.time()
            more = apply_ops(ddb, job_a.source.table, 46, 60)  # changes the new owner must apply
            wait_for(lambda: [t for t in writes(logs[other][1]) if t > moved_at], 60, "the new owner's writes")
            woken_at = time.time()
            os.kill(procs[victim].pid, signal.SIGCONT)
            time.sleep(WOKEN_WATCH_S)
            assert [t for t in writes(logs[victim][1]) if woken_at <= t] == [], "the woken worker wrote"
            # The lease had to run out first: TTL after its last renewal, sent at
            # most a renewal interval before the SIGSTOP.
            assert woken_at - stopped_at >= TTL_S - RENEW_S, "the partition moved before its lease ran out"
            changes.join(120)
            more.join(120)
            converged(job_a, ddb, 90, "job A to converge after the move")

            # 3. A 25 s blip toward Bigtable (every process) and DynamoDB Streams
            #    (job B): writes pause, nobody exits, and it all converges after.
            alive = [n for n in ("w1", "w2", "b") if procs[n].poll() is None]
            assert other in alive and "b" in alive, {n: p.poll() for n, p in procs.items()}
            bigtable.pause()
            streams.pause()
            blip_at = time.monotonic()
            changes = [apply_ops(ddb, job_a.source.table, 44, 100), apply_ops(ddb, job_b.source.table, 45, 100)]
            endpoint = re.escape(bigtable.address)
            wait_for(lambda: re.search(rf"WARNING .*Bigtable.*{endpoint}", (tmp_path / "b.err").read_text()),
                     WARN_WITHIN_S, "the local run's WARNING naming Bigtable")
            # A partition that swallows Streams requests is named as soon as one that
            # refuses them: a WARNING naming the Streams endpoint within 15 s of the blip.
            streams_endpoint = re.escape(streams.address)
            wait_for(lambda: re.search(rf"WARNING .*{streams_endpoint}", (tmp_path / "b.err").read_text()),
                     max(0.0, WARN_WITHIN_S - (time.monotonic() - blip_at)),
                     "the local run's WARNING naming the DynamoDB Streams endpoint")
            time.sleep(max(0.0, BLIP_S - (time.monotonic() - blip_at)))
            bigtable.resume()
            streams.resume()
            for t in changes:
                t.join(120)
            converged(job_a, ddb, 120, "job A to converge after the blip")
            converged(job_b, ddb, 120, "job B to converge after the blip")
            for n in ("b", other):
                assert procs[n].poll() is None, f"{n} exited: {logs.get(n, (tmp_path / 'b.err',))[0].read_text()}"
            assert "Traceback" not in (tmp_path / "b.err").read_text()
        finally:
            kill(*procs.values())
