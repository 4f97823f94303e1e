"""Prometheus metrics (``ddb2bt_*``), mirrored as Beam metrics for Dataflow.

Labels never carry row keys or item values (cardinality and privacy): only table
names, event types, dead-letter reasons, status codes, and stream/shard ids.

Replication lag is computed when scraped, from per-shard state kept by the source
and the sink: at the stream head with nothing pending it is 0 (not the age of the
last record); otherwise it is now − the change time of the oldest change read but
not yet applied (or of the last applied one), so a stalled shard keeps growing.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from apache_beam.metrics import Metrics as BeamMetrics
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily

NAMESPACE = "ddb2bt"
STREAM_RETENTION_S = 24 * 3600
LAG_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_BUCKETS = (1, 5, 10, 50, 100, 250, 500, 1000, 2500, 5000)


def _wall_s() -> float:
    return time.time()


@dataclass
class _ShardLag:
    stream: str
    pending_oldest_ms: Optional[int] = None  # oldest change read, not yet applied
    last_applied_ms: Optional[int] = None
    at_head: bool = False
    read_count: int = 0
    applied_count: int = 0


class LagTracker:
    """Per-shard event-time lag, fed by the source (read/at head) and the sink
    (applied). Thread-safe; cheap enough to call per batch."""

    def __init__(self, clock: Callable[[], float] = _wall_s) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._shards: dict = {}

    def _get(self, stream: str, shard: str) -> _ShardLag:
        key = (stream, shard)
        state = self._shards.get(key)
        if state is None:
            state = self._shards[key] = _ShardLag(stream=stream)
        return state

    def on_read(self, stream: str, shard: str, change_ms: int) -> None:
        with self._lock:
            s = self._get(stream, shard)
            s.at_head = False
            s.read_count += 1
            if s.pending_oldest_ms is None:
                s.pending_oldest_ms = change_ms

    def on_at_head(self, stream: str, shard: str) -> None:
        with self._lock:
            self._get(stream, shard).at_head = True

    def on_applied(self, stream: str, shard: str, change_ms: Optional[int], count: int) -> None:
        with self._lock:
            s = self._get(stream, shard)
            s.applied_count += count
            if change_ms is not None:
                s.last_applied_ms = change_ms if s.last_applied_ms is None else max(s.last_applied_ms, change_ms)
            if s.applied_count >= s.read_count:
                s.pending_oldest_ms = None

    def forget(self, stream: str, shard: str) -> None:
        with self._lock:
            self._shards.pop((stream, shard), None)

    def lag_seconds(self) -> dict:
        """{(stream, shard): lag seconds}."""
        now_ms = self._clock() * 1000
        out = {}
        with self._lock:
            for key, s in self._shards.items():
                if s.pending_oldest_ms is not None:
                    out[key] = max(0.0, (now_ms - s.pending_oldest_ms) / 1000)
                elif s.at_head or s.last_applied_ms is None:
                    out[key] = 0.0
                else:
                    out[key] = max(0.0, (now_ms - s.last_applied_ms) / 1000)
        return out

    def retention_headroom_seconds(self) -> dict:
        """{stream: 24 h − age of the oldest unprocessed change}."""
        now_ms = self._clock() * 1000
        out: dict = {}
        with self._lock:
            for (stream, _), s in self._shards.items():
                age = 0.0 if s.pending_oldest_ms is None else (now_ms - s.pending_oldest_ms) / 1000
                out[stream] = min(out.get(stream, STREAM_RETENTION_S), STREAM_RETENTION_S - age)
        return out

    def max_lag_seconds(self) -> float:
        return max(self.lag_seconds().values(), default=0.0)


class _LagCollector:
    def __init__(self, tracker: LagTracker) -> None:
        self._tracker = tracker

    def collect(self):
        lag = GaugeMetricFamily(f"{NAMESPACE}_replication_lag_seconds",
                                "Event-time lag of each shard: 0 at the stream head with nothing pending",
                                labels=["stream", "shard"])
        for (stream, shard), value in sorted(self._tracker.lag_seconds().items()):
            lag.add_metric([_stream_name(stream), shard], value)
        yield lag
        headroom = GaugeMetricFamily(f"{NAMESPACE}_retention_headroom_seconds",
                                     "24 h stream retention minus the age of the oldest unprocessed change",
                                     labels=["stream"])
        for stream, value in sorted(self._tracker.retention_headroom_seconds().items()):
            headroom.add_metric([_stream_name(stream)], value)
        yield headroom


def _stream_name(stream_arn: str) -> str:
    # table/<name>/stream/<label> — the account id is left out of labels.
    return stream_arn.split(":table/", 1)[-1] if ":table/" in stream_arn else stream_arn


class PipelineMetrics:
    """All metrics of one process. Components get it passed in (tests pass their own)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY, clock: Callable[[], float] = _wall_s) -> None:
        self.registry = registry
        self.lag = LagTracker(clock)
        r = registry
        self.changes_read = Counter(f"{NAMESPACE}_changes_read", "Stream records read", ["table", "event"], registry=r)
        self.changes_applied = Counter(f"{NAMESPACE}_changes_applied", "Changes acknowledged by Bigtable",
                                       ["table", "event"], registry=r)
        self.changes_coalesced = Counter(f"{NAMESPACE}_changes_coalesced",
                                         "Changes merged into another change's MutateRows entry", ["table"], registry=r)
        self.changes_skipped = Counter(f"{NAMESPACE}_changes_skipped", "Changes a rule skips", ["table"], registry=r)
        self.dead_letters = Counter(f"{NAMESPACE}_dead_letters", "Records sent to the dead-letter output",
                                    ["table", "stage", "reason"], registry=r)
        self.end_to_end_lag = Histogram(f"{NAMESPACE}_end_to_end_lag_seconds",
                                        "Acknowledged write time minus change time, per applied change",
                                        buckets=LAG_BUCKETS, registry=r)
        self.mutate_latency = Histogram(f"{NAMESPACE}_bigtable_mutate_seconds", "MutateRows call latency",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram(f"{NAMESPACE}_bigtable_batch_rows", "Row entries per MutateRows call",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.bigtable_retries = Counter(f"{NAMESPACE}_bigtable_retries", "Entries retried, by status code",
                                        ["code"], registry=r)
        self.dynamodb_throttles = Counter(f"{NAMESPACE}_dynamodb_throttles", "Throttled DynamoDB Streams calls",
                                          ["operation"], registry=r)
        self.iterator_refreshes = Counter(f"{NAMESPACE}_iterator_refreshes", "Expired shard iterators renewed",
                                          registry=r)
        self.trimmed_restarts = Counter(f"{NAMESPACE}_trimmed_restarts",
                                        "Shards restarted at TRIM_HORIZON after trimmed data (--on-trimmed=restart)",
                                        registry=r)
        self.backfill_superseded = Counter(f"{NAMESPACE}_backfill_superseded",
                                           "Backfill rows skipped because the live tail already applied a newer "
                                           "change of the item", registry=r)
        self.backfill_items = Counter(f"{NAMESPACE}_backfill_items_scanned", "Items read by the backfill",
                                      ["source"], registry=r)
        self.backfill_expected = Gauge(f"{NAMESPACE}_backfill_items_expected",
                                       "Items the backfill expects to read (table item count or export manifest)",
                                       registry=r)
        self.migration_phase = Gauge(f"{NAMESPACE}_migration_phase",
                                     "1 for the current phase of the migration", ["phase"], registry=r)
        self.checkpoint_time = Gauge(f"{NAMESPACE}_checkpoint_timestamp_seconds",
                                     "Wall time of the last durable checkpoint", registry=r)
        self.shards = Gauge(f"{NAMESPACE}_shards", "Shards by state", ["state"], registry=r)
        self.build = Info(f"{NAMESPACE}_build", "Build information", registry=r)
        r.register(_LagCollector(self.lag))
        # Beam mirrors, visible in the Dataflow UI where workers cannot be scraped.
        self._beam_applied = BeamMetrics.counter(NAMESPACE, "changes_applied")
        self._beam_dead = BeamMetrics.counter(NAMESPACE, "dead_letters")
        self._beam_lag = BeamMetrics.distribution(NAMESPACE, "end_to_end_lag_ms")

    def applied(self, table: str, event: str, count: int = 1) -> None:
        self.changes_applied.labels(table, event).inc(count)
        self._beam_applied.inc(count)

    def dead_lettered(self, table: str, stage: str, reason: str) -> None:
        self.dead_letters.labels(table, stage, reason).inc()
        self._beam_dead.inc()

    def observe_lag(self, lag_ms: int) -> None:
        self.end_to_end_lag.observe(max(lag_ms, 0) / 1000)
        self._beam_lag.update(max(lag_ms, 0))


_DEFAULT: Optional[PipelineMetrics] = None
_DEFAULT_LOCK = threading.Lock()


def default_metrics() -> PipelineMetrics:
    """The process-wide metrics on the default registry (what /metrics serves)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = PipelineMetrics()
        return _DEFAULT
