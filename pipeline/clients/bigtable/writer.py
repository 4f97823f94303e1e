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
from google.protobuf.message import DecodeError

from ddb2bt.pipeline.clients.bigtable.channel import close_bounded, make_channel
from ddb2bt.pipeline.clients.bigtable.errors import ENTRY_OK, OK, EntryStatus, check_filter_size, classify_rpc_error
from ddb2bt.pipeline.clients.bigtable.reads import data_client, iter_table, ms_datetime, table_ranges
from ddb2bt.pipeline.clients.bigtable.swaps import CompareAndSetCalls
from ddb2bt.pipeline.clients.bigtable.wire import (US_PER_MS, Entry, build_mutations, encode_mutate_rows,
                                                   mutate_rows_types)
from ddb2bt.transforms.native import native_mutate_rows_statuses

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


class GrpcMutationWriter(CompareAndSetCalls):
    """MutationWriter over a gRPC channel. One instance per DoFn (created in setup).
    Its compare-and-set calls (the lease's, the ordering guard's, the tombstone
    sweep's) and the reads they depend on are ``CompareAndSetCalls`` (swaps.py)."""

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
        # The sink's requests: already serialized (encode_mutate_rows), sent as they
        # are. Where the C module runs, the answers stay bytes too: each entry's
        # status is read from them (transforms/decoders_c.c), not through a
        # protobuf object per entry, which costs about as much as the request's
        # encoding (docs/benchmarks.md); the library reads what the C leaves.
        self._response_cls = response_cls
        self._statuses_c = native_mutate_rows_statuses()
        self._call_encoded = self._channel.unary_stream(
            MUTATE_ROWS_METHOD,
            request_serializer=None,
            response_deserializer=None if self._statuses_c is not None else response_cls.FromString,
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
        # The guard's swaps and the lease's: already serialized (wire.encode_check_and_mutate).
        self._cam_encoded = self._channel.unary_unary(
            CHECK_AND_MUTATE_METHOD,
            request_serializer=None,
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

    def mutate_rows(self, table_id: str, entries: Sequence[Entry], transactional: bool = False) -> list:
        """``transactional``: through the transactional profile (see __init__)."""
        table_name = self._prefix + table_id
        profile = self._txn_profile if transactional or table_id in self._txn_tables else self._app_profile
        request = encode_mutate_rows(table_name, profile, entries)
        statuses: list = [None] * len(entries)
        timeout = self._write_timeout()  # the fence, right before the RPC
        try:
            for response in self._call_encoded(request, timeout=timeout, metadata=self._params(table_name, profile)):
                if type(response) is bytes:
                    response = self._answer(response, statuses)
                    if response is None:
                        continue
                note_statuses(response, statuses)
        except grpc.RpcError as exc:
            if all(s is None for s in statuses):
                raise classify_rpc_error(exc) from None
            # The stream broke part-way: entries without a status are unknown, and
            # retrying them is safe (explicit timestamps make writes idempotent).
            lost = EntryStatus(exc.code().value[0], exc.details() or "stream interrupted")
            return [s if s is not None else lost for s in statuses]
        missing = EntryStatus(grpc.StatusCode.UNAVAILABLE.value[0], "no status returned for entry")
        return [s if s is not None else missing for s in statuses]

    def _answer(self, data: bytes, statuses: list):
        """One serialized MutateRows answer: None once the C has set its entries'
        statuses, else the message for the library's reading. Bytes the library
        refuses raise what gRPC's own deserializer made of them before the answers
        were left serialized: an RpcError, INTERNAL (retryable; statuses already
        read are kept, the stream counted broken there)."""
        read_c = self._statuses_c
        if read_c is not None:
            before = statuses[:]  # what the C sets of an answer it then leaves to the library is not kept
            if read_c(data, statuses, ENTRY_OK, EntryStatus) is not None:
                return None
            statuses[:] = before
        try:
            return self._response_cls.FromString(data)
        except DecodeError:
            raise UndecodableAnswer() from None

    def close(self) -> None:
        close_bounded(self._channel.close, "Bigtable channel")


class UndecodableAnswer(grpc.RpcError):
    """A MutateRows answer the protobuf library refuses: what gRPC raises when its
    response deserializer fails (INTERNAL)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.INTERNAL

    def details(self) -> str:
        return "Exception deserializing response!"


def note_statuses(response, statuses: list) -> None:
    """Each entry of a MutateRowsResponse (the protobuf message) in ``statuses``,
    by its index: the reference ``transforms/decoders_c.c`` reads the same bytes
    to the same list."""
    for e in response.entries:
        statuses[e.index] = ENTRY_OK if e.status.code == OK else EntryStatus(e.status.code, e.status.message)


# --- admin ---------------------------------------------------------------------


# --- one admin client per process ---------------------------------------------
# The admin API has a low per-project quota. A Dataflow job runs processes x
# threads x DoFns x tables: every sink DoFn building its own admin client and
# listing families every minute would multiply the calls by all of them. So one
# BigtableAdmin per (project, instance) per process, and one family listing per
# table per FAMILY_LIST_MAX_AGE_S per process, shared by every DoFn.


# --- reads -------------------------------------------------------------------------


