"""Bigtable's hard limits, enforced by us before writing: the emulator accepts
what the service rejects (5 KiB keys, 1 MiB qualifiers), so a pipeline tested only
on the emulator would otherwise fail for the first time in production.
"""
from __future__ import annotations

from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.model import MUTATION_OVERHEAD_BYTES, RowChange, SetCell

KIB = 1024
MIB = 1024 * KIB

MAX_ROW_KEY_BYTES = 4 * KIB
MAX_QUALIFIER_BYTES = 16 * KIB
MAX_CELL_VALUE_BYTES = 100 * MIB
MAX_FAMILY_NAME_CHARS = 64
# One MutateRows request may carry at most 100,000 mutations in total; one row's
# change is never split across requests, so it must fit in one on its own.
MAX_MUTATIONS_PER_REQUEST = 100_000
# The service rejects requests over 256 MiB; stay far below so one oversized
# batch can never be the reason a healthy row fails.
MAX_REQUEST_BYTES = 200 * MIB
# Bigtable timestamps are microseconds in a signed 64-bit integer; we use whole
# milliseconds, so the largest timestamp we may write is this many ms.
MAX_TIMESTAMP_MS = (2**63 - 1) // 1000
# DynamoDB Streams allows 5 GetRecords calls per second per shard. Idle shards are
# polled one call/s below that (4/s, as AWS Lambda's poller): an idle shard's next
# change then waits 125 ms on average.
STREAM_GET_RECORDS_PER_SHARD_S = 5
DEFAULT_POLL_INTERVAL_S = 1 / (STREAM_GET_RECORDS_PER_SHARD_S - 1)
# DynamoDB Streams keeps records for 24 hours; anything older is trimmed.
STREAM_RETENTION_S = 24 * 3600


def checked_size(row_key: bytes, mutations: tuple) -> int:
    """The request bytes of one row's change (``RowChange.size_bytes``), checked
    against Bigtable's limits in the same pass: MappingError (a dead-letter
    reason) if the change breaks one."""
    if not row_key:
        raise MappingError("row key is empty", reason="row_key_empty")
    if len(row_key) > MAX_ROW_KEY_BYTES:
        raise MappingError(
            f"row key is {len(row_key)} bytes, Bigtable's limit is {MAX_ROW_KEY_BYTES}",
            reason="row_key_too_long",
        )
    if len(mutations) > MAX_MUTATIONS_PER_REQUEST:
        raise MappingError(
            f"{len(mutations)} mutations for one row, limit {MAX_MUTATIONS_PER_REQUEST}",
            reason="too_many_mutations",
        )
    size = len(row_key)
    for m in mutations:
        qualifier = len(m.qualifier)
        if qualifier > MAX_QUALIFIER_BYTES:
            raise MappingError(
                f"qualifier in family {m.family!r} is {qualifier} bytes, limit {MAX_QUALIFIER_BYTES}",
                reason="qualifier_too_long",
            )
        size += len(m.family) + qualifier + MUTATION_OVERHEAD_BYTES
        if type(m) is SetCell:
            value = len(m.value)
            if value > MAX_CELL_VALUE_BYTES:
                raise MappingError(
                    f"cell {m.family}:… is {value} bytes, limit {MAX_CELL_VALUE_BYTES}",
                    reason="cell_too_large",
                )
            if not 0 <= m.timestamp_ms <= MAX_TIMESTAMP_MS:
                raise MappingError(f"cell timestamp {m.timestamp_ms} ms out of range", reason="timestamp")
            size += value
    if size > MAX_REQUEST_BYTES:
        raise MappingError(
            f"row change is {size} bytes, over the {MAX_REQUEST_BYTES}-byte request budget",
            reason="row_too_large",
        )
    return size


def check_row_change(change: RowChange) -> None:
    """Raise MappingError (a dead-letter reason) if the change breaks a limit."""
    checked_size(change.row_key, change.mutations)
