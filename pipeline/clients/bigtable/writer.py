"""The Bigtable writer: MutateRows of pre-encoded requests (``wire``), and
CheckAndMutateRow for conditional writes, compare-and-set of one cell and the
reads they depend on, with a fence hook checked right before every write.

Retries and idempotency stay with the caller (``ddb2bt.pipeline.sink.sink``):
every mutation carries an explicit whole-millisecond timestamp, so re-sending an
entry is always safe. Errors come back classified (``errors``).
"""
from __future__ import annotations

import logging
from typing import Iterator, Optional, Protocol, Sequence

import grpc

from ddb2bt.pipeline.clients.bigtable.channel import close_bounded, make_channel
from ddb2bt.pipeline.clients.bigtable.errors import ENTRY_OK, OK, EntryStatus, check_filter_size, classify_rpc_error
from ddb2bt.pipeline.clients.bigtable.reads import data_client, iter_table, ms_datetime, table_ranges
from ddb2bt.pipeline.clients.bigtable.wire import (US_PER_MS, Entry, build_mutations, encode_mutate_rows,
                                                   mutate_rows_types)
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.model import DeleteCells, SetCell

log = logging.getLogger(__name__)

MUTATE_ROWS_METHOD = "/google.bigtable.v2.Bigtable/MutateRows"
CHECK_AND_MUTATE_METHOD = "/google.bigtable.v2.Bigtable/CheckAndMutateRow"
READ_ROWS_METHOD = "/google.bigtable.v2.Bigtable/ReadRows"
DEFAULT_RPC_TIMEOUT_S = 60.0


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


def _newest_of_column(chain, family: str, qualifier: bytes) -> None:
    """Add the filters "this one column, newest version only" to a filter chain."""
    column = chain.add().column_range_filter
    column.family_name = family
    column.start_qualifier_closed = qualifier
    column.end_qualifier_closed = qualifier
    chain.add().cells_per_column_limit_filter = 1


# \xHH of every byte value, looked up: a guarded swap escapes its clock's token
# prefix (~35 bytes) on every call.
_HEX_ESCAPES = tuple(b"\\x%02x" % b for b in range(256))


def _exact_regex(value: bytes) -> bytes:
    """An RE2 pattern matching exactly ``value`` (every byte escaped as \\xHH;
    the values compared are ASCII JSON, where byte and code point agree)."""
    return b"".join(map(_HEX_ESCAPES.__getitem__, value))


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
        self._request_cls, response_cls = mutate_rows_types()
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

    def swap_rows(self, table_id: str, swaps: Sequence, in_flight: int) -> list:
        """Many ``swap_row`` calls on one table, up to ``in_flight`` of them on the
        wire at once (gRPC futures on this writer's channel: no thread per call).
        ``swaps``: (row_key, family, qualifier, expected, mutations, prefix) each.
        Returns one outcome per swap, in order: True (applied), False (the cell
        did not hold ``expected``) or the MappingError that refused it before
        sending (a predicate over Bigtable's limit). Any other failure is raised,
        classified, once every call sent has answered (none is left running).
        Fenced like every write: the fence is checked before each call."""
        table_name = self._prefix + table_id
        metadata = self._txn_params(table_name)
        outcomes: list = [None] * len(swaps)
        sent: list = []  # (index, expected is not None, future), oldest first
        failure: Optional[Exception] = None

        def settle(index: int, guarded: bool, future) -> None:
            nonlocal failure
            try:
                outcomes[index] = future.result().predicate_matched == guarded
            except grpc.RpcError as exc:
                if failure is None:
                    failure = classify_rpc_error(exc, "CheckAndMutateRow")

        try:
            for index, (row_key, family, qualifier, expected, mutations, prefix) in enumerate(swaps):
                if failure is not None:
                    break  # the batch fails (and is retried whole): send nothing more
                try:
                    request = self._cam_request(table_name, table_id, row_key, family, qualifier, expected,
                                                mutations, prefix)
                except MappingError as exc:
                    outcomes[index] = exc
                    continue
                if len(sent) >= in_flight:
                    settle(*sent.pop(0))
                    if failure is not None:
                        break
                timeout = self._write_timeout()  # the fence, right before the call (raises once the lease is lost)
                try:
                    sent.append((index, expected is not None,
                                 self._cam.future(request, timeout=timeout, metadata=metadata)))
                except grpc.RpcError as exc:  # an interceptor may fail the call as it is made
                    failure = failure or classify_rpc_error(exc, "CheckAndMutateRow")
        finally:  # whatever stops the loop (the fence too), no call sent is left running
            for call in sent:
                settle(*call)
        if failure is not None:
            raise failure
        return outcomes

    def _cam_request(self, table_name: str, table_id: str, row_key: bytes, family: str, qualifier: bytes,
                     expected: Optional[bytes], mutations: Sequence, prefix: bool):
        """The CheckAndMutateRowRequest of ``_check_and_mutate``; MappingError
        (RowFilterTooLarge) when its predicate is over Bigtable's limit."""
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
        return request

    def _check_and_mutate(self, table_id: str, row_key: bytes, family: str, qualifier: bytes,
                          expected: Optional[bytes], mutations: Sequence, timeout: float,
                          prefix: bool = False) -> bool:
        """CheckAndMutateRow through the transactional profile: ``mutations`` iff
        the newest value of family:qualifier is ``expected`` (None: iff absent;
        ``prefix``: iff it starts with ``expected``, an ASCII value). The
        predicate's size is checked before sending (MAX_ROW_FILTER_BYTES)."""
        table_name = self._prefix + table_id
        request = self._cam_request(table_name, table_id, row_key, family, qualifier, expected, mutations, prefix)
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


# --- one admin client per process ---------------------------------------------
# The admin API has a low per-project quota. A Dataflow job runs processes x
# threads x DoFns x tables: every sink DoFn building its own admin client and
# listing families every minute would multiply the calls by all of them. So one
# BigtableAdmin per (project, instance) per process, and one family listing per
# table per FAMILY_LIST_MAX_AGE_S per process, shared by every DoFn.


# --- reads -------------------------------------------------------------------------


