"""Choosing the local stack's AWS emulator: a wrong name is a clear error naming
where it came from and what is allowed; a stream retention only where the emulator
can trim (ministack)."""
from __future__ import annotations

import pytest

from ddb2bt.pipeline.local.local_stack import (DEFAULT_DYNAMODB, DYNAMODB_ENV, MINISTACK, MOTO, LocalStack,
                                               StackError, default_dynamodb)


def test_the_default_and_the_variable(monkeypatch):
    monkeypatch.delenv(DYNAMODB_ENV, raising=False)
    assert default_dynamodb() == DEFAULT_DYNAMODB == MINISTACK
    assert LocalStack().dynamodb == MINISTACK
    monkeypatch.setenv(DYNAMODB_ENV, MOTO)
    assert LocalStack().dynamodb == MOTO


def test_a_wrong_name_says_where_it_came_from_and_what_is_allowed(monkeypatch):
    monkeypatch.setenv(DYNAMODB_ENV, "localstack")
    with pytest.raises(StackError) as err:
        default_dynamodb()
    assert DYNAMODB_ENV in str(err.value) and "'localstack'" in str(err.value)
    assert "moto, ministack" in str(err.value)
    with pytest.raises(StackError, match="moto, ministack"):
        LocalStack(dynamodb="dynalite")


def test_only_ministack_takes_a_stream_retention():
    with pytest.raises(StackError, match="moto never trims"):
        LocalStack(dynamodb=MOTO, stream_retention_s=5)
    assert LocalStack(dynamodb=MINISTACK, stream_retention_s=5).stream_retention_s == 5


def test_ministack_runs_from_its_own_virtualenv_next_to_this_one(monkeypatch, tmp_path):
    """ministack pins one botocore release, so setup.sh gives it .venv-ministack
    beside .venv (the project's boto3 moves on); the stack starts it from there."""
    import sys

    from ddb2bt.pipeline.local import local_stack as ls

    monkeypatch.delenv(ls.MINISTACK_PYTHON_ENV, raising=False)
    python = tmp_path / ls.MINISTACK_VENV / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / ".venv"))
    assert ls.find_ministack_python() == str(python)
    monkeypatch.setenv(ls.MINISTACK_PYTHON_ENV, str(python))
    assert ls.find_ministack_python() == str(python)


def test_a_missing_ministack_says_how_to_install_it(monkeypatch, tmp_path):
    import importlib.util
    import sys

    from ddb2bt.pipeline.local import local_stack as ls

    monkeypatch.setenv(ls.MINISTACK_PYTHON_ENV, str(tmp_path / "nope"))
    with pytest.raises(StackError) as err:
        ls.find_ministack_python()
    assert f"{ls.MINISTACK_PYTHON_ENV}={tmp_path / 'nope'} is not an executable" in str(err.value)
    monkeypatch.delenv(ls.MINISTACK_PYTHON_ENV)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / ".venv"))
    monkeypatch.setattr(ls, "__file__", str(tmp_path / "pipeline" / "local" / "local_stack.py"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(StackError) as err:
        ls.find_ministack_python()
    for hint in ("deploy/local/setup.sh", ls.MINISTACK_REQUIREMENT, ls.MINISTACK_PYTHON_ENV, "--dynamodb moto"):
        assert hint in str(err.value)


def test_the_ministack_launcher_imports_nothing_of_ddb2bt():
    """It runs under ministack's Python, where ddb2bt is not installed."""
    import ast

    from ddb2bt.pipeline.local.local_stack import MINISTACK_LAUNCHER

    tree = ast.parse(MINISTACK_LAUNCHER.read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and m.split(".")[0] == "ddb2bt"}, imported
