"""The compiled mapping's row writers (transforms.rowwriter), the C one
(rowwriter_c.c) and the generated Python, each: the writer made for an image's
shape gives the general engine's changes, byte for byte, whatever the values of
that shape hold later — other types than the image it was made for, lengths on
both sides of every varint boundary, values the inline cases do not take (the
encoder decides) or cannot encode (the general engine decides). And the two
writers give each other's answers, errors included, and the C one keeps no
memory it was given."""
from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ddb2bt.transforms import compiled as compiled_module, rowwriter
from ddb2bt.transforms.compiled import FAST_ENCODERS, compile_mapping
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


@pytest.fixture(params=["c", "python"])
def each_writer(request, monkeypatch) -> str:
    """Every test of this module with each writer making the rows (rowwriter.NATIVE)."""
    monkeypatch.setattr(rowwriter, "NATIVE", request.param == "c")
    return request.param


def _image(values: list) -> dict:
    return dict(KEYS, **dict(zip(NAMES, values)))


@pytest.mark.usefixtures("each_writer")
@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
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


@pytest.mark.usefixtures("each_writer")
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


@pytest.mark.usefixtures("each_writer")
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


@pytest.mark.usefixtures("each_writer")
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


def test_the_c_writer_is_built_and_chosen_by_default():
    """deploy/local/setup.sh builds it (pyproject.toml's ext-modules): a machine
    whose install could not compile it spends ~8 µs more CPU a change, and must hear of
    it here rather than in a benchmark."""
    assert rowwriter.NATIVE_BUILT, ("ddb2bt.transforms.rowwriter_c is not built: install a C compiler and the "
                                    "Python headers (apt-get install build-essential python3-dev), then run "
                                    "deploy/local/setup.sh again")
    code = "from ddb2bt.transforms import rowwriter; print(rowwriter.NATIVE)"
    env = {k: v for k, v in os.environ.items() if k != rowwriter.ROW_WRITER_ENV}
    chosen = [subprocess.run([sys.executable, "-c", code], env=dict(env, **extra), capture_output=True, text=True,
                             check=True).stdout.strip() for extra in ({}, {rowwriter.ROW_WRITER_ENV: "python"})]
    assert chosen == ["True", "False"]


def _failing(value) -> bytes:
    """An encoder that refuses some values, as a real one refuses what it cannot encode."""
    if value == {"S": "refuse"}:
        raise ValueError("refused")
    return FAST_ENCODERS["json"](value)


# Every encoder a plain column may have beside the inline ones (the C writer
# calls them), and one that raises.
_ENCODERS = [FAST_ENCODERS[name] for name in ("utf8", "int64", "auto", "decimal", "json")] + [_failing]


def _answer(write, image, row_len, ts_field, prune_range):
    """A writer's answer with its wire pieces joined (all the mapping does with
    them), or the class of the error it raised."""
    try:
        count, size, pieces, families = write(image, row_len, ts_field, prune_range)
    except Exception as exc:  # noqa: BLE001 — the class is what is compared
        return type(exc)
    return count, size, b"".join(pieces), families


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(columns=st.lists(st.tuples(st.sampled_from(range(len(_ENCODERS))), st.sampled_from(["SKU", "f", "x" * 200]),
                                  st.binary(max_size=3).map(lambda q: b"q" + q)),
                        min_size=1, max_size=8, unique_by=lambda c: (c[1], c[2])),
       values=st.lists(st.one_of(_values, st.just({"S": "refuse"})), min_size=8, max_size=8),
       drop=st.booleans(), prune=st.booleans(), ms=st.sampled_from([0, 5, 16, START_MS]))
def test_the_c_writer_gives_the_generated_writers_answer(columns, values, drop, prune, ms):
    """Any shape — every encoder, families and qualifiers of any length — and any
    values: the same count, size, bytes and families, or the same error (a value
    no encoder takes; an attribute missing from the image)."""
    from ddb2bt.transforms.wire import range_field, timestamp_field

    compiled = compile_mapping(load_mapping(ROOT / "examples" / "product_catalog.yaml"))
    columns = sorted(columns, key=lambda c: (c[1], c[2]))  # plain_order's order: by (family, qualifier)
    plain = tuple((f"a{n}", _ENCODERS[enc], family, qualifier, (family, qualifier))
                  for n, (enc, family, qualifier) in enumerate(columns))
    image = {f"a{n}": values[n] for n in range(len(plain))}
    if drop:
        image.pop(f"a{len(plain) - 1}")
    ts_field, prune_range = timestamp_field(ms), range_field(0, ms) if prune else None
    range_len = len(prune_range) if prune else 0
    made = [rowwriter.plain_row_writer(plain, compiled._column, len(ts_field), range_len, prune,
                                       compiled_module._INLINE, image, native=native) for native in (True, False)]
    assert type(made[0]).__name__ == "RowWriter"
    answers = [_answer(write, image, 11, ts_field, prune_range) for write in made]
    assert answers[0] == answers[1]


def test_the_c_writer_keeps_no_memory_per_row():
    """Rows written, encoders refused and attributes missing, many times over: the
    memory Python allocated stays where it was (a reference kept per call would
    grow it by the row's bytes each time)."""
    compiled = compile_mapping(load_mapping(ROOT / "examples" / "product_catalog.yaml"))
    plain = tuple((name, encode, "SKU", name.encode(), ("SKU", name.encode()))
                  for name, encode in (("a", FAST_ENCODERS["auto"]), ("b", _failing), ("c", FAST_ENCODERS["utf8"])))
    write = rowwriter.plain_row_writer(plain, compiled._column, 8, 12, True, compiled_module._INLINE, {}, native=True)
    images = [{"a": {"SS": ["x", "y"]}, "b": {"S": "ok" * 50}, "c": {"S": "z" * 300}},
              {"a": {"SS": ["é" * 40, "q\"", "\\"]}, "b": {"N": "7"}, "c": {"S": "é"}},
              {"a": {"N": "1.5"}, "b": {"S": "refuse"}, "c": {"S": "z"}},
              {"a": {"BOOL": True}, "b": {"N": "7"}}]
    ts_field, prune_range = b"\x18" + bytes(7), b"\x1a" + bytes(11)

    def run(times: int) -> None:
        for _ in range(times):
            for image in images:
                _answer(write, image, 5, ts_field, prune_range)

    from ddb2bt.transforms.attrs import dump_str
    from ddb2bt.transforms.encoding import FALSE_BYTE, TRUE_BYTE

    # What every row shares (tracemalloc cannot see a reference kept to them):
    # their counts stay put.
    shared = [write, dump_str, TRUE_BYTE, FALSE_BYTE, _failing, FAST_ENCODERS["auto"], *images,
              *[value for image in images for value in image.values()]]
    run(200)
    counts = [sys.getrefcount(obj) for obj in shared]
    run(300)
    assert [sys.getrefcount(obj) for obj in shared] == counts
    tracemalloc.start()
    try:
        run(100)
        before = tracemalloc.get_traced_memory()[0]
        run(5000)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, grown  # 15,000 rows of ~1 KB: a leak per call would be megabytes


@pytest.mark.parametrize("native, built, level, says", [
    (True, True, "DEBUG", "C row writer"),
    (False, True, "INFO", "DDB2BT_ROW_WRITER=python"),
    (False, False, "WARNING", "not built"),
])
def test_the_mapping_stage_says_once_which_writer_runs(monkeypatch, caplog, native, built, level, says):
    from ddb2bt.transforms import dofns

    monkeypatch.setattr(dofns, "NATIVE", native)
    monkeypatch.setattr(dofns, "NATIVE_BUILT", built)
    monkeypatch.setattr(dofns, "_TOLD", [])
    with caplog.at_level("DEBUG", logger=dofns.__name__):
        dofns._say_row_writer()
        dofns._say_row_writer()
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == dofns.__name__]
    assert len(said) == 1 and said[0][0] == level and says in said[0][1], said


def test_a_row_of_more_columns_than_the_c_writer_keeps_on_its_stack_is_written_alike():
    """Past STACK_COLUMNS (64) the C writer keeps the row's values on the heap:
    the same answer as the generated Python, rows written and refused."""
    from ddb2bt.transforms.wire import range_field, timestamp_field

    compiled = compile_mapping(load_mapping(ROOT / "examples" / "product_catalog.yaml"))
    encoders = [FAST_ENCODERS["auto"], FAST_ENCODERS["utf8"], _failing]
    plain = tuple((f"a{n:03d}", encoders[n % 3], "SKU", f"q{n:03d}".encode(), ("SKU", f"q{n:03d}".encode()))
                  for n in range(70))
    image = {name: {"S": f"v{n}"} for n, (name, *_) in enumerate(plain)}
    refused = dict(image, a002={"S": "refuse"})
    ts_field, prune_range = timestamp_field(START_MS), range_field(0, START_MS)
    for prune in (False, True):
        made = [rowwriter.plain_row_writer(plain, compiled._column, len(ts_field), len(prune_range), prune,
                                           compiled_module._INLINE, image, native=native) for native in (True, False)]
        for values in (image, refused):
            answers = [_answer(write, values, 9, ts_field, prune_range) for write in made]
            assert answers[0] == answers[1]
        assert _answer(made[0], refused, 9, ts_field, prune_range) is ValueError
        assert len(_answer(made[0], image, 9, ts_field, prune_range)[2]) > 70 * 10
