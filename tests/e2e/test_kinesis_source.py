"""Kinesis Data Streams for DynamoDB as the source, end to end: moto (DynamoDB, its
stream, Kinesis) → `ddb2bt run` (Beam FnApiRunner) → cbtemulator.

moto cannot link a table to a Kinesis stream, so the tests write the change
records themselves, in the published shape, from the table's own changes
(``pipeline/testing/kinesis_cdc.py``) — delivered out of order (shuffled within
a window), some twice, across a shard split. The target must equal the mapping
of a Scan exactly.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import boto3
import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec, StreamsClientFactory, dynamodb_client
from ddb2bt.pipeline.verify.compare import compare_mapping
from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.clients.bigtable.reads import read_table
from ddb2bt.pipeline.source.kinesis import resolve_kinesis
from ddb2bt.pipeline.testing.kinesis_cdc import Disorder, change_document, publish_changes, read_table_changes
from ddb2bt.transforms.attrs import from_plain
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.ordering import CLOCK_FAMILY
from tests.conftest import ROOT, ready_but_for_the_tail, write_mapping

pytestmark = pytest.mark.e2e
IDLE = "3"


def item(**kw):
    return {k: from_plain(v) for k, v in kw.items()}


def video_ops(seed: int, count: int):
    """Random puts and deletes of a few videos' items (Video, likes, comments)."""
    import random

    rng = random.Random(seed)
    for _ in range(count):
        pk = rng.choice(["0123", "0124", "0125"])
        sk = rng.choice(["Video", "VideoStatsLikes", "VideoComment#1", "VideoComment#2", "VideoComment#3"])
        n = rng.randint(0, 59)
        if rng.random() < 0.2:
            yield ("delete", item(pk=pk, sk=sk))
        elif sk == "Video":
            yield ("put", item(pk=pk, sk=sk, UploadDate=f"2023-09-10T15:21:{n:02d}", Formats={"480": f"u{n}"}))
        elif sk == "VideoStatsLikes":
            yield ("put", item(pk=pk, sk=sk, Count=n))
        else:
            yield ("put", item(pk=pk, sk=sk, Content=f"c{n}", CreatedAt=f"2023-09-1{sk[-1]}T00:00:{n:02d}"))


def catalog_ops(seed: int, count: int):
    return [op for op in workload.operations(seed, count, 40)]


def apply_ops(ddb, table, ops, key_names):
    for op in ops:
        if isinstance(op, tuple):
            kind, it = op
            if kind == "put":
                ddb.put_item(TableName=table, Item=it)
            else:
                ddb.delete_item(TableName=table, Key={k: it[k] for k in key_names})
        else:
            workload.apply_quietly(ddb, table, op)


class KinesisWorld:
    """A DynamoDB table, its mapping reading a Kinesis stream, and the pump that
    writes the table's changes into the stream."""

    def __init__(self, tmp_path, unique, base: str, precision: str = "microsecond", shards: int = 2) -> None:
        self.source, self.stream = f"Src_{unique}", f"cdc_{unique}"
        self.path = write_mapping(tmp_path, base, source__table=self.source, target__table=f"t_{unique}",
                                  name=f"k_{unique}", source__kinesis={"stream": self.stream, "precision": precision})
        self.mapping = load_mapping(self.path)
        self.ddb = dynamodb_client()
        self.stream_arn = workload.create_table(self.ddb, self.source)
        self.kinesis = boto3.client("kinesis")
        self.kinesis.create_stream(StreamName=self.stream, ShardCount=shards)
        self.precision = precision
        self._after: dict = {}
        self._last_us: dict = {}
        assert ddb2bt(["create-table", "--mapping", str(self.path)]) == 0

    def pump(self, disorder: Disorder) -> int:
        """Publish every change made since the last pump into the Kinesis stream."""
        streams = StreamsClientFactory()()
        records = read_table_changes(streams, self.stream_arn, self._after)
        docs = [change_document(r, self.source, self.precision, self._last_us) for r in records]
        return publish_changes(self.kinesis, self.stream, docs, disorder)

    def run(self, idle: str = IDLE) -> None:
        assert ddb2bt(["run", "--mapping", str(self.path), "--until-idle", idle, "--poll-interval", "0.2"]) == 0

    def assert_converged(self) -> dict:
        items = workload.scan_all(self.ddb, self.source)
        read = lambda table: read_table(self.mapping.target.project, self.mapping.target.instance, table)  # noqa: E731
        for table, diff in compare_mapping(self.mapping, items, read).items():
            assert diff.identical, f"{table}: {diff.summary()}"
        return read(self.mapping.target.table)


@pytest.fixture
def moto_stack(stacks, monkeypatch):
    """moto, whatever the default emulator: neither emulator splits a Kinesis shard
    as AWS does. ministack deletes the parent shard, with its records, from
    ListShards (AWS keeps it, closed and readable, for the retention), so a reader
    cannot see them; moto keeps writing to the parent after closing it and leaves
    the children empty, so the reader reads a closed parent, then empty children.
    Only moto's loses nothing. Children holding records after their parent:
    tests/unit/source/test_kinesis_reader.py (FakeKinesis)."""
    s = stacks("moto")
    for k, v in s.env().items():
        monkeypatch.setenv(k, v)
    return s


@pytest.mark.parametrize("base", ["product_catalog.yaml", "videos.yaml"])
def test_out_of_order_and_duplicated_delivery_across_a_split_converges(moto_stack, tmp_path, unique, base):
    world = KinesisWorld(tmp_path, unique, base)
    ops = catalog_ops(21, 200) if base == "product_catalog.yaml" else list(video_ops(21, 150))
    apply_ops(world.ddb, world.source, ops, world.mapping.source.key_attributes)
    put = world.pump(Disorder(window=25, duplicate=0.15, split_after=80, seed=7))
    assert put > len(ops) * 0.8  # really delivered (and duplicated)
    world.run()
    rows = world.assert_converged()
    assert rows, "the workload left items to compare"
    # The split really happened and its children were read.
    shards = world.kinesis.list_shards(StreamName=world.stream)["Shards"]
    assert any(s.get("ParentShardId") for s in shards)
    # Deleted items leave a clock (the tombstone); verify does not count it.
    tables = read_table(world.mapping.target.project, world.mapping.target.instance, world.mapping.target.table)
    assert any(c[0] == CLOCK_FAMILY for cols in tables.values() for c in cols)


def test_several_tables_in_one_stream_route_by_table_name(stack, tmp_path, unique):
    a = KinesisWorld(tmp_path, unique + "a", "product_catalog.yaml", precision="millisecond", shards=1)
    b_path = write_mapping(tmp_path, "product_catalog.yaml", source__table=f"SrcB_{unique}",
                           target__table=f"tb_{unique}", name=f"kb_{unique}",
                           source__kinesis={"stream": a.stream, "precision": "millisecond"})
    b_mapping = load_mapping(b_path)
    b_stream = workload.create_table(a.ddb, b_mapping.source.table)
    assert ddb2bt(["create-table", "--mapping", str(b_path)]) == 0
    apply_ops(a.ddb, a.source, catalog_ops(3, 120), ("pk", "sk"))
    apply_ops(a.ddb, b_mapping.source.table, catalog_ops(4, 120), ("pk", "sk"))
    a.pump(Disorder(window=10, duplicate=0.1, seed=1))
    streams = StreamsClientFactory()()
    last: dict = {}  # one per table, as KinesisWorld keeps: an item's times only increase
    docs = [change_document(r, b_mapping.source.table, "millisecond", last)
            for r in read_table_changes(streams, b_stream)]
    publish_changes(a.kinesis, a.stream, docs, Disorder(window=10, duplicate=0.1, seed=2))
    # One job of both tables: each reads its own records of the one stream.
    assert ddb2bt(["run", "--mapping", str(a.path), "--mapping", str(b_path), "--until-idle", IDLE,
                   "--poll-interval", "0.2"]) == 0
    a.assert_converged()
    items = workload.scan_all(a.ddb, b_mapping.source.table)
    read = lambda table: read_table(b_mapping.target.project, b_mapping.target.instance, table)  # noqa: E731
    for table, diff in compare_mapping(b_mapping, items, read).items():
        assert diff.identical, f"{table}: {diff.summary()}"


def test_a_crash_mid_run_resumes_and_converges(stack, tmp_path, unique):
    world = KinesisWorld(tmp_path, unique, "product_catalog.yaml")
    apply_ops(world.ddb, world.source, catalog_ops(31, 600), ("pk", "sk"))
    world.pump(Disorder(window=30, duplicate=0.1, seed=3))
    cmd = [sys.executable, "-m", "ddb2bt.pipeline.app.cli", "run", "--mapping", str(world.path), "--poll-interval", "0.2"]
    proc = subprocess.Popen(cmd, env=dict(os.environ), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    store = StateSpec(BigtableSpec(world.mapping.target.project, world.mapping.target.instance),
                      job=world.mapping.name).store()
    arn = resolve_kinesis(world.mapping, world.kinesis).stream_arn
    deadline = time.monotonic() + 120
    checkpoints: dict = {}
    while time.monotonic() < deadline and not checkpoints:
        checkpoints = store.load_checkpoints(arn)
        time.sleep(0.1)  # the first durable checkpoint, then a kill mid-run
    assert checkpoints, "the job never checkpointed"
    apply_ops(world.ddb, world.source, catalog_ops(32, 200), ("pk", "sk"))
    world.pump(Disorder(window=30, duplicate=0.1, seed=4))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    world.run()
    world.assert_converged()


def test_migrate_under_a_concurrent_writer_converges_then_verify_status_dlq(stack, tmp_path, unique, capsys):
    """Backfill by Scan while a writer changes the table and its changes reach the
    Kinesis stream out of order; the backfilled items go through the same guard
    (docs/design.md §10.6). Then verify, status and dlq work on the job."""
    import json
    import threading

    world = KinesisWorld(tmp_path, unique, "product_catalog.yaml")
    apply_ops(world.ddb, world.source, catalog_ops(41, 300), ("pk", "sk"))
    world.pump(Disorder(window=20, duplicate=0.1, seed=5))
    stop = threading.Event()
    pumped = []

    def write_and_pump():
        try:
            for i, op in enumerate(catalog_ops(42, 300)):
                workload.apply_quietly(world.ddb, world.source, op)
                if i % 25 == 24:
                    pumped.append(world.pump(Disorder(window=15, duplicate=0.1, seed=i)))
            pumped.append(world.pump(Disorder(window=15, duplicate=0.1, seed=99)))
        finally:
            stop.set()

    writer = threading.Thread(target=write_and_pump, daemon=True)
    writer.start()
    try:
        assert ddb2bt(["migrate", "--mapping", str(world.path), "--segments", "2", "--until-idle", "2",
                       "--poll-interval", "0.2"]) == 0
    finally:
        writer.join()
    assert stop.is_set() and sum(pumped) > 0
    # The writer may have finished after the tail's last look: one catch-up run.
    world.run("1")
    world.assert_converged()
    capsys.readouterr()
    report = tmp_path / "verify.json"
    assert ddb2bt(["verify", "--mapping", str(world.path), "--report", str(report)]) == 0
    assert json.loads(report.read_text())["identical"]
    assert ddb2bt(["status", "--mapping", str(world.path)]) == 1  # the runs ended: no tail runs
    out = capsys.readouterr().out
    assert "phase: LIVE" in out and ready_but_for_the_tail(out), out
    assert ddb2bt(["dlq", "list", "--mapping", str(world.path)]) == 0
