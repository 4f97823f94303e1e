"""The CLI is the face (issue 32, step 4): it parses, calls one service per
command and prints. What a command does (orchestration, threads, state writes)
lives in its service (``pipeline/services/``, ``pipeline/app/local_commands.py``)."""
from __future__ import annotations

import ast

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CLI = ROOT / "pipeline" / "app" / "cli.py"
# Issue 32's budget for the CLI outside its argparse declarations: room for the
# dispatch (main), the parser's helpers and the commands still kept here, not for
# a command's work (the CLI had grown back to 962 such lines, with a thread).
MAX_LINES_OUTSIDE_ARGPARSE = 600
# Modules whose import means a command's work is done in the face.
FORBIDDEN_IN_THE_FACE = ("threading", "concurrent.futures")


def is_argparse_declaration(node: ast.AST) -> bool:
    """build_parser and the add_*_args helpers: declarations, not behaviour."""
    return isinstance(node, ast.FunctionDef) and (
        node.name == "build_parser" or (node.name.startswith("add_") and node.name.endswith(("_args", "_arg"))))


def lines_outside_argparse(source: str) -> int:
    tree = ast.parse(source)
    declared = sum(node.end_lineno - (node.decorator_list[0].lineno if node.decorator_list else node.lineno) + 1
                   for node in tree.body if is_argparse_declaration(node))
    return len(source.splitlines()) - declared


def forbidden_imports(source: str) -> list:
    """The imports (inside functions too) that would put a command's threads in the face."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found += [n for n in names if n.startswith(FORBIDDEN_IN_THE_FACE)]
    return found


def test_the_cli_parses_and_calls_a_service_per_command():
    source = CLI.read_text()
    assert lines_outside_argparse(source) <= MAX_LINES_OUTSIDE_ARGPARSE
    assert forbidden_imports(source) == []


def test_the_face_checks_can_fail():
    body = "def cmd_x(args):\n    import threading\n    return threading.Event()\n"
    parser = "def build_parser():\n    return None\n\n\ndef add_x_args(p):\n    pass\n"
    assert forbidden_imports(body) == ["threading"]
    assert forbidden_imports("from concurrent.futures import ThreadPoolExecutor\n") == ["concurrent.futures"]
    assert lines_outside_argparse(body + parser) == 3 + 2  # the command and the two blank lines between
    assert lines_outside_argparse(body * (MAX_LINES_OUTSIDE_ARGPARSE // 3 + 1)) > MAX_LINES_OUTSIDE_ARGPARSE


def commands_defined_in(source: str) -> list:
    """The ``cmd_*`` functions a module defines: in the face there are none (each
    command's work, its state writes included, is in its service)."""
    return [node.name for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("cmd_")]


def test_every_command_is_a_service_the_cli_imports():
    assert commands_defined_in(CLI.read_text()) == []
    assert commands_defined_in("def cmd_status(args):\n    return 0\n") == ["cmd_status"]


# Commands that read a file or print, and never build a pipeline: Beam (~1.5 s of
# CPU to import, most of a CLI start) must not be loaded for them.
LIGHT_COMMANDS = (["--help"], ["validate", "--mapping", "examples"],
                  ["explain", "-m", "examples/product_catalog.yaml", "--item", "-"],
                  ["lint", "--mapping", "examples/product_catalog.yaml"])


def _beam_loaded_by(argv: list, prelude: str = "") -> bool:
    import subprocess
    import sys

    code = (f"import sys\n{prelude}\nfrom ddb2bt.pipeline.app.program import main\n"
            f"sys.argv = ['ddb2bt'] + {argv!r}\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('BEAM', 'apache_beam' in sys.modules, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], input='{"sku": {"S": "a"}}', capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[3], timeout=120)
    verdict = [line for line in done.stderr.splitlines() if line.startswith("BEAM ")]
    assert verdict, done.stderr
    return verdict[-1] == "BEAM True"


@pytest.mark.parametrize("argv", LIGHT_COMMANDS, ids=lambda a: a[0].lstrip("-"))
def test_commands_that_build_no_pipeline_start_without_importing_beam(argv):
    assert not _beam_loaded_by(argv)


def test_the_beam_import_check_can_fail():
    # what `validate` did before: reach a module that imports the sink (and Beam)
    assert _beam_loaded_by(["--help"], prelude="import ddb2bt.pipeline.recover.recover")
