"""Changes/s through the Kinesis source (ordering guard: one CheckAndMutateRow
per row, docs/design.md §10.5) against the DynamoDB Streams source (ordered,
batched MutateRows), in the same run, on the same emulator, same changes.

    .venv/bin/python bench/kinesis_vs_streams.py              # 5,000 changes, 1 partition
    .venv/bin/python bench/kinesis_vs_streams.py --changes 20000 --shuffle 50

Both read in-memory sources (bench/run.py's fake DynamoDB stream; a fake Kinesis
stream of the same changes in the published JSON shape, optionally shuffled
within a window and with duplicates), so what differs is the source's decoding
and the sink. Kinesis's own per-shard read limit (5 GetRecords/s, 2 MB/s per
shard) is not applied here (pacing off): it caps one shard at ~5,000 changes/s
of 1 KB items on AWS whatever the sink does. Wall time until every change was
applied; the box is shared, so numbers are noisy: compare the two lines of one
run, not runs.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import uuid
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import MAPPING, fresh_table, run_ddb2bt, run_live, settle, stream_records  # noqa: E402
from ddb2bt.pipeline.local.local_stack import LocalStack  # noqa: E402


def kinesis_documents(records: list, table: str) -> list:
    from ddb2bt.transforms.attrs import item_to_dynamodb_json

    docs = []
    for i, (event, keys, new, old, ts) in enumerate(records):
        body = {"ApproximateCreationDateTime": ts * 1000 + i % 1000, "Keys": item_to_dynamodb_json(keys),
                "SizeBytes": 1000}
        if new is not None:
            body["NewImage"] = item_to_dynamodb_json(new)
        if old is not None:
            body["OldImage"] = item_to_dynamodb_json(old)
        docs.append({"eventName": event, "eventID": str(i), "tableName": table, "dynamodb": body,
                     "recordFormat": "application/json", "eventSource": "aws:dynamodb"})
    return docs


def run_kinesis(records: list, project: str, instance: str, table: str, shuffle: int, duplicate: float) -> float:
    from ddb2bt.pipeline.connections import BigtableSpec, StateSpec
    from ddb2bt.pipeline.graph import LiveJob
    from ddb2bt.pipeline.preflight import ensure_state_table
    from ddb2bt.pipeline.clients.bigtable.admin import BigtableAdmin
    from ddb2bt.pipeline.sink.sink import SinkConfig
    from ddb2bt.pipeline.source.kinesis import KinesisStreamsClient, ShardPacer, kinesis_stream_arn
    from ddb2bt.pipeline.source.stream_source import ReaderOptions
    from ddb2bt.pipeline.testing.fakes import FAKE_CLIENTS, RegisteredClient
    from ddb2bt.pipeline.testing.kinesis_cdc import FakeKinesis
    from ddb2bt.transforms.config import FamilyConfig, KinesisSourceConfig
    from ddb2bt.transforms.ordering import CLOCK_FAMILY

    docs = kinesis_documents(records, MAPPING.source.table)
    rng = random.Random(3)
    for start in range(0, len(docs), max(1, shuffle)):
        part = docs[start:start + shuffle]
        rng.shuffle(part)
        docs[start:start + shuffle] = part
    extra = [d for d in docs if rng.random() < duplicate]
    fake = FakeKinesis()
    fake.add("shardId-000000000000", docs + extra)
    no_pacing = ShardPacer(calls_per_s=1e9, bytes_per_s=1e15)
    name = f"K{uuid.uuid4().hex[:6]}"
    FAKE_CLIENTS[name] = KinesisStreamsClient(fake, "bench", MAPPING.source.table, pacer=no_pacing)
    BigtableAdmin(project, instance).add_family(table, FamilyConfig(CLOCK_FAMILY, max_versions=1))
    settle()
    ensure_state_table(project, instance, "ddb2bt_state")
    mapping = replace(MAPPING.with_overrides(table=table),
                      source=replace(MAPPING.source, kinesis=KinesisSourceConfig("bench")))
    job = LiveJob(mapping=mapping, stream_arn=kinesis_stream_arn(MAPPING.source.table, "bench"),
                  reader=ReaderOptions(until_idle_s=0.5, poll_interval_s=0.05, discovery_interval_s=60),
                  state=StateSpec(BigtableSpec(project, instance), job=f"bench_{table}"),
                  client_factory=RegisteredClient(name), sink=SinkConfig(ordering_guard=True))
    return run_live(job, len(docs) + len(extra))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--changes", type=int, default=5000)
    parser.add_argument("--shuffle", type=int, default=1, help="Kinesis records shuffled within windows of this size")
    parser.add_argument("--duplicate", type=float, default=0.0, help="share of Kinesis records delivered twice")
    args = parser.parse_args(argv)
    records = stream_records(args.changes)
    with LocalStack() as stack:
        stack.apply_env()
        project, instance = "bench-project", "bench-instance"
        t_streams = run_ddb2bt(records, project, instance, fresh_table(project, instance))
        t_kinesis = run_kinesis(records, project, instance, fresh_table(project, instance), args.shuffle,
                                args.duplicate)
    out = {"changes": args.changes, "shuffle": args.shuffle, "duplicate": args.duplicate,
           "dynamodb_streams_changes_per_s": round(args.changes / t_streams),
           "kinesis_guarded_changes_per_s": round(args.changes / t_kinesis),
           "guard_cost_ratio": round(t_kinesis / t_streams, 2)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
