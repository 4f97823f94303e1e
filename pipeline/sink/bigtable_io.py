"""Bigtable access: the MutateRows writer on pre-built protobufs, table admin, and
row reads for the state table, verification and tests.

Why raw protobufs: the data client's per-entry conversion costs ~75 µs per row
(measured: 7.5 s CPU per 100k rows), several times the cost of the RPC itself;
building ``MutateRowsRequest`` messages directly is ~8x cheaper. Retries and
idempotency stay ours (``ddb2bt.pipeline.sink.sink``): every mutation carries an explicit
whole-millisecond timestamp, so re-sending an entry is always safe.

Errors are classified here, once, where they enter: ``EntryStatus.retryable``
for per-entry failures, ``BigtableRetryable`` / ``BigtablePermanent`` for RPCs.
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Protocol, Sequence

import grpc

from ddb2bt.transforms.config import FamilyConfig, MappingConfig
from ddb2bt.transforms.errors import MappingError, PermanentError, RetryableError
from ddb2bt.transforms.model import DeleteCells, SetCell

log = logging.getLogger(__name__)

EMULATOR_ENV = "BIGTABLE_EMULATOR_HOST"
DEFAULT_ENDPOINT = "bigtable.googleapis.com:443"
DATA_SCOPES = ("https://www.googleapis.com/auth/bigtable.data",)
MUTATE_ROWS_METHOD = "/google.bigtable.v2.Bigtable/MutateRows"
CHECK_AND_MUTATE_METHOD = "/google.bigtable.v2.Bigtable/CheckAndMutateRow"
READ_ROWS_METHOD = "/google.bigtable.v2.Bigtable/ReadRows"
US_PER_MS = 1000
DEFAULT_RPC_TIMEOUT_S = 60.0
# gRPC's default 4 MiB receive limit is too small for wide rows read back by verify.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

OK = grpc.StatusCode.OK.value[0]
# Codes a retry can fix. INTERNAL and UNKNOWN are transient on the service
# except for the messages in _PERMANENT_MESSAGES (the emulator reports unknown
# families and bad timestamps that way; the service says NOT_FOUND/INVALID_ARGUMENT).
RETRYABLE_CODES = frozenset(
    c.value[0] for c in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED,
                         grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
)
_PERMANENT_MESSAGES = (
    (re.compile(r"unknown family|family .* (not found|does not exist)", re.I), "unknown_family"),
    (re.compile(r"invalid timestamp", re.I), "invalid_timestamp"),
)
_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}
# Whole-call failures no retry or isolation can fix.
FATAL_CODES = ("NOT_FOUND", "PERMISSION_DENIED", "UNAUTHENTICATED")
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]


def code_name(code: int) -> str:
    return _CODE_NAMES.get(code, str(code))


def bigtable_endpoint() -> str:
    """Where Bigtable calls go, for messages: the emulator's host:port or the service."""
    emulator = os.environ.get(EMULATOR_ENV)
    return f"emulator {emulator}" if emulator else DEFAULT_ENDPOINT


# Closing a channel cancels its calls, but after an interrupted call it has been
# seen to block for minutes (issue 17): teardown never waits longer than this.
CLOSE_WAIT_S = 2.0


def close_bounded(close, what: str, wait_s: float = CLOSE_WAIT_S) -> None:
    """Run ``close()`` on a daemon thread and wait at most ``wait_s``: a teardown
    must never hang on a channel or client that will not close."""
    import threading

    def run() -> None:
        try:
            close()
        except Exception as exc:  # closing is best effort; the process may be ending
            log.debug("closing %s failed: %s", what, exc)

    t = threading.Thread(target=run, name=f"close-{what}", daemon=True)
    t.start()
    t.join(wait_s)
    if t.is_alive():
        log.warning("closing %s did not finish within %.0fs; leaving it to the process exit", what, wait_s)


@dataclass(frozen=True, slots=True)
class EntryStatus:
    """Outcome of one MutateRows entry."""

    code: int
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.code == OK

    @property
    def permanent_reason(self) -> Optional[str]:
        for pattern, reason in _PERMANENT_MESSAGES:
            if pattern.search(self.message):
                return reason
        if self.code in RETRYABLE_CODES:
            return None
        if self.code == grpc.StatusCode.NOT_FOUND.value[0]:
            return "unknown_family"  # the service's answer for a missing family
        return code_name(self.code).lower()

    @property
    def retryable(self) -> bool:
        return not self.ok and self.permanent_reason is None


ENTRY_OK = EntryStatus(OK)


class BigtableRetryable(RetryableError):
    """A whole MutateRows call failed in a way a retry may fix."""


class BigtablePermanent(PermanentError):
    """A whole call failed for good (table missing, permission denied...)."""


# Bigtable rejects a row filter (a CheckAndMutateRow predicate, a ReadRows filter)
# whose serialized size is over 20,480 bytes with INVALID_ARGUMENT
# (googleapis/java-bigtable-hbase#2192); the emulator accepts any size.
MAX_ROW_FILTER_BYTES = 20_480


class RowFilterTooLarge(MappingError):
    """A predicate over Bigtable's row-filter size limit: sent, it would fail for
    good (INVALID_ARGUMENT), so it is refused before sending, naming the row."""


def check_filter_size(row_filter, what: str, table_id: str, row_key: bytes) -> None:
    """Refuse a row filter Bigtable would reject (the row key is not named: it
    may be personal data; the dead letter carrying this error names the change)."""
    size = row_filter.ByteSize()
    if size > MAX_ROW_FILTER_BYTES:
        raise RowFilterTooLarge(f"{what} on a row of {table_id} ({len(row_key)}-byte key): its predicate is {size} "
                                f"bytes, over Bigtable's row-filter limit of {MAX_ROW_FILTER_BYTES}",
                                reason="row_filter_too_large")


class BigtableUnreachable(PermanentError):
    """No connection to Bigtable (or the emulator) within the deadline."""


def classify_api_error(exc: Exception, method: str) -> Exception:
    """A google.api_core error from the data client, classified once, here."""
    from google.api_core import exceptions as gexc

    code = getattr(getattr(exc, "grpc_status_code", None), "name", None) or type(exc).__name__
    message = f"{method} failed: {code}: {getattr(exc, 'message', None) or exc}"
    retryable = (gexc.ServiceUnavailable, gexc.DeadlineExceeded, gexc.TooManyRequests, gexc.Aborted,
                 gexc.InternalServerError, gexc.Unknown, gexc.ResourceExhausted)
    if isinstance(exc, retryable):
        return BigtableRetryable(message, code=code)
    return BigtablePermanent(message, code=code)


_REACHABLE: set = set()
PROBE_STEP_S = 2.0


def probe_bigtable(deadline_s: Optional[float] = None, channel_factory=None, clock=None) -> None:
    """Wait until a connection to Bigtable is up, saying so at WARNING every few
    seconds, or raise BigtableUnreachable naming the endpoint after ``deadline_s``.
    Admin calls go through a client whose own retries are silent and long, so a
    command checks this first (once per endpoint and process)."""
    import time

    from ddb2bt.pipeline.retry import READ_ONLY_DEADLINE_S

    deadline_s = READ_ONLY_DEADLINE_S if deadline_s is None else deadline_s
    endpoint = bigtable_endpoint()
    if endpoint in _REACHABLE:
        return
    clock = clock or time.monotonic
    channel = (channel_factory or make_channel)()
    start = clock()
    next_log = 0.0
    try:
        while True:
            left = deadline_s - (clock() - start)
            try:
                grpc.channel_ready_future(channel).result(timeout=max(0.05, min(PROBE_STEP_S, left)))
                _REACHABLE.add(endpoint)
                return
            except grpc.FutureTimeoutError:
                pass
            elapsed = clock() - start
            if elapsed >= deadline_s:
                hint = (" (is the emulator running, and BIGTABLE_EMULATOR_HOST right? ddb2bt local up starts one)"
                        if os.environ.get(EMULATOR_ENV) else " (network, firewall or proxy?)")
                raise BigtableUnreachable(f"Bigtable ({endpoint}) is unreachable: no connection within "
                                          f"{deadline_s:.0f}s{hint}")
            if elapsed >= next_log:
                log.warning("Bigtable (%s): no connection for %.0fs; retrying, giving up in %.0fs", endpoint,
                            elapsed, deadline_s - elapsed)
                next_log = min(max(1.0, 2 * elapsed), elapsed + 30.0)
    finally:
        close_bounded(channel.close, "probe channel", 0.5)


Entry = tuple  # (row_key: bytes, mutations: Sequence[SetCell | DeleteCells])


class MutationWriter(Protocol):
    """What the sink needs from Bigtable. Implemented over gRPC below and by fault-
    injecting fakes in tests."""

    def mutate_rows(self, table_id: str, entries: Sequence[Entry]) -> list:
        """One MutateRows call: a list of EntryStatus, one per entry, in order.
        Raises BigtableRetryable / BigtablePermanent when the call as a whole fails."""
        ...

    def check_and_mutate(self, table_id: str, row_key: bytes, unless, mutations: Sequence) -> bool:
        """CheckAndMutateRow: apply ``mutations`` unless the row has a version of
        unless.family:unless.qualifier at or after unless.since_ms. Returns True
        when applied. Raises like mutate_rows."""
        ...

    def cells_since(self, table_id: str, row_keys: Sequence, family: str, since_ms: int) -> set:
        """{(row_key, qualifier)} of cells in ``family`` with a version at or after
        ``since_ms``, in the given rows (one ReadRows call)."""
        ...

    def close(self) -> None: ...


def build_mutations(container, mutations: Sequence) -> None:
    for m in mutations:
        pb = container.add()
        if isinstance(m, SetCell):
            sc = pb.set_cell
            sc.family_name = m.family
            sc.column_qualifier = m.qualifier
            sc.timestamp_micros = m.timestamp_ms * US_PER_MS
            sc.value = m.value
        elif isinstance(m, DeleteCells):
            dc = pb.delete_from_column
            dc.family_name = m.family
            dc.column_qualifier = m.qualifier
            dc.time_range.start_timestamp_micros = m.start_ms * US_PER_MS
            dc.time_range.end_timestamp_micros = m.end_ms * US_PER_MS
        else:  # pragma: no cover - the model has only these two
            raise TypeError(f"unknown mutation {type(m).__name__}")


def make_channel(endpoint: Optional[str] = None, interceptors: Sequence = ()) -> grpc.Channel:
    """A channel to the emulator (BIGTABLE_EMULATOR_HOST, insecure, loopback) or to
    the service with Application Default Credentials.

    ``interceptors`` are gRPC client interceptors wrapped around the channel, in
    order (tracing, or the fault injector of ``ddb2bt.pipeline.testing``): the
    caller passes them explicitly; nothing here reads them from the environment.
    """
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    emulator = os.environ.get(EMULATOR_ENV)
    if emulator and not endpoint:
        channel = grpc.insecure_channel(emulator, options=options)
    else:
        from google.api_core import grpc_helpers  # imported late: only the cloud path needs auth

        channel = grpc_helpers.create_channel(
            endpoint or DEFAULT_ENDPOINT, scopes=DATA_SCOPES, default_host=DEFAULT_ENDPOINT, options=options
        )
    return grpc.intercept_channel(channel, *interceptors) if interceptors else channel


def _newest_of_column(chain, family: str, qualifier: bytes) -> None:
    """Add the filters "this one column, newest version only" to a filter chain."""
    column = chain.add().column_range_filter
    column.family_name = family
    column.start_qualifier_closed = qualifier
    column.end_qualifier_closed = qualifier
    chain.add().cells_per_column_limit_filter = 1


def _pb_types():
    from google.cloud.bigtable_v2.types import bigtable as bigtable_types

    return bigtable_types.MutateRowsRequest.pb(), bigtable_types.MutateRowsResponse.pb()


def build_request(request_cls, table_name: str, app_profile: Optional[str], entries: Sequence[Entry]):
    request = request_cls(table_name=table_name)
    if app_profile:
        request.app_profile_id = app_profile
    for row_key, mutations in entries:
        entry = request.entries.add(row_key=row_key)
        build_mutations(entry.mutations, mutations)
    return request


# --- MutateRowsRequest, encoded directly ------------------------------------------
# The sink's requests are written straight in the protobuf wire format from the
# (row key, SetCell/DeleteCells) tuples: setting message fields one by one cost
# ~2 us per mutation, a third of the live path's CPU outside the mapping. The
# bytes are identical to ``build_request(...).SerializeToString()`` (a unit test
# compares them on random entries); the writer sends them as they are.
#
# Field numbers (google/bigtable/v2/bigtable.proto, data.proto) as wire tags,
# (number << 3) | wire type (0 varint, 2 length-delimited):
_REQ_TABLE_NAME = b"\x0a"  # MutateRowsRequest.table_name = 1
_REQ_ENTRY = b"\x12"  # MutateRowsRequest.entries = 2
_REQ_APP_PROFILE = b"\x1a"  # MutateRowsRequest.app_profile_id = 3
_ENTRY_ROW_KEY = b"\x0a"  # Entry.row_key = 1
_ENTRY_MUTATION = b"\x12"  # Entry.mutations = 2
_MUT_SET_CELL = b"\x0a"  # Mutation.set_cell = 1
_MUT_DELETE_FROM_COLUMN = b"\x12"  # Mutation.delete_from_column = 2
_CELL_FAMILY = b"\x0a"  # SetCell/DeleteFromColumn.family_name = 1
_CELL_QUALIFIER = b"\x12"  # SetCell/DeleteFromColumn.column_qualifier = 2
_SET_TIMESTAMP = b"\x18"  # SetCell.timestamp_micros = 3 (varint)
_SET_VALUE = b"\x22"  # SetCell.value = 4
_DELETE_TIME_RANGE = b"\x1a"  # DeleteFromColumn.time_range = 3
_RANGE_START = b"\x08"  # TimestampRange.start_timestamp_micros = 1 (varint)
_RANGE_END = b"\x10"  # TimestampRange.end_timestamp_micros = 2 (varint)
_UINT64 = 1 << 64  # negative int64 varints are their two's complement in 64 bits
# Varints of 0..16383 looked up, not computed: every length up to 16 KiB (values
# longer than that are computed, and rare).
_VARINT_TABLE_SIZE = 1 << 14
# (family, qualifier) → their encoded fields: a table has few distinct columns.
# Bounded so a mapping with unbounded column names cannot grow it for ever.
_MAX_CACHED_COLUMNS = 100_000
_COLUMN_FIELDS: dict = {}


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _int64(micros: int) -> bytes:
    """A timestamp's varint; out of int64 range is refused, as the message would."""
    if not _INT64_MIN <= micros <= _INT64_MAX:
        raise ValueError(f"timestamp {micros} us is out of range for int64")
    return _varint(micros)


def _varint(value: int) -> bytes:
    if value < 0:
        value += _UINT64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_VARINTS = tuple(_varint(i) for i in range(_VARINT_TABLE_SIZE))


def _length_delimited(tag: bytes, data: bytes) -> bytes:
    n = len(data)
    return tag + (_VARINTS[n] if n < _VARINT_TABLE_SIZE else _varint(n)) + data


def _column_fields(key: tuple) -> tuple:
    """(encoded family and qualifier fields, their length)."""
    family, qualifier = key
    family_bytes = family.encode()
    # proto3: a field holding its default (empty) is not written.
    fields = ((_length_delimited(_CELL_FAMILY, family_bytes) if family_bytes else b"")
              + (_length_delimited(_CELL_QUALIFIER, qualifier) if qualifier else b""))
    if len(_COLUMN_FIELDS) < _MAX_CACHED_COLUMNS:
        _COLUMN_FIELDS[key] = (fields, len(fields))
    return fields, len(fields)


# Bytes of a varint below 2**14 (the lookup table's range): 1 below 128, else 2.
# So a length-delimited field of n < 2**14 bytes takes n + 2 (tag, 1-byte length)
# or n + 3 (tag, 2-byte length) bytes: the "2 if ... else 3" below.
_ONE_BYTE_VARINT = 1 << 7


def encode_mutate_rows(table_name: str, app_profile: Optional[str], entries: Sequence[Entry]) -> bytes:
    """A serialized MutateRowsRequest: byte for byte what ``build_request`` then
    ``SerializeToString`` give (fields in number order, defaults omitted, an
    empty time range still present), without building a message. Runs once per
    mutation on the write path: lengths are added up, not measured, and lookups
    replace computation wherever a value repeats."""
    varints, table_size, varint, columns = _VARINTS, _VARINT_TABLE_SIZE, _varint, _COLUMN_FIELDS
    one_byte = _ONE_BYTE_VARINT
    out = [_length_delimited(_REQ_TABLE_NAME, table_name.encode())]
    append, extend = out.append, out.extend
    # A change's mutations share a timestamp (and its deletes a range): encoded
    # once, and a SetCell's timestamp is usually its deletes' range end.
    last_micros = None
    micros_bytes = b""
    last_ts = last_range = None
    ts_field = range_field = b""
    ts_len = range_len = 0
    for row_key, mutations in entries:
        slot = len(out)
        append(b"")  # the entry's tag and length, known once its mutations are encoded
        size = 0
        if row_key:
            key_field = _length_delimited(_ENTRY_ROW_KEY, row_key)
            append(key_field)
            size = len(key_field)
        for m in mutations:
            if type(m) is SetCell:
                family, qualifier, value, ts_ms = m
                column, n = columns.get((family, qualifier)) or _column_fields((family, qualifier))
                if ts_ms != last_ts:
                    last_ts = ts_ms
                    micros = ts_ms * US_PER_MS
                    if micros != last_micros:
                        last_micros, micros_bytes = micros, _int64(micros)
                    ts_field = _SET_TIMESTAMP + micros_bytes if micros else b""
                    ts_len = len(ts_field)
                n += ts_len
                value_len = len(value)
                if value_len:
                    if value_len < table_size:
                        value_len_bytes = varints[value_len]
                        n += value_len + (2 if value_len < one_byte else 3)
                    else:
                        value_len_bytes = varint(value_len)
                        n += value_len + 1 + len(value_len_bytes)
                    if n < table_size:
                        n_bytes = varints[n]
                        mutation_len = n + (2 if n < one_byte else 3)
                    else:
                        n_bytes = varint(n)
                        mutation_len = n + 1 + len(n_bytes)
                    mutation_len_bytes = varints[mutation_len] if mutation_len < table_size else varint(mutation_len)
                    extend((_ENTRY_MUTATION, mutation_len_bytes, _MUT_SET_CELL, n_bytes, column, ts_field,
                            _SET_VALUE, value_len_bytes, value))
                else:
                    n_bytes = varints[n] if n < table_size else varint(n)
                    mutation_len = n + 1 + len(n_bytes)
                    mutation_len_bytes = varints[mutation_len] if mutation_len < table_size else varint(mutation_len)
                    extend((_ENTRY_MUTATION, mutation_len_bytes, _MUT_SET_CELL, n_bytes, column, ts_field))
            elif type(m) is DeleteCells:
                family, qualifier, start_ms, end_ms = m
                column, n = columns.get((family, qualifier)) or _column_fields((family, qualifier))
                if (start_ms, end_ms) != last_range:
                    last_range = (start_ms, end_ms)
                    start, end = start_ms * US_PER_MS, end_ms * US_PER_MS
                    if end and end != last_micros:
                        last_micros, micros_bytes = end, _int64(end)
                    time_range = ((_RANGE_START + _int64(start) if start else b"")
                                  + (_RANGE_END + micros_bytes if end else b""))
                    range_field = _length_delimited(_DELETE_TIME_RANGE, time_range)  # present even if empty
                    range_len = len(range_field)
                n += range_len
                # The length arithmetic is written out here as in the SetCell branch
                # above, not shared through a helper: this loop runs once per
                # mutation, and a call per mutation was a measurable share of it.
                if n < table_size:
                    n_bytes = varints[n]
                    mutation_len = n + (2 if n < one_byte else 3)
                else:
                    n_bytes = varint(n)
                    mutation_len = n + 1 + len(n_bytes)
                mutation_len_bytes = varints[mutation_len] if mutation_len < table_size else varint(mutation_len)
                extend((_ENTRY_MUTATION, mutation_len_bytes, _MUT_DELETE_FROM_COLUMN, n_bytes, column, range_field))
            else:  # pragma: no cover - the model has only these two
                raise TypeError(f"unknown mutation {type(m).__name__}")
            size += mutation_len + (2 if mutation_len < one_byte else 3) if mutation_len < table_size else \
                mutation_len + 1 + len(mutation_len_bytes)
        out[slot] = _REQ_ENTRY + (varints[size] if size < table_size else varint(size))
    if app_profile:
        append(_length_delimited(_REQ_APP_PROFILE, app_profile.encode()))
    return b"".join(out)


def classify_rpc_error(exc: grpc.RpcError, method: str = "MutateRows") -> Exception:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    status = EntryStatus(code.value[0], details or "")
    message = f"{method} failed: {code.name}: {details}"
    if status.retryable:
        return BigtableRetryable(message, code=code.name)
    return BigtablePermanent(message, code=code.name)


def _exact_regex(value: bytes) -> bytes:
    """An RE2 pattern matching exactly ``value`` (every byte escaped as \\xHH;
    the values compared are ASCII JSON, where byte and code point agree)."""
    return b"".join(b"\\x%02x" % b for b in value)


class GrpcMutationWriter:
    """MutationWriter over a gRPC channel. One instance per DoFn (created in setup)."""

    def __init__(self, project: str, instance: str, app_profile: Optional[str] = None,
                 channel: Optional[grpc.Channel] = None, timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
                 interceptors: Sequence = (), transactional_app_profile: Optional[str] = None) -> None:
        self._channel = channel or make_channel(interceptors=interceptors)
        # fence() -> seconds a write may still take; raises when this process may
        # no longer write (its job lease lapsed). Checked right before each write.
        self._fence = None
        self._prefix = f"projects/{project}/instances/{instance}/tables/"
        self._project, self._instance = project, instance
        self._app_profile = app_profile
        # Replicated instances (docs/operations.md#ha-instances-app-profiles):
        # CheckAndMutateRow needs single-cluster routing with single-row
        # transactions, which an HA (multi-cluster) profile refuses. Conditional
        # calls, the reads they depend on, the state table and any write a
        # conditional check must see go through this profile (one cluster: no
        # replication lag between a write and the check that must see it); plain
        # data writes keep ``app_profile``.
        self._txn_profile = transactional_app_profile or app_profile
        self._txn_tables: set = set()
        self._timeout_s = timeout_s
        self._request_cls, response_cls = _pb_types()
        self._call = self._channel.unary_stream(
            MUTATE_ROWS_METHOD,
            request_serializer=self._request_cls.SerializeToString,
            response_deserializer=response_cls.FromString,
        )
        # The sink's requests: already serialized (encode_mutate_rows), sent as they are.
        self._call_encoded = self._channel.unary_stream(
            MUTATE_ROWS_METHOD,
            request_serializer=None,
            response_deserializer=response_cls.FromString,
        )
        from google.cloud.bigtable_v2.types import bigtable as bigtable_types

        self._read_cls = bigtable_types.ReadRowsRequest.pb()
        self._read = self._channel.unary_stream(
            READ_ROWS_METHOD,
            request_serializer=self._read_cls.SerializeToString,
            response_deserializer=bigtable_types.ReadRowsResponse.pb().FromString,
        )
        self._cam_cls = bigtable_types.CheckAndMutateRowRequest.pb()
        self._cam = self._channel.unary_unary(
            CHECK_AND_MUTATE_METHOD,
            request_serializer=self._cam_cls.SerializeToString,
            response_deserializer=bigtable_types.CheckAndMutateRowResponse.pb().FromString,
        )

    def set_fence(self, fence) -> None:
        """``fence()`` is called right before every write RPC: it raises when this
        process may no longer write, else returns the seconds the write may take
        (the RPC deadline is capped by it, so no write outlives the lease)."""
        self._fence = fence

    def _write_timeout(self) -> float:
        if self._fence is None:
            return self._timeout_s
        return max(0.001, min(self._timeout_s, self._fence()))

    @property
    def routes_transactional(self) -> bool:
        """True when conditional work goes through another app profile than plain
        data writes (``--state-app-profile``): the sink then sends the writes a
        conditional check must see with ``mutate_rows(..., transactional=True)``."""
        return self._txn_profile != self._app_profile

    def route_transactional(self, table_id: str) -> None:
        """Every write to ``table_id`` (the state table) goes through the
        transactional profile: its rows are read back by conditional calls."""
        self._txn_tables.add(table_id)

    def _params(self, table_name: str, profile: Optional[str] = None) -> tuple:
        params = f"table_name={table_name}" + (f"&app_profile_id={profile}" if profile else "")
        return (("x-goog-request-params", params),)

    def _txn_params(self, table_name: str) -> tuple:
        return self._params(table_name, self._txn_profile)

    def _rows_request(self, table_id: str, row_keys: Sequence) -> tuple:
        """(table name, ReadRows request of ``row_keys``) through the transactional
        profile: what a compare-and-set that follows must see (one cluster)."""
        table_name = self._prefix + table_id
        request = self._read_cls(table_name=table_name)
        if self._txn_profile:
            request.app_profile_id = self._txn_profile
        request.rows.row_keys.extend(sorted(set(row_keys)))
        return table_name, request

    def cells_since(self, table_id: str, row_keys: Sequence, family: str, since_ms: int) -> set:
        table_name, request = self._rows_request(table_id, row_keys)
        chain = request.filter.chain.filters
        # A column range naming the family, not a family regex: the emulator
        # compiles a regex filter again for every row (~80 us a row, more than
        # writing it); a column range is a plain comparison everywhere.
        chain.add().column_range_filter.family_name = family
        chain.add().timestamp_range_filter.start_timestamp_micros = since_ms * US_PER_MS
        chain.add().strip_value_transformer = True
        found: set = set()
        row: list = []
        key = b""
        try:
            for response in self._read(request, timeout=self._timeout_s, metadata=self._txn_params(table_name)):
                for chunk in response.chunks:
                    if chunk.row_key:
                        key = chunk.row_key
                    if chunk.HasField("qualifier"):
                        row.append((key, chunk.qualifier.value))
                    if chunk.reset_row:
                        row = []
                    elif chunk.commit_row:
                        found.update(row)
                        row = []
        except grpc.RpcError as exc:
            raise classify_rpc_error(exc, "ReadRows") from None
        return found

    def cells_between(self, table_id: str, lo_ms: int, hi_ms: Optional[int] = None) -> Iterator[tuple]:
        """(row key, family, qualifier, timestamp ms) of every cell of the table
        written at ``lo_ms`` <= ts < ``hi_ms`` (None: no end), values stripped, rows in key order
        (the recovery's boundary sweep, docs/design.md §8.1.1). The time filter is
        applied by Bigtable: only matching cells travel, but every row is scanned,
        so the table is read range by range as SampleRowKeys splits it, each range
        streamed and resumed after its last row when a stream fails
        (``iter_table``)."""
        from google.cloud.bigtable.data import row_filters

        time_range = row_filters.RowFilterChain([
            row_filters.TimestampRangeFilter(start=ms_datetime(lo_ms),
                                             end=ms_datetime(hi_ms) if hi_ms is not None else None),
            row_filters.StripValueTransformerFilter(True)])
        client = data_client(self._project)
        try:
            for start, end in table_ranges(self._project, self._instance, table_id, client):
                for row, cells in iter_table(self._project, self._instance, table_id, client=client, start_key=start,
                                             end_key=end, row_filter=time_range, app_profile=self._app_profile):
                    for (family, qualifier), versions in sorted(cells.items()):
                        for ts, _ in sorted(versions):
                            yield row, family, qualifier, ts
        finally:
            close_bounded(client.close, "Bigtable data client")

    def check_and_mutate(self, table_id: str, row_key: bytes, unless, mutations: Sequence) -> bool:
        table_name = self._prefix + table_id
        request = self._cam_cls(table_name=table_name, row_key=row_key)
        if self._txn_profile:
            request.app_profile_id = self._txn_profile
        chain = request.predicate_filter.chain.filters
        column = chain.add().column_range_filter  # exactly family:qualifier, no regex (see cells_since)
        column.family_name = unless.family
        column.start_qualifier_closed = unless.qualifier
        column.end_qualifier_closed = unless.qualifier
        chain.add().timestamp_range_filter.start_timestamp_micros = unless.since_ms * US_PER_MS
        check_filter_size(request.predicate_filter, "CheckAndMutateRow", table_id, row_key)
        build_mutations(request.false_mutations, mutations)
        timeout = self._write_timeout()
        try:
            response = self._cam(request, timeout=timeout, metadata=self._txn_params(table_name))
        except grpc.RpcError as exc:
            raise classify_rpc_error(exc, "CheckAndMutateRow") from None
        return not response.predicate_matched

    def read_cell(self, table_id: str, row_key: bytes, family: str, qualifier: bytes) -> Optional[bytes]:
        """The newest value of one cell, or None (one ReadRows call)."""
        table_name = self._prefix + table_id
        request = self._read_cls(table_name=table_name)
        if self._txn_profile:
            request.app_profile_id = self._txn_profile
        request.rows.row_keys.append(row_key)
        _newest_of_column(request.filter.chain.filters, family, qualifier)
        value: Optional[bytes] = None
        parts: list = []
        try:
            for response in self._read(request, timeout=self._timeout_s, metadata=self._txn_params(table_name)):
                for chunk in response.chunks:
                    parts.append(chunk.value)
                    if chunk.reset_row:
                        parts = []
                    elif chunk.value_size == 0:  # the cell's last chunk
                        value, parts = b"".join(parts), []
        except grpc.RpcError as exc:
            raise classify_rpc_error(exc, "ReadRows") from None
        return value

    def swap_cell(self, table_id: str, row_key: bytes, family: str, qualifier: bytes, expected: Optional[bytes],
                  value: bytes, ts_ms: int) -> bool:
        """Compare-and-set of one cell with CheckAndMutateRow: replace every version
        with ``value`` iff its newest value is ``expected`` (None: iff the cell is
        absent). True when swapped. Never fenced: the job lease itself uses it."""
        # All versions go (a time range [0, ∞): end 0 means no upper bound), then
        # the new one: applied in this order, atomically with the check.
        mutations = [DeleteCells(family, qualifier, 0, 0), SetCell(family, qualifier, value, ts_ms)]
        return self._check_and_mutate(table_id, row_key, family, qualifier, expected, mutations, self._timeout_s)

    def read_family(self, table_id: str, row_keys: Sequence, family: str) -> dict:
        """{row_key: {qualifier: newest value}} of one family in the given rows (one
        ReadRows call). The ordering guard reads its clock cells with it, through the
        transactional profile: on a replicated instance the swap that follows must see
        the same cluster (docs/operations.md, HA instances)."""
        table_name, request = self._rows_request(table_id, row_keys)
        chain = request.filter.chain.filters
        chain.add().column_range_filter.family_name = family  # no regex (see cells_since)
        chain.add().cells_per_column_limit_filter = 1
        found: dict = {}
        pending: list = []  # [(row, qualifier, value)] of the row being read
        key, qualifier, parts = b"", b"", []
        try:
            for response in self._read(request, timeout=self._timeout_s, metadata=self._txn_params(table_name)):
                for chunk in response.chunks:
                    if chunk.row_key:
                        key = chunk.row_key
                    if chunk.HasField("qualifier"):
                        qualifier = chunk.qualifier.value
                    parts.append(chunk.value)
                    if chunk.reset_row:
                        pending, parts = [], []
                        continue
                    if chunk.value_size == 0:  # the cell's last chunk
                        pending.append((key, qualifier, b"".join(parts)))
                        parts = []
                    if chunk.commit_row:
                        for k, q, v in pending:
                            found.setdefault(k, {})[q] = v
                        pending = []
        except grpc.RpcError as exc:
            raise classify_rpc_error(exc, "ReadRows") from None
        return found

    def swap_row(self, table_id: str, row_key: bytes, family: str, qualifier: bytes, expected: Optional[bytes],
                 mutations: Sequence, prefix: bool = False) -> bool:
        """CheckAndMutateRow: apply ``mutations`` iff the newest value of
        family:qualifier is ``expected`` (None: iff the cell is absent; ``prefix``:
        iff it starts with ``expected``). True when applied. Fenced like every write."""
        return self._check_and_mutate(table_id, row_key, family, qualifier, expected, mutations,
                                      self._write_timeout(), prefix)

    def _check_and_mutate(self, table_id: str, row_key: bytes, family: str, qualifier: bytes,
                          expected: Optional[bytes], mutations: Sequence, timeout: float,
                          prefix: bool = False) -> bool:
        """CheckAndMutateRow through the transactional profile: ``mutations`` iff
        the newest value of family:qualifier is ``expected`` (None: iff absent;
        ``prefix``: iff it starts with ``expected``, an ASCII value). The
        predicate's size is checked before sending (MAX_ROW_FILTER_BYTES)."""
        table_name = self._prefix + table_id
        request = self._cam_cls(table_name=table_name, row_key=row_key)
        if self._txn_profile:
            request.app_profile_id = self._txn_profile
        chain = request.predicate_filter.chain.filters
        _newest_of_column(chain, family, qualifier)
        if expected is not None:
            # RE2 matches the whole value: a prefix is followed by anything (the
            # values compared by prefix are ASCII, where "." is any byte).
            chain.add().value_regex_filter = _exact_regex(expected) + (b"(?s).*" if prefix else b"")
        check_filter_size(request.predicate_filter, "CheckAndMutateRow", table_id, row_key)
        build_mutations(request.true_mutations if expected is not None else request.false_mutations, mutations)
        try:
            response = self._cam(request, timeout=timeout, metadata=self._txn_params(table_name))
        except grpc.RpcError as exc:
            raise classify_rpc_error(exc, "CheckAndMutateRow") from None
        return response.predicate_matched == (expected is not None)

    def mutate_rows(self, table_id: str, entries: Sequence[Entry], transactional: bool = False) -> list:
        """``transactional``: through the transactional profile (see __init__)."""
        table_name = self._prefix + table_id
        profile = self._txn_profile if transactional or table_id in self._txn_tables else self._app_profile
        request = encode_mutate_rows(table_name, profile, entries)
        statuses: list = [None] * len(entries)
        timeout = self._write_timeout()  # the fence, right before the RPC
        try:
            for response in self._call_encoded(request, timeout=timeout, metadata=self._params(table_name, profile)):
                for e in response.entries:
                    statuses[e.index] = ENTRY_OK if e.status.code == OK else EntryStatus(e.status.code, e.status.message)
        except grpc.RpcError as exc:
            if all(s is None for s in statuses):
                raise classify_rpc_error(exc) from None
            # The stream broke part-way: entries without a status are unknown, and
            # retrying them is safe (explicit timestamps make writes idempotent).
            lost = EntryStatus(exc.code().value[0], exc.details() or "stream interrupted")
            return [s if s is not None else lost for s in statuses]
        missing = EntryStatus(grpc.StatusCode.UNAVAILABLE.value[0], "no status returned for entry")
        return [s if s is not None else missing for s in statuses]

    def close(self) -> None:
        close_bounded(self._channel.close, "Bigtable channel")


# --- admin ---------------------------------------------------------------------


def _gc_rule(family: FamilyConfig):
    from google.cloud.bigtable import column_family as cf
    import datetime as dt

    rules = []
    if family.max_versions:
        rules.append(cf.MaxVersionsGCRule(family.max_versions))
    if family.max_age_seconds:
        rules.append(cf.MaxAgeGCRule(dt.timedelta(seconds=family.max_age_seconds)))
    if not rules:
        return None
    if len(rules) == 1:
        return rules[0]
    return cf.GCRuleIntersection(rules=rules) if family.gc == "intersection" else cf.GCRuleUnion(rules=rules)


# A column-family listing answers in milliseconds; this bounds it when Bigtable
# does not answer at all.
FAMILY_LIST_TIMEOUT_S = 10.0


class BigtableAdmin:
    """Table administration through the classic admin client (works on the emulator)."""

    def __init__(self, project: str, instance: str, deadline_s: Optional[float] = None) -> None:
        from google.cloud.bigtable import Client

        probe_bigtable(deadline_s)  # the admin client retries unreachable endpoints silently for minutes
        self._client = Client(project=project, admin=True)
        self._instance = self._client.instance(instance)

    def table(self, table_id: str):
        return self._instance.table(table_id)

    def exists(self, table_id: str) -> bool:
        return self.table(table_id).exists()

    def families(self, table_id: str) -> set:
        # Bounded, without the classic client's own retries: they keep trying an
        # unreachable endpoint for minutes, and a sink (or a job that must stop
        # once its lease is gone) waits on this call.
        response = self._client.table_admin_client.get_table(
            request={"name": self.table(table_id).name}, timeout=FAMILY_LIST_TIMEOUT_S, retry=None)
        return set(response.column_families)

    def ensure_table(self, table_id: str, families: Iterable[FamilyConfig], splits: Sequence[bytes] = ()) -> list:
        """Create the table or add/update its families; idempotent. Returns a list
        of what changed, for the CLI to print. ``splits``: initial split points of
        a table created now (a table that exists keeps its tablets)."""
        from google.api_core import exceptions as gexc

        families = list(families)
        table = self.table(table_id)
        changes = []
        if not table.exists():
            try:
                table.create(column_families={f.name: _gc_rule(f) for f in families},
                             initial_split_keys=list(splits))
                return [f"created table {table_id} with families {', '.join(f.name for f in families)}"
                        + (f", pre-split at {len(splits)} point(s)" if splits else "")]
            except gexc.AlreadyExists:
                pass  # created concurrently: fall through to reconcile families
        if splits:
            changes.append(f"table {table_id} exists: split points apply only when a table is created "
                           "(Bigtable splits it by load from here)")
        existing = table.list_column_families()
        for f in families:
            rule = _gc_rule(f)
            if f.name not in existing:
                table.column_family(f.name, rule).create()
                changes.append(f"added family {f.name}")
            elif rule is not None and existing[f.name].gc_rule != rule:
                table.column_family(f.name, rule).update()
                changes.append(f"updated GC policy of family {f.name}")
        return changes

    def add_family(self, table_id: str, family: FamilyConfig) -> None:
        from google.api_core import exceptions as gexc

        try:
            self.table(table_id).column_family(family.name, _gc_rule(family)).create()
        except gexc.AlreadyExists:
            pass  # added concurrently

    def drop_family(self, table_id: str, name: str) -> None:
        """Drop a column family and every cell in it (one ModifyColumnFamilies call)."""
        from google.api_core import exceptions as gexc

        try:
            self.table(table_id).column_family(name).delete()
        except gexc.NotFound:
            pass  # dropped concurrently

    def delete_table(self, table_id: str) -> None:
        table = self.table(table_id)
        if table.exists():
            table.delete()

    def app_profile(self, profile_id: str) -> "AppProfileFacts":
        """The app profile's routing and transactional setting (GetAppProfile).
        ``AppProfileUnknown`` where the service has no app profiles (the emulator)."""
        from google.api_core import exceptions as gexc
        from google.cloud.bigtable.enums import RoutingPolicyType

        profile = self._instance.app_profile(profile_id)
        try:
            profile.reload()
        except gexc.MethodNotImplemented as exc:
            raise AppProfileUnknown(f"{profile_id}: the service has no app profiles ({exc.message})") from None
        except gexc.NotFound:
            return AppProfileFacts(profile_id, exists=False)
        single = profile.routing_policy_type == RoutingPolicyType.SINGLE
        return AppProfileFacts(profile_id, routing=SINGLE_CLUSTER if single else MULTI_CLUSTER,
                               cluster_id=profile.cluster_id if single else None,
                               transactional=bool(profile.allow_transactional_writes) if single else False)


SINGLE_CLUSTER = "single-cluster"
MULTI_CLUSTER = "multi-cluster"


@dataclass(frozen=True)
class AppProfileFacts:
    """What the preflight needs of an app profile (``BigtableAdmin.app_profile``)."""

    profile_id: str
    exists: bool = True
    routing: str = SINGLE_CLUSTER
    cluster_id: Optional[str] = None
    transactional: bool = False  # single-row transactions (CheckAndMutateRow) allowed


class AppProfileUnknown(Exception):
    """The admin API cannot describe app profiles here (the emulator has none)."""


# --- one admin client per process ---------------------------------------------
# The admin API has a low per-project quota. A Dataflow job runs processes x
# threads x DoFns x tables: every sink DoFn building its own admin client and
# listing families every minute would multiply the calls by all of them. So one
# BigtableAdmin per (project, instance) per process, and one family listing per
# table per FAMILY_LIST_MAX_AGE_S per process, shared by every DoFn.

FAMILY_LIST_MAX_AGE_S = 60.0  # a family added by `create-table` while a job runs is seen within a minute
# Built by this (tests count the admin clients a pipeline makes through it).
ADMIN_FACTORY: Callable[[str, str], "BigtableAdmin"] = BigtableAdmin
_PROCESS_ADMINS: dict = {}
_PROCESS_FAMILIES: dict = {}  # (project, instance, table) -> (monotonic time, frozenset | None)
_PROCESS_LOCK = threading.Lock()


def _endpoint_key() -> str:
    """Which Bigtable the clients of this process reach now: the emulator's
    address when one is set (a test or an embedder may switch emulators within
    one process; a client built for the old one would talk to a dead port)."""
    return os.environ.get("BIGTABLE_EMULATOR_HOST", "")


def process_admin(project: str, instance: str):
    """This process's admin object for the instance (built on first use)."""
    key = (project, instance, _endpoint_key())
    with _PROCESS_LOCK:
        admin = _PROCESS_ADMINS.get(key)
        if admin is None:
            admin = _PROCESS_ADMINS[key] = ADMIN_FACTORY(project, instance)
        return admin


def process_families(project: str, instance: str, table: str, max_age_s: float = FAMILY_LIST_MAX_AGE_S,
                     now: Callable[[], float] = time.monotonic) -> Optional[frozenset]:
    """The table's column families, listed at most once per ``max_age_s`` per
    process; None when they cannot be listed (no admin permission: the writes'
    own errors tell then)."""
    key = (project, instance, table, _endpoint_key())
    with _PROCESS_LOCK:  # one listing at a time: DoFns asking together share it
        cached = _PROCESS_FAMILIES.get(key)
        if cached is not None and now() - cached[0] < max_age_s:
            return cached[1]
    admin = process_admin(project, instance)
    with _PROCESS_LOCK:
        cached = _PROCESS_FAMILIES.get(key)
        if cached is not None and now() - cached[0] < max_age_s:
            return cached[1]
        try:
            families: Optional[frozenset] = frozenset(admin.families(table))
        except Exception as exc:  # no admin permission: fall back to the write's own answer
            log.warning("cannot list column families of %s (%s); relying on write errors", table,
                        type(exc).__name__)
            families = None
        _PROCESS_FAMILIES[key] = (now(), families)
        return families


def forget_process_families() -> None:
    """Forget the process's family lists: a job starting in this process (local
    runs, tests, embedders) lists them afresh, never from a run before a create-table."""
    with _PROCESS_LOCK:
        _PROCESS_FAMILIES.clear()


def forget_process_admins() -> None:
    """Drop the process's admin objects and family lists (tests)."""
    with _PROCESS_LOCK:
        _PROCESS_ADMINS.clear()
        _PROCESS_FAMILIES.clear()


def ensure_mapping_table(mapping: MappingConfig, splits: Sequence[bytes] = ()) -> list:
    """Create or update every table the mapping writes (target and index tables).
    ``splits``: initial split points of the target table, if it is created now."""
    admin = BigtableAdmin(mapping.target.project, mapping.target.instance)
    changes = []
    for table, families in mapping.table_families().items():
        if mapping.source.kinesis is not None:  # the ordering guard's clock cells (docs/design.md §10)
            from ddb2bt.transforms.ordering import CLOCK_FAMILY

            families = list(families) + [FamilyConfig(CLOCK_FAMILY, max_versions=1)]
        changes += admin.ensure_table(table, families, splits if table == mapping.target.table else ())
    return changes


# --- reads -------------------------------------------------------------------------


def data_client(project: str):
    from google.cloud.bigtable.data import BigtableDataClient

    return BigtableDataClient(project=project)


def _row_cells(row) -> dict:
    """{(family, qualifier): [(timestamp_ms, value), ...] newest first} of one row."""
    cells: dict = {}
    for cell in row.cells:
        cells.setdefault((cell.family, cell.qualifier), []).append((cell.timestamp_micros // US_PER_MS, cell.value))
    return cells


# One ReadRows attempt may take this long: a whole table read by verify is one
# attempt. Small reads (the state table) pass a shorter one.
BULK_ATTEMPT_TIMEOUT_S = 600.0
SMALL_ATTEMPT_TIMEOUT_S = 20.0


def _read(project: str, instance: str, table_id: str, queries: Iterable, client=None,
          deadline_s: Optional[float] = None, attempt_timeout_s: float = BULK_ATTEMPT_TIMEOUT_S,
          app_profile: Optional[str] = None) -> dict:
    """Run ReadRows queries; with ``client`` given it is reused and left open (callers
    reading often keep one), otherwise a client lives for this call only.

    The data client's own retries are off (they are silent, up to 600 s): each
    query is retried by our policy, which logs every failure and gives up after
    ``deadline_s`` with an error naming Bigtable and the endpoint."""
    from ddb2bt.pipeline.retry import DEFAULT_DEADLINE_S, RetryPolicy, retrying

    own = client is None
    client = client or data_client(project)
    out: dict = {}
    policy = RetryPolicy(initial_s=0.2, max_backoff_s=5.0,
                         deadline_s=DEFAULT_DEADLINE_S if deadline_s is None else deadline_s)
    timeout = min(attempt_timeout_s, policy.deadline_s) if policy.deadline_s > 0 else attempt_timeout_s
    try:
        with client.get_table(instance, table_id, **({"app_profile_id": app_profile} if app_profile else {})) as table:
            for query in queries:
                def attempt(query=query) -> list:
                    try:
                        return list(table.read_rows(query, operation_timeout=timeout, attempt_timeout=timeout,
                                                    retryable_errors=()))
                    except Exception as exc:
                        if type(exc).__module__.startswith("google.api_core"):
                            raise classify_api_error(exc, "ReadRows") from exc
                        raise

                for row in retrying(policy, f"ReadRows on {table_id}", where=f"Bigtable ({bigtable_endpoint()})")(
                        attempt):
                    out[row.row_key] = _row_cells(row)
    finally:
        if own:
            close_bounded(client.close, "Bigtable data client")
    return out


def ms_datetime(ms: int):
    """Epoch milliseconds as an aware datetime, exactly (no float rounding: a
    filter bound one microsecond off would take in or leave out a cell)."""
    import datetime as _dt

    return _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc) + _dt.timedelta(milliseconds=ms)


def read_table(project: str, instance: str, table_id: str, prefix: Optional[bytes] = None,
               latest_only: bool = False, client=None, deadline_s: Optional[float] = None,
               attempt_timeout_s: float = BULK_ATTEMPT_TIMEOUT_S, app_profile: Optional[str] = None) -> dict:
    """{row_key: {(family, qualifier): [(timestamp_ms, value), ...] newest first}}."""
    from google.cloud.bigtable.data import ReadRowsQuery, RowRange
    from google.cloud.bigtable.data import row_filters

    query = ReadRowsQuery()
    if prefix is not None:
        query = ReadRowsQuery(row_ranges=RowRange(start_key=prefix, end_key=prefix_end(prefix)))
    if latest_only:
        query.filter = row_filters.CellsColumnLimitFilter(1)
    return _read(project, instance, table_id, [query], client, deadline_s, attempt_timeout_s, app_profile)


def read_rows(project: str, instance: str, table_id: str, row_keys: Sequence, client=None,
              deadline_s: Optional[float] = None, attempt_timeout_s: float = BULK_ATTEMPT_TIMEOUT_S,
              app_profile: Optional[str] = None) -> dict:
    """Like read_table, for the given rows only (missing rows are absent)."""
    from google.cloud.bigtable.data import ReadRowsQuery

    keys = list(row_keys)
    queries = [ReadRowsQuery(row_keys=keys[i:i + READ_BATCH_ROWS]) for i in range(0, len(keys), READ_BATCH_ROWS)]
    return _read(project, instance, table_id, queries, client, deadline_s, attempt_timeout_s,
                 app_profile) if queries else {}


READ_BATCH_ROWS = 1000  # rows per ReadRows call when reading a key set


def iter_table(project: str, instance: str, table_id: str, client=None, deadline_s: Optional[float] = None,
               attempt_timeout_s: float = BULK_ATTEMPT_TIMEOUT_S, start_key: Optional[bytes] = None,
               end_key: Optional[bytes] = None, sleep=None, row_filter=None,
               app_profile: Optional[str] = None) -> Iterator:
    """(row_key, cells) of every row, in key order, as they stream in: nothing of
    the table is held (``verify`` reads tables of any size with it). One
    ReadRows stream is read to its end (a stream given up half-way would keep
    its flow-control buffers until the call is torn down). A failed stream
    resumes after the last row received; failures are logged and retried with
    backoff, and after ``deadline_s`` without progress given up, naming
    Bigtable and the endpoint. ``start_key`` (inclusive) and ``end_key``
    (exclusive) bound the read to one key range; ``row_filter`` (a
    python-bigtable row filter) is applied by Bigtable; ``app_profile`` routes
    the read (None: the instance's default profile)."""
    import time as _time

    from google.cloud.bigtable.data import ReadRowsQuery, RowRange

    from ddb2bt.pipeline.retry import DEFAULT_DEADLINE_S, RetryPolicy, gave_up
    from ddb2bt.transforms.errors import RetryableError

    sleep = sleep or _time.sleep
    own = client is None
    client = client or data_client(project)
    policy = RetryPolicy(initial_s=0.2, max_backoff_s=5.0,
                         deadline_s=DEFAULT_DEADLINE_S if deadline_s is None else deadline_s)
    timeout = min(attempt_timeout_s, policy.deadline_s) if policy.deadline_s > 0 else attempt_timeout_s
    last = None
    failing_since, backoff = None, policy.initial_s
    where = f"Bigtable ({bigtable_endpoint()})"
    try:
        with client.get_table(instance, table_id, **({"app_profile_id": app_profile} if app_profile else {})) as table:
            while True:
                if last is None:
                    query = ReadRowsQuery(row_filter=row_filter) if start_key is None and end_key is None else \
                        ReadRowsQuery(row_ranges=RowRange(start_key=start_key, end_key=end_key), row_filter=row_filter)
                else:
                    query = ReadRowsQuery(row_ranges=RowRange(start_key=last, end_key=end_key,
                                                              start_is_inclusive=False), row_filter=row_filter)
                try:
                    for row in table.read_rows_stream(query, operation_timeout=timeout, attempt_timeout=timeout,
                                                      retryable_errors=()):
                        last, failing_since, backoff = row.row_key, None, policy.initial_s
                        yield row.row_key, _row_cells(row)
                    return
                except Exception as exc:
                    err = classify_api_error(exc, "ReadRows") if type(exc).__module__.startswith(
                        "google.api_core") else exc
                    if not isinstance(err, RetryableError):
                        raise err from exc
                    now = _time.monotonic()
                    failing_since = failing_since or now
                    if policy.deadline_s > 0 and now - failing_since > policy.deadline_s:
                        raise gave_up(err, f"ReadRows on {table_id} at {where}: gave up after "
                                           f"{now - failing_since:.0f}s: {err}") from exc
                    logging.getLogger(__name__).warning("ReadRows on %s at %s failed (%s); resuming in %.1fs",
                                                        table_id, where, err, backoff)
                    sleep(backoff)
                    backoff = min(backoff * 2, policy.max_backoff_s)
    finally:
        if own:
            close_bounded(client.close, "Bigtable data client")


def table_ranges(project: str, instance: str, table_id: str, client=None) -> list:
    """[(start_key, end_key)] covering the table (None: unbounded), split where
    Bigtable's SampleRowKeys says the data splits: read in parallel, each range
    a similar share of the bytes."""
    own = client is None
    client = client or data_client(project)
    try:
        with client.get_table(instance, table_id) as table:
            keys = sorted({k for k, _ in table.sample_row_keys() if k})
    finally:
        if own:
            close_bounded(client.close, "Bigtable data client")
    bounds = [None] + keys + [None]
    return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]




def prefix_end(prefix: bytes) -> Optional[bytes]:
    """The smallest key greater than every key starting with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])
