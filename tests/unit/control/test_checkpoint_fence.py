"""A checkpoint's write is retried only while this process still owns the
partition (docs/design.md §6.5): a worker paused in the middle of the write
wakes to a retry, and must not checkpoint after the partition's new owner."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from ddb2bt.pipeline.control.lease import LeaseLost
from ddb2bt.pipeline.control.state import BigtableStateBackend, ShardCheckpoint, StateStore

ARN = "arn:aws:dynamodb:us-east-1:1:table/T/stream/2026-11-25T00:00:00.000"
FAILED = SimpleNamespace(ok=False, retryable=True, message="DEADLINE_EXCEEDED")  # the paused attempt
OK = SimpleNamespace(ok=True, retryable=False, message="")


class FlakyWriter:
    """The state table's writer: the first write times out, later ones succeed."""

    def __init__(self) -> None:
        self.attempts = 0
        self.written: list = []

    def mutate_rows(self, table_id, rows):
        self.attempts += 1
        if self.attempts == 1:
            return [FAILED for _ in rows]
        self.written.extend(key for key, _ in rows)
        return [OK for _ in rows]


def store(writer) -> StateStore:
    return StateStore(BigtableStateBackend(writer, "p", "i", "ddb2bt_state"), "job", now_ms=lambda: 1)


def test_a_checkpoint_is_not_retried_after_the_partition_moved():
    writer = FlakyWriter()

    def moved():
        raise LeaseLost("partition 0 was taken over by another worker")

    with pytest.raises(LeaseLost):
        store(writer).save_checkpoints([ShardCheckpoint(ARN, "shard-1", "100")], still_owner=moved)
    assert writer.attempts == 1 and writer.written == []


def test_a_checkpoint_is_retried_while_the_partition_is_still_owned():
    writer = FlakyWriter()
    checks: list = []
    store(writer).save_checkpoints([ShardCheckpoint(ARN, "shard-1", "100")], still_owner=lambda: checks.append(1))
    assert writer.attempts == 2 and len(writer.written) == 1 and checks == [1]
