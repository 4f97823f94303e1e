"""Prometheus metrics (``ddb2bt_*``), mirrored as Beam metrics for Dataflow.

Every series carries ``table``: the table's name in the job (its mapping's
name, the key its state is kept under), so one job of several tables is watched
per table. Components take their table's view (``PipelineMetrics.for_table``).
Labels never carry row keys or item values (cardinality and privacy): only table
names, event types, dead-letter reasons, status codes, and stream/shard ids.

Replication lag is computed when scraped, from per-shard state kept by the source
and the sink: at the stream head with nothing pending it is 0 (not the age of the
last record) for as long as the reader keeps seeing the head; otherwise it is
now − the change time of the oldest change read but not yet applied (or of the
last applied one), so a stalled shard keeps growing. A head last seen more than
HEAD_FRESH_S ago is no longer known: the lag is then the time since (a reader
held up behind another table's blocked writes, or a dead job's last report,
never shows 0).
"""
from __future__ import annotations

import functools
import logging
import math
import threading
import time
from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable, Optional

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily

from ddb2bt.transforms.arns import table_of_stream
from ddb2bt.transforms.errors import ConfigError
from ddb2bt.transforms.limits import STREAM_RETENTION_S

NAMESPACE = "ddb2bt"
# The table label of a component without a job name (a state store without one: tests, tools).
UNNAMED_TABLE = "unnamed"
# The alerts talk about lags of 1-10 minutes (DDB2BTReplicationLagHigh: 300 s):
# buckets every minute or two there, so a p99 near 300 s reads as ~300 s.
LAG_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 180, 240, 300, 360, 450, 600, 750, 900, 1800, 3600)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_BUCKETS = (1, 5, 10, 50, 100, 250, 500, 1000, 2500, 5000)
# A reader polls a shard at its head every --poll-interval (default
# DEFAULT_POLL_INTERVAL_S) plus a GetRecords round trip and a bundle's
# scheduling: a head report younger than this is current. Older, the shard may
# have changes nobody read, so its lag counts from the report
# (docs/operations.md "Replication lag"). A --poll-interval near this shows as lag.
HEAD_FRESH_S = 30.0

# The label sets every table's counters carry from the start, at 0: a rule's
# increase() and a panel's rate() see a first increment only of a series that
# was already scraped (a series born at 5 reads as no rise at all).
EVENTS = ("INSERT", "MODIFY", "REMOVE")  # a stream change's event name
BACKFILL_EVENT = "BACKFILL"  # ddb2bt_changes_applied{event}: an item the backfill copied, not a change
STREAM_OPERATIONS = ("DescribeStream", "GetShardIterator", "GetRecords")  # the throttles a reader can meet
# The gRPC codes an unreachable or overloaded Bigtable answers with: the retry
# counter of each is there before an outage.
RETRY_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "INTERNAL")
DEAD_LETTER_STAGES = ("map", "write")
# Every reason a record is dead-lettered for (MappingError.reason, the sink's
# permanent outcomes): tests/unit/observe check that it names every reason the code uses.
DEAD_LETTER_REASONS = (
    "bad_attribute", "bad_input", "bad_number", "bad_record", "cell_too_large", "column_collision", "encoding",
    "hook_error", "missing_key_attribute", "no_matching_rule", "qualifier_too_long", "row_filter_too_large",
    "row_key", "row_key_empty", "row_key_too_long", "row_too_large", "timestamp", "timestamp_unit",
    "too_many_mutations", "unmapped_attribute", "write_failed", "version_clash", "unknown_family", "sweep")


def _wall_s() -> float:
    return time.time()


@dataclass(frozen=True)
class ShardView:
    """What the process knows of one shard (metrics.LagTracker.view): times are
    source creation times in ms except ``empty_since_ms`` (this host's wall
    clock at the first empty page of the current run of empty pages)."""

    pending_oldest_ms: Optional[int] = None  # oldest change read, not yet applied
    last_applied_ms: Optional[int] = None  # newest change applied
    empty_since_ms: Optional[int] = None
    empty_pages: int = 0
    behind_ms: Optional[int] = None  # the service's own "behind latest" figure, when it gives one


@dataclass
class _ShardLag:
    stream: str
    table: str = ""
    pending_oldest_ms: Optional[int] = None  # oldest change read, not yet applied
    last_applied_ms: Optional[int] = None
    at_head: bool = False
    head_seen_s: float = 0.0  # wall time of the last at-head report
    read_count: int = 0
    applied_count: int = 0
    # The run of empty pages so far (control/catchup.py: an empty page alone is
    # not the head): this host's wall ms at its first page, and its length.
    empty_since_ms: Optional[int] = None
    empty_pages: int = 0
    behind_ms: Optional[int] = None  # the service's "behind latest" figure of the last page, when given


class LagTracker:
    """Per-shard event-time lag, fed by the source (read/at head) and the sink
    (applied). Thread-safe; cheap enough to call per batch."""

    def __init__(self, clock: Callable[[], float] = _wall_s) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._shards: dict = {}
        self._tables: dict = {}  # stream -> its table's label (set by the reader's view)
        self._retention_s: dict = {}  # stream -> its retention when not DynamoDB Streams' 24 h (Kinesis)
        self._checkpointed_s: dict = {}  # table label -> wall time of its last durable checkpoint
        self._since_s: dict = {}  # table label -> when this process first saw it (no checkpoint yet)

    def set_retention(self, stream: str, seconds: float) -> None:
        """The stream's retention, for the headroom gauge (a Kinesis stream keeps 24 h to a year)."""
        self._retention_s[stream] = seconds

    def label(self, stream: str, table: str) -> None:
        """The ``table`` label of ``stream``'s series (the reader knows it)."""
        self._tables[stream] = table

    def table_of(self, stream: str) -> str:
        return self._tables.get(stream) or table_of_stream(stream)

    def _get(self, stream: str, shard: str) -> _ShardLag:
        key = (stream, shard)
        state = self._shards.get(key)
        if state is None:
            state = self._shards[key] = _ShardLag(stream=stream)
        return state

    def on_read(self, stream: str, shard: str, change_ms: int, count: int = 1) -> None:
        """``count`` changes read, the first of them at ``change_ms`` (a page's
        records are reported at once: the same state as one call each)."""
        with self._lock:
            s = self._get(stream, shard)
            s.at_head = False
            s.empty_since_ms, s.empty_pages = None, 0
            s.read_count += count
            if s.pending_oldest_ms is None:
                s.pending_oldest_ms = change_ms

    def on_records_ahead(self, stream: str, shard: str) -> None:
        """A page without records of this table, yet not empty (behind the tip, or
        other tables' records: stream_source.page_state): not a step toward the
        head."""
        with self._lock:
            s = self._get(stream, shard)
            s.at_head = False
            s.empty_since_ms, s.empty_pages = None, 0

    def on_at_head(self, stream: str, shard: str, behind_ms: int = 0) -> None:
        """An empty page (called once per empty GetRecords page); ``behind_ms``:
        how far behind the tip it says it is (Kinesis), which dates it earlier."""
        with self._lock:
            s = self._get(stream, shard)
            s.at_head, s.head_seen_s = True, self._clock()
            if s.empty_since_ms is None:
                s.empty_since_ms = int(self._clock() * 1000) - behind_ms
            s.empty_pages += 1

    def on_checkpoint(self, table: str, wall_s: float) -> None:
        """``table``'s sink made a durable checkpoint at ``wall_s``."""
        with self._lock:
            self._checkpointed_s[table] = max(wall_s, self._checkpointed_s.get(table, 0.0))

    def on_behind(self, stream: str, shard: str, behind_ms: Optional[int]) -> None:
        """The service's own "behind latest" figure of a page (Kinesis's MillisBehindLatest)."""
        with self._lock:
            self._get(stream, shard).behind_ms = behind_ms

    def view(self, stream: str, shard: str):
        """The shard as the cutover's catch-up rule sees it (control/catchup.py)."""
        with self._lock:
            s = self._shards.get((stream, shard))
            if s is None:
                return ShardView()
            return ShardView(s.pending_oldest_ms, s.last_applied_ms, s.empty_since_ms, s.empty_pages, s.behind_ms)

    def shards_of(self, stream: str) -> list:
        with self._lock:
            return sorted(shard for (st, shard) in self._shards if st == stream)

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
        now_s = self._clock()
        now_ms = now_s * 1000
        out = {}
        with self._lock:
            for key, s in self._shards.items():
                if s.pending_oldest_ms is not None:
                    out[key] = max(0.0, (now_ms - s.pending_oldest_ms) / 1000)
                elif s.at_head:
                    # Everything up to the last head report is applied; past
                    # HEAD_FRESH_S nobody knows what came since.
                    unseen = now_s - s.head_seen_s
                    out[key] = 0.0 if unseen <= HEAD_FRESH_S else unseen
                elif s.last_applied_ms is None:
                    out[key] = 0.0
                else:
                    out[key] = max(0.0, (now_ms - s.last_applied_ms) / 1000)
        return out

    def checkpoint_age_seconds(self) -> dict:
        """{table label: seconds since its last durable checkpoint, 0 while every
        shard of it is at a current head with nothing pending}. A quiet table
        writes no checkpoints, so its age only counts while it has (or may have)
        changes to apply: read and not yet checkpointed, or a head not seen for
        HEAD_FRESH_S."""
        lags = self.lag_seconds()
        now_s = self._clock()
        out: dict = {}
        with self._lock:
            for (stream, shard), s in self._shards.items():
                table = self.table_of(stream)
                since = self._since_s.setdefault(table, now_s)
                behind = s.pending_oldest_ms is not None or lags.get((stream, shard), 0.0) > 0
                age = max(0.0, now_s - self._checkpointed_s.get(table, since)) if behind else 0.0
                out[table] = max(out.get(table, 0.0), age)
        return out

    def lag_by_table(self) -> dict:
        """{(table, stream, shard): lag seconds}."""
        return {(self.table_of(stream), stream, shard): v for (stream, shard), v in self.lag_seconds().items()}

    def retention_headroom_seconds(self) -> dict:
        """{stream: retention (24 h unless set) − age of the oldest unprocessed change}."""
        now_ms = self._clock() * 1000
        out: dict = {}
        with self._lock:
            for (stream, _), s in self._shards.items():
                age = 0.0 if s.pending_oldest_ms is None else (now_ms - s.pending_oldest_ms) / 1000
                retention = self._retention_s.get(stream, STREAM_RETENTION_S)
                out[stream] = min(out.get(stream, retention), retention - age)
        return out

    def max_lag_seconds(self) -> float:
        return max(self.lag_seconds().values(), default=0.0)


class _LagCollector:
    def __init__(self, tracker: LagTracker, backfill_items, backfill_expected) -> None:
        self._tracker = tracker
        self._rates: dict = {}  # table -> RateWindow of its backfill
        self._items = backfill_items
        self._expected = backfill_expected
        self.backfill_over: set = set()  # tables whose phase is past their backfill: no ETA

    def collect(self):
        done: dict = {}
        for m in self._items.collect():
            for sample in m.samples:
                if sample.name.endswith("_total"):
                    table = sample.labels["table"]
                    done[table] = done.get(table, 0.0) + sample.value
        expected = {s.labels["table"]: s.value for m in self._expected.collect() for s in m.samples}
        eta = GaugeMetricFamily(f"{NAMESPACE}_backfill_eta_seconds",
                                "Estimated seconds until the backfill has read the expected items "
                                "(from the last minute's rate; 0 once it is done; absent while unknown)", labels=["table"])
        for table in sorted(set(done) | set(expected)):
            rate = self._rates.setdefault(table, RateWindow()).rate(done.get(table, 0.0))
            if table in self.backfill_over or (expected.get(table) and done.get(table, 0.0) >= expected[table]):
                # done (the expected count is an estimate: the phase says it is over)
                eta.add_metric([table], 0.0)
            elif expected.get(table) and rate > 0:
                eta.add_metric([table], max(0.0, (expected[table] - done.get(table, 0.0)) / rate))
        yield eta
        lag = GaugeMetricFamily(f"{NAMESPACE}_replication_lag_seconds",
                                "Event-time lag of each shard: 0 at a current stream head with nothing "
                                "pending; a head not seen for 30 s counts from its last sighting",
                                labels=["table", "stream", "shard"])
        for (table, stream, shard), value in sorted(self._tracker.lag_by_table().items()):
            lag.add_metric([table, _stream_name(stream), shard], value)
        yield lag
        headroom = GaugeMetricFamily(f"{NAMESPACE}_retention_headroom_seconds",
                                     "24 h stream retention minus the age of the oldest unprocessed change",
                                     labels=["table", "stream"])
        for stream, value in sorted(self._tracker.retention_headroom_seconds().items()):
            headroom.add_metric([self._tracker.table_of(stream), _stream_name(stream)], value)
        yield headroom
        age = GaugeMetricFamily(f"{NAMESPACE}_checkpoint_age_seconds",
                                "Seconds since the table's last durable checkpoint while it has changes to apply "
                                "(0 while every shard is at a current head with nothing pending)", labels=["table"])
        for table, value in sorted(self._tracker.checkpoint_age_seconds().items()):
            age.add_metric([table], value)
        yield age


class RateWindow:
    """Items per second over the last ``window_s`` seconds, from a growing total."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._window = window_s
        self._clock = clock
        self._points: list = []
        self._lock = threading.Lock()

    def rate(self, total: float) -> float:
        now = self._clock()
        with self._lock:
            self._points.append((now, total))
            self._points = [p for p in self._points if now - p[0] <= self._window] or [(now, total)]
            (t0, v0), (t1, v1) = self._points[0], self._points[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0


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
                                        ["table"], buckets=LAG_BUCKETS, registry=r)
        self.mutate_latency = Histogram(f"{NAMESPACE}_bigtable_mutate_seconds", "MutateRows call latency",
                                        ["table"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram(f"{NAMESPACE}_bigtable_batch_rows", "Row entries per MutateRows call",
                                    ["table"], buckets=BATCH_BUCKETS, registry=r)
        self.bigtable_retries = Counter(f"{NAMESPACE}_bigtable_retries", "Entries retried, by the gRPC status "
                                        "code Bigtable answered (or the error's name where none came back)",
                                        ["table", "code"], registry=r)
        self.lease_waits = Counter(f"{NAMESPACE}_lease_waits", "Write attempts held back while this process "
                                   "could not prove it still holds its lease (a Bigtable blip, a paused process): "
                                   "the job's own pause, not an answer of Bigtable's", ["table"], registry=r)
        self.dynamodb_throttles = Counter(f"{NAMESPACE}_dynamodb_throttles", "Throttled DynamoDB Streams calls",
                                          ["table", "operation"], registry=r)
        # Every attempt of every DynamoDB / Streams call, by API: the rates the AWS
        # limits are about (GetRecords 5/s per shard, DescribeStream's low account
        # limit); docs/operations.md "Within AWS's limits".
        self.aws_api_calls = Counter(f"{NAMESPACE}_aws_api_calls", "DynamoDB and DynamoDB Streams API calls made "
                                     "(every attempt), by API", ["table", "api"], registry=r)
        self.iterator_refreshes = Counter(f"{NAMESPACE}_iterator_refreshes", "Expired shard iterators renewed",
                                          ["table"], registry=r)
        self.trimmed_restarts = Counter(f"{NAMESPACE}_trimmed_restarts",
                                        "Shards restarted at TRIM_HORIZON after trimmed data (--on-trimmed=restart)",
                                        ["table"], registry=r)
        self.backfill_superseded = Counter(f"{NAMESPACE}_backfill_superseded",
                                           "Backfill rows skipped because the live tail already applied a newer "
                                           "change of the item", ["table"], registry=r)
        self.ordering_guard = Counter(f"{NAMESPACE}_ordering_guard_rows",
                                      "Rows through the ordering guard of an out-of-order source (Kinesis), by "
                                      "outcome: applied, stale (an older or duplicate change: nothing written), "
                                      "lost_race (decided again)", ["table", "outcome"], registry=r)
        self.markers_stripped = Counter(f"{NAMESPACE}_markers_stripped",
                                        "Rows written again without touch markers because the marker family was "
                                        "dropped by the migration's finish meanwhile", ["table"], registry=r)
        self.version_clashes = Counter(f"{NAMESPACE}_version_clashes",
                                       "Changes refused because another item owns the same cell version",
                                       ["table"], registry=r)
        self.recovered_items = Counter(f"{NAMESPACE}_recovered_items",
                                       "Changes applied from incremental exports by `ddb2bt recover`",
                                       ["table"], registry=r)
        self.backfill_items = Counter(f"{NAMESPACE}_backfill_items_scanned", "Items read by the backfill",
                                      ["table", "source"], registry=r)
        self.backfill_expected = Gauge(f"{NAMESPACE}_backfill_items_expected",
                                       "Items the backfill expects to read (table item count or export manifest)",
                                       ["table"], registry=r)
        self.migration_phase = Gauge(f"{NAMESPACE}_migration_phase",
                                     "1 for the current phase of the migration", ["table", "phase"], registry=r)
        self.checkpoint_time = Gauge(f"{NAMESPACE}_checkpoint_timestamp_seconds",
                                     "Wall time of the last durable checkpoint", ["table"], registry=r)
        self.shards = Gauge(f"{NAMESPACE}_shards", "Shards by state", ["table", "state"], registry=r)
        # The continuous check (verify/continuous.py): items compared, divergent
        # ones by kind (missing_rows, different_cells, ...), end of the last full pass.
        self.verify_checked = Counter(f"{NAMESPACE}_verify_checked", "Items the continuous check compared",
                                      ["table"], registry=r)
        self.verify_divergent = Counter(f"{NAMESPACE}_verify_divergent",
                                        "Items the continuous check found divergent (confirmed), by kind",
                                        ["table", "kind"], registry=r)
        self.verify_last_pass = Gauge(f"{NAMESPACE}_verify_last_full_pass_timestamp_seconds",
                                      "Wall time the continuous check last finished a pass over the whole table",
                                      ["table"], registry=r)
        self.build = Info(f"{NAMESPACE}_build", "Build information", registry=r)
        self.build.info(build_info())
        self._collector = _LagCollector(self.lag, self.backfill_items, self.backfill_expected)
        r.register(self._collector)
        # Beam mirrors, visible in the Dataflow UI where workers cannot be scraped.
        # inside: Beam takes ~1.5 s of CPU to import, and the commands that never count
        # (--help, local, validate, status, dlq list) would pay it on every start
        from apache_beam.metrics import Metrics as BeamMetrics

        self._beam = BeamMetrics
        self._beam_applied = BeamMetrics.counter(NAMESPACE, "changes_applied")
        self._beam_dead = BeamMetrics.counter(NAMESPACE, "dead_letters")
        self._beam_lag = BeamMetrics.distribution(NAMESPACE, "end_to_end_lag_ms")
        self._beam_max_lag = BeamMetrics.gauge(NAMESPACE, "max_replication_lag_ms")
        self._beam_dead_by_reason: dict = {}
        self._children: dict = {}
        self._views: dict = {}
        self._dead_seen: set = set()  # (table, reason) dead-lettered in this process: the first is logged

    def for_table(self, table: str) -> "TableMetrics":
        """This process's metrics with ``table`` bound: what a component of one
        table (its reader, sink, backfill, phase) records through."""
        view = self._views.get(table)
        if view is None:
            view = self._views[table] = TableMetrics(self, table)
        return view

    def publish_lag(self) -> None:
        """Mirror the current max shard lag as a Beam gauge (Dataflow's UI)."""
        self._beam_max_lag.set(int(self.lag.max_lag_seconds() * 1000))

    def _child(self, metric, *labels):
        """Labelled children cached: ``labels()`` is a lock and a dict walk per call."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def applied(self, table: str, event: str, count: int = 1) -> None:
        self._child(self.changes_applied, table, event).inc(count)
        self._beam_applied.inc(count)

    def coalesced(self, table: str, count: int = 1) -> None:
        self._child(self.changes_coalesced, table).inc(count)

    def read(self, table: str, event: str, count: int = 1) -> None:
        self._child(self.changes_read, table, event).inc(count)

    def dead_lettered(self, table: str, stage: str, reason: str) -> None:
        if (table, reason) not in self._dead_seen:
            self._dead_seen.add((table, reason))
            logging.getLogger("ddb2bt").warning(
                "%s: a first record dead-lettered (%s, at %s); inspect with: ddb2bt dlq list --reason %s",
                table, reason, stage, reason)
        self.dead_letters.labels(table, stage, reason).inc()
        self._beam_dead.inc()
        counter = self._beam_dead_by_reason.get(reason)
        if counter is None:
            counter = self._beam_dead_by_reason[reason] = self._beam.counter(NAMESPACE, f"dead_letters_{reason}")
        counter.inc()

    def observe_lag(self, table: str, lag_ms: int) -> None:
        self._child(self.end_to_end_lag, table).observe(max(lag_ms, 0) / 1000)
        self._beam_lag.update(max(lag_ms, 0))

    # The continuous check (verify/continuous.py), mirrored as Beam metrics: on
    # Dataflow its steps run on workers (continuous_beam.py). Beam metrics have
    # no labels: the table (a mapping's name, never a key) is in the name.
    def verify_checked_items(self, table: str, count: int) -> None:
        self._child(self.verify_checked, table).inc(count)
        self._beam.counter(NAMESPACE, f"verify_checked_{table}").inc(count)

    def verify_kinds(self, table: str, kinds) -> None:
        """The divergence counter of each of ``kinds`` at 0: the check's first confirmation is a rise."""
        for kind in kinds:
            self._child(self.verify_divergent, table, kind)

    def verify_divergence(self, table: str, kind: str) -> None:
        self._child(self.verify_divergent, table, kind).inc()
        self._beam.counter(NAMESPACE, f"verify_divergent_{table}_{kind}").inc()

    def verify_pass_finished(self, table: str, at_s: float) -> None:
        self._child(self.verify_last_pass, table).set(at_s)
        self._beam.gauge(NAMESPACE, f"verify_last_full_pass_ms_{table}").set(int(at_s * 1000))

    def observe_lag_counts(self, table: str, counts: dict) -> None:
        """``observe_lag(lag)`` ``n`` times for each ``lag: n`` (milliseconds): a
        batch's changes, with one histogram update per bucket instead of one per
        change (the same samples)."""
        clamped: dict = {}
        for lag, n in counts.items():
            lag = lag if lag > 0 else 0
            clamped[lag] = clamped.get(lag, 0) + n
        observe_counted(self._child(self.end_to_end_lag, table), {lag / 1000: n for lag, n in clamped.items()})
        update = self._beam_lag.update  # Beam's distribution has no batch update: once a change
        for lag, n in clamped.items():
            for _ in range(n):
                update(lag)


class _Bound:
    """A labelled metric with its first label, ``table``, given: ``labels(rest...)``."""

    def __init__(self, metric, table: str) -> None:
        self._metric, self._table = metric, table

    def labels(self, *rest):
        return self._metric.labels(self._table, *rest)


class _Lazy:
    """A gauge's child of one table, created at its first ``set``: a series that
    has no value yet (no checkpoint so far) is absent, not 0."""

    def __init__(self, metric, table: str) -> None:
        self._metric, self._table = metric, table

    def set(self, value: float) -> None:
        self._metric.labels(self._table).set(value)


class TableMetrics:
    """One table's view of the process's metrics: the same names, with the
    ``table`` label bound (``retries.labels(code)``, ``iterator_refreshes.inc()``,
    ``observe_lag(ms)``); the shared lag tracker, registry and totals pass through."""

    _BOUND = ("bigtable_retries", "dynamodb_throttles", "backfill_items", "shards", "migration_phase",
              "aws_api_calls", "ordering_guard")
    _CHILDREN = ("end_to_end_lag", "mutate_latency", "batch_rows", "iterator_refreshes", "trimmed_restarts",
                 "backfill_superseded", "markers_stripped", "version_clashes", "recovered_items", "lease_waits")
    _LAZY = ("backfill_expected", "checkpoint_time")  # no value until there is one

    def __init__(self, metrics: PipelineMetrics, table: str) -> None:
        self.metrics, self.table = metrics, table
        for name in self._BOUND:
            setattr(self, name, _Bound(getattr(metrics, name), table))
        for name in self._CHILDREN:
            setattr(self, name, getattr(metrics, name).labels(table))
        for name in self._LAZY:
            setattr(self, name, _Lazy(getattr(metrics, name), table))
        self._seed()

    def _seed(self) -> None:
        """Every counter series this table can produce, at 0 (see EVENTS)."""
        m = self.metrics
        for event in EVENTS:
            m._child(m.changes_read, self.table, event)
            m._child(m.changes_applied, self.table, event)
        m._child(m.changes_applied, self.table, BACKFILL_EVENT)
        m._child(m.changes_coalesced, self.table)
        m._child(m.changes_skipped, self.table)
        for stage in DEAD_LETTER_STAGES:
            for reason in DEAD_LETTER_REASONS:
                m.dead_letters.labels(self.table, stage, reason)
        for code in RETRY_CODES:
            self.bigtable_retries.labels(code)
        for operation in STREAM_OPERATIONS:
            self.dynamodb_throttles.labels(operation)

    def seed_backfill(self, counts: dict, expected: Optional[int]) -> None:
        """A resumed backfill: ``counts`` ({source: items}) its stored progress,
        ``expected`` its item estimate. The scanned counter is raised to the stored
        count (never lowered: this process may have read more since)."""
        for source, count in counts.items():
            child = self.backfill_items.labels(source)
            have = child._value.get()
            if count > have:
                child.inc(count - have)
        if expected:
            self.backfill_expected.set(expected)

    def backfill_over(self, over: bool) -> None:
        """Past its backfill (or back in one): the ETA is shown only during one."""
        (self.metrics._collector.backfill_over.add if over else self.metrics._collector.backfill_over.discard)(
            self.table)

    def __getattr__(self, name):  # lag, registry, changes_*, applied(), read(), ... are the process's
        return getattr(self.metrics, name)

    def for_table(self, table: str) -> "TableMetrics":
        return self if table == self.table else self.metrics.for_table(table)

    def observe_lag(self, lag_ms: int) -> None:
        self.metrics.observe_lag(self.table, lag_ms)

    def observe_lag_counts(self, counts: dict) -> None:
        self.metrics.observe_lag_counts(self.table, counts)

    def verify_checked_items(self, count: int) -> None:
        self.metrics.verify_checked_items(self.table, count)

    def verify_kinds(self, kinds) -> None:
        self.metrics.verify_kinds(self.table, kinds)
        self.metrics._child(self.metrics.verify_checked, self.table)

    def verify_divergence(self, kind: str) -> None:
        self.metrics.verify_divergence(self.table, kind)

    def verify_pass_finished(self, at_s: float) -> None:
        self.metrics.verify_pass_finished(self.table, at_s)

    def set_phase(self, phase: str, phases, backfill_over: Optional[bool] = None) -> None:
        """``phase`` is 1 and every other of ``phases`` (the control floor's names)
        0; ``backfill_over``: whether the phase is past the backfill (no ETA then)."""
        for p in phases:
            self.migration_phase.labels(p).set(1 if p == phase else 0)
        if backfill_over is not None:
            self.backfill_over(backfill_over)


def observe_counted(histogram, counts: dict) -> None:
    """``histogram.observe(a)`` ``n`` times for every ``a: n``, as one update per
    bucket: the bucket of each amount is the first bound >= it, as ``observe``
    chooses it. Falls back to one call per sample on a client without these
    internals."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or not counts:
        for amount, n in counts.items():
            for _ in range(n):
                histogram.observe(amount)
        return
    per_bucket: dict = {}
    for amount, n in counts.items():
        i = bisect_left(bounds, amount)
        per_bucket[i] = per_bucket.get(i, 0) + n
    histogram._raise_if_not_observable()
    total.inc(math.fsum(amount * n for amount, n in counts.items()))
    for i, n in per_bucket.items():
        buckets[i].inc(n)


def counter_total(counter) -> float:
    """Sum of a (labelled) counter over all its children."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def outcome_counts(metrics: "PipelineMetrics") -> dict:
    """{applied, dead_lettered, skipped}: totals of this process so far (take one
    before a job and one after, and subtract)."""
    return {"applied": int(counter_total(metrics.changes_applied)),
            "dead_lettered": int(counter_total(metrics.dead_letters)),
            "skipped": int(counter_total(metrics.changes_skipped))}


def build_info() -> dict:
    """{version, python, apache_beam, google_cloud_bigtable}: this process's build."""
    return dict(_build_info())


@functools.lru_cache(maxsize=1)
def _build_info() -> tuple:
    """Read once per process: the installed packages' metadata does not change
    under a running job, and each DoFn instance's metrics ask for it."""
    import platform
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "unknown"

    return (("version", version("ddb2bt")), ("python", platform.python_version()),
            ("apache_beam", version("apache-beam")), ("google_cloud_bigtable", version("google-cloud-bigtable")))


# --- Pushgateway (Dataflow workers cannot be scraped) ------------------------------

PUSH_INTERVAL_S = 15.0
# The rules and panels (deploy/prometheus/alerts.yml, deploy/grafana) ignore a
# group not pushed for this long: 4 missed pushes, a worker that is gone.
PUSH_STALE_S = 60.0
DELETE_TIMEOUT_S = 1.0  # at exit: how long the last push and deleting the group may each take
_PUSHERS: dict = {}
_PUSHERS_LOCK = threading.Lock()


def grouping_key(worker: Optional[str] = None) -> dict:
    import os
    import socket

    return {"worker": worker or f"{socket.gethostname()}-{os.getpid()}"}


def start_pusher(url: str, job: str, registry: CollectorRegistry = REGISTRY, interval_s: float = PUSH_INTERVAL_S,
                 worker: Optional[str] = None) -> threading.Thread:
    """Push the process's metrics to a Prometheus Pushgateway every ``interval_s``,
    grouped by job and worker; one pusher per (url, job) per process. The
    group is deleted when the process exits normally (``stop_pushers``, also run
    by a command's stop on SIGTERM or Ctrl-C): a worker that is gone no longer
    speaks for the job. A group left behind (a SIGKILL, a lost VM) stops
    counting once it is PUSH_STALE_S old."""
    from prometheus_client import push_to_gateway

    key = (url, job)
    with _PUSHERS_LOCK:
        existing = _PUSHERS.get(key)
        if existing is not None and existing.is_alive():
            return existing
        group = grouping_key(worker)
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                try:
                    push_to_gateway(url, job=job, registry=registry, grouping_key=group, timeout=10)
                except Exception as exc:  # the job must not fail because monitoring is down
                    logging.getLogger(__name__).warning("push to %s failed: %s", url, type(exc).__name__)
                stop.wait(interval_s)

        thread = threading.Thread(target=loop, name="metrics-pusher", daemon=True)
        thread.stop = stop.set  # type: ignore[attr-defined]
        thread.group = (url, job, group)  # type: ignore[attr-defined]
        thread.start()
        if not _PUSHERS:
            import atexit

            atexit.register(stop_pushers)
        _PUSHERS[key] = thread
        return thread


def stop_pushers() -> None:
    """Stop this process's pushers and delete their groups from the gateway
    (quick: at most DELETE_TIMEOUT_S each; a gateway that does not answer leaves
    the group to go stale)."""
    from prometheus_client import delete_from_gateway

    with _PUSHERS_LOCK:
        pushers = list(_PUSHERS.values())
        _PUSHERS.clear()
    for thread in pushers:
        thread.stop()
        thread.join(DELETE_TIMEOUT_S)  # a push in flight would put the group back after its deletion
        url, job, group = thread.group
        try:
            delete_from_gateway(url, job=job, grouping_key=group, timeout=DELETE_TIMEOUT_S)
        except Exception as exc:  # exiting: monitoring being down must not keep the process
            logging.getLogger(__name__).debug("deleting the metrics group at %s failed: %s", url, type(exc).__name__)


_DEFAULT: Optional[PipelineMetrics] = None
_DEFAULT_LOCK = threading.Lock()


def default_metrics() -> PipelineMetrics:
    """The process-wide metrics on the default registry (what /metrics serves)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = PipelineMetrics()
        return _DEFAULT


def count_aws_call(api: str, table: Optional[str]) -> None:
    """One attempt of an AWS call in ``ddb2bt_aws_api_calls_total{table, api}``
    on the process's metrics: the counter the connections hand the DynamoDB
    client module (clients/dynamodb.count_calls_with). ``table``: the table's
    name in the job, never a key (docs/operations.md, Metrics)."""
    default_metrics().aws_api_calls.labels(table or UNNAMED_TABLE, api).inc()


def serve_metrics(port: Optional[int], host: str = "127.0.0.1") -> Optional[str]:
    """Serve Prometheus /metrics on ``host:port`` (0: a free port) in a daemon
    thread; returns the URL, or None when ``port`` is None or negative (the CLI's
    ``options.METRICS_OFF``: the face's constant, which this floor does not import)."""
    if port is None or port < 0:
        return None
    from prometheus_client import start_http_server

    default_metrics()
    try:
        server, _ = start_http_server(port, addr=host)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; the metrics port must be "
                          "free (choose another, or 0 for any free port)", "--metrics-port") from None
    url = f"http://{host}:{server.server_port}/metrics"
    logging.getLogger(__name__).info("metrics at %s", url)
    return url


# --- The way back (ddb2bt rollback, docs/rollback.md) ------------------------------------
# Its own block: the reverse job's lag and writes. Labels: the table's name in the
# job only (never a key or a value).


class RollbackMetrics:
    """The reverse job's metrics: ``ddb2bt_rollback_lag_seconds`` (how far behind
    Bigtable's changes DynamoDB is: now minus the commit time up to which every
    change is written back), the items written, the writes refused as stale (a
    newer version held) and the cells no item explains (not written back)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY, clock: Callable[[], float] = _wall_s) -> None:
        self._clock = clock
        self.applied_until = Gauge(f"{NAMESPACE}_rollback_applied_until_timestamp_seconds",
                                   "Commit time up to which every Bigtable change is written back to DynamoDB",
                                   ["table"], registry=registry)
        self.lag = Gauge(f"{NAMESPACE}_rollback_lag_seconds",
                         "Now minus the commit time up to which every Bigtable change is written back",
                         ["table"], registry=registry)
        self.written = Counter(f"{NAMESPACE}_rollback_items_written", "DynamoDB items the rollback wrote, by kind",
                               ["table", "kind"], registry=registry)
        self.stale = Counter(f"{NAMESPACE}_rollback_stale_writes",
                             "Rollback writes refused because DynamoDB held a newer version", ["table"],
                             registry=registry)
        self.unexplained = Counter(f"{NAMESPACE}_rollback_unexplained_cells",
                                   "Bigtable cells no item of an invertible rule reads back to (not written back)",
                                   ["table"], registry=registry)

    def applied_until_s(self, table: str, at_s: float) -> None:
        self.applied_until.labels(table).set(at_s)
        self.lag.labels(table).set(max(0.0, self._clock() - at_s))

    def wrote(self, table: str, puts: int, deletes: int, stale: int, unexplained: int) -> None:
        self.written.labels(table, "put").inc(puts)
        self.written.labels(table, "delete").inc(deletes)
        self.stale.labels(table).inc(stale)
        self.unexplained.labels(table).inc(unexplained)


_ROLLBACK: list = []


def rollback_metrics() -> RollbackMetrics:
    """The process-wide rollback metrics on the default registry."""
    with _DEFAULT_LOCK:
        if not _ROLLBACK:
            _ROLLBACK.append(RollbackMetrics())
        return _ROLLBACK[0]
