"""`ddb2bt local up --change-streams`: the test change-stream server in front of
cbtemulator, so a table created with a change stream reads back as one."""
from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from ddb2bt.pipeline.clients.bigtable.changestream import data_api_client, read_changes, table_name
from ddb2bt.pipeline.local.local_stack import CHANGE_STREAMS, MOTO, LocalStack

pytestmark = pytest.mark.e2e


def _v4(ip: str) -> str:
    address = ipaddress.ip_address(ip)
    return str(getattr(address, "ipv4_mapped", None) or address)


def test_a_stack_with_change_streams_serves_the_writes_it_forwarded(tmp_path, monkeypatch):
    with LocalStack(log_dir=tmp_path, dynamodb=MOTO, change_streams=True) as stack:
        assert set(stack.pids) == {"bigtable", MOTO, CHANGE_STREAMS}
        for name, pid in stack.pids.items():  # the front too listens on loopback only
            listening = {_v4(c.laddr.ip) for c in psutil.Process(pid).net_connections(kind="inet")
                         if c.status == psutil.CONN_LISTEN}
            assert listening == {"127.0.0.1"}, (name, listening)  # gRPC's socket shows it v4-mapped
        front = psutil.Process(stack.pids[CHANGE_STREAMS])
        assert stack.bigtable_port in {c.laddr.port for c in front.net_connections(kind="inet")
                                       if c.status == psutil.CONN_LISTEN}
        monkeypatch.setenv("BIGTABLE_EMULATOR_HOST", stack.env()["BIGTABLE_EMULATOR_HOST"])
        from google.cloud.bigtable import Client

        client = Client(project="p", admin=True)
        client.table_admin_client.create_table(request={
            "parent": "projects/p/instances/i", "table_id": "t",
            "table": {"column_families": {"cf": {}}, "change_stream_config": {"retention_period": {"seconds": 600}}}})
        start_us = int(time.time() * 1e6)
        row = client.instance("i").table("t").direct_row(b"k")
        row.set_cell("cf", b"q", b"v")
        row.commit()
        api = data_api_client()
        try:
            [change] = list(read_changes(api, table_name("p", "i", "t"), start_us, 0.5, poll_s=0.05))
        finally:
            api.transport.close()
        assert (change.row_key, change.mutations[0].value) == (b"k", b"v")
        pids = list(stack.pids.values())
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)


def test_local_up_detach_with_change_streams_records_the_front_and_refuses_a_plain_stack_under_it(tmp_path):
    env = dict(os.environ, DDB2BT_STATE_DIR=str(tmp_path / "state"), DDB2BT_LOCAL_DYNAMODB=MOTO)
    env.pop("PYTHONPATH", None)
    run = lambda *a: subprocess.run([sys.executable, "-m", "ddb2bt.pipeline.app.cli", "local", *a],
                                    capture_output=True, text=True, cwd=tmp_path, env=env)
    plain = run("up", "--detach")
    assert plain.returncode == 0, plain.stderr
    try:
        refused = run("up", "--detach", "--change-streams")
        assert refused.returncode != 0 and "without change streams is already running" in refused.stderr
    finally:
        assert "stopped (1)" in run("down").stdout
    up = run("up", "--detach", "--change-streams")
    assert up.returncode == 0, up.stderr
    try:
        [stack] = json.loads((tmp_path / "state" / "local-stack.json").read_text())["stacks"]
        assert CHANGE_STREAMS in stack["pids"]
        port = int(stack["env"]["BIGTABLE_EMULATOR_HOST"].rsplit(":", 1)[1])
        listening = {c.laddr.port for c in psutil.Process(stack["pids"][CHANGE_STREAMS]).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN}
        assert port in listening  # BIGTABLE_EMULATOR_HOST points at the front
    finally:
        assert "stopped (1)" in run("down").stdout
