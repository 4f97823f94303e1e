"""The CLI is the face (issue 32, step 4): it parses, calls one service per
command and prints. What a command does (orchestration, threads, state writes)
lives in its service (``pipeline/services/``, ``pipeline/app/local_commands.py``)."""
from __future__ import annotations

import ast
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
