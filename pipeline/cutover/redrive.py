"""`ddb2bt dlq redrive`: bring dead-lettered items to their CURRENT state.

A stored change is never re-applied. Bigtable keeps no tombstones, so writing an
old image at its old timestamp after a later delete (or attribute removal) was
applied would bring the deleted data back. Instead, for each item with dead
letters (by key, oldest first):

  1. read the item now with a consistent GetItem (time R);
  2. write its current state the way the backfill writes a scanned item — cells at
     ``floor_to_second(R) - 1 ms`` with their older versions deleted — and delete
     every cell that an image stored in its dead letters owned and the current
     item does not (``mapping.converge_change``); if the item is gone, only the
     deletes;
  3. read it again. Unchanged: every change after R has a stream timestamp at or
     after R's second, so the tail's later writes win over ours and its later
     deletes remove ours; nothing can have been resurrected. Changed: a change
     the tail may have applied *before* our write landed could have been undone
     by it, so go back to 1 with the newer state (the image just written counts
     as stored: its cells are deleted if no longer owned).

The backfill guards a scanned item with touch markers; a redrive needs none —
the second read is its guard, so it is safe in every phase, with the tail running.
Its dead letters are removed once the item converged; those whose item cannot
be mapped yet, or kept changing for ``max_rounds`` reads, are kept.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from botocore.exceptions import BotoCoreError, ClientError

from ddb2bt.pipeline.retry import DEFAULT_POLICY, RetryPolicy, retrying
from ddb2bt.pipeline.source.records import record_from_json
from ddb2bt.transforms.attrs import canonical_typed_json
from ddb2bt.transforms.errors import MappingError, PermanentError, RetryableError
from ddb2bt.transforms.mapping import converge_change, handoff_second_ms
from ddb2bt.transforms.model import MODIFY, REMOVE, ChangeRecord, MappedChange

log = logging.getLogger(__name__)

MAX_ROUNDS = 5
_RETRYABLE_AWS = ("ProvisionedThroughputExceededException", "ThrottlingException", "RequestLimitExceeded",
                  "InternalServerError", "ServiceUnavailable")


class DynamoDBRetryable(RetryableError):
    """A DynamoDB call failed in a way a retry may fix (throttling, 5xx, network)."""


class DynamoDBPermanent(PermanentError):
    """A DynamoDB call failed for good (no table, no permission, bad key)."""


def classify_dynamodb_error(exc: Exception, operation: str) -> Exception:
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        message = exc.response.get("Error", {}).get("Message", "")
        if code in _RETRYABLE_AWS or status >= 500:
            return DynamoDBRetryable(f"{operation}: {code or status}: {message}", code=code or str(status))
        return DynamoDBPermanent(f"{operation}: {code}: {message}")
    if isinstance(exc, BotoCoreError):
        return DynamoDBRetryable(f"{operation}: {type(exc).__name__}: {exc}", code=type(exc).__name__)
    return exc


class ItemReader:
    """Consistent GetItem by key, retried under the one retry policy. ``client``
    is a boto3 ``dynamodb`` client (created by the caller)."""

    def __init__(self, client, table: str, policy: RetryPolicy = DEFAULT_POLICY,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._client = client
        self._table = table
        self._policy = policy
        self._sleep = sleep

    def get(self, keys: dict) -> Optional[dict]:
        def attempt():
            try:
                return self._client.get_item(TableName=self._table, Key=dict(keys), ConsistentRead=True)
            except Exception as exc:
                raise classify_dynamodb_error(exc, "GetItem") from exc

        return retrying(self._policy, f"GetItem on {self._table}", None, self._sleep)(attempt).get("Item")


@dataclass(frozen=True)
class RedriveOptions:
    reason: Optional[str] = None
    since_ms: Optional[int] = None
    dry_run: bool = False
    max_rounds: int = MAX_ROUNDS


@dataclass(frozen=True)
class RedriveResult:
    items: int = 0  # distinct items with dead letters
    resolved: int = 0  # dead letters removed (their item converged; dry run: would be)
    still_failing: int = 0  # dead letters kept: the current item still cannot be mapped or written
    redacted: int = 0  # dead letters kept: stored without keys (--no-dlq-include-values)
    unstable: int = 0  # dead letters kept: their item kept changing while being redriven

    @property
    def kept(self) -> int:
        return self.still_failing + self.redacted + self.unstable


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


def _group(letters: list) -> tuple:
    """({item key json: (keys, [entries], [stored images])}, redacted count), in
    order of each item's oldest dead letter."""
    groups: dict = {}
    redacted = 0
    for entry in letters:
        try:
            record = record_from_json(entry["record"])
            key = canonical_typed_json({"M": dict(record.keys)})
        except Exception:  # keys stored as "<redacted>": nothing to look the item up by
            redacted += 1
            continue
        keys, entries, images = groups.setdefault(key, (dict(record.keys), [], []))
        entries.append(entry)
        images.extend(i for i in (record.old_image, record.new_image) if i is not None)
    return groups, redacted


def redrive(mapping, store, batcher, reader: ItemReader, options: RedriveOptions = RedriveOptions(),
            now_ms: Callable[[], int] = _wall_ms) -> RedriveResult:
    """Redrive the dead letters of ``store`` matching ``options`` (see the module
    docstring). ``batcher`` is a ``sink.BatchingWriter`` without a state store (a
    redrive must not move stream checkpoints); ``reader`` an ``ItemReader``."""
    letters = store.list_dead_letters(reason=options.reason, since_ms=options.since_ms)
    groups, redacted = _group(letters)
    resolved_ids: list = []
    still = unstable = 0
    for keys, entries, images in groups.values():
        seen = list(images)
        outcome = "unstable"
        for _ in range(options.max_rounds):
            ts = handoff_second_ms(now_ms()) - 1
            current = reader.get(keys)
            try:
                rows = converge_change(mapping, keys, current, tuple(seen), ts)
            except MappingError as exc:
                log.info("dead letters of an item still fail to map: %s", exc.reason)
                outcome = "failing"
                break
            if options.dry_run:
                outcome = "resolved"
                break
            record = ChangeRecord(MODIFY if current is not None else REMOVE, keys, current,
                                  current if current is not None else (seen[-1] if seen else None), ts)
            batcher.add(MappedChange(record, rows))
            if batcher.flush():
                outcome = "failing"
                break
            if reader.get(keys) == current:
                outcome = "resolved"
                break
            if current is not None:
                seen.append(current)
        if outcome == "resolved":
            resolved_ids += [e["id"] for e in entries]
        elif outcome == "failing":
            still += len(entries)
        else:
            unstable += len(entries)
    if resolved_ids and not options.dry_run:
        store.delete_dead_letters(resolved_ids)
    return RedriveResult(items=len(groups), resolved=len(resolved_ids), still_failing=still, redacted=redacted,
                         unstable=unstable)
