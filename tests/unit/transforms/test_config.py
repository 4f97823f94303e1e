import copy

import pytest
import yaml

from ddb2bt.transforms.config import load_mapping, parse_mapping
from ddb2bt.transforms.errors import ConfigError

BASE = yaml.safe_load(open("examples/product_catalog.yaml"))


def with_change(path, value):
    data = copy.deepcopy(BASE)
    node = data
    *parents, last = path
    for p in parents:
        node = node[p]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return data


def test_example_mapping_is_valid():
    m = load_mapping("examples/product_catalog.yaml")
    assert m.source.table == "ProductCatalog"
    assert m.source.key_attributes == ("pk", "sk")
    assert m.target.table == "product_catalog"
    assert [c.attribute for c in m.rules[0].columns] == ["Description", "Price", "Thumbnail"]
    assert m.rules[0].column_for("Price").encoding == "int64"


@pytest.mark.parametrize("path,value,message", [
    (("version",), 2, "version: unsupported version 2"),
    (("source",), KeyError, "source: is required"),
    (("source", "table"), "x", "source.table: 'x' is not a valid DynamoDB table name"),
    (("source", "key", "partition"), KeyError, "source.key.partition: is required"),
    (("source", "key", "sortt"), "sk", "source.key.sortt: unknown field (did you mean 'sort'?)"),
    (("target", "table"), "bad table!", "target.table: 'bad table!' is not a valid Bigtable table id"),
    (("target", "instance"), "", "target.instance: must be a non-empty string"),
    (("families",), {}, "families: declare at least one column family"),
    (("families", "bad name"), {}, "families.bad name: 'bad name' is not a valid column family name"),
    (("families", "SKU"), {"max_versions": 0}, "families.SKU.max_versions: must be an integer ≥ 1, got 0"),
    (("delimiter",), "##", "delimiter: must be a single character"),
    (("rules",), [], "rules: must be a non-empty list of rules"),
    (("rules", 0, "row_key"), "{pk}{sk}", "rules[0].row_key: placeholders {pk} and {sk} must be separated"),
    (("rules", 0, "columns", "Price", "encoding"), "int65",
     "rules[0].columns.Price.encoding: must be one of utf8, int64"),
    (("rules", 0, "columns", "Price", "column"), "Nope:Price",
     "rules[0].columns.Price.column: family 'Nope' is not declared under 'families'"),
    (("rules", 0, "columns", "Price", "column"), "SKU",
     "rules[0].columns.Price.column: must be 'family:qualifier', got 'SKU'"),
    (("rules", 0, "columns", "Price", "column"), "SKU:Description",
     "rules[0].columns: attributes 'Description' and 'Price' both map to SKU:Description"),
    (("rules", 0, "other_attributes", "family"), KeyError, "rules[0].other_attributes.family: is required"),
    (("rules", 0, "other_attributes", "mode"), "drop", "rules[0].other_attributes.mode: must be one of"),
    (("rules", 0, "match"), {"attribute": "sk"}, "rules[0].match: give exactly one of equals, prefix, regex"),
    (("rules", 0, "match"), {"attribute": "sk", "regex": "("}, "rules[0].match.regex: invalid regular expression"),
    (("rules", 0, "colums"), {}, "rules[0].colums: unknown field (did you mean 'columns'?)"),
    (("unmatched",), "drop", "unmatched: must be one of dead_letter, skip"),
])
def test_invalid_mappings_fail_naming_the_field(path, value, message):
    with pytest.raises(ConfigError) as err:
        parse_mapping(with_change(path, value))
    assert str(err.value).startswith(message), str(err.value)


def test_duplicate_rule_names_are_refused():
    data = copy.deepcopy(BASE)
    data["rules"].append(copy.deepcopy(data["rules"][0]))
    with pytest.raises(ConfigError, match=r"rules\[1\].name: duplicate rule name 'product'"):
        parse_mapping(data)


def test_unreadable_and_invalid_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read mapping file"):
        load_mapping(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("source: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_mapping(bad)


def test_overrides_replace_only_what_is_given():
    m = load_mapping("examples/product_catalog.yaml").with_overrides(project="p2", table="t2")
    assert (m.target.project, m.target.instance, m.target.table) == ("p2", "local-instance", "t2")


def test_every_problem_is_collected_each_with_its_field_and_the_name_or_value_meant():
    from ddb2bt.transforms.config import mapping_from_text
    from ddb2bt.transforms.errors import ConfigProblems

    with pytest.raises(ConfigProblems) as err:
        mapping_from_text("""
source: {table: Things, key: {partition: id}}
target: {project: p, instance: i, table: t}
families: {f: {max_versions: 0}}
rules:
  - match: {attribute: kind, prefx: a}
    row_key: "{id}"
    columns: {Price: {column: "f:p", encoding: decmal}, Name: {column: "ff:n"}}
    other_attributes: {mode: ignore}
unmatched: skp
""")
    assert [str(p) for p in err.value.problems] == [
        "families.f.max_versions: must be an integer ≥ 1, got 0",
        "rules[0].match: give exactly one of equals, prefix, regex, present (found 'prefx': did you mean 'prefix'?)",
        "rules[0].columns.Price.encoding: must be one of utf8, int64, decimal, float64, bytes, bool, null, json, "
        "dynamodb_json, auto; got 'decmal' (did you mean 'decimal'?)",
        "rules[0].columns.Name.column: family 'ff' is not declared under 'families' (did you mean 'f'?)",
        "unmatched: must be one of dead_letter, skip; got 'skp' (did you mean 'skip'?)",
    ]
    assert str(err.value).startswith("5 problems in <text>:\n  families.f.max_versions")
