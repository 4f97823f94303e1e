"""The local migrate controller, the backfill launch and the retention rule.

``migrate`` (local runner): the tail starts first, in a thread; the backfill
begins (phase BACKFILLING, marker family created, handoff T fixed once the tail
marks) or resumes; when every part is written the phase moves to CATCHING_UP;
the finish drops the marker family once no tail of ours can still mark; LIVE
once the tail is idle (``until_idle``) or has caught up. On Dataflow the same
steps are taken by the workers (``phases.advance``); here the job is only built
and launched.

``backfill``: the backfill alone, next to a running ``ddb2bt run`` (whose
readers mark while the phase says BACKFILLING); it finishes the same way.

Threads live here, not in the CLI: the CLI builds the typed options, calls one
of these functions and prints what it returns.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Callable, Optional

import apache_beam as beam

from ddb2bt.pipeline.control.markers import Bookkeeping
from ddb2bt.pipeline.control.phases import BACKFILLING, LIVE, Migration, PHASES
from ddb2bt.pipeline.cutover.status import QUEUED_META
from ddb2bt.pipeline.observe.logs import table_logger
from ddb2bt.transforms.errors import ConfigError
from ddb2bt.pipeline.clients.dynamodb import EXPORT_RETENTION_MARGIN_MS, STREAM_RETENTION_MS, describe_table
from ddb2bt.pipeline.connect.connections import dynamodb_client, DynamoDBClientFactory, wall_ms
from ddb2bt.pipeline.control.clock import CLOCK_BEHIND_LIMIT_S, check_clock
from ddb2bt.pipeline.cutover.backfill import add_backfill, BackfillJob
from ddb2bt.pipeline.source.snapshot import ExportSource, ScanSource
from ddb2bt.pipeline.verify.continuous_beam import CheckContinuously
from ddb2bt.pipeline.observe.progress import Worker, run_in_thread
from ddb2bt.pipeline.cutover.recopy import sweep_target
from ddb2bt.pipeline.graph import add_live_replication, is_local, make_pipeline
from ddb2bt.pipeline.observe.metrics import counter_total, default_metrics
from ddb2bt.pipeline.sink.sink import SinkConfig
from ddb2bt.pipeline.source.stream_source import request_stop

log = logging.getLogger(__name__)

HOUR_MS = 3600 * 1000
# An export's time is AWS's, never ahead of AWS's "now": ahead of this host's
# clock by more than it may lag AWS's (clock.py), it is not a real export time.
EXPORT_AHEAD_LIMIT_MS = int(CLOCK_BEHIND_LIMIT_S * 1000)
TAIL_STOP_WAIT_S = 60.0
# How often `migrate` looks whether the keeper moved every table LIVE: one
# state-table read per table; LIVE itself is decided on the keeper's 10 s step.
LIVE_POLL_S = 1.0


@dataclass(frozen=True)
class BackfillOptions:
    segments: int = 8
    tasks: int = 1
    max_rcu: Optional[float] = None
    consistent_read: bool = True  # the handoff's Scan must see every write before T (docs/design.md §6.6)
    page_size: int = 1000
    from_export: Optional[str] = None
    restart: bool = False
    pushgateway: Optional[str] = None
    # The backfill sink's settings: its lease (ddb2bt.pipeline.control.lease) and give-up
    # deadline (None: SinkConfig's defaults).
    sink: Optional[object] = None
    # The Scan pages' retry policy (--dynamodb-deadline); None: the readers' default.
    scan_retry: Optional[object] = None

    def __post_init__(self) -> None:
        if not 1 <= self.page_size <= 10_000:
            raise ConfigError("must be between 1 and 10000", "--page-size")
        if self.segments < 1:
            raise ConfigError("must be at least 1", "--segments")


@dataclass(frozen=True)
class Outcome:
    """What a controller call did: ``launched`` holds the remote runner's result
    (the CLI reports it); otherwise ``phase`` is where the migration stands."""

    phase: Optional[str] = None
    launched: object = None


def backfill_source(options: BackfillOptions, mapping, now_ms: Callable[[], int] = wall_ms):
    """(source, spec dict, handoff ms or None, expected items). An export's time
    is checked again here (``check_export_first`` did before anything was created;
    a table back-filled after others begins later)."""
    if options.from_export:
        source = ExportSource(options.from_export, mapping.source.region)
        # Before anything is recorded or written: a full export, in a format we
        # read, of this mapping's source table.
        source.check(mapping.source.table, mapping.source.region)
        handoff = checked_export_time(source, now_ms)
        parts = source.parts()
        return source, {"kind": "export", "location": options.from_export, "parts": len(parts)}, handoff, \
            source.item_count()
    source = ScanSource(mapping.source.table, options.segments, mapping.source.region, options.consistent_read,
                        options.max_rcu, options.page_size)
    count = describe_table(dynamodb_client(mapping.source.region), mapping.source.table,
                           metrics_table=mapping.name).get("ItemCount", 0)
    return source, {"kind": "scan", "segments": options.segments, "parts": options.segments}, None, int(count)


def checked_export_time(source: ExportSource, now_ms: Callable[[], int]) -> int:
    """The export's time, the handoff: refused when it is ahead of this host's
    clock (beyond how far this clock may lag AWS's) or older than the stream
    keeps (24 h, less a margin: changes made since it may already be trimmed)."""
    handoff = source.export_time_ms()
    age = now_ms() - handoff
    if age < -EXPORT_AHEAD_LIMIT_MS:
        # The handoff would be in the future: every back-filled cell would sit
        # above the tail's changes until then, hiding their updates and deletes
        # (docs/design.md §7.1, §7.2).
        raise ConfigError(
            f"the export's time (exportTime in manifest-summary.json) is {_span(-age)} ahead of this host's clock: "
            "AWS never exports from the future, so either this clock is behind (check NTP) or the manifest was "
            "edited. A handoff in the future would hide every change made before it behind the back-filled cells",
            "--from-export")
    if age > STREAM_RETENTION_MS - EXPORT_RETENTION_MARGIN_MS:
        raise ConfigError(
            f"the export is {age / HOUR_MS:.1f}h old: the stream keeps 24h, so changes made since the export "
            "may already be trimmed. Take a new export, or back-fill with a scan (no --from-export)",
            "--from-export")
    return handoff


def _span(ms: int) -> str:
    """A time span for a message: seconds under an hour, else hours."""
    return f"{ms / 1000:.0f} s" if ms < HOUR_MS else f"{ms / HOUR_MS:.1f} h"


def check_export_first(options: BackfillOptions, mapping, now_ms: Callable[[], int] = wall_ms) -> None:
    """--from-export: refuse an export the backfill cannot use (incremental, an unknown
    format, another table, still running, its time ahead of this clock or older
    than the stream keeps) before anything is created or written."""
    if options.from_export:
        source = ExportSource(options.from_export, mapping.source.region)
        source.check(mapping.source.table, mapping.source.region)
        checked_export_time(source, now_ms)


def _bookkeeping(mapping) -> Bookkeeping:
    return Bookkeeping.for_mapping(mapping)  # a Kinesis mapping's backfill needs no markers (design §10.6)


def check_source_clock(mapping) -> None:
    """Refuse a cutover on a clock too far from AWS's (control/clock.py), before
    anything is recorded or written."""
    client = dynamodb_client(mapping.source.region)
    check_clock(lambda: client.describe_table(TableName=mapping.source.table),
                f"DynamoDB ({mapping.source.region or 'default region'})")


def _begin(mapping, migration: Migration, options: BackfillOptions) -> tuple:
    """Resume or begin the backfill: (source, handoff ms)."""
    source, source_spec, export_time, expected = backfill_source(options, mapping)
    if export_time is None:  # T comes from this host's clock (an export's from AWS's): check it first
        check_source_clock(mapping)
    handoff = migration.resume_or_begin(source_spec, options.restart, _bookkeeping(mapping), mapping.tables,
                                        export_time)
    migration.store.save_meta("backfill_expected", str(expected))
    default_metrics().for_table(migration.store.job).backfill_expected.set(expected)
    table_logger(log, mapping.name).info("backfill of %s from %s, handoff %d (cells at %d ms)", mapping.source.table, source_spec["kind"],
             handoff, handoff - handoff % 1000 - 1)
    return source, handoff, expected


class _Backfill(beam.PTransform):
    """One table's backfill steps under one label: a job back-filling several
    tables has one such branch per table."""

    def __init__(self, add: Callable) -> None:
        super().__init__()
        self._add = add

    def expand(self, pbegin):
        return self._add(pbegin)


def _add_backfill(p, mapping, state_spec, source, handoff: int, options: BackfillOptions, reshuffle: bool,
                  label: str = ""):
    def add(root):
        return add_backfill(root, BackfillJob(source, mapping.source.key_attributes, handoff, tasks=options.tasks,
                                              scan_retry=options.scan_retry), mapping,
                            state_spec, options.sink or SinkConfig(), DynamoDBClientFactory(mapping.source.region),
                            reshuffle=reshuffle, pushgateway=options.pushgateway)

    return p | label >> _Backfill(add) if label else add(p)


def run_backfill(mapping, state_spec, options: BackfillOptions, beam_args: list,
                 migration: Optional[Migration] = None) -> Outcome:
    """The backfill pipeline: on the local runner, to its end (then the phase is
    CATCHING_UP); on Dataflow, a batch job is launched (the tail's readers move
    the phase on once every part is done, see ``phases.advance``)."""
    migration = migration or Migration(state_spec.store())
    source, handoff, expected = _begin(mapping, migration, options)
    local = is_local(beam_args)
    if not local:
        p = make_pipeline(beam_args, streaming=False)
        _add_backfill(p, mapping, state_spec, source, handoff, options, reshuffle=True)
        return Outcome(launched=p.run())

    def pipeline() -> None:
        p = make_pipeline(beam_args)
        _add_backfill(p, mapping, state_spec, source, handoff, options, reshuffle=False)
        p.run().wait_until_finish()

    metrics = default_metrics()
    start = counter_total(metrics.backfill_items)
    run_in_thread(f"backfill {mapping.name}", pipeline, expected,
                  lambda: counter_total(metrics.backfill_items) - start)
    if migration.recopy_pending:
        recopy_sweep(mapping, state_spec, migration, handoff, options)
    if not migration.finish_backfill() and migration.phase == BACKFILLING:
        raise ConfigError(f"the backfill pipeline of {mapping.name} ended but not every part is recorded done; "
                          "rerun to resume", "backfill")
    return Outcome(phase=migration.phase)


def recopy_sweep(mapping, state_spec, migration: Migration, handoff: int, options: BackfillOptions) -> None:
    """A re-copy's last step (docs/design.md §7.7): every part is written, now
    remove what no item owns any more. Recorded done only once it ran to the end,
    so a rerun after a crash sweeps again (deleting what no item owns is the same
    again)."""
    logger = table_logger(log, mapping.name)
    logger.info("re-copy sweep of %s: removing what no item owns any more", ", ".join(mapping.tables))
    result = run_in_thread(f"re-copy sweep {mapping.name}",
                           lambda: sweep_target(mapping, state_spec, handoff - handoff % 1000 - 1, options.segments,
                                                options.max_rcu))
    migration.recopy_done()
    logger.info("re-copy sweep of %s done: %d row(s) read, %d item(s) scanned, %d stale column(s) deleted, %d "
                "written meanwhile (kept)", mapping.name, result.rows_read, result.items, result.deleted,
                result.kept_newer)
    if result.unmappable:
        logger.warning("re-copy sweep of %s: %d item(s) the mapping refuses; their rows were left as they are "
                       "(ddb2bt verify lists them)", mapping.name, result.unmappable)


def refuse_remote_recopy(jobs_or_tables, options) -> None:
    """A re-copy of a table migrated before ends with the sweep (§7.7), which runs
    in the process that launched the backfill: a Dataflow launch returns at once
    and could not run it, so it is refused before anything is recorded or written
    instead of ending without having removed the rows of deleted items."""
    for job, opts in zip(jobs_or_tables, options):
        if opts.restart and Migration(job.state.store()).phase is not None:
            raise ConfigError(
                f"{job.mapping.name} was migrated before: a re-copy removes the rows of items that no longer "
                "exist with a sweep after the backfill, which a Dataflow launch cannot run. Re-copy with the "
                f"local runner next to the running Dataflow tail: ddb2bt backfill -m {job.mapping.origin} "
                "--restart (no --runner)", "--restart")


@dataclass(frozen=True)
class TableBackfill:
    """One table's backfill: its mapping, where its state lives, its options
    (each table's backfill holds its own lease)."""

    mapping: object
    state: object
    options: BackfillOptions


def backfill(tables, beam_args: list) -> Outcome:
    """``ddb2bt backfill``: each table's backfill next to a separately running
    tail. Locally the tables are back-filled one after another, and each also
    finishes: once the tails had time to stop marking, its marker family is
    dropped, so the target holds only the mapping's cells. On Dataflow one batch
    job back-fills them all."""
    tables = list(tables)
    if not is_local(beam_args):
        refuse_remote_recopy(tables, [t.options for t in tables])
        p = make_pipeline(beam_args, streaming=False)
        for i, t in enumerate(tables):
            source, handoff, _ = _begin(t.mapping, Migration(t.state.store()), t.options)
            _add_backfill(p, t.mapping, t.state, source, handoff, _one_pusher(t.options, i), reshuffle=True,
                          label=f"Backfill[{t.mapping.name}]" if len(tables) > 1 else "")
        return Outcome(launched=p.run())
    phases = []
    for t in tables:
        migration = Migration(t.state.store())
        run_backfill(t.mapping, t.state, t.options, beam_args, migration)
        migration.finish(_bookkeeping(t.mapping), t.mapping.tables, wait=True)
        phases.append(migration.phase)
    return Outcome(phase=_overall(phases))


def _one_pusher(options: BackfillOptions, index: int) -> BackfillOptions:
    """Only the first table of a job pushes metrics: a pusher sends the whole
    process's registry (every table's series, by their label), so one per table
    would count every series once per table."""
    return options if index == 0 or options.pushgateway is None else replace(options, pushgateway=None)


def _overall(phases: list) -> Optional[str]:
    """A job's phase: a table's when all agree, else the earliest (a job of
    several tables is LIVE when every table is)."""
    known = [p for p in phases if p is not None]
    if len(known) < len(phases):
        return None
    return min(known, key=PHASES.index) if known else None


def migrate(jobs, options, beam_args: list, until_idle: Optional[float], dry_run: bool = False,
            on_live: Callable[[], None] = lambda: None, check=None) -> Outcome:
    """The whole cutover of every table of ``jobs`` (``graph.LiveJob``s, one per
    table; ``options`` one BackfillOptions per job). Locally: one tail for all
    tables and each table's backfill side by side with it (one after another),
    each table's finish, and LIVE per table; returns once every table is LIVE
    and the tail idle (``until_idle``) or, without it, when the tail ends
    (``on_live`` is called when every table is LIVE). Each table keeps its own
    phase and handoff time. On Dataflow: one streaming job launched, with the
    continuous check of every table (``check``, ContinuousOptions) as a branch
    of its own when given (locally the CLI runs its threads next to this)."""
    jobs, options = list(jobs), list(options)
    if len(options) != len(jobs):
        raise ValueError("one BackfillOptions per job")
    migrations = [Migration(job.state.store()) for job in jobs]
    phases = [m.phase for m in migrations]
    for job, phase in zip(jobs, phases):
        table_logger(log, job.mapping.name).info("migrate %s → %s: phase %s", job.mapping.source.table,
                                                 job.mapping.target.table, phase or "new")
    if not is_local(beam_args):
        if not dry_run:
            refuse_remote_recopy(jobs, options)
        return Outcome(launched=launch_migrate(jobs, options, beam_args, migrations, dry_run, check))
    stop_token = uuid.uuid4().hex
    jobs = [replace(job, reader=replace(job.reader, stop_token=stop_token)) for job in jobs]

    def tail() -> None:
        p = make_pipeline(beam_args)
        add_live_replication(p, jobs)
        p.run().wait_until_finish()

    def finish_all(wait: bool) -> None:
        for job, migration in zip(jobs, migrations):
            migration.finish(_bookkeeping(job.mapping), job.mapping.tables, wait=wait)

    def go_live() -> None:
        for migration in migrations:
            migration.go_live()
        on_live()

    for job, phase in list(zip(jobs, phases))[1:]:  # `status` tells them apart from tables never migrated
        if phase is None:
            job.state.store().save_meta(QUEUED_META, str(time.time_ns() // 1_000_000))
    tail_worker = Worker("tail", tail)
    tail_worker.start()  # the tail first: changes after the handoff are never missed
    try:
        for job, opts, migration, phase in zip(jobs, options, migrations, phases):
            # --restart begins a new backfill from any phase (a re-copy, §7.7):
            # a LIVE table is copied again, never left as it was.
            if phase in (None, BACKFILLING) or opts.restart:
                run_backfill(job.mapping, job.state, opts, beam_args, migration)
            tail_worker.check()
    except BaseException:
        # Stop the tail cleanly (what it read is written and checkpointed), then fail.
        request_stop(stop_token)
        tail_worker.join(TAIL_STOP_WAIT_S)
        raise
    if until_idle is not None:
        tail_worker.join()
        tail_worker.check()
        # One more pass until idle after the backfills: the tail may have gone idle
        # (and ended) while a backfill was still running.
        final = Worker("tail-catch-up", tail)
        final.start()
        final.join()
        final.check()
        # Every tail of this controller has ended: none can mark any more, so the
        # finish need not wait for their phase caches.
        finish_all(wait=False)
        go_live()
        return Outcome(phase=LIVE)
    try:
        finish_all(wait=True)  # the tail runs on meanwhile
        # LIVE is the cutover keeper's move, on the tail's own reports: caught up
        # in time, past the handoff, for a settling period (docs/design.md §7.8),
        # whatever the write rate. Here we only wait for it.
        live = wait_until_live(migrations, tail_worker)
        tail_worker.check()
        if live:
            go_live()
    except BaseException:
        request_stop(stop_token)
        tail_worker.join(TAIL_STOP_WAIT_S)
        raise
    tail_worker.join()
    tail_worker.check()
    return Outcome(phase=_overall([m.phase for m in migrations]))


def wait_until_live(migrations, tail_worker: Worker, poll_s: float = LIVE_POLL_S) -> bool:
    """Wait while the tail runs until every table's phase is LIVE (the keeper
    moves it): True once it is, False when the tail ended first."""
    while tail_worker.is_alive():
        if all(m.phase == LIVE for m in migrations):
            return True
        tail_worker.join(poll_s)
    return all(m.phase == LIVE for m in migrations)


def launch_migrate(jobs, options, beam_args: list, migrations, dry_run: bool = False, check=None):
    """Dataflow: ONE streaming job with the tail of every table and each table's
    backfill side by side. Each table's handoff is fixed here, before launch; the
    readers then move each table's phase on (``phases.advance``): CATCHING_UP
    when its parts are done, the finish, LIVE once caught up (catchup.py)."""
    p = make_pipeline(beam_args, streaming=True)
    jobs = [replace(job, reader=replace(job.reader, promote_live=True)) for job in jobs]
    add_live_replication(p, jobs)
    for i, (job, opts, migration) in enumerate(zip(jobs, options, migrations)):
        if migration.phase not in (None, BACKFILLING) and not opts.restart:
            continue
        opts = _one_pusher(opts, i)
        if dry_run:  # build the graph only: no phase, no family, no wait
            source = backfill_source(opts, job.mapping)[0]
            handoff = time.time_ns() // 1_000_000
        else:
            source, handoff, _ = _begin(job.mapping, migration, opts)
        _add_backfill(p, job.mapping, job.state, source, handoff, opts, reshuffle=True,
                      label=f"Backfill[{job.mapping.name}]" if len(jobs) > 1 else "")
    if check is not None:  # a branch of its own; each table's steps wait for it to be LIVE

        p | "CheckContinuously" >> CheckContinuously(jobs, check)
    return p.run()
