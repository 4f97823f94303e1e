"""Tables sharing one Kinesis stream share its read budget (5 GetRecords calls
and 2 MB per second per shard, for every reader of the stream): moto (DynamoDB,
Kinesis) and cbtemulator, jobs built by the CLI (docs/design.md §10.8).

* One job of two tables: each table's reader, as the job builds it, on a worker
  of its own (a pacer of its own), reads every record of its table and together
  they stay within each shard's budget. Time is simulated (the pacers' clock),
  the calls are real calls to moto, counted per shard.
* Two jobs: a second job beyond the budget is refused while the first runs,
  starts with a share that fits, and takes the whole budget once the first has
  stopped.
* A restart with --take-over refused for its share is refused before it takes
  the lease: the running job it would replace keeps running; status shows the
  shares held. A job moved back to its DynamoDB stream frees its share.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from fractions import Fraction

import boto3
import pytest

import ddb2bt.pipeline.app.cli as cli
import ddb2bt.pipeline.connect.connections as connections
import ddb2bt.pipeline.source.kinesis as kinesis_source
import ddb2bt.pipeline.services.replicate as replicate
from ddb2bt.pipeline.control import coordinator, lease
from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec, StreamsClientFactory
from ddb2bt.pipeline.verify.compare import compare_mapping
from ddb2bt.pipeline.services.jobs import build_live_jobs, load_all
from ddb2bt.pipeline.control.lease import TAIL, LeaseState, wall_ms
from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.clients.bigtable.reads import read_table
from ddb2bt.pipeline.source.kinesis import GET_RECORDS_PER_SECOND, ShardPacer, resolve_kinesis
from ddb2bt.pipeline.source.kinesis_share import record_stream, take_shares
from ddb2bt.pipeline.source.stream_source import LocalTracker, PartitionReader, ReaderOptions, StreamPartition, drain
from ddb2bt.pipeline.testing.kinesis_cdc import (Disorder, MeteredKinesis, change_document, publish_changes,
                                                 read_table_changes)
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.errors import ConfigError
from ddb2bt.transforms.model import ShardClosed
from tests.conftest import ROOT, patch_everywhere, write_mapping
from tests.unit.source.test_kinesis_share import Clock
from tests.e2e.test_kinesis_source import IDLE, KinesisWorld, apply_ops, catalog_ops

pytestmark = pytest.mark.e2e
# Simulated seconds the two workers read: the backlog, then polls at the head.
SIMULATED_S = 20.0
# The budget is an average: checked over windows of this many seconds, where
# each reader may be one call ahead (its first call is not paced).
WINDOW_S = 5.0
# How long a job started in the background may take to record its share.
START_DEADLINE_S = 120.0


class SecondTable:
    """Another DynamoDB table whose changes go into the first world's Kinesis stream."""

    def __init__(self, world: KinesisWorld, tmp_path, unique: str, **mapping) -> None:
        self.world = world
        self.path = write_mapping(tmp_path, "product_catalog.yaml", source__table=f"SrcB_{unique}",
                                  target__table=f"tb_{unique}", name=f"kb_{unique}",
                                  source__kinesis={"stream": world.stream, "precision": world.precision}, **mapping)
        self.mapping = load_mapping(self.path)
        self.stream_arn = workload.create_table(world.ddb, self.mapping.source.table)
        self._after: dict = {}
        # Kept across pumps: an item's Kinesis times strictly increase over all
        # of them (change_document), as real deliveries' do.
        self._last_us: dict = {}
        assert ddb2bt(["create-table", "--mapping", str(self.path)]) == 0

    def pump(self, seed: int) -> int:
        records = read_table_changes(StreamsClientFactory()(), self.stream_arn, self._after)
        docs = [change_document(r, self.mapping.source.table, self.world.precision, self._last_us) for r in records]
        return publish_changes(self.world.kinesis, self.world.stream, docs, Disorder(window=10, duplicate=0.1,
                                                                                     seed=seed))

    def assert_converged(self) -> None:
        items = workload.scan_all(self.world.ddb, self.mapping.source.table)
        read = lambda table: read_table(self.mapping.target.project, self.mapping.target.instance, table)  # noqa: E731
        for table, diff in compare_mapping(self.mapping, items, read).items():
            assert diff.identical, f"{table}: {diff.summary()}"


def test_one_job_of_two_tables_on_two_workers_keeps_each_shard_within_its_budget(stack, tmp_path, unique,
                                                                                  monkeypatch):
    a = KinesisWorld(tmp_path, unique + "a", "product_catalog.yaml", precision="millisecond", shards=2)
    b = SecondTable(a, tmp_path, unique)
    apply_ops(a.ddb, a.source, catalog_ops(3, 150), ("pk", "sk"))
    apply_ops(a.ddb, b.mapping.source.table, catalog_ops(4, 150), ("pk", "sk"))
    published = {a.mapping.source.table: a.pump(Disorder(window=10, duplicate=0.1, seed=1)),
                 b.mapping.source.table: b.pump(seed=2)}

    # The job as `ddb2bt run --mapping a --mapping b` builds it (leases, shares
    # in the state table), stopped before its pipeline runs.
    built: dict = {}

    def build_and_stop(args, mappings):
        built["jobs"] = real_build(args, mappings)
        raise ConfigError("built; not run")

    real_build = replicate.build_live_jobs
    monkeypatch.setattr(replicate, "build_live_jobs", build_and_stop)  # run's service
    assert ddb2bt(["run", "--mapping", str(a.path), "--mapping", str(b.path)]) == 2
    assert len(built["jobs"]) == 2

    clock = Clock()
    metered = MeteredKinesis(boto3.client("kinesis"), clock)
    # every module that bound aws_client at import (the Kinesis source does) gets the meter
    patch_everywhere(monkeypatch, connections, "aws_client", lambda service, **kw: metered)
    readers = []
    for job in built["jobs"]:
        # Each table on a worker of its own: a process pacer of its own.
        monkeypatch.setattr(kinesis_source, "PROCESS_PACER", ShardPacer(clock=clock, sleep=clock.sleep))
        reader = PartitionReader(job.client_factory(), StreamPartition(job.stream_arn, 0, 1), ReaderOptions(),
                                 lambda *_: {}, sleep=lambda s: None)
        readers.append((job.mapping.source.table, reader, LocalTracker()))
    read = dict.fromkeys(published, 0)
    while clock.now < SIMULATED_S:
        for table, reader, tracker in readers:
            out, _ = drain(reader.read_round(tracker))
            read[table] += sum(1 for r in out if not isinstance(r, ShardClosed))
    assert read == published  # every record of its own table (duplicates included), none of the other's

    shards = [s["ShardId"] for s in a.kinesis.list_shards(StreamName=a.stream)["Shards"]]
    assert len(shards) == 2
    # the readers' calls went through the meter (a patch that missed would leave it empty)
    assert {shard for _, shard, _ in metered.calls} == set(shards)
    for shard in shards:
        calls, _ = metered.busiest(shard, WINDOW_S)
        assert calls <= GET_RECORDS_PER_SECOND * WINDOW_S + len(readers), (shard, calls)


def test_a_second_job_on_the_stream_needs_a_share_that_fits(stack, tmp_path, unique, capsys):
    a = KinesisWorld(tmp_path, unique + "a", "product_catalog.yaml", precision="millisecond", shards=1)
    b = SecondTable(a, tmp_path, unique)
    apply_ops(a.ddb, a.source, catalog_ops(5, 60), ("pk", "sk"))
    apply_ops(a.ddb, b.mapping.source.table, catalog_ops(6, 60), ("pk", "sk"))
    a.pump(Disorder(window=10, duplicate=0.1, seed=1))
    b.pump(seed=2)
    stream = resolve_kinesis(a.mapping, a.kinesis).kinesis_arn
    store = StateSpec(BigtableSpec(a.mapping.target.project, a.mapping.target.instance), job=a.mapping.name).store()

    # Job 1 runs in the background with half the budget.
    cmd = [sys.executable, "-m", "ddb2bt.pipeline.app.cli", "run", "--mapping", str(a.path), "--poll-interval", "0.2",
           "--kinesis-share", "1/2"]
    proc = subprocess.Popen(cmd, env=dict(os.environ), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline and a.mapping.name not in (store.load_stream_shares(stream) or ""):
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.1)
        assert a.mapping.name in (store.load_stream_shares(stream) or ""), "job 1 never recorded its share"

        # Job 2 asking the whole budget (the default) is refused, naming job 1.
        capsys.readouterr()
        run_b = ["run", "--mapping", str(b.path), "--until-idle", IDLE, "--poll-interval", "0.2"]
        assert ddb2bt(run_b) == 2
        err = capsys.readouterr().err
        assert "--kinesis-share: Kinesis stream " + stream in err
        assert f"({a.mapping.name} 1/2)" in err and f"asks {b.mapping.name} 1:" in err and "together 3/2" in err
        # A refused start holds nothing, even where nothing releases leases at
        # exit (a Dataflow launch): a corrected rerun is not blocked by its lease
        # (refused before it takes the lease: docs/design.md §10.8).
        args, _ = cli.build_parser().parse_known_args(run_b)
        args.beam_args, args.bigtable_interceptors, args.dry = [], (), False
        with pytest.raises(ConfigError, match="together 3/2"):
            build_live_jobs(args, load_all(args))
        b_lease = LeaseState.parse(StateSpec(BigtableSpec(b.mapping.target.project, b.mapping.target.instance),
                                             job=b.mapping.name).store().load_lease(TAIL))
        assert b_lease is None or not b_lease.live(wall_ms())
        # With the half that is left it runs.
        assert ddb2bt(run_b + ["--kinesis-share", "1/2"]) == 0
        b.assert_converged()
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # a graceful stop releases job 1's lease
        proc.wait(timeout=60)
    a.assert_converged()
    # Job 1 stopped: its share is free, and job 2 may take the whole budget.
    apply_ops(a.ddb, b.mapping.source.table, catalog_ops(7, 30), ("pk", "sk"))
    b.pump(seed=3)
    assert ddb2bt(run_b) == 0
    b.assert_converged()


def test_a_take_over_refused_for_its_share_leaves_the_running_job_running(stack, tmp_path, unique, capsys):
    """Job 1 runs with 1/2 beside another job with 1/2; restarted with --take-over
    and the default share (the whole budget) it is refused for its share before
    it takes the lease: the running job 1 keeps replicating."""
    a = KinesisWorld(tmp_path, unique + "a", "product_catalog.yaml", precision="millisecond", shards=1)
    stream = resolve_kinesis(a.mapping, a.kinesis).kinesis_arn
    bigtable = BigtableSpec(a.mapping.target.project, a.mapping.target.instance)
    running_spec, rival_spec = StateSpec(bigtable, job=a.mapping.name), StateSpec(bigtable, job=f"rival_{unique}")
    running, running_lease = coordinator.hold(running_spec, TAIL, lease.LeaseOptions(), command="run")
    rival, _ = coordinator.hold(rival_spec, TAIL, lease.LeaseOptions(), command="run")
    try:
        for spec in (running_spec, rival_spec):
            record_stream(spec.store(), stream)
            take_shares(spec.store(), stream, {spec.job: Fraction(1, 2)}, wall_ms)
        capsys.readouterr()
        assert ddb2bt(["run", "--mapping", str(a.path), "--take-over", "--until-idle", IDLE]) == 2
        err = capsys.readouterr().err
        assert f"(rival_{unique} 1/2) while this job asks {a.mapping.name} 1: together 3/2" in err
        held = LeaseState.parse(running_spec.store().load_lease(TAIL))
        assert held is not None and held.holder == running_lease.holder and held.live(wall_ms())
        assert json.loads(running_spec.store().load_stream_shares(stream)) == {a.mapping.name: "1/2",
                                                                              f"rival_{unique}": "1/2"}
        # status names who holds the stream's budget.
        ddb2bt(["status", "--mapping", str(a.path)])
        assert (f"read budget of the Kinesis stream: {a.mapping.name} 1/2, rival_{unique} 1/2 (held 1 of 1)"
                in capsys.readouterr().out)
    finally:
        running.release()
        rival.release()


def test_a_job_moved_back_to_its_dynamodb_stream_frees_its_share_of_the_kinesis_stream(stack, tmp_path, unique):
    """Job 1 read the Kinesis stream with the whole budget; restarted on its
    table's DynamoDB stream it keeps running (its lease live) but no longer
    reads the Kinesis stream: a job on that stream may take the whole budget."""
    a = KinesisWorld(tmp_path, unique + "a", "product_catalog.yaml", precision="millisecond", shards=1)
    b = SecondTable(a, tmp_path, unique)
    apply_ops(a.ddb, a.source, catalog_ops(8, 30), ("pk", "sk"))
    apply_ops(a.ddb, b.mapping.source.table, catalog_ops(9, 30), ("pk", "sk"))
    b.pump(seed=4)
    stream = resolve_kinesis(a.mapping, a.kinesis).kinesis_arn
    state = StateSpec(BigtableSpec(a.mapping.target.project, a.mapping.target.instance), job=a.mapping.name)
    assert ddb2bt(["run", "--mapping", str(a.path), "--until-idle", IDLE, "--poll-interval", "0.2"]) == 0
    assert json.loads(state.store().load_stream_shares(stream)) == {a.mapping.name: "1"}
    # The same job (name, table, target) on the table's DynamoDB stream.
    on_ddb = write_mapping(tmp_path, "product_catalog.yaml", source__table=a.source,
                           target__table=a.mapping.target.table, name=a.mapping.name)
    assert ddb2bt(["run", "--mapping", str(on_ddb), "--until-idle", IDLE, "--poll-interval", "0.2"]) == 0
    # Still running there (its lease live, as a job without --until-idle holds it).
    running, _ = coordinator.hold(state, TAIL, lease.LeaseOptions(), command="run")
    try:
        assert ddb2bt(["run", "--mapping", str(b.path), "--until-idle", IDLE, "--poll-interval", "0.2"]) == 0
        assert json.loads(state.store().load_stream_shares(stream)) == {b.mapping.name: "1"}
        b.assert_converged()
    finally:
        running.release()
