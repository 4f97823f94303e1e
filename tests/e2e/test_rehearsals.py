"""Rehearsals on the local stack, as docs/kinesis.md and docs/recover.md tell a
new user to run them: `ddb2bt demo --kinesis` (a Kinesis-sourced job end to end)
and a trim-and-recover rehearsal with `ddb2bt local changes / trim /
export-table-to-point-in-time` and the commands of docs/recover.md, each ending
IDENTICAL."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e
DEMO_DEADLINE_S = 300  # the demo's own stack, 400 changes, the idle wait: a minute on a busy 2-core box


def test_demo_kinesis_replicates_a_shuffled_duplicated_stream_of_several_shards(tmp_path):
    """What docs/kinesis.md "Try it locally" runs: its own stack, the changes
    delivered out of order and some twice over several shards, the ordering guard
    absorbing them, the target equal to the table."""
    env = dict(os.environ, DDB2BT_STATE_DIR=str(tmp_path / "state"), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "ddb2bt.pipeline.cli", "demo", "--kinesis", "--changes", "400",
                           "--rate", "1000", "--metrics-port", "-1"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=DEMO_DEADLINE_S)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "IDENTICAL" in out, out
    published = int(re.search(r"Kinesis records published\s+(\d+)", out).group(1))
    written = int(re.search(r"changes written to DynamoDB\s+(\d+)", out).group(1))
    assert published > written, out  # some delivered twice
    assert "over 3 shards" in out, out
    stale = int(re.search(r"ordering guard\s+.*stale (\d+)", out).group(1))
    assert stale > 0, out  # duplicates and older changes reached the guard and wrote nothing
