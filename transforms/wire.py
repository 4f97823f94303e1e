"""Bigtable's mutation messages in the protobuf wire format, written directly: pure
(bytes in, bytes out; no protobuf library, no I/O).

A MutateRows ``Entry`` is its row key field followed by one ``mutations`` field
per mutation, and protobuf concatenates repeated fields: the bytes of a row's
mutations (``encode_mutations``) can be produced once, where the mutations are
made — the compiled mapping does (``transforms/compiled.py``) — and a row that
several changes touch is then the concatenation of their bytes, in stream order.
The request encoder (``pipeline/clients/bigtable/wire.py``) puts the row key and
the entry's length around them. What these functions write is byte for byte what
the protobuf library serializes for the same message (property-tested:
``tests/unit/sink/test_sink_requests.py``, ``tests/unit/transforms/test_compiled_mapping.py``).

Field numbers (google/bigtable/v2/bigtable.proto, data.proto) as wire tags,
(number << 3) | wire type (0 varint, 2 length-delimited).
"""
from __future__ import annotations

from typing import Sequence

from ddb2bt.transforms.model import DeleteCells, SetCell
from ddb2bt.transforms.native import native_encode_mutations

US_PER_MS = 1000  # the model's timestamps are milliseconds, the wire's microseconds

REQ_TABLE_NAME = b"\x0a"  # MutateRowsRequest.table_name = 1
REQ_ENTRY = b"\x12"  # MutateRowsRequest.entries = 2
REQ_APP_PROFILE = b"\x1a"  # MutateRowsRequest.app_profile_id = 3
ENTRY_ROW_KEY = b"\x0a"  # Entry.row_key = 1
ENTRY_MUTATION = b"\x12"  # Entry.mutations = 2
MUT_SET_CELL = b"\x0a"  # Mutation.set_cell = 1
MUT_DELETE_FROM_COLUMN = b"\x12"  # Mutation.delete_from_column = 2
CELL_FAMILY = b"\x0a"  # SetCell/DeleteFromColumn.family_name = 1
CELL_QUALIFIER = b"\x12"  # SetCell/DeleteFromColumn.column_qualifier = 2
SET_TIMESTAMP = b"\x18"  # SetCell.timestamp_micros = 3 (varint)
SET_VALUE = b"\x22"  # SetCell.value = 4
DELETE_TIME_RANGE = b"\x1a"  # DeleteFromColumn.time_range = 3
RANGE_START = b"\x08"  # TimestampRange.start_timestamp_micros = 1 (varint)
RANGE_END = b"\x10"  # TimestampRange.end_timestamp_micros = 2 (varint)

_UINT64 = 1 << 64  # negative int64 varints are their two's complement in 64 bits
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# Varints of 0..16383 looked up, not computed: every length up to 16 KiB (values
# longer than that are computed, and rare).
VARINT_TABLE_SIZE = 1 << 14
# Bytes of a varint below 2**14 (the lookup table's range): 1 below 128, else 2.
# So a length-delimited field of n < 2**14 bytes takes n + 2 (tag, 1-byte length)
# or n + 3 (tag, 2-byte length) bytes.
ONE_BYTE_VARINT = 1 << 7
# (family, qualifier) → their encoded fields: a table has few distinct columns.
# Bounded so a mapping with unbounded column names cannot grow it for ever.
_MAX_CACHED_COLUMNS = 100_000
COLUMN_FIELDS: dict = {}


def _varint_bitwise(value: int) -> bytes:
    """A varint seven bits at a time (builds the tables below)."""
    if value < 0:
        value += _UINT64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


VARINTS = tuple(_varint_bitwise(i) for i in range(VARINT_TABLE_SIZE))
# 14 bits that more bits follow: both of their bytes have the continuation bit.
_TABLE_BITS = VARINT_TABLE_SIZE.bit_length() - 1
_CONTINUED = tuple(bytes(((i & 0x7F) | 0x80, (i >> 7) | 0x80)) for i in range(VARINT_TABLE_SIZE))


def varint(value: int) -> bytes:
    """A varint, fourteen bits per lookup: a timestamp's (~51 bits of microseconds)
    is four lookups instead of eight rounds of bit arithmetic."""
    if value < 0:
        value += _UINT64
    if value < VARINT_TABLE_SIZE:
        return VARINTS[value]
    out = []
    while value >= VARINT_TABLE_SIZE:
        out.append(_CONTINUED[value & (VARINT_TABLE_SIZE - 1)])
        value >>= _TABLE_BITS
    out.append(VARINTS[value])
    return b"".join(out)


# The last high part timestamp_varint encoded, and its bytes: consecutive changes'
# timestamps differ only in their low bits (one tuple, swapped whole: thread-safe).
_last_high: tuple = (-1, b"")


def timestamp_varint(micros: int) -> bytes:
    """varint(micros) for 2**14 <= micros < 2**63 (a timestamp after 1970-01-01
    00:00:00.016384): the low fourteen bits looked up, the rest reused from the
    previous call when it is the same — one change after another, it is."""
    global _last_high
    high = micros >> _TABLE_BITS
    last = _last_high
    if last[0] != high:
        last = _last_high = (high, varint(high))
    return _CONTINUED[micros & (VARINT_TABLE_SIZE - 1)] + last[1]


def int64(micros: int) -> bytes:
    """A timestamp's varint; out of int64 range is refused, as the message would."""
    if not INT64_MIN <= micros <= INT64_MAX:
        raise ValueError(f"timestamp {micros} us is out of range for int64")
    return varint(micros)


def length_delimited(tag: bytes, data: bytes) -> bytes:
    n = len(data)
    return tag + (VARINTS[n] if n < VARINT_TABLE_SIZE else varint(n)) + data


def column_fields(key: tuple) -> tuple:
    """(the encoded family and qualifier fields of ``key`` = (family, qualifier),
    their length); cached."""
    family, qualifier = key
    family_bytes = family.encode()
    # proto3: a field holding its default (empty) is not written.
    fields = ((length_delimited(CELL_FAMILY, family_bytes) if family_bytes else b"")
              + (length_delimited(CELL_QUALIFIER, qualifier) if qualifier else b""))
    if len(COLUMN_FIELDS) < _MAX_CACHED_COLUMNS:
        COLUMN_FIELDS[key] = (fields, len(fields))
    return fields, len(fields)


def timestamp_field(ts_ms: int) -> bytes:
    """SetCell.timestamp_micros for ``ts_ms`` (absent when 0, as proto3 omits it)."""
    micros = ts_ms * US_PER_MS
    return SET_TIMESTAMP + int64(micros) if micros else b""


def range_field(start_ms: int, end_ms: int) -> bytes:
    """DeleteFromColumn.time_range for [start_ms, end_ms): present even when empty
    (a set message field is written even with every field at its default)."""
    start, end = start_ms * US_PER_MS, end_ms * US_PER_MS
    return length_delimited(DELETE_TIME_RANGE, (RANGE_START + int64(start) if start else b"")
                            + (RANGE_END + int64(end) if end else b""))


def mutation_field(kind: bytes, body_len: int, *body: bytes, field: bytes = ENTRY_MUTATION) -> bytes:
    """One Entry.mutations field (or another repeated Mutation ``field``:
    CheckAndMutateRowRequest's): ``kind`` (MUT_SET_CELL or
    MUT_DELETE_FROM_COLUMN) around the message whose pieces are ``body``,
    ``body_len`` bytes in all."""
    inner = kind + (VARINTS[body_len] if body_len < VARINT_TABLE_SIZE else varint(body_len))
    n = len(inner) + body_len
    return b"".join((field, VARINTS[n] if n < VARINT_TABLE_SIZE else varint(n), inner) + body)


def set_cell(family: str, qualifier: bytes, value: bytes, ts_field: bytes, field: bytes = ENTRY_MUTATION) -> bytes:
    """SetCell(family, qualifier, value) at the timestamp of ``ts_field``
    (``timestamp_field``), as one Entry.mutations field (or ``field``)."""
    column, n = COLUMN_FIELDS.get((family, qualifier)) or column_fields((family, qualifier))
    if value:
        value_field = length_delimited(SET_VALUE, value)
        return mutation_field(MUT_SET_CELL, n + len(ts_field) + len(value_field), column, ts_field, value_field,
                              field=field)
    return mutation_field(MUT_SET_CELL, n + len(ts_field), column, ts_field, field=field)


def delete_cells(family: str, qualifier: bytes, time_range: bytes, field: bytes = ENTRY_MUTATION) -> bytes:
    """DeleteFromColumn(family, qualifier) over ``time_range`` (``range_field``),
    as one Entry.mutations field (or ``field``)."""
    column, n = COLUMN_FIELDS.get((family, qualifier)) or column_fields((family, qualifier))
    return mutation_field(MUT_DELETE_FROM_COLUMN, n + len(time_range), column, time_range, field=field)


# The C encoder where it runs (transforms/native.py), else None.
_native_encode = native_encode_mutations(SetCell, DeleteCells)


def encode_mutations(mutations: Sequence, field: bytes = ENTRY_MUTATION) -> bytes:
    """The Entry.mutations fields of ``mutations`` (SetCell / DeleteCells), in
    order; or another repeated Mutation ``field`` (CheckAndMutateRowRequest's).
    In C where built (transforms/native.py), else ``encode_mutations_py``."""
    if _native_encode is not None:
        data = _native_encode(mutations, field)
        if data is not None:
            return data
    return encode_mutations_py(mutations, field)


def encode_mutations_py(mutations: Sequence, field: bytes = ENTRY_MUTATION) -> bytes:
    """``encode_mutations`` in Python: the reference, and every mutation the C
    does not write (it raises where one cannot be encoded). A change's
    mutations share a timestamp, and its deletes a range: each is encoded once
    per run of equal ones."""
    out = []
    last_ts = last_range = None
    ts_field = time_range = b""
    for m in mutations:
        if type(m) is SetCell:
            if m.timestamp_ms != last_ts or type(m.timestamp_ms) is not int:  # 1.0 == 1, and is refused
                last_ts, ts_field = m.timestamp_ms, timestamp_field(m.timestamp_ms)
            out.append(set_cell(m.family, m.qualifier, m.value, ts_field, field))
        elif type(m) is DeleteCells:
            if (m.start_ms, m.end_ms) != last_range or type(m.start_ms) is not int or type(m.end_ms) is not int:
                last_range, time_range = (m.start_ms, m.end_ms), range_field(m.start_ms, m.end_ms)
            out.append(delete_cells(m.family, m.qualifier, time_range, field))
        else:
            raise TypeError(f"unknown mutation {type(m).__name__}")
    return b"".join(out)


# --- decoding: the mutations a change's wire bytes say -----------------------------
# A change built with only its wire bytes (the compiled mapping's) gets its
# mutation tuples from here, when something reads them (model.RowChange.mutations):
# the few readers that need them (dead letters, version claims, the in-memory
# fake, the tests) then see exactly the tuples the bytes were written from.

_VARINT_FIELDS = frozenset((SET_TIMESTAMP[0], RANGE_START[0], RANGE_END[0]))
_CONTINUATION_BIT = 0x80
_VARINT_PAYLOAD = 0x7F
_VARINT_SHIFT = 7


def _read_varint(data: bytes, i: int) -> tuple:
    """(the varint at ``data[i:]``, the index after it)."""
    value = shift = 0
    while True:
        if i >= len(data):
            raise ValueError(f"a varint runs past the end at byte {i}: truncated")
        byte = data[i]
        i += 1
        value |= (byte & _VARINT_PAYLOAD) << shift
        if byte < _CONTINUATION_BIT:
            return value, i
        shift += _VARINT_SHIFT


def _message_fields(data: bytes, i: int, stop: int) -> dict:
    """{tag byte: value} of the message in ``data[i:stop]``: an int for the
    varint fields, bytes for the rest (every field this module writes has a
    one-byte tag and appears at most once)."""
    fields: dict = {}
    while i < stop:
        tag = data[i]
        if tag in fields:
            raise ValueError(f"field tag {tag:#x} repeated in a mutation")
        value, i = _read_varint(data, i + 1)
        if tag not in _VARINT_FIELDS:
            value, i = data[i:i + value], i + value
        fields[tag] = value
    if i != stop:
        raise ValueError("a mutation's field runs past its message")
    return fields


def _ms(fields: dict, tag: bytes) -> int:
    """A timestamp field in milliseconds (int64 microseconds on the wire; absent: 0)."""
    micros = fields.pop(tag[0], 0)
    if micros > INT64_MAX:
        micros -= _UINT64
    ms, rest = divmod(micros, US_PER_MS)
    if rest:
        raise ValueError(f"timestamp {micros} us is not whole milliseconds: not written from the model")
    return ms


def set_cell_columns(data: bytes) -> set:
    """{(family, qualifier)} of the SetCell mutations in ``data``
    (``encode_mutations``' bytes), read without decoding the rest: no value is
    copied and no mutation built. What a backfill's repair intent records of
    every guarded change (sink/guards.py): decoding them all cost the export
    backfill more CPU than its mapping."""
    out = set()
    i, end = 0, len(data)
    set_cell, family_tag, qualifier_tag = MUT_SET_CELL[0], CELL_FAMILY[0], CELL_QUALIFIER[0]
    while i < end:
        n, i = _read_varint(data, i + 1)  # an Entry.mutations field and its length
        stop = i + n
        if data[i] == set_cell:
            _, j = _read_varint(data, i + 1)  # the SetCell message's length
            family = qualifier = b""
            while j < stop:
                tag = data[j]
                value, j = _read_varint(data, j + 1)
                if tag in _VARINT_FIELDS:
                    continue
                if tag == family_tag:
                    family = data[j:j + value]
                elif tag == qualifier_tag:
                    qualifier = data[j:j + value]
                j += value
            out.add((family.decode("utf-8"), qualifier))
        i = stop
    return out


def decode_mutations(data: bytes) -> tuple:
    """``encode_mutations`` inverted: the SetCell / DeleteCells tuples whose
    Entry.mutations fields ``data`` is, in order. Refuses anything it does not
    write (another field, a repeated one, a length past the end)."""
    out = []
    i, end = 0, len(data)
    while i < end:
        if data[i] != ENTRY_MUTATION[0]:
            raise ValueError(f"not an Entry.mutations field at byte {i}")
        n, i = _read_varint(data, i + 1)
        stop = i + n
        if n == 0 or stop > end:
            raise ValueError(f"a mutation's length does not match its message at byte {i}")
        kind = data[i]
        body_len, i = _read_varint(data, i + 1)
        if i + body_len != stop or stop > end:
            raise ValueError(f"a mutation's length does not match its message at byte {i}")
        fields = _message_fields(data, i, stop)
        family = fields.pop(CELL_FAMILY[0], b"").decode("utf-8")
        qualifier = fields.pop(CELL_QUALIFIER[0], b"")
        if kind == MUT_SET_CELL[0]:
            timestamp_ms = _ms(fields, SET_TIMESTAMP)
            mutation = SetCell(family, qualifier, fields.pop(SET_VALUE[0], b""), timestamp_ms)
        elif kind == MUT_DELETE_FROM_COLUMN[0]:
            time_range = fields.pop(DELETE_TIME_RANGE[0], None)
            if time_range is None:
                raise ValueError("a DeleteFromColumn without its time range: not written from the model")
            bounds = _message_fields(time_range, 0, len(time_range))
            start_ms, end_ms = _ms(bounds, RANGE_START), _ms(bounds, RANGE_END)
            if bounds:
                raise ValueError(f"unexpected time range fields {sorted(bounds)}")
            mutation = DeleteCells(family, qualifier, start_ms, end_ms)
        else:
            raise ValueError(f"unknown mutation kind {kind:#x}")
        if fields:
            raise ValueError(f"unexpected mutation fields {sorted(fields)}")
        out.append(mutation)
        i = stop
    return tuple(out)
