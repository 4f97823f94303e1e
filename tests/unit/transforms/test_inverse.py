"""The inverse of a mapping: which rules invert (and why not), and a row read back
into the items it holds — mapped forward then read back gives the items again."""
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.attrs import canonical_typed_json
from ddb2bt.transforms.config import load_mapping, mapping_from_text
from ddb2bt.transforms.inverse import EXISTING_ONLY, INVERTS, NO, describe, literal_regex, mapping_inversion
from ddb2bt.transforms.inverse_rows import invert_row, key_of, main_row_of, owned_row_cells
from ddb2bt.transforms.mapping import map_change
from ddb2bt.transforms.model import INSERT, ChangeRecord

from tests.unit.transforms.test_examples import HR, INVOICE_SEED, INVOICES, VIDEO_SEED, VIDEOS, item

CATALOG = load_mapping("examples/product_catalog.yaml")
CATALOG_SEED = [
    item(pk="hats", sk="fedoras#brandA", Description="A fedora", Price=30, Thumbnail="f.png", Colour="red"),
    item(pk="hats", sk="caps#brandB", Price=12, InStock=True, Sizes=["S", "M"], Rating=4.5),
    item(pk="a#b\\c", sk="x#y\\", Description="escaped", Extra={"k": [1, "two"]}),
]
HR_SEED = [
    item(PK="HR-EMPLOYEE#0001", SK="HR-EMPLOYEE#0001", Name="John Smith", HireDate="2021-03-01",
         Warehouse="WAREHOUSE#1", JobTitle="Engineer", Level=3),
    item(PK="HR-EMPLOYEE#0001", SK="JH#2021-03-01", Job={"title": "Engineer", "department": "R&D"}),
    item(PK="OE-ORDER#O1", SK="OE-ORDER#O1", CustomerID="C1", OrderStatus="OPEN", OrderDate="2023-09-10",
         Total=99.5),
    item(PK="OE-ORDER#O1", SK="ITEM#P1", Line={"product": "P1", "quantity": 2, "price": 49.75}),
    item(PK="OE-PRODUCT#P1", SK="OE-PRODUCT#P1", Name="Widget", Price=49.75),
    item(PK="OE-PRODUCT#P1", SK="WAREHOUSE#W1", Quantity=120),
    item(PK="HR-REGION#1", SK="Europe", Countries=3),
]
STRINGS = {"pk": "S", "sk": "S", "PK": "S", "SK": "S"}


def bigtable_of(mapping, items):
    bt = InMemoryBigtable()
    for n, it in enumerate(items):
        keys = {k: it[k] for k in mapping.source.key_attributes}
        for ch in map_change(mapping, ChangeRecord(INSERT, keys, it, None, 1_700_000_000_000 + n * 1000)):
            bt.mutate_rows(ch.table, [(ch.row_key, ch.mutations)])
    return {row: {col: sorted(v.items(), reverse=True) for col, v in cols.items()}
            for row, cols in bt.versions(mapping.target.table).items()}


def canon(items):
    return sorted(canonical_typed_json({"M": i}) for i in items)


def read_back(mapping, rows, previous=()):
    out, unexplained = [], []
    for key, cells in rows.items():
        inv = invert_row(mapping, key, cells, STRINGS, tuple(previous))
        out += [i.item for i in inv.items]
        unexplained += [(key, u) for u in inv.unexplained]
        assert not inv.deleted
    return out, unexplained


@pytest.mark.parametrize("mapping,seed", [(CATALOG, CATALOG_SEED), (INVOICES, INVOICE_SEED),
                                          (VIDEOS, VIDEO_SEED), (HR, HR_SEED)],
                         ids=["product_catalog", "invoices", "videos", "hr_orders"])
def test_every_example_item_reads_back_exactly_given_the_items_dynamodb_holds(mapping, seed):
    rows = bigtable_of(mapping, seed)
    items, unexplained = read_back(mapping, rows, seed)
    assert canon(items) == canon(seed)
    assert unexplained == []


def test_new_items_of_rules_that_invert_read_back_without_any_previous_item():
    catalog = [item(pk="hats", sk="fedoras#brandA", Description="A fedora", Price=30, Thumbnail="f.png",
                    Colour="red"), item(pk="a#b\\c", sk="x#y\\", Price=-7)]
    items, unexplained = read_back(CATALOG, bigtable_of(CATALOG, catalog))
    assert canon(items) == canon(catalog) and unexplained == []
    payments = [it for it in INVOICE_SEED if it["sk"]["S"].startswith("Payment-")]
    items, unexplained = read_back(INVOICES, bigtable_of(INVOICES, payments))
    assert canon(items) == canon(payments) and unexplained == []


def test_a_new_item_whose_key_the_row_does_not_spell_is_reported_not_guessed():
    invoice = [it for it in INVOICE_SEED if it["sk"]["S"].startswith("Invoice-")][:1]
    items, unexplained = read_back(INVOICES, bigtable_of(INVOICES, invoice))
    assert items == []
    assert [(k, u[:2]) for k, u in unexplained] == [(b"0123", ("Invoice", b"Details"))]


def test_auto_encoded_attributes_keep_the_type_dynamodb_holds_and_new_ones_come_back_as_strings():
    old = item(pk="hats", sk="caps", Rating=4.5, Colour="red")
    rows = bigtable_of(CATALOG, [old])
    (got,), _ = read_back(CATALOG, rows, [old])
    assert got["Rating"] == {"N": "4.5"}
    (got,), _ = read_back(CATALOG, rows)
    assert got["Rating"] == {"S": "4.5"} and got["Colour"] == {"S": "red"}


def test_a_row_that_lost_an_item_says_which_item_to_delete():
    rows = bigtable_of(INVOICES, INVOICE_SEED[:2])  # the invoice and one payment
    gone = INVOICE_SEED[2]  # DynamoDB still holds a second payment of the same invoice
    inv = invert_row(INVOICES, b"0123", rows[b"0123"], STRINGS, tuple(INVOICE_SEED[:3]))
    assert [canonical_typed_json({"M": k}) for k in inv.deleted] == [
        canonical_typed_json({"M": {"pk": gone["pk"], "sk": gone["sk"]}})]
    assert canon(i.item for i in inv.items) == canon(INVOICE_SEED[:2])


def test_an_emptied_row_deletes_its_items_and_leaves_other_rows_items_alone():
    inv = invert_row(CATALOG, b"hats#fedoras#brandA", {}, STRINGS, tuple(CATALOG_SEED))
    assert inv.items == () and inv.deleted == ({"pk": {"S": "hats"}, "sk": {"S": "fedoras#brandA"}},)


def test_an_updated_row_reads_back_as_the_updated_item():
    old = CATALOG_SEED[0]
    new = dict(old, Price={"N": "31"}, Description={"S": "new"})
    del new["Thumbnail"]
    inv = invert_row(CATALOG, b"hats#fedoras#brandA", bigtable_of(CATALOG, [new])[b"hats#fedoras#brandA"],
                     STRINGS, (old,))
    assert [i.item for i in inv.items] == [new] and inv.deleted == ()


def test_index_rows_and_ddb2bt_families_are_never_read_back():
    rows = bigtable_of(HR, HR_SEED)
    index_rows = [k for k in rows if k.startswith(b"idx#")]
    assert index_rows
    for key in index_rows:
        inv = invert_row(HR, key, rows[key], STRINGS, tuple(HR_SEED))
        assert inv.items == () and inv.unexplained == ()
    row = dict(rows[b"emp#0001"])
    row[("ddb2bt_touch", b"m")] = [(1, b"x")]
    inv = invert_row(HR, b"emp#0001", row, STRINGS, tuple(HR_SEED))
    assert inv.unexplained == () and len(inv.items) == 2


def test_the_example_rules_say_exactly_which_invert():
    statuses = {m.name: {i.rule: i.status for i in mapping_inversion(m)} for m in (CATALOG, INVOICES, VIDEOS, HR)}
    assert statuses["product_catalog"] == {"product": INVERTS}
    assert statuses["invoices"] == {"invoice": EXISTING_ONLY, "payment": INVERTS}
    assert statuses["videos"] == {"video": INVERTS, "likes": INVERTS, "views": INVERTS, "views_legacy": INVERTS,
                                  "comment": EXISTING_ONLY}
    assert statuses["hr_orders"]["job_history"] == INVERTS and statuses["hr_orders"]["employee"] == EXISTING_ONLY
    lines = describe(mapping_inversion(INVOICES))
    assert "rule invoice: inverts for items DynamoDB holds" in lines
    assert any("sk is not in the row key" in line and "prefix 'Invoice-'" in line for line in lines)


NOT_INVERTING = """
version: 1
source: {table: Things, key: {partition: pk, sort: sk}}
target: {project: p, instance: i, table: things}
families: {f: {max_versions: 1}}
rules:
  - name: dropped
    match: {attribute: sk, equals: X}
    skip: true
  - name: salted
    match: {attribute: sk, equals: Y}
    row_key: "{pk|salt:4}#{sk}"
    columns: {v: "f:v"}
  - name: computed
    match: {attribute: sk, equals: Z}
    hook: "tests.hooks.sample_hooks:split_name"
  - name: stamped
    row_key: "{pk}"
    columns: {v: {column: "f:w", timestamp: {attribute: sk, format: epoch_millis}}}
"""


def test_rules_that_do_not_invert_say_why():
    mapping = mapping_from_text(NOT_INVERTING)
    by_rule = {i.rule: i for i in mapping_inversion(mapping)}
    assert all(i.status == NO for i in by_rule.values())
    assert "skip" in by_rule["dropped"].reasons[0]
    assert "partition key 'pk'" in by_rule["salted"].reasons[0]
    assert "hook" in by_rule["computed"].reasons[0]
    assert any("key attribute 'sk'" in r for r in by_rule["stamped"].reasons)


def test_literal_regexes_rebuild_their_attribute_and_others_are_refused():
    lit = literal_regex(r"Payment-(?P<payment>.+)\.x")
    assert lit.build({"payment": "0680"}) == "Payment-0680.x"
    assert literal_regex(r"Pay\d+(?P<n>.+)") is None
    assert literal_regex(r"(HR|OE)-[A-Z]+#.*") is None


key_text = st.text(alphabet=st.sampled_from("ab#\\-xé1"), min_size=1, max_size=8)
values = st.one_of(st.text(max_size=6), st.integers(-10**6, 10**6), st.booleans(), st.none(),
                   st.lists(st.integers(0, 9), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(0, 9),
                                                                            max_size=2))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(key_text, key_text, st.dictionaries(st.sampled_from(["Colour", "Size", "Tags", "Meta"]),
                                                                values, max_size=3),
                          st.one_of(st.none(), st.integers(-2**40, 2**40)), st.one_of(st.none(), st.text(max_size=5))),
                min_size=1, max_size=4, unique_by=lambda t: (t[0], t[1])))
def test_property_catalog_items_mapped_forward_read_back_as_the_same_items(specs):
    seed = []
    for pk, sk, others, price, description in specs:
        attrs = dict(others, pk=pk, sk=sk)
        if price is not None:
            attrs["Price"] = price
        if description is not None:
            attrs["Description"] = description
        seed.append(item(**attrs))
    seed = [it for it in seed if owned_row_cells(CATALOG, it)]  # an item with no cell has no row
    rows = bigtable_of(CATALOG, seed)
    items, unexplained = read_back(CATALOG, rows, seed)
    assert canon(items) == canon(seed) and unexplained == []
    for it in items:
        assert main_row_of(CATALOG, it) in rows and key_of(CATALOG, it)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["0123", "01#4", "x\\y"]), st.text(alphabet="ab#\\-é1 ", min_size=1, max_size=6),
                          st.dictionaries(st.text(min_size=1, max_size=3), st.integers(0, 99), max_size=2),
                          st.integers(0, 10**12)),
                min_size=1, max_size=5, unique_by=lambda t: (t[0], t[1])))
def test_property_new_payments_read_back_without_any_previous_item(specs):
    seed = [item(pk=f"Invoice-{inv}", sk=f"Payment-{pay}", Details=details,
                 DateCreated=__import__("datetime").datetime.utcfromtimestamp(ms / 1000).strftime(
                     "%Y-%m-%dT%H:%M:%S") + (f".{ms % 1000:03d}" if ms % 1000 else ""))
            for inv, pay, details, ms in specs]
    items, unexplained = read_back(INVOICES, bigtable_of(INVOICES, seed))
    assert canon(items) == canon(seed) and unexplained == []


def test_the_writes_planned_for_a_row_put_what_differs_delete_what_is_gone_and_skip_what_is_equal():
    from ddb2bt.transforms.inverse_rows import DeleteItem, PutItem, plan_writes
    held = tuple(INVOICE_SEED[:3])
    changed = dict(INVOICE_SEED[1], Details={"M": {"amount_usd": {"N": "121"}}})
    rows = bigtable_of(INVOICES, [INVOICE_SEED[0], changed])  # payment 0789 deleted, 0680 changed
    inv = invert_row(INVOICES, b"0123", rows[b"0123"], STRINGS, held)
    writes = plan_writes(INVOICES, inv, held, "Invoices", 42)
    assert writes == (PutItem("Invoices", changed, {"pk": changed["pk"], "sk": changed["sk"]}, 42),
                      DeleteItem("Invoices", {"pk": INVOICE_SEED[2]["pk"], "sk": INVOICE_SEED[2]["sk"]}, 42))
    same = invert_row(INVOICES, b"0123", bigtable_of(INVOICES, held)[b"0123"], STRINGS, held)
    assert plan_writes(INVOICES, same, held, "Invoices", 43) == ()  # a forward write read back writes nothing


@pytest.mark.parametrize("order", [1, -1], ids=["kept_first", "gone_first"])
def test_a_comment_whose_version_is_gone_is_deleted_not_read_as_another_comments_version(order):
    comments = [it for it in VIDEO_SEED if it["pk"]["S"] == "0123" and it["sk"]["S"].startswith("VideoComment#")]
    kept = [c for c in comments if c["CreatedAt"]["S"] == "2023-09-10T19:01:15"]
    rows = bigtable_of(VIDEOS, kept)
    inv = invert_row(VIDEOS, b"0123", rows[b"0123"], STRINGS, tuple(comments[::order]))
    assert canon(i.item for i in inv.items) == canon(kept)
    gone = [c for c in comments if c not in kept][0]
    assert inv.deleted == ({"pk": gone["pk"], "sk": gone["sk"]},)


def test_auto_values_keep_null_and_the_empty_string_apart_when_dynamodb_holds_them():
    from ddb2bt.transforms.encoding import encode
    from ddb2bt.transforms.inverse_rows import decode_value
    for held in ({"NULL": True}, {"S": ""}, {"N": "7"}, {"BOOL": True}, {"SS": ["a", "b"]}):
        assert decode_value("auto", encode("auto", held), held) == held
    assert decode_value("auto", encode("auto", {"S": ""}), None) == {"S": ""}


hr_text = st.text(alphabet=st.sampled_from("ab#\\-1é"), min_size=1, max_size=6)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["entity", "inventory", "job"]), hr_text, hr_text, st.integers(0, 10**6)),
                min_size=1, max_size=6, unique_by=lambda t: t[:3]))
def test_property_hr_orders_new_items_of_the_rules_that_invert_read_back_without_any_previous_item(specs):
    seed = []
    for kind, a, b, n in specs:
        if kind == "entity":  # reference_entity: PK and SK both in the row key; other attributes as strings
            seed.append(item(PK=f"HR-REGION#{a}", SK=b, Countries=str(n)))
        elif kind == "inventory":  # the sort key folded into a qualifier
            seed.append(item(PK=f"OE-PRODUCT#{a}", SK=f"WAREHOUSE#{b}", Quantity=n))
        else:
            seed.append(item(PK=f"HR-EMPLOYEE#{a}", SK=f"JH#{b}", Job={"n": n}))
    items, unexplained = read_back(HR, bigtable_of(HR, seed))
    assert canon(items) == canon(seed) and unexplained == []
