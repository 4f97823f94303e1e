"""The real Beam pipeline (source SDF, mapping, sink) over the fake stream client —
for what moto cannot do (shard splits, trimming) — writing to cbtemulator."""
from __future__ import annotations

import pytest

from ddb2bt.pipeline.clients.bigtable.admin import ensure_mapping_table
from ddb2bt.pipeline.clients.bigtable.reads import read_table
from ddb2bt.pipeline.verify.compare import diff_layout, expected_layout
from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec
from ddb2bt.pipeline.testing.fakes import FAKE_CLIENTS, FakeStreamsClient, RegisteredClient
from ddb2bt.pipeline.graph import LiveJob, add_live_replication, make_pipeline
from ddb2bt.pipeline.connect.preflight import ensure_state_table
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.source.stream_source import ReaderOptions
from tests.conftest import write_mapping
from ddb2bt.transforms.config import load_mapping

pytestmark = pytest.mark.e2e


def item(pk, sk, price):
    return {"pk": {"S": pk}, "sk": {"S": sk}, "Price": {"N": str(price)}, "Description": {"S": f"{pk}/{sk}"}}


def keys(i):
    return {"pk": i["pk"], "sk": i["sk"]}


def run(mapping, client, partitions=2, **reader):
    FAKE_CLIENTS[client.table] = client
    ensure_mapping_table(mapping)
    ensure_state_table(mapping.target.project, mapping.target.instance, "ddb2bt_state")
    opts = dict(until_idle_s=1.0, poll_interval_s=0.05, discovery_interval_s=0.2,
                retry=RetryPolicy(0.01, 0.05, 10.0))
    opts.update(reader)
    job = LiveJob(mapping=mapping, stream_arn=client.stream_arn, reader=ReaderOptions(**opts),
                  state=StateSpec(BigtableSpec(mapping.target.project, mapping.target.instance), job=mapping.name),
                  partitions=partitions, client_factory=RegisteredClient(client.table))
    p = make_pipeline([])
    add_live_replication(p, job)
    p.run().wait_until_finish()


def test_shard_splits_keep_per_key_order_through_the_pipeline(stack, tmp_path, unique):
    mapping = load_mapping(write_mapping(tmp_path, target__table=f"split_{unique}", name=f"split_{unique}"))
    client = FakeStreamsClient(table=f"Split{unique}", page_size=7)
    final = {}
    # Three generations: root → two children → a grandchild; the same keys are
    # modified in every generation, so reading a child before its parent would
    # leave an older value (or resurrect a deleted item).
    client.add_shard("shard-0")
    generations = [["shard-0"], ["shard-1a", "shard-1b"], ["shard-2"]]
    version = 0
    for g, shards in enumerate(generations):
        if g == 1:
            client.split("shard-0", "shard-1a", "shard-1b")
        if g == 2:
            client.close_shard("shard-1b")
            client.split("shard-1a", "shard-2")
        for n in range(40):
            version += 1
            k = f"k{n % 10}"
            shard = shards[0] if g != 1 else ("shard-1a" if n % 10 < 5 else "shard-1b")
            if g == 2 and n % 10 >= 5:
                continue  # shard-1b's keys are finished
            new = item("hats", k, version)
            old = final.get(k)
            if version % 7 == 0 and old is not None:
                client.put(shard, "REMOVE", keys(old), None, old)
                final.pop(k)
                continue
            client.put(shard, "MODIFY" if old else "INSERT", keys(new), new, old)
            final[k] = new
    run(mapping, client)
    actual = read_table(mapping.target.project, mapping.target.instance, mapping.target.table)
    diff = diff_layout(expected_layout(mapping, final.values())[mapping.target.table], actual)
    assert diff.identical, diff.summary()
    store = StateSpec(BigtableSpec(mapping.target.project, mapping.target.instance), job=mapping.name).store()
    ckpts = store.load_checkpoints(client.stream_arn)
    assert {s for s, c in ckpts.items() if c.finished} == {"shard-0", "shard-1a", "shard-1b"}
    assert not ckpts["shard-2"].finished


def test_trimmed_data_stops_the_pipeline_loudly(stack, tmp_path, unique):
    mapping = load_mapping(write_mapping(tmp_path, target__table=f"trim_{unique}", name=f"trim_{unique}"))
    client = FakeStreamsClient(table=f"Trim{unique}")
    client.add_shard("s")
    for i in range(5):
        client.put("s", "INSERT", keys(item("hats", f"k{i}", i)), item("hats", f"k{i}", i))
    run(mapping, client, partitions=1)
    # the job is stopped; meanwhile the stream trims past its checkpoint
    client.put("s", "INSERT", keys(item("hats", "late", 9)), item("hats", "late", 9))
    client.shards["s"].trimmed_before = 6
    with pytest.raises(Exception) as err:
        run(mapping, client, partitions=1)
    text = str(err.value)
    assert "LOST" in text and "backfill" in text


def test_a_quiet_shard_seen_at_its_head_resumes_its_trimmed_checkpoint_through_the_pipeline(stack, tmp_path, unique):
    """docs/design.md §8.2 through the real SDF, sink and state table: the first
    run idles at the head long enough to prove it (3 empty pages over 3 s) and
    records it; the checkpoint (its last record) then ages out with nothing
    after it lost, and the second run goes on from the oldest record."""
    mapping = load_mapping(write_mapping(tmp_path, target__table=f"quiet_{unique}", name=f"quiet_{unique}"))
    client = FakeStreamsClient(table=f"Quiet{unique}")
    client.add_shard("s")
    final = {}
    for i in range(3):
        final[f"k{i}"] = item("hats", f"k{i}", i)
        client.put("s", "INSERT", keys(final[f"k{i}"]), final[f"k{i}"])
    run(mapping, client, partitions=1, until_idle_s=4.0, poll_interval_s=0.2)
    store = StateSpec(BigtableSpec(mapping.target.project, mapping.target.instance), job=mapping.name).store()
    assert "s" in store.load_shard_heads(client.stream_arn)
    # stopped; the quiet shard's last record ages out, a change arrives after it
    client.shards["s"].trimmed_before = 3
    final["late"] = item("hats", "late", 9)
    client.put("s", "INSERT", keys(final["late"]), final["late"])
    run(mapping, client, partitions=1)
    actual = read_table(mapping.target.project, mapping.target.instance, mapping.target.table)
    diff = diff_layout(expected_layout(mapping, final.values())[mapping.target.table], actual)
    assert diff.identical, diff.summary()
