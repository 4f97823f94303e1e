"""A Kinesis mapping's migration needs no touch markers (docs/design.md §10.6,
docs/kinesis.md): its backfill is a change like any other to the ordering guard.
So migrate/backfill create no marker family in its targets, and a `dlq redrive`
during its backfill writes no marker (there is no family to write it to)."""
from __future__ import annotations

from dataclasses import replace

from ddb2bt.pipeline.cutover import controller
from ddb2bt.pipeline.recover.redrive import redrive
from ddb2bt.pipeline.sink.guarded import GuardedBatchingWriter
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.mapping import MARKER_FAMILY
from ddb2bt.transforms.model import INSERT, ChangeRecord, DeadLetter
from ddb2bt.transforms.ordering import CLOCK_FAMILY
from tests.conftest import write_mapping
from tests.unit.cutover.cutover_common import CATALOG, FAST, T, item


class Admin:
    def __init__(self, tables) -> None:
        self.tables = {t: {"SKU"} for t in tables}

    def exists(self, table):
        return table in self.tables

    def families(self, table):
        return set(self.tables[table])

    def add_family(self, table, family):
        self.tables[table].add(family.name)

    def drop_family(self, table, name):
        self.tables[table].discard(name)


def kinesis_catalog(tmp_path):
    return load_mapping(write_mapping(tmp_path, source__kinesis={"stream": "cdc"}))


def test_a_kinesis_migration_creates_no_marker_family(tmp_path, monkeypatch):
    from ddb2bt.pipeline.control import markers as bookkeeping

    admin = Admin(CATALOG.tables)
    monkeypatch.setattr(bookkeeping, "process_admin", lambda project, instance: admin)
    kinesis = kinesis_catalog(tmp_path)
    controller._bookkeeping(kinesis).ensure(kinesis.tables)
    assert all(MARKER_FAMILY not in admin.families(t) for t in kinesis.tables)
    controller._bookkeeping(CATALOG).ensure(CATALOG.tables)  # a DynamoDB stream's backfill needs them
    assert all(MARKER_FAMILY in admin.families(t) for t in CATALOG.tables)
    admin.tables[kinesis.target.table].add(MARKER_FAMILY)  # left by an older version: still dropped
    controller._bookkeeping(kinesis).drop(kinesis.tables)
    assert MARKER_FAMILY not in admin.families(kinesis.target.table)


def test_a_redrive_during_a_kinesis_backfill_writes_no_marker(tmp_path):
    kinesis = kinesis_catalog(tmp_path)
    bt = InMemoryBigtable(families={kinesis.target.table: {"SKU", CLOCK_FAMILY}})  # as create-table makes it
    clock = [T + 10_000]
    store = StateStore(bt, "job", lambda: clock[0])
    store.save_meta("phase", "BACKFILLING")
    now = item(pk="hats", sk="a", Price=2)
    store.save_dead_letters([DeadLetter("encoding", "MappingError", "m", "map",
                                        ChangeRecord(INSERT, item(pk="hats", sk="a"), now, None, T), T)])

    class Table:
        def get(self, keys):
            return now

    batcher = GuardedBatchingWriter(bt, None, replace(FAST, ordering_guard=True), sleep=lambda s: None)
    result = redrive(kinesis, store, batcher, Table(), now_ms=lambda: clock[0],
                     sleep=lambda s: clock.__setitem__(0, clock[0] + int(s * 1000)))
    assert result.resolved == 1
    assert {f for f, _ in bt.latest(kinesis.target.table)[b"hats#a"]} == {"SKU", CLOCK_FAMILY}
