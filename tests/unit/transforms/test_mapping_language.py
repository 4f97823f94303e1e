"""Column kinds, timestamps, TTL, hooks, and their validation."""

import pytest

from ddb2bt.transforms.config import mapping_from_text
from ddb2bt.transforms.errors import ConfigError, MappingError
from ddb2bt.transforms.mapping import map_change
from ddb2bt.transforms.model import INSERT, MODIFY, REMOVE, ChangeRecord, DeleteCells, SetCell
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable

TS = 1_700_000_000_000
HEAD = """
source: {table: Things, key: {partition: id}}
target: {project: p, instance: i, table: t}
"""


def mapping(body):
    return mapping_from_text(HEAD + body)


def rec(event, new=None, old=None, ts=TS, ttl=False, **kw):
    keys = {"id": {"S": "1"}}
    return ChangeRecord(event, keys, dict(keys, **new) if new is not None else None,
                        dict(keys, **old) if old is not None else None, ts, is_ttl_delete=ttl)


def apply(m, *records):
    bt = InMemoryBigtable()
    for r in records:
        for ch in map_change(m, r):
            bt.mutate_rows(ch.table, [(ch.row_key, ch.mutations)])
    return bt


SETS = mapping("""
families: {tags: {}, attrs: {}, h: {}, d: {}}
rules:
  - row_key: "{id}"
    columns:
      Tags: {family: tags, as: set, marker: zero}
      Attrs: {family: attrs, as: map, encoding: utf8}
      History: {column: "h:History", as: list_versions, encoding: utf8}
    item_column: {column: "d:item", encoding: json, include_keys: false}
    other_attributes: {mode: ignore}
""")


def test_set_members_become_qualifiers_and_removed_members_are_deleted():
    bt = apply(SETS, rec(INSERT, {"Tags": {"SS": ["red", "blue"]}}),
               rec(MODIFY, {"Tags": {"SS": ["blue", "green"]}}, {"Tags": {"SS": ["red", "blue"]}}, ts=TS + 1000))
    row = bt.latest("t")[b"1"]
    assert {q for (f, q) in row if f == "tags"} == {b"blue", b"green"}
    assert row[("tags", b"blue")] == b"\x00"


def test_map_keys_become_qualifiers():
    bt = apply(SETS, rec(INSERT, {"Attrs": {"M": {"color": {"S": "red"}, "size": {"S": "L"}}}}))
    row = bt.latest("t")[b"1"]
    assert row[("attrs", b"color")] == b"red" and row[("attrs", b"size")] == b"L"


def test_list_versions_are_timestamp_ordered_cells_and_a_rewrite_replaces_them():
    first = {"History": {"L": [{"S": "a"}, {"S": "b"}, {"S": "c"}]}}
    second = {"History": {"L": [{"S": "d"}]}}
    bt = apply(SETS, rec(INSERT, first), rec(MODIFY, second, first, ts=TS + 1))
    versions = bt.versions("t")[b"1"][("h", b"History")]
    assert versions == {TS + 1: b"d"}
    bt = apply(SETS, rec(INSERT, first))
    versions = bt.versions("t")[b"1"][("h", b"History")]
    assert [versions[t] for t in sorted(versions)] == [b"a", b"b", b"c"] and max(versions) == TS


def test_whole_item_serialized_into_one_column():
    bt = apply(SETS, rec(INSERT, {"Other": {"N": "5"}, "Tags": {"SS": ["x"]}}))
    assert bt.latest("t")[b"1"][("d", b"item")] == b'{"Other":5,"Tags":["x"]}'


VERSIONED = mapping("""
families: {c: {max_versions: 1000}}
rules:
  - row_key: "{id}"
    columns:
      Body: {column: "c:body", encoding: utf8, timestamp: {attribute: At, format: epoch_seconds}}
""")


def test_versioned_cells_use_the_attribute_and_deletes_remove_exactly_that_version():
    (ch,) = map_change(VERSIONED, rec(INSERT, {"Body": {"S": "x"}, "At": {"N": "1694359308.5"}}))
    assert ch.mutations == (SetCell("c", b"body", b"x", 1694359308500),)
    (ch,) = map_change(VERSIONED, rec(REMOVE, old={"Body": {"S": "x"}, "At": {"N": "1694359308.5"}}))
    assert ch.mutations == (DeleteCells("c", b"body", 1694359308500, 1694359308501),)


@pytest.mark.parametrize("value,fmt,expected", [
    ({"S": "2023-09-10T15:21:48Z"}, "iso8601", 1694359308000),
    ({"S": "2023-09-10T15:21:48.123456+00:00"}, "iso8601", 1694359308123),
    ({"S": "2023-09-10T17:21:48+02:00"}, "iso8601", 1694359308000),
    ({"N": "1694359308123"}, "epoch_millis", 1694359308123),
    ({"N": "1694359308"}, "epoch_seconds", 1694359308000),
])
def test_timestamp_formats_round_down_to_whole_milliseconds(value, fmt, expected):
    from ddb2bt.transforms.mapping import parse_timestamp_ms
    assert parse_timestamp_ms(value, fmt, "At") == expected


def test_bad_or_missing_timestamp_is_a_dead_letter():
    with pytest.raises(MappingError) as err:
        map_change(VERSIONED, rec(INSERT, {"Body": {"S": "x"}, "At": {"S": "yesterday"}}))
    assert err.value.reason == "timestamp"
    with pytest.raises(MappingError) as err:
        map_change(VERSIONED, rec(INSERT, {"Body": {"S": "x"}}))
    assert err.value.reason == "timestamp"


def test_ttl_deletions_ignored_or_applied_per_mapping():
    body = """
families: {f: {max_age_seconds: 86400}}
ttl: {attribute: Expires, deletions: %s}
rules:
  - row_key: "{id}"
    other_attributes: {mode: column, family: f}
"""
    old = {"A": {"S": "x"}, "Expires": {"N": "1"}}
    assert map_change(mapping(body % "ignore"), rec(REMOVE, old=old, ttl=True)) == ()
    assert map_change(mapping(body % "ignore"), rec(REMOVE, old=old, ttl=False)) != ()
    assert map_change(mapping(body % "apply"), rec(REMOVE, old=old, ttl=True)) != ()


HOOKED = mapping("""
families: {n: {}}
rules:
  - hook: "tests.hooks.sample_hooks:split_name"
""")


def test_hook_produces_cells_and_the_engine_keeps_the_contract():
    (ch,) = map_change(HOOKED, rec(INSERT, {"Name": {"S": "Ada King Lovelace"}}))
    assert ch.table == "people" and ch.row_key == b"person#1"
    assert SetCell("n", b"part2", b"Lovelace", TS) in ch.mutations
    (ch,) = map_change(HOOKED, rec(MODIFY, {"Name": {"S": "Ada"}}, {"Name": {"S": "Ada King"}}, ts=TS + 5))
    assert SetCell("n", b"part0", b"Ada", TS + 5) in ch.mutations
    assert DeleteCells("n", b"part0", 0, TS + 5) in ch.mutations  # older versions pruned
    assert DeleteCells("n", b"part1", 0, TS + 6) in ch.mutations  # no longer produced


@pytest.mark.parametrize("hook,reason", [("broken", "hook_error"), ("bad_shape", "hook_error")])
def test_hook_failures_are_dead_letters(hook, reason):
    m = mapping(f"""
families: {{n: {{}}}}
rules:
  - hook: "tests.hooks.sample_hooks:{hook}"
""")
    with pytest.raises(MappingError) as err:
        map_change(m, rec(INSERT, {"Name": {"S": "x"}}))
    assert err.value.reason == reason


@pytest.mark.parametrize("body,message", [
    ("families: {f: {}}\nrules:\n  - hook: 'nosuchmodule:f'", "rules[0].hook: cannot import 'nosuchmodule'"),
    ("families: {f: {}}\nrules:\n  - hook: 'tests.hooks.sample_hooks:nope'",
     "rules[0].hook: 'tests.hooks.sample_hooks' has no function 'nope'"),
    ("families: {f: {}}\nrules:\n  - hook: 'nocolon'", "rules[0].hook: must be 'module:function'"),
    ("families: {f: {}}\nrules:\n  - row_key: '{id}'\n    columns: {A: {column: 'f:a', as: set}}",
     "rules[0].columns.A.family: is required"),
    ("families: {f: {}}\nrules:\n  - row_key: '{id}'\n    columns: {A: {family: f, as: map, column: 'f:a'}}",
     "rules[0].columns.A.column: a map fills a whole family"),
    ("families: {f: {}}\nrules:\n  - row_key: '{id}'\n    columns: {A: {column: 'f:a', marker: zero}}",
     "rules[0].columns.A.marker: only a set"),
    ("families: {f: {}}\nrules:\n  - row_key: '{id}'\n    columns: {A: {column: 'f:a', timestamp: {attribute: T, format: unix}}}",
     "rules[0].columns.A.timestamp.format: must be one of iso8601"),
    ("families: {f: {}}\nrules:\n  - row_key: '{id}'\n    indexes: [{name: i, row_key: 'x#{A}', family: f, project: [A]}]",
     "rules[0].indexes[0].row_key: must include the item's key ({id} missing)"),
    ("families: {f: {}}\nrules:\n  - row_key: '{id}'\n    indexes: [{name: i, row_key: 'x#{A}#{id}', family: g, project: [A]}]",
     "rules[0].indexes[0].family: family 'g' is not declared"),
    ("families: {f: {max_versions: 1, gc: intersection}}\nrules:\n  - row_key: '{id}'",
     "families.f.gc: gc: intersection needs both"),
    ("families: {f: {}}\nttl: {attribute: E, deletions: maybe}\nrules:\n  - row_key: '{id}'",
     "ttl.deletions: must be one of apply, ignore"),
    ("families: {f: {}}\nrules:\n  - row_key: '{id}'\n    item_column: {column: 'f:{id}'}",
     "rules[0].item_column.column: the item column's qualifier must be a literal"),
    ("families: {f: {}}\nrules:\n  - row_key: '{id|salt:1}'", "rules[0].row_key: salt needs a bucket count"),
])
def test_invalid_language_features_fail_naming_the_field(body, message):
    with pytest.raises(ConfigError) as err:
        mapping(body)
    assert str(err.value).startswith(message), str(err.value)


def test_table_families_include_index_tables():
    m = mapping("""
families: {f: {max_versions: 2, max_age_seconds: 60}}
rules:
  - row_key: "{id}"
    other_attributes: {mode: ignore}
    indexes: [{name: by_a, table: t_idx, row_key: "{A}#{id}", family: i, match: {attribute: A, present: true}}]
""")
    fams = m.table_families()
    # no touch-marker family: the cutover adds it for a backfill and drops it at the finish
    assert [f.name for f in fams["t"]] == ["f"]
    assert [f.name for f in fams["t_idx"]] == ["i"]
    assert m.tables == ("t", "t_idx")


def test_a_map_sharing_its_family_with_a_column_is_a_validate_error():
    # Changed on purpose (issue 13): this used to validate and then dead-letter every
    # item whose map had a key "x" (column_collision); now validate refuses it.
    with pytest.raises(ConfigError) as err:
        mapping("""
families: {f: {}}
rules:
  - row_key: "{id}"
    columns:
      A: {column: "f:x"}
      M: {family: f, as: map}
""")
    assert str(err.value) == ("rules[0].columns.M: family 'f' is used by both the column 'A' (f:x) and the map 'M' "
                              "(as: map); the map 'M' (as: map) fills its family with qualifiers from the data, so "
                              "it needs a family of its own")


def test_two_claims_on_one_cell_at_run_time_are_still_a_dead_letter():
    m = mapping("""
families: {f: {}}
rules:
  - row_key: "{id}"
    columns:
      A: {column: "f:B"}
    other_attributes: {mode: column, family: f}
""")
    with pytest.raises(MappingError) as err:
        map_change(m, rec(INSERT, {"A": {"S": "1"}, "B": {"S": "2"}}))
    assert err.value.reason == "column_collision"
