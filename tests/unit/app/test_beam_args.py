"""Beam options reach Beam the same whether given as ``--flag value`` or
``--flag=value`` (issue 35, item 7: ``--runner DirectRunner`` made Beam warn
"Unparseable argument: DirectRunner", because the local runner's ``--runner`` was
dropped without its value)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from ddb2bt.pipeline.graph import make_pipeline
from ddb2bt.pipeline.options import joined_beam_args, without_runner

# Starting Python and importing Beam takes a few seconds on a loaded machine.
SUBPROCESS_TIMEOUT_S = 120
STDERR_SHOWN_CHARS = 2000  # the end of a failed run's stderr, where its traceback is


@pytest.fixture
def unparseable(monkeypatch):
    """The arguments Beam would warn about ("Unparseable argument: …")."""
    seen: list = []
    monkeypatch.setattr(PipelineOptions, "_warn_on_unknown_options",
                        staticmethod(lambda unknown, parser: seen.extend(unknown)))
    return seen


@pytest.mark.parametrize("runner", [["--runner", "DirectRunner"], ["--runner=DirectRunner"],
                                    ["--runner", "FnApiRunner"]])
def test_the_local_runner_is_dropped_with_its_value(runner, unparseable):
    pipeline = make_pipeline([*runner, "--job_name", "j1"])
    # what Pipeline.run does first: warn about every argument Beam cannot place
    pipeline.options.get_all_options(retain_unknown_options=True, display_warnings=True)
    assert unparseable == []
    assert pipeline.options.get_all_options()["job_name"] == "j1"


def test_both_spellings_become_one():
    spaced = ["--runner", "DataflowRunner", "--project", "p-1", "--streaming", "--dry_run",
              "--experiments", "a", "--experiments=b", "--region", "us-central1"]
    assert joined_beam_args(spaced) == ["--runner=DataflowRunner", "--project=p-1", "--streaming", "--dry_run",
                                        "--experiments=a", "--experiments=b", "--region=us-central1"]
    joined = joined_beam_args(spaced)
    assert joined_beam_args(joined) == joined  # already one spelling: unchanged
    assert without_runner(["--runner", "X", "--a=1"]) == without_runner(["--runner=X", "--a=1"]) == ["--a=1"]


def test_the_cli_hands_beam_one_spelling(monkeypatch):
    """`ddb2bt run … --runner DirectRunner --job_name j` and the `=` spelling reach
    the command with the same Beam arguments."""
    from ddb2bt.pipeline.app import cli

    seen: list = []
    monkeypatch.setattr(cli, "cmd_run", lambda args: seen.append(args.beam_args) or 0)
    parser = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with_run(parser(), cli))
    for argv in (["--runner", "DirectRunner", "--job_name", "j"], ["--runner=DirectRunner", "--job_name=j"]):
        assert cli.main(["run", "--mapping", "m.yaml", *argv]) == 0
    assert seen == [["--runner=DirectRunner", "--job_name=j"]] * 2


def _with_run(parser, cli):
    import argparse

    commands, = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    commands.choices["run"].set_defaults(func=cli.cmd_run)
    return parser


def test_a_pipeline_built_and_never_run_leaves_no_temporary_directory(tmp_path):
    """Beam removes a pipeline's temporary directory only in ``run()``: a command
    that fails while building its graph must not leave one in /tmp each time."""
    code = ("import os; from ddb2bt.pipeline.graph import make_pipeline; "
            "p = make_pipeline(['--job_name', 'j']); assert os.path.isdir(p.local_tempdir); print(p.local_tempdir)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
                         env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-STDERR_SHOWN_CHARS:]
    made = Path(out.stdout.strip())
    assert made.parent == tmp_path and made.name.startswith("beam-pipeline-temp")
    assert not made.exists()
