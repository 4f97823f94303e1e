import subprocess
import sys

import pytest

from pipeline.cli import build_parser, main
from pipeline.graph import is_local
from tests.conftest import ROOT

COMMANDS = [["demo"], ["validate"], ["explain"], ["create-table"], ["run"], ["dlq"], ["dlq", "list"],
            ["local"], ["local", "up"]]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(command + ["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "usage: ddb2bt" in out
    if command[0] != "dlq" or len(command) > 1:
        assert "--" in out


def test_top_level_help_teaches_with_examples(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("demo", "run", "create-table", "dlq", "local", "validate", "explain"):
        assert cmd in out
    assert "examples:" in out


def test_validate_ok_and_config_errors_exit_2(tmp_path, capsys):
    assert main(["validate", "--mapping", str(ROOT / "examples/product_catalog.yaml")]) == 0
    assert "OK:" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("source: {table: ProductCatalog, key: {partition: pk}}\ntarget: {project: p}\n")
    assert main(["validate", "--mapping", str(bad)]) == 2
    assert "configuration error: target.instance: is required" in capsys.readouterr().err


def test_explain_plain_json_item(tmp_path, capsys):
    item = tmp_path / "item.json"
    item.write_text('{"pk": "hats", "sk": "fedoras#brandA", "Price": 30, "Description": "wool"}')
    assert main(["explain", "-m", str(ROOT / "examples/product_catalog.yaml"), "--item", str(item)]) == 0
    out = capsys.readouterr().out
    assert "row b'hats#fedoras#brandA'" in out
    assert "set    SKU:Price = b'\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x1e'" in out
    assert "delete SKU:Description in [0, 1700000000001) ms" in out


def test_unknown_options_are_only_passed_to_beam_by_run():
    args, unknown = build_parser().parse_known_args(["run", "-m", "x.yaml", "--runner=DataflowRunner", "--region=r"])
    assert unknown == ["--runner=DataflowRunner", "--region=r"]
    with pytest.raises(SystemExit):
        main(["validate", "-m", "x.yaml", "--bogus"])


@pytest.mark.parametrize("args,local", [([], True), (["--runner=DirectRunner"], True),
                                        (["--runner", "DataflowRunner"], False)])
def test_local_runner_detection(args, local):
    assert is_local(args) is local


def test_console_script_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "--help"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert "Replicate a live DynamoDB table" in out
