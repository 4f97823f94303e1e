import struct
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from ddb2bt.pipeline.verify.compare import expected_layout
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.config import TtlConfig, load_mapping, mapping_from_text
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.mapping import backfill_record, map_change
from ddb2bt.transforms.model import INSERT, MODIFY, REMOVE, ChangeRecord, DeleteCells, SetCell

M = load_mapping("examples/product_catalog.yaml")
TS = 1_694_359_308_000  # 2023-09-10T15:21:48Z

SEED_ROWS = [  # Example 1 of the seed document
    ("hats", "fedoras#brandA", "Made from high-quality wool...", "30", "https://storage.example/1"),
    ("hats", "fedoras#brandB", "Durable water-resistant canvas...", "28", "https://storage.example/2"),
    ("hats", "newsboy#brandB", "Add a touch of vintage charm...", "25", "https://storage.example/3"),
    ("shoes", "sneakers#brandA", "Explore the city in style...", "40", "https://storage.example/4"),
    ("shoes", "sneakers#brandB", "Classic features with contemporary materials...", "50", "https://storage.example/5"),
]


def item(pk, sk, **attrs):
    out = {"pk": {"S": pk}, "sk": {"S": sk}}
    out.update(attrs)
    return out


def keys_of(i):
    return {"pk": i["pk"], "sk": i["sk"]}


def test_example_1_golden_layout():
    model = InMemoryBigtable()
    for pk, sk, desc, price, thumb in SEED_ROWS:
        i = item(pk, sk, Description={"S": desc}, Price={"N": price}, Thumbnail={"S": thumb})
        for ch in map_change(M, ChangeRecord(INSERT, keys_of(i), i, None, TS)):
            model.mutate_rows(ch.table, [(ch.row_key, ch.mutations)])
    rows = model.latest("product_catalog")
    assert sorted(rows) == [b"hats#fedoras#brandA", b"hats#fedoras#brandB", b"hats#newsboy#brandB",
                            b"shoes#sneakers#brandA", b"shoes#sneakers#brandB"]
    assert rows[b"hats#fedoras#brandA"] == {
        ("SKU", b"Description"): b"Made from high-quality wool...",
        ("SKU", b"Price"): struct.pack(">q", 30),
        ("SKU", b"Thumbnail"): b"https://storage.example/1",
    }
    versions = model.versions("product_catalog")
    assert all(list(v) == [TS] for row in versions.values() for v in row.values())


def test_insert_sets_cells_without_pruning():
    """A stream INSERT's item did not exist: no older versions to prune."""
    i = item("hats", "x", Price={"N": "30"}, Extra={"SS": ["b", "a"]})
    (ch,) = map_change(M, ChangeRecord(INSERT, keys_of(i), i, None, TS))
    assert ch.row_key == b"hats#x"
    assert ch.mutations == (SetCell("SKU", b"Extra", b'["a","b"]', TS), SetCell("SKU", b"Price", struct.pack(">q", 30), TS))


def test_modify_sets_cells_and_prunes_older_versions():
    old = item("hats", "x", Price={"N": "29"})
    i = item("hats", "x", Price={"N": "30"}, Extra={"SS": ["b", "a"]})
    (ch,) = map_change(M, ChangeRecord(MODIFY, keys_of(i), i, old, TS))
    assert ch.mutations == (
        SetCell("SKU", b"Extra", b'["a","b"]', TS), DeleteCells("SKU", b"Extra", 0, TS),
        SetCell("SKU", b"Price", struct.pack(">q", 30), TS), DeleteCells("SKU", b"Price", 0, TS),
    )


def test_insert_prunes_for_backfill_records_and_when_ttl_deletions_are_ignored():
    i = item("hats", "x", Price={"N": "30"})
    (bf,) = map_change(M, backfill_record(keys_of(i), i, TS))
    assert DeleteCells("SKU", b"Price", 0, bf.mutations[0].timestamp_ms) in bf.mutations
    keep = replace(M, ttl=TtlConfig(attribute="expires", deletions="ignore"))
    (ch,) = map_change(keep, ChangeRecord(INSERT, keys_of(i), i, None, TS))
    assert ch.mutations == (SetCell("SKU", b"Price", struct.pack(">q", 30), TS), DeleteCells("SKU", b"Price", 0, TS))


def test_modify_removing_an_attribute_deletes_its_column_time_bounded():
    old = item("hats", "x", Price={"N": "30"}, Thumbnail={"S": "t"})
    new = item("hats", "x", Price={"N": "31"})
    (ch,) = map_change(M, ChangeRecord(MODIFY, keys_of(new), new, old, TS))
    assert DeleteCells("SKU", b"Thumbnail", 0, TS + 1) in ch.mutations
    assert SetCell("SKU", b"Price", struct.pack(">q", 31), TS) in ch.mutations


def test_remove_deletes_every_column_the_old_image_names_never_the_row():
    old = item("hats", "x", Price={"N": "30"}, Description={"S": "d"}, Other={"BOOL": True})
    (ch,) = map_change(M, ChangeRecord(REMOVE, keys_of(old), None, old, TS))
    assert set(ch.mutations) == {DeleteCells("SKU", q, 0, TS + 1) for q in (b"Price", b"Description", b"Other")}


def test_key_only_item_produces_no_row():
    i = item("hats", "x")
    assert map_change(M, ChangeRecord(INSERT, keys_of(i), i, None, TS)) == ()


@pytest.mark.parametrize("record,reason", [
    (ChangeRecord("UPSERT", {"pk": {"S": "a"}, "sk": {"S": "b"}}, {}, None, TS), "bad_record"),
    (ChangeRecord(INSERT, {}, {"pk": {"S": "a"}}, None, TS), "bad_record"),
    (ChangeRecord(MODIFY, {"pk": {"S": "a"}, "sk": {"S": "b"}}, {"pk": {"S": "a"}, "sk": {"S": "b"}}, None, TS),
     "bad_record"),
    (ChangeRecord(INSERT, {"pk": {"S": "a"}, "sk": {"S": "b"}}, None, None, TS), "bad_record"),
    (ChangeRecord(INSERT, {"pk": {"S": "a"}, "sk": {"S": "b"}},
                  {"pk": {"S": "a"}, "sk": {"S": "b"}, "Price": {"N": "1.5"}}, None, TS), "encoding"),
    (ChangeRecord(INSERT, {"pk": {"S": "a"}, "sk": {"S": "b" * 5000}},
                  {"pk": {"S": "a"}, "sk": {"S": "b" * 5000}, "Price": {"N": "1"}}, None, TS), "row_key_too_long"),
    (ChangeRecord(INSERT, {"pk": {"S": "a"}, "sk": {"S": "b"}},
                  {"pk": {"S": "a"}, "sk": {"S": "b"}, "q" * 17000: {"S": "v"}}, None, TS), "qualifier_too_long"),
])
def test_unmappable_records_raise_with_a_reason(record, reason):
    with pytest.raises(MappingError) as err:
        map_change(M, record)
    assert err.value.reason == reason


STRICT = mapping_from_text("""
source: {table: Things, key: {partition: pk}}
target: {project: p, instance: i, table: things}
families: {f: {}}
rules:
  - name: typed
    match: {attribute: pk, prefix: "T#"}
    row_key: "{pk|strip_prefix:T#}"
    columns: {A: "f:a"}
  - name: ignored
    match: {attribute: pk, prefix: "tmp#"}
    skip: true
""")


def test_unlisted_attribute_is_a_dead_letter_by_default_and_unmatched_items_too():
    with pytest.raises(MappingError) as err:
        map_change(STRICT, ChangeRecord(INSERT, {"pk": {"S": "T#1"}}, {"pk": {"S": "T#1"}, "B": {"S": "x"}}, None, TS))
    assert err.value.reason == "unmapped_attribute"
    with pytest.raises(MappingError) as err:
        map_change(STRICT, ChangeRecord(INSERT, {"pk": {"S": "U#1"}}, {"pk": {"S": "U#1"}}, None, TS))
    assert err.value.reason == "no_matching_rule"
    assert map_change(STRICT, ChangeRecord(INSERT, {"pk": {"S": "tmp#1"}}, {"pk": {"S": "tmp#1"}}, None, TS)) == ()
    (ch,) = map_change(STRICT, ChangeRecord(INSERT, {"pk": {"S": "T#1"}}, {"pk": {"S": "T#1"}, "A": {"N": "5"}}, None, TS))
    assert ch.row_key == b"1"


# --- convergence: random histories, duplicates and replays --------------------------

KEYS = [("hats", "a#1"), ("hats", "a"), ("shoes", "b"), ("hats#x", "y")]
ATTR_VALUES = {
    "Description": st.text(max_size=5).filter(lambda s: not any(0xD800 <= ord(c) <= 0xDFFF for c in s)).map(lambda s: {"S": s}),
    "Price": st.integers(-5, 5).map(lambda n: {"N": str(n)}),
    "Tags": st.sets(st.sampled_from("abc"), min_size=1).map(lambda s: {"SS": sorted(s)}),
    "Flag": st.booleans().map(lambda b: {"BOOL": b}),
}
op = st.tuples(
    st.sampled_from(range(len(KEYS))),
    st.sampled_from(["put", "update", "delete"]),
    st.fixed_dictionaries({}, optional=ATTR_VALUES),
    st.integers(0, 2),  # seconds to advance the clock: 0 = same second (AWS rounds to seconds)
)


def history(ops):
    """Simulate DynamoDB: yields stream records; returns the final table."""
    table, records, now = {}, [], TS
    for k, kind, attrs, advance in ops:
        now += advance * 1000
        pk, sk = KEYS[k]
        key = {"pk": {"S": pk}, "sk": {"S": sk}}
        old = table.get(KEYS[k])
        if kind == "delete":
            if old is None:
                continue
            del table[KEYS[k]]
            records.append(ChangeRecord(REMOVE, key, None, old, now))
            continue
        if kind == "put":
            new = dict(key, **attrs)
        else:
            new = dict(old or key)
            new.update(attrs)
            for name in list(new):
                if name not in attrs and name not in key and len(name) % 2 == 0:  # remove some attributes
                    del new[name]
        table[KEYS[k]] = new
        records.append(ChangeRecord(MODIFY if old is not None else INSERT, key, new, old, now))
    return records, list(table.values())


def apply_all(model, records):
    for r in records:
        for ch in map_change(M, r):
            model.mutate_rows(ch.table, [(ch.row_key, ch.mutations)])


@pytest.mark.slow
@settings(max_examples=1500, deadline=None)
@given(st.lists(op, max_size=25), st.data())
def test_random_histories_converge_despite_duplicates_and_replays(ops, data):
    records, final = history(ops)
    delivered = []
    for r in records:
        delivered.extend([r] * data.draw(st.integers(1, 2), label="copies"))
    if records:
        checkpoint = data.draw(st.integers(0, len(records) - 1), label="replay from")
        delivered.extend(records[checkpoint:])  # a restart from an older checkpoint
    model = InMemoryBigtable()
    apply_all(model, delivered)
    expected = {row: {col: e.value for col, e in cols.items()}
                for row, cols in expected_layout(M, final)["product_catalog"].items()}
    assert model.latest("product_catalog") == expected
    # exactly one version per owned column: nothing relies on garbage collection
    assert all(len(v) == 1 for row in model.versions("product_catalog").values() for v in row.values())


@settings(max_examples=500, deadline=None)
@given(st.lists(op, max_size=25))
def test_the_modify_fast_path_produces_exactly_what_the_general_path_does(ops):
    import ddb2bt.transforms.mapping as engine

    records, _ = history(ops)
    fast = [map_change(M, r) for r in records]
    general = engine._old_cells
    try:
        engine._old_cells = lambda mapping, record, new: engine.owned_cells(
            mapping, record.keys, record.old_image, with_values=False)
        slow = [map_change(M, r) for r in records]
    finally:
        engine._old_cells = general
    assert fast == slow
