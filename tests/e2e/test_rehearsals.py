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
    done = subprocess.run([sys.executable, "-m", "ddb2bt.pipeline.app.cli", "demo", "--kinesis", "--changes", "400",
                           "--rate", "1000", "--metrics-port", "-1"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=DEMO_DEADLINE_S)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "IDENTICAL" in out, out
    published = int(re.search(r"Kinesis records published\s+(\d+)", out).group(1))
    records = int(re.search(r"the table's (\d+) stream records", out).group(1))
    assert published > records, out  # some delivered twice (compared with the stream records: on ministack, as
    # on AWS, a write that changes nothing has none, so there can be fewer records than writes)
    assert "over 3 shards" in out, out
    stale = int(re.search(r"ordering guard\s+.*stale (\d+)", out).group(1))
    assert stale > 0, out  # duplicates and older changes reached the guard and wrote nothing


def test_trim_and_recover_rehearsal_with_the_commands_of_the_docs(stack, tmp_path, unique, monkeypatch, capsys):
    """docs/recover.md "Rehearse it locally", step by step: a job replicates and
    stops; the table changes; `local trim` makes the stream forget; `run` stops
    naming `ddb2bt recover`; `recover` prints the export commands, run with
    `ddb2bt local` for `aws dynamodb`; `recover --from-export` applies them; the
    tail resumes; verify: IDENTICAL. The commands' options are the docs' own
    (`--until-idle 3`, the default poll interval): a run that ends at its head
    records a head sighting, and the proof must still find the changes lost."""
    import json
    import shlex
    import signal

    from ddb2bt.pipeline.app.cli import main as ddb2bt
    from ddb2bt.pipeline.local import local_stack
    from tests.conftest import write_mapping

    monkeypatch.setenv(local_stack.STATE_DIR_ENV, str(tmp_path / "state"))
    local_stack.save_state(stack)  # the shared test stack, as `local up --detach` records its own
    path = str(write_mapping(tmp_path, "product_catalog.yaml", source__table=f"Rehearse{unique}",
                             target__table=f"rehearse_{unique}", name=f"rehearse_{unique}"))
    m = ["--mapping", path]
    try:
        assert ddb2bt(["local", "changes", *m, "--changes", "300", "--seed", "1"]) == 0
        assert ddb2bt(["create-table", *m]) == 0
        assert ddb2bt(["run", *m, "--until-idle", "3"]) == 0
        assert ddb2bt(["local", "changes", *m, "--changes", "200", "--seed", "2"]) == 0  # the job is down
        capsys.readouterr()
        assert ddb2bt(["local", "trim", *m]) == 0
        out = capsys.readouterr().out
        assert "trimming proxy" in out and "had not read 0" not in out, out
        for name, value in local_stack.load_state()["env"].items():  # eval "$(ddb2bt local env)"
            monkeypatch.setenv(name, value)
        assert ddb2bt(["local", "changes", *m, "--changes", "50", "--seed", "3"]) == 0  # after the trim: held
        capsys.readouterr()
        assert ddb2bt(["run", *m, "--until-idle", "3"]) == 1
        err = capsys.readouterr().err
        assert "LOST" in err and "ddb2bt recover" in err and "no change was lost" not in err, err
        assert ddb2bt(["status", *m]) == 1
        assert "trimmed: recover with ddb2bt recover" in capsys.readouterr().out
        assert ddb2bt(["recover", *m, "--s3-bucket", f"rehearsal-{unique}"]) == 0
        plan = [line.strip() for line in capsys.readouterr().out.splitlines()
                if line.strip().startswith("aws dynamodb export-table-to-point-in-time")]
        assert len(plan) >= 2, plan  # one window ends at the boundary, the next begins there
        exports = []
        for command in plan:
            assert ddb2bt(["local", *shlex.split(command)[2:]]) == 0
            exports.append(capsys.readouterr().out.split("--from-export ", 1)[1].split()[0])
        assert ddb2bt(["recover", *m, *[a for e in exports for a in ("--from-export", e)]]) == 0
        assert "recovered:" in capsys.readouterr().out
        assert ddb2bt(["run", *m, "--until-idle", "3"]) == 0
        report = tmp_path / "verify.json"
        assert ddb2bt(["verify", *m, "--report", str(report)]) == 0
        assert json.loads(report.read_text())["identical"]
    finally:
        proxy = (local_stack.load_state() or {}).get("pids", {}).get("trim-proxy")
        if proxy:  # only what the test started: the shared stack keeps running
            os.killpg(proxy, signal.SIGTERM)
