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
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Protocol, Sequence

import grpc

from ddb2bt.pipeline.clients.bigtable.channel import close_bounded, make_channel, probe_bigtable
from ddb2bt.pipeline.clients.bigtable.errors import ENTRY_OK, OK, EntryStatus, check_filter_size, classify_rpc_error
from ddb2bt.pipeline.clients.bigtable.reads import data_client, iter_table, ms_datetime, table_ranges
from ddb2bt.pipeline.clients.bigtable.wire import (US_PER_MS, Entry, build_mutations, encode_mutate_rows,
                                                   mutate_rows_types)
from ddb2bt.transforms.config import FamilyConfig, MappingConfig
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


