"""The sink's rows (batch.Row) keep what every write needs — their mutations'
count, bytes and wire pieces — as changes are coalesced, and build their list of
mutations only when something reads it: a batch of the compiled mapping's
changes is sent without decoding one change's mutations (model.EncodedMutations),
and whenever they are read they are the changes' mutations in stream order."""
from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

import ddb2bt.transforms.wire as transforms_wire
from ddb2bt.pipeline.clients.bigtable.errors import ENTRY_OK
from ddb2bt.pipeline.observe.metrics import PipelineMetrics
from ddb2bt.pipeline.sink.batch import Row
from ddb2bt.pipeline.sink.batching import BatchingWriter
from ddb2bt.pipeline.sink.config import SinkConfig
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.dofns import map_record
from ddb2bt.transforms.mapping import MARKER_FAMILY
from ddb2bt.transforms.model import INSERT, MODIFY, ChangeRecord, MappedBatch, RowChange, SetCell, StreamPosition

MAPPING = load_mapping(Path(__file__).resolve().parents[3] / "examples" / "product_catalog.yaml")
T = 1_700_000_000_000


def changes(n: int, items: int = 3, mark: bool = False) -> list:
    out, images = [], {}
    for seq in range(n):
        k = seq % items
        keys = {"pk": {"S": "cat"}, "sk": {"S": f"item#{k}"}}
        new = dict(keys, Price={"N": str(seq)}, Description={"S": f"d{seq}"})
        old = images.get(k)
        images[k] = new
        record = ChangeRecord(MODIFY if old else INSERT, keys, new, old, T + seq,
                              position=StreamPosition("arn:s", "shard-1", str(10**20 + seq)))
        out.append(map_record(MAPPING, record, lambda: T, mark_touched=mark))
    return out


class Decodes:
    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        real = transforms_wire.decode_mutations

        def counting(data):
            self.calls += 1
            return real(data)
        monkeypatch.setattr(transforms_wire, "decode_mutations", counting)


def test_a_batch_of_compiled_changes_is_sent_without_decoding_their_mutations(monkeypatch):
    decodes = Decodes(monkeypatch)
    sent = []

    class RecordingWriter:  # the gRPC writer's part: it sends the bytes, never the tuples
        def mutate_rows(self, table, entries):
            sent.append(list(entries))
            return [ENTRY_OK] * len(entries)

    mapped = changes(30)
    writer = BatchingWriter(RecordingWriter(), None, SinkConfig(), PipelineMetrics(CollectorRegistry()),
                            known_families=lambda table: frozenset({"SKU"}))
    writer.add(MappedBatch(tuple(mapped)))
    writer.flush()
    assert decodes.calls == 0
    entries = [e for request in sent for e in request]
    assert len(entries) == 3  # coalesced: one entry per item
    for row_key, mutations in entries:  # read now: the changes' mutations, in stream order
        expected = [m for c in mapped for r in c.rows if r.row_key == row_key for m in r.mutations]
        assert list(mutations) == expected and len(mutations) == len(expected)
        assert mutations == expected and mutations[0] == expected[0]


def test_a_row_read_midway_stays_whole_and_explicit_mutations_replace_the_parts():
    mapped = changes(4, items=1)
    first, *rest = [(c, c.rows[0]) for c in mapped]
    row = Row("product_catalog", first[1].row_key, wire=[])
    row.add(*first)
    assert row.mutations == list(first[1].mutations)  # read: built now
    for element, change in rest:
        row.add(element, change)
    every = [m for _, c in [first, *rest] for m in c.mutations]
    assert row.mutations == every and row.count == len(every)
    assert row.size == sum(c.size_bytes for _, c in [first, *rest])
    assert b"".join(row.wire) == transforms_wire.encode_mutations(every)
    row.mutations = every[:1]
    assert row.count == 1 and row.mutations == every[:1]
    assert row.wire is None  # replaced mutations: the old bytes would send what they no longer say
    row.add(*rest[0])
    assert row.wire is None and row.mutations == every[:1] + list(rest[0][1].mutations)
    assert Row("t", b"k", [SetCell("f", b"q", b"", 1)]).count == 1


def test_markers_are_told_from_the_families_and_match_the_mutations(monkeypatch):
    decodes = Decodes(monkeypatch)
    for mark in (False, True):
        decodes.calls = 0
        element = changes(1, mark=mark)[0]
        row = Row("product_catalog", element.rows[0].row_key, wire=[])
        row.add(element, element.rows[0])
        assert row.has_markers() is mark
        assert decodes.calls == 0
        assert any(m.family == MARKER_FAMILY for m in row.mutations) is mark


def test_the_in_memory_fake_applies_what_the_bytes_say():
    bt = InMemoryBigtable(families={"product_catalog": {"SKU"}})
    writer = BatchingWriter(bt, None, SinkConfig())
    writer.add(MappedBatch(tuple(changes(9))))
    writer.flush()
    assert len(bt.tables["product_catalog"]) == 3


def test_a_row_made_with_its_first_change_is_the_row_made_then_given_it():
    """Row.of_change (the batch's every new row) fills the slots that Row(...)
    then add() fill, for a change sent as wire bytes and for one that is not."""
    record = ChangeRecord(INSERT, {"k": {"S": "x"}}, {}, {}, T, StreamPosition("arn", "s", "1"))
    encoded = changes(1)[0].rows[0]
    plain = RowChange("t", b"r", (SetCell("f", b"q", b"v", T),))
    assert encoded.wire is not None and plain.wire is None
    for change in (encoded, plain):
        made = Row.of_change(change.table, change.row_key, record, change)
        built = Row(change.table, change.row_key, wire=None if change.wire is None else [])
        built.add(record, change)
        assert {s: getattr(made, s) for s in Row.__slots__} == {s: getattr(built, s) for s in Row.__slots__}
        assert made.mutations == built.mutations == list(change.mutations)
