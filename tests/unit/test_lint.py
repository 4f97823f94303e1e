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
    indexes: [{name: by_mail, row_key: "m#{Email}#{id}", family: f}]
    other_attributes: {mode: ignore}
""")
    found = lint(m)
    assert {"timestamp_first_key", "pii_in_row_key", "versions_collected", "mixed_retention",
            "ttl_never_expires"} <= codes(found, "WARN")
    assert "attributes_ignored" in codes(found, "INFO")


def test_salted_timestamp_key_is_not_a_hotspot():
    m = mapping_from_text(HEAD + 'families: {f: {}}\nrules:\n  - row_key: "{CreatedAt|salt:8}#{id}"\n'
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
