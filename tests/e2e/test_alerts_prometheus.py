"""The shipped alerts and dashboard against a real Prometheus during real
incidents on the local stack (tests/e2e/prometheus_server.py: Debian's
prometheus on 127.0.0.1, scrape and evaluation every second, the shipped
alerts.yml with only its `for:` shortened). Each incident is played and the
expected alert is asserted through Prometheus' HTTP API, within a bound, and
(where the rule's window allows) cleared after recovery:

* the first burst of dead letters and the first confirmed divergence of a job
  alert (their counters exist at 0 from the start, so the first one is a rise);
* every dashboard query returns data, never negative, on a running job;
* a SIGKILL under writes: DDB2BTJobDown fires, and clears once the job runs
  again; the restarted job's phase (LIVE) is there from its first scrape;
* a restart in the middle of a backfill: phase and stored progress from the
  first scrape, progress ~1 and ETA 0 once the backfill is done;
* Bigtable down (connections refused) for 75 s: DDB2BTNoProgress fires while
  the job still runs, well before its --bigtable-deadline; after Bigtable is
  back the job writes again within seconds and the alert clears;
* the Pushgateway path: a worker killed while behind, replaced by a healthy
  one, stops alerting once its group is stale; a worker stopped with SIGTERM
  deletes its group; DDB2BTJobDown does not fire where only pushes arrive.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
from ddb2bt.pipeline.control.phases import Migration
from ddb2bt.transforms.model import SetCell
from tests.conftest import ROOT
from tests.e2e.prometheus_server import Prometheus, check_dashboard, free_port
from tests.e2e.test_cutover import preload, random_changes, setup, store_of

pytestmark = pytest.mark.e2e

FIRE_S = 45  # an alert with a shortened `for:` fires within this of its condition (scrape 1 s, eval 1 s)
CLEAR_S = 45


def spawn(args: list, log, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ddb2bt.pipeline.app.cli", *args], cwd=ROOT,
                            env=env or dict(os.environ), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def first_scrape_after(prom: Prometheus, after_s: float) -> float:
    """The time of the first successful scrape of the job after ``after_s`` (its raw sample)."""
    def first():
        for series in prom._get("/api/v1/query", query='up{job="ddb2bt"}[3m]')["result"]:
            times = [float(t) for t, v in series["values"] if float(t) > after_s and float(v) == 1]
            if times:
                return times[0]
        return None
    return prom.wait(first, 120, "the restarted job to be scraped")


def writer(ddb, table, items, stop: threading.Event, seed: int, pace_s: float = 0.05) -> threading.Thread:
    def run():
        n = 0
        while not stop.is_set():
            random_changes(ddb, table, items, 10, seed=seed + n)
            n += 1
            time.sleep(pace_s)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_dead_letters_divergence_dashboard_sigkill_and_restart_at_live(stack, tmp_path, unique):
    path, mapping, ddb = setup(tmp_path, unique)
    table = mapping.name
    items = preload(ddb, mapping.source.table, 30, seed=31)
    quiet, busy = items[0], items[1:]
    port = free_port()
    log = open(tmp_path / "job.log", "wb")
    job = spawn(["migrate", "--mapping", str(path), "--segments", "2", "--poll-interval", "0.2",
                 "--metrics-port", str(port), "--continuous-check", "200", "--continuous-check-segments", "1"],
                log)
    stop = threading.Event()
    try:
        with Prometheus(tmp_path, targets=(f"127.0.0.1:{port}",)) as prom:
            # LIVE needs changes applied past the handoff: a writer from the start
            changes = writer(ddb, mapping.source.table, busy, stop, seed=100)
            prom.wait_scraped(f'ddb2bt_migration_phase{{table="{table}", phase="LIVE"}} == 1', 120)
            # 1. the first dead letters of the job: 5 items whose row key is too long
            prom.wait_scraped(f'ddb2bt_dead_letters_total{{table="{table}"}}', 30)
            for i in range(5):
                ddb.put_item(TableName=mapping.source.table,
                             Item={"pk": {"S": "#" * 2000 + str(i)}, "sk": {"S": "x" * 200}, "Price": {"N": "1"}})
            burst = time.monotonic()
            fired = prom.wait_firing("DDB2BTDeadLettersIncreasing", FIRE_S)
            assert {a["labels"]["table"] for a in fired} == {table}
            print(f"dead letters: alert {time.monotonic() - burst:.1f}s after the burst")
            # 2. the first confirmed divergence: a quiet item's cell changed behind the job's back
            t = mapping.target
            row = f"{quiet['pk']['S']}#{quiet['sk']['S']}".encode()
            GrpcMutationWriter(t.project, t.instance).mutate_rows(t.table, [
                (row, [SetCell("SKU", b"Description", b"tampered", time.time_ns() // 1_000_000 - 1000)])])
            tampered = time.monotonic()
            fired = prom.wait_firing("DDB2BTVerifyDivergence", 120)
            assert fired[0]["labels"]["kind"] == "different_cells"
            print(f"divergence: alert {time.monotonic() - tampered:.1f}s after the edit")
            # 3. the dashboard while the job runs: every query has data, none negative
            # (no Pushgateway on this path: its freshness query has none)
            prom.wait_scraped(f'rate(ddb2bt_changes_applied_total{{table="{table}"}}[1m]) > 0', 30)
            values = check_dashboard(prom, table, no_data_expected=("time() - max by (job) (push_time_seconds",))
            applied = 'sum by (table) (rate(ddb2bt_changes_applied_total{table=~"%s", event!="BACKFILL"}[1m]))'
            assert max(values[applied % table]) > 0
            assert not prom.alerts("DDB2BTJobDown") and not prom.alerts("DDB2BTNoProgress")
            # 4. SIGKILL under writes: JobDown, then a restart at LIVE
            kill(job)
            killed = time.time()
            prom.wait_firing("DDB2BTJobDown", FIRE_S)
            print(f"JobDown {time.time() - killed:.1f}s after the SIGKILL")
            job = spawn(["run", "--mapping", str(path), "--poll-interval", "0.2", "--metrics-port", str(port)], log)
            first = first_scrape_after(prom, killed)
            phase = prom.query(f'ddb2bt_migration_phase{{table="{table}"}} == 1', at=first)
            assert [labels["phase"] for labels, _ in phase] == ["LIVE"], phase
            # the counters a rate reads are there from the first scrape (the catch-up is a rise)
            applied = prom.query(f'ddb2bt_changes_applied_total{{table="{table}", event="MODIFY"}}', at=first)
            assert applied, "the applied counter was absent at the restarted job's first scrape"
            assert prom.query(f'ddb2bt_checkpoint_timestamp_seconds{{table="{table}"}} < 1e9', at=first) == []
            prom.wait_cleared("DDB2BTJobDown", CLEAR_S)
            stop.set()
            changes.join(30)
    except AssertionError:
        print(open(tmp_path / "job.log", errors="replace").read()[-5000:])
        raise
    finally:
        stop.set()
        kill(job)
        log.close()
    assert b"a first record dead-lettered" in (tmp_path / "job.log").read_bytes()


def test_a_restart_mid_backfill_shows_its_phase_and_progress_from_the_first_scrape(stack, tmp_path, unique):
    path, mapping, ddb = setup(tmp_path, unique)
    table = mapping.name
    items = preload(ddb, mapping.source.table, 1200, seed=41)
    store = store_of(mapping)
    port = free_port()
    log = open(tmp_path / "job.log", "wb")
    # a page budget slows the backfill down enough to catch it (moto: 1 RCU a page of 40)
    args = ["migrate", "--mapping", str(path), "--segments", "4", "--max-rcu", "2", "--page-size", "40",
            "--poll-interval", "0.2", "--metrics-port", str(port)]
    job = spawn(args, log)
    stop = threading.Event()
    changes = writer(ddb, mapping.source.table, items, stop, seed=300, pace_s=0.5)
    try:
        with Prometheus(tmp_path, targets=(f"127.0.0.1:{port}",)) as prom:
            prom.wait(lambda: sum(p.count for p in store.load_backfill_progress().values()) >= 200, 120,
                      "backfill progress")
            kill(job)
            killed = time.time()
            stored = sum(p.count for p in store.load_backfill_progress().values())
            assert Migration(store).phase == "BACKFILLING"
            # resumed at the same pace: ~12 s of backfill left, so the first scrape finds it
            # running even when a loaded machine delays the metrics server's first answers
            job = spawn(args, log)
            first = first_scrape_after(prom, killed)
            phase = prom.query(f'ddb2bt_migration_phase{{table="{table}"}} == 1', at=first)
            assert [labels["phase"] for labels, _ in phase] == ["BACKFILLING"], phase
            progress = prom.query(f'sum by (table) (ddb2bt_backfill_items_scanned_total{{table="{table}"}}) '
                                  f'/ max by (table) (ddb2bt_backfill_items_expected{{table="{table}"}})', at=first)
            assert progress and progress[0][1] >= stored / 1200 - 0.01, (progress, stored)
            prom.wait_scraped(f'ddb2bt_migration_phase{{table="{table}", phase="LIVE"}} == 1', 120)
            time.sleep(2)
            progress = prom.query(f'sum by (table) (ddb2bt_backfill_items_scanned_total{{table="{table}"}}) '
                                  f'/ max by (table) (ddb2bt_backfill_items_expected{{table="{table}"}})')
            assert 0.99 <= progress[0][1] <= 1.2, progress
            assert prom.query(f'ddb2bt_backfill_eta_seconds{{table="{table}"}}')[0][1] == 0
    except AssertionError:
        print(open(tmp_path / "job.log", errors="replace").read()[-5000:])
        raise
    finally:
        stop.set()
        kill(job)
        log.close()
    changes.join(30)


OUTAGE_S = 75  # longer than DDB2BTNoProgress' 60 s threshold plus its shortened `for:`
DEADLINE_S = 150  # the job's --bigtable-deadline here: the alert must come well before
# Writes again within this after Bigtable is back: the lease's next renewal (every 5 s while
# unproven) and the write's own back-off (up to 10 s) on a loaded machine. gRPC's default
# reconnect back-off would try next ~38 s after a 75 s outage (1 s x 1.6^n: 43 s, 70 s, 113 s).
RECONNECT_S = 25


def test_a_bigtable_outage_alerts_before_the_deadline_and_the_job_reconnects_within_seconds(stack, tmp_path,
                                                                                             unique):
    from ddb2bt.pipeline.testing.proxy import PausableProxy

    path, mapping, ddb = setup(tmp_path, unique)
    table = mapping.name
    items = preload(ddb, mapping.source.table, 30, seed=51)
    port = free_port()
    log = open(tmp_path / "job.log", "wb")
    stop = threading.Event()
    with PausableProxy(stack.bigtable_port) as bigtable:
        env = dict(os.environ, BIGTABLE_EMULATOR_HOST=bigtable.address)
        job = spawn(["migrate", "--mapping", str(path), "--segments", "2", "--poll-interval", "0.2",
                     "--metrics-port", str(port), "--bigtable-deadline", str(DEADLINE_S)], log, env)
        try:
            with Prometheus(tmp_path, targets=(f"127.0.0.1:{port}",)) as prom:
                changes = writer(ddb, mapping.source.table, items, stop, seed=200, pace_s=0.5)
                prom.wait_scraped(f'ddb2bt_migration_phase{{table="{table}", phase="LIVE"}} == 1', 120)
                prom.wait_scraped(f'increase(ddb2bt_changes_applied_total{{table="{table}"}}[10s]) > 0', 30)
                bigtable.cut()
                cut = time.monotonic()
                prom.wait_firing("DDB2BTNoProgress", OUTAGE_S + FIRE_S)
                fired_after = time.monotonic() - cut
                assert job.poll() is None and prom.query('up{job="ddb2bt"} == 1'), "the job gave up first"
                assert fired_after < DEADLINE_S - 30, fired_after
                print(f"DDB2BTNoProgress {fired_after:.1f}s into the outage (deadline {DEADLINE_S}s)")
                time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - cut)))
                applied = prom.query(f'sum(ddb2bt_changes_applied_total{{table="{table}"}})')[0][1]
                bigtable.resume()
                back = time.monotonic()
                prom.wait(lambda: prom.query(f'sum(ddb2bt_changes_applied_total{{table="{table}"}})')[0][1]
                          > applied, RECONNECT_S, "writes after Bigtable came back")
                print(f"writing again {time.monotonic() - back:.1f}s after Bigtable came back")
                prom.wait_cleared("DDB2BTNoProgress", CLEAR_S)
                assert job.poll() is None
        except AssertionError:
            print(open(tmp_path / "job.log", errors="replace").read()[-5000:])
            raise
        finally:
            stop.set()
            kill(job)
            log.close()


WORKER = """
import sys, time, signal
from prometheus_client import CollectorRegistry
from ddb2bt.pipeline.observe.metrics import PipelineMetrics, start_pusher
lag_s, url, job, worker = float(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
metrics = PipelineMetrics(CollectorRegistry())
view = metrics.for_table("orders")
arn = "arn:aws:dynamodb:us-east-1:1:table/Orders/stream/x"
metrics.lag.label(arn, "orders")
view.shards.labels("open").set(1)
view.set_phase("LIVE", ("BACKFILLING", "CATCHING_UP", "LIVE"))
metrics.lag.on_read(arn, "shard-1", int((time.time() - lag_s) * 1000))  # behind by lag_s, nothing applied
if lag_s == 0:
    metrics.lag.on_applied(arn, "shard-1", int(time.time() * 1000), 1)
    metrics.lag.on_at_head(arn, "shard-1")
    def heads():
        while True:
            metrics.lag.on_at_head(arn, "shard-1")
            time.sleep(1)
    import threading; threading.Thread(target=heads, daemon=True).start()
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # a clean stop: atexit runs
start_pusher(url, job=job, registry=metrics.registry, interval_s=1, worker=worker)
print("pushing", flush=True)
while True:
    time.sleep(1)
"""


def pushing_worker(lag_s: float, gateway: str, worker: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(lag_s), gateway, "ddb2bt-orders", worker], cwd=ROOT,
                            stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline().strip() == b"pushing"
    return proc


def groups(gateway: str) -> set:
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://{gateway}/api/v1/metrics", timeout=5) as resp:
        return {g["labels"].get("worker") for g in json.loads(resp.read())["data"]}


def test_a_dead_worker_on_the_pushgateway_path_stops_alerting(tmp_path):
    gateway_port = free_port()
    gateway = f"127.0.0.1:{gateway_port}"
    gw = subprocess.Popen(["/usr/bin/prometheus-pushgateway", f"--web.listen-address={gateway}"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    procs = []
    try:
        with Prometheus(tmp_path, pushgateway=gateway) as prom:
            behind = pushing_worker(900, f"http://{gateway}", "w-old")
            procs.append(behind)
            prom.wait_firing("DDB2BTReplicationLagHigh", FIRE_S)
            kill(behind)  # SIGKILL: its group stays on the gateway
            killed = time.monotonic()
            healthy = pushing_worker(0, f"http://{gateway}", "w-new")
            procs.append(healthy)
            prom.wait_cleared("DDB2BTReplicationLagHigh", 60 + CLEAR_S)
            print(f"the dead worker's lag stopped alerting {time.monotonic() - killed:.1f}s after its kill")
            assert "w-old" in groups(gateway), "the killed worker's group should still be on the gateway"
            lag = prom.query('max by (table, stream, shard) (ddb2bt_replication_lag_seconds{table=~"orders"} '
                             'unless on (job, worker) (time() - push_time_seconds{job=~"ddb2bt-.+"} > 60))')
            assert lag and max(v for _, v in lag) < 60, lag
            # this worker backfills nothing and runs no continuous check: those panels have no data
            check_dashboard(prom, "orders", no_data_expected=("backfill_items_scanned", "backfill_eta", "verify_"))
            assert "DDB2BTJobDown" not in prom.firing_names() and "DDB2BTMetricsStale" not in prom.firing_names()
            # a clean stop deletes the worker's own group
            healthy.send_signal(signal.SIGTERM)
            healthy.wait(10)
            prom.wait(lambda: "w-new" not in groups(gateway), 10, "the stopped worker's group to be deleted")
    finally:
        for p in procs:
            kill(p)
        gw.terminate()
        gw.wait(10)
