import json
import os
import signal
import socket
import time
import subprocess
import sys
import urllib.request

import boto3
import psutil
import pytest

from ddb2bt.pipeline.local.local_stack import StackError, find_cbtemulator
from tests.conftest import ROOT

pytestmark = pytest.mark.e2e


def test_servers_bind_to_loopback_and_answer(emulator_stack):
    stack = emulator_stack
    env = stack.env()
    host, port = env["BIGTABLE_EMULATOR_HOST"].split(":")
    assert host == "127.0.0.1"
    socket.create_connection((host, int(port)), timeout=2).close()
    assert env["AWS_ENDPOINT_URL_DYNAMODB"].startswith("http://127.0.0.1:")
    assert env["AWS_ENDPOINT_URL_DYNAMODB_STREAMS"] == env["AWS_ENDPOINT_URL_DYNAMODB"]
    ready = {"moto": "/moto-api/", "ministack": "/_ministack/ready"}[stack.dynamodb]
    with urllib.request.urlopen(env["AWS_ENDPOINT_URL_DYNAMODB"] + ready) as resp:
        assert resp.status == 200
    # every socket either server listens on is on loopback (ministack binds 0.0.0.0,
    # and opens an MQTT listener, unless told otherwise)
    for name, pid in stack.pids.items():
        listening = [c.laddr for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert listening, f"{name} listens nowhere"
        assert {addr.ip for addr in listening} == {"127.0.0.1"}, (name, listening)
    # the emulator serves what ddb2bt uses, answering as DynamoDB does
    ddb = boto3.client("dynamodb", endpoint_url=env["AWS_ENDPOINT_URL_DYNAMODB"], region_name=env["AWS_REGION"],
                       aws_access_key_id="testing", aws_secret_access_key="testing")
    assert "TableNames" in ddb.list_tables()


# How long after PITR is turned on the test looks again: more than a second, so an
# emulator that answers "now" (ministack did) shows a later time than the switch.
PITR_LOOK_AGAIN_AFTER_S = 1.5


def test_pitr_earliest_restorable_time_is_when_it_was_turned_on(emulator_stack, unique):
    """As on AWS, on both emulators: `ddb2bt recover` refuses a change older than
    the earliest restorable time, so an emulator answering "now" on every call
    (ministack did) made every change unrecoverable and the recovery rehearsal
    of docs/recover.md fail."""
    env = emulator_stack.env()
    ddb = boto3.client("dynamodb", endpoint_url=env["AWS_ENDPOINT_URL_DYNAMODB"], region_name=env["AWS_REGION"],
                       aws_access_key_id="testing", aws_secret_access_key="testing")
    table = f"Pitr{unique}"
    ddb.create_table(TableName=table, KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
                     AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
                     BillingMode="PAY_PER_REQUEST")
    before = time.time()
    ddb.update_continuous_backups(TableName=table,
                                  PointInTimeRecoverySpecification={"PointInTimeRecoveryEnabled": True})
    after = time.time()
    while time.time() < after + PITR_LOOK_AGAIN_AFTER_S:  # the wall clock itself is the condition
        time.sleep(after + PITR_LOOK_AGAIN_AFTER_S - time.time())
    pitr = ddb.describe_continuous_backups(TableName=table)["ContinuousBackupsDescription"][
        "PointInTimeRecoveryDescription"]
    assert pitr["PointInTimeRecoveryStatus"] == "ENABLED"
    # whole seconds on moto: the second it was turned on
    assert int(before) <= pitr["EarliestRestorableDateTime"].timestamp() <= after, pitr
    ddb.update_continuous_backups(TableName=table,  # turning it on again keeps the time
                                  PointInTimeRecoverySpecification={"PointInTimeRecoveryEnabled": True})
    again = ddb.describe_continuous_backups(TableName=table)["ContinuousBackupsDescription"][
        "PointInTimeRecoveryDescription"]
    assert again["EarliestRestorableDateTime"] == pitr["EarliestRestorableDateTime"]
    ddb.delete_table(TableName=table)


def test_missing_emulator_gives_install_instructions(monkeypatch, tmp_path):
    monkeypatch.setenv("CBTEMULATOR", str(tmp_path / "nope"))
    with pytest.raises(StackError) as err:
        find_cbtemulator()
    assert "google-cloud-cli-bigtable-emulator" in str(err.value)
    assert "gcloud components install bigtable" in str(err.value)


def test_local_run_sets_the_variables_for_the_command(tmp_path):
    script = "import os; print(os.environ['BIGTABLE_EMULATOR_HOST'], os.environ['AWS_ENDPOINT_URL_DYNAMODBSTREAMS'])"
    out = subprocess.run([sys.executable, "-m", "ddb2bt.pipeline.app.cli", "local", "run", "--", sys.executable, "-c", script],
                         capture_output=True, text=True, cwd=tmp_path, check=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout
    bigtable, aws = out.split()
    assert bigtable.startswith("127.0.0.1:") and aws.startswith("http://127.0.0.1:")


def test_detached_stack_up_env_down(tmp_path):
    """One stack per user, found from any directory; a second `up` reports the
    running one; `down` stops it (and a stack an older version recorded in the
    working directory)."""
    env = dict(os.environ, DDB2BT_STATE_DIR=str(tmp_path / "state"))
    env.pop("PYTHONPATH", None)
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    run = lambda cwd, *a: subprocess.run([sys.executable, "-m", "ddb2bt.pipeline.app.cli", "local", *a],
                                         capture_output=True, text=True, cwd=cwd, env=env)
    assert run(one, "up", "--detach").returncode == 0
    try:
        again = run(two, "up", "--detach")
        assert again.returncode == 0 and "already running" in again.stdout
        printed = run(two, "env")  # another directory sees the same stack
        assert printed.returncode == 0
        exports = dict(line.removeprefix("export ").split("=", 1) for line in printed.stdout.splitlines())
        host, port = exports["BIGTABLE_EMULATOR_HOST"].split(":")
        socket.create_connection((host, int(port)), timeout=2).close()
        state = json.loads((tmp_path / "state" / "local-stack.json").read_text())
        assert len(state["stacks"]) == 1
    finally:
        assert "stopped (1)" in run(two, "down").stdout
    assert run(one, "env").returncode == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
            time.sleep(0.2)
        except OSError:
            break
    else:
        raise AssertionError("the emulator still accepts connections after `local down`")


def test_detached_stack_with_ministack_and_no_silent_switch(tmp_path):
    """`local up --detach --dynamodb ministack` starts ministack (recorded, so `env`
    and a second `up` know which); asking for moto while it runs is refused, naming
    the running one, instead of handing back the other emulator."""
    env = dict(os.environ, DDB2BT_STATE_DIR=str(tmp_path / "state"))
    env.pop("PYTHONPATH", None)
    run = lambda *a: subprocess.run([sys.executable, "-m", "ddb2bt.pipeline.app.cli", "local", *a],
                                    capture_output=True, text=True, cwd=tmp_path, env=env)
    started = run("up", "--detach", "--dynamodb=ministack")
    assert started.returncode == 0, started.stderr
    try:
        state = json.loads((tmp_path / "state" / "local-stack.json").read_text())
        (record,) = state["stacks"]
        assert record["dynamodb"] == "ministack" and set(record["pids"]) == {"bigtable", "ministack"}
        exports = dict(line.removeprefix("export ").split("=", 1) for line in run("env").stdout.splitlines())
        with urllib.request.urlopen(exports["AWS_ENDPOINT_URL_DYNAMODB"] + "/_ministack/ready") as resp:
            assert resp.status == 200
        other = run("up", "--detach", "--dynamodb", "moto")
        assert other.returncode == 2
        assert "ministack is already running" in other.stderr and "--dynamodb" in other.stderr
        assert "already running" in run("up", "--detach", "--dynamodb", "ministack").stdout
    finally:
        assert "stopped (1)" in run("down").stdout


def _gone(pid: int, deadline_s: float = 10.0) -> bool:
    """Wait (on the condition, with a deadline) until ``pid`` has exited."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_up_over_a_half_down_stack_restarts_the_dead_half_and_down_stops_everything(tmp_path):
    """Before: `local up --detach` over a stack whose AWS emulator had died
    started a second stack and forgot the first (its cbtemulator leaked; `local
    down` stopped only the new one), and `local env` said no stack was running.
    On the default emulator (ministack), which the revived one must be too."""
    import signal

    env = dict(os.environ, DDB2BT_STATE_DIR=str(tmp_path / "state"))
    env.pop("PYTHONPATH", None)
    run = lambda *a: subprocess.run([sys.executable, "-m", "ddb2bt.pipeline.app.cli", "local", *a],  # noqa: E731
                                    capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    state_path = tmp_path / "state" / "local-stack.json"
    assert run("up", "--detach").returncode == 0
    pids = []
    try:
        (first,) = json.loads(state_path.read_text())["stacks"]
        pids += first["pids"].values()
        aws = first["dynamodb"]
        os.killpg(first["pids"][aws], signal.SIGTERM)
        assert _gone(first["pids"][aws])
        printed = run("env")
        assert printed.returncode == 1 and f"half down ({aws} stopped)" in printed.stderr
        other = {"moto": "ministack", "ministack": "moto"}[aws]
        refused = run("up", "--detach", "--dynamodb", other)  # not the other emulator in the dead one's place
        assert refused.returncode == 2 and f"{aws} is half down" in refused.stderr
        again = run("up", "--detach")
        assert again.returncode == 0 and f"{aws} started again on the same port" in again.stdout, again.stderr
        (now,) = json.loads(state_path.read_text())["stacks"]  # one stack, not two
        pids += now["pids"].values()
        assert now["pids"]["bigtable"] == first["pids"]["bigtable"] and now["env"] == first["env"]
        assert now["dynamodb"] == aws
        ready = {"moto": "/moto-api/", "ministack": "/_ministack/ready"}[aws]
        with urllib.request.urlopen(now["env"]["AWS_ENDPOINT_URL_DYNAMODB"] + ready) as resp:
            assert resp.status == 200
        assert run("env").returncode == 0
    finally:
        assert "stopped (1)" in run("down").stdout
    assert all(_gone(pid) for pid in set(pids))


STUCK_ON_A_STACK = """
import sys, time
from ddb2bt.pipeline.local.local_stack import LocalStack
from ddb2bt.pipeline.signals import run_command
def job():
    with LocalStack() as stack:
        print(" ".join(str(pid) for pid in stack.pids.values()), flush=True)
        time.sleep(120)  # a job that does not stop in its grace period
    return 0
sys.exit(run_command(job, stop=lambda: None, grace_s=1))
"""


def test_a_command_that_ends_at_once_leaves_no_emulator_running():
    """The servers run in sessions of their own (the terminal's Ctrl-C does not
    reach them): a command ended past its grace must end them on its way out,
    not leave them running for ever (the demo did, interrupted mid-run)."""
    p = subprocess.Popen([sys.executable, "-c", STUCK_ON_A_STACK], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    pids = [int(pid) for pid in p.stdout.readline().split()]
    assert len(pids) == 2 and all(psutil.pid_exists(pid) for pid in pids)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.2)
    assert not any(_running(pid) for pid in pids), [psutil.Process(pid).cmdline() for pid in pids if _running(pid)]


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
