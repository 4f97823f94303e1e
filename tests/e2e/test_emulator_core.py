"""The end-to-end core against BOTH local AWS emulators in the same run: moto and
ministack are independent implementations of DynamoDB + Streams, so a behaviour
that only one emulator's quirks hide (moto: millisecond record times, no-op and
duplicate records, no trimming, no iterator expiry; ministack: one shard that never
splits) shows on the other. Live tail under a writer, cutover under a writer,
restart from a checkpoint after a kill, and a trimmed checkpoint (ministack trims
its own stream; moto never trims, so the trimming proxy of `ddb2bt local trim`
answers as AWS does in front of it), all through the `ddb2bt` CLI as a user runs it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from botocore.exceptions import ClientError

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.connect.connections import StreamsClientFactory
from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.local import local_stack
from ddb2bt.pipeline.local.local_stack import DYNAMODB_EMULATORS, MINISTACK, LocalStack
from tests.conftest import ROOT
from tests.e2e.test_cutover import assert_target_is_exactly_the_mapping, preload, random_changes, setup, store_of
from tests.e2e.test_live_replication import check_identical

pytestmark = pytest.mark.e2e
RUN = ["--poll-interval", "0.2"]
# Few items, many changes: several changes to one item land in the same second,
# which on ministack (as on AWS) share one whole-second record time.
HOT_ITEMS = 30
CHECKPOINT_WAIT_S = 120  # the first durable checkpoint, on a loaded 2-core machine
# ministack's stream retention for the trimming test: long enough for the first run
# to read its records, short enough that trimming comes within seconds.
SHORT_RETENTION_S = 10.0
TRIM_WAIT_S = 60
WRITE_PACE_S = 0.3  # a change every 0.3 s: several within the retention, few in all


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def test_live_tail_under_a_writer_replicates_exactly(emulator_stack, tmp_path, unique):
    path, mapping, ddb = setup(tmp_path, unique)
    done = threading.Event()

    def write():
        try:
            for op in workload.operations(21, 800, HOT_ITEMS):
                workload.apply_quietly(ddb, mapping.source.table, op)
        finally:
            done.set()

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "3", *RUN]) == 0
    writer.join()
    assert done.is_set()
    # whatever was written after the tail went idle: one catch-up run
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", *RUN]) == 0
    items, actual = check_identical(mapping, ddb)
    assert items and len(actual) == len(items)


def test_migrate_under_a_concurrent_writer_then_verify(emulator_stack, tmp_path, unique, capsys):
    path, mapping, ddb = setup(tmp_path, unique)
    items = preload(ddb, mapping.source.table, 1500, seed=31)
    stop = threading.Event()
    changes: list = []
    writer = threading.Thread(target=lambda: changes.append(
        random_changes(ddb, mapping.source.table, items, 400, seed=32, stop=stop)), daemon=True)
    writer.start()
    try:
        assert ddb2bt(["migrate", "--mapping", str(path), "--segments", "4", "--until-idle", "2", *RUN]) == 0
    finally:
        writer.join()
    assert changes == [400]
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", *RUN]) == 0
    assert_target_is_exactly_the_mapping(mapping, ddb)
    report = tmp_path / "verify.json"
    assert ddb2bt(["verify", "--mapping", str(path), "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["identical"] and data["items"] == len(workload.scan_all(ddb, mapping.source.table))


def test_restart_after_a_kill_resumes_from_the_checkpoint(emulator_stack, tmp_path, unique):
    path, mapping, ddb = setup(tmp_path, unique)
    for op in workload.operations(41, 400, HOT_ITEMS):
        workload.apply_quietly(ddb, mapping.source.table, op)
    proc = subprocess.Popen([sys.executable, "-m", "ddb2bt.pipeline.app.cli", "run", "--mapping", str(path), *RUN],
                            cwd=ROOT, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    store = store_of(mapping)
    stream_arn = ddb.describe_table(TableName=mapping.source.table)["Table"]["LatestStreamArn"]
    try:
        _wait(lambda: store.load_checkpoints(stream_arn), CHECKPOINT_WAIT_S, "the first durable checkpoint")
        for op in workload.operations(42, 200, HOT_ITEMS):  # more changes while it runs
            workload.apply_quietly(ddb, mapping.source.table, op)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    first = {s: c.sequence_number for s, c in store.load_checkpoints(stream_arn).items()}
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "2", *RUN]) == 0
    check_identical(mapping, ddb)
    after = {s: c.sequence_number for s, c in store.load_checkpoints(stream_arn).items()}
    assert set(after) >= set(first)
    assert any(int(after[s]) > int(seq) for s, seq in first.items()), "the restart resumed and moved on"


def _trimmed_past(stream_arn: str, shard: str, sequence_number: str) -> bool:
    client = StreamsClientFactory()()
    try:
        client.get_shard_iterator(StreamArn=stream_arn, ShardId=shard, ShardIteratorType="AFTER_SEQUENCE_NUMBER",
                                  SequenceNumber=sequence_number)
    except ClientError as exc:
        return exc.response["Error"]["Code"] == "TrimmedDataAccessException"
    return False


@pytest.mark.parametrize("emulator", DYNAMODB_EMULATORS)
def test_a_trimmed_checkpoint_stops_the_job_loudly(emulator, stacks, tmp_path, unique, monkeypatch, capsys):
    """A stopped job's checkpoint the stream has trimmed past: the restarted job
    must stop, saying changes were LOST and how to recover (docs/design.md §8), and
    status must show the shard TRIMMED. ministack trims: a stack of its own with a
    retention of seconds. moto never trims: the shared moto stack, with `ddb2bt
    local trim` (its proxy answers TrimmedDataAccessException as AWS does)."""
    if emulator == MINISTACK:
        with LocalStack(log_dir=tmp_path / "logs", dynamodb=MINISTACK, stream_retention_s=SHORT_RETENTION_S) as own:
            _trimmed_checkpoint(own, None, tmp_path, unique, monkeypatch, capsys)
        return
    monkeypatch.setenv(local_stack.STATE_DIR_ENV, str(tmp_path / "state"))
    shared = stacks(emulator)
    local_stack.save_state(shared)  # `local trim` works on a recorded stack, as `local up --detach` records its own
    try:
        _trimmed_checkpoint(shared, lambda path: ddb2bt(["local", "trim", "--mapping", str(path)]) == 0, tmp_path,
                            unique, monkeypatch, capsys)
    finally:
        proxy = (local_stack.load_state() or {}).get("pids", {}).get("trim-proxy")
        if proxy:  # only what the test started: the shared stack keeps running
            os.killpg(proxy, signal.SIGTERM)


def _trimmed_checkpoint(stack, trim, tmp_path, unique, monkeypatch, capsys) -> None:
    """``trim(path)`` trims the stream now (moto); None: wait for the retention."""
    for k, v in stack.env().items():
        monkeypatch.setenv(k, v)
    path, mapping, ddb = setup(tmp_path, unique)
    table = mapping.source.table
    stream_arn = ddb.describe_table(TableName=table)["Table"]["LatestStreamArn"]
    store = store_of(mapping)
    # Records outlive the retention only briefly, so write until the job has read
    # and checkpointed some (however long it takes to start), then let it go idle.

    def write_until_checkpointed():
        deadline = time.monotonic() + CHECKPOINT_WAIT_S
        n = 0
        while not store.load_checkpoints(stream_arn) and time.monotonic() < deadline:
            ddb.put_item(TableName=table, Item={"pk": {"S": "a"}, "sk": {"S": f"{n}"}, "Price": {"N": "1"}})
            n += 1
            time.sleep(WRITE_PACE_S)

    writer = threading.Thread(target=write_until_checkpointed, daemon=True)
    writer.start()
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", *RUN]) == 0
    writer.join()
    (shard, checkpoint), = store.load_checkpoints(stream_arn).items()
    # the job is stopped; changes come and age out of the stream unread
    for n in range(3):
        ddb.put_item(TableName=table, Item={"pk": {"S": "b"}, "sk": {"S": f"lost{n}"}, "Price": {"N": "2"}})
    if trim is not None:
        assert trim(path)
        for k, v in local_stack.load_state()["env"].items():  # eval "$(ddb2bt local env)"
            monkeypatch.setenv(k, v)
    _wait(lambda: _trimmed_past(stream_arn, shard, checkpoint.sequence_number), TRIM_WAIT_S,
          "the stream to trim past the checkpoint")
    capsys.readouterr()
    code = ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", *RUN])
    err = capsys.readouterr().err
    assert code != 0
    assert "LOST" in err and "ddb2bt recover" in err, err
    assert ddb2bt(["status", "--mapping", str(path)]) != 0
    assert "TRIMMED" in capsys.readouterr().out
