"""A stream of the wrong view type is told apart from no stream, and both name
the commands that fix them."""
from __future__ import annotations

import pytest

from ddb2bt.pipeline.connect.preflight import resolve_stream
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.errors import ConfigError

MAPPING = "examples/hr_orders.yaml"


class Table:
    def __init__(self, spec):
        self.spec = spec

    def describe_table(self, TableName):
        return {"Table": {"TableName": TableName, "StreamSpecification": self.spec,
                          "LatestStreamArn": f"arn:aws:dynamodb:us-east-1:1:table/{TableName}/stream/1"}}


@pytest.mark.parametrize("spec, fix", [
    ({"StreamEnabled": False}, "StreamEnabled=true,StreamViewType=NEW_AND_OLD_IMAGES"),
    ({"StreamEnabled": True, "StreamViewType": "KEYS_ONLY"}, "StreamEnabled=false, then aws dynamodb update-table"),
])
def test_a_missing_or_keys_only_stream_names_the_fix(spec, fix):
    mapping = load_mapping(MAPPING)
    with pytest.raises(ConfigError) as err:
        resolve_stream(mapping, Table(spec))
    text = str(err.value)
    assert f"aws dynamodb update-table --table-name {mapping.source.table} --stream-specification" in text
    assert fix in text and "StreamViewType=NEW_AND_OLD_IMAGES" in text
