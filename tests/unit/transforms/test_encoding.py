import json
import struct
from decimal import Decimal

import pytest
from hypothesis import given, settings, strategies as st

from ddb2bt.transforms.attrs import canonical_json, canonical_typed_json, from_dynamodb_json, to_dynamodb_json
from ddb2bt.transforms.encoding import ENCODINGS, decode, encode
from ddb2bt.transforms.errors import MappingError


@pytest.mark.parametrize("encoding,value,expected", [
    ("utf8", {"S": "café 日本"}, "café 日本".encode()),
    ("int64", {"N": "30"}, struct.pack(">q", 30)),
    ("int64", {"N": "-1"}, b"\xff" * 8),
    ("int64", {"N": "9223372036854775807"}, b"\x7f" + b"\xff" * 7),
    ("int64", {"N": "3.0"}, struct.pack(">q", 3)),
    ("decimal", {"N": "12.50"}, b"12.50"),
    ("float64", {"N": "0.1"}, struct.pack(">d", 0.1)),
    ("bytes", {"B": b"\x00\xff"}, b"\x00\xff"),
    ("bool", {"BOOL": True}, b"\x01"),
    ("bool", {"BOOL": False}, b"\x00"),
    ("null", {"NULL": True}, b""),
    ("json", {"M": {"b": {"N": "1.50"}, "a": {"L": [{"S": "x"}, {"NULL": True}, {"BOOL": False}]}}},
     b'{"a":["x",null,false],"b":1.50}'),
    ("json", {"SS": ["b", "a"]}, b'["a","b"]'),
    ("json", {"NS": ["10", "9", "-1"]}, b"[-1,9,10]"),
    ("json", {"B": b"\x01\x02"}, b'"AQI="'),
    ("dynamodb_json", {"N": "30"}, b'{"N":"30"}'),
    ("auto", {"S": "x"}, b"x"),
    ("auto", {"N": "30"}, b"30"),
    ("auto", {"SS": ["z", "y"]}, b'["y","z"]'),
])
def test_encode_exact_bytes(encoding, value, expected):
    assert encode(encoding, value) == expected


@pytest.mark.parametrize("encoding,value,fragment", [
    ("int64", {"N": "30.5"}, "not an integer"),
    ("int64", {"N": "9223372036854775808"}, "does not fit in 64 bits"),
    ("int64", {"S": "30"}, "needs N, got S"),
    ("utf8", {"N": "1"}, "needs S, got N"),
    ("float64", {"N": "0.12345678901234567890123"}, "is not a float64: the nearest double reads back as"),
    ("bytes", {"S": "x"}, "needs B"),
    ("bool", {"N": "1"}, "needs BOOL"),
    ("decimal", {"N": "abc"}, "not a number"),
    ("utf8", {"S": "\ud800"}, "not valid Unicode"),
    ("auto", {"XX": 1}, "unknown DynamoDB type"),
])
def test_value_that_does_not_fit_is_a_mapping_error(encoding, value, fragment):
    with pytest.raises(MappingError) as err:
        encode(encoding, value, where="Price")
    assert fragment in err.value.message
    assert err.value.reason in ("encoding", "bad_attribute")


def test_json_numbers_keep_dynamodb_digits_and_fix_invalid_spelling():
    assert canonical_json({"N": "1.50"}) == "1.50"
    assert canonical_json({"N": ".5"}) == "0.5"
    assert canonical_json({"N": "1E+2"}) == "1E+2"
    tiny = "-0.000000000000000000000000000000000001"
    assert canonical_json({"N": tiny}) == tiny  # valid JSON already: verbatim
    assert canonical_json({"N": "+5"}) == "5"


# --- property tests: every DynamoDB type round-trips ---------------------------------

numbers = st.decimals(allow_nan=False, allow_infinity=False, places=None).filter(
    lambda d: d.is_finite() and len(d.as_tuple().digits) <= 38 and -130 < d.adjusted() < 125
).map(lambda d: str(d))
texts = st.text(max_size=20)
binaries = st.binary(max_size=20)
scalars = st.one_of(
    texts.map(lambda s: {"S": s}), numbers.map(lambda n: {"N": n}), binaries.map(lambda b: {"B": b}),
    st.booleans().map(lambda b: {"BOOL": b}), st.just({"NULL": True}),
)
sets = st.one_of(
    st.sets(texts, min_size=1, max_size=5).map(lambda s: {"SS": sorted(s)}),
    st.sets(st.integers(-10**37, 10**37), min_size=1, max_size=5).map(lambda s: {"NS": sorted(str(n) for n in s)}),
    st.sets(binaries, min_size=1, max_size=5).map(lambda s: {"BS": sorted(s)}),
)
values = st.recursive(
    st.one_of(scalars, sets),
    lambda inner: st.one_of(st.lists(inner, max_size=4).map(lambda l: {"L": l}),
                            st.dictionaries(texts, inner, max_size=4).map(lambda m: {"M": m})),
    max_leaves=20,
)
valid_unicode = texts.filter(lambda s: not any(0xD800 <= ord(c) <= 0xDFFF for c in s))


def _normalise(v):
    """Value equality as DynamoDB sees it (numbers by value, sets unordered)."""
    (tag, inner), = v.items()
    if tag == "N":
        return ("N", Decimal(inner))
    if tag in ("SS", "BS"):
        return (tag, tuple(sorted(inner)))
    if tag == "NS":
        return (tag, tuple(sorted(Decimal(n) for n in inner)))
    if tag == "M":
        return ("M", tuple(sorted((k, _normalise(x)) for k, x in inner.items())))
    if tag == "L":
        return ("L", tuple(_normalise(x) for x in inner))
    return (tag, inner)


def _no_surrogates(v) -> bool:
    return "\\ud" not in canonical_typed_json(v).encode("utf-8", "backslashreplace").decode("ascii", "ignore").lower()


@pytest.mark.slow
@settings(max_examples=1000, deadline=None)
@given(values)
def test_dynamodb_json_round_trips_every_type(value):
    try:
        data = encode("dynamodb_json", value)
    except MappingError:
        return  # lone surrogates cannot be UTF-8; checked separately
    assert _normalise(decode("dynamodb_json", data)) == _normalise(value)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None)
@given(values)
def test_auto_round_trips_given_the_type(value):
    (tag,) = value
    try:
        data = encode("auto", value)
    except MappingError:
        return
    assert _normalise(decode("auto", data, tag)) == _normalise(value) or tag in ("M", "L")


@settings(max_examples=500, deadline=None)
@given(st.integers(-2**63, 2**63 - 1))
def test_int64_round_trip_and_order_of_non_negative(n):
    data = encode("int64", {"N": str(n)})
    assert decode("int64", data) == {"N": str(n)}
    assert len(data) == 8


@settings(max_examples=500, deadline=None)
@given(values)
def test_dynamodb_json_text_round_trip(value):
    assert _normalise(from_dynamodb_json(to_dynamodb_json(value))) == _normalise(value)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(valid_unicode, st.one_of(scalars, sets), max_size=5))
def test_canonical_json_is_independent_of_key_order(d):
    forward = canonical_json({"M": d})
    backward = canonical_json({"M": dict(reversed(list(d.items())))})
    assert forward == backward
    assert " " not in forward.replace('" "', "").split('"')[0]  # no whitespace outside strings at the start


def test_every_encoding_is_documented_and_decodable():
    samples = {"utf8": {"S": "x"}, "int64": {"N": "1"}, "decimal": {"N": "1.5"}, "float64": {"N": "1.5"},
               "bytes": {"B": b"x"}, "bool": {"BOOL": True}, "null": {"NULL": True},
               "json": {"M": {"a": {"N": "1"}}}, "dynamodb_json": {"S": "x"}, "auto": {"S": "x"}}
    assert set(samples) == set(ENCODINGS)
    for enc, value in samples.items():
        tag = next(iter(value))
        assert _normalise(decode(enc, encode(enc, value), tag)) == _normalise(value), enc


@given(st.text())
@settings(max_examples=2000)
def test_the_fast_string_quoting_is_exactly_json_dumps(text):
    from ddb2bt.transforms.attrs import dump_str

    assert dump_str(text) == json.dumps(text, ensure_ascii=False)


def _item_from_json_value_by_value(item):
    """item_from_dynamodb_json as it was: every value through from_dynamodb_json."""
    return {name: from_dynamodb_json(v) for name, v in item.items()}


_not_values = st.sampled_from([{"S": "a", "N": "1"}, {}, {"X": "y"}, "text", 5, None, {"B": "not base64!"}])


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(valid_unicode, st.one_of(values.map(to_dynamodb_json), _not_values), max_size=6))
def test_an_item_from_dynamodb_json_is_its_values_converted_one_by_one(item):
    """item_from_dynamodb_json's shortcut (an item of values spelled alike in
    both forms is copied as it is) gives what converting each value gives, and
    refuses what it refuses, with the same error."""
    from ddb2bt.transforms.attrs import item_from_dynamodb_json

    try:
        expected = _item_from_json_value_by_value(item)
    except Exception as exc:  # noqa: BLE001 — whatever it is, the shortcut must raise it too
        with pytest.raises(type(exc)) as raised:
            item_from_dynamodb_json(item)
        assert str(raised.value) == str(exc)
        return
    got = item_from_dynamodb_json(item)
    assert got == expected and got is not item
    assert all(type(got[name]) is type(expected[name]) for name in item)


def test_auto_tells_a_null_from_an_empty_string_on_every_encoding_path():
    """auto writes NULL as the byte 0xFF (never UTF-8, digits or JSON) and an
    empty string as nothing: the plain encoder, the compiled mapping and the
    verify path (expected_cells) agree, and both read back exactly."""
    from ddb2bt.transforms.encoding import AUTO_NULL, decode, encode
    from ddb2bt.transforms.config import parse_mapping
    from ddb2bt.transforms.mapping import expected_cells

    assert encode("auto", {"NULL": True}) == AUTO_NULL != encode("auto", {"S": ""}) == b""
    assert decode("auto", AUTO_NULL) == {"NULL": True}  # without the type too
    assert decode("auto", AUTO_NULL, "NULL") == decode("auto", b"", "NULL") == {"NULL": True}  # older cells
    assert decode("auto", b"", "S") == {"S": ""}
    assert encode("null", {"NULL": True}) == b""  # a declared NULL column keeps its empty value
    mapping = parse_mapping({"version": 1, "name": "t", "source": {"table": "Things", "key": {"partition": "pk"}},
                             "target": {"project": "p", "instance": "i", "table": "things"},
                             "families": {"d": {}}, "rules": [{"name": "all", "row_key": "{pk}",
                                                              "other_attributes": {"mode": "column", "family": "d"}}]})
    cells = expected_cells(mapping, {"pk": {"S": "a"}, "gone": {"NULL": True}, "blank": {"S": ""}})
    by_qualifier = {c.qualifier: c.value for c in cells.values()}
    assert by_qualifier[b"gone"] == AUTO_NULL and by_qualifier[b"blank"] == b""
