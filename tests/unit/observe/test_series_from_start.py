"""Every series a rule or a panel reads is there from a job's start with its
real value: counters at 0 per label set the job can produce (a rule's
increase() sees a first event only on a series scraped before it), the stored
phase and backfill progress, no checkpoint time before a checkpoint; labels say
what they count; a worker's Pushgateway group goes when the worker does."""
from __future__ import annotations

import logging
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from prometheus_client import CollectorRegistry

from ddb2bt.pipeline.clients.bigtable.channel import RECONNECT_MAX_MS, RECONNECT_OPTIONS
from ddb2bt.pipeline.control.phases import NONCE_SEP, PHASES, Migration
from ddb2bt.pipeline.control.state import BackfillCheckpoint, StateStore
from ddb2bt.pipeline.observe.metrics import (BACKFILL_EVENT, DEAD_LETTER_REASONS, DEAD_LETTER_STAGES, EVENTS,
                                             LAG_BUCKETS, RETRY_CODES, PipelineMetrics, start_pusher, stop_pushers)
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable


ROOT = Path(__file__).resolve().parents[3]


def value(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, labels)


def test_a_tables_counters_exist_at_zero_from_its_start():
    metrics = PipelineMetrics(CollectorRegistry())
    metrics.for_table("orders")
    for event in (*EVENTS, BACKFILL_EVENT):
        assert value(metrics, "ddb2bt_changes_applied_total", table="orders", event=event) == 0
    for event in EVENTS:
        assert value(metrics, "ddb2bt_changes_read_total", table="orders", event=event) == 0
    for stage in DEAD_LETTER_STAGES:
        for reason in DEAD_LETTER_REASONS:
            assert value(metrics, "ddb2bt_dead_letters_total", table="orders", stage=stage, reason=reason) == 0
    for code in RETRY_CODES:
        assert value(metrics, "ddb2bt_bigtable_retries_total", table="orders", code=code) == 0
    for name in ("ddb2bt_changes_skipped_total", "ddb2bt_changes_coalesced_total", "ddb2bt_lease_waits_total"):
        assert value(metrics, name, table="orders") == 0
    assert value(metrics, "ddb2bt_dynamodb_throttles_total", table="orders", operation="GetRecords") == 0
    # no value yet: absent, not 0 (`time() - 0` would read 56 years; progress n/0 infinite)
    assert value(metrics, "ddb2bt_checkpoint_timestamp_seconds", table="orders") is None
    assert value(metrics, "ddb2bt_backfill_items_expected", table="orders") is None
    metrics.for_table("orders").checkpoint_time.set(1700000000.0)
    assert value(metrics, "ddb2bt_checkpoint_timestamp_seconds", table="orders") == 1700000000.0


# The Bigtable change-stream reader's errors carry reasons too, but only the
# rollback reads a change stream, and it stops on them: it writes no dead letter.
NEVER_DEAD_LETTERED = {ROOT / "pipeline" / "clients" / "bigtable" / "changestream.py"}


def test_every_dead_letter_reason_the_code_uses_has_its_series_from_the_start():
    used = set()
    for folder in ("pipeline", "transforms"):
        for path in set((ROOT / folder).rglob("*.py")) - NEVER_DEAD_LETTERED:
            used |= set(re.findall(r'reason="([a-z_]+)"', path.read_text()))
            used |= set(re.findall(r'permanent_reason or "([a-z_]+)"', path.read_text()))
    errors = (ROOT / "pipeline" / "clients" / "bigtable" / "errors.py").read_text()
    used |= set(re.findall(r'return "([a-z_]+)"', errors))
    assert used and used <= set(DEAD_LETTER_REASONS), sorted(used - set(DEAD_LETTER_REASONS))


def test_the_first_dead_letter_of_a_reason_logs_a_warning_once(caplog):
    metrics = PipelineMetrics(CollectorRegistry())
    with caplog.at_level(logging.WARNING, logger="ddb2bt"):
        for _ in range(3):
            metrics.dead_lettered("orders", "map", "row_key_too_long")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "dead-lettered" in r.getMessage()]
    assert len(warnings) == 1 and "row_key_too_long" in warnings[0].getMessage()
    assert "ddb2bt dlq list" in warnings[0].getMessage()


def test_the_continuous_checks_divergence_kinds_exist_at_zero_once_it_runs():
    from ddb2bt.pipeline.verify.continuous import KINDS

    metrics = PipelineMetrics(CollectorRegistry())
    metrics.for_table("orders").verify_kinds(KINDS)
    for kind in KINDS:
        assert value(metrics, "ddb2bt_verify_divergent_total", table="orders", kind=kind) == 0
    assert value(metrics, "ddb2bt_verify_checked_total", table="orders") == 0


def store_with(phase: str, progress: dict, expected: int):
    store = StateStore(InMemoryBigtable(), "orders", lambda: 5)
    store.save_meta("phase", f"{phase}{NONCE_SEP}abc")
    store.save_meta("backfill_expected", str(expected))
    for (source, part), count in progress.items():
        store.save_backfill_progress([BackfillCheckpoint(source, part, "token", count)])
    return store


def test_a_restarted_job_publishes_the_stored_phase_and_backfill_progress(monkeypatch):
    metrics = PipelineMetrics(CollectorRegistry())
    monkeypatch.setattr("ddb2bt.pipeline.control.phases.default_metrics", lambda: metrics)
    store = store_with("BACKFILLING", {("scan", "segment-0"): 300, ("scan", "segment-1"): 200}, 1000)
    Migration(store).publish()
    assert value(metrics, "ddb2bt_migration_phase", table="orders", phase="BACKFILLING") == 1
    assert {value(metrics, "ddb2bt_migration_phase", table="orders", phase=p) for p in PHASES} == {0, 1}
    assert value(metrics, "ddb2bt_backfill_items_scanned_total", table="orders", source="scan") == 500
    assert value(metrics, "ddb2bt_backfill_items_expected", table="orders") == 1000
    Migration(store).publish()  # again (the tail's start, then the backfill's): not counted twice
    assert value(metrics, "ddb2bt_backfill_items_scanned_total", table="orders", source="scan") == 500


def test_the_eta_is_zero_once_the_backfill_is_over_not_a_guess_from_a_slowing_rate(monkeypatch):
    metrics = PipelineMetrics(CollectorRegistry())
    monkeypatch.setattr("ddb2bt.pipeline.control.phases.default_metrics", lambda: metrics)
    store = store_with("LIVE", {("scan", "segment-0"): 700}, 1000)  # the estimate said 1,000: it was 700
    Migration(store).publish()
    assert value(metrics, "ddb2bt_backfill_eta_seconds", table="orders") == 0
    metrics.for_table("other").seed_backfill({"scan": 50}, 50)  # read everything it expected
    assert value(metrics, "ddb2bt_backfill_eta_seconds", table="other") == 0


def test_backfilled_items_are_not_counted_as_inserts():
    from ddb2bt.pipeline.sink.report import report_batch
    from ddb2bt.pipeline.sink.batch import Batch
    from ddb2bt.transforms.model import BackfillPosition, ChangeRecord, MappedChange, RowChange, SetCell

    metrics = PipelineMetrics(CollectorRegistry())
    view = metrics.for_table("orders")
    pos = BackfillPosition("scan", "segment-0", None, 1)
    copied = MappedChange(ChangeRecord("INSERT", {"k": {"S": "a"}}, {}, None, 1000, pos),
                          (RowChange("t", b"a", (SetCell("f", b"q", b"v", 1000),)),))
    batch = Batch()
    batch.elements.append(copied)
    report_batch(view, batch, [], 2000)
    assert value(metrics, "ddb2bt_changes_applied_total", table="orders", event=BACKFILL_EVENT) == 1
    assert value(metrics, "ddb2bt_changes_applied_total", table="orders", event="INSERT") == 0


def test_a_lease_pause_is_counted_as_such_not_as_a_bigtable_status_code():
    from ddb2bt.pipeline.clients.bigtable.errors import EntryStatus
    from ddb2bt.pipeline.control.lease import LeaseUnproven
    from tests.unit.sink.test_sink import UNAVAILABLE, change, make

    _, _, writer, metrics = make(fault=lambda table, entries, n: [EntryStatus(UNAVAILABLE, "later")]
                                 if table == "t" and n == 0 else None)
    fences = []

    def fence(batch):  # the ownership check: unproven once, before the first retry
        fences.append(1)
        if len(fences) == 2:
            raise LeaseUnproven("no renewal succeeded lately")

    writer._fence_partitions = fence
    writer.add(change(1))
    assert writer.flush() == []
    assert value(metrics, "ddb2bt_bigtable_retries_total", table="job", code="UNAVAILABLE") == 1
    assert value(metrics, "ddb2bt_lease_waits_total", table="job") == 1
    codes = {s.labels["code"] for m in metrics.bigtable_retries.collect() for s in m.samples}
    assert codes <= set(RETRY_CODES), codes


def test_lag_buckets_resolve_the_lags_the_alerts_talk_about():
    between = [b for b in LAG_BUCKETS if 300 <= b <= 900]
    assert len(between) >= 4 and max(b - a for a, b in zip(between, between[1:])) <= 150


def test_the_bigtable_channel_reconnects_within_seconds_after_an_outage():
    options = dict(RECONNECT_OPTIONS)
    assert options["grpc.max_reconnect_backoff_ms"] == RECONNECT_MAX_MS <= 10_000
    assert options["grpc.initial_reconnect_backoff_ms"] <= 1_000


def test_a_pusher_deletes_its_group_when_the_process_stops():
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_PUT(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(("PUT", self.path))
            self.send_response(200)
            self.end_headers()

        def do_DELETE(self):
            seen.append(("DELETE", self.path))
            self.send_response(202)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        registry = CollectorRegistry()
        PipelineMetrics(registry)
        start_pusher(f"127.0.0.1:{server.server_port}", "ddb2bt-del", registry, interval_s=0.05, worker="w9")
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.02)
        stop_pushers()
    finally:
        server.shutdown()
    assert seen[0] == ("PUT", "/metrics/job/ddb2bt-del/worker/w9")
    assert seen[-1] == ("DELETE", "/metrics/job/ddb2bt-del/worker/w9")
