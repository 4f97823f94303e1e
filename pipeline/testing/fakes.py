"""Fakes for what the emulators cannot do, behind the same interfaces as the real
clients: an in-memory Bigtable (a MutationWriter and StateBackend, with fault
injection) and a DynamoDB Streams client with boto3's interface (shard splits,
closed shards, trimming, expired iterators, throttling).

Used by unit tests, the fault suites and the benchmarks; never by the pipeline
itself.
"""
from __future__ import annotations

import copy
import datetime as dt
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

from botocore.exceptions import ClientError

from ddb2bt.pipeline.clients.bigtable.errors import ENTRY_OK, BigtablePermanent, BigtableRetryable, EntryStatus
from ddb2bt.transforms.draft import item_size
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.model import DeleteCells, SetCell
from ddb2bt.transforms.wire import encode_mutations

# --- Bigtable -------------------------------------------------------------------


def _check_wire(entry) -> None:
    """An entry that carries its bytes (WireEntry: what the gRPC writer sends) must
    say exactly what its mutation tuples (what this fake applies) say."""
    wire = getattr(entry, "wire", None)
    if wire is not None and wire != encode_mutations(entry[1]):
        raise AssertionError(f"entry for row {entry[0]!r}: its wire bytes are not its mutations")


class InMemoryBigtable:
    """Bigtable's write semantics in memory: cells keyed by timestamp, a SetCell at
    an existing timestamp replaces it, DeleteFromColumn honours [start, end).

    ``families``: {table: set of families}; writing to an unknown family fails the
    entry like the emulator does (INTERNAL "unknown family"). ``fault``: called with
    (table, entries, call number) before applying; may raise BigtableRetryable /
    BigtablePermanent or return a list of EntryStatus|None (None = apply normally).
    """

    def __init__(self, families: Optional[dict] = None,
                 fault: Optional[Callable[[str, Sequence, int], Optional[list]]] = None) -> None:
        self.families = families if families is not None else {}
        self.fault = fault
        self.tables: dict = {}
        self.calls: list = []  # [(table, [row keys])] in call order
        self._lock = threading.Lock()

    def mutate_rows(self, table_id: str, entries: Sequence) -> list:
        with self._lock:
            call_no = len(self.calls)
            self.calls.append((table_id, [k for k, _ in entries]))
            injected = self.fault(table_id, entries, call_no) if self.fault else None
            out = []
            for i, (row_key, mutations) in enumerate(entries):
                _check_wire(entries[i])
                if injected is not None and injected[i] is not None:
                    out.append(injected[i])
                    continue
                out.append(self._apply(table_id, row_key, mutations))
            return out

    def check_and_mutate(self, table_id: str, row_key: bytes, unless, mutations: Sequence) -> bool:
        with self._lock:
            call_no = len(self.calls)
            self.calls.append((table_id, [row_key]))
            if self.fault:
                injected = self.fault(table_id, [(row_key, mutations)], call_no)
                if injected is not None and injected[0] is not None and not injected[0].ok:
                    status = injected[0]
                    raise (BigtableRetryable if status.retryable else BigtablePermanent)(status.message)
            column = self.tables.get(table_id, {}).get(row_key, {}).get((unless.family, unless.qualifier), {})
            if any(ts >= unless.since_ms for ts in column):
                return False
            status = self._apply(table_id, row_key, mutations)
            if not status.ok:
                raise BigtablePermanent(status.message)
            return True

    def read_cell(self, table_id: str, row_key: bytes, family: str, qualifier: bytes) -> Optional[bytes]:
        with self._lock:
            column = self.tables.get(table_id, {}).get(row_key, {}).get((family, qualifier))
            return column[max(column)] if column else None

    def swap_cell(self, table_id: str, row_key: bytes, family: str, qualifier: bytes, expected: Optional[bytes],
                  value: bytes, ts_ms: int) -> bool:
        """Compare-and-set like GrpcMutationWriter.swap_cell (CheckAndMutateRow)."""
        with self._lock:
            if self.fault:  # the same fault hook as writes: lets tests make renewals fail
                injected = self.fault(table_id, [(row_key, [])], len(self.calls))
                if injected is not None and injected[0] is not None and not injected[0].ok:
                    status = injected[0]
                    raise (BigtableRetryable if status.retryable else BigtablePermanent)(status.message)
            self.calls.append((table_id, [row_key]))
            row = self.tables.setdefault(table_id, {}).setdefault(row_key, {})
            column = row.get((family, qualifier))
            current = column[max(column)] if column else None
            if current != expected:
                if not row:
                    del self.tables[table_id][row_key]
                return False
            row[(family, qualifier)] = {ts_ms: value}
            return True

    def read_family(self, table_id: str, row_keys: Sequence, family: str) -> dict:
        """Like GrpcMutationWriter.read_family: {row: {qualifier: newest value}}."""
        with self._lock:
            rows = self.tables.get(table_id, {})
            return {k: {q: versions[max(versions)] for (f, q), versions in rows[k].items() if f == family}
                    for k in set(row_keys) if k in rows}

    def swap_row(self, table_id: str, row_key: bytes, family: str, qualifier: bytes, expected: Optional[bytes],
                 mutations: Sequence, prefix: bool = False) -> bool:
        """Like GrpcMutationWriter.swap_row: ``mutations`` iff the cell's newest value
        is ``expected`` (None: absent; ``prefix``: starts with it), atomically."""
        with self._lock:
            call_no = len(self.calls)
            self.calls.append((table_id, [row_key]))
            if self.fault:
                injected = self.fault(table_id, [(row_key, mutations)], call_no)
                if injected is not None and injected[0] is not None and not injected[0].ok:
                    status = injected[0]
                    raise (BigtableRetryable if status.retryable else BigtablePermanent)(status.message)
            column = self.tables.get(table_id, {}).get(row_key, {}).get((family, qualifier))
            current = column[max(column)] if column else None
            if prefix and expected is not None and current is not None and current.startswith(expected):
                current = expected
            if current != expected:
                return False
            status = self._apply(table_id, row_key, mutations)
            if not status.ok:
                raise BigtablePermanent(status.message)
            return True

    def cells_since(self, table_id: str, row_keys: Sequence, family: str, since_ms: int) -> set:
        with self._lock:
            rows = self.tables.get(table_id, {})
            return {(k, q) for k in set(row_keys) for (f, q), versions in rows.get(k, {}).items()
                    if f == family and any(ts >= since_ms for ts in versions)}

    def cells_between(self, table_id: str, lo_ms: int, hi_ms: Optional[int] = None) -> Iterator:
        """Like GrpcMutationWriter.cells_between: (row, family, qualifier, ts) of
        the cells at lo_ms <= ts < hi_ms (None: no end), rows in key order."""
        end = float("inf") if hi_ms is None else hi_ms
        with self._lock:
            rows = self.tables.get(table_id, {})
            found = [(k, f, q, ts) for k in sorted(rows) for (f, q), versions in sorted(rows[k].items())
                     for ts in sorted(versions) if lo_ms <= ts < end]
        return iter(found)

    def _apply(self, table_id: str, row_key: bytes, mutations: Sequence) -> EntryStatus:
        known = self.families.get(table_id)
        if known is not None:
            for m in mutations:
                if m.family not in known:
                    return EntryStatus(13, f'unknown family "{m.family}"')
        rows = self.tables.setdefault(table_id, {})
        row = rows.setdefault(row_key, {})
        for m in mutations:
            column = row.setdefault((m.family, m.qualifier), {})
            if isinstance(m, SetCell):
                column[m.timestamp_ms] = m.value
            elif isinstance(m, DeleteCells):
                end = m.end_ms if m.end_ms > 0 else float("inf")
                if end == m.start_ms + 1:  # one version (the sweep's exact deletes): no scan of the column
                    column.pop(m.start_ms, None)
                else:
                    for ts in [t for t in column if m.start_ms <= t < end]:
                        del column[ts]
            if not column:
                del row[(m.family, m.qualifier)]
        if not row:
            del rows[row_key]
        return ENTRY_OK

    def close(self) -> None:
        pass

    # StateBackend
    def write_rows(self, rows: Sequence, before_retry=None) -> None:  # never retried here
        statuses = self.mutate_rows("__state__", rows)
        if not all(s.ok for s in statuses):
            raise BigtableRetryable("state write failed")

    def read_prefix(self, prefix: bytes, limit: Optional[int] = None) -> dict:
        rows = sorted((k, v) for k, v in self.latest("__state__").items() if k.startswith(prefix))
        return dict(rows if limit is None else rows[:limit])

    def keys_written_since(self, prefix: bytes, since_ms: int) -> dict:
        with self._lock:
            out = {}
            for k, row in self.tables.get("__state__", {}).items():
                stamps = [ts for v in row.values() for ts in v if ts >= since_ms]
                if k.startswith(prefix) and stamps:
                    out[k] = max(stamps)
            return out

    def read_keys(self, keys: Sequence) -> dict:
        latest = self.latest("__state__")
        return {k: latest[k] for k in keys if k in latest}

    def claim(self, key: bytes, unless, mutations: Sequence) -> bool:
        return self.check_and_mutate("__state__", key, unless, mutations)

    def swap(self, key: bytes, family: str, qualifier: bytes, expected: Optional[bytes], value: bytes,
             ts_ms: int) -> bool:
        return self.swap_cell("__state__", key, family, qualifier, expected, value, ts_ms)

    def latest(self, table_id: str) -> dict:
        """{row_key: {(family, qualifier): newest value}}."""
        with self._lock:
            return {
                key: {col: versions[max(versions)] for col, versions in row.items()}
                for key, row in self.tables.get(table_id, {}).items()
            }

    def versions(self, table_id: str) -> dict:
        with self._lock:
            return copy.deepcopy(self.tables.get(table_id, {}))


# --- DynamoDB Streams --------------------------------------------------------------


def client_error(code: str, message: str = "", operation: str = "GetRecords", status: int = 400) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message or code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, operation)


# DynamoDB Streams' GetRecords returns at most 1,000 records or 1 MB, whichever
# comes first: AWS's published limit, which moto does not keep
# (docs/development.md, two AWS emulators). The larger reading of "1 MB" here;
# the reader recognises a page cut at the smaller (stream_source.page_is_full).
GET_RECORDS_MAX_BYTES = 1 << 20


def _image_size(image: dict) -> int:
    """DynamoDB's size of an image; an image that is not one (tests write some,
    to see them dead-lettered) counts its text's length."""
    try:
        return item_size(image)
    except (MappingError, TypeError, AttributeError, KeyError, ValueError):
        return len(repr(image))


@dataclass
class FakeShard:
    shard_id: str
    parent_id: Optional[str] = None
    records: list = field(default_factory=list)  # boto3-form records
    closed: bool = False
    trimmed_before: int = 0  # records with index < this are gone (TrimmedDataAccess)
    listed: bool = True  # False once the shard aged out of the stream


class FakeStreamsClient:
    """boto3 ``dynamodbstreams`` client interface over in-memory shards.

    Iterators are opaque strings ``shard|index|generation``; ``expire_iterators()``
    makes every outstanding iterator raise ExpiredIteratorException once.
    ``faults``: a list of ClientErrors raised by the next calls (FIFO), to inject
    throttling storms and 500s. ``page_size`` caps records per GetRecords and
    ``page_bytes`` their size: a page ends at 1,000 records or 1 MB, whichever
    comes first, as AWS's GetRecords does, each record's size its ``SizeBytes``
    (its keys and images by DynamoDB's item-size rules); a page holds at least one.
    """

    def __init__(self, table: str = "Fake", page_size: int = 1000, describe_page: int = 100,
                 page_bytes: int = GET_RECORDS_MAX_BYTES) -> None:
        self.stream_arn = f"arn:aws:dynamodb:us-east-1:000000000000:table/{table}/stream/2024-01-01T00:00:00.000"
        self.table = table
        self.shards: dict = {}
        self.page_size = page_size
        self.page_bytes = page_bytes
        self.describe_page = describe_page
        self.faults: list = []
        self.calls: list = []
        self.view_type = "NEW_AND_OLD_IMAGES"
        self.stream_status = "ENABLED"
        self._generation = 0
        self._seq = 100000000000000000000
        self._lock = threading.Lock()
        self._clock_ms = 1_700_000_000_000

    # -- building the stream
    def add_shard(self, shard_id: str, parent_id: Optional[str] = None) -> FakeShard:
        shard = self.shards[shard_id] = FakeShard(shard_id, parent_id)
        return shard

    def put(self, shard_id: str, event: str, keys: dict, new: Optional[dict] = None, old: Optional[dict] = None,
            created_ms: Optional[int] = None) -> str:
        with self._lock:
            self._seq += 1
            seq = str(self._seq)
            if created_ms is None:
                self._clock_ms += 1
                created_ms = self._clock_ms
            size = sum(_image_size(image) for image in (keys, new, old) if image is not None)
            ddb = {"Keys": keys, "SequenceNumber": seq, "SizeBytes": size, "StreamViewType": self.view_type,
                   "ApproximateCreationDateTime": dt.datetime.fromtimestamp(created_ms / 1000, dt.timezone.utc)}
            if new is not None:
                ddb["NewImage"] = new
            if old is not None:
                ddb["OldImage"] = old
            self.shards[shard_id].records.append(
                {"eventID": f"e{seq}", "eventName": event, "eventSource": "aws:dynamodb", "dynamodb": ddb}
            )
            return seq

    def close_shard(self, shard_id: str) -> None:
        self.shards[shard_id].closed = True

    def split(self, parent_id: str, *child_ids: str) -> list:
        self.close_shard(parent_id)
        return [self.add_shard(c, parent_id) for c in child_ids]

    def expire_iterators(self) -> None:
        self._generation += 1

    # -- boto3 interface
    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.faults:
            fault = self.faults.pop(0)
            if fault is not None:
                raise fault

    def describe_stream(self, StreamArn: str, Limit: int = 100, ExclusiveStartShardId: Optional[str] = None,
                        ShardFilter: Optional[dict] = None) -> dict:
        self._call("DescribeStream")
        if StreamArn != self.stream_arn:
            raise client_error("ResourceNotFoundException", f"Requested resource not found: {StreamArn}",
                               "DescribeStream")
        listed = [s for s in self.shards.values() if s.listed]
        if ShardFilter is not None:  # CHILD_SHARDS, the only type: the children of one shard
            if ShardFilter.get("Type") != "CHILD_SHARDS" or not ShardFilter.get("ShardId"):
                raise client_error("ValidationException", f"bad ShardFilter {ShardFilter}", "DescribeStream")
            listed = [s for s in listed if s.parent_id == ShardFilter["ShardId"]]
        ids = [s.shard_id for s in listed]
        start = ids.index(ExclusiveStartShardId) + 1 if ExclusiveStartShardId in ids else 0
        page = listed[start:start + min(Limit, self.describe_page)]
        shards = []
        for s in page:
            seq_range = {"StartingSequenceNumber": s.records[0]["dynamodb"]["SequenceNumber"] if s.records else "0"}
            if s.closed and s.records:
                seq_range["EndingSequenceNumber"] = s.records[-1]["dynamodb"]["SequenceNumber"]
            entry = {"ShardId": s.shard_id, "SequenceNumberRange": seq_range}
            if s.parent_id:
                entry["ParentShardId"] = s.parent_id
            shards.append(entry)
        desc = {"StreamArn": self.stream_arn, "StreamStatus": self.stream_status,
                "StreamViewType": self.view_type, "TableName": self.table, "Shards": shards}
        if start + len(page) < len(listed):
            desc["LastEvaluatedShardId"] = page[-1].shard_id
        return {"StreamDescription": desc}

    def get_shard_iterator(self, StreamArn: str, ShardId: str, ShardIteratorType: str,
                           SequenceNumber: Optional[str] = None) -> dict:
        self._call("GetShardIterator")
        shard = self.shards.get(ShardId)
        if shard is None or not shard.listed:
            raise client_error("ResourceNotFoundException", f"shard {ShardId} not found", "GetShardIterator")
        if ShardIteratorType == "TRIM_HORIZON":
            index = shard.trimmed_before
        elif ShardIteratorType == "LATEST":
            index = len(shard.records)
        elif ShardIteratorType in ("AFTER_SEQUENCE_NUMBER", "AT_SEQUENCE_NUMBER"):
            seqs = [r["dynamodb"]["SequenceNumber"] for r in shard.records]
            if SequenceNumber not in seqs:
                raise client_error("ValidationException", f"unknown sequence number {SequenceNumber}",
                                   "GetShardIterator")
            index = seqs.index(SequenceNumber) + (1 if ShardIteratorType == "AFTER_SEQUENCE_NUMBER" else 0)
            # As on AWS: a position at or after a record the stream no longer
            # holds is refused, even when nothing after that record is gone
            # (a quiet shard whose last record aged out).
            if seqs.index(SequenceNumber) < shard.trimmed_before:
                raise client_error("TrimmedDataAccessException", "the requested data was trimmed",
                                   "GetShardIterator")
        else:
            raise client_error("ValidationException", f"bad iterator type {ShardIteratorType}", "GetShardIterator")
        return {"ShardIterator": f"{ShardId}|{index}|{self._generation}"}

    def get_records(self, ShardIterator: str, Limit: int = 1000) -> dict:
        self._call("GetRecords")
        try:
            shard_id, index_text, generation = ShardIterator.rsplit("|", 2)
            index = int(index_text)
        except ValueError:
            raise client_error("ValidationException", "invalid iterator") from None
        if int(generation) != self._generation:
            raise client_error("ExpiredIteratorException", "Iterator expired")
        shard = self.shards[shard_id]
        if index < shard.trimmed_before:
            raise client_error("TrimmedDataAccessException", "the requested data was trimmed")
        page = shard.records[index:index + min(Limit, self.page_size)]
        total = 0
        for n, record in enumerate(page):
            total += record["dynamodb"]["SizeBytes"]
            if total > self.page_bytes and n:
                page = page[:n]
                break
        nxt = index + len(page)
        # Records are never mutated by readers: a shallow copy keeps the fake from
        # charging deep-copy costs no real client has to the benchmarks.
        out = {"Records": list(page)}
        if not (shard.closed and nxt >= len(shard.records)):
            out["NextShardIterator"] = f"{shard_id}|{nxt}|{self._generation}"
        return out


# Beam pickles DoFns; a fake client (with its lock) cannot travel, so tests register
# it here and hand the pipeline a picklable factory that looks it up in-process.
FAKE_CLIENTS: dict = {}


@dataclass(frozen=True)
class RegisteredClient:
    name: str

    def __call__(self):
        return FAKE_CLIENTS[self.name]
