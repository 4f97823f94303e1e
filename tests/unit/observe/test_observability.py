"""Metrics semantics, alert rules (promtool), dashboard, Pushgateway, JSON logs."""
from __future__ import annotations

import collections
import json
import logging
import re
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from ddb2bt.pipeline.app.cli import JsonFormatter
from ddb2bt.pipeline.testing.fakes import FakeStreamsClient, InMemoryBigtable
from ddb2bt.pipeline.observe.metrics import HEAD_FRESH_S, PipelineMetrics, RollbackMetrics, start_pusher
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.source.stream_source import LocalTracker, PartitionReader, ReaderOptions, StreamPartition, drain_round

ROOT = Path(__file__).resolve().parents[3]
PROMTOOL_HELP = "promtool is missing: install the Debian package 'prometheus' (deploy/local/setup.sh does it)"


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, PROMTOOL_HELP  # a missing tool fails the suite, it never skips
    return path


def test_alert_rules_are_valid():
    out = subprocess.run([promtool(), "check", "rules", "deploy/prometheus/alerts.yml"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "11 rules found" in out.stdout


def test_alert_rules_unit_tests_pass():
    out = subprocess.run([promtool(), "test", "rules", "alerts_test.yml"], cwd=ROOT / "deploy/prometheus",
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def exposed_names() -> set:
    metrics = PipelineMetrics(CollectorRegistry())
    metrics.lag.on_read("arn:aws:dynamodb:r:1:table/T/stream/x", "s", 0)
    metrics.for_table("t").backfill_expected.set(10)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",),
                "gauge": ("",), "unknown": ("",)}
    names = set()
    for family in metrics.registry.collect():  # labelled metrics have no samples until used
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    rollback = CollectorRegistry()  # the way back's own block (docs/rollback.md)
    RollbackMetrics(rollback)
    for family in rollback.collect():
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
    return names


def referenced(text: str) -> set:
    return set(re.findall(r"\bddb2bt_[a-z0-9_]+", text))


def test_every_metric_the_dashboard_queries_exists():
    dash = json.loads((ROOT / "deploy/grafana/dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    used = referenced(exprs)
    assert len(used) >= 12
    missing = used - exposed_names()
    assert not missing, f"dashboard queries metrics nobody exports: {missing}"
    titles = {p["title"] for p in dash["panels"]}
    for needed in ("Replication lag per shard", "End-to-end lag p50 / p99", "Throughput (changes/s)",
                   "Errors and retries (/s)", "Retention headroom", "Backfill progress"):
        assert needed in titles


def test_every_metric_the_alerts_use_exists():
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    used = referenced(" ".join(r["expr"] for g in rules["groups"] for r in g["rules"]))
    assert used and not used - exposed_names()


def test_no_row_keys_or_values_in_labels():
    allowed = {"table", "event", "stage", "reason", "code", "operation", "state", "stream", "shard", "phase",
               "source", "le", "version", "python", "apache_beam", "google_cloud_bigtable"}
    metrics = PipelineMetrics(CollectorRegistry())
    for family in metrics.registry.collect():
        for sample in family.samples:
            assert set(sample.labels) <= allowed, (family.name, sample.labels)


class Clock:
    def __init__(self):
        self.s = 1_700_000_100.0

    def __call__(self):
        return self.s


def reader_with_metrics():
    client = FakeStreamsClient()
    clock = Clock()
    metrics = PipelineMetrics(CollectorRegistry(), clock=clock)
    state = StateStore(InMemoryBigtable(), "job", lambda: 1)
    reader = PartitionReader(client, StreamPartition(client.stream_arn, 0, 1),
                             ReaderOptions(retry=RetryPolicy(0.001, 0.001, 1.0), discovery_interval_s=0),
                             state.load_checkpoints, metrics, now_ms=lambda: int(clock() * 1000), sleep=lambda s: None)
    return client, clock, metrics, reader


def lag(metrics, shard="s"):
    return metrics.registry.get_sample_value("ddb2bt_replication_lag_seconds", {
        "table": "Fake", "stream": "Fake/stream/2024-01-01T00:00:00.000", "shard": shard})


def test_idle_shard_lag_is_zero_not_the_age_of_the_last_record():
    client, clock, metrics, reader = reader_with_metrics()
    client.add_shard("s")
    client.put("s", "INSERT", {"k": {"S": "1"}}, {"k": {"S": "1"}}, created_ms=int(clock() * 1000) - 5000)
    tracker = LocalTracker()
    out, _ = drain_round(reader, tracker)
    assert 4.9 <= lag(metrics) <= 5.1  # read, not yet applied: 5 s behind
    metrics.lag.on_applied(client.stream_arn, "s", out[0].change_ms, 1)
    drain_round(reader, tracker)  # empty page: at the stream head
    for _ in range(120):  # an hour of silence, the reader polling all along
        clock.s += 30
        drain_round(reader, tracker)
    assert lag(metrics) == 0.0
    assert checkpoint_age(metrics) == 0.0, "a quiet table at its head needs no checkpoint"
    headroom = metrics.registry.get_sample_value("ddb2bt_retention_headroom_seconds",
                                                 {"table": "Fake", "stream": "Fake/stream/2024-01-01T00:00:00.000"})
    assert headroom == 24 * 3600


def checkpoint_age(metrics, table="Fake"):
    return metrics.registry.get_sample_value("ddb2bt_checkpoint_age_seconds", {"table": table})


def test_a_head_nobody_polls_any_more_is_not_lag_zero():
    """Two tables in one job: the reader of the quiet one is held up behind the
    other's blocked writes (one fused stage), so its last "at the head" grows
    old. Its lag and checkpoint age must grow, not stay 0."""
    client, clock, metrics, reader = reader_with_metrics()
    client.add_shard("s")
    client.put("s", "INSERT", {"k": {"S": "1"}}, {"k": {"S": "1"}}, created_ms=int(clock() * 1000) - 1000)
    tracker = LocalTracker()
    out, _ = drain_round(reader, tracker)
    metrics.lag.on_applied(client.stream_arn, "s", out[0].change_ms, 1)
    metrics.lag.on_checkpoint("Fake", clock())
    drain_round(reader, tracker)  # at the head
    clock.s += HEAD_FRESH_S  # still current
    assert lag(metrics) == 0.0 and checkpoint_age(metrics) == 0.0
    clock.s += 52 - HEAD_FRESH_S  # no poll since: 52 s in all
    assert lag(metrics) == 52.0 and checkpoint_age(metrics) == 52.0
    drain_round(reader, tracker)  # the reader runs again and finds the head
    assert lag(metrics) == 0.0 and checkpoint_age(metrics) == 0.0


def test_stalled_shard_lag_keeps_growing():
    client, clock, metrics, reader = reader_with_metrics()
    client.add_shard("s")
    now_ms = int(clock() * 1000)
    client.put("s", "INSERT", {"k": {"S": "1"}}, {"k": {"S": "1"}}, created_ms=now_ms - 1000)
    drain_round(reader, LocalTracker())  # read, but the sink never acknowledges (stalled)
    first = lag(metrics)
    clock.s += 600
    assert lag(metrics) == first + 600
    headroom = metrics.registry.get_sample_value("ddb2bt_retention_headroom_seconds",
                                                 {"table": "Fake", "stream": "Fake/stream/2024-01-01T00:00:00.000"})
    assert headroom == 24 * 3600 - first - 600


def test_backfill_eta_appears_once_a_rate_is_known_per_table():
    metrics = PipelineMetrics(CollectorRegistry())
    orders, carts = metrics.for_table("orders"), metrics.for_table("carts")
    orders.backfill_expected.set(1000)
    carts.backfill_expected.set(1000)
    assert metrics.registry.get_sample_value("ddb2bt_backfill_eta_seconds", {"table": "orders"}) is None
    orders.backfill_items.labels("scan").inc(100)
    generate_latest(metrics.registry)
    import time
    time.sleep(0.05)
    orders.backfill_items.labels("scan").inc(100)
    eta = metrics.registry.get_sample_value("ddb2bt_backfill_eta_seconds", {"table": "orders"})
    assert eta is not None and eta > 0
    # the table whose backfill reads nothing has no rate, so no made-up ETA
    assert metrics.registry.get_sample_value("ddb2bt_backfill_eta_seconds", {"table": "carts"}) is None


def test_pushgateway_receives_grouped_metrics():
    received = []

    class Handler(BaseHTTPRequestHandler):
        def do_PUT(self):
            received.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        do_POST = do_PUT

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        registry = CollectorRegistry()
        PipelineMetrics(registry)
        pusher = start_pusher(f"127.0.0.1:{server.server_port}", "ddb2bt-test", registry, interval_s=0.05,
                              worker="w1")
        deadline = __import__("time").monotonic() + 5
        while not received and __import__("time").monotonic() < deadline:
            __import__("time").sleep(0.02)
        pusher.stop()
        pusher.join(2)
    finally:
        server.shutdown()
    path, body = received[0]
    assert path == "/metrics/job/ddb2bt-test/worker/w1"
    assert b"ddb2bt_build_info" in body


def test_json_logs_carry_the_stage():
    record = logging.LogRecord("ddb2bt.pipeline.sink.sink", logging.WARNING, __file__, 1, "retrying %s", ("x",), None)
    line = json.loads(JsonFormatter().format(record))
    assert line["stage"] == "sink" and line["msg"] == "retrying x" and line["level"] == "WARNING"


@pytest.mark.parametrize("repeats", [1, 3])
def test_lags_observed_per_batch_give_the_same_histogram_as_one_observation_each(repeats):
    """Also the Beam distribution's samples: one update per change (a batch's
    changes share a few change times, so a few lags, each counted)."""
    from ddb2bt.pipeline.observe.metrics import LAG_BUCKETS

    lags_ms = [-5, 0, 49, 50, 51, 100, 999, 1000, 1001, 59_999, 3_600_000, 3_600_001, 10**9, -7, 50] * repeats
    one_each, batched = PipelineMetrics(CollectorRegistry()), PipelineMetrics(CollectorRegistry())
    beam_one, beam_batched = [], []
    one_each._beam_lag = type("Recorder", (), {"update": staticmethod(beam_one.append)})()
    batched._beam_lag = type("Recorder", (), {"update": staticmethod(beam_batched.append)})()
    for lag in lags_ms:
        one_each.for_table("t").observe_lag(lag)
    batched.for_table("t").observe_lag_counts(collections.Counter(lags_ms))
    assert sorted(beam_batched) == sorted(beam_one) and len(beam_one) == len(lags_ms)

    def samples(m):
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for metric in m.registry.collect() if metric.name == "ddb2bt_end_to_end_lag_seconds"
                for s in metric.samples if not s.name.endswith("_created")}

    expected, got = samples(one_each), samples(batched)
    assert len(expected) == len(LAG_BUCKETS) + 3  # every bucket, +Inf, count and sum
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), key


def test_every_series_carries_the_table_label():
    """One job of several tables is watched per table: every metric a
    component records through its table's view is labelled with the table."""
    from ddb2bt.pipeline.observe.metrics import TableMetrics

    metrics = PipelineMetrics(CollectorRegistry())
    view = metrics.for_table("orders")
    assert metrics.for_table("orders") is view and view.for_table("carts") is metrics.for_table("carts")
    for name in TableMetrics._BOUND:
        getattr(view, name).labels(*(["x"] * (len(getattr(metrics, name)._labelnames) - 1))).inc() \
            if getattr(metrics, name)._type == "counter" else \
            getattr(view, name).labels(*(["x"] * (len(getattr(metrics, name)._labelnames) - 1))).set(1)
    for name in TableMetrics._CHILDREN:
        child = getattr(view, name)
        (child.observe if hasattr(child, "observe") else child.inc if hasattr(child, "inc") and
         getattr(metrics, name)._type == "counter" else child.set)(1)
    view.applied("orders", "INSERT")
    view.read("orders", "INSERT")
    view.coalesced("orders")
    view.dead_lettered("orders", "map", "r")
    view.changes_skipped.labels("orders").inc()
    metrics.lag.label("arn:aws:dynamodb:r:1:table/Orders/stream/x", "orders")
    metrics.lag.on_read("arn:aws:dynamodb:r:1:table/Orders/stream/x", "s", 0)
    samples = [(family.name, s.labels) for family in metrics.registry.collect() if family.name != "ddb2bt_build"
               for s in family.samples]
    assert [x for x in samples if "table" not in x[1]] == []
    assert {x[1]["table"] for x in samples} == {"orders", "carts"}  # carts: its view's series exist, at 0
    names = {family.name for family in metrics.registry.collect()}
    assert len(names) >= 24  # every family was exercised above


PUSHGATEWAY_HELP = ("prometheus-pushgateway is missing: install the Debian package 'prometheus-pushgateway' "
                    "(deploy/local/setup.sh does it)")


def test_a_real_pushgateway_keeps_a_dead_jobs_values_and_the_stale_alert_sees_it(tmp_path):
    """What DDB2BTMetricsStale rests on, against the real gateway binary: our
    pushes arrive grouped by job and worker with the gateway's own
    push_time_seconds, which the alert's selector matches; once the worker
    stops, the gateway keeps serving its last values ("lag 0") and its push time
    stops, so only the push time can tell a dead job from a healthy one."""
    import time
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    binary = shutil.which("prometheus-pushgateway") or shutil.which("pushgateway")
    assert binary, PUSHGATEWAY_HELP
    from ddb2bt.pipeline.local.local_stack import free_port

    port = free_port()
    gateway = subprocess.Popen([binary, f"--web.listen-address=127.0.0.1:{port}", "--persistence.file="],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def scrape() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    def push_times(samples: dict) -> dict:
        return {dict(labels)["worker"]: v for (name, labels), v in samples.items() if name == "push_time_seconds"
                and dict(labels).get("job") == "ddb2bt-orders"}

    try:
        registry = CollectorRegistry()
        PipelineMetrics(registry).lag.on_at_head("arn:aws:dynamodb:r:1:table/Orders/stream/x", "s1")
        pusher = start_pusher(f"127.0.0.1:{port}", "ddb2bt-orders", registry, interval_s=0.05, worker="w1")
        deadline = time.monotonic() + 20
        seen: dict = {}
        while time.monotonic() < deadline:  # the gateway starts, then two pushes land
            try:
                seen = push_times(scrape())
            except OSError:
                seen = {}
            if "w1" in seen and seen.get("w1", 0) > 0 and len(set(seen.values())) == 1:
                first = seen["w1"]
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"no push reached the gateway: {seen}")
        while time.monotonic() < deadline and push_times(scrape())["w1"] == first:
            time.sleep(0.05)
        assert push_times(scrape())["w1"] > first, "a live worker's push time advances"
        pusher.stop()
        pusher.join(5)
        samples = scrape()
        last = push_times(samples)["w1"]
        # the dead worker's values stay on the gateway, the lag still says 0 ...
        lag = [v for (name, labels), v in samples.items() if name == "ddb2bt_replication_lag_seconds"
               and dict(labels).get("job") == "ddb2bt-orders"]
        assert lag == [0.0]
        # ... and only its push time stops: what the alert watches, selected the way the rule does
        rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())["groups"][0]["rules"]
        expr = next(r["expr"] for r in rules if r.get("alert") == "DDB2BTMetricsStale")
        job_regex = re.search(r'push_time_seconds\{job=~"([^"]+)"\}', expr).group(1)
        assert re.fullmatch(job_regex, "ddb2bt-orders") and not re.fullmatch(job_regex, "other-job")
        assert push_times(scrape())["w1"] == last <= time.time()
    finally:
        gateway.terminate()
        gateway.wait(10)


class _CatalogTable:
    """DescribeTable and Scan with boto3's call shapes, for the catalog example."""

    def describe_table(self, TableName):
        return {"Table": {"TableName": TableName, "ItemCount": 3}}

    def scan(self, **kw):
        items = [{"pk": {"S": "hats"}, "sk": {"S": f"fedora#{i}"}, "Price": {"N": str(i)}} for i in range(3)]
        return {"Items": items, "ConsumedCapacity": {"CapacityUnits": 1.0}}


def test_aws_api_calls_are_labelled_with_the_tables_name_in_the_job_like_every_series(monkeypatch, capsys):
    # Before: DescribeTable and Scan were labelled with the DynamoDB table's name
    # (ProductCatalog) and the stream's calls with the job's (product_catalog).
    import boto3.session

    from ddb2bt.pipeline.connect import reachability
    from ddb2bt.pipeline.app.cli import main
    from ddb2bt.pipeline.local.examples import resolve_mapping_path
    from ddb2bt.pipeline.observe.metrics import default_metrics
    from ddb2bt.transforms.config import load_mapping

    # Below the connections (they hand the process's call counter to the DynamoDB
    # client module where they make a client): boto3 gives the fake table.
    monkeypatch.setattr(boto3.session.Session, "client", lambda self, service, **kw: _CatalogTable())
    calls = default_metrics().aws_api_calls
    count = lambda table, api: calls.labels(table, api)._value.get()  # noqa: E731
    before = {(t, api): count(t, api) for t in ("product_catalog", "ProductCatalog") for api in ("Scan", "DescribeTable")}
    assert main(["lint", "-m", "example:product_catalog", "--sample", "3"]) == 0  # Scan: one per segment, 3
    assert "3 items checked" in capsys.readouterr().out
    reachability._probe_dynamodb(load_mapping(resolve_mapping_path("example:product_catalog")), 5.0)  # DescribeTable
    after = {key: count(*key) - value for key, value in before.items()}
    assert after == {("product_catalog", "Scan"): 3, ("product_catalog", "DescribeTable"): 1,
                     ("ProductCatalog", "Scan"): 0, ("ProductCatalog", "DescribeTable"): 0}
