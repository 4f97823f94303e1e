"""Kinesis GetRecords responses in the published wire shape (JSON protocol: each
record's ``Data`` is the base64 of the DynamoDB change document AWS publishes),
parsed by botocore's own parser for the kinesis service, decoded by the Kinesis
source, and mapped for the ordering guard: for each record, whether the reading
table keeps it, its change time in microseconds, whether it is a TTL deletion,
and the exact mutations it makes on a row without a clock (kinesis/*.json).

Fixture shape: ``table`` (the table the job reads), ``precision`` (the mapping's
``source.kinesis.precision``), ``mapping``, ``records`` (each ``data``: the JSON
document, ``sequenceNumber``), ``expect`` (one per record)."""
from __future__ import annotations

import base64
import functools
import json

import botocore.session
import pytest
from botocore.parsers import create_parser

from ddb2bt.pipeline.source.kinesis import decode_kinesis_record, kinesis_stream_arn
from ddb2bt.pipeline.source.records import from_stream_record
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.ordering import guarded_rows, row_mutations
from tests.conformance.harness import fixtures, mapping, render_mutation, show

FILES = fixtures("kinesis")
SHARD = "shardId-000000000001"


@functools.lru_cache(maxsize=1)
def _parser():
    model = botocore.session.get_session().get_service_model("kinesis")
    return create_parser(model.metadata["protocol"]), model.operation_model("GetRecords").output_shape


def parse_kinesis_get_records(records: list) -> dict:
    """The GetRecords response body as it travels (Data base64), parsed by botocore:
    Data arrives as bytes, exactly as the reader receives it from boto3."""
    body = {"Records": [{"SequenceNumber": r["sequenceNumber"], "ApproximateArrivalTimestamp": 1700000000.5,
                         "PartitionKey": r.get("partitionKey", "pk"),
                         "Data": base64.b64encode(json.dumps(r["data"]).encode("utf-8")).decode("ascii")}
                        for r in records],
            "NextShardIterator": "AAAAAAAAAAFexample", "MillisBehindLatest": 0}
    parser, shape = _parser()
    return parser.parse({"body": json.dumps(body).encode("utf-8"), "headers": {}, "status_code": 200}, shape)


def kinesis_outcome(config, fixture, raw) -> dict:
    decoded = decode_kinesis_record(raw, fixture["table"], fixture.get("precision", "auto"))
    if decoded is None:
        return {"kept": False}
    record = from_stream_record(decoded, kinesis_stream_arn(fixture["table"], "cdc"), SHARD)
    out: dict = {"kept": True, "eventName": record.event_name, "change_us": record.change_us,
                 "change_ms": record.change_ms, "ttl_delete": record.is_ttl_delete}
    try:
        rows = guarded_rows(config, record)
    except MappingError as exc:
        out["dead_letter"] = {"reason": exc.reason, "message": exc.message}
        return out
    out["rows"] = [{"table": r.table, "row": show(r.row_key),
                    "mutations": [render_mutation(m) for m in row_mutations(r, None)]} for r in rows]
    return out


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_kinesis_fixture(path):
    fixture = json.loads(path.read_text())
    parsed = parse_kinesis_get_records(fixture["records"])
    assert len(parsed["Records"]) == len(fixture["expect"]), "one expectation per record"
    assert all(isinstance(r["Data"], bytes) for r in parsed["Records"])
    config = mapping(fixture["mapping"])
    assert [kinesis_outcome(config, fixture, raw) for raw in parsed["Records"]] == fixture["expect"]


def test_the_fixtures_cover_what_the_issue_names():
    names = {p.stem for p in FILES}
    docs = [r["data"] for p in FILES for r in json.loads(p.read_text())["records"]]
    created = [d["dynamodb"].get("ApproximateCreationDateTime", 0) for d in docs]
    assert any(c >= 10 ** 14 for c in created) and any(0 < c < 10 ** 14 for c in created), "both precisions"
    assert any((d.get("userIdentity") or {}).get("principalId") == "dynamodb.amazonaws.com" for d in docs), "TTL"
    assert len({d.get("tableName") for d in docs}) >= 2, "several tables in one stream"
    assert len(names) >= 5
