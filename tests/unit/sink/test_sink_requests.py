"""The sink's MutateRows requests are encoded directly (``encode_mutate_rows``,
and the mutations the compiled mapping encodes where it makes them,
``transforms.wire``): they must be byte for byte what building the protobuf
message and serializing it gives (``build_request(...).SerializeToString()``),
for any entries the mapping can produce — and for edge cases it does not (empty fields, negative and huge
timestamps, values and rows past the varint lookup table)."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ddb2bt.pipeline.clients.bigtable.wire import (WireEntry, build_check_and_mutate, build_mutations, build_request,
                                                   encode_check_and_mutate, encode_mutate_rows, mutate_rows_types,
                                                   newest_of_column_predicate)
from ddb2bt.transforms import native
from ddb2bt.transforms.wire import encode_mutations, encode_mutations_py
from ddb2bt.transforms.model import DeleteCells, RowChange, SetCell

REQUEST_CLS = mutate_rows_types()[0]
TABLE = "projects/p/instances/i/tables/t"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Millisecond timestamps whose microseconds still fit in an int64.
TS_MS = st.one_of(st.integers(0, 4_102_444_800_000), st.integers(-(INT64_MAX // 1000), INT64_MAX // 1000),
                  st.sampled_from([0, 1, -1, 127, 128, 16_383, 16_384]))
FAMILIES = st.one_of(st.sampled_from(["cf", "SKU", "_m", "", "ünï"]), st.text(max_size=20))
QUALIFIERS = st.one_of(st.sampled_from([b"", b"a", b"Price"]), st.binary(max_size=300))
VALUES = st.one_of(st.binary(max_size=200), st.sampled_from([b"", b"\x00"]),
                   st.sampled_from([16_383, 16_384, 20_000]).map(lambda n: b"v" * n))
SET_CELLS = st.builds(SetCell, FAMILIES, QUALIFIERS, VALUES, TS_MS)
DELETES = st.builds(DeleteCells, FAMILIES, QUALIFIERS, TS_MS, TS_MS)
ROW_CHANGES = st.builds(RowChange, st.just("t"), st.binary(max_size=64),
                        st.lists(st.one_of(SET_CELLS, DELETES), max_size=12).map(tuple))


def reference(table: str, app_profile, entries) -> bytes:
    return build_request(REQUEST_CLS, table, app_profile, entries).SerializeToString()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ROW_CHANGES, max_size=8), st.one_of(st.none(), st.just(""), st.text(max_size=10)),
       st.sampled_from([TABLE, ""]))
def test_encoded_requests_are_byte_identical_to_the_built_message(changes, app_profile, table):
    entries = [(c.row_key, c.mutations) for c in changes]
    assert encode_mutate_rows(table, app_profile, entries) == reference(table, app_profile, entries)


def random_change(rng: random.Random, ts_ms: int) -> RowChange:
    """A change shaped like the mapping's: one timestamp, a few columns written,
    older versions of others deleted below it."""
    columns = [f"col{i}".encode() for i in range(rng.randrange(1, 12))]
    mutations = []
    for q in columns:
        if rng.random() < 0.6:
            mutations.append(SetCell("SKU", q, rng.randbytes(rng.choice([0, 1, 8, 100, 1000])), ts_ms))
        else:
            mutations.append(DeleteCells("SKU", q, 0, ts_ms))
    return RowChange("t", f"cat{rng.randrange(50):02d}#item#{rng.randrange(10**6):06d}".encode(), tuple(mutations))


def test_random_batches_shaped_like_the_mappings_are_byte_identical():
    rng = random.Random(16)
    for batch in range(20):
        ts = 1_700_000_000_000 + batch * 1000
        # Up to 1,000 entries, as the sink sends: request lengths far past 16 KiB.
        changes = [random_change(rng, ts + i // 3) for i in range(rng.choice([1, 10, 1000]))]
        entries = [(c.row_key, c.mutations) for c in changes]
        encoded = encode_mutate_rows(TABLE, None, entries)
        assert encoded == reference(TABLE, None, entries)
        parsed = REQUEST_CLS.FromString(encoded)
        assert [e.row_key for e in parsed.entries] == [c.row_key for c in changes]


def test_an_entry_larger_than_the_varint_table_is_encoded_exactly():
    big = [(b"row", tuple(SetCell("cf", b"q%d" % i, b"x" * 5000, 1) for i in range(10)))]
    assert encode_mutate_rows(TABLE, "profile", big) == reference(TABLE, "profile", big)


def test_a_timestamp_out_of_int64_range_is_refused_like_the_message_refuses_it():
    import pytest

    entries = [(b"row", (SetCell("cf", b"q", b"v", INT64_MAX // 1000 + 1),))]
    with pytest.raises(ValueError):
        reference(TABLE, None, entries)
    with pytest.raises(ValueError):
        encode_mutate_rows(TABLE, None, entries)


def protobuf_mutations(mutations) -> bytes:
    """Entry.mutations as the protobuf library writes them (an Entry without a row key)."""
    request = REQUEST_CLS()
    build_mutations(request.entries.add().mutations, mutations)
    return request.entries[0].SerializeToString()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(SET_CELLS, DELETES), max_size=12))
def test_mutations_encoded_where_they_are_made_are_the_messages_bytes(mutations):
    """transforms.wire.encode_mutations, the form the compiled mapping emits."""
    assert encode_mutations(mutations) == protobuf_mutations(mutations)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(ROW_CHANGES, st.booleans()), max_size=8), st.one_of(st.none(), st.text(max_size=10)))
def test_entries_carrying_their_wire_bytes_encode_to_the_same_request(changes, app_profile):
    """A request mixing entries that carry their mutations' bytes (WireEntry, as
    the sink sends the compiled mapping's changes) and entries of tuples is byte
    for byte the message the protobuf library builds; a coalesced entry's bytes
    are its changes' bytes concatenated."""
    entries = []
    for change, encoded in changes:
        if encoded:
            half = len(change.mutations) // 2  # two changes coalesced into one entry
            pieces = [encode_mutations(change.mutations[:half]), encode_mutations(change.mutations[half:])]
            entries.append(WireEntry(change.row_key, change.mutations, b"".join(pieces)))
        else:
            entries.append((change.row_key, change.mutations))
    assert encode_mutate_rows(TABLE, app_profile, entries) == reference(TABLE, app_profile, entries)


def test_the_sink_sends_the_compiled_mappings_bytes_for_coalesced_rows():
    """Through BatchingWriter: changes mapped by the compiled mapping reach the
    writer as entries carrying their bytes — several changes to one row coalesced
    into one entry — and the request they make is byte for byte the protobuf
    library's for the same rows' mutation tuples (the sink's reference)."""
    from pathlib import Path

    from prometheus_client import CollectorRegistry

    from ddb2bt.pipeline.clients.bigtable.errors import ENTRY_OK
    from ddb2bt.pipeline.observe.metrics import PipelineMetrics
    from ddb2bt.pipeline.sink.sink import BatchingWriter, SinkConfig
    from ddb2bt.transforms.config import load_mapping
    from ddb2bt.transforms.dofns import map_record
    from ddb2bt.transforms.model import INSERT, MODIFY, REMOVE, ChangeRecord, MappedBatch, StreamPosition

    mapping = load_mapping(Path(__file__).resolve().parents[3] / "examples" / "product_catalog.yaml")
    sent = []

    class RecordingWriter:
        def mutate_rows(self, table, entries):
            sent.append(list(entries))
            return [ENTRY_OK] * len(entries)

    rng = random.Random(36)
    items: dict = {}
    changes = []
    for seq in range(300):
        k = rng.randrange(20)  # 20 items, 300 changes: most rows are written several times per batch
        keys = {"pk": {"S": f"cat{k % 3}"}, "sk": {"S": f"item#{k:03d}"}}
        old = items.get(k)
        if old is not None and rng.random() < 0.15:
            event, new = REMOVE, None
            del items[k]
        else:
            new = dict(keys, Name={"S": rng.choice(["hat", "cap", ""])}, Price={"N": str(rng.randrange(10**6))},
                       **({"Colour": {"S": "red"}} if rng.random() < 0.5 else {}))
            event = MODIFY if old is not None else INSERT
            items[k] = new
        record = ChangeRecord(event, keys, new, old, 1_700_000_000_000 + seq // 7,
                              position=StreamPosition("arn:s", "shard-1", str(10**20 + seq)))
        changes.append(map_record(mapping, record, lambda: 0))
    assert not any(c.dead_letter for c in changes)
    writer = BatchingWriter(RecordingWriter(), None, SinkConfig(), PipelineMetrics(CollectorRegistry()))
    writer.add(MappedBatch(tuple(changes)))
    writer.flush()
    entries = [e for request in sent for e in request]
    assert len(entries) == len({e[0] for e in entries}) <= 20 < len(changes)  # coalesced
    assert all(type(e) is WireEntry for e in entries)
    for request in sent:
        plain = [(row_key, tuple(mutations)) for row_key, mutations in request]
        assert encode_mutate_rows(TABLE, None, request) == reference(TABLE, None, plain)


def test_a_change_rebuilt_with_other_mutations_carries_no_stale_bytes():
    """RowChange.wire is not an __init__ field: dataclasses.replace (how version
    claims, marker stripping and redrive rebuild a change) leaves the copy without
    bytes, so the sink encodes the copy's own tuples; equality ignores the bytes."""
    import dataclasses

    from ddb2bt.transforms.config import load_mapping
    from ddb2bt.transforms.mapping import map_change
    from ddb2bt.transforms.model import INSERT, ChangeRecord
    from pathlib import Path

    mapping = load_mapping(Path(__file__).resolve().parents[3] / "examples" / "product_catalog.yaml")
    keys = {"pk": {"S": "hats"}, "sk": {"S": "item#1"}}
    change, = map_change(mapping, ChangeRecord(INSERT, keys, dict(keys, Name={"S": "cap"}), None, 1_700_000_000_000))
    assert change.wire == protobuf_mutations(change.mutations)
    fewer = dataclasses.replace(change, mutations=change.mutations[:-1], size_bytes=-1)
    assert fewer.wire is None
    assert dataclasses.replace(change) == change


# --- the ordering guard's CheckAndMutateRow requests ---------------------------------

CAM_CLS = None


def cam_reference(*args) -> bytes:
    global CAM_CLS
    if CAM_CLS is None:
        from google.cloud.bigtable_v2.types import bigtable as bigtable_types

        CAM_CLS = bigtable_types.CheckAndMutateRowRequest.pb()
    return build_check_and_mutate(CAM_CLS, *args).SerializeToString()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([TABLE, ""]), st.binary(max_size=64), FAMILIES, QUALIFIERS,
       st.one_of(st.none(), st.binary(max_size=300)),
       st.lists(st.one_of(SET_CELLS, DELETES), max_size=12), st.booleans(),
       st.one_of(st.none(), st.just(""), st.text(max_size=10)))
def test_check_and_mutate_requests_are_byte_identical_to_the_built_message(table, row_key, family, qualifier, regex,
                                                                            mutations, when_matched, app_profile):
    """Any row key (the empty one too), column, value filter or none, mutations,
    case and app profile: the bytes ``encode_check_and_mutate`` sends are the
    message's, and its predicate is the message's predicate (whose size the
    writer checks against Bigtable's row-filter limit)."""
    predicate = newest_of_column_predicate(family, qualifier, regex)
    sent = encode_check_and_mutate(table, app_profile, row_key, predicate, mutations, when_matched)
    assert sent == cam_reference(table, app_profile, row_key, family, qualifier, regex, mutations, when_matched)
    message = CAM_CLS.FromString(sent)
    assert len(predicate) == message.predicate_filter.ByteSize()
    assert len(message.true_mutations if when_matched else message.false_mutations) == len(mutations)


# --- the C encoder of mutations (transforms/encoders_c.c) --------------------------

ODD = st.one_of(st.builds(SetCell, st.sampled_from(["\ud800", "f", b"f"]), st.sampled_from([b"q", "q", bytearray(b"q")]),
                          st.sampled_from([b"v", "v", None]), st.sampled_from([True, 1.5, 2**62, -(2**62), 10**20, 5])),
                st.builds(DeleteCells, st.sampled_from(["\ud800", "f"]), st.sampled_from([b"q", "q"]),
                          st.sampled_from([0, True, 2**61, None]), st.sampled_from([0, 7, -(2**62), 10**20])))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(SET_CELLS, DELETES, ODD), max_size=8), st.sampled_from([b"\x12", b"\x22", b"\x2a"]))
def test_the_c_encoder_writes_the_python_bytes_or_leaves_them_to_it(mutations, field):
    """Any mutations, odd ones too (a str qualifier, a bool or float time, a
    time past int64 in microseconds, a family that is not UTF-8): the C gives
    the Python encoder's bytes, or None and the Python decides (and raises);
    through ``encode_mutations`` the answer, or the error, is the Python one's."""
    assert native.NATIVE_BUILT, "ddb2bt.transforms.rowwriter_c is not built (docs/development.md)"
    fast = native.rowwriter_c.encode_mutations(SetCell, DeleteCells, mutations, field)
    try:
        expected = encode_mutations_py(mutations, field)
    except Exception as exc:  # noqa: BLE001 — whatever the reference raises, the C must not have written bytes
        assert fast is None
        with pytest.raises(type(exc)):
            encode_mutations(mutations, field)
        return
    assert fast is None or fast == expected
    assert encode_mutations(mutations, field) == expected
    if all(type(m.family) is str and type(m.qualifier) is bytes for m in mutations) and not any(
            isinstance(v, (bool, float)) or v is None or (type(v) is int and abs(v) > 2**62 // 1000)
            for m in mutations for v in m[2:] if not isinstance(v, (bytes, str))) and not any(
            "\ud800" in m.family for m in mutations):
        assert fast == expected  # the usual shapes are the C's own, none left to Python


def test_the_c_encoder_holds_no_reference_and_no_memory_per_call():
    import sys
    import tracemalloc

    mutations = (SetCell("SKU", b"q", b"v" * 100, 1_700_000_000_123), DeleteCells("SKU", b"q", 0, 1_700_000_000_123),
                 SetCell("\ud800", b"q", b"v", 1))  # the last one: left to Python (None)
    value = mutations[0].value
    before = sys.getrefcount(value)
    for _ in range(1000):
        native.rowwriter_c.encode_mutations(SetCell, DeleteCells, mutations[:2], b"\x12")
        native.rowwriter_c.encode_mutations(SetCell, DeleteCells, mutations, b"\x12")
    tracemalloc.start()
    snapshot = tracemalloc.take_snapshot()
    for _ in range(2000):
        native.rowwriter_c.encode_mutations(SetCell, DeleteCells, mutations[:2], b"\x12")
        native.rowwriter_c.encode_mutations(SetCell, DeleteCells, mutations, b"\x12")
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(snapshot, "filename") if s.size_diff > 0)
    tracemalloc.stop()
    assert sys.getrefcount(value) == before
    assert grown < 64 * 1024, grown


def test_the_c_encoder_leaves_an_iterator_and_an_odd_tag_to_python_untouched():
    mutations = [SetCell("cf", b"q", b"v", 5), DeleteCells("cf", b"q", 0, 5)]
    expected = encode_mutations_py(mutations)
    assert encode_mutations(m for m in mutations) == expected  # read once, by whichever encoder writes it
    assert encode_mutations(iter([SetCell("cf", b"q", bytearray(b"v"), 5)])) == encode_mutations_py(
        [SetCell("cf", b"q", bytearray(b"v"), 5)])
    with pytest.raises(TypeError):
        encode_mutations(m for m in mutations + [object()])
    for tag in (bytearray(b"\x12"), b"\x82\x01", b""):
        assert native.rowwriter_c.encode_mutations(SetCell, DeleteCells, mutations, tag) is None
        assert encode_mutations(mutations, tag) == encode_mutations_py(mutations, tag)
    with pytest.raises(TypeError):
        native.rowwriter_c.encode_mutations(dict, DeleteCells, mutations, b"\x12")
