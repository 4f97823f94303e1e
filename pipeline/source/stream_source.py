"""DynamoDB Streams source: an unbounded splittable DoFn over *partitions* of a
stream's shards.

Why partitions, not one element per shard: shard discovery has to run for as long
as the job does, and on the local FnApiRunner a discovery SDF feeding a reader SDF
runs as two sequential stages (the reader would never start). So each element is
``StreamPartition(stream, i, n)``; it owns the shards with ``crc32(shard id) % n == i``
(exactly one reader per shard, far below the limit of 2), discovers shards itself
and reads its shards round-robin. On Dataflow, n partitions spread over workers.

Correctness, per docs/design.md §4 (per-row order) and §8 (trimmed data):
* a shard is read sequentially, one GetRecords page per round, from its last
  claimed sequence number (AFTER_SEQUENCE_NUMBER); the restriction is the set of
  shard positions, so a checkpoint split resumes exactly after the last record
  emitted;
* a child shard starts only when the state table says its parent is finished — the
  sink writes that after acknowledging the parent's last writes — or when the
  parent is gone from the stream; so all changes of a key stay in order;
* a closed shard (no NextShardIterator) emits ``ShardClosed`` and leaves the
  restriction;
* expired iterators are renewed from the last position; throttling and 5xx back
  off with jitter (bounded); trimmed data stops the job (``ChangesLostError``)
  unless ``on_trimmed="restart"``.
"""
from __future__ import annotations

import functools
import logging
import time
import zlib
from collections import Counter
from datetime import datetime, timezone
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Callable, Iterator, Optional

from ddb2bt.transforms.errors import ChangesLostError
from ddb2bt.pipeline.control.state import RESUME_AT_TRIM_HORIZON
from ddb2bt.pipeline.clients.dynamodb import (STREAM_RETENTION_S, IteratorExpired, Listing, ShardDirectory, ShardPacer,
                                      StreamThrottled, endpoint_of, fast_records_decoding, table_of_stream)
from ddb2bt.transforms.limits import DEFAULT_POLL_INTERVAL_S
from ddb2bt.transforms.model import ShardClosed
from ddb2bt.pipeline.observe.metrics import PipelineMetrics
from ddb2bt.pipeline.source.calls import StreamCalls
from ddb2bt.pipeline.source.heads import (ShardHeads, nothing_lost_since_head, oldest_record_ms, trimmed_message,
                                          unproven_note)
from ddb2bt.pipeline.source.pace import ShardPace
from ddb2bt.pipeline.source.records import from_stream_record
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.control.state import ShardCheckpoint

log = logging.getLogger(__name__)

TRIM_HORIZON = "trim_horizon"
LATEST = "latest"
START_MODES = (TRIM_HORIZON, LATEST)
ON_TRIMMED = ("fail", "restart")
GET_RECORDS_LIMIT = 1000  # the service's maximum per call
# ... and its other bound: a page stops at 1 MB of records. The smaller reading
# of "1 MB": a page cut at either is recognised.
GET_RECORDS_MAX_BYTES = 1_000_000
# What the service counts toward that megabyte is not published; its records on
# the wire (DynamoDB JSON: type tags, quotes) run ~1.4x their SizeBytes for
# ~1 KB items (measured, docs/benchmarks.md) and more for short attributes. So a
# page is taken for cut once its SizeBytes pass the megabyte divided by this: a
# page wrongly taken for full costs one more paced call, one wrongly taken for
# the head a poll interval and a lag of zero.
WIRE_BYTES_PER_SIZE_BYTE = 2
# A page may carry this key: how many records a client that reads a stream shared
# by several tables (Kinesis, docs/design.md §10.8) passed over as another
# table's (page_state).
OTHER_TABLES_RECORDS = "OtherTablesRecords"
_EVENT_OF = attrgetter("event_name")  # a page's reads are counted per event type, in C
_SIZE_OF = attrgetter("size_bytes")
# Full pages read from one shard in one round (bundle): up to 10,000 changes, so a
# backlog is drained in large bundles while a bundle's unacknowledged work stays
# small enough to redo quickly after a failure.
PAGES_PER_ROUND = 10
# After a shard closes its children may be listed: a listing of the stream at
# most this old (another partition's, shared through the ShardDirectory) will do.
REDISCOVERY_MAX_AGE_S = 1.0

_STOP_REQUESTS: set = set()
STOP_ALL = "*"  # every reader in this process (Ctrl-C, SIGTERM: ddb2bt.pipeline.signals)


def request_stop(token: str) -> None:
    _STOP_REQUESTS.add(token)


def clear_stop(token: str) -> None:
    _STOP_REQUESTS.discard(token)


def stop_requested(token: Optional[str]) -> bool:
    return STOP_ALL in _STOP_REQUESTS or (token is not None and token in _STOP_REQUESTS)


# In-process holds on ending at idleness (local runs), by stop token: a writer in the
# same process that is still writing (the demo; its pauses under load can outlast
# until_idle_s) keeps the readers polling. Each held round restarts the idle wait, so
# after the release a reader polls at least once more (until_idle_s less one poll
# interval later) before it can end: what was written just before is read.
_IDLE_END_HOLDS: set = set()


def hold_idle_end(token: str) -> None:
    _IDLE_END_HOLDS.add(token)


def release_idle_end(token: str) -> None:
    _IDLE_END_HOLDS.discard(token)


def idle_end(options: "ReaderOptions", idle_since_ms: int, now_ms: int, waiting: bool, tracker) -> str:
    """An idle reader's next step: "end" once idle for ``until_idle_s`` with no
    shard waiting for its parent, else "poll"; while its stop token's end is held
    (``hold_idle_end``), the idle wait starts over each round."""
    until = options.until_idle_s
    if until is None or waiting or now_ms - idle_since_ms < until * 1000:
        return "poll"
    if options.stop_token is not None and options.stop_token in _IDLE_END_HOLDS:
        tracker.try_claim(ClaimIdle(now_ms))
        return "poll"
    return "end"


def after_round(options: "ReaderOptions", tracker, result: "RoundResult", now_ms: int, waiting: bool) -> str:
    """A partition's next step after a round: "continue" (it read something, or
    is not at its head), "poll" (idle: wait, the idle time claimed from now on),
    "end" (idle for ``until_idle_s``, idle_end)."""
    r = tracker.current_restriction()
    if not result.at_head:
        if r.idle_since_ms is not None:
            tracker.try_claim(ClaimIdle(None))
        return "continue"
    if r.idle_since_ms is None:
        tracker.try_claim(ClaimIdle(now_ms))
        return "poll"
    return idle_end(options, r.idle_since_ms, now_ms, waiting, tracker)


@dataclass(frozen=True)
class ReaderOptions:
    start: str = TRIM_HORIZON
    # The job had no checkpoint and no recorded start when launched
    # (preflight.settle_start): only then does ``start`` apply; a restarted job
    # starts every shard without a checkpoint at TRIM_HORIZON (docs/design.md §6.3).
    fresh: bool = True
    on_trimmed: str = "fail"
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    discovery_interval_s: float = 10.0
    until_idle_s: Optional[float] = None
    # On the local FnApiRunner a deferral's delay is ignored: sleep when idle instead.
    sleep_when_idle: bool = True
    # In-process stop requests (local runs): `request_stop(token)` ends the reading
    # cleanly at the next round, everything read so far written and checkpointed.
    stop_token: Optional[str] = None
    # Readers that have caught up (control/catchup.py) move a finished migration CATCHING_UP → LIVE
    # (control.phases.advance): Dataflow's migrate, or `run` next to a backfill.
    promote_live: bool = True
    # The job's lease (ddb2bt.pipeline.control.lease.LeaseSpec): every round asks its coordinator, so
    # a process that lost it stops even while it has nothing to write.
    lease: Optional[object] = None
    retry: RetryPolicy = RetryPolicy(initial_s=0.2, max_backoff_s=20.0, deadline_s=300.0)

    def __post_init__(self) -> None:
        if self.start not in START_MODES:
            raise ValueError(f"start must be one of {START_MODES}")
        if self.on_trimmed not in ON_TRIMMED:
            raise ValueError(f"on_trimmed must be one of {ON_TRIMMED}")


@functools.lru_cache(maxsize=1 << 16)
def shard_hash(shard_id: str) -> int:
    """The CRC-32 of a shard id, which places the shard in a partition;
    remembered, as every partition asks it of every listed shard on each
    discovery."""
    return zlib.crc32(shard_id.encode())


@dataclass(frozen=True)
class StreamPartition:
    stream_arn: str
    index: int
    count: int

    def owns(self, shard_id: str) -> bool:
        return shard_hash(shard_id) % self.count == self.index


# A shard started at LATEST whose first iterator cannot be used again (another
# DoFn instance, a worker failover, a rebalanced partition, an iterator expired
# after 15 minutes) is read again from TRIM_HORIZON, its records stamped more
# than this before the first LATEST iterator skipped: AWS stamps records to the
# second on its own clock, this host's clock may differ by seconds (NTP), and
# re-reading a little more is harmless (a restarted job re-reads from
# TRIM_HORIZON, docs/design.md §6.3).
LATEST_REREAD_MARGIN_MS = 300_000


@dataclass(frozen=True)
class ShardPos:
    """Where to resume a shard: after a sequence number, or at a start mode.

    ``since_ms``: a LATEST position whose first iterator was made at that time
    (this host's clock). Only that first GetShardIterator is LATEST: any later
    one of the position (it never advanced: no record read yet) reads from
    TRIM_HORIZON and skips the records stamped before ``since_ms`` less
    LATEST_REREAD_MARGIN_MS (``skips``), so nothing written after the first
    iterator is skipped, whichever instance makes the next one."""

    after: Optional[str] = None
    mode: str = TRIM_HORIZON
    since_ms: Optional[int] = None

    def iterator_args(self) -> dict:
        if self.after is not None:
            return {"ShardIteratorType": "AFTER_SEQUENCE_NUMBER", "SequenceNumber": self.after}
        if self.mode == LATEST and self.since_ms is not None:
            return {"ShardIteratorType": "TRIM_HORIZON"}
        return {"ShardIteratorType": self.mode.upper()}

    @property
    def unstamped_latest(self) -> bool:
        """A LATEST position no iterator was made for yet."""
        return self.after is None and self.mode == LATEST and self.since_ms is None

    def skips_before_ms(self) -> Optional[int]:
        """Records stamped before this (ms) are older than the start: not emitted."""
        if self.after is None and self.mode == LATEST and self.since_ms is not None:
            return self.since_ms - LATEST_REREAD_MARGIN_MS
        return None


@dataclass(frozen=True)
class PartitionRestriction:
    """The SDF restriction: every active shard's position, the shards already read
    to their end (so discovery does not restart them), idle bookkeeping."""

    positions: tuple = ()  # ((shard_id, ShardPos), ...) sorted by shard id
    closed: frozenset = frozenset()
    discovered_once: bool = False
    idle_since_ms: Optional[int] = None
    done: bool = False
    # Wall ms of the partition's latest GetRecords call: the shards' pace travels
    # with the restriction, so a residual resumed by another DoFn instance or
    # worker waits out AWS's 5 calls per second per shard from it (every shard
    # taken as called then: never sooner than the previous holder allowed).
    last_call_ms: Optional[int] = None

    def position_map(self) -> dict:
        return dict(self.positions)


# Claims, in the order the reader makes them.
@dataclass(frozen=True)
class ClaimStart:
    shard_id: str
    pos: ShardPos


@dataclass(frozen=True)
class ClaimRecord:
    shard_id: str
    sequence_number: str


@dataclass(frozen=True)
class ClaimClosed:
    shard_id: str


@dataclass(frozen=True)
class ClaimForget:
    shard_id: str


@dataclass(frozen=True)
class ClaimIdle:
    since_ms: Optional[int]


@dataclass(frozen=True)
class ClaimDiscovered:
    pass


@dataclass(frozen=True)
class ClaimEnd:
    pass


@dataclass(frozen=True)
class ClaimCalled:
    """A GetRecords call is made at ``at_ms`` (wall clock)."""

    at_ms: int


# The per-record claim builds a ShardPos and a PartitionRestriction for every
# record read: filled in one dict update instead of a frozen dataclass __init__
# (one object.__setattr__ per field), about half the cost. Same fields, values,
# equality, hash and pickling as the constructor's (a unit test compares them).
_new_object = object.__new__


def _shard_pos_after(sequence_number: str) -> ShardPos:
    pos = _new_object(ShardPos)
    pos.__dict__.update(after=sequence_number, mode=TRIM_HORIZON, since_ms=None)
    return pos


def _restriction(positions: tuple, closed: frozenset, discovered_once: bool, idle_since_ms: Optional[int],
                 done: bool, last_call_ms: Optional[int]) -> PartitionRestriction:
    r = _new_object(PartitionRestriction)
    r.__dict__.update(positions=positions, closed=closed, discovered_once=discovered_once,
                      idle_since_ms=idle_since_ms, done=done, last_call_ms=last_call_ms)
    return r


def apply_claim(r: PartitionRestriction, claim) -> PartitionRestriction:
    """Pure restriction update for one claim."""
    if type(claim) is ClaimRecord:  # once per record: built directly, not with replace()
        entry = (claim.shard_id, _shard_pos_after(claim.sequence_number))
        positions = r.positions
        if len(positions) == 1 and positions[0][0] == claim.shard_id:
            positions = (entry,)
        else:
            pos = dict(positions)
            pos[claim.shard_id] = entry[1]
            positions = tuple(sorted(pos.items()))
        return _restriction(positions, r.closed, r.discovered_once, None, r.done, r.last_call_ms)
    if type(claim) is ClaimCalled:  # once per GetRecords call: O(1), whatever the shard count
        return _restriction(r.positions, r.closed, r.discovered_once, r.idle_since_ms, r.done, claim.at_ms)
    if isinstance(claim, ClaimStart):
        pos = r.position_map()
        pos[claim.shard_id] = claim.pos
        return replace(r, positions=tuple(sorted(pos.items())))
    if isinstance(claim, ClaimClosed):
        pos = r.position_map()
        pos.pop(claim.shard_id, None)
        return replace(r, positions=tuple(sorted(pos.items())), closed=r.closed | {claim.shard_id})
    if isinstance(claim, ClaimForget):
        return replace(r, closed=r.closed - {claim.shard_id})
    if isinstance(claim, ClaimIdle):
        return replace(r, idle_since_ms=claim.since_ms)
    if isinstance(claim, ClaimDiscovered):
        return replace(r, discovered_once=True)
    if isinstance(claim, ClaimEnd):
        return replace(r, done=True)
    raise TypeError(f"unknown claim {claim!r}")


def _not_started(listing: Listing, partition: StreamPartition, r: PartitionRestriction) -> list:
    """The partition's listed shards it neither reads nor knows closed, in order."""
    active = r.position_map()
    return [s for s in sorted(listing.shards) if partition.owns(s) and s not in active and s not in r.closed]


def checkpoints_needed(listing: Listing, partition: StreamPartition, r: PartitionRestriction) -> set:
    """Pure: the shards whose checkpoints ``plan_starts`` reads — the partition's
    listed shards not started, their parents, and its closed ones."""
    needed = set(r.closed)
    for shard_id in _not_started(listing, partition, r):
        needed.add(shard_id)
        if listing.shards[shard_id]:
            needed.add(listing.shards[shard_id])
    return needed


def plan_starts(listing: Listing, partition: StreamPartition, r: PartitionRestriction,
                checkpoints: dict, start_mode: str, fresh: bool = True) -> tuple:
    """Pure lineage planning: ([ClaimStart/ClaimClosed/ClaimForget...], waiting ids).

    A shard of ours that is neither active nor known-closed starts when it has no
    parent, its parent is no longer listed (aged out), or its parent is recorded
    finished in the state table. Shards present at the very first discovery of a
    ``fresh`` job (no checkpoint, no recorded start when it was launched) start at
    ``start_mode``; every other shard without a checkpoint starts at TRIM_HORIZON:
    new children (nothing between discovery rounds is missed), and on a restarted
    job the shards it never checkpointed (quiet ones, ones born while it was
    down), whose changes since the job stopped a later start would skip.
    """
    claims: list = []
    waiting: list = []
    for shard_id in _not_started(listing, partition, r):
        ckpt: Optional[ShardCheckpoint] = checkpoints.get(shard_id)
        if ckpt is not None and ckpt.finished:
            # Recorded finished in the state table: nothing to read, and nothing
            # for the restriction to remember (it is committed every round; a
            # table with thousands of closed shards made it hundreds of KB).
            continue
        parent = listing.shards[shard_id]
        parent_ckpt = checkpoints.get(parent) if parent else None
        parent_done = parent is None or parent not in listing.shards or (parent_ckpt is not None and parent_ckpt.finished)
        if not parent_done:
            waiting.append(shard_id)
            continue
        if ckpt is not None and ckpt.sequence_number == RESUME_AT_TRIM_HORIZON:
            pos = ShardPos(mode=TRIM_HORIZON)  # recovered from incremental exports (recover/recover.py)
        elif ckpt is not None and ckpt.sequence_number:
            pos = ShardPos(after=ckpt.sequence_number)
        elif fresh and not r.discovered_once and (parent is None or parent not in listing.shards):
            pos = ShardPos(mode=start_mode)
        else:
            pos = ShardPos(mode=TRIM_HORIZON)
        claims.append(ClaimStart(shard_id, pos))
    for shard_id in sorted(r.closed):
        ckpt = checkpoints.get(shard_id)
        # Aged out of the stream, or recorded finished (the sink records a shard
        # finished once every write before its end is acknowledged): the
        # restriction keeps only what the state table does not already record.
        if shard_id not in listing.shards or (ckpt is not None and ckpt.finished):
            claims.append(ClaimForget(shard_id))
    return claims, waiting


@dataclass
class RoundResult:
    records: int = 0
    at_head: bool = True
    finished: bool = False  # the partition is done (until-idle reached)
    stopped: bool = False  # a claim failed: the runner split us, return now
    # The round ended because its next shard may not be called yet (5 GetRecords/s
    # per shard): the reader hands the wait back to the runner instead of sleeping
    # in it, so other partitions of the process read meanwhile. Seconds to wait.
    paced_s: Optional[float] = None
    # An idle round that came before its idle poll was due (no call): seconds
    # until it is (None: a full poll interval, the round read every shard).
    idle_wait_s: Optional[float] = None


def iterator_args_for(client, pos: ShardPos) -> dict:
    """GetShardIterator's arguments for ``pos``: a LATEST position re-read from
    its first iterator's time starts at AT_TIMESTAMP on a stream that has it
    (Kinesis: ``reads_at_timestamp``) rather than re-reading its retention."""
    skips_before = pos.skips_before_ms()
    if skips_before is not None and getattr(client, "reads_at_timestamp", False):
        return {"ShardIteratorType": "AT_TIMESTAMP",
                "Timestamp": datetime.fromtimestamp(skips_before / 1000, timezone.utc)}
    return pos.iterator_args()


def skip_older(decoded: list, before_ms: Optional[int]) -> list:
    """The records of a page to emit: all, or those stamped at or after ``before_ms``
    (a LATEST position re-read from TRIM_HORIZON, ShardPos.skips_before_ms)."""
    if before_ms is None:
        return decoded
    return [rec for rec in decoded if rec.change_ms >= before_ms]


def page_is_full(records: list) -> bool:
    """Whether a GetRecords page (its ChangeRecords) may have stopped at one of the
    service's bounds rather than at the shard's head: 1,000 records, or 1 MB —
    told by its records' SizeBytes, the page's and its largest record's together
    (the next record, of a like size, would not have fitted) over the megabyte as
    SizeBytes may count it (WIRE_BYTES_PER_SIZE_BYTE: the wire form is larger). A
    page whose records carry no sizes (an emulator's 0) is full at 1,000 only.
    Kinesis pages (the same reader) stop at 10 MB: one of theirs over 1 MB is
    taken for full too — conservatively: one more paced call, which finds the
    head, and the lag counted until then."""
    if len(records) >= GET_RECORDS_LIMIT:
        return True
    sizes = list(map(_SIZE_OF, records))
    return bool(sizes) and sum(sizes) + max(sizes) > GET_RECORDS_MAX_BYTES // WIRE_BYTES_PER_SIZE_BYTE


# A Kinesis page this close to the tip (MillisBehindLatest, ms) is at it. Under
# constant writes a page that reached the tip may still say a few ms: a page
# that must say exactly 0 would let another table's steady traffic keep a quiet
# table from ever being proven at its head. An empty page is dated this much
# earlier (ShardHeads.on_page), so a head proof never claims more than was read.
TIP_SLACK_MS = 1000


def page_state(page: dict, decoded: list, now_ms: int, pending: Optional[int]) -> tuple:
    """(empty, full, pending) of a GetRecords ``page`` of an open shard and its
    ``decoded`` records of this table (docs/design.md §7.8): whether it is a step
    toward the head; whether more may follow (another turn, paced); and the
    oldest unread record's time, ms — None at the head. ``pending``: the
    shard's estimate before this page.

    Kinesis says whether a page reached the tip: a page behind it
    (``MillisBehindLatest`` over TIP_SLACK_MS) has records ahead, so it is
    neither empty nor the head, even without records (Kinesis documents empty
    pages mid-shard); without records of this table, the next unread record
    reached the stream that long ago. Of a stream shared by several tables, a
    page of only other tables' records (OTHER_TABLES_RECORDS) is empty at the
    tip, and without the figure taken for one behind it (its bound cannot be
    told from here; the estimate stands, or is now). A page of GET_RECORDS_LIMIT
    records, ours and theirs, is behind the tip whatever the figure. Otherwise a
    page is full at the service's bounds (page_is_full), and empty without
    records."""
    behind = page.get("MillisBehindLatest")
    passed_over = page.get(OTHER_TABLES_RECORDS, 0)
    # A page full of records, ours or not, may have stopped at the bound whatever
    # the figure says (moto's figure is the records' creation times' spread).
    ahead = ((behind > TIP_SLACK_MS if behind is not None else passed_over > 0)
             or len(decoded) + passed_over >= GET_RECORDS_LIMIT)
    if decoded:
        # A full page: more may follow, and the next unread record is at least as new
        # as the last one read (a conservative lag); else at the head.
        full = ahead or page_is_full(decoded)
        return False, full, decoded[-1].change_ms if full else None
    if ahead:
        return False, True, now_ms - behind if behind is not None else (pending if pending is not None else now_ms)
    return True, False, None


class PartitionReader:
    """Reads one partition's shards, one round at a time. Beam-free: the SDF calls
    ``read_round`` with its tracker's claim function; tests call it directly."""

    def __init__(self, client, partition: StreamPartition, options: ReaderOptions,
                 load_checkpoints: Callable[[str, set], dict], metrics: Optional[PipelineMetrics] = None,
                 now_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
                 sleep: Callable[[float], None] = time.sleep, directory: Optional[ShardDirectory] = None,
                 pacer: Optional[ShardPacer] = None, hand_back_pacing: bool = False,
                 load_heads: Optional[Callable[[str], dict]] = None,
                 between_attempts: Optional[Callable[[], None]] = None,
                 describe_slot: Optional[Callable[[], object]] = None) -> None:
        self._client = client
        fast_records_decoding(client)  # GetRecords pages through the C JSON parser
        # Within AWS's limits (docs/operations.md): the stream's shards are listed
        # once per process for all its partitions (the SDF passes the process's
        # ShardDirectory; alone, a reader has its own); GetRecords is paced per shard.
        self._directory = directory if directory is not None else ShardDirectory()
        # A client with a rate of its own (a Kinesis table's share of the shard's
        # budget, docs/design.md §10.8) paces the rounds at it: the hand-back then
        # waits for it instead of the client sleeping in GetRecords.
        rate = getattr(client, "calls_per_s", None)
        if pacer is None:
            pacer = ShardPacer(rate, sleep=sleep) if isinstance(rate, (int, float)) else ShardPacer(sleep=sleep)
        self._pace = ShardPace(pacer, options.poll_interval_s)
        # The splittable DoFn's readers: a round that would wait for the pacer ends
        # and returns the wait to the runner (RoundResult.paced_s).
        self._hand_back_pacing = hand_back_pacing
        self._closed_since: list = []  # shards closed since the last discovery: their children are asked for
        self._partition = partition
        self._options = options
        self._load_checkpoints = load_checkpoints
        # The table's view of the metrics (the SDF passes it; given the process's,
        # the stream's table name is the label).
        self._metrics = metrics.for_table(table_of_stream(partition.stream_arn)) \
            if isinstance(metrics, PipelineMetrics) else metrics
        self._now_ms = now_ms
        self._sleep = sleep
        self._iterators: dict = {}  # shard id -> (ShardPos it was made for, iterator)
        # shard id -> creation ms of the oldest record not read yet (None: at the
        # head), for `status` (saved by the SDF, see pending_since)
        self._pending: dict = {}
        self._last_discovery_ms: Optional[int] = None
        self._waiting: list = []
        self._table = self._metrics.table if self._metrics is not None else table_of_stream(partition.stream_arn)
        if self._metrics is not None:
            self._metrics.lag.label(partition.stream_arn, self._table)
        # Remote calls under one retry policy; between attempts, the coordinator's
        # lease check: no retry outlives the lease.
        # Each DescribeStream attempt first waits for its slot of the stream's
        # schedule shared by every process (control/shared_rate.py; the SDF passes it).
        self._call = StreamCalls(self._metrics, self._table, options.retry, sleep,
                                 endpoint_of(client, "DynamoDB Streams"), between_attempts,
                                 slots={"DescribeStream": describe_slot} if describe_slot else None)
        # When each shard was last seen at its head: what proves that a trimmed
        # checkpoint lost nothing (docs/design.md §8.2).
        self._shard_heads = ShardHeads(partition.stream_arn, now_ms, self._metrics, load_heads)

    # -- discovery
    def discover(self, tracker) -> bool:
        r = tracker.current_restriction()
        claim = tracker.try_claim
        stream_arn, closed = self._partition.stream_arn, self._closed_since
        if closed:  # their children only (CHILD_SHARDS), not the whole stream again
            listing = self._directory.children(self._client, stream_arn, closed, self._call,
                                               REDISCOVERY_MAX_AGE_S,
                                               listers=self._partition.count)
        else:  # spaced so that every partition count stays within AWS's DescribeStream limit
            listing = self._directory.listing(self._client, stream_arn, self._call,
                                              self._options.discovery_interval_s, listers=self._partition.count)
        self._closed_since = []
        checkpoints = self._load_checkpoints(stream_arn, checkpoints_needed(listing, self._partition, r))
        claims, self._waiting = plan_starts(listing, self._partition, r, checkpoints,
                                            self._options.start, self._options.fresh)
        for c in claims + [ClaimDiscovered()]:
            if not claim(c):
                return False
        self._last_discovery_ms = self._now_ms()
        if self._metrics:
            self._metrics.shards.labels("open").set(len(listing.shards) - len(listing.closed_ids))
            self._metrics.shards.labels("closed").set(len(listing.closed_ids))
            self._metrics.shards.labels("waiting_for_parent").set(len(self._waiting))
        return True

    def _discovery_due(self, r: PartitionRestriction) -> bool:
        if not r.discovered_once or self._last_discovery_ms is None:
            return True
        return self._now_ms() - self._last_discovery_ms >= self._options.discovery_interval_s * 1000

    # -- reading
    def _iterator(self, shard_id: str, pos: ShardPos) -> str:
        cached = self._iterators.get(shard_id)
        if cached is not None and cached[0] == pos:
            return cached[1]
        args = iterator_args_for(self._client, pos)
        try:
            it = self._call("GetShardIterator", lambda: self._client.get_shard_iterator(
                StreamArn=self._partition.stream_arn, ShardId=shard_id, **args))["ShardIterator"]
        except ChangesLostError:
            it = self._on_trimmed(shard_id, pos)
        self._iterators[shard_id] = (pos, it)
        return it

    def _on_trimmed(self, shard_id: str, pos: ShardPos) -> str:
        where = f"after sequence number {pos.after}" if pos.after else pos.mode
        message = trimmed_message(shard_id, self._partition.stream_arn, where)
        head_ms = self._shard_heads.last_head_ms(shard_id)
        retention_s = getattr(self._client, "retention_s", None) or STREAM_RETENTION_S
        now = self._now_ms()
        oldest_ms = None if head_ms is None else oldest_record_ms(
            self._client, self._partition.stream_arn, shard_id, self._call, lambda: self._pace.pacer.wait(shard_id))
        if nothing_lost_since_head(head_ms, now, retention_s, oldest_ms):
            # Seen at its head, and a record from before then still held: nothing
            # after the sighting was trimmed (heads.py, nothing_lost_since_head).
            log.warning("shard %s of %s: its checkpoint (%s) has aged out of the stream, but no change was "
                        "lost: the job saw the shard at its head %.1f h ago and the oldest record the shard "
                        "still holds is %.1f h older than that, so every change since is still in the stream. "
                        "Continuing from TRIM_HORIZON (docs/design.md §8.2).", shard_id,
                        self._partition.stream_arn, where, (now - head_ms) / 3_600_000,
                        (head_ms - oldest_ms) / 3_600_000)
            return self._call("GetShardIterator", lambda: self._client.get_shard_iterator(
                StreamArn=self._partition.stream_arn, ShardId=shard_id,
                ShardIteratorType="TRIM_HORIZON"))["ShardIterator"]
        message += unproven_note(head_ms, now, retention_s, oldest_ms)
        if self._options.on_trimmed != "restart":
            raise ChangesLostError(message)
        log.error("%s Continuing from TRIM_HORIZON because --on-trimmed=restart (or a re-copy, migrate "
                  "--restart, whose backfill restores what was lost).", message)
        if self._metrics:
            self._metrics.trimmed_restarts.inc()
        return self._call("GetShardIterator", lambda: self._client.get_shard_iterator(
            StreamArn=self._partition.stream_arn, ShardId=shard_id, ShardIteratorType="TRIM_HORIZON"))["ShardIterator"]

    def heads(self) -> dict:
        """{shard id: the latest time (ms, this host's clock) it was seen at its
        head} of the shards this partition reads, for the state table."""
        return self._shard_heads.heads(self._iterators)

    def _get_records(self, shard_id: str, pos: ShardPos) -> dict:
        for _ in range(3):  # an iterator can expire between renewal and use; renew at most twice
            iterator = self._iterator(shard_id, pos)
            self._pace.pacer.wait(shard_id)  # at most GET_RECORDS_PER_SHARD_PER_S on this shard
            try:
                return self._call("GetRecords", lambda: self._client.get_records(
                    ShardIterator=iterator, Limit=GET_RECORDS_LIMIT))
            except IteratorExpired:
                self._iterators.pop(shard_id, None)
                if self._metrics:
                    self._metrics.iterator_refreshes.inc()
            except ChangesLostError:
                self._iterators.pop(shard_id, None)
                self._iterators[shard_id] = (pos, self._on_trimmed(shard_id, pos))
        raise StreamThrottled(f"GetRecords on {shard_id}: iterator kept expiring")

    def _stamp_latest(self, tracker, shard_id: str, pos: ShardPos) -> bool:
        """Make the LATEST position's first (and only LATEST) iterator and claim
        its time; False when the claim fails (the runner split us)."""
        stamped = ShardPos(mode=LATEST, since_ms=self._now_ms())
        iterator = self._iterator(shard_id, pos)
        if not tracker.try_claim(ClaimStart(shard_id, stamped)):
            return False
        self._iterators[shard_id] = (stamped, iterator)
        return True

    def _wait_for(self, shard_id: str) -> float:
        return self._pace.ready_in(shard_id, self._pending.get(shard_id))

    def read_round(self, tracker) -> Iterator:
        """Discover if due, then read every active shard (a page, or up to
        PAGES_PER_ROUND while its pages come back full), yielding
        ChangeRecord / ShardClosed; returns (as the generator's value) a RoundResult.
        ``tracker.try_claim(c) -> bool`` updates the restriction; False means the
        runner split us and the round must stop at once."""
        result = RoundResult()
        claim = tracker.try_claim
        if self._discovery_due(tracker.current_restriction()):
            if not self.discover(tracker):
                result.stopped = True
                return result
        # A shard with a backlog gets up to PAGES_PER_ROUND full pages in one
        # round (one bundle): fewer bundles amortise the runner's per-bundle cost.
        # The shards take turns, a page each: a shard's next call then comes after
        # the other shards' calls, so the pacer (5 GetRecords/s per shard) rarely
        # has to wait, and N shards in a backlog read about N pages in the time
        # one shard may read one, instead of each shard's pages one after another
        # with a pacing sleep between every two. A page short of both bounds
        # (page_is_full) means the shard is at its head: it leaves the round.
        stream_arn, metrics = self._partition.stream_arn, self._metrics
        on_read = metrics.lag.on_read if metrics else None
        turns = list(tracker.current_restriction().positions)
        self._pace.resume(tracker.current_restriction().last_call_ms, turns, self._now_ms())  # whoever read last
        for _ in range(PAGES_PER_ROUND):
            if not turns:
                break
            still_full: list = []
            paced: list = []  # (wait, shard, position) of shards read too recently for another call
            for shard_id, pos in turns:
                wait = self._wait_for(shard_id) if self._hand_back_pacing else 0.0
                if wait > 0:
                    # Read a moment ago: another shard's turn, or the round ends and the
                    # runner gets the wait (other partitions read meanwhile). Without
                    # hand-back (a plain loop, tests) the pacer sleeps in _get_records.
                    paced.append((wait, shard_id, pos))
                    continue
                if tracker.current_restriction().done:  # split: the rest is the residual's; a page read
                    result.stopped = True  # now (1 of the shard's 5 calls/s) could not be claimed
                    return result
                if not pos.unstamped_latest:
                    if not claim(ClaimCalled(self._pace.calling(self._now_ms()))):
                        result.stopped = True  # the call's time travels with the restriction (its pace)
                        return result
                if pos.unstamped_latest:
                    # The shard's first iterator, at LATEST: its time goes into the
                    # restriction before anything is read from it, so whichever instance
                    # makes the next iterator starts where this one did (ShardPos.since_ms).
                    # Read from the next round on (the restriction committed by then).
                    if not self._stamp_latest(tracker, shard_id, pos):
                        result.stopped = True
                        return result
                    continue
                page = self._get_records(shard_id, pos)
                records = page.get("Records", [])
                rec = None
                if records:
                    decoded = [from_stream_record(raw, stream_arn, shard_id) for raw in records]
                    rec = decoded[-1]
                    # The page is claimed whole, up to its last record, before any of it is
                    # emitted: all that is claimed is emitted (a split meanwhile stops the next
                    # claim), so a residual resumes right after the last record emitted.
                    if not claim(ClaimRecord(shard_id, rec.position.sequence_number)):
                        result.stopped = True
                        return result
                    emitted = skip_older(decoded, pos.skips_before_ms())
                    if on_read is not None and emitted:  # per page and event type, before the sink
                        on_read(stream_arn, shard_id, emitted[0].change_ms, len(emitted))
                        for event_name, count in Counter(map(_EVENT_OF, emitted)).items():
                            metrics.read(self._table, event_name, count)
                    yield from emitted
                    result.records += len(emitted)
                    result.at_head = False
                new_pos = ShardPos(after=records[-1]["dynamodb"]["SequenceNumber"]) if records else pos
                nxt = page.get("NextShardIterator")
                empty, full, pending = page_state(page, decoded if records else (), self._now_ms(),
                                                  self._pending.get(shard_id))
                result.at_head = result.at_head and empty
                self._pending[shard_id] = pending if nxt is not None else None
                self._pace.page(shard_id, empty)
                if nxt is None:
                    if not claim(ClaimClosed(shard_id)):
                        result.stopped = True
                        return result
                    self._iterators.pop(shard_id, None)
                    self._pending.pop(shard_id, None)
                    yield ShardClosed(self._partition.stream_arn, shard_id, new_pos.after)
                    # Discover again next round: this shard's children can start as
                    # soon as the sink has recorded it finished.
                    self._last_discovery_ms = None
                    self._closed_since.append(shard_id)
                    self._pace.closed(shard_id)
                    result.at_head = False
                    continue  # closed: out of the round
                self._iterators[shard_id] = (new_pos, nxt)
                self._shard_heads.on_page(shard_id, page, empty)
                if full:
                    still_full.append((shard_id, new_pos))  # more may follow: another turn
            if paced and not still_full:  # nothing left to read now: the runner waits, not us
                if result.records == 0 and all(self._pace.idle(s, self._pending.get(s))
                                               for _, s, _ in paced):
                    # Every shard was at its head, and empty, when last read: an idle
                    # poll that came early, an idle round, and the wait until it is due.
                    result.idle_wait_s = min(w for w, _, _ in paced)
                    return result
                # Until the first of the partition's shards may be read, this round's included.
                result.paced_s = min(self._wait_for(s) for s, _ in tracker.current_restriction().positions)
                result.at_head = False
                return result
            turns = still_full + [(shard_id, pos) for _, shard_id, pos in paced]
        return result

    def shard_ids(self) -> list:
        """The shards this partition is reading (closed ones leave)."""
        return list(self._iterators)

    @property
    def waiting(self) -> list:
        return list(self._waiting)

    def pending_since(self) -> dict:
        """{shard id: creation ms of the oldest record not read yet, None at the
        head} of the shards this partition reads (closed ones leave)."""
        active = dict(self._pending)
        for shard_id in [s for s in active if s not in self._iterators]:
            del active[shard_id]  # closed (read to its end) or never read
        return active

    def idle_decision(self, tracker, result: RoundResult) -> str:
        """After a round: "continue" (more data), "poll" (idle, wait), "end" (after_round)."""
        return after_round(self._options, tracker, result, self._now_ms(), bool(self._waiting))


class LocalTracker:
    """A restriction tracker without Beam, for tests and one-shot tools."""

    def __init__(self, restriction: PartitionRestriction = PartitionRestriction()) -> None:
        self._r = restriction
        self.claims: list = []

    def current_restriction(self) -> PartitionRestriction:
        return self._r

    def try_claim(self, claim) -> bool:
        if self._r.done:
            return False
        self.claims.append(claim)
        self._r = apply_claim(self._r, claim)
        return True


def drain(gen: Iterator) -> tuple:
    """Run a generator to completion: (elements, its return value)."""
    out: list = []
    while True:
        try:
            out.append(next(gen))
        except StopIteration as stop:
            return out, stop.value


def drain_round(reader: PartitionReader, tracker) -> tuple:
    """Run one round to completion: (elements, RoundResult). For tests and tools."""
    return drain(reader.read_round(tracker))

