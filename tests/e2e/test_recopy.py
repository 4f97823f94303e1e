"""A re-copy that re-copies (issue 33, items 2 and 8): `migrate --restart` on a
LIVE job copies the table again and leaves the target equal to it — rows
deleted behind the job's back rewritten, rows of items deleted while changes
were lost removed — and the advice of a replaced stream's refusal, followed,
ends IDENTICAL."""
from __future__ import annotations

import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.connect.connections import StreamsClientFactory
from ddb2bt.pipeline.control.phases import Migration
from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
from ddb2bt.pipeline.clients.bigtable.reads import read_table
from ddb2bt.pipeline.control.state import ShardCheckpoint
from ddb2bt.transforms.model import DeleteCells
from tests.e2e.test_cutover import (assert_target_is_exactly_the_mapping, identical, preload, setup, store_of)

pytestmark = pytest.mark.e2e

ITEMS = 300
LOST_DELETES = 25  # items deleted in DynamoDB whose stream records are never applied
TARGET_DELETES = 10  # rows deleted from Bigtable behind the job's back


def _migrate_live(path):
    assert ddb2bt(["migrate", "--mapping", str(path), "--segments", "2", "--until-idle", "1",
                   "--poll-interval", "0.2"]) == 0


def _skip_the_stream(mapping, ddb, store):
    """Lose every change the stream holds past the checkpoints: each shard's
    checkpoint is moved to its last record, as if those records had been trimmed
    before the tail applied them."""
    arn = ddb.describe_table(TableName=mapping.source.table)["Table"]["LatestStreamArn"]
    streams = StreamsClientFactory(mapping.source.region)()
    checkpoints = store.load_checkpoints(arn)
    moved = []
    for shard in streams.describe_stream(StreamArn=arn)["StreamDescription"]["Shards"]:
        sid = shard["ShardId"]
        seq = checkpoints[sid].sequence_number if sid in checkpoints else None
        args = {"ShardIteratorType": "AFTER_SEQUENCE_NUMBER", "SequenceNumber": seq} if seq else \
            {"ShardIteratorType": "TRIM_HORIZON"}
        it = streams.get_shard_iterator(StreamArn=arn, ShardId=sid, **args)["ShardIterator"]
        last = seq
        while it:
            page = streams.get_records(ShardIterator=it, Limit=1000)
            if not page["Records"]:
                break
            last = page["Records"][-1]["dynamodb"]["SequenceNumber"]
            it = page.get("NextShardIterator")
        if last != seq:
            moved.append(ShardCheckpoint(arn, sid, last))
    assert moved, "the lost deletes should be in the stream"
    store.save_checkpoints(moved)


def _delete_target_rows(mapping, count):
    t = mapping.target
    rows = read_table(t.project, t.instance, t.table)
    keys = sorted(rows)[:count]
    writer = GrpcMutationWriter(t.project, t.instance)
    far = 4_000_000_000_000  # after every cell: the whole row goes
    writer.mutate_rows(t.table, [(k, [DeleteCells(f, q, 0, far) for (f, q) in rows[k]]) for k in keys])
    writer.close()


def _delete_items(ddb, table, items):
    for it in items:
        ddb.delete_item(TableName=table, Key={"pk": it["pk"], "sk": it["sk"]})


def test_restart_on_a_live_job_recopies_the_table(stack, tmp_path, unique, capsys):
    path, mapping, ddb = setup(tmp_path, unique)
    items = preload(ddb, mapping.source.table, ITEMS, seed=31)
    _migrate_live(path)
    store = store_of(mapping)
    assert Migration(store).phase == "LIVE"
    first_handoff = Migration(store).handoff_ms
    # Changes lost: items deleted in DynamoDB, their REMOVE records never applied.
    _delete_items(ddb, mapping.source.table, items[:LOST_DELETES])
    _skip_the_stream(mapping, ddb, store)
    # Rows deleted from the target behind the job's back.
    _delete_target_rows(mapping, TARGET_DELETES)
    ok, summary = identical(mapping, ddb)
    assert not ok, "the divergence should be visible before the re-copy"
    capsys.readouterr()
    assert ddb2bt(["migrate", "--mapping", str(path), "--restart", "--segments", "2", "--until-idle", "1",
                   "--poll-interval", "0.2"]) == 0
    assert "migration LIVE" in capsys.readouterr().out
    assert Migration(store).phase == "LIVE"
    assert Migration(store).handoff_ms > first_handoff, "a new backfill, with a new handoff time"
    assert not Migration(store).recopy_pending
    assert_target_is_exactly_the_mapping(mapping, ddb)
    assert ddb2bt(["verify", "--mapping", str(path)]) == 0


@pytest.mark.parametrize("extra", [[], ["--new-stream"]], ids=["restart", "restart-new-stream"])
def test_a_replaced_stream_recovers_by_following_its_own_advice(stack, tmp_path, unique, capsys, extra):
    path, mapping, ddb = setup(tmp_path, unique)
    items = preload(ddb, mapping.source.table, ITEMS, seed=32)
    _migrate_live(path)
    table = mapping.source.table
    old_arn = ddb.describe_table(TableName=table)["Table"]["LatestStreamArn"]
    # The stream is disabled, items are deleted, the stream is enabled again:
    # those deletes are in no stream. (moto cannot re-enable a table's stream,
    # so the table is re-created with its items and then given a new stream:
    # the same outcome, a new stream ARN that starts empty.)
    kept = workload.scan_all(ddb, table)
    lost = {(i["pk"]["S"], i["sk"]["S"]) for i in items[:LOST_DELETES]}
    ddb.delete_table(TableName=table)
    ddb.create_table(TableName=table, BillingMode="PAY_PER_REQUEST",
                     AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"},
                                           {"AttributeName": "sk", "AttributeType": "S"}],
                     KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"},
                                {"AttributeName": "sk", "KeyType": "RANGE"}])
    for item in kept:
        if (item["pk"]["S"], item["sk"]["S"]) not in lost:
            ddb.put_item(TableName=table, Item=item)
    ddb.update_table(TableName=table, StreamSpecification={"StreamEnabled": True,
                                                           "StreamViewType": "NEW_AND_OLD_IMAGES"})
    assert ddb.describe_table(TableName=table)["Table"]["LatestStreamArn"] != old_arn
    capsys.readouterr()
    # The tail refuses, naming the recovery ...
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", "--poll-interval", "0.2"]) != 0
    err = capsys.readouterr().err
    assert "stream was replaced" in err and "ddb2bt migrate --restart" in err
    # ... and that command, as given (with --new-stream too), copies the table
    # again and tails the new stream: never "LIVE" without the copy.
    assert ddb2bt(["migrate", "--mapping", str(path), "--restart", *extra, "--segments", "2", "--until-idle", "1",
                   "--poll-interval", "0.2"]) == 0
    assert_target_is_exactly_the_mapping(mapping, ddb)
    assert ddb2bt(["verify", "--mapping", str(path)]) == 0
    # The new stream is followed from now on: a later change arrives.
    ddb.delete_item(TableName=table, Key={"pk": items[-1]["pk"], "sk": items[-1]["sk"]})
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", "--poll-interval", "0.2"]) == 0
    ok, summary = identical(mapping, ddb)
    assert ok, summary


def test_restart_removes_versioned_comments_and_videos_deleted_while_changes_were_lost(stack, tmp_path, unique):
    """Versioned cells (comments timestamped by CreatedAt) of deleted comments in
    a column other comments still own, and whole videos, go; their version
    owners are released, so a new comment may take such a version again."""
    from tests.unit.transforms.test_examples import item

    path, mapping, ddb = setup(tmp_path, unique, base="videos.yaml")
    table = mapping.source.table
    comments = []
    for v in range(12):
        pk = f"{v:04d}"
        ddb.put_item(TableName=table, Item=item(pk=pk, sk="Video", UploadDate="2023-09-10T15:21:48",
                                                Formats={"480": f"https://s/{pk}"}))
        for c in range(4):
            it = item(pk=pk, sk=f"VideoComment#{c}", Content=f"comment {c}", CreatedAt=f"2023-09-1{c}T10:00:{v:02d}")
            ddb.put_item(TableName=table, Item=it)
            comments.append(it)
    _migrate_live(path)
    store = store_of(mapping)
    lost = comments[::3] + [item(pk="0000", sk="Video")]
    _delete_items(ddb, table, lost)
    _skip_the_stream(mapping, ddb, store)
    assert not identical(mapping, ddb)[0]
    assert ddb2bt(["migrate", "--mapping", str(path), "--restart", "--segments", "2", "--until-idle", "1",
                   "--poll-interval", "0.2"]) == 0
    assert_target_is_exactly_the_mapping(mapping, ddb)
    # A deleted comment's version is free again: a new comment at the same time is no clash.
    again = dict(comments[0], sk={"S": "VideoComment#new"}, Content={"S": "same second"})
    ddb.put_item(TableName=table, Item=again)
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", "--poll-interval", "0.2"]) == 0
    assert store.count_dead_letters() == 0
    assert ddb2bt(["verify", "--mapping", str(path)]) == 0
