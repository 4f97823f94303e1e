"""`ddb2bt status`: where the migration stands and whether readers may switch.

Facts are gathered from the state table and the stream; ``assess`` (pure) turns
them into READY / NOT READY with every reason.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from botocore.exceptions import BotoCoreError, ClientError

from ddb2bt.pipeline.control.mapping_change import running_mapping
from ddb2bt.pipeline.control.phases import BACKFILLING, CATCHING_UP, Migration
from ddb2bt.pipeline.control.lease import BACKFILL, TAIL, LeaseState
from ddb2bt.pipeline.clients.retry import READ_ONLY_DEADLINE_S, RetryPolicy
from ddb2bt.pipeline.clients.dynamodb import (STREAM_RETENTION_MS, STREAM_RETENTION_S, SourceTableMissing,
                                              describe_table, list_shards)
from ddb2bt.pipeline.source.heads import nothing_lost_since_head, oldest_record_ms
from ddb2bt.transforms.fingerprint import describe_changes, mapping_outline, outline_fingerprint
from ddb2bt.pipeline.connect.connections import StreamsClientFactory, dynamodb_client
from ddb2bt.pipeline.control.markers import Bookkeeping
from ddb2bt.pipeline.control.state import RESUME_AT_TRIM_HORIZON
from ddb2bt.pipeline.source.kinesis import KinesisClientFactory, resolve_kinesis
from ddb2bt.pipeline.source.kinesis_share import share_text, held_shares

log = logging.getLogger(__name__)

HEADROOM_READY_MS = 6 * 3600 * 1000  # the alert threshold too
LAG_READY_MS = 60 * 1000
# The readers save what they see of their shards every 30 s (stream_sdf.READER_REPORT_S)
# and when they end: a report older than two of those periods (and a little
# slack for a slow round) is from a reader that stopped or stalled.
REPORT_FRESH_MS = 75 * 1000
# Meta row: when a multi-table migrate queued this table (its backfill follows the
# tables before it); status tells "waiting its turn" from "never migrated".
QUEUED_META = "migrate_queued_ms"


@dataclass
class ShardStatus:
    shard_id: str
    sequence_number: Optional[str]
    finished: bool
    pending_since_ms: Optional[int]  # creation time of the oldest record not applied yet
    last_applied_ms: Optional[int]
    # The checkpoint points at data the stream trimmed (changes lost from the stream):
    # `ddb2bt recover` restores them from incremental exports (docs/recover.md).
    trimmed: bool = False
    # ms since a reader last reported on the shard (None: never); pending_since_ms
    # is what that report said
    reported_ago_ms: Optional[int] = 0

    def lag_ms(self, now_ms: int) -> int:
        return 0 if self.pending_since_ms is None else max(0, now_ms - self.pending_since_ms)


@dataclass
class Facts:
    now_ms: int
    phase: Optional[str]
    handoff_ms: Optional[int]
    backfill_parts: int
    backfill_done_parts: int
    backfill_items: int
    backfill_expected: Optional[int]
    backfill_done_ms: Optional[int]
    shards: list = field(default_factory=list)
    dead_letters: int = 0
    last_verify: Optional[dict] = None
    stream_arn: Optional[str] = None
    # Target tables that still hold the migration's touch-marker family: its cells
    # (and rows holding only them) are not the mapping's, so readers must not switch.
    bookkeeping_tables: list = field(default_factory=list)
    # Does a live process (or Dataflow job) hold the job's backfill / tail lease?
    # None: not known (facts built without the state's leases).
    backfill_held: Optional[bool] = None
    tail_held: Optional[bool] = None
    # When the tail lease was last released or lapsed (None: held now, or never held).
    tail_stopped_ms: Optional[int] = None
    # A multi-table migrate queued this table (it backfills one table after another).
    queued_ms: Optional[int] = None
    # The mapping the job's tail runs ({"fingerprint", "since_ms", "previous", ...},
    # mapping_change.py) and, when status was given one, that mapping's fingerprint
    # and how it differs from the running one.
    running_mapping: Optional[dict] = None
    given_mapping: Optional[str] = None
    given_changes: tuple = ()
    # A Kinesis source: the stream's read-budget shares held now ({job: share},
    # kinesis_share.held_shares; docs/kinesis.md "Several tables on one stream").
    kinesis_shares: Optional[dict] = None


def assess(f: Facts, flags: str = "") -> tuple:
    """(ready, [reasons it is not]). ``flags``: the options that select this
    job's state (--mapping, --job-name, --state-table, …), appended to every
    command a reason suggests, so it looks at the same state."""
    f_ = f" {flags}" if flags else ""
    if f.phase == "CUT_OVER":  # the forward tail stopped for good: its shards report no more
        return False, [f"cut over: forward replication stopped for good, the way back runs; whether switching back "
                       f"is READY: ddb2bt rollback status{f_}"]
    reasons = []
    if f.phase is None and f.queued_ms is not None and f.tail_held:
        reasons.append("waiting its turn: the running multi-table migrate backfills one table after another, "
                       "this one once the tables before it are done")
    elif f.phase is None:
        reasons.append(f"no migration recorded for this job: run ddb2bt migrate{f_}")
    elif f.phase == BACKFILLING and f.backfill_held is False:
        reasons.append(f"backfill stopped at {f.backfill_done_parts}/{f.backfill_parts} parts (no process holds the "
                       f"job's backfill): rerun ddb2bt migrate{f_} to resume it")
    elif f.phase == BACKFILLING:
        reasons.append(f"backfill running: {f.backfill_done_parts}/{f.backfill_parts} parts done")
    elif f.phase == CATCHING_UP:
        reasons.append("backfill done; the tail is still catching up")
    tail_stopped = f.phase is not None and f.phase != BACKFILLING and f.tail_held is not True
    if tail_stopped:
        # Every change made while nobody tails the stream waits unapplied.
        since = f" since {_when(f.tail_stopped_ms)}" if f.tail_stopped_ms else ""
        reasons.append(f"the tail is not running (no process holds the job's tail lease{since}): resume it with "
                       f"ddb2bt run{f_ or ' -m <mapping>'}")
    if f.bookkeeping_tables:
        reasons.append(f"bookkeeping cells may remain in {', '.join(f.bookkeeping_tables)} (touch-marker family "
                       f"not dropped yet: the migration has not finished; rerun ddb2bt migrate{f_} or keep the "
                       "tail running)")
    silent = [s for s in f.shards if not s.finished and not s.trimmed and (s.reported_ago_ms is None
                                                                           or s.reported_ago_ms > REPORT_FRESH_MS)]
    if silent and not tail_stopped:  # with no tail running, that it does not report goes without saying
        reasons.append(f"{len(silent)} shard(s) without a report from a running reader in the last "
                       f"{REPORT_FRESH_MS // 1000} s: the tail is stalled or stopped (restart it with ddb2bt run{f_})")
    if f.phase not in (None, BACKFILLING) and not f.shards:
        # No shard listed (the stream not described or not answering): nothing
        # shows the tail is caught up, so it is not READY on faith.
        which = f"stream {f.stream_arn}" if f.stream_arn else "no stream described"
        reasons.append(f"no shard of the source's stream could be listed now ({which}): that the tail is caught "
                       f"up is not shown; check the source is reachable and run ddb2bt status{f_} again")
    lagging = [s for s in f.shards if not s.finished and s.lag_ms(f.now_ms) > LAG_READY_MS]
    if lagging:
        worst = max(s.lag_ms(f.now_ms) for s in lagging)
        reasons.append(f"{len(lagging)} shard(s) behind by up to {worst / 1000:.0f}s (threshold {LAG_READY_MS // 1000}s)")
    trimmed = [s for s in f.shards if s.trimmed]
    if trimmed:
        reasons.append(f"trimmed: {len(trimmed)} shard(s) lost changes the stream no longer holds; recover with "
                       f"ddb2bt recover{f_ or ' -m <mapping>'} (it prints the incremental exports to make, then applies them)")
    if f.phase == "RECOVERING":
        reasons.append(f"recovering from incremental exports: rerun ddb2bt recover{f_ or ' -m <mapping>'} --from-export ... "
                       "with the same exports to finish (it resumes after the last applied data file)")
    headroom = retention_headroom_ms(f)
    if headroom < HEADROOM_READY_MS:
        reasons.append(f"retention headroom {headroom / 3600000:.1f}h < 6h: changes risk being trimmed")
    if f.dead_letters:
        reasons.append(f"{f.dead_letters} dead letter(s): inspect with ddb2bt dlq list{f_}")
    running = f.running_mapping or {}
    if f.given_mapping and running.get("fingerprint") and f.given_mapping != running["fingerprint"]:
        reasons.append("the mapping given is not the one the job runs (" + "; ".join(f.given_changes[:3])
                       + ("; …" if len(f.given_changes) > 3 else "") + f"): start the tail with it (ddb2bt migrate "
                       f"--restart{f_} re-copies the table under it), then verify")
    v = f.last_verify
    if not v:
        reasons.append(f"never verified: run ddb2bt verify{f_}")
    elif _checked_another_mapping(v, running):
        reasons.append(f"the last verify checked another mapping than the one the job runs (it changed at "
                       f"{_when(running.get('since_ms'))}): run ddb2bt verify{f_}")
    elif not v.get("identical"):
        reasons.append("the last verify found differences")
    elif v.get("sampled"):
        reasons.append(f"the last verify was sampled: run a full ddb2bt verify{f_} before cutover")
    elif f.backfill_done_ms and v.get("checked_at_ms", 0) < f.backfill_done_ms:
        reasons.append("the last verify is older than the end of the backfill: verify again")
    return (not reasons, reasons)


def _checked_another_mapping(verify: dict, running: dict) -> bool:
    """The last verify predates the mapping the job runs: another fingerprint, or
    (a verify recorded before fingerprints were) older than the change."""
    if not running.get("fingerprint"):
        return False
    if verify.get("mapping"):
        return verify["mapping"] != running["fingerprint"]
    return bool(running.get("previous")) and verify.get("checked_at_ms", 0) < running.get("since_ms", 0)


def _when(ms) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000)) if ms else "-"


def retention_headroom_ms(f: Facts) -> int:
    pending = [s.pending_since_ms for s in f.shards if s.pending_since_ms is not None and not s.finished]
    oldest_age = max((f.now_ms - p for p in pending), default=0)
    return STREAM_RETENTION_MS - oldest_age


def reported_shards(store, stream_arn: str) -> dict:
    """{shard id: (report ms, pending since ms | None, ended)} from the readers' newest
    reports (``StateStore.save_reader_report``). Status reads no shard records
    itself: GetRecords is limited to 5 calls/s per shard, shared with the tail
    and any Lambda trigger (docs/operations.md, AWS limits)."""
    out: dict = {}
    for report in store.load_reader_reports(stream_arn):
        at = int(report.get("at_ms", 0))
        for shard_id, pending in (report.get("shards") or {}).items():
            if shard_id not in out or out[shard_id][0] < at:
                out[shard_id] = (at, pending, bool(report.get("ended")))
    return out


def _trimmed(streams, stream_arn: str, shard_id: str, after: Optional[str]) -> bool:
    """The shard's checkpoint points at records the stream no longer holds."""
    if not after or after == RESUME_AT_TRIM_HORIZON:
        return False
    try:
        streams.get_shard_iterator(StreamArn=stream_arn, ShardId=shard_id, ShardIteratorType="AFTER_SEQUENCE_NUMBER",
                                   SequenceNumber=after)
    except ClientError as exc:
        return exc.response.get("Error", {}).get("Code") == "TrimmedDataAccessException"
    return False


def _oldest_held_ms(streams, stream_arn: str, shard_id: str) -> Optional[int]:
    """The shard's oldest record's time (heads.oldest_record_ms), or None when the
    stream does not answer now: then nothing is proven, and the shard stays
    trimmed (the tail, which retries, decides for itself when it starts)."""
    try:
        return oldest_record_ms(streams, stream_arn, shard_id)
    except (ClientError, BotoCoreError) as exc:  # an error answer, or none (a timeout, no connection)
        code = exc.response.get("Error", {}).get("Code") if isinstance(exc, ClientError) else type(exc).__name__
        log.warning("cannot read the oldest record of %s (%s): a trimmed checkpoint there is not proven harmless",
                    shard_id, code)
        return None


def gather(store, streams, stream_arn: Optional[str], now_ms: Optional[int] = None,
           bookkeeping=None, tables: tuple = (), mapping=None) -> Facts:
    """``bookkeeping`` (a ``control.markers.Bookkeeping``) is asked which of
    ``tables`` (and the tables the migration recorded) still hold markers;
    ``mapping`` (the one status was given) is compared with the one the job runs."""
    m = Migration(store)
    progress = store.load_backfill_progress()
    spec = m.source_spec() or {}
    done_ms = store.load_meta("backfill_done_ms")
    verify_text = store.load_meta("verify")
    facts = Facts(
        now_ms=now_ms or time.time_ns() // 1_000_000,
        phase=m.phase,
        handoff_ms=m.handoff_ms,
        backfill_parts=int(spec.get("parts", len(progress))),
        backfill_done_parts=sum(1 for p in progress.values() if p.done),
        backfill_items=sum(p.count for p in progress.values()),
        backfill_expected=int(store.load_meta("backfill_expected") or 0) or None,
        backfill_done_ms=int(done_ms) if done_ms else None,
        dead_letters=store.count_dead_letters(),
        last_verify=json.loads(verify_text) if verify_text else None,
        stream_arn=stream_arn,
    )
    backfill, tail = (LeaseState.parse(store.load_lease(role)) for role in (BACKFILL, TAIL))
    facts.backfill_held, facts.tail_held = (bool(lease and lease.live(facts.now_ms)) for lease in (backfill, tail))
    if tail is not None and not facts.tail_held:
        facts.tail_stopped_ms = tail.expires_ms  # a released lease's is its release time
    queued = store.load_meta(QUEUED_META)
    facts.queued_ms = int(queued) if queued else None
    facts.running_mapping = running_mapping(store)
    if mapping is not None:
        outline = mapping_outline(mapping)
        facts.given_mapping = outline_fingerprint(outline)
        facts.given_changes = tuple(describe_changes((facts.running_mapping or {}).get("outline"), outline))
    if bookkeeping is not None:
        facts.bookkeeping_tables = bookkeeping.remaining(sorted(set(tables) | set(m.marker_tables())))
    if stream_arn:
        # status answers within ~30 s even when the stream endpoint is unreachable
        listed = list_shards(streams, stream_arn, retry=RetryPolicy(0.2, 5.0, READ_ONLY_DEADLINE_S),
                             metrics_table=getattr(store, "job", None)).shards
        ckpts = store.load_checkpoints(stream_arn, listed)  # the listed shards', not every one the stream had
        reports = reported_shards(store, stream_arn)
        heads = store.load_shard_heads(stream_arn)
        retention_s = getattr(streams, "retention_s", None) or STREAM_RETENTION_S
        for shard_id in sorted(listed):
            c = ckpts.get(shard_id)
            finished = bool(c and c.finished)
            seq = c.sequence_number if c else None
            at, pending, ended = reports.get(shard_id, (None, None, True))
            reported_ago = None if at is None else max(0, facts.now_ms - at)
            # A running reader (its tail lease held, its report fresh) stops loudly
            # on trimmed data itself. Any other shard is probed — a holder killed a
            # minute ago leaves a fresh report but no live lease: one
            # GetShardIterator and no record read (docs/operations.md, AWS's limits).
            running = facts.tail_held and not ended and reported_ago is not None and reported_ago <= REPORT_FRESH_MS
            trimmed = not finished and not running and _trimmed(streams, stream_arn, shard_id, seq)
            if trimmed and heads.get(shard_id) is not None and nothing_lost_since_head(
                    heads[shard_id], facts.now_ms, retention_s, _oldest_held_ms(streams, stream_arn, shard_id)):
                trimmed = False  # the tail goes on from the oldest record, nothing lost (docs/design.md §8.2)
            facts.shards.append(ShardStatus(
                shard_id, seq, finished, None if finished or trimmed else pending,
                c.change_ms if c else None, trimmed, reported_ago))
    return facts


def render(f: Facts, flags: str = "") -> list:
    ready, reasons = assess(f, flags)
    when = lambda ms: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000)) if ms else "-"
    lines = [f"phase: {f.phase or '-'}    handoff: {when(f.handoff_ms)}"]
    expected = f" of ~{f.backfill_expected}" if f.backfill_expected else ""
    lines.append(f"backfill: {f.backfill_done_parts}/{f.backfill_parts} parts done, {f.backfill_items} items"
                 f"{expected}; finished {when(f.backfill_done_ms)}")
    lines.append(f"stream: {f.stream_arn or '-'}")
    if f.kinesis_shares is not None:
        lines.append("read budget of the Kinesis stream: " + (", ".join(
            f"{job} {share_text(share)}" for job, share in sorted(f.kinesis_shares.items())) or "no job holds a share")
            + f" (held {share_text(sum(f.kinesis_shares.values(), 0))} of 1)")
    for s in f.shards:
        state = "finished" if s.finished else "TRIMMED (changes lost from the stream)" if s.trimmed else (
            "not read yet" if s.reported_ago_ms is None else
            "at head" if s.pending_since_ms is None else f"lag {s.lag_ms(f.now_ms) / 1000:.1f}s")
        if not s.finished and not s.trimmed:
            state += " (no reader report)" if s.reported_ago_ms is None else \
                f" (reported {s.reported_ago_ms / 1000:.0f}s ago)"
        lines.append(f"  {s.shard_id}: {state}; position {s.sequence_number or 'start'}")
    lines.append(f"retention headroom: {retention_headroom_ms(f) / 3600000:.1f}h")
    lines.append(f"dead letters: {f.dead_letters}")
    lines.append("bookkeeping in the target: " + (", ".join(f.bookkeeping_tables) or "none"))
    v = f.last_verify
    lines.append("last verify: " + ("-" if not v else
                                    f"{'IDENTICAL' if v.get('identical') else 'DIFFERENT'} "
                                    f"({'sampled' if v.get('sampled') else 'full'}) at {when(v.get('checked_at_ms'))}"))
    if any(s.trimmed for s in f.shards):
        lines.append(f"trimmed: recover with ddb2bt recover{' ' + flags if flags else ' -m <mapping>'} (docs/recover.md)")
    lines.append("READY for cutover" if ready else "NOT READY: " + "; ".join(reasons))
    return lines


def table_facts(mapping, store, read_retry, describe: bool = True) -> Facts:
    """One table's facts: its stream from DescribeTable (status still answers,
    without shard lag, when the source cannot be described), its state, its
    marker family. A missing source table is an error: with no stream, a
    retention headroom would be a made-up number. ``describe=False``: the source
    is known to be unreachable (ddb2bt.pipeline.connect.reachability): no stream facts."""
    arn = kinesis_arn = None
    kinesis = mapping.source.kinesis
    streams_factory = StreamsClientFactory(mapping.source.region)
    try:
        if not describe:
            raise ConnectionError("unreachable (see above)")
        if kinesis is not None:  # the tail reads the Kinesis stream (docs/kinesis.md)
            source = resolve_kinesis(mapping)
            arn, kinesis_arn = source.stream_arn, source.kinesis_arn or source.stream_arn
            streams_factory = KinesisClientFactory(kinesis.stream, mapping.source.table, mapping.source.region,
                                                   kinesis.precision)
        else:
            arn = describe_table(dynamodb_client(mapping.source.region), mapping.source.table,
                                 retry=read_retry, metrics_table=mapping.name).get("LatestStreamArn")
    except SourceTableMissing:
        raise
    except Exception as exc:  # status must work even when the source is unreachable
        log.warning("cannot describe %s: %s", mapping.source.table, exc)
    facts = gather(store, streams_factory(), arn,
                   bookkeeping=Bookkeeping.for_target(mapping.target.project, mapping.target.instance),
                   tables=mapping.tables, mapping=mapping)
    if kinesis is not None and kinesis_arn is not None:
        facts = replace(facts, kinesis_shares=held_shares(store, kinesis_arn, facts.now_ms))
    return facts


def render_tables(named: list, flags: Callable[[str], str] = lambda name: "") -> list:
    """A job of several tables: one line per table, then the total. ``named`` is
    [(table name, Facts)]; ``flags(name)`` the options selecting that table's state."""
    lines, ready_count = [], 0
    for name, f in named:
        ready, reasons = assess(f, flags(name))
        ready_count += ready
        lag = max((s.lag_ms(f.now_ms) for s in f.shards if not s.finished), default=0)
        lines.append(f"{name}: {'READY' if ready else 'NOT READY'}  phase {f.phase or '-'}, "
                     f"backfill {f.backfill_done_parts}/{f.backfill_parts} parts, lag {lag / 1000:.1f}s, "
                     f"{f.dead_letters} dead letter(s)" + ("" if ready else " — " + "; ".join(reasons)))
    phases = [f.phase for _, f in named]
    live = sum(1 for p in phases if p == "LIVE")
    lines.append(f"total: {ready_count} of {len(named)} table(s) READY, {live} LIVE, "
                 f"{sum(f.dead_letters for _, f in named)} dead letter(s); "
                 + ("READY for cutover" if ready_count == len(named) else "NOT READY"))
    return lines


def facts_json(f: Facts, flags: str = "") -> dict:
    ready, reasons = assess(f, flags)
    return {"ready": ready, "reasons": reasons, "phase": f.phase, "handoff_ms": f.handoff_ms,
            "dead_letters": f.dead_letters, "last_verify": f.last_verify,
            "bookkeeping_tables": f.bookkeeping_tables, "shards": [vars(s) for s in f.shards]}
