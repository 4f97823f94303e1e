"""Differential tests: the compiled mapping (``compiled.compile_mapping``, what
``map_change`` runs) against the general engine (``general_map_change``, the
reference), over random items and random histories — INSERT/MODIFY/REMOVE with
old and new images, TTL deletes, backfill records, touch markers on and off —
with every example mapping, and a mapping using the rest of the language.

Two properties: whatever the compiled path returns by itself is exactly the
general engine's result (RowChanges, mutations and their types in order, sizes,
guards, versions) and carries, as each change's ``wire``, exactly the bytes the
protobuf library serializes for the general engine's mutations; and ``map_change`` as a whole (the compiled path plus its hand-
over to the general engine) gives the same results and the same dead letters
(reason, class and message). Random values include malformed and oversized ones
and missing key attributes, so the dead-letter paths are covered too.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from ddb2bt.transforms.compiled import compile_mapping, compiled_owned_cells
from ddb2bt.transforms.config import load_mapping, mapping_from_text, parse_mapping
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.limits import MAX_QUALIFIER_BYTES, MAX_ROW_KEY_BYTES
from ddb2bt.transforms.mapping import backfill_record, general_map_change, map_change, owned_cells, select_rule
from ddb2bt.transforms.model import INSERT, MODIFY, REMOVE, ChangeRecord, DeleteCells, SetCell
from ddb2bt.transforms.ordering import guarded_rows
from ddb2bt.pipeline.clients.bigtable.wire import build_mutations, mutate_rows_types

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ("product_catalog", "videos", "invoices", "hr_orders")
START_MS = 1_700_000_000_000
REQUEST_CLS = mutate_rows_types()[0]

LANGUAGE = mapping_from_text("""
source: {table: Things, key: {partition: pk, sort: sk}}
target: {project: p, instance: i, table: t}
families: {tags: {}, attrs: {}, h: {}, d: {}, e: {}, v: {}, o: {}}
unmatched: skip
rules:
  - name: skipped
    match: {attribute: sk, equals: skip}
    skip: true
  - name: hooked
    match: {attribute: sk, prefix: "hook"}
    hook: "tests.hooks.sample_hooks:split_name"
  - name: kinds
    match: [{attribute: sk, regex: "k(?P<n>[0-9])?"}, {attribute: Flag, present: false}]
    row_key: "{pk|reverse}#{sk}"
    include_key_attributes: true
    columns:
      Tags: {family: tags, as: set, marker: zero}
      Attrs: {family: attrs, as: map, encoding: utf8}
      History: {column: "h:History", as: list_versions, encoding: utf8}
      Seen: {column: "e:Seen", encoding: int64, timestamp: {attribute: At, format: epoch_millis}}
      Sec: {column: "e:{match.n}", encoding: float64, timestamp: {attribute: AtS, format: epoch_seconds}}
    item_column: {column: "d:item", encoding: dynamodb_json, include_keys: false}
    other_attributes: {mode: ignore}
  - name: flagged
    match: {attribute: sk, prefix: "k"}
    row_key: "{pk|reverse}#{sk}"
    columns:
      Flag: {column: "v:Flag", encoding: bool}
    other_attributes: {mode: column, family: o}
  - name: numbers
    match: [{attribute: N, equals: 7}, {attribute: B, equals: true}]
    row_key: "n#{pk|pad:6}#{sk|max_minus}"
    other_attributes: {mode: column, family: o, encoding: json}
  - name: templated
    match: {attribute: sk, prefix: "s"}
    row_key: "{pk}#{sk}"
    columns:
      Value: {column: "v:{Q}", encoding: utf8}
""")


def _ttl_variant(name: str):
    data = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    data["ttl"] = {"attribute": "Expires", "deletions": "ignore"}
    data["name"] = f"{name}_ttl_ignored"
    return parse_mapping(data, origin=f"{name}+ttl")


MAPPINGS = {name: load_mapping(ROOT / "examples" / f"{name}.yaml") for name in EXAMPLES}
MAPPINGS.update({f"{name}+ttl": _ttl_variant(name) for name in EXAMPLES})
MAPPINGS["language"] = LANGUAGE

# Key values that reach every rule of the mappings (and none).
PKS = ["hats", "0123", "Invoice-0001", "HR-EMPLOYEE#0001", "OE-ORDER#O1", "OE-PRODUCT#P1", "OE-CUSTOMER#C1",
       "HR-REGION#R1", "a#b\\c", "Invoice-", "12", "-3"]
SKS = ["hats#fedoras#brandA", "Video", "VideoStatsLikes", "VideoStatsViews", "VideoStats", "VideoComment#1",
       "Invoice-0001", "Payment-0680", "Payment-", "HR-EMPLOYEE#0001", "JH#2021-03-01", "OE-ORDER#O1", "ITEM#P1",
       "OE-PRODUCT#P1", "WAREHOUSE#W1", "OE-CUSTOMER#C1", "skip", "hook1", "k", "k5", "s1", "17"]
NAMES = ["Description", "Price", "Thumbnail", "Stock", "Color", "Formats", "UploadDate", "Count", "ViewCount",
         "Content", "CreatedAt", "Details", "DateCreated", "Name", "HireDate", "Warehouse", "JobTitle", "Job",
         "CustomerID", "OrderStatus", "OrderDate", "Total", "Line", "Quantity", "AccountRep", "Expires", "Tags",
         "Attrs", "History", "Seen", "At", "AtS", "Sec", "Flag", "N", "B", "Value", "Q", "first", "last",
         "pk", "sk", "SKU", "a" * (MAX_QUALIFIER_BYTES + 1)]

texts = st.one_of(st.sampled_from(["", "x", "OPEN", "W1", "2023-09-10T15:21:00", "2023-09-10T15:21:00+02:00",
                                   "1700000000000", "a#b", "back\\slash", "quote\"d", "\ud800", "é#ü",
                                   "x" * (MAX_ROW_KEY_BYTES + 1)]),
                  st.text(max_size=12))
numbers = st.one_of(st.sampled_from(["0", "7", "-3", "1.5", "1e3", "1E+2", "9223372036854775807",
                                     "9223372036854775808", "0.1", "1700000000000", "1700000000", "abc", "NaN",
                                     "1e400", " 12", "1_000", "007"]),
                    st.integers(-10**20, 10**20).map(str))
scalars = st.one_of(
    texts.map(lambda s: {"S": s}),
    numbers.map(lambda n: {"N": n}),
    st.binary(max_size=6).map(lambda b: {"B": b}),
    st.booleans().map(lambda b: {"BOOL": b}),
    st.just({"NULL": True}),
)
malformed = st.sampled_from([{"S": 1}, {"N": 5}, {}, {"S": "a", "N": "1"}, {"X": "1"}, "plain", {"NULL": False},
                             {"B": "text"}, {"SS": "notalist"}, {"M": {1: {"S": "x"}}}, {"L": "x"},
                             {"S": "x" * (17 * 1024)}])
values = st.recursive(
    st.one_of(scalars, st.lists(texts, max_size=3).map(lambda x: {"SS": x}),
              st.lists(numbers, max_size=3).map(lambda x: {"NS": x}),
              st.lists(st.binary(max_size=3), max_size=2).map(lambda x: {"BS": x})),
    lambda inner: st.one_of(st.lists(inner, max_size=3).map(lambda x: {"L": x}),
                            st.dictionaries(st.sampled_from(["480", "720", "a", "title", "x y"]), inner,
                                            max_size=3).map(lambda x: {"M": x})),
    max_leaves=6)
attribute_values = st.one_of(values, values, values, malformed)


# Per mapping, the key values that reach its rules (drawn more often than the rest).
RULE_KEYS = {
    "product_catalog": (["hats", "a#b\\c"], ["hats#fedoras#brandA", "x"]),
    "videos": (["0123", "a#b\\c"], ["Video", "VideoStatsLikes", "VideoStatsViews", "VideoStats", "VideoComment#1"]),
    "invoices": (["Invoice-0001", "Invoice-"], ["Invoice-0001", "Payment-0680", "Payment-"]),
    "hr_orders": (["HR-EMPLOYEE#0001", "OE-ORDER#O1", "OE-PRODUCT#P1", "OE-CUSTOMER#C1", "HR-REGION#R1"],
                  ["HR-EMPLOYEE#0001", "JH#2021-03-01", "OE-ORDER#O1", "ITEM#P1", "OE-PRODUCT#P1", "WAREHOUSE#W1",
                   "OE-CUSTOMER#C1", "R1"]),
    "language": (["12", "a#b\\c", "-3"], ["skip", "hook1", "k", "k5", "s1", "17"]),
}


@st.composite
def keys_strategy(draw, name):
    pks, sks = RULE_KEYS[name.split("+")[0]]
    pk = draw(st.one_of(st.sampled_from(pks), st.sampled_from(pks), st.sampled_from(PKS)))
    sk = draw(st.one_of(st.sampled_from(sks), st.sampled_from(sks), st.sampled_from(SKS)))
    keys = {"pk": {"S": pk}, "sk": {"S": sk}}
    if draw(st.integers(0, 19)) == 0:
        del keys[draw(st.sampled_from(["pk", "sk"]))]  # a missing key attribute
    elif draw(st.integers(0, 19)) == 0:
        keys["pk"] = draw(attribute_values)
    return keys


def hr_keys(keys: dict) -> dict:
    """hr_orders names its key PK/SK."""
    return {k.upper(): v for k, v in keys.items()}


PLAUSIBLE = st.sampled_from([
    {"S": "2023-09-10T15:21:00"}, {"S": "2023-09-11T00:00:01Z"}, {"S": "1969-12-31T23:59:59.999"},
    {"S": "OPEN"}, {"S": "W1"}, {"S": "Clerk"},
    {"N": "7"}, {"N": "42"}, {"N": "1700000000000"}, {"N": "1700000000"}, {"N": "2.5"}, {"BOOL": True},
    {"M": {"480": {"S": "u"}, "720": {"S": "v"}}}, {"M": {"Amount": {"N": "10"}, "Note": {"S": "n"}}},
    {"SS": ["red", "blue"]}, {"L": [{"S": "a"}, {"S": "b"}]}, {"S": "\ud800"},
])
EXTRAS = ["Extra", "a" * (MAX_QUALIFIER_BYTES + 1)]  # unlisted attributes: a column, ignored or a dead letter


def vocabulary(mapping, keys) -> list:
    """The attribute names the rule an item with these keys selects mentions (so
    that valid items are common), else every name."""
    try:
        rule, _ = select_rule(mapping, keys, keys)
    except MappingError:
        rule = None
    if rule is None or rule.skip or rule.hook:
        return NAMES
    names = {c.attribute for c in rule.columns} | set(rule.consumed) | {c.attribute for c in rule.conditions}
    for c in rule.columns:
        if c.timestamp is not None:
            names.add(c.timestamp.attribute)
    for index in rule.indexes:
        names |= set(index.row_key.sources) | set(index.project) | {c.attribute for c in index.conditions}
    return sorted(names) * 4 + EXTRAS


@st.composite
def images(draw, mapping, keys):
    item = dict(keys)
    for name in draw(st.lists(st.sampled_from(vocabulary(mapping, keys)), max_size=6, unique=True)):
        item[name] = draw(st.one_of(PLAUSIBLE, attribute_values))
    return item


def protobuf_mutations(mutations) -> bytes:
    """The Entry.mutations fields of ``mutations`` as the protobuf library writes
    them: an Entry without a row key serializes as exactly those fields."""
    request = REQUEST_CLS()
    build_mutations(request.entries.add().mutations, mutations)
    return request.entries[0].SerializeToString()


def _mutations_of(reference):
    """(table, row key, mutations) of a canonical 'ok' outcome, as model tuples."""
    kinds = {"SetCell": SetCell, "DeleteCells": DeleteCells}
    return [(table, row, tuple(kinds[kind](*fields) for kind, fields in muts))
            for table, row, muts, *_ in reference[1]]


def canon(result):
    return [(c.table, c.row_key, tuple((type(m).__name__, tuple(m)) for m in c.mutations), c.guard, c.size_bytes,
             c.versioned, c.owner) for c in result]


def outcome(fn, *args):
    try:
        return "ok", canon(fn(*args))
    except MappingError as exc:
        return "dead letter", type(exc).__name__, exc.reason, exc.message
    except Exception as exc:  # the general engine's other failures must be the same too
        return "error", type(exc).__name__, str(exc)


def check(mapping, record, mark_touched):
    """The compiled path alone equals the reference when it answers; map_change
    (compiled, handing over what it does not take) always does."""
    reference = outcome(general_map_change, mapping, record, mark_touched)
    compiled = compile_mapping(mapping)
    try:
        alone = compiled._map(record, mark_touched)
    except Exception:  # noqa: BLE001 — handed to the general engine: covered by the second property
        alone = None
    if alone is not None:
        # What the sink reads of every change without decoding its mutations
        # (model.EncodedMutations): read first, before canon() decodes them.
        facts = [(c.mutation_count, sorted(c.families), len(set(c.families)), c.set_column_order) for c in alone]
        assert ("ok", canon(alone)) == reference, record
        assert facts == [(len(m), sorted({x.family for x in m}), len({x.family for x in m}),
                          tuple(sorted({(x.family, x.qualifier) for x in m if isinstance(x, SetCell)})))
                         for *_, m in _mutations_of(reference)], record
        # What goes on the wire: the compiled bytes are the protobuf library's
        # serialization of the general engine's mutations (reference[1]: its changes).
        assert [c.wire for c in alone] == [protobuf_mutations(m) for *_, m in _mutations_of(reference)], record
    assert outcome(map_change, mapping, record, mark_touched) == reference, record
    return alone is not None


def cells_outcome(fn, mapping, keys, image, with_values):
    try:
        return "ok", sorted(fn(mapping, keys, image, with_values).items(), key=repr)
    except MappingError as exc:
        return "dead letter", type(exc).__name__, exc.reason, exc.message
    except Exception as exc:  # the general engine's other failures must be the same too
        return "error", type(exc).__name__, str(exc)


def check_owned(mapping, keys, images) -> None:
    """The ordering guard's cells (``compiled_owned_cells``) are the general
    engine's (``owned_cells``): the same OwnedCells, or the same error."""
    for image in images:
        for with_values in (True, False):
            assert (cells_outcome(compiled_owned_cells, mapping, keys, image, with_values)
                    == cells_outcome(owned_cells, mapping, keys, image, with_values)), (image, with_values)


def _keys_for(name, keys):
    return hr_keys(keys) if name.startswith("hr_orders") else keys


@pytest.mark.parametrize("name", sorted(MAPPINGS))
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_compiled_equals_general_for_random_changes(name, data):
    mapping = MAPPINGS[name]
    keys = _keys_for(name, data.draw(keys_strategy(name), label="keys"))
    new = data.draw(images(mapping, keys), label="new")
    old = data.draw(images(mapping, keys), label="old")
    event = data.draw(st.sampled_from([INSERT, MODIFY, REMOVE]), label="event")
    how = data.draw(st.sampled_from(["unrelated", "changed", "fewer"]), label="old image")
    if how == "changed" and new:  # the common MODIFY: a value or two differ
        old = dict(new)
        for attr in data.draw(st.lists(st.sampled_from(sorted(new)), max_size=2), label="changed"):
            old[attr] = data.draw(st.one_of(PLAUSIBLE, attribute_values), label="old value")
    elif how == "fewer" and new:  # the new image added attributes
        dropped = data.draw(st.lists(st.sampled_from(sorted(new)), max_size=3), label="added")
        old = {k: v for k, v in new.items() if k not in dropped}
    ts = data.draw(st.sampled_from([START_MS, 0, 1, 2, -1, 2**62]), label="change time")
    record = ChangeRecord(event, keys, None if event == REMOVE else new, None if event == INSERT else old, ts,
                          is_ttl_delete=event == REMOVE and data.draw(st.booleans(), label="ttl"))
    check(mapping, record, data.draw(st.booleans(), label="mark touched"))
    check_owned(mapping, keys, (new, old))
    backfill = backfill_record(keys, new, START_MS + data.draw(st.integers(0, 1999), label="handoff"))
    check(mapping, backfill, data.draw(st.booleans(), label="mark backfill"))


@pytest.mark.parametrize("name", sorted(MAPPINGS))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_compiled_equals_general_over_random_histories(name, data):
    """A table's history: each change's old image is the item as it was."""
    mapping = MAPPINGS[name]
    items: dict = {}
    now = START_MS
    key_pool = data.draw(st.lists(keys_strategy(name), min_size=1, max_size=3), label="items")
    for _ in range(data.draw(st.integers(1, 12), label="changes")):
        keys = _keys_for(name, data.draw(st.sampled_from(key_pool), label="key"))
        k = repr(sorted(keys.items()))
        now += data.draw(st.sampled_from([0, 1, 1000]), label="advance")
        old = items.get(k)
        if old is not None and data.draw(st.integers(0, 3), label="op") == 0:
            del items[k]
            record = ChangeRecord(REMOVE, keys, None, old, now, is_ttl_delete=data.draw(st.booleans(), label="ttl"))
        else:
            if old is not None and data.draw(st.booleans(), label="small change"):
                new = dict(old)
                for attr in data.draw(st.lists(st.sampled_from(vocabulary(mapping, keys)), max_size=2), label="set"):
                    new[attr] = data.draw(st.one_of(PLAUSIBLE, attribute_values), label="value")
                if old:
                    new.pop(data.draw(st.sampled_from(sorted(old)), label="removed"), None)
            else:
                new = data.draw(images(mapping, keys), label="item")
            items[k] = new
            record = ChangeRecord(MODIFY if old is not None else INSERT, keys, new, old, now)
        check(mapping, record, data.draw(st.booleans(), label="mark touched"))
        check_owned(mapping, keys, (record.new_image, record.old_image))
        if record.new_image is not None and data.draw(st.booleans(), label="backfill"):
            check(mapping, backfill_record(keys, record.new_image, now - data.draw(st.integers(0, 5000))), False)


sys.path.insert(0, str(ROOT / "bench"))


@pytest.mark.parametrize("name", EXAMPLES)
def test_realistic_streams_are_mapped_by_the_compiled_path_alone(name):
    """The bench's realistic histories (bench/mapping_cpu.py): every record,
    stream or backfill, marked or not, is mapped by the compiled code itself —
    none is handed over — and exactly as the general engine maps it. With a
    millisecond per change (a Kinesis record's times) and with whole seconds
    (DynamoDB Streams' on AWS: many changes share one)."""
    from mapping_cpu import backfill, history

    mapping = load_mapping(ROOT / "examples" / f"{name}.yaml")
    records = history(name, 600, whole_seconds=False) + history(name, 600, seed=2)
    for mark in (False, True):
        for record in records + backfill(records):
            assert check(mapping, record, mark), record
    assert compile_mapping(mapping).fallbacks == 0
    for record in records:  # the ordering guard's cells of both images: from the compiled rules alone
        check_owned(mapping, record.keys, (record.new_image, record.old_image))
        assert guarded_rows(mapping, record) == guarded_rows(mapping, record, owned_cells), record
        for image in (record.new_image, record.old_image):
            if image is not None:
                compile_mapping(mapping)._image_cells(record.keys, image, True)  # raises where it hands over


def test_a_record_the_compiled_path_does_not_take_is_handed_over_and_counted():
    mapping = load_mapping(ROOT / "examples" / "product_catalog.yaml")
    compiled = compile_mapping(mapping)
    keys = {"pk": {"S": "hats"}, "sk": {"S": "x"}}
    record = ChangeRecord(INSERT, keys, dict(keys, Price={"N": "1.5"}), None, START_MS)  # int64 refuses 1.5
    with pytest.raises(MappingError):
        compiled._map(record, False)
    before = compiled.fallbacks
    with pytest.raises(MappingError) as exc:
        map_change(mapping, record)
    assert exc.value.reason == "encoding" and compiled.fallbacks == before + 1


def test_an_old_image_of_another_rule_for_the_same_row_has_its_cells_deleted():
    """A MODIFY that moves an item to another rule writing the same row: the old
    rule's cells are deleted (no shortcut may skip them), by the compiled path."""
    keys = {"pk": {"S": "12"}, "sk": {"S": "k5"}}
    old = dict(keys, Extra={"S": "x"})  # rule kinds: keys included, the item column
    new = dict(old, Flag={"BOOL": True})  # rule flagged: same row key
    record = ChangeRecord(MODIFY, keys, new, old, START_MS)
    assert check(LANGUAGE, record, False)
    deleted = {m.qualifier for c in map_change(LANGUAGE, record) for m in c.mutations if m.family == "d"}
    assert deleted == {b"item"}


CATALOG_KEYS = {"pk": {"S": "hats"}, "sk": {"S": "fedora"}}
CATALOG_ITEM = dict(CATALOG_KEYS, Price={"N": "12"}, Brand={"S": "a"}, Active={"BOOL": True})


@pytest.mark.parametrize("record", [
    ChangeRecord(INSERT, CATALOG_KEYS, CATALOG_ITEM, None, START_MS),
    ChangeRecord(MODIFY, CATALOG_KEYS, dict(CATALOG_ITEM, Price={"N": "13"}), CATALOG_ITEM, START_MS),
    ChangeRecord(MODIFY, CATALOG_KEYS, CATALOG_ITEM, dict(CATALOG_ITEM, Gone={"S": "x"}), START_MS),  # old owns more
    ChangeRecord(MODIFY, CATALOG_KEYS, dict(CATALOG_KEYS), CATALOG_ITEM, START_MS),  # nothing but keys: no cells
    ChangeRecord(INSERT, CATALOG_KEYS, dict(CATALOG_ITEM, Thumbnail={"S": "t"}, **{"Brand ": {"S": "b"}}), None, 0),
    backfill_record(CATALOG_KEYS, CATALOG_ITEM, START_MS),
], ids=["insert", "modify", "modify-old-owns-more", "keys-only", "insert-at-epoch", "backfill"])
@pytest.mark.parametrize("mark", [False, True])
def test_images_of_plain_columns_are_written_straight_from_their_attributes(record, mark):
    """An image whose every attribute is a plain column (or not placed) is
    written from its attributes in (family, qualifier) order, without the cell
    keys (_CompiledRule.plain_order): what the general engine writes, the first
    time its shape is seen and after."""
    mapping = load_mapping(ROOT / "examples" / "product_catalog.yaml")
    rule = compile_mapping(mapping)._rules[0]
    assert rule.plain_order(CATALOG_ITEM) is not None
    assert [cell[0] for cell in rule.plain_order(CATALOG_ITEM)] == ["Active", "Brand", "Price"]
    assert rule.plain_order(dict(CATALOG_KEYS)) is None  # no cells: the general loop's (empty) answer
    for _ in range(2):
        assert check(mapping, record, mark), record


KINDS_KEYS = {"pk": {"S": "12"}, "sk": {"S": "k5"}}
KINDS_ITEM = dict(KINDS_KEYS, History={"L": [{"S": "a"}, {"S": "b"}]}, Tags={"SS": ["x", "y"]},
                  Attrs={"M": {"a": {"S": "b"}}}, At={"N": "1700000000000"}, Seen={"N": "3"},
                  AtS={"N": "1700000000"}, Sec={"N": "2.5"})
KINDS_CHANGED = dict(KINDS_ITEM, History={"L": []}, Tags={"SS": ["y"]}, At={"N": "1700000000001"})


@pytest.mark.parametrize("record", [
    ChangeRecord(INSERT, KINDS_KEYS, KINDS_ITEM, None, START_MS),
    ChangeRecord(MODIFY, KINDS_KEYS, KINDS_CHANGED, KINDS_ITEM, START_MS),
    ChangeRecord(MODIFY, KINDS_KEYS, KINDS_ITEM, KINDS_CHANGED, 3),
    ChangeRecord(REMOVE, KINDS_KEYS, None, KINDS_ITEM, START_MS),
    backfill_record(KINDS_KEYS, KINDS_ITEM, START_MS),
], ids=["insert", "modify", "modify-near-epoch", "remove", "backfill"])
@pytest.mark.parametrize("mark", [False, True])
def test_sets_maps_lists_item_columns_and_epoch_timestamps_are_compiled(record, mark):
    assert check(LANGUAGE, record, mark)
    check_owned(LANGUAGE, record.keys, (record.new_image, record.old_image))
