"""Bigtable change streams read through the raw data API (python-bigtable has
no reader): the table's partitions (GenerateInitialChangeStreamPartitions), one
partition's stream (ReadChangeStream) from a start time or continuation tokens,
its DataChange messages merged into whole ``RowChange`` records (a change
spread over several messages, a value over several chunks), heartbeats with
their token and low watermark, and CloseStream with the new partitions of a
split or merge.

``read_changes`` reads every partition of a table, following splits, until no
change arrived for a while: what a command or a test without Beam uses. The
Beam reader (``ddb2bt.pipeline.source.change_stream``) drives ``ChangeStreamClient``
partition by partition with checkpoints in the job's state table.
"""
from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

from ddb2bt.pipeline.clients.bigtable.channel import bigtable_endpoint, close_bounded, make_channel
from ddb2bt.pipeline.clients.bigtable.errors import classify_api_error
from ddb2bt.pipeline.clients.retry import DEFAULT_DEADLINE_S, RetryPolicy, retrying
from ddb2bt.transforms.change_records import (SOURCE_GC, SOURCE_USER, DeleteCells, DeleteFamily, RowChange,
                                              SetCell)
from ddb2bt.transforms.errors import PermanentError

log = logging.getLogger(__name__)

US_PER_S = 1_000_000
# ReadChangeStreamResponse.DataChange.Type
GARBAGE_COLLECTION, CONTINUATION = 2, 3
# How often the server is asked for a heartbeat (token and low watermark) on a quiet stream.
HEARTBEAT_S = 1.0
# Partitions read at once in one pass (each a bounded ReadChangeStream that ends
# once the stream passed the pass's end time, a wait of about a heartbeat on the service).
PARALLEL_READS = 16


class ChangeStreamError(PermanentError):
    """The change stream cannot be read as asked (a broken message sequence, a
    mutation a reader cannot represent, a token or start time out of retention)."""


@dataclass(frozen=True, order=True)
class Partition:
    """A change-stream partition: the row range [start, end); empty end = table end."""

    start: bytes = b""
    end: bytes = b""

    @property
    def id(self) -> str:
        """The partition as ``RowChange.partition`` names it: ``<start hex>:<end hex>``."""
        return f"{self.start.hex()}:{self.end.hex()}"

    @classmethod
    def parse(cls, text: str) -> "Partition":
        start, sep, end = text.partition(":")
        if not sep:
            raise ValueError(f"not a change-stream partition id (<start hex>:<end hex>): {text!r}")
        return cls(bytes.fromhex(start), bytes.fromhex(end))


@dataclass(frozen=True)
class Heartbeat:
    """The stream is read up to ``token``; no later change is older than ``watermark_us``."""

    partition: Partition
    token: str
    watermark_us: int


@dataclass(frozen=True)
class PartitionClosed:
    """The stream of ``partition`` ended. With ``new_partitions`` (a split or a
    merge), each new partition is read next from the ``tokens`` that cover it;
    without, the stream finished (past its end time)."""

    partition: Partition
    tokens: tuple  # ((Partition, token), ...)
    new_partitions: tuple
    status_code: int = 0
    message: str = ""

    def tokens_for(self, new: Partition) -> list:
        """The continuation tokens whose partitions lie within ``new``."""
        return [(p, t) for p, t in self.tokens if p.start >= new.start and (not new.end or (p.end and p.end <= new.end))]


Event = Union[RowChange, Heartbeat, PartitionClosed]


def _us(ts) -> int:
    return ts.seconds * US_PER_S + ts.nanos // 1000


def partition_of(pb) -> Partition:
    return Partition(pb.row_range.start_key_closed, pb.row_range.end_key_open)


def _mutation(m):
    kind = m.WhichOneof("mutation")
    if kind == "set_cell":
        c = m.set_cell
        return SetCell(c.family_name, c.column_qualifier, c.timestamp_micros, c.value)
    if kind == "delete_from_column":
        c, r = m.delete_from_column, m.delete_from_column.time_range
        return DeleteCells(c.family_name, c.column_qualifier, r.start_timestamp_micros or None,
                           r.end_timestamp_micros or None)
    if kind == "delete_from_family":
        return DeleteFamily(m.delete_from_family.family_name)
    raise ChangeStreamError(f"the change stream holds a {kind} mutation, which the reader cannot represent "
                            "(aggregate families and whole-row deletes are not part of a table's change stream)")


class ChangeMerger:
    """Merges one partition's ReadChangeStreamResponse messages (protobuf) into
    events: a DataChange may span messages (CONTINUATION, ``done`` on the last)
    and a SetCell's value may span chunks (``chunk_info``); the token and
    watermark come with the last message of a change."""

    def __init__(self, partition: Partition) -> None:
        self.partition = partition
        self._head = None  # the first message of the change being merged
        self._mutations: list = []
        self._cell = None  # (SetCell fields, bytearray, expected size) of a chunked value

    def feed(self, msg) -> Optional[Event]:
        kind = msg.WhichOneof("stream_record")
        if kind != "data_change" and (self._head is not None or self._cell is not None):
            raise ChangeStreamError(f"a {kind} arrived inside an unfinished change on partition {self.partition.id}")
        if kind == "heartbeat":
            hb = msg.heartbeat
            return Heartbeat(partition_of(hb.continuation_token.partition), hb.continuation_token.token,
                             _us(hb.estimated_low_watermark))
        if kind == "close_stream":
            c = msg.close_stream
            return PartitionClosed(self.partition, tuple((partition_of(t.partition), t.token) for t in
                                                         c.continuation_tokens),
                                   tuple(partition_of(p) for p in c.new_partitions), c.status.code, c.status.message)
        if kind != "data_change":
            raise ChangeStreamError(f"an empty ReadChangeStream message on partition {self.partition.id}")
        return self._data(msg.data_change)

    def _data(self, d) -> Optional[RowChange]:
        continuation = d.type_ == CONTINUATION
        if continuation != (self._head is not None):
            raise ChangeStreamError(f"a DataChange {'continuation without a start' if continuation else 'started inside another'}"
                                    f" on partition {self.partition.id}")
        if not continuation:
            self._head = d
        for chunk in d.chunks:
            self._chunk(chunk)
        if not d.done:
            return None
        if self._cell is not None:
            raise ChangeStreamError(f"a change ended inside a chunked value on partition {self.partition.id}")
        head, mutations = self._head, tuple(self._mutations)
        self._head, self._mutations = None, []
        return RowChange(head.row_key, _us(head.commit_timestamp), head.tiebreaker,
                         SOURCE_GC if head.type_ == GARBAGE_COLLECTION else SOURCE_USER, mutations, self.partition.id, d.token)

    def _chunk(self, chunk) -> None:
        if not chunk.HasField("chunk_info"):
            if self._cell is not None:
                raise ChangeStreamError(f"a mutation arrived inside a chunked value on partition {self.partition.id}")
            self._mutations.append(_mutation(chunk.mutation))
            return
        info, cell = chunk.chunk_info, chunk.mutation.set_cell
        if info.chunked_value_offset == 0:
            if self._cell is not None:
                raise ChangeStreamError(f"a chunked value restarted on partition {self.partition.id}")
            self._cell = (cell.family_name, cell.column_qualifier, cell.timestamp_micros, bytearray(),
                          info.chunked_value_size)
        elif self._cell is None or info.chunked_value_offset != len(self._cell[3]):
            raise ChangeStreamError(f"a value chunk at offset {info.chunked_value_offset} out of order on "
                                    f"partition {self.partition.id}")
        self._cell[3].extend(cell.value)
        if info.last_chunk:
            family, qualifier, ts, value, size = self._cell
            if len(value) != size:
                raise ChangeStreamError(f"a chunked value of {len(value)} bytes, announced {size}, on partition "
                                        f"{self.partition.id}")
            self._mutations.append(SetCell(family, qualifier, ts, bytes(value)))
            self._cell = None


def data_api_client(channel_factory: Callable = make_channel):
    """The generated data-API client, on the emulator's channel or the service's."""
    from google.cloud.bigtable_v2 import BigtableClient
    from google.cloud.bigtable_v2.services.bigtable.transports import BigtableGrpcTransport

    return BigtableClient(transport=BigtableGrpcTransport(channel=channel_factory()))


def table_name(project: str, instance: str, table: str) -> str:
    return f"projects/{project}/instances/{instance}/tables/{table}"


class ChangeStreamClient:
    """One table's change stream through the raw RPCs; ``api`` is a generated
    ``BigtableClient`` (``data_api_client()``), kept open by its owner."""

    def __init__(self, api, table: str, app_profile: Optional[str] = None,
                 policy: RetryPolicy = RetryPolicy(initial_s=0.2, max_backoff_s=5.0, deadline_s=DEFAULT_DEADLINE_S),
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.api, self.table, self.app_profile = api, table, app_profile or ""
        self.policy, self._sleep = policy, sleep

    def _where(self) -> str:
        return f"Bigtable ({bigtable_endpoint()})"

    def partitions(self) -> list:
        """The table's partitions now (retried by our policy)."""
        def attempt() -> list:
            try:
                return sorted(partition_of(type(r).pb(r).partition) for r in
                              self.api.generate_initial_change_stream_partitions(
                                  request={"table_name": self.table, "app_profile_id": self.app_profile},
                                  retry=None, timeout=30.0))
            except Exception as exc:
                raise _classified(exc, "GenerateInitialChangeStreamPartitions") from exc

        return retrying(self.policy, f"GenerateInitialChangeStreamPartitions on {self.table}", where=self._where(),
                        sleep=self._sleep)(attempt)

    def read(self, partition: Partition, start_time_us: Optional[int] = None, tokens: Sequence = (),
             end_time_us: Optional[int] = None, heartbeat_s: float = HEARTBEAT_S) -> Iterator[Event]:
        """One ReadChangeStream call (not retried: the caller resumes from the
        last token it holds). ``tokens``: [(Partition, token)] covering ``partition``."""
        from google.cloud.bigtable_v2.types import ReadChangeStreamRequest

        request = ReadChangeStreamRequest.pb()(table_name=self.table, app_profile_id=self.app_profile)
        request.partition.row_range.start_key_closed = partition.start
        request.partition.row_range.end_key_open = partition.end
        if tokens:
            for p, token in tokens:
                t = request.continuation_tokens.tokens.add(token=token)
                t.partition.row_range.start_key_closed = p.start
                t.partition.row_range.end_key_open = p.end
        elif start_time_us is not None:
            request.start_time.seconds, micros = divmod(start_time_us, US_PER_S)
            request.start_time.nanos = micros * 1000
        if end_time_us is not None:
            request.end_time.seconds, micros = divmod(end_time_us, US_PER_S)
            request.end_time.nanos = micros * 1000
        request.heartbeat_duration.seconds = int(heartbeat_s)
        request.heartbeat_duration.nanos = int((heartbeat_s - int(heartbeat_s)) * 1e9)
        timeout = None if end_time_us is None else max(30.0, (end_time_us / US_PER_S - time.time()) + 30.0)
        merger = ChangeMerger(partition)
        try:
            for response in self.api.read_change_stream(request=ReadChangeStreamRequest(mapping=request),
                                                        retry=None, timeout=timeout):
                event = merger.feed(type(response).pb(response))
                if event is not None:
                    yield event
        except ChangeStreamError:
            raise
        except Exception as exc:
            raise _classified(exc, "ReadChangeStream") from exc


def _classified(exc: Exception, method: str) -> Exception:
    from google.api_core import exceptions as gexc

    if isinstance(exc, gexc.OutOfRange):
        return ChangeStreamError(f"{method} failed: the start time or continuation token is outside the change "
                                 f"stream's retention: {exc.message}; start again from a time within it",
                                 reason="out_of_retention")
    if isinstance(exc, gexc.FailedPrecondition):
        return ChangeStreamError(f"{method} failed: {exc.message}; enable the table's change stream first "
                                 "(ddb2bt create-table --change-stream)", reason="change_stream_disabled")
    if isinstance(exc, gexc.GoogleAPICallError):
        return classify_api_error(exc, method)
    return exc


def _covers(tokens: Sequence, partition: Partition) -> bool:
    ranges = sorted(p for p, _ in tokens)
    return bool(ranges) and ranges[0].start == partition.start and ranges[-1].end == partition.end and all(
        a.end == b.start for a, b in zip(ranges, ranges[1:]))


class Frontier:
    """Where each partition of a table is read from next: a start time or the
    tokens of its last read, and the partitions a split or merge announced whose
    tokens do not cover them yet."""

    def __init__(self, start_time_us: Optional[int]) -> None:
        self.start_time_us = start_time_us
        self.cursors: dict = {}  # Partition -> [(Partition, token)] (empty: from its start time)
        self.starts: dict = {}  # Partition without a token yet -> its start time, when not start_time_us
        self.watermarks: dict = {}  # Partition -> no change not yet read there is older than this (us)
        self._waiting: dict = {}  # new Partition -> tokens gathered so far
        self._waiting_marks: dict = {}  # new Partition -> the least mark of its parents so far

    def low_watermark_us(self) -> Optional[int]:
        """No change not yet read is older than this (the least of the partitions'
        marks; a partition without one holds it at the start time): the reader's
        lag is the wall time minus this. None before any partition has a mark."""
        marks = [self.watermarks.get(p, self.start_of(p)) for p in self.cursors]
        return None if not marks or None in marks else min(marks)

    def mark(self, partition: Partition, watermark_us: int) -> None:
        if partition in self.cursors:
            self.watermarks[partition] = max(watermark_us, self.watermarks.get(partition, 0))

    def start_of(self, partition: Partition) -> int:
        return self.starts.get(partition, self.start_time_us)

    def finished(self, partition: Partition, end_us: int) -> None:
        """A read of ``partition`` up to ``end_us`` ended with no token: nothing
        up to ``end_us`` is left there, so it starts after it next time."""
        if not self.cursors.get(partition):
            self.starts[partition] = end_us + 1
        self.mark(partition, end_us + 1)

    def advance(self, partition: Partition, token: str) -> None:
        self.cursors[partition] = [(partition, token)]
        self.starts.pop(partition, None)

    def to_json(self) -> str:
        """The frontier as text for a checkpoint (``from_json`` reads it back)."""
        def tokens(ts: Sequence) -> list:
            return [[p.id, t] for p, t in ts]

        return json.dumps({"start_time_us": self.start_time_us,
                           "cursors": {p.id: tokens(ts) for p, ts in sorted(self.cursors.items())},
                           "starts": {p.id: us for p, us in sorted(self.starts.items())},
                           "watermarks": {p.id: us for p, us in sorted(self.watermarks.items())},
                           "waiting": {p.id: tokens(ts) for p, ts in sorted(self._waiting.items())},
                           "waiting_marks": {p.id: us for p, us in sorted(self._waiting_marks.items())}})

    @classmethod
    def from_json(cls, text: str) -> "Frontier":
        data = json.loads(text)
        frontier = cls(data["start_time_us"])

        def tokens(ts: list) -> list:
            return [(Partition.parse(p), t) for p, t in ts]

        frontier.cursors = {Partition.parse(p): tokens(ts) for p, ts in data["cursors"].items()}
        frontier.starts = {Partition.parse(p): us for p, us in data["starts"].items()}
        frontier.watermarks = {Partition.parse(p): us for p, us in data.get("watermarks", {}).items()}
        frontier._waiting = {Partition.parse(p): tokens(ts) for p, ts in data["waiting"].items()}
        frontier._waiting_marks = {Partition.parse(p): us for p, us in data.get("waiting_marks", {}).items()}
        return frontier

    def close(self, closed: PartitionClosed) -> None:
        """The stream of a partition ended; a finished one (past its end time) stays to be read again."""
        if not closed.new_partitions:
            return
        del self.cursors[closed.partition]
        self.starts.pop(closed.partition, None)
        parent_mark = self.watermarks.pop(closed.partition, None)
        for new in closed.new_partitions:
            gathered = self._waiting.setdefault(new, [])
            gathered += [t for t in closed.tokens_for(new) if t not in gathered]
            if parent_mark is not None:
                self._waiting_marks[new] = min(parent_mark, self._waiting_marks.get(new, parent_mark))
            if _covers(gathered, new):
                self.cursors[new] = self._waiting.pop(new)
                mark = self._waiting_marks.pop(new, None)
                if mark is not None:
                    self.watermarks[new] = mark


def initial_frontier(stream: ChangeStreamClient, start_time_us: int) -> Frontier:
    """Every partition of the table now, each to be read from ``start_time_us``."""
    frontier = Frontier(start_time_us)
    frontier.cursors = {p: [] for p in stream.partitions()}
    return frontier


def read_pass(stream: ChangeStreamClient, frontier: Frontier, end_us: int,
              sleep: Callable[[float], None] = time.sleep) -> list:
    """Read every partition of ``frontier`` up to ``end_us`` (one bounded
    ReadChangeStream each, retried by the client policy from the partition's
    last token; up to PARALLEL_READS partitions at once), advancing ``frontier``
    past what was read; the changes, partition after partition, each in commit
    order. A partition split or merged on the way is
    replaced by its new partitions, read in the next pass."""
    def read(partition: Partition, tokens: list) -> list:
        def step() -> list:
            return list(stream.read(partition, None if tokens else frontier.start_of(partition), tokens, end_us))

        return retrying(stream.policy, f"ReadChangeStream on {stream.table} partition {partition.id}",
                        where=f"Bigtable ({bigtable_endpoint()})", sleep=sleep)(step)

    cursors = sorted(frontier.cursors.items())
    if len(cursors) == 1:
        read_events = [read(*cursors[0])]
    else:
        with ThreadPoolExecutor(max_workers=min(PARALLEL_READS, len(cursors)), thread_name_prefix="changes") as pool:
            read_events = list(pool.map(lambda cursor: read(*cursor), cursors))
    changes: list = []
    for (partition, _), events in zip(cursors, read_events):
        for event in events:
            if isinstance(event, RowChange):
                changes.append(event)
                frontier.advance(partition, event.token)
            elif isinstance(event, Heartbeat):
                frontier.advance(partition, event.token)
                frontier.mark(partition, event.watermark_us)
            elif event.status_code:
                raise ChangeStreamError(f"the change stream of {stream.table} partition {partition.id} closed with "
                                        f"status {event.status_code}: {event.message}", reason="closed_with_error")
            elif event.new_partitions:
                frontier.close(event)
            else:
                frontier.finished(partition, end_us)
    return changes


def read_changes(client, table: str, start_time_us: Optional[int], until_idle_s: float,
                 app_profile: Optional[str] = None, poll_s: float = 0.2,
                 clock: Callable[[], float] = time.monotonic, wall_us: Callable[[], int] = lambda: int(time.time() * US_PER_S),
                 sleep: Callable[[float], None] = time.sleep) -> Iterator[RowChange]:
    """Every change to ``table`` (``projects/P/instances/I/tables/T``) from
    ``start_time_us`` (None: from now), all partitions, splits followed, until no
    change arrived for ``until_idle_s``. ``client``: a generated data-API client
    (``data_api_client()``). Each partition is read in bounded steps up to the
    time of the step; a failed step is retried by the client policy from the
    last token (no change is yielded twice, none skipped)."""
    stream = ChangeStreamClient(client, table, app_profile, sleep=sleep)
    frontier = initial_frontier(stream, start_time_us if start_time_us is not None else wall_us())
    last_change = clock()
    while True:
        changes = read_pass(stream, frontier, wall_us(), sleep)
        yield from changes
        if changes:
            last_change = clock()
        elif clock() - last_change >= until_idle_s:
            return
        else:
            sleep(poll_s)


def open_client():
    """A data-API client for ``read_changes``, and its close (bounded)."""
    api = data_api_client()
    return api, lambda: close_bounded(api.transport.close, "Bigtable data-API client")
