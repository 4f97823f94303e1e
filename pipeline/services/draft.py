"""The reads behind ``ddb2bt draft`` and ``create-table --split-from-sample``:
DescribeTable, DescribeTimeToLive, DescribeContinuousBackups, and a bounded
parallel sample of items. The drafting itself is pure
(``ddb2bt.transforms.draft``).

The sample is spread over the whole key space: every parallel Scan segment (a
hash range) reads up to ten times its share and keeps a uniform reservoir of it,
plus a few items of every entity type it read and its largest item, so a type
a scan reaches last is not missed. It is bounded four ways: about N items are
kept (memory holds them and one page per segment), at most ten times N are read,
the read budget is the backfill's ``TokenBucket`` (``--max-rcu``, capacity units
per second, charged from what the service reports), and a deadline stops it
(the items read so far are the sample).
"""
from __future__ import annotations

import logging
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

from botocore.exceptions import BotoCoreError, ClientError

from ddb2bt.pipeline.clients.dynamodb import (DEFAULT_READ_RETRY, MAX_SCAN_THREADS, SCAN_PAGE_LIMIT, TokenBucket,
                                      describe_table, scan_pages)
from ddb2bt.transforms.draft import (MAX_ENTITY_TYPES, RARE_TYPE_ITEMS, Assessment, Draft, SampleFacts, TableFacts,
                                     assess, draft_mapping, item_size, split_points, table_facts, type_signature)
from ddb2bt.transforms.errors import PermanentError
from ddb2bt.transforms.lint import lint

log = logging.getLogger("ddb2bt.draft")

DEFAULT_SAMPLE_ITEMS = 1000
# Segments read in parallel: enough to spread the sample over the table's key
# space (each segment is a hash range), few enough that a small N is not thinned
# to a handful of items per segment.
DEFAULT_SAMPLE_SEGMENTS = 8
# A sample is a look, not a backfill: it gives up reading after this long and
# drafts from what it has.
DEFAULT_SAMPLE_DEADLINE_S = 120.0
# Each segment reads up to this many items per item it keeps, and draws its share
# from all of them (a reservoir): a type stored where a scan reaches it last is
# still sampled, and a table up to this many times the sample is read whole.
DEFAULT_READ_FACTOR = 10
# Entity-type signatures a segment tracks for its rare keeps, at most (more
# distinct prefixes than entity types are data, not types).
MAX_SIGNATURES = 4 * MAX_ENTITY_TYPES
_ACCESS_DENIED = ("AccessDeniedException", "UnrecognizedClientException", "AccessDenied")


class DraftRefused(PermanentError):
    """Nothing useful can be drafted (no table, no permission, no items)."""


def _denied(exc: Exception, operation: str, table: str) -> Optional[DraftRefused]:
    if isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") in _ACCESS_DENIED:
        return DraftRefused(f"{operation} on DynamoDB table {table!r} was refused (no permission): ddb2bt draft "
                            "needs dynamodb:DescribeTable and dynamodb:Scan on the table (dynamodb:DescribeTimeToLive "
                            "and dynamodb:DescribeContinuousBackups are optional); see docs/iam.md")
    return None


def _optional(call: Callable[[], dict], operation: str, table: str) -> Optional[dict]:
    """An optional description (TTL, PITR): None when not permitted or not
    supported, so the draft says "unknown" instead of failing."""
    try:
        return call()
    except (ClientError, BotoCoreError) as exc:
        log.warning("%s of %s not readable (%s): reported as unknown", operation, table, type(exc).__name__)
        return None


def read_table_facts(client, table: str, region: Optional[str] = None) -> TableFacts:
    """DescribeTable (required) with TTL and PITR (optional) → TableFacts."""
    try:
        describe = describe_table(client, table)
    except PermanentError as exc:
        cause = exc.__cause__
        raise (_denied(cause, "DescribeTable", table) or DraftRefused(str(exc))) from None
    ttl = _optional(lambda: client.describe_time_to_live(TableName=table), "DescribeTimeToLive", table)
    backups = _optional(lambda: client.describe_continuous_backups(TableName=table), "DescribeContinuousBackups",
                        table)
    return table_facts(describe, ttl, backups, region)


@dataclass(frozen=True)
class SampleBounds:
    items: int = DEFAULT_SAMPLE_ITEMS
    max_rcu: Optional[float] = None  # capacity units per second, whole sample
    deadline_s: float = DEFAULT_SAMPLE_DEADLINE_S
    segments: int = DEFAULT_SAMPLE_SEGMENTS
    read_factor: int = DEFAULT_READ_FACTOR  # items read per item kept, at most


class _SegmentSample:
    """One segment's share of the sample, drawn from everything it reads: a
    uniform reservoir of ``share`` items, plus up to RARE_TYPE_ITEMS items of
    every entity type (key-prefix signature) the reservoir would otherwise miss,
    plus the largest item read. Memory: the share, the rare keeps, one item."""

    def __init__(self, share: int, keys: tuple, seed: str) -> None:
        self.share, self.keys = share, keys
        self.random = random.Random(seed)
        self.reservoir: list = []
        self.rare: dict = {}  # signature -> [item, ...]
        self.read = self.read_bytes = 0
        self.largest: Optional[tuple] = None  # (size, item)

    def offer(self, item: dict) -> None:
        self.read += 1
        size = item_size(item)
        self.read_bytes += size
        if self.largest is None or size > self.largest[0]:
            self.largest = (size, item)
        if len(self.reservoir) < self.share:
            self.reservoir.append(item)
        else:
            slot = self.random.randrange(self.read)
            if slot < self.share:
                self.reservoir[slot] = item
        if self.keys:
            sig = type_signature(item, self.keys)
            kept = self.rare.get(sig)
            if kept is None and len(self.rare) < MAX_SIGNATURES:
                kept = self.rare[sig] = []
            if kept is not None and len(kept) < RARE_TYPE_ITEMS:
                kept.append(item)

    def items(self) -> list:
        out = list(self.reservoir)
        chosen = {id(it) for it in out}
        present = {type_signature(it, self.keys) for it in out} if self.keys else set()
        for sig, kept in self.rare.items():
            if sig not in present:
                out += [it for it in kept if id(it) not in chosen]
        if self.largest is not None and self.largest[0] > max((item_size(it) for it in out), default=0):
            out.append(self.largest[1])  # the sizes the target must take: the largest read
        return out


def sample_table(client, table: str, bounds: SampleBounds, *, keys: tuple = (), metrics_table: Optional[str] = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> tuple:
    """(items, SampleFacts): a sample spread over the whole key space. Every
    parallel Scan segment (a hash range) reads up to ``read_factor`` times its
    share and keeps a uniform reservoir of its share, plus every entity type it
    read (``keys``: the table's key attributes, whose prefixes tell the types)
    and its largest item; under the RCU budget and the deadline.
    ``metrics_table``: the table's name in the job, labelling the Scan calls counted."""
    segments = max(1, min(bounds.segments, bounds.items))
    share = math.ceil(bounds.items / segments)
    budget = share * max(1, bounds.read_factor)
    page_items = math.ceil(budget / math.ceil(budget / SCAN_PAGE_LIMIT))  # even pages: the last one not read past the budget
    bucket = TokenBucket(bounds.max_rcu, clock=clock, sleep=sleep)
    started = clock()
    lock = threading.Lock()
    samples = [_SegmentSample(share, keys, f"{table}:{i}") for i in range(segments)]
    totals = {"pages": 0, "rcu": 0.0, "deadline": False, "done": 0}

    def segment(i: int) -> None:
        sample = samples[i]
        pages = scan_pages(client, table, segment=i, total_segments=segments, consistent_read=False,
                           page_limit=page_items, bucket=bucket, retry=DEFAULT_READ_RETRY,
                           metrics_table=metrics_table)
        ended = True
        try:
            for page in pages:
                for item in page.items[:budget - sample.read]:
                    sample.offer(item)
                with lock:
                    totals["pages"] += 1
                    totals["rcu"] += page.consumed
                if sample.read >= budget:
                    ended = False
                    break
                if clock() - started >= bounds.deadline_s:
                    ended = False
                    with lock:
                        totals["deadline"] = True
                    break
        finally:
            pages.close()
        if ended:
            with lock:
                totals["done"] += 1

    try:
        with ThreadPoolExecutor(max_workers=min(segments, MAX_SCAN_THREADS)) as pool:
            list(pool.map(segment, range(segments)))
    except PermanentError as exc:
        denied = _denied(exc.__cause__, "Scan", table) if isinstance(exc.__cause__, Exception) else None
        raise (denied or DraftRefused(str(exc))) from None
    items = [it for sample in samples for it in sample.items()]
    stopped = "deadline" if totals["deadline"] else "end" if totals["done"] == segments else "limit"
    return items, SampleFacts(items=len(items), scanned_pages=totals["pages"], consumed_rcu=totals["rcu"],
                              stopped=stopped, segments=segments, seconds=clock() - started,
                              read=sum(x.read for x in samples), read_bytes=sum(x.read_bytes for x in samples),
                              largest_read=max((x.largest[0] for x in samples if x.largest), default=0),
                              segments_done=totals["done"])


@dataclass(frozen=True)
class DraftResult:
    facts: TableFacts
    sample: SampleFacts
    draft: Draft
    assessment: Assessment
    splits: tuple  # split points for a new target table (row keys of the drafted mapping)


def draft_table(client, table: str, bounds: SampleBounds, *, project: str, instance: str,
                target_table: Optional[str] = None, region: Optional[str] = None,
                now: Callable[[], float] = time.time) -> DraftResult:
    """Describe, sample, draft, lint, assess. ``DraftRefused`` when nothing useful
    can be drafted: no such table, no permission, no items."""
    facts = read_table_facts(client, table, region)
    items, sample = sample_table(client, table, bounds, keys=(facts.partition_key,) + (
        (facts.sort_key,) if facts.sort_key else ()))
    if not items:
        raise DraftRefused(f"DynamoDB table {table!r} has no items ({sample.scanned_pages} Scan page(s) read): "
                           "a draft guesses columns, types and entity types from items, so there is nothing to "
                           "draft from. Put a few representative items first, or start from a shipped example "
                           "(ddb2bt examples --copy DIR)")
    draft = draft_mapping(facts, items, project=project, instance=instance, table=target_table, now_s=now())
    mapping = draft.mapping()
    splits = tuple(split_points(mapping, items))
    assessment = assess(facts, sample, items, mapping, lint(mapping, items), len(splits), draft.types)
    return DraftResult(facts, sample, draft, assessment, splits)


def sampled_split_points(client, mapping, bounds: SampleBounds) -> tuple:
    """(split points, SampleFacts) for ``create-table --split-from-sample``: the
    mapping's row keys of a sample of its source table."""
    items, sample = sample_table(client, mapping.source.table, bounds, keys=mapping.source.key_attributes,
                                 metrics_table=mapping.name)
    return tuple(split_points(mapping, items)), sample
