"""Strict options and clear messages: typos and out-of-range numbers are refused
before anything starts, errors say what to do only when it applies, and a closed
pipe is not an error worth a traceback."""
from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

from ddb2bt.pipeline.app.cli import RESUME_HINT, main, report_outcome, start_metrics_server
from ddb2bt.pipeline.options import check_beam_args, number
from ddb2bt.transforms.errors import ConfigError
from tests.conftest import ROOT

MAPPING = str(ROOT / "examples/product_catalog.yaml")


def refused(argv: list, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_a_misspelled_option_is_refused_with_a_suggestion(capsys):
    err = refused(["run", "--mapping", MAPPING, "--until-idel", "3"], capsys)
    assert "unknown option: --until-idel (did you mean --until-idle?)" in err
    err = refused(["status", "--mapping", MAPPING, "--jsn"], capsys)
    assert "--jsn (did you mean --json?)" in err


def test_every_command_suggests_the_option_meant_even_when_a_required_one_is_then_missing(capsys):
    """`status --maping m.yaml` misses the required --mapping too: the misspelling
    is what to say, as for `migrate --until-idel`, whatever the command."""
    for argv in (["status", "--maping", MAPPING], ["verify", "--maping", MAPPING], ["migrate", "--maping", MAPPING],
                 ["dlq", "list", "--maping", MAPPING], ["create-table", "--maping", MAPPING]):
        err = refused(argv, capsys)
        assert "unknown option: --maping (did you mean --mapping?)" in err, (argv, err)
        assert "required" not in err, (argv, err)


def test_an_option_of_another_command_is_named_as_such_not_guessed_among_beams(capsys):
    """`run` has no --segments: say whose option it is, rather than offer one of
    Beam's hundreds of options that happens to look a little alike."""
    err = refused(["run", "--mapping", MAPPING, "--segment", "4"], capsys)
    assert "--segment (--segments is an option of `backfill`, `migrate`, `verify`, not of this command)" in err
    assert "user_agent" not in err
    err = refused(["run", "--mapping", MAPPING, "--num_worker", "4"], capsys)
    assert "--num_worker (did you mean --num_workers?)" in err, "Beam's own options are still suggested"


def test_beam_options_pass_and_unknown_runners_are_named(capsys):
    assert check_beam_args(["--project=p", "--region", "us-central1", "--num_workers=3"], []) is None
    err = refused(["run", "--mapping", MAPPING, "--runner=Bogus"], capsys)
    assert "--runner Bogus: unknown runner" in err and "--project" not in err
    assert check_beam_args(["--runner", "DataflowRunner"], []) is None


@pytest.mark.parametrize("option,value,message", [
    ("--until-idle", "-1", "must be greater than 0, got -1"),
    ("--until-idle", "soon", "'soon' is not a number"),
    ("--partitions", "0", "must be at least 1, got 0"),
    ("--metrics-port", "70000", "must be at most 65535, got 70000"),
    ("--poll-interval", "0", "must be greater than 0, got 0"),
])
def test_numbers_out_of_range_are_refused(option, value, message, capsys):
    err = refused(["run", "--mapping", MAPPING, option, value], capsys)
    assert f"argument {option}: {message}" in err


def test_number_type_bounds():
    parse = number(float, above=0, maximum=1)
    assert parse("0.5") == 0.5 and parse("1") == 1.0
    for bad in ("0", "1.01", "x"):
        with pytest.raises(Exception):
            parse(bad)
    assert number(int, minimum=1)("7") == 7


def test_a_busy_metrics_port_is_named_as_the_metrics_port():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError) as exc:
            start_metrics_server(port, "127.0.0.1")
    assert "--metrics-port" in str(exc.value) and "metrics port" in str(exc.value)


def test_no_resume_hint_where_no_job_ran(tmp_path, capsys):
    bad = tmp_path / "item.json"
    bad.write_text("{not json")
    assert main(["explain", "--mapping", MAPPING, "--item", str(bad)]) != 0
    err = capsys.readouterr().err
    assert "ddb2bt:" in err and RESUME_HINT.strip() not in err


def test_run_outcome_names_dead_letters_and_how_to_inspect_them():
    quiet = report_outcome({"applied": 5, "dead_lettered": 0, "skipped": 1}, "--mapping m.yaml")
    assert quiet == "done: 5 change(s) applied, 0 dead-lettered, 1 skipped"
    loud = report_outcome({"applied": 5, "dead_lettered": 2, "skipped": 0}, "--mapping m.yaml")
    assert "2 dead-lettered" in loud and "ddb2bt dlq list --mapping m.yaml" in loud and "dlq redrive" in loud


def test_a_closed_pipe_is_quiet():
    script = textwrap.dedent("""
        import sys
        from ddb2bt.pipeline.app import cli
        def flood(args):
            for i in range(200_000):
                print("letter", i)
            return 0
        cli.cmd_examples = flood
        parser = cli.build_parser
        def patched():
            p = parser()
            for a in p._actions:
                if hasattr(a, "choices") and isinstance(a.choices, dict) and "examples" in a.choices:
                    a.choices["examples"].set_defaults(func=flood)
            return p
        cli.build_parser = patched
        sys.exit(cli.main(["examples"]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # like `| head -1`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_validate_suggests_a_misspelt_required_key(tmp_path, capsys):
    bad = tmp_path / "typo.yaml"
    bad.write_text((ROOT / "examples/product_catalog.yaml").read_text().replace("  instance:", "  instanse:"))
    assert main(["validate", "--mapping", str(bad)]) == 2
    assert "target.instance: is required (found 'instanse': did you mean 'instance'?)" in capsys.readouterr().err


def test_validate_refuses_a_row_key_placeholder_typo(tmp_path, capsys):
    # Changed on purpose (issue 35): this was a warning (exit 0) while every item
    # would be a dead letter.
    typo = tmp_path / "placeholder.yaml"
    typo.write_text((ROOT / "examples/product_catalog.yaml").read_text().replace('"{pk}#{sk}"', '"{pk}#{skk}"'))
    assert main(["validate", "--mapping", str(typo)]) == 2
    captured = capsys.readouterr()
    assert "rules[0].row_key: {skk}" in captured.err and "did you mean {sk}?" in captured.err
    assert "OK:" not in captured.out
    assert main(["validate", "--mapping", MAPPING, "--strict"]) == 0  # the examples are clean


def test_validate_reports_every_mistake_of_a_mapping_in_one_run(tmp_path, capsys):
    text = (ROOT / "examples/product_catalog.yaml").read_text()
    mistakes = {'"{pk}#{sk}"': '"{pkk}#{sk}"',  # a row-key placeholder naming no attribute
                "encoding: utf8}": "encoding: utf88}",  # an enum value misspelt
                'Price", encoding:': 'Price", encodng:',  # a misspelt field
                "max_versions: 1": "max_version: 1"}  # another, in a family
    for old, new in mistakes.items():
        assert old in text, old
        text = text.replace(old, new, 1)
    bad = tmp_path / "four.yaml"
    bad.write_text(text)
    assert main(["validate", "--mapping", str(bad), "--mapping", MAPPING]) == 2
    out = capsys.readouterr()
    assert f"configuration error: 4 problems in {bad}:\n" in out.err, out.err
    assert "rules[0].row_key: {pkk}" in out.err and "did you mean {pk}?" in out.err
    assert "rules[0].columns.Description.encoding: must be one of" in out.err
    assert "got 'utf88' (did you mean 'utf8'?)" in out.err
    assert "rules[0].columns.Price.encodng: unknown field (did you mean 'encoding'?)" in out.err
    assert "families.SKU.max_version: unknown field (did you mean 'max_versions'?)" in out.err
    assert f"OK: {MAPPING}" in out.out  # the other file is still checked


def test_the_backfill_scan_gives_up_after_the_dynamodb_deadline():
    from ddb2bt.pipeline.app.cli import build_parser
    from ddb2bt.pipeline.services.jobs import backfill_options

    args = build_parser().parse_args(["backfill", "--mapping", MAPPING, "--dynamodb-deadline", "42"])
    assert backfill_options(args).scan_retry.deadline_s == 42
    default = build_parser().parse_args(["backfill", "--mapping", MAPPING])
    assert backfill_options(default).scan_retry.deadline_s == default.dynamodb_deadline
