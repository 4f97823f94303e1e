"""The reads behind ``ddb2bt draft`` and ``create-table --split-from-sample``:
DescribeTable, DescribeTimeToLive, DescribeContinuousBackups, and a bounded
parallel sample of items. The drafting itself is pure
(``ddb2bt.transforms.draft``).

The sample is bounded three ways: at most N items are kept (each segment reads
pages no larger than its share, so memory holds N items and one page each), the
read budget is the backfill's ``TokenBucket`` (``--max-rcu``, capacity units per
second, charged from what the service reports), and a deadline stops it (the
items read so far are the sample).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

from botocore.exceptions import BotoCoreError, ClientError

from ddb2bt.pipeline.clients.dynamodb import (DEFAULT_READ_RETRY, MAX_SCAN_THREADS, SCAN_PAGE_LIMIT, TokenBucket,
                                      describe_table, scan_pages)
from ddb2bt.transforms.draft import (Assessment, Draft, SampleFacts, TableFacts, assess, draft_mapping,
                                     split_points, table_facts)
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


def sample_table(client, table: str, bounds: SampleBounds, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> tuple:
    """(items, SampleFacts): at most ``bounds.items`` items read by parallel
    segment scans, each segment its share, under the RCU budget and deadline."""
    segments = max(1, min(bounds.segments, bounds.items))
    share = math.ceil(bounds.items / segments)
    bucket = TokenBucket(bounds.max_rcu, clock=clock, sleep=sleep)
    started = clock()
    lock = threading.Lock()
    items: list = []
    totals = {"pages": 0, "rcu": 0.0, "deadline": False}

    def segment(i: int) -> None:
        got = 0
        pages = scan_pages(client, table, segment=i, total_segments=segments, consistent_read=False,
                           page_limit=min(SCAN_PAGE_LIMIT, share), bucket=bucket, retry=DEFAULT_READ_RETRY)
        try:
            for page in pages:
                keep = page.items[:share - got]
                got += len(keep)
                with lock:
                    items.extend(keep)
                    totals["pages"] += 1
                    totals["rcu"] += page.consumed
                if got >= share:
                    return
                if clock() - started >= bounds.deadline_s:
                    with lock:
                        totals["deadline"] = True
                    return
                if len(keep) < len(page.items):
                    return
        finally:
            pages.close()

    try:
        with ThreadPoolExecutor(max_workers=min(segments, MAX_SCAN_THREADS)) as pool:
            list(pool.map(segment, range(segments)))
    except PermanentError as exc:
        denied = _denied(exc.__cause__, "Scan", table) if isinstance(exc.__cause__, Exception) else None
        raise (denied or DraftRefused(str(exc))) from None
    del items[bounds.items:]
    stopped = "deadline" if totals["deadline"] else "limit" if len(items) >= bounds.items else "end"
    return items, SampleFacts(items=len(items), scanned_pages=totals["pages"], consumed_rcu=totals["rcu"],
                              stopped=stopped, segments=segments, seconds=clock() - started)


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
    items, sample = sample_table(client, table, bounds)
    if not items:
        raise DraftRefused(f"DynamoDB table {table!r} has no items ({sample.scanned_pages} Scan page(s) read): "
                           "a draft guesses columns, types and entity types from items, so there is nothing to "
                           "draft from. Put a few representative items first, or start from a shipped example "
                           "(ddb2bt examples --copy DIR)")
    draft = draft_mapping(facts, items, project=project, instance=instance, table=target_table, now_s=now())
    mapping = draft.mapping()
    splits = tuple(split_points(mapping, items))
    assessment = assess(facts, sample, items, mapping, lint(mapping, items), len(splits))
    return DraftResult(facts, sample, draft, assessment, splits)


def sampled_split_points(client, mapping, bounds: SampleBounds) -> tuple:
    """(split points, SampleFacts) for ``create-table --split-from-sample``: the
    mapping's row keys of a sample of its source table."""
    items, sample = sample_table(client, mapping.source.table, bounds)
    return tuple(split_points(mapping, items)), sample
