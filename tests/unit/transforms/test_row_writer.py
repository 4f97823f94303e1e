"""The compiled mapping's generated row writers (transforms.rowwriter): the code
written for an image's shape gives the general engine's changes, byte for byte,
whatever the values of that shape hold later — other types than the image it
was made for, lengths on both sides of every varint boundary, values the
inline cases do not take (the encoder decides) or cannot encode (the general
engine decides)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ddb2bt.transforms.compiled import compile_mapping
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.mapping import backfill_record
from ddb2bt.transforms.model import INSERT, MODIFY, ChangeRecord
from ddb2bt.transforms.wire import VARINT_TABLE_SIZE

from tests.unit.transforms.test_compiled_mapping import check

ROOT = Path(__file__).resolve().parents[3]
START_MS = 1_700_000_000_000
KEYS = {"pk": {"S": "hats"}, "sk": {"S": "fedora"}}
# A length on each side of a varint's one- and two-byte ends, and of the inline
# encoding's table (VARINT_TABLE_SIZE: longer values go through transforms.wire).
LENGTHS = (0, 1, 100, 127, 128, 129, VARINT_TABLE_SIZE - 40, VARINT_TABLE_SIZE, VARINT_TABLE_SIZE + 5)

# Values of every kind the inline cases take or hand over, each tried in every slot.
TRICKY = [{"S": "x" * n} for n in LENGTHS] + [{"S": "é☃"}, {"S": "\ud800"}, {"S": 5}, {"S": "a", "N": "1"}] + [
    {"N": n} for n in ("0", "12", "9" * 18, "9" * 19, "1.5", "007", "-3", "1e5", "\u0661\u0662", "1.2.3", ".5", "5.",
                       "1.50", " 1", "")] + [
    {"BOOL": True}, {"BOOL": False}, {"BOOL": 1}, {"SS": ["b", "a"]}, {"SS": ["é", 'q"', "\\", "\n"]},
    {"SS": []}, {"SS": ["a", 1]}, {"SS": "ab"}, {"NS": ["2", "1"]}, {"NULL": True}, {"B": b"\x00"}, {"L": []}, {}]
_texts = st.one_of(st.sampled_from(LENGTHS).map(lambda n: "x" * n), st.text(max_size=40))
_numbers = st.one_of(st.integers(0, 10**18).map(str), st.sampled_from(["0", "9" * 18, "9" * 19, "1.5", "007", "-3",
                                                                       "1e5", "١٢", "1.2.3", ".5", "5."]))
# What an attribute of a plain column may hold: the inline cases and the rest.
_values = st.one_of(
    _texts.map(lambda t: {"S": t}),
    _numbers.map(lambda n: {"N": n}),
    st.booleans().map(lambda b: {"BOOL": b}),
    st.lists(st.text(max_size=5), min_size=1, max_size=3, unique=True).map(lambda s: {"SS": s}),
    st.just({"NULL": True}),
    st.just({"B": b"\x00\x01"}),
    st.just({"S": "\ud800"}),  # a lone surrogate: no UTF-8 for it
    st.just({"S": "a", "N": "1"}),  # two tags: not an attribute value
    st.just({"S": 5}),
)
# product_catalog: Description and Thumbnail utf8, Price int64, the rest auto.
NAMES = ("Description", "Price", "Thumbnail", "Stock", "Brand", "Rating", "Active")


def _image(values: list) -> dict:
    return dict(KEYS, **dict(zip(NAMES, values)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=st.lists(_values, min_size=len(NAMES), max_size=len(NAMES)),
       then=st.lists(st.lists(_values, min_size=len(NAMES), max_size=len(NAMES)), min_size=1, max_size=4),
       backfill=st.booleans())
def test_a_shapes_writer_gives_the_general_engines_changes_for_any_values_of_that_shape(first, then, backfill):
    """The writer is made for the first image of a shape (its auto values' tags
    tried first) and used for the next ones of the same shape, whatever they hold."""
    mapping = load_mapping(ROOT / "examples" / "product_catalog.yaml")  # a fresh one: no writer yet
    images = [_image(first)] + [_image(values) for values in then]
    for n, image in enumerate(images):
        if backfill:
            record = backfill_record(KEYS, image, START_MS)
        else:
            record = ChangeRecord(INSERT, KEYS, image, None, START_MS + n) if n == 0 else \
                ChangeRecord(MODIFY, KEYS, image, images[n - 1], START_MS + n)
        check(mapping, record, False)


BASE = ({"S": "d"}, {"N": "12"}, {"S": "t"}, {"N": "3"}, {"S": "b"}, {"N": "4.5"}, {"BOOL": True})


@pytest.mark.parametrize("slot", NAMES)
def test_every_kind_of_value_in_every_slot_gives_the_general_engines_changes(slot):
    """A writer made for the usual image, then each tricky value in ``slot``
    (inserted, and as a modify of the usual image), then the usual image again."""
    mapping = load_mapping(ROOT / "examples" / "product_catalog.yaml")
    base = _image(list(BASE))
    assert check(mapping, ChangeRecord(INSERT, KEYS, base, None, START_MS), False)
    assert check(mapping, ChangeRecord(MODIFY, KEYS, base, base, START_MS + 1), False)
    for n, value in enumerate(TRICKY):
        image = dict(base, **{slot: value})
        check(mapping, ChangeRecord(INSERT, KEYS, image, None, START_MS + n), False)
        check(mapping, ChangeRecord(MODIFY, KEYS, image, base, START_MS + n), False)
        check(mapping, backfill_record(KEYS, image, START_MS + n), False)
    assert check(mapping, ChangeRecord(MODIFY, KEYS, base, base, START_MS + 1), False)


def test_writers_are_made_once_per_shape_and_lengths_and_reused():
    """One writer per (shape, timestamp field length, range length, pruning): an
    insert (no pruning) and a modify (pruning) of one shape make two, and later
    changes of that shape reuse them; a timestamp of another varint length makes
    its own."""
    mapping = load_mapping(ROOT / "examples" / "product_catalog.yaml")
    compiled = compile_mapping(mapping)
    image = _image([{"S": "d"}, {"N": "12"}, {"S": "t"}, {"N": "3"}, {"S": "b"}, {"N": "4.5"}, {"BOOL": True}])
    for n in range(3):
        assert check(mapping, ChangeRecord(INSERT, KEYS, image, None, START_MS + n), False)
        assert check(mapping, ChangeRecord(MODIFY, KEYS, image, image, START_MS + n), False)
    rule = compiled._rules[0]
    writers = rule.plain_order(image).writers
    assert len(writers) == 2 and {key[2] for key in writers} == {False, True}
    assert check(mapping, ChangeRecord(INSERT, KEYS, image, None, 5), False)  # a 1-byte timestamp varint
    assert len(writers) == 3


def test_past_the_shape_cache_and_the_writer_budget_images_take_the_cell_loop(monkeypatch):
    """A sparse table's many shapes: once the shapes kept or the writers made
    reach their bounds, further images are written by the compiled cell loop —
    the same changes — and nothing more is generated or kept."""
    from ddb2bt.transforms import compiled as compiled_module

    monkeypatch.setattr(compiled_module, "_MAX_SHAPES", 3)
    mapping = load_mapping(ROOT / "examples" / "product_catalog.yaml")
    compiled = compile_mapping(mapping)
    compiled._writers_left = 2
    rule = compiled._rules[0]
    images = [_image(list(BASE)[:n]) for n in range(1, len(NAMES) + 1)]  # seven shapes
    for n, image in enumerate(images * 2):
        assert check(mapping, ChangeRecord(INSERT, KEYS, image, None, START_MS + n), False)
        assert check(mapping, ChangeRecord(MODIFY, KEYS, image, image, START_MS + n), False)
    assert len(rule._shapes) == 3 and compiled._writers_left == 0
    assert sum(len(order.writers) for order in rule._shapes.values() if order is not None) == 2
    assert rule.plain_order(images[-1]) is None  # not kept: no writer for it either
