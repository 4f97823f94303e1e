"""A dead letter is keyed by what it is (its record's position, stage and
reason), not by when it was stored: a bundle the runner retries, or a replay
from an older checkpoint, that dead-letters the same record again leaves one
letter, so `status`, `dlq list` and "N dead-lettered" count records, not attempts."""
from __future__ import annotations

from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.model import INSERT, ChangeRecord, DeadLetter, StreamPosition

ARN = "arn:aws:dynamodb:us-east-1:1:table/T/stream/2024"


def record(seq: str, position=True) -> ChangeRecord:
    keys = {"pk": {"S": f"k{seq}"}}
    return ChangeRecord(INSERT, keys, keys, None, 1_000, StreamPosition(ARN, "s0", seq) if position else None)


def letter(rec: ChangeRecord, at_ms: int, reason: str = "encoding", stage: str = "map") -> DeadLetter:
    return DeadLetter(reason, "MappingError", f"failed at {at_ms}", stage, rec, at_ms)


def test_a_retried_bundle_leaves_one_letter_per_record():
    clock = [10_000]
    store = StateStore(InMemoryBigtable(), "job", lambda: clock[0])
    bundle = [record("1"), record("2")]
    for attempt in range(3):  # the runner retries the bundle; a restart replays it
        clock[0] += 1_000
        store.save_dead_letters([letter(r, clock[0]) for r in bundle])
    assert store.count_dead_letters() == 2
    listed = store.list_dead_letters()
    assert sorted(e["position"] for e in listed) == ["s0/1", "s0/2"]
    assert {e["failed_at_ms"] for e in listed} == {"13000"}  # the latest attempt's


def test_letters_that_differ_in_what_they_are_stay_apart():
    store = StateStore(InMemoryBigtable(), "job", lambda: 5)
    store.save_dead_letters([letter(record("1"), 1), letter(record("1"), 2, reason="row_key_too_long"),
                             letter(record("1"), 3, stage="write"), letter(record("2"), 4),
                             letter(record("a", position=False), 5), letter(record("b", position=False), 6)])
    assert store.count_dead_letters() == 6
    store.save_dead_letters([letter(record("a", position=False), 7)])  # no position: its keys tell it apart
    assert store.count_dead_letters() == 6
