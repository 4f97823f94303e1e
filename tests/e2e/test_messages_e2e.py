"""Messages a user meets in the first hour, against the emulators: verify never
stops at one item, a missing source table is named, a run says what it did."""
from __future__ import annotations

import json
import time

import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.connect.connections import dynamodb_client
from ddb2bt.pipeline.local import workload
from tests.conftest import write_mapping

pytestmark = pytest.mark.e2e
READ_ONLY_DEADLINE_S = 30


def _setup(tmp_path, unique, prefix):
    path = write_mapping(tmp_path, source__table=f"{prefix}_{unique}", target__table=f"{prefix.lower()}_{unique}",
                         name=f"{prefix.lower()}_{unique}")
    ddb = dynamodb_client()
    workload.create_table(ddb, f"{prefix}_{unique}")
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    return path, ddb, f"{prefix}_{unique}"


def test_verify_lists_unmappable_items_and_still_compares_the_rest(stack, tmp_path, unique, capsys):
    path, ddb, table = _setup(tmp_path, unique, "Unmappable")
    for i in range(5):
        ddb.put_item(TableName=table, Item={"pk": {"S": "hats"}, "sk": {"S": f"s{i}"}, "Price": {"N": str(i)}})
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", "--poll-interval", "0.1"]) == 0
    ddb.put_item(TableName=table, Item={"pk": {"S": "hats"}, "sk": {"S": "bad"}, "Price": {"N": "1.5"}})
    ddb.put_item(TableName=table, Item={"pk": {"S": "hats"}, "sk": {"S": "s1"}, "Price": {"N": "99"}})  # stale
    capsys.readouterr()
    report = tmp_path / "report.json"
    # (the tail is stopped with the stale change pending: no re-check, it would wait for a tail)
    assert ddb2bt(["verify", "--mapping", str(path), "--report", str(report), "--recheck-wait", "0"]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT" in out and "unmappable items" in out and "1.5" not in out  # values stay redacted
    data = json.loads(report.read_text())
    assert data["unmappable_items"]["count"] == 1
    assert set(data["unmappable_items"]["examples"][0]["key"]) == {"pk", "sk"}
    assert data["tables"][f"unmappable_{unique}"]["different_cells"]["count"] == 1  # the stale cell is found


def test_run_ends_with_what_it_did_and_how_to_see_dead_letters(stack, tmp_path, unique, capsys):
    path, ddb, table = _setup(tmp_path, unique, "Counted")
    ddb.put_item(TableName=table, Item={"pk": {"S": "hats"}, "sk": {"S": "ok"}, "Price": {"N": "3"}})
    ddb.put_item(TableName=table, Item={"pk": {"S": "hats"}, "sk": {"S": "bad"}, "Price": {"N": "2.5"}})
    capsys.readouterr()
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", "--poll-interval", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "done: 1 change(s) applied, 1 dead-lettered, 0 skipped" in out
    assert f"ddb2bt dlq list --mapping {path}" in out


@pytest.mark.parametrize("command", ["verify", "status", "backfill"])
def test_a_missing_source_table_is_named(stack, tmp_path, unique, command, capsys):
    path = write_mapping(tmp_path, source__table=f"Nowhere_{unique}", name=f"nowhere_{unique}")
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    capsys.readouterr()
    started = time.monotonic()
    assert ddb2bt([command, "--mapping", str(path)]) in (1, 2)
    assert time.monotonic() - started < READ_ONLY_DEADLINE_S
    err = capsys.readouterr().err
    assert f"Nowhere_{unique}" in err and ("does not exist" in err or "not found" in err), err
    assert "Traceback" not in err and "ResourceNotFoundException" not in err
