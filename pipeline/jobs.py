"""Typed job options built from a mapping and the parsed command line: the
state and sink settings, the live job, the lease, deadlines and the metrics
server. The CLI parses and prints; what a command needs to run is built here
(and the local demo uses the same pieces)."""
from __future__ import annotations

import logging
import re
import time
from typing import Optional

from ddb2bt.transforms.errors import ConfigError

log = logging.getLogger("ddb2bt")


def dlq_values(args) -> bool:
    from ddb2bt.pipeline.graph import is_local

    explicit = getattr(args, "dlq_include_values", None)
    return is_local(args.beam_args) if explicit is None else explicit


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


def start_metrics_server(port: Optional[int], host: str) -> Optional[str]:
    from ddb2bt.pipeline.metrics import serve_metrics

    return serve_metrics(port, host)


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


def report_outcome(counts: dict, mapping_arg: str) -> str:
    """The last line of a local run: what happened to the changes it read."""
    line = (f"done: {counts['applied']} change(s) applied, {counts['dead_lettered']} dead-lettered, "
            f"{counts['skipped']} skipped")
    if counts["dead_lettered"]:
        line += (f"\n  inspect the dead letters: ddb2bt dlq list --mapping {mapping_arg}"
                 f"\n  after fixing the mapping:  ddb2bt dlq redrive --mapping {mapping_arg}")
    return line


def backfill_options(args):
    from ddb2bt.pipeline.cutover.controller import BackfillOptions

    return BackfillOptions(segments=args.segments, tasks=args.tasks, max_rcu=args.max_rcu,
                           consistent_read=args.consistent_read, page_size=args.page_size,
                           from_export=args.from_export, restart=args.restart,
                           pushgateway=getattr(args, "metrics_pushgateway", None),
                           scan_retry=backfill_scan_retry(args))


def backfill_scan_retry(args):
    """The backfill's Scan pages give up after --dynamodb-deadline, like the tail."""
    from ddb2bt.pipeline.dynamodb import DEFAULT_READ_RETRY

    deadline = getattr(args, "dynamodb_deadline", None)
    return replace_deadline(DEFAULT_READ_RETRY, deadline) if deadline is not None else None


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


def with_backfill_lease(args, options, state):
    """The backfill's own lease (a backfill may run next to the job's tail)."""
    from dataclasses import replace

    from ddb2bt.pipeline.lease import BACKFILL

    return replace(options, sink=_sink_config(args, acquire_lease(args, state, BACKFILL)))
