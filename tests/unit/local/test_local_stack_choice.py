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


def _fake_sdk(tmp_path, name: str, with_emulator: bool):
    """A Cloud CLI install: <root>/bin/gcloud that notes each call and answers
    `gcloud info` with ``answer`` (written later), maybe with the emulator."""
    root = tmp_path / name
    (root / "bin").mkdir(parents=True)
    if with_emulator:
        emu = root / "platform" / "bigtable-emulator" / "cbtemulator"
        emu.parent.mkdir(parents=True)
        emu.write_text("#!/bin/sh\n")
        emu.chmod(0o755)
    gcloud = root / "bin" / "gcloud"
    gcloud.write_text(f'#!/bin/sh\necho called >> "{tmp_path}/gcloud-calls"\n/bin/cat "{tmp_path}/answer" 2>/dev/null\n')
    gcloud.chmod(0o755)
    return root


def test_the_emulator_next_to_gcloud_is_found_without_running_gcloud(tmp_path, monkeypatch):
    from ddb2bt.pipeline.local import local_stack
    root = _fake_sdk(tmp_path, "sdk", with_emulator=True)
    monkeypatch.delenv("CBTEMULATOR", raising=False)
    monkeypatch.setenv("PATH", str(root / "bin"))
    monkeypatch.setattr(local_stack, "USUAL_SDK_ROOTS", ())
    assert local_stack.find_cbtemulator() == str(root / "platform" / "bigtable-emulator" / "cbtemulator")
    assert not (tmp_path / "gcloud-calls").exists()  # ~1 s of CPU saved per stack


def test_gcloud_info_is_asked_when_the_usual_places_hold_no_emulator(tmp_path, monkeypatch):
    from ddb2bt.pipeline.local import local_stack
    shim = _fake_sdk(tmp_path, "shim", with_emulator=False)  # e.g. a gcloud wrapper script
    real = _fake_sdk(tmp_path, "real", with_emulator=True)
    (tmp_path / "answer").write_text(f"{real}\n")
    monkeypatch.delenv("CBTEMULATOR", raising=False)
    monkeypatch.setenv("PATH", str(shim / "bin"))
    monkeypatch.setattr(local_stack, "USUAL_SDK_ROOTS", ())
    assert local_stack.find_cbtemulator() == str(real / "platform" / "bigtable-emulator" / "cbtemulator")
    assert (tmp_path / "gcloud-calls").read_text().count("called") == 1
    (tmp_path / "answer").unlink()
    with pytest.raises(local_stack.StackError, match="install"):
        local_stack.find_cbtemulator()
