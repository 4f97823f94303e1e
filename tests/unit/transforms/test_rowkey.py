import pytest
from hypothesis import given, settings, strategies as st

from ddb2bt.transforms.errors import ConfigError, MappingError
from ddb2bt.transforms.rowkey import build_key, escape, parse_template, split_key


def key(template, delimiter="#", **attrs):
    t = parse_template(template, delimiter, "row_key")
    return build_key(t, {}, {k: (v if isinstance(v, dict) else {"S": v}) for k, v in attrs.items()})


def test_seed_example_1_row_key_is_unescaped_in_the_last_part():
    assert key("{pk}#{sk}", pk="hats", sk="fedoras#brandA") == b"hats#fedoras#brandA"


def test_delimiter_inside_an_earlier_part_is_escaped():
    assert key("{pk}#{sk}", pk="a#b", sk="c") == b"a\\#b#c"
    assert key("{pk}#{sk}", pk="a\\", sk="c") == b"a\\\\#c"
    assert key("{pk}#{sk}", pk="a", sk="b#c") != key("{pk}#{sk}", pk="a#b", sk="c")


@pytest.mark.parametrize("template,attrs,expected", [
    ("{id|pad:6}", {"id": {"N": "42"}}, b"000042"),
    ("{id|reverse}", {"id": "12345"}, b"54321"),
    ("{d|reverse_domain}", {"d": "com.google.drive"}, b"drive.google.com"),
    ("{ts|max_minus}", {"ts": {"N": "0"}}, b"9223372036854775807"),
    ("{ts|max_minus}", {"ts": {"N": "9223372036854775807"}}, b"0000000000000000000"),
    ("{pk|strip_prefix:Invoice-}", {"pk": "Invoice-0123"}, b"0123"),
    ("tenant#{t}#{id}", {"t": "acme", "id": "7"}, b"tenant#acme#7"),
    ("{b|hex}#x", {"b": {"B": b"\x00\xff"}}, b"00ff#x"),
    ("{b}", {"b": {"B": b"\x00#\xff"}}, b"\x00#\xff"),
])
def test_transforms(template, attrs, expected):
    assert key(template, **attrs) == expected


@pytest.mark.parametrize("template,attrs,reason", [
    ("{id|pad:3}", {"id": {"N": "1234"}}, "row_key"),
    ("{id|pad:3}", {"id": {"N": "-1"}}, "row_key"),
    ("{id|pad:3}", {"id": {"N": "1.5"}}, "row_key"),
    ("{pk|strip_prefix:X-}", {"pk": "Y-1"}, "row_key"),
    ("{missing}", {"pk": "x"}, "missing_key_attribute"),
    ("{m}", {"m": {"M": {}}}, "row_key"),
])
def test_key_part_errors_are_dead_letter_reasons(template, attrs, reason):
    with pytest.raises(MappingError) as err:
        key(template, **attrs)
    assert err.value.reason == reason


@pytest.mark.parametrize("template,fragment", [
    ("{a}{b}", "must be separated by the delimiter"),
    ("{a}-{b}", "must contain the delimiter"),
    ("{a|nope}", "unknown key transform 'nope'"),
    ("{a|pad}", "needs an argument"),
    ("{a|pad:x}", "pad needs a digit count"),
    ("{a|reverse:1}", "takes no argument"),
    ("{}", "empty placeholder"),
    ("{a", "unbalanced braces"),
    ("", "non-empty template"),
])
def test_bad_templates_fail_fast_naming_the_field(template, fragment):
    with pytest.raises(ConfigError) as err:
        parse_template(template, "#", "rules[0].row_key")
    assert fragment in str(err.value)
    assert str(err.value).startswith("rules[0].row_key")


parts = st.text(alphabet=st.sampled_from("ab#\\/:é"), max_size=6)


@settings(max_examples=2000, deadline=None)
@given(parts, parts, parts, parts)
def test_row_keys_are_injective(a1, b1, a2, b2):
    t = parse_template("{a}#{b}", "#", "row_key")
    k1 = build_key(t, {"a": {"S": a1}, "b": {"S": b1}}, None)
    k2 = build_key(t, {"a": {"S": a2}, "b": {"S": b2}}, None)
    assert (k1 == k2) == ((a1, b1) == (a2, b2))
    assert split_key(t, k1) == [a1.encode(), b1.encode()]


@settings(max_examples=1000, deadline=None)
@given(parts, parts, parts)
def test_three_part_keys_split_back(a, b, c):
    t = parse_template("x#{a}#lit#{b}#{c}", "#", "row_key")
    k = build_key(t, {"a": {"S": a}, "b": {"S": b}, "c": {"S": c}}, None)
    assert split_key(t, k) == [a.encode(), b.encode(), c.encode()]


def test_escape_is_reversible_by_construction():
    assert escape(b"a#b\\c", b"#") == b"a\\#b\\\\c"
