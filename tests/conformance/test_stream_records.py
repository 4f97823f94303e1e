"""GetRecords responses in the published wire shape, parsed by botocore itself,
read by the stream reader's record conversion and mapped: exact cells or the exact
dead letter for each record (stream/*.json)."""
from __future__ import annotations

import datetime as dt
import json

import pytest

from ddb2bt.pipeline.source.records import from_stream_record
from tests.conformance.harness import fixtures, mapping, outcome, parse_get_records

STREAM_ARN = "arn:aws:dynamodb:us-east-1:123456789012:table/Catalog/stream/2023-11-14T22:13:20.000"
FILES = fixtures("stream")


def _binary_values(value):
    """Every payload of B and BS anywhere in an AttributeValue."""
    (tag, inner), = value.items()
    if tag == "B":
        yield inner
    elif tag == "BS":
        yield from inner
    elif tag == "M":
        for v in inner.values():
            yield from _binary_values(v)
    elif tag == "L":
        for v in inner:
            yield from _binary_values(v)


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_stream_fixture(path):
    fixture = json.loads(path.read_text())
    parsed = parse_get_records(fixture["response"])
    records = parsed["Records"]
    assert len(records) == len(fixture["expect"]), "one expectation per record"
    config = mapping(fixture["mapping"])
    got = []
    for raw in records:
        ddb = raw["dynamodb"]
        # botocore's own types, as boto3 hands them to the reader
        if "ApproximateCreationDateTime" in ddb:
            assert isinstance(ddb["ApproximateCreationDateTime"], dt.datetime)
        for image in ("Keys", "NewImage", "OldImage"):
            for value in (ddb.get(image) or {}).values():
                assert all(isinstance(b, bytes) for b in _binary_values(value))
        got.append(outcome(config, from_stream_record(raw, STREAM_ARN, "shardId-00000001700000000000-abcdef01")))
    assert got == fixture["expect"]


def test_there_are_enough_fixtures():
    from tests.conformance.harness import HERE

    total = len(FILES) + len([p for p in (HERE / "exports").iterdir() if p.is_dir()]) + len(fixtures("explain"))
    assert total >= 40, total
