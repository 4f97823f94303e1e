"""What a sink buffers between flushes: one ``Row`` per (table, row key), with its
changes coalesced in stream order, and the ``Batch`` written and checkpointed as one."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from ddb2bt.transforms.mapping import MARKER_FAMILY
from ddb2bt.pipeline.control.markers import has_markers
from ddb2bt.pipeline.control.state import ShardCheckpoint

__all__ = ["Batch", "Row", "RowMutations", "merge_checkpoints"]


class Row:
    """One (table, row key) of a batch: its changes (``parts``), coalesced in stream
    order into one MutateRows entry whose mutations are theirs, in that order.

    ``mutations`` is read only off the common path (isolation, markers, claims, the
    in-memory fake): until then it is not built, and the changes' own mutations are
    not decoded from their wire bytes (model.EncodedMutations); what every row
    needs — how many mutations (``count``), their bytes (``size``, ``wire``) — is
    kept as changes are added. Given explicitly, ``mutations`` replace the parts'.
    """

    __slots__ = ("table", "row_key", "parts", "size", "wire", "count", "_mutations")

    def __init__(self, table: str, row_key: bytes, mutations=None, parts: Optional[list] = None, size: int = 0,
                 wire: Optional[list] = None) -> None:
        self.table = table
        self.row_key = row_key
        self.parts = [] if parts is None else parts  # [(MappedChange, RowChange)] in stream order
        self.size = size  # bytes, summed as changes are added (not recomputed per request)
        # ``mutations`` in the wire format, one piece per change (RowChange.wire), while
        # every change added came encoded; None: the request encodes ``mutations``.
        # Replacing ``mutations`` sets it to None (the setter).
        self._mutations: Optional[list] = None  # None: the parts' mutations, built when read
        if mutations is not None:
            self.mutations = mutations
        else:
            self.count = sum(change.mutation_count for _, change in self.parts) if self.parts else 0
        self.wire = wire

    @classmethod
    def of_change(cls, table: str, row_key: bytes, element, change) -> "Row":
        """A row and its first change: what ``Row(table, row_key, wire=[] or None)``
        then ``add(element, change)`` make, its slots filled directly (once for
        every row of every batch)."""
        row = cls.__new__(cls)
        row.table, row.row_key = table, row_key
        row.parts = [(element, change)]
        row.count = change.mutation_count
        row.size = change.size_bytes
        row._mutations = None
        wire = change.wire
        row.wire = None if wire is None else [wire]
        return row

    def add(self, element, change) -> None:
        """Coalesce one more change (a MappedChange's RowChange for this row)."""
        self.parts.append((element, change))
        self.count += change.mutation_count
        self.size += change.size_bytes
        if self._mutations is not None:  # already read: kept whole
            self._mutations.extend(change.mutations)
        wire = self.wire
        if wire is not None:  # coalescing: the entry's bytes are its changes' bytes, in order
            if change.wire is None:
                self.wire = None
            else:
                wire.append(change.wire)

    @property
    def mutations(self) -> list:
        if self._mutations is None:
            self._mutations = [m for _, change in self.parts for m in change.mutations]
        return self._mutations

    @mutations.setter
    def mutations(self, value) -> None:
        self._mutations = list(value)
        self.count = len(self._mutations)
        self.wire = None  # the old bytes no longer say these mutations

    def lazy_mutations(self) -> "RowMutations":
        """``mutations`` as a sequence built only if read: what a request's entry
        carries beside the bytes it is sent as (clients.bigtable.wire.WireEntry)."""
        return RowMutations(self)

    def has_markers(self) -> bool:
        """Whether any mutation is a touch marker (control.markers.has_markers),
        told by the families the changes keep, without building the mutations."""
        if self._mutations is not None or not self.parts:
            return has_markers(self.mutations)
        return any(MARKER_FAMILY in change.families for _, change in self.parts)

    def __repr__(self) -> str:
        return f"Row({self.table!r}, {self.row_key!r}, {self.count} mutations, {len(self.parts)} changes)"


class RowMutations(Sequence):
    """A Row's mutations, read from it when first used (Row.lazy_mutations)."""

    __slots__ = ("_row",)

    def __init__(self, row: Row) -> None:
        self._row = row

    def __len__(self) -> int:
        return self._row.count

    def __getitem__(self, index):
        return self._row.mutations[index]

    def __iter__(self):
        return iter(self._row.mutations)

    def __eq__(self, other) -> bool:
        return self._row.mutations == (other._row.mutations if type(other) is RowMutations else other)

    __hash__ = None  # a list's: unhashable

    def __repr__(self) -> str:
        return repr(self._row.mutations)


@dataclass
class Batch:
    """Everything buffered since the last flush; written and checkpointed as one."""

    rows: dict = field(default_factory=dict)  # (table, row_key) -> Row
    mutations: int = 0
    bytes: int = 0
    dead: list = field(default_factory=list)
    positions: dict = field(default_factory=dict)  # (stream, shard) -> (sequence number, change ms)
    applied: dict = field(default_factory=dict)  # (stream, shard) -> [count, max change ms]
    closed: list = field(default_factory=list)
    elements: list = field(default_factory=list)  # every MappedChange, in order
    conditional: list = field(default_factory=list)  # [(MappedChange, RowChange)] for CheckAndMutateRow
    guarded: list = field(default_factory=list)  # backfill RowChanges to repair if the tail touched them
    guard_parts: dict = field(default_factory=dict)  # (source, part) -> its guarded RowChanges (the journal)
    backfill: dict = field(default_factory=dict)  # (source, part) -> BackfillCheckpoint
    coalesced: int = 0  # changes added to a row already in the batch (counted once per batch: cheaper)

    def empty(self) -> bool:
        return not (self.rows or self.dead or self.positions or self.closed or self.conditional or self.backfill)


def merge_checkpoints(checkpoints: list) -> list:
    merged: dict = {}
    for c in checkpoints:
        key = (c.stream_arn, c.shard_id)
        prev = merged.get(key)
        if prev is None:
            merged[key] = c
        else:
            merged[key] = ShardCheckpoint(
                c.stream_arn, c.shard_id, c.sequence_number or prev.sequence_number,
                finished=prev.finished or c.finished, change_ms=c.change_ms or prev.change_ms,
            )
    return list(merged.values())
