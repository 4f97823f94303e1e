"""Typed job options built from a mapping and the parsed command line: the
state and sink settings, the live job, the lease, deadlines and the metrics
server. The CLI parses and prints; what a command needs to run is built here
(and the local demo uses the same pieces)."""
from __future__ import annotations

import logging
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from ddb2bt.transforms.errors import ConfigError
from ddb2bt.pipeline.clients.retry import READ_ONLY_DEADLINE_S, RetryPolicy
from ddb2bt.pipeline.clients.dynamodb import DEFAULT_READ_RETRY, list_shards
from ddb2bt.pipeline import signals
from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec, StreamsClientFactory, dynamodb_client, wall_ms
from ddb2bt.pipeline.connect.preflight import (check_app_profiles, check_stream_continuity, check_target,
                                               ensure_state_table, resolve_stream, settle_start)
from ddb2bt.pipeline.control.lease import TAIL, BACKFILL
from ddb2bt.pipeline.control.ownership import claim_targets
from ddb2bt.pipeline.control.phases import Migration, PhaseMarking, refuse_forward_after_cutover
from ddb2bt.pipeline.control.state import DEFAULT_STATE_TABLE
from ddb2bt.pipeline.control.mapping_change import change_notice, record_mapping
from ddb2bt.pipeline.dataflow import option_value, read_text
from ddb2bt.pipeline.local.examples import resolve_mapping_path
from ddb2bt.pipeline.observe.metrics import serve_metrics, default_metrics
from ddb2bt.pipeline.options import auto_partitions, AUTO_PARTITIONS
from ddb2bt.pipeline.source.kinesis import KinesisClientFactory, resolve_kinesis
from ddb2bt.pipeline.source.kinesis_share import check_shares, record_stream, table_shares, take_shares
from ddb2bt.pipeline.source.stream_source import ReaderOptions
from ddb2bt.transforms.config import load_mapping, mapping_from_text, check_distinct_tables

log = logging.getLogger("ddb2bt")


def dlq_values(args) -> bool:
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.graph import is_local

    explicit = getattr(args, "dlq_include_values", None)
    return is_local(args.beam_args) if explicit is None else explicit


def acquire_leases(args, states: list, role: str, taken: Optional[list] = None) -> list:
    """Each table's ``role`` lease (``acquire_lease``), all or none: if one is
    held elsewhere, the ones already taken are released before the error goes
    on, so a refused multi-table start leaves nothing held (on Dataflow a lease
    taken for a job that never launched would block a rerun until it expired).
    ``taken`` (a list) receives the held leases, for a caller that may still
    refuse the start after this."""
    taken = [] if taken is None else taken
    try:
        return [acquire_lease(args, state, role, taken) for state in states]
    except BaseException:
        for held in taken:
            held.release()
        raise


def acquire_lease(args, state, role: str, taken: Optional[list] = None):
    """Hold the job's ``role`` lease for this command, or raise LeaseHeld naming
    the holder; released when the command ends. Returns the LeaseSpec the
    DoFns fence their writes with (None for a dry run)."""
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.control import coordinator, lease
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
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
    held, spec = coordinator.hold(state, role, options, command=args.command, dataflow_job=dataflow_job)
    if taken is not None:
        taken.append(held)
    if dataflow_job is None:
        signals.on_exit(held.release)
    log.info("holding the %s lease of job %s (%s)", role, state.job, spec.holder)
    return spec


def claim_target_tables(args, mappings: list, states: list) -> None:
    """Before anything is written: each table the mappings write belongs to
    this job, or the command is refused naming the job that owns it
    (ddb2bt.pipeline.control.ownership; --adopt-target takes it over). Not for a dry run."""
    if getattr(args, "dry", False):
        return
    claim_targets(mappings, states, command=args.command, adopt=getattr(args, "adopt_target", False))


MAPPING_SUFFIXES = (".yaml", ".yml")


def mapping_sources(values) -> list:
    """The mapping files named by ``--mapping`` values, in order: a file, an
    ``example:NAME``, a directory (its *.yaml / *.yml files, sorted) or a gs://
    folder (ending in /: the same, through Beam's filesystems); a value may
    also be a comma-separated list (the Flex Template passes one). Refuses an
    empty directory and a file named twice."""
    out: list = []
    for value in values if isinstance(values, (list, tuple)) else [values]:
        for part in (v.strip() for v in str(value).split(",")):
            if not part:
                continue
            if part.startswith("gs://") and part.endswith("/"):
                from apache_beam.io.filesystems import FileSystems

                found = sorted(m.path for suffix in MAPPING_SUFFIXES
                               for m in FileSystems.match([part + "*" + suffix])[0].metadata_list)
                where = "gs:// folder"
            elif Path(part).is_dir():
                found = sorted(str(f) for f in Path(part).iterdir() if f.is_file() and f.suffix in MAPPING_SUFFIXES)
                where = "directory"
            else:
                out.append(part)
                continue
            if not found:
                raise ConfigError(f"the {where} {part} holds no mapping files (*.yaml, *.yml)", "--mapping")
            out.extend(found)
    if len(set(out)) != len(out):
        twice = sorted({f for f in out if out.count(f) > 1})
        raise ConfigError(f"named more than once: {', '.join(twice)}", "--mapping")
    return out


def _load_one(source: str):
    if source.startswith("gs://"):  # Flex Template launches read it from GCS
        return mapping_from_text(read_text(source), origin=source)

    return load_mapping(resolve_mapping_path(source))


def load_all(args) -> list:
    """Every mapping the command line names (one table each), overrides applied.
    Several mappings make one job of several tables: each needs its own name (its
    state key), source table and target tables, and the per-table overrides
    (--bigtable-table, --job-name) are refused."""
    sources = mapping_sources(args.mapping)
    if not sources:
        raise ConfigError("give at least one mapping file", "--mapping")
    mappings = [_load_one(s).with_overrides(args.project, args.instance, args.table) for s in sources]
    if len(mappings) > 1:
        if args.table:
            raise ConfigError(f"names one table but {len(mappings)} mappings are given; set target.table in each "
                              "mapping file instead", "--bigtable-table")
        if getattr(args, "job_name", None):
            raise ConfigError(f"names one job's state but {len(mappings)} mappings are given: each table's state "
                              "is kept under its mapping's name", "--job-name")
        check_distinct_tables(mappings, sources)
    return mappings


def load_sources(args) -> tuple:
    """For ``validate``: (mappings, [(file, ConfigError)]) — every file named
    is loaded, and a bad one does not stop the others from being checked; the
    good ones are then checked together like ``load_all``."""
    sources = mapping_sources(args.mapping)
    loaded, labels, bad = [], [], []
    for source in sources:
        try:
            loaded.append(_load_one(source).with_overrides(args.project, args.instance, args.table))
            labels.append(source)
        except ConfigError as exc:
            bad.append((source, exc))
    if len(sources) > 1 and args.table:
        raise ConfigError(f"names one table but {len(sources)} mappings are given; set target.table in each "
                          "mapping file instead", "--bigtable-table")
    if len(loaded) > 1:
        check_distinct_tables(loaded, labels)
    return loaded, bad


def load(args):
    """The one mapping of a command that takes one (explain, recover): a file,
    an example or a directory holding one file."""
    mappings = load_all(args)
    if len(mappings) > 1:
        files = ", ".join(m.origin for m in mappings)
        raise ConfigError(f"'{args.command}' takes one mapping, got {len(mappings)} ({files}): give the one "
                          "table's file (a directory must hold only it)", "--mapping")
    return mappings[0]


# The options that select WHICH state a command reads or writes (args attribute,
# option): a hint printed after a command must repeat every one that was given,
# or the suggested command looks at another job's state (e.g. 0 dead letters).
STATE_SELECTING = (("project", "--bigtable-project"), ("instance", "--bigtable-instance"),
                   ("table", "--bigtable-table"), ("state_table", "--state-table"), ("job_name", "--job-name"),
                   ("state_app_profile", "--state-app-profile"))


def mapping_flags(args, mappings: Optional[list] = None) -> str:
    """The --mapping options of this command line and every state-selecting
    option given (STATE_SELECTING; a default left out), quoted for a shell: what
    the hints printed after a command append, so they look at the same state.
    ``mappings`` replaces the --mapping values (a hint about one table of several)."""
    from shlex import quote

    values = mappings if mappings is not None else \
        args.mapping if isinstance(args.mapping, (list, tuple)) else [args.mapping]
    flags = [f"--mapping {quote(str(m))}" for m in values]
    for attribute, option in STATE_SELECTING:
        value = getattr(args, attribute, None)
        if value is None or (attribute == "state_table" and value == DEFAULT_STATE_TABLE):
            continue
        flags.append(f"{option} {quote(str(value))}")
    return " ".join(flags)


# Options that make a command start over rather than resume: left out of the
# command an interrupted run names to resume it (a `migrate --restart` resumed
# with --restart would copy the table again).
RESTARTING_OPTIONS = ("--restart", "--start")
RESTARTING_WITH_VALUE = ("--start",)


def resume_command(argv: list) -> str:
    """The command that resumes an interrupted ``ddb2bt`` command line: the
    same, without the options that start over (RESTARTING_OPTIONS)."""
    from shlex import join

    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in RESTARTING_OPTIONS:
            skip = name in RESTARTING_WITH_VALUE and "=" not in arg
            continue
        kept.append(arg)
    return "ddb2bt " + join(kept)


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


def partitions_following_shards(mapping, stream_arn: str, client_factory) -> int:
    """``--partitions auto``: from the stream's open shards now (one listing, through
    the source's own client: DynamoDB Streams or the Kinesis adapter)."""
    listing = list_shards(client_factory(), stream_arn)
    open_shards = len(listing.shards) - len(listing.closed_ids)
    partitions = auto_partitions(open_shards)
    log.info("%s: %d open shard(s): %d partition(s) (--partitions auto)", mapping.source.table, open_shards,
             partitions)
    return partitions


def check_profiles(args, mapping) -> None:
    """The app-profile preflight (``preflight.check_app_profiles``): refuses a
    state profile that cannot run CheckAndMutateRow, before anything is written."""
    note = check_app_profiles(mapping.target.project, mapping.target.instance, mapping.target.app_profile,
                              getattr(args, "state_app_profile", None))
    if note:
        log.debug(note)


def state_spec(args, mapping, include_values: bool = True):
    # Jobs give up after --bigtable-deadline; read-only commands answer within ~30 s.
    deadline = getattr(args, "bigtable_deadline", READ_ONLY_DEADLINE_S)
    return StateSpec(BigtableSpec(mapping.target.project, mapping.target.instance, mapping.target.app_profile,
                                  interceptors=tuple(getattr(args, "bigtable_interceptors", ())),
                                  deadline_s=deadline,
                                  state_app_profile=getattr(args, "state_app_profile", None)),
                     job=args.job_name or mapping.name, table=args.state_table, include_values=include_values)


def start_metrics_server(port: Optional[int], host: str) -> Optional[str]:
    return serve_metrics(port, host)


def recopy_tail(args) -> tuple:
    """(accept a replaced stream, on_trimmed) of the tail. A re-copy (`migrate
    --restart`, local: on Dataflow it is refused, controller.refuse_remote_recopy)
    copies the whole table again, so what a trimmed checkpoint or a replaced
    stream lost is restored by its backfill: its tail follows the new stream, and
    a trimmed shard goes on from the oldest record (docs/design.md §7.7), where a
    plain tail stops loudly."""
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.graph import is_local

    recopy = bool(getattr(args, "restart", False)) and is_local(args.beam_args)
    return bool(args.new_stream) or recopy, "restart" if recopy else args.on_trimmed


def build_live_jobs(args, mappings: list) -> list:
    """One LiveJob per mapping, for one job of them all. Every table is checked
    first — its stream exists and is NEW_AND_OLD_IMAGES, its target table
    exists, its stream is the one its checkpoints are for — so a bad table is
    refused, named, before any lease is taken or anything is written; then each
    table's lease is taken (per table: another process replicating one of them
    is refused, naming it)."""
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.graph import LiveJob, is_local
    # A mapping with source.kinesis reads its Kinesis stream (docs/kinesis.md).
    sources = [resolve_kinesis(m) if m.source.kinesis is not None else resolve_stream(m, dynamodb_client(m.source.region))
               for m in mappings]
    for i, source in enumerate(sources):  # e.g. one table named with and without its region
        first = next(j for j, other in enumerate(sources) if other.stream_arn == source.stream_arn)
        if first != i:
            raise ConfigError(f"{mappings[first].origin} and {mappings[i].origin} read the same stream "
                              f"({source.table}): one job reads each table once", "--mapping")
    for mapping in mappings:
        warning = check_target(mapping)
        if warning:
            log.warning(warning)
        check_profiles(args, mapping)
    accept_new_stream, on_trimmed = recopy_tail(args)
    for mapping, source in zip(mappings, sources):
        ensure_state_table(mapping.target.project, mapping.target.instance, args.state_table)
        # `migrate --restart` is the recovery the refusal names: a new backfill
        # copies the table again and its tail follows the new stream.
        store = state_spec(args, mapping).store()
        check_stream_continuity(store, source.stream_arn, accept_new_stream)
        if not getattr(args, "restart", False):  # a new migration may begin after a cutover
            refuse_forward_after_cutover(Migration(store), mapping.source.table)
    states = [state_spec(args, mapping, dlq_values(args)) for mapping in mappings]
    claim_target_tables(args, mappings, states)
    # Before the leases: with --take-over, acquiring them displaces the running
    # job at once, and a start then refused for its share would leave nothing
    # replicating (docs/design.md §10.8). The compare-and-set below decides.
    take_kinesis_shares(args, mappings, sources, states, check_only=True)
    held: list = []
    leases = acquire_leases(args, states, TAIL, held)
    try:
        shares = take_kinesis_shares(args, mappings, sources, states)
    except BaseException:
        # Refused: nothing held, as acquire_leases leaves it (a Dataflow job's
        # lease is not released at exit, and would block a corrected rerun).
        for lease in held:
            lease.release()
        raise
    jobs = []
    for mapping, source, state, lease, share in zip(mappings, sources, states, leases, shares):
        # After the lease: a launch refused before it holds the job records no start.
        store = state.store()
        try:
            start = settle_start(store, source.stream_arn, args.start, wall_ms(),
                                 kinesis=mapping.source.kinesis is not None)
            # The stored phase and backfill progress on the metrics from the first
            # scrape (a re-copy clears that progress when it begins: not shown before)
            Migration(store).publish(progress=not getattr(args, "restart", False))
        finally:
            store.close()
        reader = ReaderOptions(
            start=args.start, fresh=start.fresh, on_trimmed=on_trimmed, poll_interval_s=args.poll_interval,
            discovery_interval_s=args.discovery_interval, until_idle_s=args.until_idle,
            sleep_when_idle=is_local(args.beam_args), lease=lease, retry=dynamodb_retry(args),
        )
        # Every tail watches the migration phase: a `ddb2bt backfill` started next to a
        # running `ddb2bt run` needs its changes marked just as `migrate`'s own tail.
        kinesis = mapping.source.kinesis
        sink = sink_config(args, lease)
        client_factory = StreamsClientFactory(mapping.source.region)
        if kinesis is not None:  # out-of-order delivery: the ordering guard writes (docs/design.md §10)
            sink = replace(sink, ordering_guard=True)
            client_factory = KinesisClientFactory(kinesis.stream, mapping.source.table, mapping.source.region,
                                                  kinesis.precision, start_timestamp_ms=start.kinesis_from_ms,
                                                  share=float(share))
        partitions = args.partitions
        if partitions == AUTO_PARTITIONS:
            partitions = partitions_following_shards(mapping, source.stream_arn, client_factory)
        jobs.append(LiveJob(mapping=mapping, stream_arn=source.stream_arn, reader=reader, state=state,
                            partitions=partitions, sink=sink,
                            client_factory=client_factory, marking=PhaseMarking(state),
                            pushgateway=getattr(args, "metrics_pushgateway", None)))
    return jobs


def take_kinesis_shares(args, mappings: list, sources: list, states: list, check_only: bool = False) -> list:
    """Each table's share of its Kinesis stream's read budget (None: a DynamoDB
    stream): the job's ``--kinesis-share`` split between its tables on the
    stream, recorded in the state table while the tail leases are held, with
    the stream each table now reads, so a start that would overspend the budget
    with other jobs is refused (docs/design.md §10.8). ``check_only``: refuse
    such a start, writing nothing (before the leases are taken)."""
    from fractions import Fraction

    arns = [source.kinesis_arn or source.stream_arn if mapping.source.kinesis is not None else None
            for mapping, source in zip(mappings, sources)]
    shares = table_shares(arns, getattr(args, "kinesis_share", None) or Fraction(1))
    if getattr(args, "dry", False):
        return shares
    groups: dict = {}  # (state table, stream) -> (a state spec, {job: share})
    for arn, state, share in zip(arns, states, shares):
        if arn is not None:
            where = (state.bigtable.project, state.bigtable.instance, state.table, arn)
            groups.setdefault(where, (state, {}))[1][state.job] = share
        if not check_only:
            # Every table, a DynamoDB stream's too: its share of a stream it
            # read before stops counting there (kinesis_share.READS_META).
            store = state.store()
            try:
                record_stream(store, arn)
            finally:
                store.close()
    for (_, _, _, arn), (state, consumers) in groups.items():
        store = state.store()
        try:
            (check_shares if check_only else take_shares)(store, arn, consumers, wall_ms)
        finally:
            store.close()
    return shares


def note_mapping_changes(args, jobs: list) -> None:
    """Record the mapping each tail runs; tell the user what changed since the
    job last ran (docs/cutover.md, "Changing the mapping"). Called once the job
    runs: a local job as it starts, a remote one once its launch was accepted (a
    rejected Dataflow --update leaves the recorded mapping as it was)."""
    import sys

    if getattr(args, "dry", False):
        return
    for job in jobs:
        change = record_mapping(job.state.store(), job.mapping, lambda: time.time_ns() // 1_000_000)
        if change is not None:
            print(change_notice(job.mapping.name, change, mapping_flags(args, None if len(jobs) == 1 else
                                                                        [job.mapping.origin]),
                                recopying=getattr(args, "command", None) == "migrate" and bool(
                                    getattr(args, "restart", False))), file=sys.stderr)


OUTCOMES = ("applied", "dead_lettered", "skipped")


def outcome_snapshot(metrics=None) -> dict:
    """{job (state key, the metrics' table label): {applied, dead_lettered,
    skipped}}: this process's totals so far, per table. Take one before a
    command writes and ``outcome_since`` after it."""
    metrics = metrics or default_metrics()
    out: dict = {}
    for key, counter in (("applied", metrics.changes_applied), ("dead_lettered", metrics.dead_letters),
                         ("skipped", metrics.changes_skipped)):
        for family in counter.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    table = out.setdefault(sample.labels.get("table", ""), dict.fromkeys(OUTCOMES, 0))
                    table[key] += int(sample.value)
    return out


def outcome_since(before: dict, jobs: list, metrics=None) -> dict:
    """{job: counts} for ``jobs`` (state keys): what happened since ``before``."""
    after = outcome_snapshot(metrics)
    zero = dict.fromkeys(OUTCOMES, 0)
    return {job: {k: after.get(job, zero)[k] - before.get(job, zero)[k] for k in OUTCOMES} for job in jobs}


def write_summary(args, counts: dict, mappings: list, states: list) -> str:
    """The summary every writing command ends with (run, migrate, backfill, dlq
    redrive): ``done: …``, with the dead-letter hints carrying the options that
    select the state. Several tables: the total first (the same ``done:`` line),
    then each table, named, with its own hints. ``counts``: {job: counts}
    (``outcome_since``)."""
    if len(mappings) == 1:
        return report_outcome(counts[states[0].job], mapping_flags(args))
    total = {k: sum(counts[s.job][k] for s in states) for k in OUTCOMES}
    lines = [report_outcome(total, "").split("\n", 1)[0] + f" ({len(mappings)} tables)"]
    for mapping, state in zip(mappings, states):
        per_table = report_outcome(counts[state.job], mapping_flags(args, [mapping.origin]))
        lines += [f"  {state.job}: " + per_table.split("\n", 1)[0].removeprefix("done: ")]
        lines += ["  " + hint for hint in per_table.split("\n")[1:]]
    return "\n".join(lines)


def report_outcome(counts: dict, mapping_flags: str) -> str:
    """The last line of a command that writes: what happened to the changes it read."""
    line = (f"done: {counts['applied']} change(s) applied, {counts['dead_lettered']} dead-lettered, "
            f"{counts['skipped']} skipped")
    if counts["dead_lettered"]:
        line += (f"\n  inspect the dead letters: ddb2bt dlq list {mapping_flags}"
                 f"\n  after fixing the mapping:  ddb2bt dlq redrive {mapping_flags}")
    return line


def backfill_options(args, tables: int = 1):
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.cutover.controller import BackfillOptions

    if args.from_export and tables > 1:
        raise ConfigError(f"an export is one table's, but {tables} mappings are given: back-fill them by Scan, or "
                          "back-fill each table from its export with its own `ddb2bt backfill` next to the "
                          "multi-table `ddb2bt run`", "--from-export")
    return BackfillOptions(segments=args.segments, tasks=args.tasks, max_rcu=args.max_rcu,
                           consistent_read=args.consistent_read, page_size=args.page_size,
                           from_export=args.from_export, restart=args.restart,
                           pushgateway=getattr(args, "metrics_pushgateway", None),
                           scan_retry=backfill_scan_retry(args))


def backfill_scan_retry(args):
    """The backfill's Scan pages give up after --dynamodb-deadline, like the tail."""
    deadline = getattr(args, "dynamodb_deadline", None)
    return replace_deadline(DEFAULT_READ_RETRY, deadline) if deadline is not None else None


def sink_config(args=None, lease=None):
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.sink.sink import SinkConfig

    if args is None or not hasattr(args, "bigtable_deadline"):
        return SinkConfig(lease=lease)
    return SinkConfig(lease=lease, retry=replace_deadline(RetryPolicy(), args.bigtable_deadline,
                                                          "--bigtable-deadline"))


def dynamodb_retry(args):
    return replace_deadline(ReaderOptions.retry, getattr(args, "dynamodb_deadline", None))


def replace_deadline(policy, deadline_s, option: str = "--dynamodb-deadline"):
    from dataclasses import replace

    if deadline_s is not None and not deadline_s > 0:
        raise ConfigError(f"must be a positive number of seconds, got {deadline_s:g}", option)
    return policy if deadline_s is None else replace(policy, deadline_s=deadline_s)


def with_backfill_leases(args, options, states: list) -> list:
    """Each table's backfill options with its own backfill lease (a backfill may
    run next to the job's tail), all or none."""
    from dataclasses import replace

    return [replace(options, sink=sink_config(args, lease)) for lease in acquire_leases(args, states, BACKFILL)]
