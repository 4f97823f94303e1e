"""Issue 13's refusals and messages, one test each (the conformance suite in
tests/conformance checks the same through published shapes)."""
from __future__ import annotations

import pytest

from ddb2bt.transforms.config import mapping_from_text
from ddb2bt.transforms.errors import ConfigError, MappingError
from ddb2bt.transforms.lint import lint
from ddb2bt.transforms.mapping import map_change, parse_timestamp_ms
from ddb2bt.transforms.model import INSERT, ChangeRecord

HEAD = "source: {table: Things, key: {partition: id}}\ntarget: {project: p, instance: i, table: t}\n"


# --- plausibility of epoch timestamps ------------------------------------------------

@pytest.mark.parametrize("raw,fmt,message", [
    ("1694359308123", "epoch_seconds",
     "At: 1694359308123 as epoch_seconds is the year ~55,662; it looks like milliseconds (use format: epoch_millis)"),
    ("1694359308", "epoch_millis",
     "At: 1694359308 as epoch_millis is 1970-01-20T14:39:19Z, before 1973-03-03; it looks like seconds "
     "(use format: epoch_seconds)"),
    ("100000000000", "epoch_seconds", "At: 100000000000 as epoch_seconds is the year ~5,138"),
    ("99999999999", "epoch_millis", "At: 99999999999 as epoch_millis is 1973-03-03T09:46:39Z, before 1973-03-03"),
])
def test_an_epoch_value_in_the_other_unit_is_refused_saying_so(raw, fmt, message):
    with pytest.raises(MappingError) as err:
        parse_timestamp_ms({"N": raw}, fmt, "At")
    assert err.value.reason == "timestamp_unit"
    assert err.value.message.startswith(message)


@pytest.mark.parametrize("raw,fmt,ms", [("99999999999", "epoch_seconds", 99_999_999_999_000),
                                        ("100000000000", "epoch_millis", 100_000_000_000),
                                        ("1694359308.5", "epoch_seconds", 1_694_359_308_500)])
def test_values_on_the_right_side_of_the_boundary_are_read(raw, fmt, ms):
    assert parse_timestamp_ms({"N": raw}, fmt, "At") == ms


VERSIONED = mapping_from_text(HEAD + """
families: {c: {max_versions: 100}}
rules:
  - row_key: "{id}"
    columns:
      Body: {column: "c:body", encoding: utf8, timestamp: {attribute: At, format: epoch_seconds}}
""")


def test_a_milliseconds_value_under_epoch_seconds_is_a_dead_letter_and_lint_sample_warns():
    item = {"id": {"S": "1"}, "Body": {"S": "x"}, "At": {"N": "1694359308123"}}
    with pytest.raises(MappingError) as err:
        map_change(VERSIONED, ChangeRecord(INSERT, {"id": {"S": "1"}}, item, None, 1_700_000_000_000))
    assert err.value.reason == "timestamp_unit"
    good = {"id": {"S": "2"}, "Body": {"S": "y"}, "At": {"N": "1694359308"}}
    findings = [f for f in lint(VERSIONED, [item, good]) if f.code == "timestamp_unit"]
    assert len(findings) == 1 and findings[0].level == "WARN"
    assert findings[0].message.startswith("1 of 2 sampled items have a timestamp attribute in the other unit than "
                                          "the column's format (At: 1694359308123 as epoch_seconds is the year")


# --- sets and maps own their family -----------------------------------------------

@pytest.mark.parametrize("columns,other,message", [
    ("Tags: {family: f, as: set}\n      Attrs: {family: f, as: map}", "{mode: ignore}",
     "rules[0].columns.Attrs: family 'f' is used by both the set 'Tags' (as: set) and the map 'Attrs' (as: map)"),
    ("Tags: {family: f, as: set}", "{mode: column, family: f}",
     "rules[0].other_attributes: family 'f' is used by both the set 'Tags' (as: set) and other_attributes"),
    ("Tags: {family: f, as: set}\n      Name: {column: 'f:Name'}", "{mode: ignore}",
     "rules[0].columns.Name: family 'f' is used by both the set 'Tags' (as: set) and the column 'Name' (f:Name)"),
])
def test_set_and_map_families_are_exclusive(columns, other, message):
    body = HEAD + f"""
families: {{f: {{}}, g: {{}}}}
rules:
  - row_key: "{{id}}"
    columns:
      {columns}
    other_attributes: {other}
"""
    with pytest.raises(ConfigError) as err:
        mapping_from_text(body)
    assert str(err.value).startswith(message), str(err.value)


def test_a_set_and_a_map_in_families_of_their_own_validate():
    mapping_from_text(HEAD + """
families: {f: {}, g: {}, h: {}}
rules:
  - row_key: "{id}"
    columns:
      Tags: {family: f, as: set}
      Attrs: {family: g, as: map}
    other_attributes: {mode: column, family: h}
""")
