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

"Converged" is then checked against the target itself (given ``read_rows``):
each row the item maps to (now, or in a stored image) is read back, and a
column of one of the mapping's families that the current item does not produce,
no newer than the redrive's write, is deleted up to it — a cell a mapping
change left behind, or an attribute removed while its change was lost. That is
only sure where the row is the item's alone (its row key spells the item's
key, and no other item it could spell exists); a row several items share, a
cell of a family the mapping does not own, or an item whose earlier rows are
unknown (no stored image, and none left in the stream) is reported *not
proven* and its dead letters are kept: a redrive never says "resolved" for
what it could not check.

Dead letters stored without values (--no-dlq-include-values, the default on
Dataflow) hold the keys and the stream position: the images a redrive needs
are read back from the stream while it still holds the record (24 h); letters
of earlier versions, whose keys were redacted, are found the same way.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.observe.logs import table_logger
from ddb2bt.pipeline.verify.continuous import DIVERGENT
from ddb2bt.pipeline.verify.recheck import owner_candidates
from ddb2bt.pipeline.control.letters import keys_redacted, record_from_json, values_omitted
from ddb2bt.pipeline.source.records import from_stream_record
from ddb2bt.transforms.attrs import canonical_typed_json
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.mapping import (MARKER_FAMILY, converge_change, expected_cells, handoff_second_ms,
                                       marker_qualifier)
from ddb2bt.transforms.model import MODIFY, REMOVE, ChangeRecord, DeleteCells, MappedChange, SetCell, StreamPosition
from ddb2bt.transforms.ordering import CLOCK_FAMILY, converge_rows
from ddb2bt.pipeline.clients.dynamodb import (IteratorExpired, ShardPacer, StreamThrottled, classify_aws_error,
                                              get_item)
from ddb2bt.pipeline.clients.retry import retrying
from ddb2bt.pipeline.source.kinesis import KinesisClientFactory
from ddb2bt.transforms.errors import ChangesLostError, StreamGoneError
from ddb2bt.pipeline.clients.bigtable.reads import read_rows
from ddb2bt.pipeline.connect.connections import DynamoDBClientFactory, StreamsClientFactory
from ddb2bt.pipeline.control.phases import MarkingPolicy
from ddb2bt.pipeline.sink.guarded import GuardedBatchingWriter
from ddb2bt.pipeline.sink.sink import BatchingWriter, SinkConfig
from ddb2bt.transforms.rowkey import Placeholder

log = logging.getLogger(__name__)

MAX_ROUNDS = 5
GROUP_ITEMS = 500  # items read, written and checked together (one wait per round)
# Allowance for the difference between this machine's clock and the stream's
# timestamps (AWS's clock): the wait after a write is this much longer.
CLOCK_MARGIN_MS = 1000


class ItemReader:
    """Consistent GetItem by key (``ddb2bt.pipeline.clients.dynamodb.get_item``: retries and
    error classification there). ``client`` is a boto3 ``dynamodb`` client."""

    def __init__(self, client, table: str, policy: Optional[RetryPolicy] = None,
                 metrics_table: Optional[str] = None) -> None:
        self._client = client
        self._table = table
        self._policy = policy
        self._metrics_table = metrics_table  # the job's name: the table label of the calls counted

    def get(self, keys: dict) -> Optional[dict]:
        if self._policy is None:
            return get_item(self._client, self._table, dict(keys), metrics_table=self._metrics_table)
        return get_item(self._client, self._table, dict(keys), self._policy, metrics_table=self._metrics_table)


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
    redacted: int = 0  # dead letters kept: no key to find the item by (redacted, and the stream lost the record)
    unstable: int = 0  # dead letters kept: their item kept changing while being redriven
    unproven: int = 0  # dead letters kept: written, but their rows could not be proven to match (module docstring)
    cleaned: int = 0  # cells removed that the current mapping does not produce

    @property
    def kept(self) -> int:
        return self.still_failing + self.redacted + self.unstable + self.unproven


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


def _group(letters: list, streams=None) -> tuple:
    """({item key json: (keys, [entries], [stored images])}, redacted count,
    {item key json of items with a letter whose images are unknown}), in order
    of each item's oldest dead letter. A letter stored without values is
    completed from the stream (``streams``) while it still holds the record."""
    groups: dict = {}
    redacted = 0
    imageless: set = set()
    for entry in letters:
        text = entry["record"]
        stored = _stored_record(text)
        missing_images = False
        if stored is not None and values_omitted(text):
            record = _from_stream(streams, stored.position) or (None if keys_redacted(text) else stored)
            missing_images = record is None or not _has_images(record)
        else:
            record = stored
        if record is None:
            redacted += 1
            continue
        key = canonical_typed_json({"M": dict(record.keys)})
        keys, entries, images = groups.setdefault(key, (dict(record.keys), [], []))
        entries.append(entry)
        images.extend(i for i in (record.old_image, record.new_image) if i is not None)
        if missing_images:
            imageless.add(key)
    return groups, redacted, imageless


def _stored_record(text: str) -> Optional[ChangeRecord]:
    """The letter's record; one whose keys were redacted keeps only its position
    (keys None). None: unreadable."""
    try:
        return record_from_json(text)
    except Exception:  # redacted keys do not parse as DynamoDB JSON
        pass
    try:
        pos = json.loads(text).get("position")
        return ChangeRecord("", {}, None, None, 0, StreamPosition(pos["streamArn"], pos["shardId"],
                                                                  pos["sequenceNumber"])) if pos else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _has_images(record: ChangeRecord) -> bool:
    return record.old_image is not None or record.new_image is not None


# A redrive reads beside a running tail, which may spend a shard's whole 5
# GetRecords/s: it takes at most this many per shard, and retries a throttled
# call as the tail does, for up to the policy's deadline.
REDRIVE_GET_RECORDS_PER_SHARD_PER_S = 1.0
REDRIVE_STREAM_RETRY = RetryPolicy(initial_s=0.2, max_backoff_s=5.0, deadline_s=120.0)


class LetterStream:
    """Reads a letter's record back from its stream position: paced
    (REDRIVE_GET_RECORDS_PER_SHARD_PER_S), each call retried while throttled or
    failing transiently (REDRIVE_STREAM_RETRY). Only the stream's own word that
    the record is gone (trimmed, an expired iterator, the stream or shard gone)
    makes it "no longer in its stream"; any other failure, a throttled read
    that never got through included, stops the redrive with its error and
    keeps the letters. ``streams``: a DynamoDB Streams client, or a Kinesis
    stream's (source.kinesis.KinesisStreamsClient) for a Kinesis job."""

    def __init__(self, streams, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic, policy: RetryPolicy = REDRIVE_STREAM_RETRY) -> None:
        self._streams = streams
        self._sleep = sleep
        self._policy = policy
        self._pacer = ShardPacer(REDRIVE_GET_RECORDS_PER_SHARD_PER_S, clock=clock, sleep=sleep)

    def _call(self, operation: str, fn: Callable, shard_id: Optional[str] = None):
        from botocore.exceptions import BotoCoreError, ClientError

        def attempt():
            if shard_id is not None:
                self._pacer.wait(shard_id)
            try:
                return fn()
            except (ClientError, BotoCoreError) as exc:
                raise classify_aws_error(exc, operation) from exc

        return retrying(self._policy, f"{operation} (dlq redrive)", sleep=self._sleep,
                        retry_on=(StreamThrottled,))(attempt)

    def record(self, pos: Optional[StreamPosition]) -> Optional[ChangeRecord]:
        """The letter's record (keys and images), or None: no position, or the
        stream no longer holds it. One GetShardIterator and one GetRecords of one
        record, each retried."""
        if pos is None or not pos.sequence_number:
            return None
        try:
            it = self._call("GetShardIterator", lambda: self._streams.get_shard_iterator(
                StreamArn=pos.stream_arn, ShardId=pos.shard_id, ShardIteratorType="AT_SEQUENCE_NUMBER",
                SequenceNumber=pos.sequence_number))["ShardIterator"]
            raw = self._call("GetRecords", lambda: self._streams.get_records(ShardIterator=it, Limit=1),
                             pos.shard_id).get("Records", [])
        except (ChangesLostError, IteratorExpired, StreamGoneError) as exc:  # the images are lost
            log.info("a dead letter's record is no longer in its stream (%s)", exc)
            return None
        if not raw or raw[0].get("dynamodb", {}).get("SequenceNumber") != pos.sequence_number:
            return None
        return from_stream_record(raw[0], pos.stream_arn, pos.shard_id)


def _from_stream(streams: Optional[LetterStream], pos: Optional[StreamPosition]) -> Optional[ChangeRecord]:
    return None if streams is None else streams.record(pos)


def redrive(mapping, store, batcher, reader: ItemReader, options: RedriveOptions = RedriveOptions(),
            now_ms: Callable[[], int] = _wall_ms, sleep: Callable[[float], None] = time.sleep,
            streams=None, read_rows: Optional[Callable[[str, list], dict]] = None,
            delete_cells: Optional[Callable[[str, bytes, list], None]] = None) -> RedriveResult:
    """Redrive the dead letters of ``store`` matching ``options`` (see the module
    docstring). ``batcher`` is a ``sink.BatchingWriter`` without a state store (a
    redrive must not move stream checkpoints); ``reader`` an ``ItemReader``;
    ``streams`` (a Streams client) completes letters stored without values;
    ``read_rows(table, keys)`` and ``delete_cells(table, row, mutations)`` check
    the rows afterwards and remove what the current mapping does not produce
    (without them, nothing is checked)."""
    policy = MarkingPolicy(lambda: store)
    policy.setup()
    # A Kinesis job's backfill reads no markers (docs/design.md §10.6), and its
    # targets have no marker family: a redrive there marks nothing.
    marking = policy.active if mapping.source.kinesis is None else (lambda: False)
    letters = store.list_dead_letters(reason=options.reason, since_ms=options.since_ms)
    groups, redacted, imageless = _group(letters, LetterStream(streams, sleep) if streams is not None else None)
    outcome: dict = {}
    final: dict = {}
    items = list(groups.items())
    for start in range(0, len(items), GROUP_ITEMS):
        _converge(mapping, dict(items[start:start + GROUP_ITEMS]), batcher, reader, options, now_ms, sleep,
                  outcome, marking, final)
    cleaned = 0
    if read_rows is None:  # nothing checked: an item whose earlier rows are unknown is not proven
        for key in imageless:
            if outcome.get(key) == "resolved":
                outcome[key] = "unproven"
    elif not options.dry_run:
        checker = _RowCheck(mapping, reader, read_rows, delete_cells)
        for key, (keys, entries, images) in groups.items():
            if outcome.get(key) == "resolved":
                current, ts = final[key]
                # A divergence the continuous check confirmed (repair) must be shown
                # gone; an ordinary dead letter's rows are judged where they can be.
                strict = any(e.get("reason") == DIVERGENT for e in entries)
                proven, removed = checker.check(keys, current, images, ts, key in imageless, strict)
                cleaned += removed
                if not proven:
                    outcome[key] = "unproven"
    resolved = [e["id"] for key, (_, entries, _) in groups.items() if outcome.get(key) == "resolved"
                for e in entries]
    count = lambda what: sum(len(entries) for key, (_, entries, _) in groups.items() if outcome.get(key) == what)
    if resolved and not options.dry_run:
        store.delete_dead_letters(resolved)
    return RedriveResult(items=len(groups), resolved=len(resolved), still_failing=count("failing"),
                         redacted=redacted, unproven=count("unproven"), cleaned=cleaned,
                         unstable=len(letters) - redacted - len(resolved) - count("failing") - count("unproven"))


# Families of ddb2bt's own in a target row: never the mapping's, never foreign.
OWN_FAMILIES = (MARKER_FAMILY, CLOCK_FAMILY)


class _RowCheck:
    """After an item converged: its rows read back, cells the current mapping
    does not produce removed where the row is provably the item's alone
    (module docstring)."""

    def __init__(self, mapping, reader, read_rows: Callable, delete_cells: Optional[Callable]) -> None:
        self.mapping, self.reader, self.read_rows, self.delete_cells = mapping, reader, read_rows, delete_cells
        self.owned = {t: {f.name for f in fams} for t, fams in mapping.table_families().items()}

    def _cells(self, item) -> dict:
        try:
            return expected_cells(self.mapping, item) if item is not None else {}
        except MappingError:
            return {}

    def _alone(self, keys: dict, table: str, row: bytes) -> bool:
        """Only this item can own the row: the row key spells its key, and every
        other key it could spell (a part read as S or as N) is no item."""
        candidates = owner_candidates(self.mapping, table, row)
        if keys not in candidates:
            return False
        return all(self.reader.get(c) is None for c in candidates if c != keys)

    def check(self, keys: dict, current, images: list, ts: int, imageless: bool, strict: bool = False) -> tuple:
        """(proven, cells removed). ``strict`` (a repair of a confirmed divergence):
        a row that cannot be judged is not proven; otherwise it is left as it
        is (other items' cells in a shared row are theirs)."""
        want: dict = {}
        for cell in self._cells(current).values():
            want.setdefault((cell.table, cell.row_key), set()).add((cell.family, cell.qualifier))
        rows = set(want)
        for image in images:
            rows |= {(c.table, c.row_key) for c in self._cells(image).values()}
        proven, removed = not (imageless and (current is None or not self._rows_follow_keys())), 0
        for table, row in sorted(rows):
            have = self.read_rows(table, [row]).get(row, {})
            expected = want.get((table, row), set())
            if strict and expected - set(have):
                # An owned cell missing where the item's state was just written
                # (a write that went around the clock, or a delete since): a
                # repair that cannot see its effect has not proven anything.
                proven = False
            extra = {col: versions for col, versions in have.items() if col not in expected
                     and col[0] not in OWN_FAMILIES}
            if not extra:
                continue
            owned = self.owned.get(table, set())
            if not self._alone(keys, table, row) or any(f not in owned for f, _ in extra):
                # Other items' cells, or someone else's family: not ours to judge.
                proven = proven and not strict
                continue
            # Cells no newer than our write: a newer one is the tail's, after our read.
            deletes = [DeleteCells(f, q, 0, ts + 1) for (f, q), versions in sorted(extra.items())
                       if max(t for t, _ in versions) <= ts]
            if len(deletes) < len(extra):
                proven = False
            if deletes and self.delete_cells is not None:
                self.delete_cells(table, row, deletes)
                removed += len(deletes)
            elif deletes:
                proven = False
        return proven, removed

    def _rows_follow_keys(self) -> bool:
        """Every row the mapping writes is keyed by key attributes alone (no
        index rows, no row key of other attributes): an item's earlier rows are
        its current ones, so no image is needed to find them."""
        key_attrs = set(self.mapping.source.key_attributes)
        for rule in self.mapping.rules:
            if rule.indexes:
                return False
            tokens = rule.row_key.tokens if rule.row_key is not None else ()
            if any(isinstance(t, Placeholder) and t.source not in key_attrs for t in tokens):
                return False
        return True


def _converge(mapping, groups: dict, batcher, reader, options: RedriveOptions, now_ms, sleep, outcome: dict,
              marking: Callable[[], bool] = lambda: True, final: Optional[dict] = None) -> None:
    """Rounds of read → write → (next second) → read for a group of items; fills
    ``outcome`` {item key: "resolved" | "failing"} (absent: kept changing) and
    ``final`` {item key: (the state written, its timestamp)} of the resolved."""
    final = {} if final is None else final
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
                final[key] = (current, record.change_ms)
            else:  # changed meanwhile: once more with the newer state
                if current is not None:
                    seen[key].append(current)
                pending.append(key)


def letter_streams(mapping):
    """The client a redrive reads letters' records back with: the job's own
    stream, its Kinesis stream for a Kinesis job (whose letters' positions name
    a Kinesis shard and sequence number under the job's per-table stream name,
    not a DynamoDB stream)."""
    kinesis = mapping.source.kinesis
    if kinesis is not None:
        return KinesisClientFactory(kinesis.stream, mapping.source.table, mapping.source.region, kinesis.precision)()
    return StreamsClientFactory(mapping.source.region)()


def redrive_job(mapping, state_spec, options: RedriveOptions = RedriveOptions()) -> RedriveResult:
    """`ddb2bt dlq redrive` against the real services: the sink's writer (the same
    limits, retries and version ownership as the pipeline, but no checkpoints: a
    redrive must not move the stream's) and a consistent GetItem reader."""
    writer = state_spec.bigtable.writer()
    store = state_spec.store(writer)
    if mapping.source.kinesis is not None:  # through the item's clock (docs/design.md §10, docs/kinesis.md)

        batcher = GuardedBatchingWriter(writer, None, SinkConfig(overlap_writes=False, ordering_guard=True))
    else:
        batcher = BatchingWriter(writer, None, SinkConfig(overlap_writes=False), versions=store.versions())
    t = mapping.target
    try:
        reader = ItemReader(DynamoDBClientFactory(mapping.source.region)(), mapping.source.table,
                            metrics_table=store.job)
        return redrive(mapping, store, batcher, reader, options, streams=letter_streams(mapping),
                       read_rows=lambda table, keys: read_rows(t.project, t.instance, table, keys,
                                                               app_profile=t.app_profile),
                       delete_cells=lambda table, row, mutations: writer.mutate_rows(table, [(row, mutations)]))
    finally:
        batcher.close()
        writer.close()
