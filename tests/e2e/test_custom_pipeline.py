"""examples/custom_pipeline.py, end to end on the emulators: ddb2bt's public
transforms composed with a user's own steps (a computed attribute added before
mapping, one entity type dropped after it)."""
from __future__ import annotations

import pytest

from ddb2bt.examples import custom_pipeline
from ddb2bt.pipeline.connect.connections import dynamodb_client
from ddb2bt.pipeline.verify.compare import diff_layout, expected_layout
from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.clients.bigtable.reads import read_table
from ddb2bt.transforms.config import load_mapping
from tests.conftest import write_mapping

pytestmark = pytest.mark.e2e


def test_custom_pipeline_replicates_with_the_users_steps(stack, tmp_path, unique):
    path = write_mapping(tmp_path, source__table=f"Custom_{unique}", target__table=f"custom_{unique}",
                         name=f"custom_{unique}")
    mapping = load_mapping(path)
    ddb = dynamodb_client()
    workload.create_table(ddb, mapping.source.table)
    for op in workload.operations(21, 400, 60):
        workload.apply_quietly(ddb, mapping.source.table, op)

    assert custom_pipeline.main(["--mapping", str(path), "--until-idle", "2"]) == 0

    items = workload.scan_all(ddb, mapping.source.table)
    dropped = [it for it in items if it["pk"]["S"] == custom_pipeline.DROPPED_CATEGORY]
    kept = [custom_pipeline.price_band(it) for it in items if it not in dropped]
    assert dropped and kept, "the workload must exercise both steps"
    actual = read_table(mapping.target.project, mapping.target.instance, mapping.target.table)
    diff = diff_layout(expected_layout(mapping, kept)[mapping.target.table], actual)
    assert diff.identical, diff.summary()
    bands = {cols[("SKU", b"PriceBand")][0][1] for cols in actual.values()}
    assert bands <= {b"low", b"mid", b"high"} and len(bands) >= 2
    assert not any(row.startswith(custom_pipeline.DROPPED_CATEGORY.encode() + b"#") for row in actual)
