import subprocess
import sys

import pytest

from ddb2bt.pipeline.app.cli import build_parser, main
from ddb2bt.pipeline.graph import is_local
from tests.conftest import ROOT

COMMANDS = [["demo"], ["validate"], ["explain"], ["lint"], ["create-table"], ["run"], ["dlq"], ["dlq", "list"],
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
    err = capsys.readouterr().err
    assert f"configuration error: 3 problems in {bad}:" in err  # every one, in one run
    assert "\n  target.instance: is required\n  families: is required\n  rules: is required" in err


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
    out = subprocess.run([sys.executable, "-m", "ddb2bt.pipeline.app.cli", "--help"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert "Replicate a live DynamoDB table" in out


def test_explain_reproduces_the_seed_layouts_of_examples_2_and_3(tmp_path, capsys):
    comment = tmp_path / "comment.json"
    comment.write_text('{"pk": {"S": "0123"}, "sk": {"S": "VideoComment#98765481"}, '
                       '"Content": {"S": "I really like this. Special effects are amazing."}, '
                       '"CreatedAt": {"S": "2023-09-10T19:01:15"}}')
    assert main(["explain", "-m", str(ROOT / "examples/videos.yaml"), "--item", str(comment)]) == 0
    out = capsys.readouterr().out
    assert "table videos row b'0123'" in out
    assert "set    comments:UserComments = b'I really like this. Special effects are amazing.' @1694372475000" in out
    assert "delete comments:UserComments in [1694372475000, 1694372475001) ms" in out  # exactly its version
    payment = tmp_path / "payment.json"
    payment.write_text('{"pk": "Invoice-0123", "sk": "Payment-0680", "DateCreated": "2023-09-10T15:21:40", '
                       '"Details": {"amount_usd": 120, "bill_to": "John", "address": "123 Abc St"}}')
    assert main(["explain", "-m", str(ROOT / "examples/invoices.yaml"), "--item", str(payment)]) == 0
    out = capsys.readouterr().out
    assert "table invoices row b'0123'" in out
    assert 'set    Payment:0680 = b\'{"address":"123 Abc St","amount_usd":120,"bill_to":"John"}\' @1694359300000' in out


def test_lint_command_reports_and_strict_fails(capsys):
    assert main(["lint", "-m", str(ROOT / "examples/hr_orders.yaml")]) == 0
    assert "pii_in_row_key" in capsys.readouterr().out
    assert main(["lint", "-m", str(ROOT / "examples/hr_orders.yaml"), "--strict"]) == 1
    assert main(["lint", "-m", str(ROOT / "examples/product_catalog.yaml"), "--strict"]) == 0


def test_lint_takes_a_directory_like_validate_and_recover_says_it_takes_one_table(tmp_path, capsys):
    import shutil

    for name in ("product_catalog", "videos"):
        shutil.copy(ROOT / f"examples/{name}.yaml", tmp_path / f"{name}.yaml")
    assert main(["lint", "--mapping", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"== {tmp_path / 'product_catalog.yaml'} (product_catalog)" in out
    assert f"== {tmp_path / 'videos.yaml'} (videos)" in out and out.count("warning(s),") == 2
    assert main(["recover", "--mapping", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--mapping: 'recover' takes one mapping, got 2 (" in err and "videos.yaml" in err


def test_metrics_port_minus_one_is_off_for_every_command_that_serves_metrics(monkeypatch):
    from ddb2bt.pipeline.observe import metrics
    from ddb2bt.pipeline.app.cli import build_parser
    from ddb2bt.pipeline.services.jobs import start_metrics_server
    from ddb2bt.pipeline.options import options_by_command

    commands = sorted(c for c in options_by_command(build_parser())["--metrics-port"])
    assert {"run", "migrate", "backfill", "recover", "demo"} <= set(commands)
    for command in commands:
        args, _ = build_parser().parse_known_args(command.split() + (["-m", "x.yaml"] if command != "demo" else [])
                                                  + ["--metrics-port", "-1"])
        assert args.metrics_port == -1, command
    started = []
    monkeypatch.setattr("prometheus_client.start_http_server", lambda *a, **k: started.append(a))
    assert start_metrics_server(-1, "127.0.0.1") is None and metrics.serve_metrics(-1) is None
    assert started == []  # no server, not even on a free port


def test_beam_options_given_as_flag_value_or_flag_equals_value_work_alike(caplog, monkeypatch):
    import logging

    import ddb2bt.pipeline.app.cli as cli
    from ddb2bt.pipeline.graph import make_pipeline
    from ddb2bt.pipeline.options import joined_beam_args

    assert joined_beam_args(["--runner", "DirectRunner", "--project", "p", "--dry_run", "--region=r"]) == \
        ["--runner=DirectRunner", "--project=p", "--dry_run", "--region=r"]
    for spelling in (["--runner", "DirectRunner"], ["--runner=DirectRunner"]):
        with caplog.at_level(logging.WARNING):
            make_pipeline(spelling + ["--job_name", "j"])
        # Beam used to discard the runner's value with a warning: "Unparseable argument"
        assert not [r for r in caplog.records if "nparseable" in r.getMessage()], spelling
    seen = {}
    monkeypatch.setattr(cli, "cmd_verify", lambda args: seen.setdefault("beam_args", args.beam_args) and 0)
    assert cli.main(["verify", "-m", "example:product_catalog", "--runner", "DirectRunner"]) == 0
    assert seen["beam_args"] == ["--runner=DirectRunner"]
