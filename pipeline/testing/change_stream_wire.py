"""The protobuf side of the test change-stream server: a logged change as
``ReadChangeStreamResponse`` messages (values over ``chunk_bytes`` in chunks,
long changes over several messages), heartbeats and CloseStream, and the
mutations a data request applies, its ``-1`` (server-assigned) cell timestamps
made the commit time's millisecond."""
from __future__ import annotations

from typing import Iterable, Optional

from google.cloud.bigtable_v2.types import bigtable as bt
from google.cloud.bigtable_v2.types import data as dt

from ddb2bt.pipeline.testing.change_log import LoggedChange, Range

Response = bt.ReadChangeStreamResponse.pb()
Request = bt.ReadChangeStreamRequest.pb()
InitialRequest = bt.GenerateInitialChangeStreamPartitionsRequest.pb()
InitialResponse = bt.GenerateInitialChangeStreamPartitionsResponse.pb()
Mutation = dt.Mutation.pb()
StreamPartition = dt.StreamPartition.pb()
Token = dt.StreamContinuationToken.pb()
DataChange = Response.DataChange
Chunk = Response.MutationChunk

# Mutations per message before a change continues in the next one.
CHUNKS_PER_MESSAGE = 100
DEFAULT_CHUNK_BYTES = 1024 * 1024
CLUSTER_ID = "local"
US_PER_MS = 1000


def partition_pb(rng: Range):
    p = StreamPartition()
    p.row_range.start_key_closed = rng.start
    p.row_range.end_key_open = rng.end
    return p


def range_of(partition) -> Range:
    """The [start, end) of a StreamPartition; ValueError for another form of range."""
    r = partition.row_range
    if r.WhichOneof("start_key") == "start_key_open" or r.WhichOneof("end_key") == "end_key_closed":
        raise ValueError("a partition's row range is [start_key_closed, end_key_open)")
    return Range(r.start_key_closed, r.end_key_open)


def token_pb(rng: Range, token: str):
    t = Token()
    t.partition.CopyFrom(partition_pb(rng))
    t.token = token
    return t


def _set_ts(ts, us: int) -> None:
    ts.seconds, ts.nanos = divmod(us, 1_000_000)
    ts.nanos *= 1000


def us_of(ts) -> int:
    return ts.seconds * 1_000_000 + ts.nanos // 1000


def _chunks(mutations: Iterable, chunk_bytes: int) -> list:
    """Each element a list of MutationChunk for one message: whole mutations
    grouped, a chunked SetCell one piece per message."""
    groups: list = [[]]
    for m in mutations:
        if m.WhichOneof("mutation") == "set_cell" and len(m.set_cell.value) > chunk_bytes:
            value = m.set_cell.value
            for offset in range(0, len(value), chunk_bytes):
                c = Chunk()
                if offset == 0:
                    c.mutation.set_cell.family_name = m.set_cell.family_name
                    c.mutation.set_cell.column_qualifier = m.set_cell.column_qualifier
                    c.mutation.set_cell.timestamp_micros = m.set_cell.timestamp_micros
                c.mutation.set_cell.value = value[offset:offset + chunk_bytes]
                c.chunk_info.chunked_value_size = len(value)
                c.chunk_info.chunked_value_offset = offset
                c.chunk_info.last_chunk = offset + chunk_bytes >= len(value)
                groups.append([c])
            groups.append([])
            continue
        if len(groups[-1]) >= CHUNKS_PER_MESSAGE:
            groups.append([])
        c = Chunk()
        c.mutation.CopyFrom(m)
        groups[-1].append(c)
    return [g for g in groups if g]


def data_change_messages(change: LoggedChange, token: str, watermark_us: int,
                         chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list:
    groups = _chunks(change.mutations, chunk_bytes)
    out = []
    for i, group in enumerate(groups):
        msg = Response()
        d = msg.data_change
        if i == 0:
            d.type_ = DataChange.Type.GARBAGE_COLLECTION if change.gc else DataChange.Type.USER
            if not change.gc:
                d.source_cluster_id = CLUSTER_ID
            d.row_key = change.row_key
            _set_ts(d.commit_timestamp, change.commit_us)
            d.tiebreaker = 0
        else:
            d.type_ = DataChange.Type.CONTINUATION
        d.chunks.extend(group)
        if i == len(groups) - 1:
            d.done = True
            d.token = token
            _set_ts(d.estimated_low_watermark, watermark_us)
        out.append(msg)
    return out


def heartbeat(rng: Range, token: str, watermark_us: int):
    msg = Response()
    msg.heartbeat.continuation_token.CopyFrom(token_pb(rng, token))
    _set_ts(msg.heartbeat.estimated_low_watermark, watermark_us)
    return msg


def close_stream(children: Optional[list] = None):
    """CloseStream, OK; ``children`` [(Range, token)] after a split."""
    msg = Response()
    msg.close_stream.status.code = 0
    for rng, token in children or ():
        msg.close_stream.continuation_tokens.append(token_pb(rng, token))
        msg.close_stream.new_partitions.append(partition_pb(rng))
    return msg


def stamp(mutations: Iterable, commit_us: int) -> None:
    """Server-assigned cell timestamps (-1) become the commit time's millisecond, in place."""
    for m in mutations:
        if m.WhichOneof("mutation") == "set_cell" and m.set_cell.timestamp_micros == -1:
            m.set_cell.timestamp_micros = commit_us // US_PER_MS * US_PER_MS


def as_logged(mutations: Iterable, families: Iterable[str]) -> tuple:
    """The mutations as a change stream shows them: DeleteFromRow as one
    DeleteFromFamily per column family of the table."""
    out = []
    for m in mutations:
        if m.WhichOneof("mutation") == "delete_from_row":
            for family in sorted(families):
                d = Mutation()
                d.delete_from_family.family_name = family
                out.append(d)
        else:
            c = Mutation()
            c.CopyFrom(m)
            out.append(c)
    return tuple(out)


def read_modify_write_cells(row) -> tuple:
    """The cells a ReadModifyWriteRow wrote (its response row) as SetCell mutations."""
    out = []
    for family in row.families:
        for column in family.columns:
            for cell in column.cells:
                m = Mutation()
                m.set_cell.family_name = family.name
                m.set_cell.column_qualifier = column.qualifier
                m.set_cell.timestamp_micros = cell.timestamp_micros
                m.set_cell.value = cell.value
                out.append(m)
    return tuple(out)
