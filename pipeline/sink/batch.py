"""What a sink buffers between flushes: one ``Row`` per (table, row key), with its
changes coalesced in stream order, and the ``Batch`` written and checkpointed as one."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ddb2bt.pipeline.control.state import ShardCheckpoint

__all__ = ["Batch", "Row", "merge_checkpoints"]


@dataclass
class Row:
    table: str
    row_key: bytes
    mutations: list = field(default_factory=list)
    parts: list = field(default_factory=list)  # [(MappedChange, RowChange)] in stream order
    size: int = 0  # bytes, summed as changes are added (not recomputed per request)
    # ``mutations`` in the wire format, one piece per change (RowChange.wire), while
    # every change added came encoded; None: the request encodes ``mutations``.
    # Whoever replaces ``mutations`` sets it to None.
    wire: Optional[list] = None


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
