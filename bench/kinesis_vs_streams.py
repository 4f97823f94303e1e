"""Changes/s and CPU per change through the Kinesis source (ordering guard:
a clock read per batch and one CheckAndMutateRow per row, docs/design.md §10.5)
against the DynamoDB Streams source (ordered, batched MutateRows), under the
same pacing, in the same run, on the same emulator, same changes.

    .venv/bin/python bench/kinesis_vs_streams.py                  # 5,000 changes, 1 shard, 3 rounds
    .venv/bin/python bench/kinesis_vs_streams.py --changes 20000 --shuffle 50 --rounds 5

Each row says its pacing:

  paced     both sources read as in production: DynamoDB Streams 5 GetRecords/s
            per shard (the reader's pacer), Kinesis 5 GetRecords/s and 2 MB/s
            per shard (the reader's pacer and the client's, a share of 1). What
            a one-shard job does on AWS, where the sink is fast enough.
  unpaced   both pacers off (the fake streams are not AWS): what the source's
            decoding and the sink cost, each as fast as this process goes.

Both read in-memory sources (bench/run.py's fake DynamoDB stream; a fake Kinesis
stream of the same changes in the published JSON shape, optionally shuffled
within a window and with duplicates), so what differs is the source's decoding,
its pacing and the sink. A round runs each pacing's two sides one after the
other, the side that goes first alternating between rounds; each side reports
wall time until every change was applied or skipped, this process's CPU per
change and the emulator's. The box is shared: compare the two sides of one
round, and read the spread over rounds, not one figure. A paced round also
reports ``kinesis_over_streams_aws_bound``: the Kinesis side's cap under AWS's
2 MB/s a shard against what the Streams side did in that round, the most the
ratio can be with these records and that Streams rate, whatever the Kinesis
reader does (at ~1 KB items, 0.36).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import (ITEM_BYTES, LAST_LIVE_RUN, MAPPING, MS_PER_S, US_PER_S, Meter, unpaced,  # noqa: E402
                       fresh_table, run_ddb2bt, run_live, settle, stream_records)
from ddb2bt.pipeline.local.local_stack import LocalStack  # noqa: E402
from ddb2bt.pipeline.testing.fakes import GET_RECORDS_MAX_BYTES  # noqa: E402

PACINGS = ("paced", "unpaced")
# DynamoDB Streams' published GetRecords limits (per shard): 5 calls/s, each at most
# 1,000 records or 1 MB (the fake stream's page, GET_RECORDS_MAX_BYTES).
STREAMS_CALLS_PER_S = 5
STREAMS_PAGE_RECORDS = 1000
STREAMS_PAGE_BYTES = GET_RECORDS_MAX_BYTES
# Changes of the unreported first run of each side: enough to import and start
# every stage once, few enough to add a second or two.
WARM_UP_CHANGES = 500


def recent(records: list) -> list:
    """bench/run.py's records moved to end now: the Kinesis reader refuses a
    record older than the stream's retention (a wrong precision setting would
    look like that), and both sides get the same times."""
    shift = time.time_ns() // 1_000_000 - max(r[4] for r in records)
    return [(event, keys, new, old, ts + shift) for event, keys, new, old, ts in records]


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


def disordered(records: list, shuffle: int, duplicate: float) -> list:
    """The Kinesis records: shuffled within windows of ``shuffle``, and a share
    ``duplicate`` of them delivered twice (at the end)."""
    docs = kinesis_documents(records, MAPPING.source.table)
    rng = random.Random(3)
    for start in range(0, len(docs), max(1, shuffle)):
        part = docs[start:start + shuffle]
        rng.shuffle(part)
        docs[start:start + shuffle] = part
    return docs + [d for d in docs if rng.random() < duplicate]


@contextmanager
def reader_pacing(paced: bool):
    """The readers' pacer (5 GetRecords/s per shard, as on AWS) left on, or
    taken away for the run."""
    if paced:
        yield
        return
    with unpaced():
        yield


def run_kinesis(docs: list, project: str, instance: str, table: str, paced: bool) -> float:
    from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec
    from ddb2bt.pipeline.graph import LiveJob
    from ddb2bt.pipeline.connect.preflight import ensure_state_table
    from ddb2bt.pipeline.clients.bigtable.admin import BigtableAdmin
    from ddb2bt.pipeline.sink.sink import SinkConfig
    from ddb2bt.pipeline.source.kinesis import KinesisStreamsClient, ShardPacer, kinesis_stream_arn
    from ddb2bt.pipeline.source.stream_source import ReaderOptions
    from ddb2bt.pipeline.testing.fakes import FAKE_CLIENTS, RegisteredClient
    from ddb2bt.pipeline.testing.kinesis_cdc import FakeKinesis
    from ddb2bt.transforms.config import FamilyConfig, KinesisSourceConfig
    from ddb2bt.transforms.ordering import CLOCK_FAMILY

    fake = FakeKinesis()
    fake.add("shardId-000000000000", docs)
    # Paced: a fresh pacer of production's limits (5 calls/s, 2 MB/s per shard), so
    # that no earlier run's budget carries over; unpaced: limits no run reaches.
    pacer = ShardPacer() if paced else ShardPacer(calls_per_s=1e9, bytes_per_s=1e15)
    name = f"K{uuid.uuid4().hex[:6]}"
    FAKE_CLIENTS[name] = KinesisStreamsClient(fake, "bench", MAPPING.source.table, pacer=pacer)
    BigtableAdmin(project, instance).add_family(table, FamilyConfig(CLOCK_FAMILY, max_versions=1))
    settle()
    ensure_state_table(project, instance, "ddb2bt_state")
    mapping = replace(MAPPING.with_overrides(table=table),
                      source=replace(MAPPING.source, kinesis=KinesisSourceConfig("bench")))
    job = LiveJob(mapping=mapping, stream_arn=kinesis_stream_arn(MAPPING.source.table, "bench"),
                  reader=ReaderOptions(until_idle_s=0.5, poll_interval_s=0.05, discovery_interval_s=60),
                  state=StateSpec(BigtableSpec(project, instance), job=f"bench_{table}"),
                  client_factory=RegisteredClient(name), sink=SinkConfig(ordering_guard=True))
    with reader_pacing(paced):
        return run_live(job, len(docs))


def run_streams(records: list, project: str, instance: str, table: str, paced: bool) -> float:
    with reader_pacing(paced):
        return run_ddb2bt(records, project, instance, table)


def measure(stack, fn, changes: int) -> dict:
    """One side's figures: changes/s (wall time until every change was applied or
    skipped), this process's and the emulator's CPU per change. This process's
    CPU is counted from the job's start to the last change applied (run_live's
    LAST_LIVE_RUN), as bench/run.py counts it: not the harness's filling of the
    fake stream (for Kinesis, JSON-encoding every record), nor the idle wait that
    only ends a local run. The emulator's is counted around the whole side."""
    settle()
    with Meter(stack.pids["bigtable"]) as m:
        wall = fn()
    return {"changes_per_s": round(changes / wall),
            "client_cpu_us_per_change": round(LAST_LIVE_RUN["cpu_s"] / changes * US_PER_S, 1),
            "emulator_cpu_us_per_change": round(m.emu / changes * US_PER_S, 1)}


def kinesis_read_cap(docs: list) -> int:
    """Changes/s one shard's 2 MB/s read limit allows for these records (the
    Kinesis side's ceiling when paced, whatever the sink does)."""
    from ddb2bt.pipeline.source.kinesis import READ_BYTES_PER_SECOND

    return round(READ_BYTES_PER_SECOND / record_bytes(docs))


def record_bytes(docs: list) -> int:
    """The records' mean size as JSON, bytes (what a read limit counts)."""
    return round(sum(len(json.dumps(d).encode()) for d in docs) / len(docs))


def stream_record_bytes(records: list) -> int:
    """The Streams records' mean SizeBytes (keys and images by DynamoDB's item-size
    rules, as the fake stream sizes them: what its 1 MB page counts)."""
    from ddb2bt.transforms.draft import item_size  # inside: only this bound needs it

    return round(sum(sum(item_size(image) for image in (keys, new, old) if image is not None)
                     for _, keys, new, old, _ in records) / len(records))


def streams_read_cap(records: list) -> int:
    """Changes/s one DynamoDB Streams shard allows on AWS for records of this size:
    5 GetRecords/s of at most 1,000 records or 1 MB (the fake stream's pages stop
    at both, as AWS's do)."""
    per_page = min(STREAMS_PAGE_RECORDS, STREAMS_PAGE_BYTES // max(1, stream_record_bytes(records)))
    return per_page * STREAMS_CALLS_PER_S


def spread(values: list) -> dict:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2), "max": round(max(values), 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--changes", type=int, default=5000)
    parser.add_argument("--item-bytes", type=int, default=ITEM_BYTES,
                        help="size of the items written (bench/run.py's ~1 KB by default): with both images "
                             "a change's record is about twice this, and a Kinesis shard reads 2 MB/s")
    parser.add_argument("--shuffle", type=int, default=1, help="Kinesis records shuffled within windows of this size")
    parser.add_argument("--duplicate", type=float, default=0.0, help="share of Kinesis records delivered twice")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every row (the spread is reported)")
    parser.add_argument("--pacing", choices=PACINGS + ("both",), default="both",
                        help="paced: AWS's per-shard read limits on both sides; unpaced: none on either")
    args = parser.parse_args(argv)
    exact = recent(stream_records(args.changes, size=args.item_bytes, whole_seconds=False))
    # Each source's times as AWS gives them: DynamoDB Streams' rounded down to the
    # second, a Kinesis record's with its microseconds (kinesis_documents).
    records = [(event, keys, new, old, ts - ts % MS_PER_S) for event, keys, new, old, ts in exact]
    docs = disordered(exact, args.shuffle, args.duplicate)
    pacings = PACINGS if args.pacing == "both" else (args.pacing,)
    kinesis_cap = kinesis_read_cap(docs)
    rows: dict = {p: [] for p in pacings}
    with LocalStack() as stack:
        stack.apply_env()
        project, instance = "bench-project", "bench-instance"
        # Not reported: the first run of each side pays for imports and the runner's start-up.
        warm = min(WARM_UP_CHANGES, args.changes)
        run_streams(records[:warm], project, instance, fresh_table(project, instance), False)
        run_kinesis(kinesis_documents(records[:warm], MAPPING.source.table), project, instance,
                    fresh_table(project, instance), False)
        for r in range(args.rounds):
            for pacing in pacings:
                paced = pacing == "paced"
                sides = {
                    "dynamodb_streams": lambda: measure(stack, lambda: run_streams(
                        records, project, instance, fresh_table(project, instance), paced), args.changes),
                    # Every delivered record counts as a change (duplicates included): what the reader
                    # and the guard handle.
                    "kinesis_guarded": lambda: measure(stack, lambda: run_kinesis(
                        docs, project, instance, fresh_table(project, instance), paced), len(docs)),
                }
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                row = {"round": r + 1, "pacing": pacing, "first": order[0]}
                for side in order:
                    row[side] = sides[side]()
                row["kinesis_over_streams"] = round(row["kinesis_guarded"]["changes_per_s"]
                                                    / row["dynamodb_streams"]["changes_per_s"], 2)
                if paced:
                    # The most a Kinesis reader could reach under AWS's 2 MB/s a shard,
                    # against what the Streams side did: the ratio's ceiling, set by AWS.
                    row["kinesis_over_streams_aws_bound"] = round(
                        kinesis_cap / row["dynamodb_streams"]["changes_per_s"], 2)
                    row["kinesis_share_of_its_cap"] = round(row["kinesis_guarded"]["changes_per_s"] / kinesis_cap, 2)
                rows[pacing].append(row)
                print(json.dumps(row), flush=True)
    out = {"changes": args.changes, "kinesis_records": len(docs), "shuffle": args.shuffle,
           "duplicate": args.duplicate, "rounds": args.rounds,
           "item_bytes": args.item_bytes, "kinesis_record_bytes": record_bytes(docs),
           "kinesis_2mb_per_s_cap_changes_per_s": kinesis_cap,
           "streams_record_bytes": stream_record_bytes(records),
           "streams_1mb_page_cap_changes_per_s": streams_read_cap(records)}
    for pacing, runs in rows.items():
        out[pacing] = {
            "dynamodb_streams_changes_per_s": spread([x["dynamodb_streams"]["changes_per_s"] for x in runs]),
            "kinesis_guarded_changes_per_s": spread([x["kinesis_guarded"]["changes_per_s"] for x in runs]),
            "kinesis_over_streams": spread([x["kinesis_over_streams"] for x in runs]),
            **({"kinesis_over_streams_aws_bound": spread([x["kinesis_over_streams_aws_bound"] for x in runs]),
                "kinesis_share_of_its_cap": spread([x["kinesis_share_of_its_cap"] for x in runs])}
               if pacing == "paced" else {}),
            "dynamodb_streams_client_cpu_us_per_change": spread(
                [x["dynamodb_streams"]["client_cpu_us_per_change"] for x in runs]),
            "kinesis_guarded_client_cpu_us_per_change": spread(
                [x["kinesis_guarded"]["client_cpu_us_per_change"] for x in runs]),
            "dynamodb_streams_emulator_cpu_us_per_change": spread(
                [x["dynamodb_streams"]["emulator_cpu_us_per_change"] for x in runs]),
            "kinesis_guarded_emulator_cpu_us_per_change": spread(
                [x["kinesis_guarded"]["emulator_cpu_us_per_change"] for x in runs]),
        }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
