"""The live path end to end: moto (DynamoDB + Streams) → Beam FnApiRunner →
cbtemulator, driven through the `ddb2bt` CLI exactly as a user runs it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.clients.bigtable.reads import read_table
from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.verify.compare import diff_layout, expected_layout
from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec, dynamodb_client
from ddb2bt.pipeline.control.state import ShardCheckpoint
from tests.conftest import ROOT, write_mapping
from ddb2bt.transforms.config import load_mapping

pytestmark = pytest.mark.e2e
IDLE = "3"


def setup_tables(stack, tmp_path, unique, **changes):
    source, target = f"Products_{unique}", f"products_{unique}"
    path = write_mapping(tmp_path, source__table=source, target__table=target, name=f"job_{unique}", **changes)
    mapping = load_mapping(path)
    ddb = dynamodb_client()
    workload.create_table(ddb, source)
    return path, mapping, ddb


def check_identical(mapping, ddb):
    items = workload.scan_all(ddb, mapping.source.table)
    actual = read_table(mapping.target.project, mapping.target.instance, mapping.target.table)
    diff = diff_layout(expected_layout(mapping, items)[mapping.target.table], actual)
    assert diff.identical, diff.summary()
    assert diff.extra_versions == [], "every owned column must hold exactly one version"
    return items, actual


def writer_thread(ddb, table, seed, count, population, done: threading.Event):
    def run():
        try:
            for op in workload.operations(seed, count, population):
                workload.apply_quietly(ddb, table, op)
        finally:
            done.set()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_random_changes_replicate_exactly(stack, tmp_path, unique):
    path, mapping, ddb = setup_tables(stack, tmp_path, unique)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    done = threading.Event()
    # The writer runs while the pipeline replicates (never idle for IDLE seconds).
    writer = writer_thread(ddb, mapping.source.table, seed=11, count=1200, population=150, done=done)
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", IDLE, "--poll-interval", "0.2"]) == 0
    writer.join()
    assert done.is_set()
    # Anything written after the pipeline went idle is picked up by a catch-up run.
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", "--poll-interval", "0.2"]) == 0
    items, actual = check_identical(mapping, ddb)
    assert len(items) > 50 and len(actual) == len(items)
    # the workload's edge cases were really exercised
    values = [v for row in actual.values() for col in row.values() for _, v in col]
    assert any(len(v) >= workload.LARGE_VALUE_CHARS for v in values), "a large value was replicated"
    assert any("日本".encode() in v or "🙂".encode() in v for v in values), "unicode was replicated"


def test_restart_after_kill_and_replay_from_an_older_checkpoint_converge(stack, tmp_path, unique):
    path, mapping, ddb = setup_tables(stack, tmp_path, unique)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    for op in workload.operations(5, 600, 120):
        workload.apply_quietly(ddb, mapping.source.table, op)
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "ddb2bt.pipeline.app.cli", "run", "--mapping", str(path), "--poll-interval", "0.2"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    store = StateSpec(BigtableSpec(mapping.target.project, mapping.target.instance), job=mapping.name).store()
    stream_arn = ddb.describe_table(TableName=mapping.source.table)["Table"]["LatestStreamArn"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not store.load_checkpoints(stream_arn):
        time.sleep(0.1)  # wait for the first durable checkpoint, then kill mid-run
    assert store.load_checkpoints(stream_arn), "the job never checkpointed"
    for op in workload.operations(6, 300, 120):  # more changes while it runs
        workload.apply_quietly(ddb, mapping.source.table, op)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    # restart: resumes from the checkpoint and converges
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", IDLE, "--poll-interval", "0.2"]) == 0
    check_identical(mapping, ddb)
    # replay from an older checkpoint (the very first record): still identical
    (shard, ck), = store.load_checkpoints(stream_arn).items()
    client = __import__("ddb2bt.pipeline.connect.connections", fromlist=["x"]).StreamsClientFactory()()
    it = client.get_shard_iterator(StreamArn=stream_arn, ShardId=shard, ShardIteratorType="TRIM_HORIZON")
    first = client.get_records(ShardIterator=it["ShardIterator"], Limit=1)["Records"][0]["dynamodb"]["SequenceNumber"]
    store.save_checkpoints([ShardCheckpoint(stream_arn, shard, first)])
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", "--poll-interval", "0.2"]) == 0
    check_identical(mapping, ddb)
    assert store.load_checkpoints(stream_arn)[shard].sequence_number == ck.sequence_number


def test_oversized_key_and_unknown_family_are_dead_lettered_while_the_rest_replicates(stack, tmp_path, unique, capsys):
    from ddb2bt.pipeline.clients.bigtable.admin import BigtableAdmin
    from ddb2bt.transforms.config import FamilyConfig

    path, mapping, ddb = setup_tables(
        stack, tmp_path, unique,
        families={"SKU": {"max_versions": 1}, "Extra": {}},
        rules__0__row_key="{pk}#{sk}",
        rules__0__columns={"Description": {"column": "SKU:Description", "encoding": "utf8"},
                           "Price": {"column": "SKU:Price", "encoding": "int64"},
                           "Thumbnail": {"column": "SKU:Thumbnail", "encoding": "utf8"},
                           "Note": {"column": "Extra:Note", "encoding": "utf8"}},
    )
    # The table exists without the Extra family (e.g. made by an older mapping).
    BigtableAdmin(mapping.target.project, mapping.target.instance).ensure_table(
        mapping.target.table, [FamilyConfig("SKU", max_versions=1)])
    table = mapping.source.table
    ddb.put_item(TableName=table, Item={"pk": {"S": "hats"}, "sk": {"S": "good"}, "Price": {"N": "30"}})
    # Within DynamoDB's key limits (2 KB + 1 KB) but over Bigtable's 4 KiB once the
    # delimiters inside the partition key are escaped.
    ddb.put_item(TableName=table, Item={"pk": {"S": "#" * 2000}, "sk": {"S": "k" * 200}, "Price": {"N": "1"}})
    ddb.put_item(TableName=table, Item={"pk": {"S": "hats"}, "sk": {"S": "noted"}, "Note": {"S": "x"}})
    ddb.put_item(TableName=table, Item={"pk": {"S": "shoes"}, "sk": {"S": "good2"}, "Price": {"N": "40"}})
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", "--poll-interval", "0.2"]) == 0
    rows = read_table(mapping.target.project, mapping.target.instance, mapping.target.table)
    assert sorted(rows) == [b"hats#good", b"shoes#good2"]
    capsys.readouterr()
    assert ddb2bt(["dlq", "list", "--mapping", str(path), "--json"]) == 0
    letters = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted(l["reason"] for l in letters) == ["row_key_too_long", "unknown_family"]
    for letter in letters:
        record = json.loads(letter["record"])
        assert record["eventName"] == "INSERT" and "newImage" in record  # the original record is kept
    assert ddb2bt(["dlq", "list", "--mapping", str(path)]) == 0
    assert "2 dead letter(s): row_key_too_long 1, unknown_family 1" in capsys.readouterr().out


def test_redrive_reapplies_fixed_dead_letters_without_overriding_newer_changes(stack, tmp_path, unique, capsys):
    from ddb2bt.pipeline.clients.bigtable.admin import BigtableAdmin
    from ddb2bt.transforms.config import FamilyConfig

    path, mapping, ddb = setup_tables(
        stack, tmp_path, unique, families={"SKU": {"max_versions": 1}, "Extra": {}},
        rules__0__columns={"Price": {"column": "SKU:Price", "encoding": "int64"},
                           "Note": {"column": "Extra:Note", "encoding": "utf8"}})
    BigtableAdmin(mapping.target.project, mapping.target.instance).ensure_table(
        mapping.target.table, [FamilyConfig("SKU", max_versions=1)])  # no Extra family yet
    table = mapping.source.table
    ddb.put_item(TableName=table, Item={"pk": {"S": "a"}, "sk": {"S": "1"}, "Note": {"S": "old"}})
    ddb.put_item(TableName=table, Item={"pk": {"S": "a"}, "sk": {"S": "2"}, "Note": {"S": "only"}})
    run = ["run", "--mapping", str(path), "--until-idle", "1", "--poll-interval", "0.2"]
    assert ddb2bt(run) == 0
    capsys.readouterr()
    assert ddb2bt(["dlq", "list", "--mapping", str(path), "--json"]) == 0
    letters = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [l["reason"] for l in letters] == ["unknown_family", "unknown_family"]
    assert ddb2bt(["dlq", "show", "--mapping", str(path), letters[0]["id"]]) == 0
    assert '"eventName": "INSERT"' in capsys.readouterr().out
    # the cause is fixed; then item 1 changes again before the redrive
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    time.sleep(1.1)
    ddb.put_item(TableName=table, Item={"pk": {"S": "a"}, "sk": {"S": "1"}, "Note": {"S": "newer"}})
    assert ddb2bt(run) == 0
    capsys.readouterr()
    assert ddb2bt(["dlq", "redrive", "--mapping", str(path), "--reason", "unknown_family"]) == 0
    # (redrive writes each item's current state now; the output says so)
    assert "resolved 2 dead letter(s) of 2 item(s)" in capsys.readouterr().out
    rows = read_table(mapping.target.project, mapping.target.instance, mapping.target.table, latest_only=True)
    assert rows[b"a#1"][("Extra", b"Note")][0][1] == b"newer"  # the old change did not override it
    assert rows[b"a#2"][("Extra", b"Note")][0][1] == b"only"  # the lost change is there now
    assert ddb2bt(["dlq", "list", "--mapping", str(path)]) == 0
    assert "0 dead letter(s)" in capsys.readouterr().out
    assert ddb2bt(["dlq", "redrive", "--mapping", str(path)]) == 0  # idempotent: nothing left


def test_credentials_never_reach_logs_or_dead_letters(stack, tmp_path, unique, capfd, monkeypatch):
    canary = "CANARY-SECRET-" + unique
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", canary)  # moto accepts any secret
    path, mapping, ddb = setup_tables(stack, tmp_path, unique)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    table = mapping.source.table
    ddb.put_item(TableName=table, Item={"pk": {"S": "a"}, "sk": {"S": "1"}, "Price": {"N": "1.5"}})  # dead letter
    ddb.put_item(TableName=table, Item={"pk": {"S": "a"}, "sk": {"S": "2"}, "Price": {"N": "2"},
                                        "Description": {"S": "private item text"}})
    assert ddb2bt(["--log-level", "DEBUG", "--log-format", "json", "run", "--mapping", str(path),
                   "--until-idle", "1", "--poll-interval", "0.2"]) == 0
    assert ddb2bt(["dlq", "list", "--mapping", str(path), "--json"]) == 0
    out, err = capfd.readouterr()
    assert canary not in out and canary not in err
    assert "private item text" not in err  # item contents are not logged
    assert '"stage":' in err  # JSON logs carry the stage
