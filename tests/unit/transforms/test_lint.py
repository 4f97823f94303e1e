from ddb2bt.transforms.attrs import from_plain
from ddb2bt.transforms.config import load_mapping, mapping_from_text
from ddb2bt.transforms.lint import lint

HEAD = "source: {table: Things, key: {partition: id}}\ntarget: {project: p, instance: i, table: t}\n"


def codes(findings, level=None):
    return {f.code for f in findings if level is None or f.level == level}


def test_clean_example_has_no_warnings():
    assert codes(lint(load_mapping("examples/product_catalog.yaml")), "WARN") == set()


def test_hotspot_pii_and_retention_findings():
    m = mapping_from_text(HEAD + """
families: {f: {max_versions: 1}, g: {max_versions: 1}}
ttl: {attribute: Expires, deletions: ignore}
rules:
  - row_key: "{CreatedAt}#{id}"
    columns:
      Body: {column: "f:b", timestamp: {attribute: CreatedAt}}
      Steps: {column: "g:s", as: list_versions}
      Plain: {column: "f:p"}
    indexes: [{name: by_mail, row_key: "m#{Email}#{id}", family: f, project: [Email]}]
    other_attributes: {mode: ignore}
""")
    found = lint(m)
    assert {"timestamp_first_key", "pii_in_row_key", "versions_collected", "mixed_retention",
            "ttl_never_expires"} <= codes(found, "WARN")
    assert "attributes_ignored" in codes(found, "INFO")


def test_salted_timestamp_key_is_not_a_hotspot():
    m = mapping_from_text(HEAD + 'families: {f: {}}\nrules:\n  - row_key: "{CreatedAt|salt:8}#{id}"\n'
                                 '    match: {attribute: CreatedAt, present: true}\n'
                                 '    other_attributes: {mode: ignore}\n')
    assert "timestamp_first_key" not in codes(lint(m))


def test_sample_findings():
    m = mapping_from_text(HEAD + """
families: {c: {max_versions: 2}}
rules:
  - match: {attribute: kind, equals: comment}
    row_key: "{Video}#{id}"
    columns:
      Body: {column: "c:b", timestamp: {attribute: At}}
      Video: {column: "c:v"}
      kind: {column: "c:k"}
""")
    items = [{k: from_plain(v) for k, v in d.items()} for d in (
        {"id": "1", "kind": "comment", "Video": "v", "Body": "a", "At": "2023-01-01T00:00:00"},
        {"id": "2", "kind": "other"},
        {"id": "3", "kind": "comment", "Video": "v" * 3500, "Body": "b", "At": "2023-01-01T00:00:00"},
        {"id": "4", "kind": "comment", "Video": "v", "Body": "c", "At": "bad"},
    )]
    found = lint(m, items)
    assert {"unmatched_items", "unmappable_items", "row_key_near_limit"} <= codes(found, "WARN")
    assert any("4 items checked" in f.message for f in found)


# A shop's single-table design: customers and orders in one table, one
# overloaded GSI (GSI1PK is a customer's e-mail, an order's status), as a
# mapping of one rule per entity type, each with its gsi1 index rows.
SHOP = """
source: {table: Shop, key: {partition: PK, sort: SK}}
target: {project: p, instance: i, table: shop}
families: {d: {}, g: {}}
rules:
  - name: customer
    match: {attribute: SK, equals: PROFILE}
    row_key: "{PK}#{SK}"
    other_attributes: {family: d}
    indexes: [{name: gsi1, row_key: "gsi1#{GSI1PK}#{PK}#{SK}", family: g}]
  - name: order
    match: {attribute: SK, prefix: "ORDER#"}
    row_key: "{PK}#{SK}"
    other_attributes: {family: d}
    indexes: [{name: gsi1, row_key: "gsi1#{GSI1PK}#{PK}#{SK}", family: g}]
"""
CUSTOMERS = 300
ORDER_STATUSES = ("PENDING",) * 36 + ("SHIPPED",) * 32 + ("DELIVERED",) * 32  # 36 % in one


def shop_items() -> list:
    customers = [{"PK": f"CUST#{i}", "SK": "PROFILE", "GSI1PK": f"user{i}@example.com"} for i in range(CUSTOMERS)]
    orders = [{"PK": f"CUST#{i % CUSTOMERS}", "SK": f"ORDER#{i}", "GSI1PK": status}
              for i, status in enumerate(ORDER_STATUSES)]
    return [{k: from_plain(v) for k, v in d.items()} for d in customers + orders]


def test_sampled_hotspot_is_counted_per_rule_and_index_in_a_single_table_design():
    found = [f for f in lint(mapping_from_text(SHOP), shop_items()) if f.code == "low_cardinality_prefix"]
    # Over all 400 items GSI1PK has 303 values; over the orders' index rows, 3.
    assert [(f.level, f.where) for f in found] == [("WARN", "rules[1] order: indexes[0] gsi1")]
    assert "3 distinct value(s) in the 100 sampled items" in found[0].message and "36%" in found[0].message
    assert "PENDING" not in found[0].message  # item values are not printed


def test_sampled_index_counts_only_the_items_its_conditions_hold_for():
    # One rule for both entities; the index on status holds only the orders
    # (match: Type = order). The customers' own row keys spread fine.
    m = mapping_from_text(SHOP.replace("""  - name: customer
    match: {attribute: SK, equals: PROFILE}
    row_key: "{PK}#{SK}"
    other_attributes: {family: d}
    indexes: [{name: gsi1, row_key: "gsi1#{GSI1PK}#{PK}#{SK}", family: g}]
""", "").replace('match: {attribute: SK, prefix: "ORDER#"}', "")
                        .replace('family: g}]', 'family: g, match: {attribute: SK, prefix: "ORDER#"}}]'))
    found = [f.where for f in lint(m, shop_items()) if f.code == "low_cardinality_prefix"]
    assert found == ["rules[0] order: indexes[0] gsi1"]
