"""The first day on the emulators (issue 26): a second job name on a target
table another job owns is refused, naming the owner; a multi-table `migrate`
ends with the same summary as `run` — its dead letter included — and every
phase line names its table."""
from __future__ import annotations

import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.connect.connections import dynamodb_client
from ddb2bt.pipeline.local import workload
from ddb2bt.transforms.config import load_mapping
from tests.conftest import write_mapping

pytestmark = pytest.mark.e2e
TAIL = ["--poll-interval", "0.2"]


def catalog(tmp_path, unique, label: str):
    (tmp_path / label).mkdir()
    path = write_mapping(tmp_path / label, source__table=f"{label}_{unique}", target__table=f"{label}_{unique}",
                         name=f"{label}_{unique}")
    mapping = load_mapping(path)
    workload.create_table(dynamodb_client(), mapping.source.table)
    return path, mapping


def test_a_second_job_name_on_an_owned_target_table_is_refused(stack, tmp_path, unique, capsys):
    path, mapping = catalog(tmp_path, unique, "Owned")
    assert ddb2bt(["create-table", "-m", str(path)]) == 0
    ddb = dynamodb_client()
    ddb.put_item(TableName=mapping.source.table, Item={"pk": {"S": "a"}, "sk": {"S": "1"}, "Price": {"N": "1"}})
    assert ddb2bt(["run", "-m", str(path), "--until-idle", "1", *TAIL]) == 0  # the mapping's name owns it now
    capsys.readouterr()
    # the typo'd job name of the issue: refused before anything is written
    assert ddb2bt(["run", "-m", str(path), "--job-name", "shpo", "--until-idle", "1", *TAIL]) == 2
    err = capsys.readouterr().err
    assert f"is owned by job '{mapping.name}'" in err and f"--job-name {mapping.name}" in err
    assert ddb2bt(["dlq", "list", "-m", str(path), "--job-name", "shpo"]) == 0  # the refused job wrote nothing
    assert "0 dead letter(s)" in capsys.readouterr().out
    # told otherwise: the new name adopts the table, and the old one is refused from then on
    assert ddb2bt(["run", "-m", str(path), "--job-name", "shpo", "--adopt-target", "--until-idle", "1", *TAIL]) == 0
    assert ddb2bt(["run", "-m", str(path), "--until-idle", "1", *TAIL]) == 2
    assert "is owned by job 'shpo'" in capsys.readouterr().err
    # the job is retired: release-target frees the table, and any job may claim it again
    assert ddb2bt(["release-target", "-m", str(path), "--job-name", "shpo"]) == 0
    assert f"{mapping.target.table}: released by job shpo" in capsys.readouterr().out
    assert ddb2bt(["run", "-m", str(path), "--until-idle", "1", *TAIL]) == 0


def test_a_multi_table_migrate_ends_with_the_summary_and_names_its_tables_in_the_log(stack, tmp_path, unique,
                                                                                     capsys):
    (a_path, a), (b_path, b) = catalog(tmp_path, unique, "Shop"), catalog(tmp_path, unique, "Lines")
    both = ["-m", str(a_path), "-m", str(b_path)]
    assert ddb2bt(["create-table", *both]) == 0
    ddb = dynamodb_client()
    ddb.put_item(TableName=a.source.table, Item={"pk": {"S": "a"}, "sk": {"S": "1"}, "Price": {"N": "3"}})
    ddb.put_item(TableName=b.source.table, Item={"pk": {"S": "b"}, "sk": {"S": "1"}, "Price": {"N": "2.5"}})
    assert ddb2bt(["migrate", *both, "--segments", "1", "--until-idle", "1", *TAIL]) == 0
    out, err = capsys.readouterr()
    assert "migration LIVE" in out
    # the summary comes after LIVE: the dead letter is not hidden, and the hint selects its table's state
    summary = out[out.index("migration LIVE"):]
    # (the item is dead-lettered twice: once read by the backfill, once from the stream)
    assert f"  {a.name}: 2 change(s) applied, 0 dead-lettered" in summary
    assert f"  {b.name}: 0 change(s) applied, 2 dead-lettered" in summary
    assert f"ddb2bt dlq list --mapping {b_path}" in summary
    for mapping in (a, b):
        assert f"[{mapping.name}] migration phase: LIVE" in err
    assert "] migration phase:" in err and "INFO ddb2bt.pipeline.control.phases: migration phase" not in err
