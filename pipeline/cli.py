"""``ddb2bt``: replicate a live DynamoDB table into Bigtable.

Run ``ddb2bt <command> --help`` for each command's options and examples.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from ddb2bt.transforms.errors import ConfigError, PermanentError
from ddb2bt.transforms.limits import DEFAULT_POLL_INTERVAL_S

log = logging.getLogger("ddb2bt")

EPILOG = """\
examples:
  ddb2bt demo                                    # everything local: emulators, writes, replication
  ddb2bt local up --detach && eval "$(ddb2bt local env)"
  ddb2bt create-table --mapping examples/product_catalog.yaml
  ddb2bt run --mapping examples/product_catalog.yaml --until-idle 5
  ddb2bt dlq list --mapping examples/product_catalog.yaml
  ddb2bt run --mapping m.yaml --runner=DataflowRunner --project=P --region=R --temp_location=gs://b/tmp
"""


STAGES = (("pipeline.stream", "source"), ("ddb2bt.pipeline.sink.sink", "sink"), ("ddb2bt.pipeline.cutover.backfill", "backfill"),
          ("transforms", "mapping"), ("ddb2bt.pipeline.cutover.phases", "migrate"), ("ddb2bt.pipeline.cutover.verify", "verify"),
          ("ddb2bt.pipeline.retry", "retry"), ("ddb2bt.pipeline.local.local_stack", "local"), ("ddb2bt.pipeline.metrics", "metrics"))


def stage_of(logger: str) -> str:
    for prefix, stage in STAGES:
        if logger.startswith(prefix):
            return stage
    return "cli" if logger.startswith("ddb2bt") else "other"


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with the pipeline stage that logged it."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname, "stage": stage_of(record.name),
               "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(level: str, fmt: str) -> None:
    import warnings

    # The Bigtable client warns on every connection to the emulator; say it once in our own log.
    warnings.filterwarnings("ignore", message="Connecting to Bigtable emulator")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Beam, gRPC and boto are chatty at INFO and may echo request details.
    for noisy in ("apache_beam", "botocore", "boto3", "urllib3", "google", "grpc", "werkzeug"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


# --- shared options --------------------------------------------------------------


def add_mapping_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--mapping", "-m", required=required, metavar="FILE",
                   help="mapping file (YAML): source table, target table, and how items become rows; "
                        "example:NAME takes a packaged example (see 'ddb2bt examples')")
    # Not --project: that is Beam's (the Dataflow job's project), passed through.
    p.add_argument("--bigtable-project", dest="project", metavar="PROJECT",
                   help="override the mapping's target.project")
    p.add_argument("--bigtable-instance", "--instance", dest="instance", metavar="INSTANCE",
                   help="override the mapping's target.instance")
    p.add_argument("--bigtable-table", "--table", dest="table", metavar="TABLE",
                   help="override the mapping's target.table")


def add_state_args(p: argparse.ArgumentParser) -> None:
    from ddb2bt.pipeline.state import DEFAULT_STATE_TABLE

    p.add_argument("--state-table", default=DEFAULT_STATE_TABLE,
                   help="Bigtable table for checkpoints and dead letters, created on first use (default %(default)s)")
    p.add_argument("--job-name", help="name under which state is kept (default: the mapping's name)")


def add_dlq_values_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dlq-include-values", action=argparse.BooleanOptionalAction, default=None,
                   help="store item images in dead letters, so they can be redriven (default: on for local "
                        "runs, off on Dataflow, where dead letters then keep keys only, redacted)")


def dlq_values(args) -> bool:
    from ddb2bt.pipeline.graph import is_local

    explicit = getattr(args, "dlq_include_values", None)
    return is_local(args.beam_args) if explicit is None else explicit


def add_tail_args(p: argparse.ArgumentParser) -> None:
    """Options of the live tail (run and migrate)."""
    p.add_argument("--start", choices=("trim_horizon", "latest"), default="trim_horizon",
                   help="where shards without a checkpoint start (default %(default)s: the oldest record kept)")
    p.add_argument("--on-trimmed", choices=("fail", "restart"), default="fail",
                   help="if a checkpoint points at trimmed data (changes lost): stop (default) or restart "
                        "from the oldest record with a loud warning")
    p.add_argument("--until-idle", type=float, metavar="SECONDS",
                   help="stop once every shard has been at the stream head this long (tests, catch-up runs; "
                        "migrate: after the backfill, then phase LIVE)")
    p.add_argument("--poll-interval", type=float, default=DEFAULT_POLL_INTERVAL_S,
                   help="seconds between polls of an idle shard (default %(default)s: 4 GetRecords/s, "
                        "under the stream's 5/s per-shard limit)")
    p.add_argument("--discovery-interval", type=float, default=10.0, help="seconds between shard discoveries")
    p.add_argument("--partitions", type=int, default=1,
                   help="parallel readers; each owns a hash-partition of the shards (Dataflow: ~2 per worker)")
    p.add_argument("--new-stream", action="store_true",
                   help="accept that the table's stream was replaced since the last run (changes in between "
                        "are lost; prefer a new backfill)")
    add_dlq_values_arg(p)


def add_ops_args(p: argparse.ArgumentParser) -> None:
    """One holder per job and give-up deadlines (run, migrate, backfill); see docs/NOTES-ops.md."""
    from ddb2bt.pipeline.lease import DEFAULT_RENEW_S, DEFAULT_TTL_S
    from ddb2bt.pipeline.retry import DEFAULT_DEADLINE_S

    g = p.add_argument_group("one running process per job, and deadlines")
    how = g.add_mutually_exclusive_group()
    how.add_argument("--take-over", action="store_true",
                     help="replace the process holding this job's lease: it stops before its next write, and this "
                          "one starts writing when the old lease expires (at most --lease-ttl)")
    how.add_argument("--standby", action="store_true",
                     help="if another process holds the job's lease, wait (applying nothing) and take over when "
                          "it stops or its lease expires")
    g.add_argument("--lease-ttl", type=float, default=DEFAULT_TTL_S, metavar="SECONDS",
                   help="how long the lease outlives its last renewal: a crashed holder is replaced after it "
                        "(default %(default)s)")
    g.add_argument("--lease-renew", type=float, default=DEFAULT_RENEW_S, metavar="SECONDS",
                   help="seconds between lease renewals (default %(default)s; at most 3/8 of --lease-ttl)")
    g.add_argument("--bigtable-deadline", type=float, default=DEFAULT_DEADLINE_S, metavar="SECONDS",
                   help="give up on a Bigtable call failing with retryable errors after this long and stop "
                        "(default %(default)s)")
    g.add_argument("--dynamodb-deadline", type=float, default=DEFAULT_DEADLINE_S, metavar="SECONDS",
                   help="give up on a DynamoDB / Streams call failing with retryable errors (throttling, 5xx, "
                        "unreachable) after this long and stop (default %(default)s)")


def acquire_lease(args, state, role: str):
    """Hold the job's ``role`` lease for this command, or raise LeaseHeld naming
    the holder; released when the command ends. Returns the LeaseSpec the
    DoFns fence their writes with (None for a dry run)."""
    from ddb2bt.pipeline import lease, signals
    from ddb2bt.pipeline.dataflow import option_value
    from ddb2bt.pipeline.graph import is_local

    for option in ("bigtable_deadline", "dynamodb_deadline"):
        value = getattr(args, option, None)
        if value is not None and not value > 0:
            raise ConfigError(f"must be a positive number of seconds, got {value:g}", "--" + option.replace("_", "-"))
    if getattr(args, "dry", False):
        return None
    try:
        options = lease.LeaseOptions(args.lease_ttl, args.lease_renew, lease.TAKE_OVER if args.take_over else
                                     lease.STANDBY if args.standby else lease.FAIL)
    except ValueError as exc:
        raise ConfigError(str(exc), "--lease-ttl/--lease-renew") from None
    dataflow_job = None
    if not is_local(args.beam_args):
        # On Dataflow the job holds the lease: its workers renew it under the job's name.
        dataflow_job = option_value(args.beam_args, "job_name")
        if not dataflow_job:
            base = re.sub(r"[^a-z0-9-]+", "-", f"ddb2bt-{state.job}".lower()).strip("-")[:40]
            dataflow_job = f"{base}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
            args.beam_args.append(f"--job_name={dataflow_job}")
    held, spec = lease.hold(state, role, options, command=args.command, dataflow_job=dataflow_job)
    if dataflow_job is None:
        signals.on_exit(held.release)
    log.info("holding the %s lease of job %s (%s)", role, state.job, spec.holder)
    return spec


def add_metrics_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address for /metrics (default loopback)")
    p.add_argument("--metrics-pushgateway", metavar="URL",
                   help="push metrics to this Prometheus Pushgateway every 15 s, grouped by job and worker "
                        "(for Dataflow, whose workers cannot be scraped)")


def load(args):
    from ddb2bt.transforms.config import load_mapping, mapping_from_text

    if args.mapping.startswith("gs://"):  # Flex Template launches read it from GCS
        from ddb2bt.pipeline.dataflow import read_text

        mapping = mapping_from_text(read_text(args.mapping), origin=args.mapping)
    else:
        from ddb2bt.pipeline.local.examples import resolve_mapping_path

        mapping = load_mapping(resolve_mapping_path(args.mapping))
    return mapping.with_overrides(args.project, args.instance, args.table)


def submitted(result, args) -> int:
    """After launching on a remote runner: say what was launched (or dry-run)."""
    job = getattr(result, "job", None)
    if job is not None and getattr(job, "proto", None) is not None:
        kind = "streaming" if job.proto.type == 2 else "batch"
        print(f"{'dry run: built' if args.dry else 'launched'} {kind} job {job.proto.name or ''} "
              f"{job.proto.id or ''}".rstrip())
    else:
        print("launched")
    return 0


def state_spec(args, mapping, include_values: bool = True):
    from ddb2bt.pipeline.connections import BigtableSpec, StateSpec
    from ddb2bt.pipeline.retry import READ_ONLY_DEADLINE_S

    # Jobs give up after --bigtable-deadline; read-only commands answer within ~30 s.
    deadline = getattr(args, "bigtable_deadline", READ_ONLY_DEADLINE_S)
    return StateSpec(BigtableSpec(mapping.target.project, mapping.target.instance, mapping.target.app_profile,
                                  interceptors=tuple(getattr(args, "bigtable_interceptors", ())),
                                  deadline_s=deadline),
                     job=args.job_name or mapping.name, table=args.state_table, include_values=include_values)


# --- commands --------------------------------------------------------------------


def cmd_validate(args) -> int:
    mapping = load(args)
    rules = ", ".join(r.name for r in mapping.rules)
    print(f"OK: {args.mapping}: {mapping.source.table} → {mapping.target.project}/{mapping.target.instance}/"
          f"{mapping.target.table}; families {', '.join(sorted(mapping.family_names))}; rules {rules}")
    return 0


def cmd_explain(args) -> int:
    from ddb2bt.transforms.attrs import from_plain, item_from_dynamodb_json, type_of
    from ddb2bt.transforms.errors import MappingError
    from ddb2bt.transforms.mapping import map_change
    from ddb2bt.transforms.model import INSERT, REMOVE, ChangeRecord, SetCell

    mapping = load(args)
    raw = json.loads(Path(args.item).read_text() if args.item != "-" else sys.stdin.read())
    try:
        item = item_from_dynamodb_json(raw)
        for v in item.values():
            type_of(v)
    except Exception:
        item = {k: from_plain(v) for k, v in raw.items()}
    keys = {k: item[k] for k in mapping.source.key_attributes if k in item}
    ts = args.timestamp_ms
    for event, new, old in ((INSERT, item, None), (REMOVE, None, item)):
        print(f"== {event} at {ts} ms")
        try:
            changes = map_change(mapping, ChangeRecord(event, keys, new, old, ts))
        except MappingError as exc:
            print(f"  dead letter [{exc.reason}]: {exc.message}")
            continue
        if not changes:
            print("  (skipped by the mapping)")
        for ch in changes:
            print(f"  table {ch.table} row {ch.row_key!r}")
            for m in ch.mutations:
                if isinstance(m, SetCell):
                    print(f"    set    {m.family}:{m.qualifier.decode('utf-8', 'replace')} = {m.value[:80]!r} @{m.timestamp_ms}")
                else:
                    print(f"    delete {m.family}:{m.qualifier.decode('utf-8', 'replace')} in [{m.start_ms}, {m.end_ms}) ms")
    return 0


def cmd_lint(args) -> int:
    from ddb2bt.transforms.lint import WARN, lint

    mapping = load(args)
    items = None
    if args.sample:
        from ddb2bt.pipeline.connections import dynamodb_client

        from ddb2bt.pipeline.dynamodb import scan_items

        items = list(scan_items(dynamodb_client(mapping.source.region), mapping.source.table, limit=args.sample,
                                consistent_read=False))
    findings = lint(mapping, items)
    for f in findings:
        print(f)
    warnings = sum(1 for f in findings if f.level == WARN)
    print(f"{warnings} warning(s), {len(findings) - warnings} note(s)")
    return 1 if warnings and args.strict else 0


def cmd_create_table(args) -> int:
    from ddb2bt.pipeline.sink.bigtable_io import ensure_mapping_table
    from ddb2bt.pipeline.preflight import ensure_state_table

    mapping = load(args)
    changes = ensure_mapping_table(mapping)
    changes += [f"state: {c}" for c in ensure_state_table(mapping.target.project, mapping.target.instance,
                                                            args.state_table)]
    for line in changes or ["nothing to do: tables and families already match the mapping"]:
        print(line)
    return 0


def start_metrics_server(port: Optional[int], host: str) -> Optional[str]:
    if port is None:
        return None
    from prometheus_client import start_http_server

    from ddb2bt.pipeline.metrics import default_metrics

    default_metrics()
    server, _ = start_http_server(port, addr=host)
    url = f"http://{host}:{server.server_port}/metrics"
    log.info("metrics at %s", url)
    return url


def build_live_job(args, mapping):
    from ddb2bt.pipeline.connections import StreamsClientFactory, dynamodb_client
    from ddb2bt.pipeline.graph import LiveJob, is_local
    from ddb2bt.pipeline.cutover.phases import PhaseMarking
    from ddb2bt.pipeline.preflight import check_target, ensure_state_table, resolve_stream
    from ddb2bt.pipeline.source.stream_source import ReaderOptions

    from ddb2bt.pipeline.preflight import check_stream_continuity

    source = resolve_stream(mapping, dynamodb_client(mapping.source.region))
    warning = check_target(mapping)
    if warning:
        log.warning(warning)
    ensure_state_table(mapping.target.project, mapping.target.instance, args.state_table)
    check_stream_continuity(state_spec(args, mapping).store(), source.stream_arn, args.new_stream)
    state = state_spec(args, mapping, dlq_values(args))
    from ddb2bt.pipeline.lease import TAIL

    lease = acquire_lease(args, state, TAIL)
    reader = ReaderOptions(
        start=args.start, on_trimmed=args.on_trimmed, poll_interval_s=args.poll_interval,
        discovery_interval_s=args.discovery_interval, until_idle_s=args.until_idle,
        sleep_when_idle=is_local(args.beam_args), lease=lease, retry=dynamodb_retry(args),
    )
    # Every tail watches the migration phase: a `ddb2bt backfill` started next to a
    # running `ddb2bt run` needs its changes marked just as `migrate`'s own tail.
    return LiveJob(mapping=mapping, stream_arn=source.stream_arn, reader=reader, state=state,
                   partitions=args.partitions, sink=_sink_config(args, lease), client_factory=StreamsClientFactory(mapping.source.region),
                   marking=PhaseMarking(state), pushgateway=getattr(args, "metrics_pushgateway", None))


def cmd_run(args) -> int:
    from ddb2bt.pipeline.graph import is_local, make_pipeline
    from ddb2bt.pipeline.io import ReplicateToBigtable

    mapping = load(args)
    job = build_live_job(args, mapping)
    start_metrics_server(args.metrics_port, args.metrics_host)
    log.info("replicating %s (%s) → %s/%s/%s, %d partition(s), start=%s%s", mapping.source.table,
             job.stream_arn.rsplit("/", 1)[-1], mapping.target.project, mapping.target.instance,
             mapping.target.table, job.partitions, job.reader.start,
             f", until idle {args.until_idle}s" if args.until_idle else "")
    p = make_pipeline(args.beam_args)
    p | "ReplicateToBigtable" >> ReplicateToBigtable.from_job(job)
    result = p.run()
    if not is_local(args.beam_args):
        return submitted(result, args)  # a streaming job runs on; drain it to stop
    result.wait_until_finish()
    log.info("pipeline finished: %s", getattr(result, "state", "DONE"))
    return 0


# --- backfill, migrate, verify, status -------------------------------------------------

RETENTION_MARGIN_MS = 3600 * 1000  # an export must leave the tail an hour of stream to spare
TAIL_STOP_WAIT_S = 60.0
DAY_MS = 24 * 3600 * 1000


def watch(worker, total: Optional[int], desc: str, value) -> None:
    """Show a progress bar (items/s and ETA) while ``worker`` runs; in logs (not a
    terminal) a line every few seconds."""
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    with tqdm(total=total or None, unit="item", desc=desc, dynamic_ncols=True, file=sys.stderr,
              mininterval=0.5 if tty else 10.0) as bar:
        while worker.is_alive():
            worker.join(0.5)
            bar.n = int(value())
            bar.update(0)
        bar.n = int(value())
        bar.refresh()
    worker.check()


def backfill_source(args, mapping):
    """(source, spec dict, handoff ms or None, expected items)."""
    from ddb2bt.pipeline.cutover.backfill import ExportSource, ScanSource
    from ddb2bt.pipeline.connections import dynamodb_client

    if args.from_export:
        source = ExportSource(args.from_export, mapping.source.region)
        handoff = source.export_time_ms()
        age = time.time_ns() // 1_000_000 - handoff
        if age > DAY_MS - RETENTION_MARGIN_MS:
            raise ConfigError(
                f"the export is {age / 3600000:.1f}h old: the stream keeps 24h, so changes made since the export "
                "may already be trimmed. Take a new export, or back-fill with a scan (no --from-export)",
                "--from-export")
        parts = source.parts()
        return source, {"kind": "export", "location": args.from_export, "parts": len(parts)}, handoff, \
            source.item_count()
    if not 1 <= args.page_size <= 10_000:
        raise ConfigError("must be between 1 and 10000", "--page-size")
    source = ScanSource(mapping.source.table, args.segments, mapping.source.region, args.consistent_read,
                        args.max_rcu, args.page_size)
    count = dynamodb_client(mapping.source.region).describe_table(TableName=mapping.source.table)["Table"].get(
        "ItemCount", 0)
    return source, {"kind": "scan", "segments": args.segments, "parts": args.segments}, None, int(count)


def run_backfill(args, mapping, spec, marking_wait=True) -> Optional[int]:
    from ddb2bt.pipeline.cutover.backfill import BackfillJob, add_backfill
    from ddb2bt.pipeline.connections import DynamoDBClientFactory
    from ddb2bt.pipeline.graph import is_local, make_pipeline
    from ddb2bt.pipeline.metrics import counter_total as _counter_total, default_metrics
    from ddb2bt.pipeline.cutover.phases import Migration, Worker

    from ddb2bt.pipeline.lease import BACKFILL

    lease = acquire_lease(args, spec, BACKFILL)
    store = spec.store()
    migration = Migration(store)
    source, source_spec, export_time, expected = backfill_source(args, mapping)
    handoff = migration.resume_or_begin(source_spec, args.restart, export_time,
                                        sleep=time.sleep if marking_wait else (lambda s: None))
    store.save_meta("backfill_expected", str(expected))
    metrics = default_metrics()
    metrics.backfill_expected.set(expected)
    log.info("backfill of %s from %s, handoff %d (cells at %d ms)", mapping.source.table, source_spec["kind"],
             handoff, handoff - handoff % 1000 - 1)
    job = BackfillJob(source, mapping.source.key_attributes, handoff, tasks=args.tasks)

    def build(p) -> None:
        add_backfill(p, job, mapping, spec, _sink_config(args, lease), DynamoDBClientFactory(mapping.source.region),
                     reshuffle=not is_local(args.beam_args), pushgateway=getattr(args, "metrics_pushgateway", None))

    if not is_local(args.beam_args):
        # On Dataflow the backfill is a batch job; the tail's workers move the
        # phase to CATCHING_UP once every part is done (see PhaseMarking).
        p = make_pipeline(args.beam_args, streaming=False)
        build(p)
        return submitted(p.run(), args)

    def pipeline() -> None:
        p = make_pipeline(args.beam_args)
        build(p)
        p.run().wait_until_finish()

    start = _counter_total(metrics.backfill_items)
    worker = Worker("backfill", pipeline)
    worker.start()
    watch(worker, expected, "backfill", lambda: _counter_total(metrics.backfill_items) - start)
    migration.finish_backfill()
    return None


def _sink_config(args=None, lease=None):
    from ddb2bt.pipeline.retry import RetryPolicy
    from ddb2bt.pipeline.sink.sink import SinkConfig

    if args is None or not hasattr(args, "bigtable_deadline"):
        return SinkConfig(lease=lease)
    return SinkConfig(lease=lease, retry=replace_deadline(RetryPolicy(), args.bigtable_deadline,
                                                          "--bigtable-deadline"))


def dynamodb_retry(args):
    from ddb2bt.pipeline.source.stream_source import ReaderOptions

    return replace_deadline(ReaderOptions.retry, getattr(args, "dynamodb_deadline", None))


def replace_deadline(policy, deadline_s, option: str = "--dynamodb-deadline"):
    from dataclasses import replace

    if deadline_s is not None and not deadline_s > 0:
        raise ConfigError(f"must be a positive number of seconds, got {deadline_s:g}", option)
    return policy if deadline_s is None else replace(policy, deadline_s=deadline_s)


def cmd_backfill(args) -> int:
    from ddb2bt.pipeline.preflight import check_target, ensure_state_table

    mapping = load(args)
    warning = check_target(mapping)
    if warning:
        log.warning(warning)
    ensure_state_table(mapping.target.project, mapping.target.instance, args.state_table)
    start_metrics_server(args.metrics_port, args.metrics_host)
    launched = run_backfill(args, mapping, state_spec(args, mapping, dlq_values(args)))
    if launched is not None:
        return launched
    print("backfill complete; phase CATCHING_UP: keep the live tail running (ddb2bt run) and check ddb2bt status")
    return 0


def cmd_migrate(args) -> int:
    from ddb2bt.pipeline.graph import add_live_replication, is_local, make_pipeline
    from ddb2bt.pipeline.metrics import default_metrics
    from ddb2bt.pipeline.cutover.phases import BACKFILLING, LIVE, Migration, Worker
    from dataclasses import replace

    import uuid

    from ddb2bt.pipeline.source.stream_source import request_stop

    mapping = load(args)
    job = build_live_job(args, mapping)
    spec = job.state
    migration = Migration(spec.store())
    stop_token = uuid.uuid4().hex
    job = replace(job, reader=replace(job.reader, stop_token=stop_token))
    start_metrics_server(args.metrics_port, args.metrics_host)
    metrics = default_metrics()

    def tail() -> None:
        p = make_pipeline(args.beam_args)
        add_live_replication(p, job)
        p.run().wait_until_finish()

    phase = migration.phase
    log.info("migrate %s → %s: phase %s", mapping.source.table, mapping.target.table, phase or "new")
    if not is_local(args.beam_args):
        return launch_migrate(args, mapping, job, migration)
    tail_worker = Worker("tail", tail)
    tail_worker.start()  # the tail first: changes after the handoff are never missed
    try:
        if phase in (None, BACKFILLING):
            run_backfill(args, mapping, spec)
        tail_worker.check()
    except BaseException:
        # Stop the tail cleanly (what it read is written and checkpointed), then fail.
        request_stop(stop_token)
        tail_worker.join(TAIL_STOP_WAIT_S)
        raise
    if args.until_idle is not None:
        tail_worker.join()
        tail_worker.check()
        # One more pass until idle after the backfill: the tail may have gone idle
        # (and ended) while the backfill was still running.
        final = Worker("tail-catch-up", tail)
        final.start()
        final.join()
        final.check()
        migration.set_phase(LIVE)
        print("migration LIVE (tail idle); verify with: ddb2bt verify --mapping", args.mapping)
        return 0
    while tail_worker.is_alive() and metrics.lag.max_lag_seconds() > 0:
        tail_worker.join(1.0)
    tail_worker.check()
    if migration.phase != LIVE:
        migration.set_phase(LIVE)
    print("migration LIVE; the tail keeps running (Ctrl-C stops it; a restart resumes)")
    tail_worker.join()
    tail_worker.check()
    return 0


def launch_migrate(args, mapping, job, migration) -> int:
    """Dataflow: ONE streaming job with the tail and the backfill side by side.
    The handoff is fixed here, before launch; the workers' PhaseMarking moves
    BACKFILLING → CATCHING_UP when every part is done, and the readers move
    CATCHING_UP → LIVE once at the stream head."""
    from dataclasses import replace

    from ddb2bt.pipeline.cutover.backfill import BackfillJob, add_backfill
    from ddb2bt.pipeline.connections import DynamoDBClientFactory
    from ddb2bt.pipeline.graph import add_live_replication, make_pipeline
    from ddb2bt.pipeline.cutover.phases import BACKFILLING
    from ddb2bt.pipeline.lease import BACKFILL

    p = make_pipeline(args.beam_args, streaming=True)
    job = replace(job, reader=replace(job.reader, promote_live=True))
    add_live_replication(p, job)
    if migration.phase in (None, BACKFILLING):
        source, source_spec, export_time, expected = backfill_source(args, mapping)
        sleep = (lambda s: None) if args.dry else time.sleep
        handoff = migration.resume_or_begin(source_spec, args.restart, export_time, sleep=sleep)
        migration.store.save_meta("backfill_expected", str(expected))
        add_backfill(p, BackfillJob(source, mapping.source.key_attributes, handoff, tasks=args.tasks), mapping,
                     job.state, _sink_config(args, acquire_lease(args, job.state, BACKFILL)),
                     DynamoDBClientFactory(mapping.source.region), reshuffle=True,
                     pushgateway=job.pushgateway)
    return submitted(p.run(), args)


def cmd_verify(args) -> int:
    from ddb2bt.pipeline.sink.bigtable_io import read_rows, read_table
    from ddb2bt.pipeline.connections import dynamodb_client
    from ddb2bt.pipeline.cutover.phases import Worker
    from ddb2bt.pipeline.preflight import ensure_state_table
    from ddb2bt.pipeline.cutover.verify import print_report, verify

    mapping = load(args)
    if not 0 < args.sample_rate <= 1:
        raise ConfigError("must be in (0, 1]", "--sample-rate")
    from ddb2bt.pipeline.sink.bigtable_io import probe_bigtable

    probe_bigtable()  # before scanning the source: an unreachable target fails verify in ~25 s
    ddb = dynamodb_client(mapping.source.region)
    t = mapping.target
    expected = ddb.describe_table(TableName=mapping.source.table)["Table"].get("ItemCount", 0)
    scanned = [0]
    result: list = []

    def run() -> None:
        result.append(verify(mapping, ddb, lambda table: read_table(t.project, t.instance, table),
                             lambda table, keys: read_rows(t.project, t.instance, table, keys),
                             segments=args.segments, sample_rate=args.sample_rate,
                             consistent=not args.eventually_consistent, show_values=args.show_values,
                             on_page=lambda n: scanned.__setitem__(0, scanned[0] + n)))

    worker = Worker("verify", run)
    worker.start()
    watch(worker, expected, "verify", lambda: scanned[0])
    report = result[0]
    print_report(report)
    if args.report:
        Path(args.report).write_text(json.dumps(report.to_json(), indent=2, ensure_ascii=False))
    ensure_state_table(t.project, t.instance, args.state_table)
    summary = {k: v for k, v in report.to_json().items() if k != "tables"}
    state_spec(args, mapping).store().save_meta("verify", json.dumps(summary))
    return 0 if report.identical else 1


def cmd_status(args) -> int:
    from ddb2bt.pipeline.connections import StreamsClientFactory, dynamodb_client
    from ddb2bt.pipeline.cutover.status import assess, gather, render

    mapping = load(args)
    arn = None
    try:
        arn = dynamodb_client(mapping.source.region).describe_table(
            TableName=mapping.source.table)["Table"].get("LatestStreamArn")
    except Exception as exc:  # status must work even when the source is unreachable
        log.warning("cannot describe %s: %s", mapping.source.table, exc)
    facts = gather(state_spec(args, mapping).store(), StreamsClientFactory(mapping.source.region)(), arn)
    ready, reasons = assess(facts)
    if args.json:
        print(json.dumps({"ready": ready, "reasons": reasons, "phase": facts.phase, "handoff_ms": facts.handoff_ms,
                          "dead_letters": facts.dead_letters, "last_verify": facts.last_verify,
                          "shards": [vars(s) for s in facts.shards]}, indent=2))
    else:
        for line in render(facts):
            print(line)
    return 0 if ready else 1


def cmd_dlq_list(args) -> int:
    mapping = load(args)
    store = state_spec(args, mapping).store()
    since = int(args.since * 1000) if args.since is not None else None
    letters = store.list_dead_letters(reason=args.reason, since_ms=since)
    if args.json:
        for entry in letters[: args.limit]:
            print(json.dumps(entry, ensure_ascii=False))
        return 0
    by_reason: dict = {}
    for entry in letters:
        by_reason[entry.get("reason", "?")] = by_reason.get(entry.get("reason", "?"), 0) + 1
    print(f"{len(letters)} dead letter(s)" + (": " + ", ".join(f"{r} {n}" for r, n in sorted(by_reason.items()))
                                              if letters else ""))
    for entry in letters[: args.limit]:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(entry.get("failed_at_ms", "0")) / 1000))
        print(f"  {when}  {entry.get('reason')}  [{entry.get('stage')}] {entry.get('message')}  "
              f"(at {entry.get('position', 'n/a')})")
    return 0


def cmd_dlq_show(args) -> int:
    mapping = load(args)
    letters = [e for e in state_spec(args, mapping).store().list_dead_letters() if e["id"] == args.id]
    if not letters:
        print(f"no dead letter {args.id}", file=sys.stderr)
        return 1
    entry = dict(letters[0])
    entry["record"] = json.loads(entry["record"])
    print(json.dumps(entry, indent=2, ensure_ascii=False))
    return 0


def cmd_dlq_redrive(args) -> int:
    """Re-apply dead letters with the current mapping and table, oldest first. Each
    change keeps its own timestamp, so a redriven old change can never override a
    newer one already applied (its cells are older; its deletes end at its time)."""
    from ddb2bt.pipeline.source.records import record_from_json
    from ddb2bt.pipeline.sink.sink import BatchingWriter
    from ddb2bt.transforms.dofns import map_record

    mapping = load(args)
    spec = state_spec(args, mapping)
    store = spec.store()
    since = int(args.since * 1000) if args.since is not None else None
    letters = store.list_dead_letters(reason=args.reason, since_ms=since)
    writer = spec.bigtable.writer()
    # No state store: a redrive must not move the stream checkpoints.
    batcher = BatchingWriter(writer, None, _sink_config())
    fixed, still, skipped = [], 0, 0
    try:
        for entry in letters:  # ids sort by failure time: stream order per shard
            record = record_from_json(entry["record"])
            if record.new_image is None and record.old_image is None and record.event_name != "REMOVE":
                skipped += 1  # stored without values (--no-dlq-include-values): nothing to re-apply
                continue
            mapped = map_record(mapping, record, lambda: time.time_ns() // 1_000_000)
            if mapped.dead_letter is not None:
                still += 1
                continue
            if args.dry_run:
                fixed.append(entry["id"])
                continue
            batcher.add(mapped)
            if batcher.flush():
                still += 1
            else:
                fixed.append(entry["id"])
        if not args.dry_run:
            store.delete_dead_letters(fixed)
    finally:
        writer.close()
    verb = "would re-apply" if args.dry_run else "re-applied"
    print(f"{verb} {len(fixed)} dead letter(s); {still} still failing (kept); {skipped} without stored values "
          "(kept: re-read the item from DynamoDB or back-fill)")
    return 0 if still == 0 else 1


def cmd_local(args) -> int:
    from ddb2bt.pipeline.local import local_stack as ls

    if args.local_cmd == "env":
        state = ls.load_state()
        if state is None:
            print("# no local stack is running; start one with: ddb2bt local up --detach", file=sys.stderr)
            return 1
        for k, v in state["env"].items():
            print(f"export {k}={v}")
        return 0
    if args.local_cmd == "down":
        stopped = ls.stop_detached()
        print("local stack stopped" if stopped else "no local stack was running")
        return 0
    stack = ls.LocalStack(log_dir=Path(".ddb2bt/logs"))
    if args.local_cmd == "run":
        command = [c for c in args.command if c != "--"]
        if not command:
            raise ConfigError("give a command after --, e.g. ddb2bt local run -- pytest", "command")
        with stack:
            env = dict(os.environ)
            env.update(stack.env())
            return subprocess.call(command, env=env)
    # up
    if args.detach:
        stack.start()
        ls.save_state(stack)
        # Detach: the servers live in their own sessions; forget them here.
        stack._procs.clear()
        print("local stack running; use it with:  eval \"$(ddb2bt local env)\"   stop it with: ddb2bt local down")
        return 0
    with stack:
        for k, v in stack.env().items():
            print(f"export {k}={v}")
        print("# local stack running; Ctrl-C stops it", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


def cmd_demo(args) -> int:
    from ddb2bt.pipeline.local.demo import run_demo

    return run_demo(args)


def cmd_examples(args) -> int:
    from ddb2bt.pipeline.local.examples import EXAMPLE_PREFIX, copy_examples, example_names, example_path

    if args.copy:
        copied = copy_examples(Path(args.copy))
        print(f"copied {len(copied)} example mapping(s) to {args.copy}"
              + (" (existing files kept)" if len(copied) < len(example_names()) else ""))
        return 0
    for name in example_names():
        print(f"{EXAMPLE_PREFIX}{name}\t{example_path(name)}")
    return 0


# --- parser ----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddb2bt", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Replicate a live DynamoDB table into Cloud Bigtable (change data capture on Apache Beam).",
        epilog=EPILOG)
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    parser.add_argument("--log-format", default="text", choices=("text", "json"),
                        help="json: one JSON object per line, for log collectors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    raw = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("examples", help="list the example mappings that ship with ddb2bt, or copy them",
                       formatter_class=raw, description=(
                           "Lists the packaged example mappings (one per seed layout) with their paths. Any "
                           "--mapping option accepts example:NAME for one of them; --copy DIR copies them all "
                           "into DIR to edit."),
                       epilog="examples:\n  ddb2bt examples\n  ddb2bt explain -m example:product_catalog --item -\n"
                              "  ddb2bt examples --copy ./mappings")
    p.add_argument("--copy", metavar="DIR", help="copy every example into DIR (existing files are kept)")
    p.set_defaults(func=cmd_examples)

    p = sub.add_parser("demo", help="run everything locally: emulators, a changing table, live replication",
                       formatter_class=raw, description=(
                           "Starts cbtemulator and moto on 127.0.0.1, creates the ProductCatalog table with a "
                           "stream, writes a realistic stream of changes while the pipeline replicates them on "
                           "the local runner, shows progress and lag, and ends with a summary and a row read "
                           "back from Bigtable. Needs no cloud account."),
                       epilog="example:\n  ddb2bt demo --changes 2000 --rate 300")
    p.add_argument("--changes", type=int, default=1500, help="changes to write (default %(default)s)")
    p.add_argument("--items", type=int, default=300, help="distinct products (default %(default)s)")
    p.add_argument("--rate", type=float, default=250.0, help="target writes per second (default %(default)s)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--metrics-port", type=int, default=0, help="serve /metrics here (0: a free port; -1: off)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("validate", help="check a mapping file", formatter_class=raw,
                       epilog="example:\n  ddb2bt validate --mapping examples/product_catalog.yaml")
    add_mapping_args(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("explain", help="show the row key and cells a mapping produces for an item",
                       formatter_class=raw,
                       epilog="example:\n  echo '{\"pk\":\"hats\",\"sk\":\"fedoras#brandA\",\"Price\":30}' | "
                              "ddb2bt explain -m examples/product_catalog.yaml --item -")
    add_mapping_args(p)
    p.add_argument("--item", required=True, help="item file: DynamoDB JSON or plain JSON ('-' for stdin)")
    p.add_argument("--timestamp-ms", type=int, default=1_700_000_000_000, help="change time to show")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("lint", help="check a mapping against Bigtable's rules and schema best practices",
                       formatter_class=raw, description=(
                           "Reports timestamp-first or sequential keys (hotspots), keys and qualifiers near the "
                           "limits, families whose GC would drop versions or that mix retention needs, "
                           "attributes that look like personal data in row keys, and — with --sample — items "
                           "that match no rule or cannot be mapped."),
                       epilog="examples:\n  ddb2bt lint -m examples/hr_orders.yaml\n"
                              "  ddb2bt lint -m m.yaml --sample 1000 --strict")
    add_mapping_args(p)
    p.add_argument("--sample", type=int, default=0, metavar="N", help="also check N items scanned from the table")
    p.add_argument("--strict", action="store_true", help="exit 1 when there are warnings")
    p.set_defaults(func=cmd_lint)

    p = sub.add_parser("create-table", help="create or update the Bigtable table (and the state table)",
                       formatter_class=raw, description=(
                           "Idempotent: creates the target table with the mapping's families and GC policies, "
                           "adds missing families, updates changed GC policies, and creates the state table."),
                       epilog="example:\n  ddb2bt create-table --mapping examples/product_catalog.yaml")
    add_mapping_args(p)
    add_state_args(p)
    p.set_defaults(func=cmd_create_table)

    p = sub.add_parser("run", help="replicate the live stream (Beam job)", formatter_class=raw, description=(
        "Reads the source table's DynamoDB stream and applies every change to Bigtable. Resumes from the "
        "checkpoints in the state table when there are any. Unrecognised options go to Beam: locally the "
        "job uses the pure-Python FnApiRunner; pass --runner=DataflowRunner and the usual Dataflow options "
        "for production."),
        epilog="examples:\n  ddb2bt run -m examples/product_catalog.yaml --until-idle 5\n"
               "  ddb2bt run -m m.yaml --metrics-port 9464\n"
               "  ddb2bt run -m m.yaml --runner=DataflowRunner --project=P --region=us-central1 "
               "--temp_location=gs://bucket/tmp")
    add_mapping_args(p)
    add_state_args(p)
    add_tail_args(p)
    add_metrics_args(p)
    add_ops_args(p)
    p.set_defaults(func=cmd_run, beam=True)

    def add_backfill_args(p) -> None:
        p.add_argument("--segments", type=int, default=8, help="parallel Scan segments (default %(default)s)")
        p.add_argument("--tasks", type=int, default=1,
                       help="Beam elements the parts are spread over (Dataflow: about the worker count)")
        p.add_argument("--max-rcu", type=float, help="read budget in capacity units per second (whole job)")
        p.add_argument("--consistent-read", action="store_true", help="strongly consistent Scan (2x the RCUs)")
        p.add_argument("--page-size", type=int, default=1000,
                       help="items per Scan page (smaller: finer resume points and a smoother read budget)")
        p.add_argument("--from-export", metavar="DIR_OR_S3",
                       help="back-fill from a DynamoDB export (the directory or s3://bucket/prefix holding "
                            "manifest-summary.json); its ExportTime is the handoff time")
        p.add_argument("--restart", action="store_true",
                       help="begin a new backfill (new handoff time) instead of resuming the one in progress")

    p = sub.add_parser("backfill", help="copy the existing table (parallel Scan or an export)", formatter_class=raw,
                       description=(
                           "Copies every item through the mapping with cells one millisecond older than the "
                           "handoff second, so changes streamed after it always win. Resumes per segment/file. "
                           "Run the live tail alongside (ddb2bt run), or use ddb2bt migrate for both."),
                       epilog="examples:\n  ddb2bt backfill -m m.yaml --segments 16 --max-rcu 2000\n"
                              "  ddb2bt backfill -m m.yaml --from-export s3://bucket/AWSDynamoDB/01234-abcd/")
    add_mapping_args(p)
    add_state_args(p)
    add_backfill_args(p)
    add_dlq_values_arg(p)
    add_metrics_args(p)
    add_ops_args(p)
    p.set_defaults(func=cmd_backfill, beam=True)

    p = sub.add_parser("migrate", help="the whole cutover: live tail + backfill + catch-up, resumable",
                       formatter_class=raw, description=(
                           "Starts the live tail, records the handoff time, back-fills alongside, and keeps "
                           "tailing. Phases BACKFILLING → CATCHING_UP → LIVE are stored in the state table "
                           "(ddb2bt status shows them); rerun the same command after a stop or crash and every "
                           "part resumes where it stopped."),
                       epilog="examples:\n  ddb2bt migrate -m m.yaml --segments 16 --metrics-port 9464\n"
                              "  ddb2bt migrate -m m.yaml --until-idle 5     # tests: stop once caught up")
    add_mapping_args(p)
    add_state_args(p)
    add_backfill_args(p)
    add_tail_args(p)
    add_metrics_args(p)
    add_ops_args(p)
    p.set_defaults(func=cmd_migrate, beam=True)

    p = sub.add_parser("verify", help="prove Bigtable equals the mapping of the DynamoDB table", formatter_class=raw,
                       description=(
                           "Reads the source (parallel Scan) and the target and reports missing rows, extra "
                           "rows, missing cells, cells no item owns (orphans) and differing cells, with a few "
                           "examples (values redacted unless --show-values). Exit code 0 only when identical."),
                       epilog="examples:\n  ddb2bt verify -m m.yaml --report verify.json\n"
                              "  ddb2bt verify -m m.yaml --sample-rate 0.01   # 1% of the items, by key hash")
    add_mapping_args(p)
    add_state_args(p)
    p.add_argument("--segments", type=int, default=8, help="parallel Scan segments")
    p.add_argument("--sample-rate", type=float, default=1.0, help="fraction of items to check (default: all)")
    p.add_argument("--show-values", action="store_true", help="show cell values in examples")
    p.add_argument("--eventually-consistent", action="store_true", help="cheaper, eventually consistent Scan")
    p.add_argument("--report", metavar="FILE.json", help="write the machine-readable report here")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("status", help="phase, lag, backfill progress, READY / NOT READY for cutover",
                       formatter_class=raw,
                       epilog="examples:\n  ddb2bt status -m m.yaml\n  ddb2bt status -m m.yaml --json\n"
                              "exit code: 0 READY, 1 NOT READY")
    add_mapping_args(p)
    add_state_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("dlq", help="inspect dead letters", formatter_class=raw,
                       epilog="examples:\n  ddb2bt dlq list -m examples/product_catalog.yaml\n"
                              "  ddb2bt dlq list -m m.yaml --reason row_key_too_long --json\n"
                              "  ddb2bt dlq show -m m.yaml 1700000000123#ab12cd34ef56\n"
                              "  ddb2bt dlq redrive -m m.yaml --reason unknown_family")
    dsub = p.add_subparsers(dest="dlq_cmd", required=True)
    pl = dsub.add_parser("list", help="list dead letters with their reasons")
    add_mapping_args(pl)
    add_state_args(pl)
    pl.add_argument("--reason", help="only this reason (e.g. unknown_family)")
    pl.add_argument("--since", type=float, help="only those at or after this Unix time (seconds)")
    pl.add_argument("--limit", type=int, default=50)
    pl.add_argument("--json", action="store_true", help="one JSON object per line")
    pl.set_defaults(func=cmd_dlq_list)
    ps = dsub.add_parser("show", help="one dead letter in full (the original record included)")
    add_mapping_args(ps)
    add_state_args(ps)
    ps.add_argument("id", help="the id printed by dlq list --json")
    ps.set_defaults(func=cmd_dlq_show)
    pr = dsub.add_parser("redrive", help="re-apply dead letters once the cause is fixed (e.g. the mapping)",
                         description="Re-applies stored dead letters, oldest first, with the current mapping; "
                                     "those that now succeed are removed, the others kept. Idempotent, and "
                                     "safe against newer changes: every change keeps its own timestamp.")
    add_mapping_args(pr)
    add_state_args(pr)
    pr.add_argument("--reason", help="only this reason")
    pr.add_argument("--since", type=float, help="only those at or after this Unix time (seconds)")
    pr.add_argument("--dry-run", action="store_true", help="only report which dead letters now map; write nothing")
    pr.set_defaults(func=cmd_dlq_redrive)

    p = sub.add_parser("local", help="the local emulator stack (cbtemulator + moto)", formatter_class=raw,
                       epilog="examples:\n  ddb2bt local up              # foreground, Ctrl-C stops\n"
                              "  ddb2bt local up --detach && eval \"$(ddb2bt local env)\"\n"
                              "  ddb2bt local run -- pytest tests/e2e\n  ddb2bt local down")
    lsub = p.add_subparsers(dest="local_cmd", required=True)
    up = lsub.add_parser("up", help="start both servers on free 127.0.0.1 ports")
    up.add_argument("--detach", action="store_true", help="keep running in the background")
    lsub.add_parser("env", help="print export lines for a detached stack")
    lsub.add_parser("down", help="stop a detached stack")
    run = lsub.add_parser("run", help="start the stack, run a command with its variables, stop it")
    run.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_local)
    return parser


def main(argv: Optional[list] = None, *, bigtable_interceptors: Sequence = ()) -> int:
    """The ``ddb2bt`` command. ``bigtable_interceptors`` (gRPC client interceptors for
    the Bigtable write channel) is for programs that embed the CLI, such as the
    fault-injection runner in ``ddb2bt.pipeline.testing``; the command line has no
    flag for it."""
    as_program = argv is None  # run as the ddb2bt program (not embedded with an argument list)
    if as_program:
        from ddb2bt.pipeline.signals import exit_quietly_on_interrupt

        exit_quietly_on_interrupt()
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "beam", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.beam_args = unknown
    args.bigtable_interceptors = tuple(bigtable_interceptors)
    from ddb2bt.pipeline.dataflow import is_dry_run  # not graph: that imports Beam

    args.dry = is_dry_run(unknown)
    setup_logging(args.log_level, args.log_format)
    from ddb2bt.pipeline.signals import run_command

    try:
        return run_command(lambda: args.func(args) or 0, enabled=getattr(args, "beam", False),
                           exit_when_interrupted=as_program)
    except ConfigError as exc:
        print(f"ddb2bt: configuration error: {exc}", file=sys.stderr)
        return 2
    except PermanentError as exc:
        print(f"ddb2bt: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ddb2bt: interrupted; state is checkpointed, run the same command to resume", file=sys.stderr)
        return 130
    except Exception as exc:  # a pipeline failure (Beam may wrap ours): one clear line, the detail in the log
        log.debug("failure", exc_info=True)
        print(f"ddb2bt: error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
              "(nothing after the last checkpoint was acknowledged; rerun to resume; --log-level DEBUG for "
              "details)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
