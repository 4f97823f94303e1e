"""Admin calls per process, not per DoFn (issue 22): a pipeline of several sink
DoFns (three branches, several bundles) builds one admin client and lists each
table's column families once, counted through a fake admin; the migration's
bookkeeping shares the same admin object.

The admin is a fake because what is counted is our calls to it, not what the
emulator answers (it enforces no admin quota)."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from ddb2bt.pipeline.clients.bigtable import admin as bigtable_admin
from ddb2bt.pipeline.sink.sink import SinkConfig, _WriteToBigtableFn
from ddb2bt.pipeline.testing.fakes import FAKE_CLIENTS, InMemoryBigtable
from ddb2bt.transforms.dofns import map_record
from ddb2bt.transforms.model import INSERT, ChangeRecord

from tests.unit.cutover.cutover_common import CATALOG, FAST, T, item

COUNTS: dict = {}
LOCK = threading.Lock()


class CountingAdmin:
    """BigtableAdmin's ``families`` over the in-memory Bigtable's families,
    counting the clients built and the listings made."""

    def __init__(self, project: str, instance: str) -> None:
        with LOCK:
            COUNTS["clients"] = COUNTS.get("clients", 0) + 1

    def families(self, table: str) -> set:
        with LOCK:
            COUNTS.setdefault("listings", {}).setdefault(table, 0)
            COUNTS["listings"][table] += 1
        return {"SKU"}


@dataclass(frozen=True)
class FakeBigtableSpec:
    """A BigtableSpec stand-in (picklable): the writer is the registered in-memory Bigtable."""

    name: str
    project: str = "p"
    instance: str = "i"

    def writer(self):
        return FAKE_CLIENTS[self.name]


@pytest.fixture
def counting_admin(monkeypatch):
    COUNTS.clear()
    bigtable_admin.forget_process_admins()
    monkeypatch.setattr(bigtable_admin, "ADMIN_FACTORY", CountingAdmin)
    yield COUNTS
    bigtable_admin.forget_process_admins()


def changes(n: int) -> list:
    out = []
    for i in range(n):
        new = item(pk=f"p{i}", sk="a", Price=i)
        out.append(map_record(CATALOG, ChangeRecord(INSERT, item(pk=f"p{i}", sk="a"), new, None, T + i), lambda: T))
    return out


def test_several_sink_dofns_in_one_process_share_one_admin_client_and_one_family_listing(counting_admin):
    bt = FAKE_CLIENTS["admin-per-process"] = InMemoryBigtable()
    spec = FakeBigtableSpec("admin-per-process")
    elements = changes(30)
    config = SinkConfig(retry=FAST.retry, max_batch_rows=4)
    try:
        options = PipelineOptions(["--runner=FnApiRunner", "--direct_num_workers=1"])
        with beam.Pipeline(options=options) as p:
            source = p | beam.Create(elements, reshuffle=False)
            for branch in range(3):  # three sink DoFns, each its own instance and setup()
                _ = source | f"Write{branch}" >> beam.ParDo(_WriteToBigtableFn(spec, None, config))
    finally:
        del FAKE_CLIENTS["admin-per-process"]
    assert len(bt.latest("product_catalog")) == 30  # the pipeline wrote through every branch
    assert counting_admin["clients"] == 1
    assert counting_admin["listings"] == {"product_catalog": 1}


def test_bookkeeping_uses_the_process_admin(counting_admin):
    from ddb2bt.pipeline.control.markers import Bookkeeping

    a, b = Bookkeeping.for_target("p", "i"), Bookkeeping.for_target("p", "i")
    assert a._admin is b._admin and counting_admin["clients"] == 1


def test_family_lists_expire_per_process(counting_admin):
    now = [0.0]
    assert bigtable_admin.process_families("p", "i", "t", 60.0, now=lambda: now[0]) == frozenset({"SKU"})
    now[0] = 59.0
    bigtable_admin.process_families("p", "i", "t", 60.0, now=lambda: now[0])
    assert counting_admin["listings"] == {"t": 1}
    now[0] = 60.0  # a family added by create-table is seen within a minute
    bigtable_admin.process_families("p", "i", "t", 60.0, now=lambda: now[0])
    assert counting_admin["listings"] == {"t": 2}


def test_a_family_missing_from_the_cached_list_is_asked_for_again_before_dead_lettering(counting_admin, monkeypatch):
    from ddb2bt.pipeline.sink.sink import BatchingWriter, _FamilyCache

    now = [0.0]
    families = {"product_catalog": {"Other"}}  # SKU not there yet

    class Admin(CountingAdmin):
        def families(self, table):
            super().families(table)
            return set(families[table])

    monkeypatch.setattr(bigtable_admin, "ADMIN_FACTORY", Admin)
    cache = _FamilyCache(FakeBigtableSpec("x"), now=lambda: now[0])
    bt = InMemoryBigtable()
    batcher = BatchingWriter(bt, None, SinkConfig(retry=FAST.retry), known_families=cache)
    first, second = changes(2)
    batcher.add(first)
    assert [d.reason for d in batcher.flush()] == ["unknown_family"]  # listed twice: still missing
    families["product_catalog"].add("SKU")  # create-table adds it
    now[0] = 6.0  # past FAMILY_RECHECK_S, well within FAMILY_CACHE_S
    batcher.add(second)
    assert batcher.flush() == []  # asked again, found, written
    assert b"p1#a" in bt.latest("product_catalog")
