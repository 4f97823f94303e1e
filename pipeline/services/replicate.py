"""The commands that replicate: ``ddb2bt run`` (the live tail), ``backfill`` and
``migrate``, with what they share: the summary at the end and the local continuous-
check threads. The CLI (``pipeline/app/cli.py``) only parses and calls these; what they
print and return is the command's output and exit code.
"""
from __future__ import annotations

import contextlib
import logging

from ddb2bt.pipeline.services.jobs import (
    backfill_options, build_live_jobs, check_profiles, claim_target_tables, dlq_values, load_all, mapping_flags,
    note_mapping_changes,
    outcome_since, outcome_snapshot, start_metrics_server, state_spec, submitted, with_backfill_leases,
    write_summary,
)
from ddb2bt.pipeline import signals
from ddb2bt.pipeline.connect.preflight import check_target, ensure_state_table
from ddb2bt.pipeline.control.phases import Migration, refuse_forward_after_cutover

log = logging.getLogger("ddb2bt")


def cmd_run(args) -> int:
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.graph import is_local, make_pipeline
    from ddb2bt.pipeline.io import ReplicateToBigtable

    jobs = build_live_jobs(args, load_all(args))
    start_metrics_server(args.metrics_port, args.metrics_host)
    for job in jobs:
        mapping = job.mapping
        log.info("replicating %s (%s) → %s/%s/%s, %d partition(s), start=%s%s", mapping.source.table,
                 job.stream_arn.rsplit("/", 1)[-1], mapping.target.project, mapping.target.instance,
                 mapping.target.table, job.partitions, job.reader.start,
                 f", until idle {args.until_idle}s" if args.until_idle else "")
    p = make_pipeline(args.beam_args)
    p | "ReplicateToBigtable" >> ReplicateToBigtable.from_jobs(jobs)
    if getattr(args, "continuous_check", None) and not is_local(args.beam_args):
        # inside: loaded when the command runs, not by --help (the CLI imports every service)
        from ddb2bt.pipeline.verify.continuous_beam import CheckContinuously

        # On a remote runner the check is a branch of the job: its workers run it.
        p | "CheckContinuously" >> CheckContinuously(jobs, continuous_options(args))
    args.job_started = True
    # Locally p.run() itself runs the job: the checks start before it.
    stop_checks = start_continuous_checks(args, jobs) if is_local(args.beam_args) else None
    try:
        with summary_at_end(args, [j.mapping for j in jobs], [j.state for j in jobs], is_local(args.beam_args)):
            if is_local(args.beam_args):
                note_mapping_changes(args, jobs)  # p.run() runs the job here
            result = p.run()
            if not is_local(args.beam_args):
                note_mapping_changes(args, jobs)  # launched: a refused launch or --update raised above
                return submitted(result, args)  # a streaming job runs on; drain it to stop
            result.wait_until_finish()
    finally:
        if stop_checks is not None:
            stop_checks.set()
    return 0


def interrupted() -> bool:
    """This command was stopped by Ctrl-C / SIGTERM: its last line (signals.py)
    names the command that resumes it, and nothing else may name another."""
    scope = signals.current()
    return scope is not None and scope.interrupted is not None


@contextlib.contextmanager
def summary_at_end(args, mappings: list, states: list, local: bool = True):
    """Every command that writes ends with the same summary (``write_summary``):
    after its work, or when Ctrl-C stops it (what was done so far). Not for a
    launch on Dataflow: the job runs on, and its counts are the job's."""
    before = outcome_snapshot()

    def summary() -> str:
        return write_summary(args, outcome_since(before, [s.job for s in states]), mappings, states)

    try:
        yield
    except KeyboardInterrupt:
        if local:
            print("stopped; so far: " + summary(), flush=True)
        raise
    if local and not getattr(args, "dry", False):
        print(summary(), flush=True)


def continuous_options(args):
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.verify.continuous import ContinuousOptions

    return ContinuousOptions(items_per_s=args.continuous_check, segments=args.continuous_check_segments)


@contextlib.contextmanager
def continuous_checks(args, jobs: list):
    """``start_continuous_checks`` for the length of a block."""
    stop = start_continuous_checks(args, jobs)
    try:
        yield
    finally:
        stop.set()


def start_continuous_checks(args, jobs: list):
    """--continuous-check RATE: one checking thread per table next to the local
    job (verify/continuous.py; on Dataflow a branch of the job instead,
    continuous_beam.py); returns the Event that stops them."""
    import threading

    stop = threading.Event()
    if getattr(args, "continuous_check", None):
        # inside: loaded when the command runs, not by --help (the CLI imports every service)
        from ddb2bt.pipeline.verify.continuous import start_continuous_check

        for job in jobs:
            start_continuous_check(job.mapping, state_spec(args, job.mapping).store(), continuous_options(args),
                                   stop, job.stream_arn, job.client_factory)
    return stop


def cmd_backfill(args) -> int:
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.cutover.controller import TableBackfill, backfill, check_export_first
    from ddb2bt.pipeline.graph import is_local
    mappings = load_all(args)
    options = backfill_options(args, len(mappings))
    for mapping in mappings:
        check_export_first(options, mapping)  # before anything is created or written
    for mapping in mappings:
        warning = check_target(mapping)
        if warning:
            log.warning(warning)
        check_profiles(args, mapping)
    for mapping in mappings:
        ensure_state_table(mapping.target.project, mapping.target.instance, args.state_table)
    specs = [state_spec(args, mapping, dlq_values(args)) for mapping in mappings]
    if not getattr(args, "restart", False):  # after the cutover: it would copy DynamoDB over the app's writes
        for mapping, spec in zip(mappings, specs):
            refuse_forward_after_cutover(Migration(spec.store()), mapping.source.table)
    claim_target_tables(args, mappings, specs)
    tables = [TableBackfill(m, spec, opts)
              for m, spec, opts in zip(mappings, specs, with_backfill_leases(args, options, specs))]
    start_metrics_server(args.metrics_port, args.metrics_host)
    with summary_at_end(args, mappings, specs, local=not args.dry and is_local(args.beam_args)):
        outcome = backfill(tables, args.beam_args)
        if outcome.launched is not None:
            return submitted(outcome.launched, args)
    print(f"backfill complete; phase {outcome.phase}, touch markers removed: keep the live tail running "
          "(ddb2bt run) and check ddb2bt status")
    return 0


def cmd_migrate(args) -> int:
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.cutover.controller import check_export_first, migrate
    from ddb2bt.pipeline.graph import is_local

    mappings = load_all(args)
    options = backfill_options(args, len(mappings))
    for mapping in mappings:
        check_export_first(options, mapping)  # before the tail starts writing
    jobs = build_live_jobs(args, mappings)
    per_table = with_backfill_leases(args, options, [job.state for job in jobs])
    start_metrics_server(args.metrics_port, args.metrics_host)
    # The summary (dead letters included) comes last: "migration LIVE" is not the end of the story.
    local = is_local(args.beam_args)
    with summary_at_end(args, mappings, [job.state for job in jobs], local=local), \
            continuous_checks(args, jobs if local and not args.dry else []):
        check = continuous_options(args) if getattr(args, "continuous_check", None) else None
        if local:
            note_mapping_changes(args, jobs)  # migrate runs the job here
        outcome = migrate(jobs, per_table, args.beam_args, args.until_idle, dry_run=args.dry, check=check,
                          on_live=lambda: print("migration LIVE" + ("" if args.until_idle is not None else
                                                "; the tail goes on replicating (Ctrl-C stops it; a restart "
                                                "resumes)"), flush=True))
        if outcome.launched is not None:
            if not local:
                note_mapping_changes(args, jobs)  # launched: a refused launch or --update raised above
            return submitted(outcome.launched, args)
        if args.until_idle is not None:
            print(f"tail idle; nothing of ddb2bt's is left in the target; verify with: ddb2bt verify "
                  f"{mapping_flags(args)}")
        elif not interrupted():  # the tail ended by itself (the stream gone): say it is not running
            print(f"the tail stopped; resume with: ddb2bt run {mapping_flags(args)}")
    return 0
