"""``ddb2bt explain`` on every shape a user has at hand (explain/*.json): the exact
output, or the exact refusal, for each."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from ddb2bt.pipeline.app.cli import main
from tests.conformance.harness import fixtures
from tests.conftest import ROOT

FILES = fixtures("explain")


def run_explain(mapping_arg: str, text: str) -> tuple:
    """(exit code, stdout, stderr) of `ddb2bt explain -m M --item -` given ``text`` on stdin."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdin, sys.stdout, sys.stderr
    sys.stdin, sys.stdout, sys.stderr = io.StringIO(text), out, err
    try:
        code = main(["--log-level", "WARNING", "explain", "-m", mapping_arg, "--item", "-"])
    finally:
        sys.stdin, sys.stdout, sys.stderr = saved
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_explain_fixture(path):
    fixture = json.loads(path.read_text())
    assert run_explain(fixture["mapping"], fixture["input"]) == (fixture["exit"], fixture["stdout"], fixture["stderr"])


def test_the_command_line_of_the_issue_keeps_36_digits():
    """echo '{"Item": …}' | ddb2bt explain -m examples/product_catalog.yaml --item -"""
    digits = "123456789012345678901234567890123456"
    item = '{"Item": {"pk": {"S": "hats"}, "sk": {"S": "fedoras#brandA"}, "Weight": {"N": "%s"}}}' % digits
    done = subprocess.run([sys.executable, "-m", "ddb2bt.pipeline.app.cli", "explain", "-m", "examples/product_catalog.yaml",
                           "--item", "-"], input=item, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "  table product_catalog row b'hats#fedoras#brandA'\n" in done.stdout
    assert f"    set    SKU:Weight = b'{digits}' @1700000000000\n" in done.stdout
