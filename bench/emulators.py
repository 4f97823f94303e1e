"""moto or ministack: which local AWS emulator is closer to AWS, and which is
faster, measured on this machine (docs/benchmarks.md, "The two AWS emulators").

Each emulator gets a fresh local stack (`LocalStack(dynamodb=...)`, as
`ddb2bt local up --dynamodb ...` starts it) and the same work:

* speed: start-up, BatchWriteItem, a full Scan, draining the stream with
  GetRecords, and a real `ddb2bt run --until-idle` over that stream;
* fidelity: each behaviour of DynamoDB and DynamoDB Streams the product relies on
  (docs/design.md §2), checked against what AWS documents.

    .venv/bin/python bench/emulators.py [--items 3000]   # ~2 minutes; JSON in bench/results/
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BATCH = 25  # BatchWriteItem's limit
PAYLOAD_CHARS = 1400  # ~1.5 KB records: 1,000 of them (GetRecords' count limit) exceed AWS's 1 MB page
KIB = 1024
ITEM_BYTES_PROBE = 1_000_000  # an item number whose size stands for all (7-digit sort keys)
RETENTION_PROBE_S = 2.0  # ministack's retention for the trimming probe (moto has none to set)
AWS_MAX_NUMBER_DIGITS = 38


def _size(item: dict) -> int:
    """An item's size as DynamoDB counts it: names plus values (a number: about one
    byte per two digits, plus one)."""
    return sum(len(name) + (len(v["S"].encode()) if "S" in v else len(v["N"]) // 2 + 1) for name, v in item.items())


def _item(n: int) -> dict:
    return {"pk": {"S": f"p{n % 97}"}, "sk": {"S": f"s{n:07d}"}, "Price": {"N": str(n)},
            "Description": {"S": "d" * PAYLOAD_CHARS}}


ITEM_BYTES = _size(_item(ITEM_BYTES_PROBE))


def _shard_records(streams, arn: str) -> list:
    out = []
    for shard in streams.describe_stream(StreamArn=arn)["StreamDescription"]["Shards"]:
        it = streams.get_shard_iterator(StreamArn=arn, ShardId=shard["ShardId"],
                                        ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
        while it:
            page = streams.get_records(ShardIterator=it, Limit=1000)
            out.extend(page["Records"])
            if not page["Records"]:
                break
            it = page.get("NextShardIterator")
    return out


def _code(fn) -> str:
    from botocore.exceptions import ClientError

    try:
        fn()
    except ClientError as exc:
        return exc.response["Error"]["Code"]
    return "accepted"


def measure(dynamodb: str, items: int) -> dict:
    from ddb2bt.pipeline.connect.connections import StreamsClientFactory, dynamodb_client
    from ddb2bt.pipeline.local import workload
    from ddb2bt.pipeline.local.local_stack import MINISTACK, LocalStack

    result: dict = {"dynamodb": dynamodb}
    began = time.monotonic()
    stack = LocalStack(log_dir=Path(tempfile.mkdtemp()), dynamodb=dynamodb,
                       stream_retention_s=RETENTION_PROBE_S * 30 if dynamodb == MINISTACK else None)
    stack.start()
    result["start_s"] = round(time.monotonic() - began, 2)
    previous = stack.apply_env()
    try:
        ddb, streams = dynamodb_client(), StreamsClientFactory()()
        table = "BenchEmulators"
        workload.create_table(ddb, table)
        arn = ddb.describe_table(TableName=table)["Table"]["LatestStreamArn"]
        began = time.monotonic()
        for start in range(0, items, BATCH):
            ddb.batch_write_item(RequestItems={table: [{"PutRequest": {"Item": _item(n)}}
                                                       for n in range(start, min(start + BATCH, items))]})
        result["batch_write_items_per_s"] = round(items / (time.monotonic() - began))
        began = time.monotonic()
        pages, scanned, first_page = 0, 0, None
        kwargs: dict = {"TableName": table}
        while True:
            page = ddb.scan(**kwargs)
            pages += 1
            scanned += len(page["Items"])
            first_page = first_page if first_page is not None else len(page["Items"])
            if "LastEvaluatedKey" not in page:
                break
            kwargs["ExclusiveStartKey"] = page["LastEvaluatedKey"]
        result["scan_items_per_s"] = round(scanned / (time.monotonic() - began))
        began = time.monotonic()
        records = _shard_records(streams, arn)
        result["get_records_per_s"] = round(len(records) / (time.monotonic() - began))
        result["run_until_idle_changes_per_s"] = _ddb2bt_run(table, len(records))
        first = streams.get_records(ShardIterator=streams.get_shard_iterator(
            StreamArn=arn, ShardId=_first_shard(streams, arn),
            ShardIteratorType="TRIM_HORIZON")["ShardIterator"], Limit=1000)["Records"]
        fidelity = {
            # AWS: rounded down to the whole second (docs/design.md §2)
            "record_times_whole_seconds": all(r["dynamodb"]["ApproximateCreationDateTime"].microsecond == 0
                                              for r in records),
            # AWS: a Scan page stops at 1 MB; GetRecords at 1 MB or 1,000 records
            # (sizes as DynamoDB counts items, to within a few per cent)
            "scan_first_page_items": first_page,
            "scan_first_page_kib": round(first_page * ITEM_BYTES / KIB),
            "get_records_first_page_records": len(first),
            "get_records_first_page_kib": round(len(first) * ITEM_BYTES / KIB),
            "records_carry_size_bytes": all(r["dynamodb"].get("SizeBytes", 0) > 0 for r in records),
            "records_carry_event_source_arn": all("eventSourceARN" in r for r in records),
            "records_per_write": round(len(records) / items, 3),
        }
        # AWS writes no stream record for a put that changes nothing
        before = len(_shard_records(streams, arn))
        ddb.put_item(TableName=table, Item=_item(0))
        fidelity["no_op_put_writes_a_record"] = len(_shard_records(streams, arn)) > before
        # AWS: numbers hold at most 38 significant digits; names are 3-255 characters
        fidelity["number_of_39_digits"] = _code(lambda: ddb.put_item(
            TableName=table, Item={"pk": {"S": "x"}, "sk": {"S": "y"}, "Price": {"N": "1" * 39}}))
        fidelity["table_name_of_2_characters"] = _code(lambda: workload.create_table(ddb, "ab"))
        fidelity.update(_trimming(dynamodb))
        result["fidelity"] = fidelity
    finally:
        stack.stop()
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return result


def _first_shard(streams, arn: str) -> str:
    return streams.describe_stream(StreamArn=arn)["StreamDescription"]["Shards"][0]["ShardId"]


def _trimming(dynamodb: str) -> dict:
    """Does a record older than the retention become TrimmedDataAccessException? On
    ministack with its retention set to seconds; moto has no retention to set."""
    from ddb2bt.pipeline.connect.connections import StreamsClientFactory, dynamodb_client
    from ddb2bt.pipeline.local import workload
    from ddb2bt.pipeline.local.local_stack import MINISTACK, LocalStack

    if dynamodb != MINISTACK:
        return {"trims_records_past_retention": "moto has no retention: never trims"}
    with LocalStack(log_dir=Path(tempfile.mkdtemp()), dynamodb=dynamodb, stream_retention_s=RETENTION_PROBE_S) as own:
        own.apply_env()
        ddb, streams = dynamodb_client(), StreamsClientFactory()()
        workload.create_table(ddb, "TrimProbe")
        arn = ddb.describe_table(TableName="TrimProbe")["Table"]["LatestStreamArn"]
        ddb.put_item(TableName="TrimProbe", Item=_item(1))
        seq = _shard_records(streams, arn)[0]["dynamodb"]["SequenceNumber"]
        time.sleep(RETENTION_PROBE_S * 2)  # the probe's own server: its retention is the thing measured
        code = _code(lambda: streams.get_shard_iterator(
            StreamArn=arn, ShardId=_first_shard(streams, arn), ShardIteratorType="AFTER_SEQUENCE_NUMBER",
            SequenceNumber=seq))
    return {"trims_records_past_retention": code}


def _ddb2bt_run(table: str, records: int) -> int:
    """A real `ddb2bt run --until-idle 1` over the stream (Beam start-up included)."""
    from ddb2bt.pipeline.app.cli import main as ddb2bt
    from tests.conftest import write_mapping

    path = write_mapping(Path(tempfile.mkdtemp()), source__table=table, target__table=f"bench_{table.lower()}",
                         name=f"bench_{table.lower()}")
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    began = time.monotonic()
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", "--poll-interval", "0.2"]) == 0
    return round(records / (time.monotonic() - began))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=3000)
    args = parser.parse_args()
    import logging

    logging.disable(logging.INFO)
    results = {"items": args.items, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "emulators": [measure(name, args.items) for name in ("moto", "ministack")]}
    out = ROOT / "bench" / "results" / f"emulators-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(json.dumps(results, indent=2, default=str))
    print(f"written: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
