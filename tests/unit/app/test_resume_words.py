"""An interrupted job names one command, the one that resumes it: the same
command line without what starts over (`migrate --restart` would copy the table
again), and a `migrate` stopped with Ctrl-C says nothing else about resuming."""
from __future__ import annotations

import signal

from ddb2bt.pipeline.services.jobs import resume_command
from ddb2bt.pipeline.signals import current, run_command


def test_the_resume_command_is_the_same_command_without_what_starts_over():
    assert resume_command(["migrate", "--mapping", "m.yaml", "--restart", "--until-idle", "5"]) == \
        "ddb2bt migrate --mapping m.yaml --until-idle 5"
    assert resume_command(["run", "-m", "my table.yaml", "--start", "latest"]) == "ddb2bt run -m 'my table.yaml'"
    assert resume_command(["run", "--start=trim_horizon", "-m", "m.yaml"]) == "ddb2bt run -m m.yaml"


def test_ctrl_c_prints_one_resume_command(capsys):
    import ddb2bt.pipeline.services.replicate as replicate

    said = []

    def command():
        current().on_signal(signal.SIGINT)  # as the watcher thread would
        said.append(replicate.interrupted())
        return 0

    argv = ["migrate", "--mapping", "m.yaml", "--restart"]
    assert run_command(command, stop=lambda: None, grace_s=30, resume=resume_command(argv)) == 130
    err = capsys.readouterr().err
    assert said == [True]  # migrate then leaves out its own "the tail stopped; resume with: ddb2bt run"
    assert err.strip().splitlines()[-1].endswith("; resume with: ddb2bt migrate --mapping m.yaml")
    assert err.count("resume") == 1 and "run the same command" not in err
