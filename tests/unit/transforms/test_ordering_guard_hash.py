"""The image hash of the ordering guard's clock (docs/design.md §10.1, §10.3) is
stored in clocks and compared with later changes' hashes, so its input must
never change: each fast path (``ordering._typed_json`` in Python, and
``encoders_c.c`` where built) writes exactly ``attrs.canonical_typed_json``'s
text, or leaves the value to it. Every test here runs with each fast path."""
from __future__ import annotations

import hashlib
import sys
from collections import OrderedDict
from functools import partial

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ddb2bt.transforms.attrs import canonical_typed_json
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms import native, ordering
from ddb2bt.transforms.attrs import dump_str
from ddb2bt.transforms.ordering import HASH_BYTES, _typed_json, image_hash, map_json, typed_map_json_py

texts = st.one_of(st.text(max_size=12), st.sampled_from(['quote"d', "back\\slash", "tab\there", "\x00", "\ud800",
                                                          "é#ü", "\u2028", ""]))
numbers = st.one_of(st.integers(-10**38 + 1, 10**38 - 1).map(str), st.sampled_from(["1.50", "1e3", "-0", "abc"]))
scalars = st.one_of(texts.map(lambda s: {"S": s}), numbers.map(lambda n: {"N": n}),
                    st.binary(max_size=6).map(lambda b: {"B": b}), st.booleans().map(lambda b: {"BOOL": b}),
                    st.just({"NULL": True}))
sets = st.one_of(st.lists(texts, max_size=4).map(lambda x: {"SS": x}),
                 st.lists(st.integers(-999, 999).map(str), max_size=3, unique=True).map(lambda x: {"NS": x}),
                 st.lists(st.binary(max_size=3), max_size=2).map(lambda x: {"BS": x}))
malformed = st.sampled_from([{"S": 1}, {"N": 5}, {}, {"S": "a", "N": "1"}, {"X": "1"}, "plain", {"NULL": False},
                             {"B": "text"}, {"SS": "notalist"}, {"SS": ["a", 1]}, {"M": {1: {"S": "x"}}},
                             {"L": "x"}, {"BOOL": 1}, OrderedDict(S="x")])
values = st.recursive(st.one_of(scalars, sets, malformed), lambda inner: st.one_of(
    st.lists(inner, max_size=3).map(lambda x: {"L": x}),
    st.dictionaries(texts, inner, max_size=4).map(lambda x: {"M": x})), max_leaves=10)
images = st.dictionaries(texts, values, max_size=6)


@pytest.fixture(autouse=True, params=["c", "python"])
def fast_path(request, monkeypatch):
    """Each test with each fast path of ``map_json`` (the C one must be built here)."""
    if request.param == "c":
        assert native.NATIVE_BUILT, "ddb2bt.transforms.rowwriter_c is not built (docs/development.md)"
        fast = partial(native.rowwriter_c.typed_map_json, dump_str)
    else:
        fast = typed_map_json_py
    monkeypatch.setattr(ordering, "_fast_map_json", fast)
    return fast


def reference_hash(image) -> bytes:
    return hashlib.blake2b(canonical_typed_json({"M": dict(image)}).encode("utf-8"), digest_size=HASH_BYTES).digest()


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values)
def test_the_fast_text_is_the_canonical_text_or_nothing(value):
    fast = _typed_json(value)
    if fast is None:
        return
    assert fast == canonical_typed_json(value)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(images)
def test_the_image_hash_is_the_hash_of_the_canonical_text(image):
    try:
        expected = reference_hash(image)
    except (MappingError, UnicodeEncodeError) as exc:  # a bad value; a lone surrogate in a string
        with pytest.raises(type(exc)) as raised:
            image_hash(image)
        assert getattr(raised.value, "reason", None) == getattr(exc, "reason", None)
        return
    assert image_hash(image) == expected


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(images)
def test_the_fast_bytes_are_the_canonical_text_or_nothing(fast_path, image):
    """Each fast path, called directly: the reference's text in UTF-8, the same
    error, or None (then the reference decides). Never another text."""
    try:
        fast = fast_path(image)
    except UnicodeEncodeError:  # a lone surrogate: the text cannot be UTF-8, as str.encode says
        with pytest.raises(UnicodeEncodeError):
            canonical_typed_json({"M": image}).encode("utf-8")
        return
    if fast is not None:
        assert fast == canonical_typed_json({"M": image}).encode("utf-8")


def test_the_fast_paths_refuse_what_the_reference_must_decide(fast_path):
    """Shapes only the reference writes (binary, number sets, subclasses of
    dict or str, a tag that is not a str) give None, never a text."""
    class Text(str):
        pass

    for image in ({"a": {"B": b"x"}}, {"a": {"NS": ["1"]}}, {"a": {"BS": [b"x"]}}, {"a": OrderedDict(S="x")},
                  {Text("a"): {"S": "x"}}, {"a": {"S": Text("x")}}, {"a": {1: "x"}}, {"a": {"SS": [Text("x")]}},
                  {"a": {"M": OrderedDict(b={"S": "x"})}}, {"a": {"L": ({"S": "x"},)}}, {"a": {"NULL": False}},
                  {"a": {"BOOL": 1}}, {"a": {"S": "x", "N": "1"}}):
        assert fast_path(image) is None, image
    assert fast_path(OrderedDict(a={"S": "x"})) is None


def test_nesting_past_dynamodbs_is_left_to_the_reference_and_never_crashes(fast_path):
    """DynamoDB nests maps and lists 32 levels deep at most: the C writes up to
    64 and leaves deeper ones to the reference (None), with a bounded C stack
    whatever Python's recursion limit; the Python fast path recurses as Python
    does. Either way, the answer is the reference's text, or its error."""
    def nested(levels: int) -> dict:
        value = {"S": "x"}
        for i in range(levels):
            value = {"L": [value]} if i % 2 else {"M": {"k": value}}
        return {"a": value}

    shallow = nested(40)
    assert fast_path(shallow) == canonical_typed_json({"M": shallow}).encode("utf-8")
    deep = nested(sys.getrecursionlimit() + 100)
    try:
        assert fast_path(deep) is None
    except RecursionError:
        assert fast_path is typed_map_json_py
    with pytest.raises(RecursionError):
        map_json(deep)
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(200_000)
    try:  # in a process with a raised limit the C must not overflow its stack (the Python path is not called here)
        if fast_path is not typed_map_json_py:
            assert fast_path(nested(100_000)) is None
    finally:
        sys.setrecursionlimit(old)


def test_the_clock_qualifier_is_the_key_s_canonical_text(fast_path):
    keys = {"sk": {"N": "7"}, "pk": {"S": "caf\u00e9 \"x\""}}
    assert map_json(keys) == canonical_typed_json({"M": keys}).encode("utf-8")
    assert map_json({"pk": {"B": b"\x00"}}) == canonical_typed_json({"M": {"pk": {"B": b"\x00"}}}).encode("utf-8")


def test_the_fast_path_takes_a_decoded_image_whole():
    """The images of a stream record (S, N, BOOL, NULL, SS, M, L): no fallback."""
    image = {"pk": {"S": "hats"}, "Price": {"N": "12.50"}, "Active": {"BOOL": True}, "Gone": {"NULL": True},
             "Colors": {"SS": ["red", "blue"]}, "Formats": {"M": {"480": {"S": "u"}, "1080": {"L": [{"N": "1"}]}}}}
    assert _typed_json({"M": image}) == canonical_typed_json({"M": image})
    assert ordering._fast_map_json(image) == canonical_typed_json({"M": image}).encode("utf-8")
    assert image_hash(image) == reference_hash(image)


def test_a_clock_is_written_byte_for_byte_as_before():
    """Clocks already in Bigtable hold image hashes, cell digests and a token
    this version must reproduce: a different digest would rewrite every cell
    once, a different image hash would misorder two changes of one timestamp.
    The value below was written by the guard before its fast paths."""
    from ddb2bt.transforms.attrs import from_plain
    from ddb2bt.transforms.config import load_mapping
    from ddb2bt.transforms.model import INSERT, ChangeRecord
    from ddb2bt.transforms.ordering import CLOCK_FAMILY, guarded_rows, row_mutations

    catalog = load_mapping("examples/product_catalog.yaml")
    keys = {"pk": from_plain("hats"), "sk": from_plain("b")}
    image = {**keys, "Price": from_plain(12), "Description": from_plain('a "quoted" d\u00e9scription'),
             "Color": {"SS": ["red", "blue"]}}
    (row,) = guarded_rows(catalog, ChangeRecord(INSERT, keys, image, None, 1_700_000_000_123,
                                                change_us=1_700_000_000_123_456))
    (clock,) = [m.value for m in row_mutations(row, None) if m.family == CLOCK_FAMILY and hasattr(m, "value")]
    assert clock == (b'3:2358b7af33c7bc2758a8bf781cc3ce10:1700000000123456:d9d1c04552558ee1:'
                     b'[["SKU","436f6c6f72",null,"476a1dabb57ca383"],["SKU","4465736372697074696f6e",null,'
                     b'"27e9b96c36a2c03c"],["SKU","5072696365",null,"86ebd9802be6a521"]]')


def test_the_c_holds_what_it_walks_while_python_code_runs():
    """``dump_str`` is Python code: one that drops the list or map being walked
    (another thread could) must not make the C read freed memory; it writes
    the list or map as it was when the walk began."""
    assert native.NATIVE_BUILT, "ddb2bt.transforms.rowwriter_c is not built (docs/development.md)"
    for kind in ("L", "M"):
        image = {"a": {"L": [{"S": 'drop"'}, {"S": "b"}, {"S": "c"}]}} if kind == "L" else \
            {"a": {"M": {'drop"': {"S": "v"}, "b": {"S": "v"}, "c": {"S": "v"}}}}
        expected = canonical_typed_json({"M": image}).encode("utf-8")

        def dropping_dump_str(text: str) -> str:
            if text == 'drop"':  # the container being walked loses its last other reference
                image["a"][kind] = [] if kind == "L" else {"b": {"S": "HIJACK"}, "c": {"S": "HIJACK"}}
            return dump_str(text)

        assert native.rowwriter_c.typed_map_json(dropping_dump_str, image) == expected, kind
