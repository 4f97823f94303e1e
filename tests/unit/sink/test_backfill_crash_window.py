"""The backfill's write/repair crash window (pipeline/sink/guards.py): a crash
after a batch's plain write and before its repair, with the tail's delete of an
item landing before that write, must not leave the deleted item in the table once
the backfill resumes (the Scan no longer returns the item) and finishes."""
from __future__ import annotations

import pytest

from ddb2bt.pipeline.sink.sink import BatchingWriter
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.dofns import map_record
from ddb2bt.transforms.mapping import MARKER_FAMILY, backfill_record
from ddb2bt.transforms.model import REMOVE, BackfillPosition, ChangeRecord, PartDone

from tests.unit.cutover.cutover_common import CATALOG, FAST, T, item

PART = "segment-0000-of-0001"
TABLE = "product_catalog"


class Crash(BaseException):
    """The process dies (SIGKILL, a lost lease, a deadline): nothing after it runs."""


def keys(it):
    return {"pk": it["pk"], "sk": it["sk"]}


def scanned(it, count):
    return backfill_record(keys(it), it, T, BackfillPosition("scan", PART, f"token-{count}", count))


def sink(bt, store):
    return BatchingWriter(bt, store, FAST, sleep=lambda s: None)


def finish(bt):
    """The finish drops the marker family: every marker cell goes."""
    for row in bt.tables.get(TABLE, {}).values():
        for column in [c for c in row if c[0] == MARKER_FAMILY]:
            del row[column]
    for key in [k for k, row in bt.tables.get(TABLE, {}).items() if not row]:
        del bt.tables[TABLE][key]


def test_a_crash_between_the_backfill_write_and_its_repair_resurrects_nothing(monkeypatch):
    bt = InMemoryBigtable()
    store = StateStore(bt, "job", lambda: T)
    gone, kept = item(pk="hats", sk="a", Price=3), item(pk="hats", sk="b", Price=4)
    # The backfill scanned both items (T is fixed; the tail marks since T's second).
    batch = [map_record(CATALOG, scanned(gone, 1), lambda: T), map_record(CATALOG, scanned(kept, 2), lambda: T)]
    assert all(r.guard is not None and not r.guard.conditional for m in batch for r in m.rows), \
        "this test is about the write-then-repair strategy"
    # The tail deletes one of them before the backfill's batch lands.
    tail = sink(bt, store)
    tail.add(map_record(CATALOG, ChangeRecord(REMOVE, keys(gone), None, gone, T + 2000), lambda: T, True))
    assert tail.flush() == []
    # The backfill's batch is written; the process dies before the repair.
    first = sink(bt, store)
    monkeypatch.setattr(bt, "cells_since", lambda *a: (_ for _ in ()).throw(Crash()))
    for m in batch:
        first.add(m)
    with pytest.raises(Crash):
        first.flush()
    monkeypatch.undo()
    assert b"hats#a" in bt.latest(TABLE), "the batch was written before the crash"
    assert ("scan", PART) not in store.load_backfill_progress(), "and nothing was checkpointed"
    # Resume: the Scan no longer returns the deleted item; the part completes.
    resumed = sink(bt, store)
    resumed.add(map_record(CATALOG, scanned(kept, 1), lambda: T))
    resumed.add(PartDone("scan", PART, 1))
    assert resumed.flush() == []
    assert store.load_backfill_progress()[("scan", PART)].done
    finish(bt)
    assert set(bt.latest(TABLE)) == {b"hats#b"}, "the item the tail deleted must not come back"
    assert store.load_repair_intents("scan", PART) == {}, "the journal is cleared once repaired"


def test_a_batch_without_a_crash_clears_its_journal_and_writes_one_record_per_part():
    bt = InMemoryBigtable()
    store = StateStore(bt, "job", lambda: T)
    s = sink(bt, store)
    s.add(map_record(CATALOG, scanned(item(pk="p", sk="1", Price=1), 1), lambda: T))
    writes = []
    real = store.save_repair_intent
    store.save_repair_intent = lambda *a: writes.append(a[:2]) or real(*a)
    assert s.flush() == []
    assert writes == [("scan", PART)]
    assert store.load_repair_intents("scan", PART) == {}
    assert b"p#1" in bt.latest(TABLE)
