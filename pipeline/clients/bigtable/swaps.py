"""Compare-and-set on one row with CheckAndMutateRow, and the reads it depends
on: the job lease's cell (``swap_cell``), the ordering guard's clock swaps
(``swap_row``, ``swap_rows`` with many calls in flight), the newest value of a
cell or a family. A part of ``GrpcMutationWriter`` (writer.py), kept apart so
each class holds one concern: it uses the writer's channel calls, its
transactional app profile and its fence, which writer.py sets up.
"""
from __future__ import annotations

from typing import Optional, Sequence

import grpc

from ddb2bt.pipeline.clients.bigtable.errors import check_filter_size, classify_rpc_error
from ddb2bt.pipeline.clients.bigtable.wire import (add_newest_of_column, encode_check_and_mutate,
                                                   newest_of_column_predicate)
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.model import DeleteCells, SetCell


# \xHH of every byte value, looked up: a guarded swap escapes its clock's token
# prefix (~35 bytes) on every call.
_HEX_ESCAPES = tuple(b"\\x%02x" % b for b in range(256))


def _exact_regex(value: bytes) -> bytes:
    """An RE2 pattern matching exactly ``value`` (every byte escaped as \\xHH;
    the values compared are ASCII JSON, where byte and code point agree)."""
    return b"".join(map(_HEX_ESCAPES.__getitem__, value))


class CompareAndSetCalls:
    """The compare-and-set calls of ``GrpcMutationWriter``. Needs from it: the
    call ``_cam_encoded`` (CheckAndMutateRow, its request serialized here), the
    request class and call ``_read_cls``/``_read`` (ReadRows), ``_prefix`` (the tables' name prefix),
    ``_txn_profile``/``_txn_params`` (the transactional app profile),
    ``_rows_request``, ``_timeout_s`` and ``_write_timeout`` (the fence)."""

    def read_cell(self, table_id: str, row_key: bytes, family: str, qualifier: bytes) -> Optional[bytes]:
        """The newest value of one cell, or None (one ReadRows call)."""
        table_name = self._prefix + table_id
        request = self._read_cls(table_name=table_name)
        if self._txn_profile:
            request.app_profile_id = self._txn_profile
        request.rows.row_keys.append(row_key)
        add_newest_of_column(request.filter.chain.filters, family, qualifier)
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
                                 self._cam_encoded.future(request, timeout=timeout, metadata=metadata)))
                except grpc.RpcError as exc:  # an interceptor may fail the call as it is made
                    failure = failure or classify_rpc_error(exc, "CheckAndMutateRow")
        finally:  # whatever stops the loop (the fence too), no call sent is left running
            for call in sent:
                settle(*call)
        if failure is not None:
            raise failure
        return outcomes

    def _cam_request(self, table_name: str, table_id: str, row_key: bytes, family: str, qualifier: bytes,
                     expected: Optional[bytes], mutations: Sequence, prefix: bool) -> bytes:
        """The serialized CheckAndMutateRowRequest of ``_check_and_mutate``
        (wire.encode_check_and_mutate: the message's bytes, written directly);
        MappingError (RowFilterTooLarge) when its predicate is over Bigtable's limit."""
        # RE2 matches the whole value: a prefix is followed by anything (the
        # values compared by prefix are ASCII, where "." is any byte).
        value_regex = None if expected is None else _exact_regex(expected) + (b"(?s).*" if prefix else b"")
        predicate = newest_of_column_predicate(family, qualifier, value_regex)
        check_filter_size(len(predicate), "CheckAndMutateRow", table_id, row_key)
        return encode_check_and_mutate(table_name, self._txn_profile, row_key, predicate, mutations,
                                       expected is not None)

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
            response = self._cam_encoded(request, timeout=timeout, metadata=self._txn_params(table_name))
        except grpc.RpcError as exc:
            raise classify_rpc_error(exc, "CheckAndMutateRow") from None
        return response.predicate_matched == (expected is not None)
