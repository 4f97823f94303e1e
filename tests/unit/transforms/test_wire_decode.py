"""transforms.wire.decode_mutations and the RowChanges built from wire bytes alone
(the compiled mapping's, model.EncodedMutations): decoding gives back exactly the
mutations that were encoded, refuses what the encoder never writes, and a change
whose mutations are decoded on first read is the change its constructor builds
(fields, equality, hash, repr, pickling, dataclasses.replace)."""
from __future__ import annotations

import dataclasses
import pickle

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ddb2bt.transforms.model import DeleteCells, EncodedMutations, RowChange, SetCell, build_row_change
from ddb2bt.transforms.wire import decode_mutations, encode_mutations, set_cell_columns

from tests.unit.sink.test_sink_requests import FAMILIES, QUALIFIERS, TS_MS, VALUES  # the encoder's own strategies

MUTATIONS = st.lists(st.one_of(st.builds(SetCell, FAMILIES, QUALIFIERS, VALUES, TS_MS),
                               st.builds(DeleteCells, FAMILIES, QUALIFIERS, TS_MS, TS_MS)), max_size=12).map(tuple)


def encoded_change(mutations: tuple, **fields) -> RowChange:
    """What the compiled mapping builds: the mutations only as their bytes."""
    reference = RowChange("t", b"row", mutations, **fields)
    families = tuple(dict.fromkeys(m.family for m in mutations))
    return build_row_change("t", b"row", EncodedMutations(len(mutations), families), reference.guard,
                            reference.size_bytes, reference.versioned, reference.owner, encode_mutations(mutations))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(MUTATIONS)
def test_decoding_gives_back_exactly_what_was_encoded(mutations):
    decoded = decode_mutations(encode_mutations(mutations))
    assert decoded == mutations
    assert [type(m) for m in decoded] == [type(m) for m in mutations]
    assert all(type(x) is type(y) for a, b in zip(decoded, mutations) for x, y in zip(a, b))


@pytest.mark.parametrize("data, why", [
    (b"\x0a\x00", "not an Entry.mutations field"),
    (encode_mutations((SetCell("f", b"q", b"v", 5),))[:-1], "length"),
    (b"\x12\x02\x1a\x00", "unknown mutation kind"),
    (b"\x12\x04\x0a\x02\x2a\x00", "unexpected mutation fields"),  # SetCell field 5: never written
    (b"\x12\x06\x0a\x04\x18\x01\x18\x01", "repeated"),
    (b"\x12\x04\x0a\x02\x18\x01", "whole milliseconds"),  # 1 us
    (b"\x12\x02\x12\x00", "without its time range"),
    (b"\x12", "truncated"),  # cut inside a length
    (b"\x12\x00", "length"),  # an empty mutation
    (b"\x12\x05\x0a", "length"),  # a mutation longer than what is left
])
def test_decoding_refuses_what_the_encoder_never_writes(data, why):
    with pytest.raises(ValueError, match=why):
        decode_mutations(data)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(MUTATIONS)
def test_a_change_built_from_its_bytes_is_the_constructed_change(mutations):
    expected = RowChange("t", b"row", mutations, versioned=(("f", b"q", 5, True),), owner=b"o")
    built = encoded_change(mutations, versioned=(("f", b"q", 5, True),), owner=b"o")
    # What the sink reads of every change, before anything decodes the mutations.
    assert built.mutation_count == len(mutations)
    assert sorted(set(built.families)) == sorted({m.family for m in mutations})
    assert built == expected and hash(built) == hash(expected) and repr(built) == repr(expected)
    assert [getattr(built, f.name) for f in dataclasses.fields(built)][:-1] == \
           [getattr(expected, f.name) for f in dataclasses.fields(expected)][:-1]  # all but wire
    assert built.mutations is built.mutations  # decoded once, kept
    assert built.mutation_count == len(mutations) and sorted(set(built.families)) == sorted(
        {m.family for m in mutations})
    assert pickle.loads(pickle.dumps(built)) == expected
    assert pickle.loads(pickle.dumps(encoded_change(mutations))).mutations == mutations  # pickled from its tuples
    copy = dataclasses.replace(encoded_change(mutations), owner=b"x")
    assert copy.mutations == mutations and copy.wire is None  # replace: the tuples, no bytes carried over


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(MUTATIONS)
def test_the_set_columns_are_read_from_the_bytes_without_decoding_the_mutations(mutations):
    """What a backfill's repair intent records of every guarded change: the
    SetCells' columns, the same from the bytes as from the tuples, and reading
    them leaves the mutations undecoded."""
    expected = {(m.family, m.qualifier) for m in mutations if isinstance(m, SetCell)}
    assert set_cell_columns(encode_mutations(mutations)) == expected
    built = encoded_change(mutations)
    assert built.set_columns == expected
    assert type(RowChange.mutations.slot.__get__(built)) is EncodedMutations  # still only bytes
    assert RowChange("t", b"row", mutations).set_columns == expected  # a change built from tuples


def test_a_change_is_still_frozen():
    built = encoded_change((SetCell("f", b"q", b"v", 5),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.mutations = ()
