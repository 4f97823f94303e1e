"""`dlq redrive` and `repair` of a Kinesis job write through the ordering guard
(docs/design.md §10, docs/kinesis.md), and `recover` refuses a Kinesis mapping:
a write around the item's clock survives a later REMOVE (which deletes only what
the clock lists), and a redriven delete without a tombstone lets a late older
change bring the item back."""
from __future__ import annotations

import time

import boto3
import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec, dynamodb_client
from ddb2bt.pipeline.recover.redrive import RedriveOptions, redrive_job
from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
from ddb2bt.pipeline.clients.bigtable.reads import read_table
from ddb2bt.pipeline.sink.guarded import apply_guarded
from ddb2bt.transforms.attrs import from_plain
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.model import INSERT, MODIFY, REMOVE, ChangeRecord, DeadLetter
from ddb2bt.transforms.ordering import CLOCK_FAMILY, guarded_rows
from tests.conftest import write_mapping

pytestmark = pytest.mark.e2e


def item(**kw):
    return {k: from_plain(v) for k, v in kw.items()}


def change(event, keys, new, old, ms):
    return ChangeRecord(event, keys, new, old, ms, change_us=ms * 1000)


def test_a_redrive_of_a_kinesis_job_writes_through_the_clock(stack, tmp_path, unique, capsys):
    path = write_mapping(tmp_path, source__table=f"Src_{unique}", target__table=f"t_{unique}", name=f"r_{unique}",
                         source__kinesis={"stream": f"cdc_{unique}"})
    boto3.client("kinesis").create_stream(StreamName=f"cdc_{unique}", ShardCount=1)
    mapping = load_mapping(path)
    ddb = dynamodb_client()
    workload.create_table(ddb, mapping.source.table)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    writer = GrpcMutationWriter(mapping.target.project, mapping.target.instance)
    spec = StateSpec(BigtableSpec(mapping.target.project, mapping.target.instance), mapping.name)
    store = spec.store()
    t0 = int(time.time() * 1000) - 60_000
    a, b = item(pk="hats", sk="a"), item(pk="hats", sk="b")
    a1, a2 = item(pk="hats", sk="a", Price=1), item(pk="hats", sk="a", Price=1, Description="felt")
    b1, b2 = item(pk="hats", sk="b", Price=1), item(pk="hats", sk="b", Price=2)
    try:
        # Applied by the tail through the guard: a and b created.
        for record in (change(INSERT, a, a1, None, t0), change(INSERT, b, b1, None, t0)):
            apply_guarded(writer, guarded_rows(mapping, record))
        # Dead-lettered: a gains a Description, b changes; then b is deleted (that REMOVE lost too).
        late_b = change(MODIFY, b, b2, b1, t0 + 1000)
        store.save_dead_letters([DeadLetter("encoding", "MappingError", "m", "map", change(MODIFY, a, a2, a1,
                                                                                           t0 + 1000), t0),
                                 DeadLetter("encoding", "MappingError", "m", "map", late_b, t0)])
        ddb.put_item(TableName=mapping.source.table, Item=a2)  # DynamoDB now: a with Description, no b
        result = redrive_job(mapping, spec, RedriveOptions())
        assert (result.items, result.resolved) == (2, 2)
        after = int(time.time() * 1000) + 1000
        # a is deleted after the redrive; a late duplicate of b's old change arrives.
        apply_guarded(writer, guarded_rows(mapping, change(REMOVE, a, None, a2, after)))
        apply_guarded(writer, guarded_rows(mapping, late_b))
        rows = read_table(mapping.target.project, mapping.target.instance, mapping.target.table)
        owned = {key: sorted(q for (f, q) in cells if f != CLOCK_FAMILY) for key, cells in rows.items()}
        assert owned.get(b"hats#a", []) == [], "the REMOVE deletes what the redrive wrote"
        assert owned.get(b"hats#b", []) == [], "the redriven delete's tombstone keeps the late change out"
    finally:
        store.close()
        writer.close()
    capsys.readouterr()
    assert ddb2bt(["recover", "--mapping", str(path)]) == 2
    err = capsys.readouterr().err
    assert "source.kinesis" in err and "ordering guard" in err


def test_shuffled_duplicated_delivery_with_a_dead_letter_fixed_and_redriven_converges(stack, tmp_path, unique,
                                                                                      capsys):
    """The Kinesis end to end: shuffled, duplicated records on several shards
    converge, including an item whose change was dead-lettered by
    a broken mapping, redriven once the mapping is fixed, and then deleted: the
    REMOVE must delete what the redrive wrote (no divergent cell)."""
    from ddb2bt.pipeline.testing.kinesis_cdc import Disorder
    from tests.e2e.test_kinesis_source import IDLE, KinesisWorld, apply_ops, catalog_ops

    world = KinesisWorld(tmp_path, unique, "product_catalog.yaml")
    broken = write_mapping(tmp_path, "product_catalog.yaml", source__table=world.source, target__table=f"t_{unique}",
                           name=f"k_{unique}", source__kinesis={"stream": world.stream, "precision": "microsecond"},
                           rules__0__columns__Description={"column": "SKU:Description", "encoding": "int64"})
    run = ["--until-idle", IDLE, "--poll-interval", "0.2"]
    apply_ops(world.ddb, world.source, catalog_ops(41, 150), ("pk", "sk"))
    # (No split: moto keeps putting records into a split parent, which the reader has finished.)
    world.pump(Disorder(window=20, duplicate=0.15, seed=5))
    world.run()
    hat = item(pk="redriven", sk="hat", Price=1)
    world.ddb.put_item(TableName=world.source, Item=hat)
    world.pump(Disorder(seed=6))
    assert ddb2bt(["run", "--mapping", str(broken), *run]) == 0
    world.ddb.put_item(TableName=world.source, Item=dict(hat, Description=from_plain("felt")))
    world.pump(Disorder(seed=7))
    capsys.readouterr()
    assert ddb2bt(["run", "--mapping", str(broken), *run]) == 0
    assert "1 dead-lettered" in capsys.readouterr().out  # its change is a dead letter
    assert ddb2bt(["dlq", "redrive", "--mapping", str(world.path)]) == 0  # the mapping fixed
    world.ddb.delete_item(TableName=world.source, Key=item(pk="redriven", sk="hat"))
    apply_ops(world.ddb, world.source, catalog_ops(42, 100), ("pk", "sk"))
    world.pump(Disorder(window=20, duplicate=0.15, seed=8))
    world.run()
    rows = world.assert_converged()
    assert not any(f != CLOCK_FAMILY for f, _ in rows.get(b"redriven#hat", {})), "the REMOVE deleted it all"
    store = StateSpec(BigtableSpec(world.mapping.target.project, world.mapping.target.instance),
                      world.mapping.name).store()
    try:
        assert store.count_dead_letters() == 0
    finally:
        store.close()
