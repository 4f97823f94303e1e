"""Where a restarted job starts (docs/design.md §6.3): a job first run with
`--start latest` on a quiet table has no checkpoint; the changes made while it
is down must not be skipped by the next run."""
from __future__ import annotations

import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.connect.connections import dynamodb_client
from ddb2bt.pipeline.verify.compare import diff_layout, expected_layout
from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.clients.bigtable.reads import read_table
from ddb2bt.transforms.config import load_mapping
from tests.conftest import write_mapping

pytestmark = pytest.mark.e2e
RUN = ["--until-idle", "2", "--poll-interval", "0.2"]


def test_a_quiet_job_restarted_reads_what_was_written_while_it_was_down(stack, tmp_path, unique, capsys):
    path = write_mapping(tmp_path, source__table=f"Quiet_{unique}", target__table=f"quiet_{unique}",
                         name=f"quiet_{unique}")
    mapping = load_mapping(path)
    ddb = dynamodb_client()
    workload.create_table(ddb, mapping.source.table)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    assert ddb2bt(["run", "--mapping", str(path), "--start", "latest", *RUN]) == 0  # quiet: no checkpoint
    for op in workload.operations(5, 40, 10):  # written while the job is down
        workload.apply_quietly(ddb, mapping.source.table, op)
    capsys.readouterr()
    assert ddb2bt(["run", "--mapping", str(path), "--start", "latest", *RUN]) == 2
    err = capsys.readouterr().err
    assert "--start" in err and "already run" in err and "TRIM_HORIZON" in err
    assert ddb2bt(["run", "--mapping", str(path), *RUN]) == 0  # the restart as documented
    items = workload.scan_all(ddb, mapping.source.table)
    assert items
    actual = read_table(mapping.target.project, mapping.target.instance, mapping.target.table)
    diff = diff_layout(expected_layout(mapping, items)[mapping.target.table], actual)
    assert diff.identical, diff.summary()
