"""Kinesis Data Streams for DynamoDB, played locally: moto cannot link a table to
a Kinesis stream, so this reads the table's changes from its DynamoDB stream
(moto has that) and writes them into a Kinesis stream as DynamoDB would — one
record per change, the published JSON document (``eventName``, ``dynamodb.Keys``,
``NewImage``, ``OldImage``, ``ApproximateCreationDateTime`` in milliseconds or
microseconds, ``tableName``, ``userIdentity``) — optionally delivered the way
Kinesis may deliver them: shuffled within a window, some twice, with a shard
split part-way. For `ddb2bt demo --kinesis`, the tests and the bench; never used by a job.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Optional

from ddb2bt.transforms.attrs import item_to_dynamodb_json
from ddb2bt.transforms.model import datetime_to_ms

__all__ = ["Disorder", "change_document", "publish_changes", "read_table_changes", "split_first_open_shard"]


@dataclass(frozen=True)
class Disorder:
    """How to misdeliver: ``window`` records shuffled together, ``duplicate`` the
    share of records sent twice (the copy anywhere later in the window), a shard
    split after ``split_after`` records (None: no split)."""

    window: int = 1
    duplicate: float = 0.0
    split_after: Optional[int] = None
    seed: int = 0


def read_table_changes(streams, stream_arn: str, after: Optional[dict] = None) -> list:
    """Every record of a DynamoDB stream (boto3 form), shard by shard, parents
    first; ``after`` {shard: sequence number} continues a previous read (updated)."""
    after = after if after is not None else {}
    shards = streams.describe_stream(StreamArn=stream_arn)["StreamDescription"]["Shards"]
    out = []
    for shard in shards:
        sid = shard["ShardId"]
        kwargs = ({"ShardIteratorType": "AFTER_SEQUENCE_NUMBER", "SequenceNumber": after[sid]} if sid in after
                  else {"ShardIteratorType": "TRIM_HORIZON"})
        it = streams.get_shard_iterator(StreamArn=stream_arn, ShardId=sid, **kwargs)["ShardIterator"]
        while it:
            page = streams.get_records(ShardIterator=it, Limit=1000)
            records = page.get("Records", [])
            out.extend(records)
            if records:
                after[sid] = records[-1]["dynamodb"]["SequenceNumber"]
            if not records:
                break
            it = page.get("NextShardIterator")
    return out


def change_document(record: dict, table: str, precision: str, last_us: dict) -> dict:
    """A DynamoDB Streams record → the document DynamoDB writes to Kinesis.

    A stream record's time is whole seconds (on AWS, and on ministack; moto adds a
    millisecond fraction), a Kinesis record's is the change's own millisecond or
    microsecond. So an item's changes within one stream time get successive units
    from it (strictly increasing per item, as the real times of one item's
    changes are): MICROSECOND, the millisecond plus the item's change count in it;
    MILLISECOND, likewise in milliseconds. Without that, every change of an item
    in one second would share a timestamp, which real deliveries do not
    (docs/design.md §10.3 says what equal timestamps can and cannot order)."""
    ddb = record["dynamodb"]
    ms = datetime_to_ms(ddb["ApproximateCreationDateTime"])
    key = json.dumps(item_to_dynamodb_json(ddb["Keys"]), sort_keys=True)
    unit = ms * 1000 if precision == "microsecond" else ms
    created = max(unit, last_us.get(key, -1) + 1)
    last_us[key] = created
    body: dict = {"ApproximateCreationDateTime": created, "Keys": item_to_dynamodb_json(ddb["Keys"]),
                  "SizeBytes": ddb.get("SizeBytes", 0)}
    for name in ("NewImage", "OldImage"):
        if ddb.get(name) is not None:
            body[name] = item_to_dynamodb_json(ddb[name])
    identity = record.get("userIdentity")
    return {"awsRegion": record.get("awsRegion", "us-east-1"), "eventID": record.get("eventID", ""),
            "eventName": record["eventName"], "recordFormat": "application/json", "tableName": table,
            "userIdentity": ({"type": identity.get("Type"), "principalId": identity.get("PrincipalId")}
                             if identity else None),
            "dynamodb": body, "eventSource": "aws:dynamodb"}


def publish_changes(kinesis, stream: str, documents: list, disorder: Disorder = Disorder()) -> int:
    """Put ``documents`` into the Kinesis stream, misdelivered per ``disorder``.
    The partition key is the item's key (as DynamoDB's is per item). Returns how
    many records were put."""
    rng = random.Random(disorder.seed)
    order = list(documents)
    window = max(1, disorder.window)
    for start in range(0, len(order), window):
        part = order[start:start + window]
        rng.shuffle(part)
        order[start:start + window] = part
    out = []
    for i, doc in enumerate(order):
        out.append(doc)
        if rng.random() < disorder.duplicate:
            out.insert(min(len(out), i + 1 + rng.randrange(window)), doc)
    put = 0
    for i, doc in enumerate(out):
        if disorder.split_after is not None and i == disorder.split_after:
            split_first_open_shard(kinesis, stream)
        kinesis.put_record(StreamName=stream, Data=json.dumps(doc).encode("utf-8"),
                           PartitionKey=json.dumps(doc["dynamodb"]["Keys"], sort_keys=True))
        put += 1
    return put


def split_first_open_shard(kinesis, stream: str) -> None:
    shards = kinesis.list_shards(StreamName=stream)["Shards"]
    shard = next(s for s in shards if "EndingSequenceNumber" not in s.get("SequenceNumberRange", {}))
    low, high = int(shard["HashKeyRange"]["StartingHashKey"]), int(shard["HashKeyRange"]["EndingHashKey"])
    kinesis.split_shard(StreamName=stream, ShardToSplit=shard["ShardId"], NewStartingHashKey=str((low + high) // 2))
