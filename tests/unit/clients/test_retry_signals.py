"""Failures that speak (the retry loop's warnings and final error) and Ctrl-C /
SIGTERM handling (ddb2bt.pipeline.signals)."""
from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ddb2bt.pipeline.clients import retry
from ddb2bt.pipeline.clients.retry import RetryPolicy, retrying
from ddb2bt.pipeline.signals import EXIT_INTERRUPTED, INTERRUPTED, current, on_exit, run_command
from ddb2bt.pipeline.clients.bigtable.errors import BigtablePermanent, BigtableRetryable
from tests.conftest import ROOT


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def failing(clock: Clock, until: float, exc=lambda: BigtableRetryable("ReadRows failed: UNAVAILABLE: down",
                                                                        code="UNAVAILABLE")):
    calls = []

    def fn():
        calls.append(clock.t)
        clock.t += 0.05  # each attempt takes a little time
        if clock.t < until:
            raise exc()
        return "ok"
    return fn, calls


def test_the_first_failure_is_a_warning_naming_what_where_code_and_deadline(caplog):
    clock = Clock()
    fn, calls = failing(clock, until=100.3)
    caplog.set_level(logging.WARNING, "ddb2bt.pipeline.clients.retry")
    r = retrying(RetryPolicy(0.1, 1.0, 60.0), "ReadRows on ddb2bt_state", sleep=clock.sleep,
                 where="Bigtable (emulator 127.0.0.1:9)", clock=clock)
    assert r(fn) == "ok"
    first = caplog.records[0].getMessage()
    assert caplog.records[0].levelno == logging.WARNING
    assert first.startswith("ReadRows on ddb2bt_state at Bigtable (emulator 127.0.0.1:9) failing for 0.0s (1 attempt)")
    assert "UNAVAILABLE" in first and "giving up in 60s" in first
    assert "recovered" in caplog.records[-1].getMessage()


def test_warnings_back_off_while_a_call_keeps_failing(caplog):
    clock = Clock()
    fn, calls = failing(clock, until=10_000.0)
    caplog.set_level(logging.WARNING, "ddb2bt.pipeline.clients.retry")
    r = retrying(RetryPolicy(0.1, 2.0, 300.0), "MutateRows on t", sleep=clock.sleep, where="Bigtable (x)",
                 clock=clock)
    with pytest.raises(BigtableRetryable) as err:
        r(fn)
    failing_for = [float(m.getMessage().split("failing for ")[1].split("s")[0]) for m in caplog.records]
    assert len(calls) > 150 and 8 <= len(failing_for) <= 20  # backoff: far fewer lines than attempts
    assert failing_for[0] < 0.1
    gaps = [b - a for a, b in zip(failing_for, failing_for[1:])]
    assert max(gaps) <= retry.MAX_LOG_GAP_S + 2.5  # never silent for long
    msg = str(err.value)
    assert msg.startswith("gave up on MutateRows on t at Bigtable (x) after 30") and "deadline 300s" in msg
    assert "UNAVAILABLE" in msg and err.value.code == "UNAVAILABLE"
    assert isinstance(err.value.__cause__, BigtableRetryable)


def test_permanent_errors_are_not_retried():
    clock = Clock()
    fn, calls = failing(clock, until=10_000.0, exc=lambda: BigtablePermanent("NOT_FOUND", code="NOT_FOUND"))
    with pytest.raises(BigtablePermanent):
        retrying(RetryPolicy(0.1, 1.0, 60.0), "x", sleep=clock.sleep, clock=clock)(fn)
    assert len(calls) == 1


def test_a_check_between_attempts_ends_the_retrying(monkeypatch):
    clock = Clock()
    fn, calls = failing(clock, until=10_000.0)

    class Lost(Exception):
        pass

    def check():
        if len(calls) >= 3:
            raise Lost()

    with pytest.raises(Lost):
        retrying(RetryPolicy(0.1, 1.0, 60.0), "x", sleep=clock.sleep, clock=clock, between_attempts=check)(fn)
    assert len(calls) == 3


def test_an_interrupted_command_stops_gracefully_runs_its_cleanups_and_exits_130(capsys):
    stops, cleanups = [], []

    def command():
        assert on_exit(lambda: cleanups.append("released"))
        current().on_signal(signal.SIGTERM)  # as the watcher thread would
        assert stops == ["stop"]
        return 0  # the job ended cleanly after the stop request

    assert run_command(command, stop=lambda: stops.append("stop"), grace_s=30) == EXIT_INTERRUPTED
    assert cleanups == ["released"]
    err = capsys.readouterr().err
    assert "SIGTERM: stopping" in err and err.strip().splitlines()[-1] == INTERRUPTED
    assert current() is None and not on_exit(lambda: None)


def test_an_interrupted_job_that_checkpoints_nothing_claims_no_checkpoints(capsys):
    """verify runs a Beam job but checkpoints nothing: its last line says only
    that it was interrupted."""
    from ddb2bt.pipeline.signals import INTERRUPTED_NO_JOB

    def command():
        current().on_signal(signal.SIGINT)
        return 0

    assert run_command(command, stop=lambda: None, grace_s=30, resume="ddb2bt verify -m m.yaml",
                       checkpoints=False) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == INTERRUPTED_NO_JOB and "checkpointed" not in err.splitlines()[-1]


def test_the_cli_marks_verify_as_a_job_that_checkpoints_nothing():
    from ddb2bt.pipeline.app.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["verify", "-m", "m.yaml"]).checkpoints is False
    assert getattr(parser.parse_args(["run", "-m", "m.yaml"]), "checkpoints", True) is True


def test_an_error_after_an_interruption_is_reported_as_the_interruption(capsys):
    def command():
        current().on_signal(signal.SIGINT)
        raise RuntimeError("teardown noise")

    assert run_command(command, stop=lambda: None, grace_s=30) == EXIT_INTERRUPTED
    assert "teardown noise" not in capsys.readouterr().err


def test_commands_without_a_job_run_unchanged():
    assert run_command(lambda: 3, enabled=False) == 3
    with pytest.raises(ValueError):
        run_command(lambda: (_ for _ in ()).throw(ValueError("x")))


def test_in_a_thread_no_handlers_are_installed_but_cleanups_still_run():
    out = []

    def command():
        on_exit(lambda: out.append("cleaned"))
        return 0

    t = threading.Thread(target=lambda: out.append(run_command(command)))
    t.start()
    t.join(5)
    assert out == ["cleaned", 0]


SCRIPT = textwrap.dedent("""
    import sys, time
    from ddb2bt.pipeline.signals import run_command
    def job():  # a job that ignores the stop request (a reader stuck in a call)
        print("ready", flush=True)
        time.sleep(60)
        return 0
    sys.exit(run_command(job, stop=lambda: None, grace_s=float(sys.argv[1])))
""")


def _spawn(grace: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, grace], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_a_second_ctrl_c_exits_at_once():
    p = _spawn("30")
    p.send_signal(signal.SIGINT)
    time.sleep(0.3)
    sent = time.monotonic()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=10)
    assert time.monotonic() - sent < 1.5
    assert p.returncode == EXIT_INTERRUPTED and "Traceback" not in err
    assert err.strip().splitlines()[-1] == INTERRUPTED


def test_sigterm_ends_a_stuck_job_after_the_grace_period():
    p = _spawn("1")
    sent = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=10)
    assert 0.9 < time.monotonic() - sent < 3
    assert p.returncode == EXIT_INTERRUPTED and "Traceback" not in err and "SIGTERM: stopping" in err


HOOKED = textwrap.dedent("""
    import sys, time
    from ddb2bt.pipeline.local.exits import on_hard_exit
    from ddb2bt.pipeline.signals import run_command
    on_hard_exit(lambda: open(sys.argv[1], "w").write("ended"))
    on_hard_exit(lambda: 1 / 0)  # a hook that fails keeps none of the others from running
    on_hard_exit(lambda: open(sys.argv[1], "a").write(" twice"))
    def job():
        print("ready", flush=True)
        time.sleep(60)
        return 0
    sys.exit(run_command(job, stop=lambda: None, grace_s=30))
""")


def test_a_hard_exit_runs_the_hooks_of_what_must_not_outlive_the_process(tmp_path):
    """A command that ends at once (here a second Ctrl-C) skips its cleanups but
    still runs pipeline.local.exits' hooks: the local stack's servers end there."""
    mark = tmp_path / "mark"
    p = subprocess.Popen([sys.executable, "-c", HOOKED, str(mark)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGINT)
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=10)
    assert p.returncode == EXIT_INTERRUPTED and "Traceback" not in err
    assert mark.read_text() == "ended twice"


QUIET = textwrap.dedent("""
    import time
    from ddb2bt.pipeline.signals import exit_quietly_on_interrupt
    exit_quietly_on_interrupt()  # what the ddb2bt program does first, for every command
    print("ready", flush=True)
    time.sleep(60)  # a command that runs no job (status, verify): no scope of its own
""")


def test_a_command_that_runs_no_job_claims_no_checkpoints_when_interrupted():
    """`status` or `verify` stopped by Ctrl-C read nothing to checkpoint: the last
    line must not say that what was acknowledged is checkpointed."""
    from ddb2bt.pipeline.signals import INTERRUPTED_NO_JOB

    p = subprocess.Popen([sys.executable, "-c", QUIET], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=10)
    assert p.returncode == EXIT_INTERRUPTED and "Traceback" not in err
    assert err.strip().splitlines()[-1] == INTERRUPTED_NO_JOB and "checkpointed" not in err
