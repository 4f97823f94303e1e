"""Exact decoding: decode(encode(v)) gives back v itself — the same digits spelled
the same way — over DynamoDB's whole number range (38 significant digits, exponents
-130..+125) and every type. (test_encoding.py compares numbers by value; these do
not, which is what caught json turning 0.0000001 into 1E-7 and float64 decoding
100 as 100.0.)"""
from __future__ import annotations

import struct
from decimal import Decimal

import pytest
from hypothesis import example, given, settings, strategies as st

from ddb2bt.transforms.attrs import (MAX_MAGNITUDE, MIN_MAGNITUDE, canonical_number, check_dynamodb_number)
from ddb2bt.transforms.encoding import decode, encode
from ddb2bt.transforms.errors import MappingError


def dynamodb_decimal(coefficient: int, exponent: int) -> Decimal:
    # Built from its tuple: arithmetic (scaleb, unary minus, abs) would round to
    # the decimal context's 28 digits.
    return Decimal((int(coefficient < 0), tuple(int(c) for c in str(abs(coefficient))), exponent))


# Every number DynamoDB can hold: up to 38 significant digits, magnitude 1E-130 ..
# 9.99…E+125 (and zero), as Decimals; spelled below in DynamoDB's own positional
# form and in exponent forms a user or another tool might write.
dynamodb_numbers = st.one_of(
    st.just(Decimal(0)), st.just(MIN_MAGNITUDE), st.just(MAX_MAGNITUDE), st.just(MAX_MAGNITUDE.copy_negate()),
    st.builds(lambda sign, c, e: dynamodb_decimal(sign * c, e), st.sampled_from((1, -1)),
              st.integers(1, 10**38 - 1), st.integers(-130 - 37, 125)),
).filter(lambda d: d == 0 or MIN_MAGNITUDE <= d.copy_abs() <= MAX_MAGNITUDE)

spellings = st.one_of(
    dynamodb_numbers.map(canonical_number),  # as DynamoDB returns numbers
    dynamodb_numbers.map(str),  # Python's spelling, e.g. 1E-130, 1.2E+5
    dynamodb_numbers.map(lambda d: format(d, "E")),  # 1.000E+2 (trailing zeros kept)
)


@settings(max_examples=600, deadline=None)
@given(spellings)
@example("0.0000001")
@example("1E-130")
@example("0." + "0" * 129 + "1")  # 1E-130 written out
@example("9.9999999999999999999999999999999999999E+125")
@example("123456789012345678901234567890123456")
def test_text_keeping_encodings_give_back_the_very_spelling(text):
    value = {"N": text}
    assert check_dynamodb_number(Decimal(text)) == Decimal(text)
    for encoding in ("decimal", "auto", "dynamodb_json", "json"):
        assert decode(encoding, encode(encoding, value), "N") == value, encoding
    for container in ({"M": {"n": value}}, {"L": [value, {"S": "x"}]}, {"NS": [text]}):
        tag = next(iter(container))
        for encoding in ("json", "dynamodb_json"):
            assert decode(encoding, encode(encoding, container), tag) == container, (encoding, container)


@settings(max_examples=600, deadline=None)
@given(dynamodb_numbers)
@example(Decimal("100"))
@example(Decimal("0.1"))
@example(Decimal("1E-7"))
@example(Decimal("1E-130"))
def test_float64_accepts_exactly_the_shortest_form_of_a_double_and_gives_it_back(number):
    text = canonical_number(number)
    try:
        data = encode("float64", {"N": text})
    except MappingError as exc:
        # refused only when the nearest double does not read back as this number
        assert Decimal(repr(float(number))) != number, exc.message
        return
    assert Decimal(repr(float(number))) == number
    assert data == struct.pack(">d", float(number))
    assert decode("float64", data) == {"N": text}  # DynamoDB's spelling: 100, not 100.0


@settings(max_examples=1000, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False).filter(
    lambda f: f == 0 or 1e-130 <= abs(f) <= 9.9e125))
def test_every_double_in_dynamodb_range_round_trips_through_float64(f):
    text = canonical_number(Decimal(repr(f)))
    assert decode("float64", encode("float64", {"N": text})) == {"N": text}


@pytest.mark.parametrize("text,decoded", [("100", "100"), ("0.1", "0.1"), ("1e-7", "0.0000001"),
                                          ("1.5E+3", "1500"), ("-0", "0"), ("2.50", "2.5")])
def test_float64_decodes_in_dynamodb_spelling(text, decoded):
    assert decode("float64", encode("float64", {"N": text})) == {"N": decoded}


@pytest.mark.parametrize("text", ["0.1000000000000000055", "12345678901234567890123456789012345678", "1E+400"])
def test_float64_refuses_what_no_double_reads_back_as(text):
    with pytest.raises(MappingError, match="is not a float64"):
        encode("float64", {"N": text})


@settings(max_examples=500, deadline=None)
@given(st.integers(-2**63, 2**63 - 1))
def test_int64_gives_back_positional_digits(n):
    assert decode("int64", encode("int64", {"N": str(n)})) == {"N": str(n)}


texts = st.text(max_size=12).filter(lambda s: not any(0xD800 <= ord(c) <= 0xDFFF for c in s))
numbers = spellings.filter(lambda t: canonical_number(Decimal(t)) == t)  # JSON-native, as DynamoDB has them
scalars = st.one_of(texts.map(lambda s: {"S": s}), numbers.map(lambda n: {"N": n}),
                    st.binary(max_size=12).map(lambda b: {"B": b}), st.booleans().map(lambda b: {"BOOL": b}),
                    st.just({"NULL": True}))
sets = st.one_of(
    st.sets(texts, min_size=1, max_size=4).map(lambda s: {"SS": sorted(s)}),
    st.sets(dynamodb_numbers.map(canonical_number), min_size=1, max_size=4).map(
        lambda s: {"NS": sorted(s, key=Decimal)}),
    st.sets(st.binary(max_size=8), min_size=1, max_size=4).map(lambda s: {"BS": sorted(s)}),
)
values = st.recursive(st.one_of(scalars, sets), lambda inner: st.one_of(
    st.lists(inner, max_size=3).map(lambda items: {"L": items}),
    st.dictionaries(texts, inner, max_size=3).map(lambda m: {"M": m})), max_leaves=12)
# What plain JSON can carry without a schema: no sets and no binary inside maps/lists.
json_native = st.recursive(
    st.one_of(texts.map(lambda s: {"S": s}), numbers.map(lambda n: {"N": n}),
              st.booleans().map(lambda b: {"BOOL": b}), st.just({"NULL": True})),
    lambda inner: st.one_of(st.lists(inner, max_size=3).map(lambda items: {"L": items}),
                            st.dictionaries(texts, inner, max_size=3).map(lambda m: {"M": m})), max_leaves=12)


def sorted_sets(value):
    """Sets come back sorted (canonical form); DynamoDB sets have no order."""
    (tag, inner), = value.items()
    if tag == "NS":
        return {tag: sorted(inner, key=lambda t: (Decimal(t), t))}
    if tag in ("SS", "BS"):
        return {tag: sorted(inner)}
    if tag == "M":
        return {"M": {k: sorted_sets(v) for k, v in inner.items()}}
    if tag == "L":
        return {"L": [sorted_sets(v) for v in inner]}
    return value


@settings(max_examples=500, deadline=None)
@given(values)
def test_dynamodb_json_and_auto_give_back_every_type_exactly(value):
    (tag,) = value
    assert decode("dynamodb_json", encode("dynamodb_json", value)) == sorted_sets(value)
    if tag not in ("M", "L"):  # auto stores maps and lists as json: see the next test
        assert decode("auto", encode("auto", value), tag) == sorted_sets(value)


@settings(max_examples=500, deadline=None)
@given(json_native)
def test_json_gives_back_json_native_values_exactly(value):
    (tag,) = value
    assert decode("json", encode("json", value), tag) == value
    assert decode("auto", encode("auto", value), tag) == value


@settings(max_examples=500, deadline=None)
@given(st.one_of(sets, st.binary(max_size=12).map(lambda b: {"B": b})))
def test_json_gives_back_top_level_sets_and_binary_given_the_type(value):
    (tag,) = value
    assert decode("json", encode("json", value), tag) == sorted_sets(value)


@pytest.mark.parametrize("text,reason", [
    ("1" * 39, "39 significant digits"),
    ("1E-131", "magnitude out of DynamoDB's range"),
    ("1E+126", "magnitude out of DynamoDB's range"),
    ("NaN", "not a finite number"),
])
def test_what_dynamodb_would_refuse_is_refused_with_the_reason(text, reason):
    with pytest.raises(MappingError, match=reason) as err:
        check_dynamodb_number(Decimal(text), "Price")
    assert err.value.reason == "bad_number"


def test_38_digits_and_trailing_zeros_are_within_the_limit():
    assert check_dynamodb_number(Decimal("1" * 38 + "000"))  # 38 significant digits, then zeros
    assert check_dynamodb_number(Decimal("0.000" + "9" * 38))
    assert canonical_number(Decimal("1.50")) == "1.5" and canonical_number(Decimal("1E+2")) == "100"
