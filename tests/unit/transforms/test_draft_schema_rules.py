"""A drafted mapping a user can trust: `draft` follows Bigtable's schema rules
(few families, short names, no age-based GC where items carry no TTL, an index
only over the items carrying its keys and not led by a value of few values),
samples the whole key space (every segment, a reservoir, every entity type it
read, the largest item), reports what it saw, and places split points in every
range the mapping writes; `lint` checks each rule on any mapping."""
from __future__ import annotations

import pytest

from ddb2bt.pipeline.services.draft import SampleBounds, sample_table
from ddb2bt.transforms.config import parse_mapping
from ddb2bt.transforms.draft import SampleFacts, assess, draft_mapping, split_points, table_facts
from ddb2bt.transforms.lint import WARN, lint
from ddb2bt.transforms.mapping import expected_cells
from tests.unit.transforms.draft_tables import LARGE_ITEM_BYTES, NOW_S, shop_table
from tests.unit.transforms.test_examples import item

TTL_ON = {"TimeToLiveDescription": {"TimeToLiveStatus": "ENABLED", "AttributeName": "expiresAt"}}


def shop_draft(items=None):
    source = shop_table()
    facts = table_facts(source.describe("Shop"), TTL_ON, None)
    return draft_mapping(facts, source.items if items is None else items, project="p", instance="i", now_s=NOW_S)


def warnings(mapping, items=None) -> dict:
    return {(f.code, f.where): f.message for f in lint(mapping, items) if f.level == WARN}


# --- what draft writes --------------------------------------------------------------


def test_the_draft_of_a_single_table_design_has_few_short_families_and_no_age_gc():
    d = shop_draft()
    assert set(d.data["families"]) == {"d", "idx"}  # not one per entity type, map or set
    assert not any("max_age_seconds" in spec for spec in d.data["families"].values())  # TTL only on carts
    assert d.data["ttl"] == {"attribute": "expiresAt", "deletions": "apply"}
    assert {r["name"] for r in d.data["rules"]} == {"cust_profile", "cust_order", "cart_cart", "product_details",
                                                     "other"}
    families = {spec["column"].split(":")[0] for r in d.data["rules"] for spec in r.get("columns", {}).values()}
    assert families == {"d"}


def test_the_status_index_is_drafted_on_the_orders_only_and_salted():
    d = shop_draft()
    indexed = {r["name"]: r["indexes"] for r in d.data["rules"] if "indexes" in r}
    assert set(indexed) == {"cust_order", "other"}  # orders carry orderStatus; an unseen type might too
    key = indexed["cust_order"][0]["row_key"]
    assert key == "idx/bystatus/{PK|salt:16}/{orderStatus}/{createdAt}/{PK}/{SK}"  # the status is not first


def test_the_draft_lints_silent_over_its_sample():
    source = shop_table()
    d = shop_draft()
    assert warnings(d.mapping(), source.items) == {}


def test_a_long_attribute_name_gets_a_short_qualifier():
    long_name = "customerPreferredShippingAddressInstructionsForTheCourierOnWeekdays" * 2
    items = [item(PK=f"CUST#{i}", SK="PROFILE", **{long_name: "leave at door", "Name": "n"}) for i in range(20)]
    d = draft_mapping(table_facts(shop_table().describe("Shop"), None, None), items, project="p", instance="i",
                      now_s=NOW_S)
    column = d.data["rules"][0]["columns"][long_name]["column"]
    assert column.startswith("d:customerPreferred") and len(column) - 2 <= 64 and "~" in column
    assert warnings(d.mapping(), items) == {}


# --- what lint checks, on any mapping ---------------------------------------------------


def mapping(families: dict, rules: list, ttl=None):
    doc = {"version": 1, "name": "shop", "source": {"table": "Shop", "key": {"partition": "PK", "sort": "SK"}},
           "target": {"project": "p", "instance": "i", "table": "shop"}, "families": families, "rules": rules}
    if ttl:
        doc["ttl"] = {"attribute": ttl, "deletions": "apply"}
    return parse_mapping(doc, origin="<test>")


def rule(name: str, family: str = "d", **extra) -> dict:
    return {"name": name, "row_key": "{PK}#{SK}", "other_attributes": {"mode": "column", "family": family}, **extra}


def test_lint_flags_an_age_gc_on_a_family_fed_by_items_without_ttl():
    aged = {"d": {"max_age_seconds": 86_400 * 60}}
    assert ("age_gc_without_ttl", "families.d") in warnings(mapping(aged, [rule("all")]))  # no TTL at all
    carts = [item(PK=f"CART#{i}", SK="CART", expiresAt=NOW_S + i) for i in range(5)]
    profiles = [item(PK=f"CUST#{i}", SK="PROFILE", Name="n") for i in range(5)]
    with_ttl = mapping(aged, [rule("all")], ttl="expiresAt")
    found = warnings(with_ttl, carts + profiles)
    assert "5 of the 10 sampled items feeding it carry no expiresAt" in found[("age_gc_without_ttl", "families.d")]
    assert warnings(with_ttl, carts) == {}  # every item feeding it expires: safe
    split = mapping({"cart": {"max_age_seconds": 86_400 * 60}, "d": {}},
                    [rule("cart", "cart", match={"attribute": "PK", "prefix": "CART#"}), rule("rest")],
                    ttl="expiresAt")
    assert warnings(split, carts + profiles) == {}  # the age GC only where the carts go
    # without a sample: only a rule that requires the TTL attribute may feed an aged family
    assert ("age_gc_without_ttl", "families.cart") in warnings(split)
    required = mapping({"cart": {"max_age_seconds": 86_400 * 60}, "d": {}},
                       [rule("cart", "cart", match={"attribute": "expiresAt", "present": True}), rule("rest")],
                       ttl="expiresAt")
    assert warnings(required) == {}


def test_lint_flags_many_families_long_family_names_and_long_qualifiers():
    many = {f"f{i}": {} for i in range(11)}
    assert ("many_families", "families") in warnings(mapping(many, [rule("all", "f0")]))
    long_name = mapping({"customer_profiles": {}}, [rule("all", "customer_profiles")])
    assert ("long_family_name", "families.customer_profiles") in warnings(long_name)
    attribute = "a" * 100  # over 64 bytes: long
    static = mapping({"d": {}}, [rule("all", columns={"Name": {"column": f"d:{attribute}"}})])
    assert ("long_qualifier", "rules[0] all: columns.Name") in warnings(static)
    sampled = mapping({"d": {}}, [rule("all")])
    assert ("long_qualifier", "families.d") in warnings(sampled, [item(PK="a", SK="b", **{attribute: 1})])
    assert warnings(sampled, [item(PK="a", SK="b", Name=1)]) == {}


def test_lint_flags_an_index_over_items_without_its_key_attributes_and_a_hotspot_prefix():
    index = {"name": "bystatus", "row_key": "idx#{orderStatus}#{PK}#{SK}", "family": "idx"}
    m = mapping({"d": {}, "idx": {}}, [rule("profile", match={"attribute": "SK", "equals": "PROFILE"},
                                            indexes=[index]),
                                       rule("order", indexes=[index])])
    items = [item(PK=f"CUST#{i}", SK="PROFILE", Name="n") for i in range(30)] + \
            [item(PK=f"CUST#{i}", SK=f"ORDER#{i}", orderStatus="SHIPPED" if i % 4 else "PENDING") for i in range(30)]
    found = warnings(m, items)
    assert "none of the 30 sampled items this rule maps carries orderStatus" in \
        found[("index_without_keys", "rules[0] profile: indexes[0] bystatus")]
    assert ("index_without_keys", "rules[1] order: indexes[0] bystatus") not in found
    assert ("low_cardinality_prefix", "rules[1] order: indexes[0] bystatus") in found  # the status first: hotspot
    salted = {**index, "row_key": "idx#{PK|salt:16}#{orderStatus}#{PK}#{SK}"}
    fixed = mapping({"d": {}, "idx": {}}, [rule("order", indexes=[salted])])
    assert warnings(fixed, items[30:]) == {}


# --- the sample: the whole key space ----------------------------------------------------


class SegmentedTable:
    """A DynamoDB client whose parallel Scan gives segment i the items i, i+S,
    i+2S, … in the order they were written: a type written last is at the end
    of every segment (where a scan reaches it last), as in the emulators."""

    def __init__(self, items: list) -> None:
        self.items = items

    def scan(self, TableName, ConsistentRead, ReturnConsumedCapacity, Segment=0, TotalSegments=1, Limit=1000,
             ExclusiveStartKey=None):
        mine = self.items[Segment::TotalSegments]
        start = ExclusiveStartKey["at"] if ExclusiveStartKey else 0
        page = mine[start:start + Limit]
        out = {"Items": page, "ConsumedCapacity": {"CapacityUnits": 0.5 * len(page)}}
        if start + Limit < len(mine):
            out["LastEvaluatedKey"] = {"at": start + Limit}
        return out


def test_the_sample_reaches_the_type_a_scan_reaches_last_and_the_largest_item():
    source = shop_table()
    items, sample = sample_table(SegmentedTable(source.items), "Shop", SampleBounds(items=200),
                                 keys=("PK", "SK"))
    products = [it for it in items if it["PK"]["S"].startswith("PRODUCT#")]
    assert sample.stopped == "end" and sample.read == len(source.items)  # 10 x 200 reads the 1,500 items whole
    assert 20 <= len(products) <= 80  # about a fifth of the sample, not none
    assert max(len(it.get("Description", {}).get("S", "")) for it in items) == LARGE_ITEM_BYTES
    assert sample.largest_read > LARGE_ITEM_BYTES
    assert len(items) <= 200 + 8 * 5  # the reservoirs, and at most a few keeps of a rare type per segment


def test_a_type_too_rare_for_the_reservoir_is_still_sampled():
    source = shop_table()
    rare = [item(PK=f"COUPON#{i}", SK="COUPON", Code=f"C{i}") for i in range(3)]
    items, _ = sample_table(SegmentedTable(source.items + rare), "Shop", SampleBounds(items=200), keys=("PK", "SK"))
    assert sum(1 for it in items if it["PK"]["S"].startswith("COUPON#")) == 3


def test_the_report_says_coverage_types_the_largest_item_and_where_a_type_may_be_missing():
    source = shop_table()
    facts = table_facts(source.describe("Shop", item_count=150_000), TTL_ON, None)
    d = draft_mapping(facts, source.items[:1000] + source.items[-1:], project="p", instance="i", now_s=NOW_S)
    m = d.mapping()
    sample = SampleFacts(items=1001, scanned_pages=8, consumed_rcu=400.0, stopped="limit", segments=8, seconds=2.0,
                         read=10_000, read_bytes=10**6, largest_read=163_120, segments_done=0)
    report = assess(facts, sample, source.items[:1001], m, lint(m, source.items[:1001]), 10, d.types).render()
    assert "coverage: the sample read 6.7% of the table's items (10,000 of ~150,000)" in report
    assert "largest item read 163,120 B" in report
    assert "entity types (sampled items): " in report
    assert "cust_profile 200" in report and "cust_order 800" in report and "product 1" in report
    assert "an entity type rarer than about 1 in 10,000 items may be missing" in report
    assert "entity type 'product' is in only 1 sampled item(s)" in report
    assert "e+" not in report  # a share is written as people write it


# --- split points: every range the mapping writes -------------------------------------


@pytest.mark.parametrize("limit", [100, 5])
def test_split_points_start_every_range_the_mapping_writes(limit):
    source = shop_table()
    m = shop_draft().mapping()
    points = split_points(m, source.items, limit=limit)
    assert len(points) <= limit and points == sorted(points)
    index_keys = sorted(c.row_key for it in source.items for c in expected_cells(m, it).values()
                        if c.family == "idx")
    assert index_keys[0] in points  # the index rows start on a tablet of their own
    if limit == 100:  # each entity type's range and the index's
        for prefix in (b"CART#", b"CUST#", b"PRODUCT#", b"idx/bystatus/"):
            assert any(p.startswith(prefix) for p in points), prefix
