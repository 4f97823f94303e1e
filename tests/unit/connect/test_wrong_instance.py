"""A wrong --bigtable-instance, against the emulators: every command names the
project and instance it looked in, and the command it suggests carries the
overrides it was given (so it creates or reads the table where the job looks),
instead of a raw ``ReadRows failed: NOT_FOUND``."""
from __future__ import annotations

import shutil

import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.connect.preflight import check_target, create_table_command
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.errors import ConfigError
from tests.conftest import ROOT

WRONG = ["--bigtable-project", "local-project", "--bigtable-instance"]


def catalog(tmp_path):
    path = tmp_path / "m.yaml"
    shutil.copy(ROOT / "examples" / "product_catalog.yaml", path)
    return path


def test_the_suggested_create_table_carries_the_overrides():
    mapping = load_mapping(str(ROOT / "examples" / "product_catalog.yaml"))
    assert create_table_command(mapping).endswith("product_catalog.yaml")  # nothing given: nothing added
    moved = mapping.with_overrides(None, "other inst", "t2")
    assert create_table_command(moved).endswith("product_catalog.yaml --bigtable-instance 'other inst' "
                                                "--bigtable-table t2")


def test_run_names_the_instance_and_suggests_create_table_with_it(stack, tmp_path, unique):
    mapping = load_mapping(str(catalog(tmp_path))).with_overrides("local-project", f"wrong-{unique}")
    with pytest.raises(ConfigError) as err:
        check_target(mapping)
    message = str(err.value)
    assert f"project 'local-project', instance 'wrong-{unique}'" in message
    assert f"ddb2bt create-table --mapping {tmp_path / 'm.yaml'} --bigtable-project local-project " \
           f"--bigtable-instance wrong-{unique}" in message


@pytest.mark.parametrize("command", ["verify", "status"])
def test_verify_and_status_name_the_instance_not_a_raw_not_found(stack, tmp_path, unique, capsys, command):
    args = [command, "-m", str(catalog(tmp_path)), *WRONG, f"wrong-{unique}"]
    assert ddb2bt(args + (["--recheck-wait", "0"] if command == "verify" else [])) == 2  # a configuration error
    captured = capsys.readouterr()
    said = captured.out + captured.err
    assert "NOT_FOUND" not in said and "ReadRows failed" not in said
    assert f"instance 'wrong-{unique}'" in said, said
    assert f"--bigtable-instance wrong-{unique}" in said
