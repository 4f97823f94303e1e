"""`ddb2bt dlq redrive`: bring dead-lettered items to their CURRENT state.

A stored change is never re-applied. Bigtable keeps no tombstones, so writing an
old image at its old timestamp after a later delete (or attribute removal) was
applied would bring the deleted data back. Instead, for each item with dead
letters (by key, oldest first):

  1. read the item now with a consistent GetItem (at time R, in second S);
  2. write its current state — cells at ``S + 999 ms``, the last millisecond of
     R's second, with their older versions deleted — and delete every cell that
     an image stored in its dead letters owned and the current item does not
     (``mapping.converge_change``); if the item is gone, only the deletes. Every
     change made before R has a stream timestamp of at most S (whole seconds), so
     the current state wins over whatever the tail wrote for them — including
     changes the tail applied while the dead-lettered one was missing;
  3. wait until S's second is over (plus a clock margin), then read it again.
     Unchanged: every change after this read has a stream timestamp after
     ``S + 999``, so the tail's later writes win over ours and its later deletes
     remove ours; nothing can have been resurrected. Changed: a change made
     between the reads may have been applied by the tail *before* our write landed
     and been undone by it, so go back to 1 with the newer state (the image just
     written counts as stored: its cells are deleted if no longer owned).

The second read guards against the tail; against a *backfill* it is not enough:
a backfill batch that scanned the item before the redrive can land after it and
bring back what the redrive deleted. So while a backfill may run (phase
BACKFILLING, or unreadable) a redrive marks the rows it writes with touch
markers, like the tail (``ddb2bt_touch``, at its write time, after the handoff),
and the backfill's guard then leaves them alone. With that it is safe in every
phase, with the tail running.
Items are redriven in groups, so the wait is paid once per round of a group.
Its dead letters are removed once the item converged; those whose item cannot
be mapped yet, or kept changing for ``max_rounds`` reads, are kept.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

from ddb2bt.pipeline.retry import RetryPolicy
from ddb2bt.pipeline.logs import table_logger
from ddb2bt.pipeline.source.records import record_from_json
from ddb2bt.transforms.attrs import canonical_typed_json
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.mapping import MARKER_FAMILY, converge_change, handoff_second_ms, marker_qualifier
from ddb2bt.transforms.model import MODIFY, REMOVE, ChangeRecord, MappedChange, SetCell
from ddb2bt.transforms.ordering import converge_rows

log = logging.getLogger(__name__)

MAX_ROUNDS = 5
GROUP_ITEMS = 500  # items read, written and checked together (one wait per round)
# Allowance for the difference between this machine's clock and the stream's
# timestamps (AWS's clock): the wait after a write is this much longer.
CLOCK_MARGIN_MS = 1000


class ItemReader:
    """Consistent GetItem by key (``ddb2bt.pipeline.dynamodb.get_item``: retries and
    error classification there). ``client`` is a boto3 ``dynamodb`` client."""

    def __init__(self, client, table: str, policy: Optional[RetryPolicy] = None) -> None:
        self._client = client
        self._table = table
        self._policy = policy

    def get(self, keys: dict) -> Optional[dict]:
        from ddb2bt.pipeline.dynamodb import get_item

        if self._policy is None:
            return get_item(self._client, self._table, dict(keys))
        return get_item(self._client, self._table, dict(keys), self._policy)


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
            now_ms: Callable[[], int] = _wall_ms, sleep: Callable[[float], None] = time.sleep) -> RedriveResult:
    """Redrive the dead letters of ``store`` matching ``options`` (see the module
    docstring). ``batcher`` is a ``sink.BatchingWriter`` without a state store (a
    redrive must not move stream checkpoints); ``reader`` an ``ItemReader``."""
    from ddb2bt.pipeline.cutover.phases import MarkingPolicy

    policy = MarkingPolicy(lambda: store)
    policy.setup()
    # A Kinesis job's backfill reads no markers (docs/design.md §10.6), and its
    # targets have no marker family: a redrive there marks nothing.
    marking = policy.active if mapping.source.kinesis is None else (lambda: False)
    letters = store.list_dead_letters(reason=options.reason, since_ms=options.since_ms)
    groups, redacted = _group(letters)
    outcome: dict = {}
    items = list(groups.items())
    for start in range(0, len(items), GROUP_ITEMS):
        _converge(mapping, dict(items[start:start + GROUP_ITEMS]), batcher, reader, options, now_ms, sleep,
                  outcome, marking)
    resolved = [e["id"] for key, (_, entries, _) in groups.items() if outcome.get(key) == "resolved"
                for e in entries]
    count = lambda what: sum(len(entries) for key, (_, entries, _) in groups.items() if outcome.get(key) == what)
    if resolved and not options.dry_run:
        store.delete_dead_letters(resolved)
    return RedriveResult(items=len(groups), resolved=len(resolved), still_failing=count("failing"),
                         redacted=redacted, unstable=len(letters) - redacted - len(resolved) - count("failing"))


def _converge(mapping, groups: dict, batcher, reader, options: RedriveOptions, now_ms, sleep, outcome: dict,
              marking: Callable[[], bool] = lambda: True) -> None:
    """Rounds of read → write → (next second) → read for a group of items; fills
    ``outcome`` {item key: "resolved" | "failing"} (absent: kept changing)."""
    seen = {key: list(images) for key, (_, _, images) in groups.items()}
    pending = list(groups)
    # An out-of-order source (Kinesis): every write goes through the item's clock
    # (docs/design.md §10), or a later REMOVE, which deletes only what the clock
    # lists, would leave what this wrote, and a redriven delete would leave no
    # tombstone against a late older change.
    guarded = mapping.source.kinesis is not None
    if guarded and not getattr(batcher, "ordering_guard", False):
        raise TypeError("a Kinesis mapping's redrive writes through the ordering guard (GuardedBatchingWriter)")
    for _ in range(options.max_rounds):
        if not pending:
            return
        written: dict = {}  # key -> (image written, record)
        last_second = 0
        for key in pending:
            keys = groups[key][0]
            second = handoff_second_ms(now_ms())
            current = reader.get(keys)
            # The last millisecond of the read's second: newer than every change
            # before the read (stream timestamps are whole seconds, at most this
            # one), older than every change after the second ends — the wait below.
            ts = second + 999
            try:
                rows = (converge_rows if guarded else converge_change)(mapping, keys, current, tuple(seen[key]), ts)
            except MappingError as exc:
                table_logger(log, mapping.name).info("an item's dead letters still fail to map: %s", exc.reason)
                outcome[key] = "failing"
                continue
            if options.dry_run:
                outcome[key] = "resolved"
                continue
            if marking():  # a backfill may run: its guard must see this write (module docstring)
                marker = SetCell(MARKER_FAMILY, marker_qualifier(keys), b"", ts)
                rows = tuple(replace(r, mutations=r.mutations + (marker,), size_bytes=-1) for r in rows)
            record = ChangeRecord(MODIFY if current is not None else REMOVE, keys, current,
                                  current if current is not None else (seen[key][-1] if seen[key] else None), ts)
            batcher.add(MappedChange(record, rows))
            written[key] = (current, record)
            last_second = max(last_second, second)
        if not written:
            return
        failed = {id(d.record) for d in batcher.flush()}
        # Every change made from now on has a stream timestamp after the ones we
        # wrote; a change made before now and after a read shows in the next read.
        wait_ms = last_second + 1000 + CLOCK_MARGIN_MS - now_ms()
        if wait_ms > 0:
            sleep(wait_ms / 1000)
        pending = []
        for key, (current, record) in written.items():
            if id(record) in failed:
                outcome[key] = "failing"
            elif reader.get(groups[key][0]) == current:
                outcome[key] = "resolved"
            else:  # changed meanwhile: once more with the newer state
                if current is not None:
                    seen[key].append(current)
                pending.append(key)


def redrive_job(mapping, state_spec, options: RedriveOptions = RedriveOptions()) -> RedriveResult:
    """`ddb2bt dlq redrive` against the real services: the sink's writer (the same
    limits, retries and version ownership as the pipeline, but no checkpoints: a
    redrive must not move the stream's) and a consistent GetItem reader."""
    from ddb2bt.pipeline.connections import DynamoDBClientFactory
    from ddb2bt.pipeline.sink.sink import BatchingWriter, SinkConfig

    writer = state_spec.bigtable.writer()
    store = state_spec.store(writer)
    if mapping.source.kinesis is not None:  # through the item's clock (docs/design.md §10, docs/kinesis.md)
        from ddb2bt.pipeline.sink.guarded import GuardedBatchingWriter

        batcher = GuardedBatchingWriter(writer, None, SinkConfig(overlap_writes=False, ordering_guard=True))
    else:
        batcher = BatchingWriter(writer, None, SinkConfig(overlap_writes=False), versions=store.versions())
    try:
        reader = ItemReader(DynamoDBClientFactory(mapping.source.region)(), mapping.source.table)
        return redrive(mapping, store, batcher, reader, options)
    finally:
        batcher.close()
        writer.close()
