"""The shipped JSON Schema accepts every example and rejects what the parser rejects."""
import json
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.unit.transforms.test_config import with_change

SCHEMA = json.loads(resources.files("transforms").joinpath("mapping.schema.json").read_text())
EXAMPLES = sorted(Path("examples").glob("*.yaml"))


def test_schema_is_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_validates(path):
    jsonschema.validate(yaml.safe_load(path.read_text()), SCHEMA)


@pytest.mark.parametrize("path,value", [
    (("version",), 2),
    (("source",), KeyError),
    (("source", "key", "sortt"), "sk"),
    (("target", "table"), "bad table!"),
    (("families",), {}),
    (("families", "bad name"), {}),
    (("families", "SKU"), {"max_versions": 0}),
    (("delimiter",), "##"),
    (("rules",), []),
    (("rules", 0, "columns", "Price", "encoding"), "int65"),
    (("rules", 0, "columns", "Price", "column"), "SKU"),
    (("rules", 0, "other_attributes", "mode"), "drop"),
    (("rules", 0, "match"), {"attribute": "sk"}),
    (("rules", 0, "colums"), {}),
    (("unmatched",), "drop"),
])
def test_schema_rejects_what_the_parser_rejects(path, value):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(with_change(path, value), SCHEMA)
