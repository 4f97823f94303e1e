"""`dlq redrive` reads a letter's record back from its stream as the tail reads:
paced, each call retried while throttled; only the stream's own word that the
record is gone makes it "no longer in its stream"; a Kinesis job's letter is
read back from its Kinesis stream."""
from __future__ import annotations

import json

import pytest

from ddb2bt.pipeline.recover.redrive import LetterStream, REDRIVE_GET_RECORDS_PER_SHARD_PER_S, redrive
from ddb2bt.pipeline.source.kinesis import KinesisStreamsClient, ShardPacer, kinesis_stream_arn
from ddb2bt.pipeline.testing.fakes import FakeStreamsClient, client_error
from ddb2bt.pipeline.testing.kinesis_cdc import FakeKinesis
from ddb2bt.transforms.errors import PermanentError
from ddb2bt.transforms.model import SetCell, StreamPosition
from tests.unit.cutover.cutover_common import CATALOG, T, item  # noqa: E402
from tests.unit.recover.test_redrive_and_verify import Table, checked, setup

NOW_MS = 1_700_000_000_000


class Failing:
    """A Streams client whose first calls of an operation fail with ``code``."""

    def __init__(self, streams, operation: str, code: str, times: int = 1) -> None:
        self._streams, self._operation, self._code, self._left = streams, operation, code, times

    def __getattr__(self, name):
        fn = getattr(self._streams, name)
        if name != self._operation:
            return fn

        def call(**kw):
            if self._left > 0:
                self._left -= 1
                raise client_error(self._code, operation=name)
            return fn(**kw)
        return call


def _letter_in_a_stream():
    streams = FakeStreamsClient(table="ProductCatalog")
    streams.add_shard("s0")
    old, new = item(pk="hats", sk="a", Price=1, Thumbnail="t"), item(pk="hats", sk="a", Price=1)
    streams.put("s0", "MODIFY", item(pk="hats", sk="a"), new, old)
    seq = streams.shards["s0"].records[0]["dynamodb"]["SequenceNumber"]
    letter = {"eventName": "MODIFY", "eventID": "e", "changeMs": T, "ttlDelete": False, "valuesOmitted": True,
              "keys": {"pk": "<redacted>", "sk": "<redacted>"},
              "position": {"streamArn": streams.stream_arn, "shardId": "s0", "sequenceNumber": seq}}
    return streams, new, {"id": "job#dlq#1", "reason": "encoding", "record": json.dumps(letter)}


def _redrive(streams, new, raw):
    bt, store, batcher, clock, sleep = setup([])

    class Store:
        deleted = None

        def list_dead_letters(self, reason=None, since_ms=None):
            return [raw]

        def delete_dead_letters(self, ids):
            self.deleted = ids

        def load_meta(self, name):
            return store.load_meta(name)

    letters = Store()
    bt.mutate_rows("product_catalog", [(b"hats#a", [SetCell("SKU", b"Thumbnail", b"t", T - 5000)])])
    result = redrive(CATALOG, letters, batcher, Table([new]), now_ms=lambda: clock[0], sleep=sleep, streams=streams,
                     **checked(bt))
    return result, letters


@pytest.mark.parametrize("operation", ["GetShardIterator", "GetRecords"])
def test_a_throttled_read_is_retried_not_reported_gone(operation):
    streams, new, raw = _letter_in_a_stream()
    throttled = Failing(streams, operation.replace("GetShardIterator", "get_shard_iterator").replace(
        "GetRecords", "get_records"), "ProvisionedThroughputExceededException", times=2)
    result, letters = _redrive(throttled, new, raw)
    assert (result.resolved, result.redacted) == (1, 0) and letters.deleted == [raw["id"]]


def test_a_failure_that_does_not_say_gone_stops_the_redrive_and_keeps_the_letter():
    streams, new, raw = _letter_in_a_stream()
    with pytest.raises(PermanentError, match="AccessDeniedException"):
        _redrive(Failing(streams, "get_records", "AccessDeniedException"), new, raw)


def test_a_trimmed_record_is_gone():
    streams, new, raw = _letter_in_a_stream()
    streams.shards["s0"].trimmed_before = 1
    result, letters = _redrive(streams, new, raw)
    assert (result.redacted, result.resolved, letters.deleted) == (1, 0, None)


def test_reads_are_paced_per_shard():
    streams, _, raw = _letter_in_a_stream()
    pos = StreamPosition(**{"stream_arn": streams.stream_arn, "shard_id": "s0",
                            "sequence_number": json.loads(raw["record"])["position"]["sequenceNumber"]})
    now, slept = [0.0], []

    def sleep(s):
        slept.append(s)
        now[0] += s

    reads = LetterStream(streams, sleep=sleep, clock=lambda: now[0])
    assert reads.record(pos) is not None and reads.record(pos) is not None
    assert slept == [pytest.approx(1 / REDRIVE_GET_RECORDS_PER_SHARD_PER_S)]


def test_a_kinesis_letter_is_read_back_from_its_kinesis_stream():
    fake = FakeKinesis()
    doc = {"eventName": "MODIFY", "tableName": "Catalog", "eventID": "e1",
           "dynamodb": {"ApproximateCreationDateTime": NOW_MS, "Keys": {"pk": {"S": "a"}},
                        "NewImage": {"pk": {"S": "a"}, "n": {"N": "2"}},
                        "OldImage": {"pk": {"S": "a"}, "n": {"N": "1"}}, "SizeBytes": 10}}
    fake.add("shardId-1", [dict(doc, eventID="e0"), doc], first_seq=41)
    client = KinesisStreamsClient(fake, "cdc", "Catalog", "auto", pacer=ShardPacer(clock=lambda: 0.0,
                                                                                   sleep=lambda s: None),
                                  now_ms=lambda: NOW_MS)
    reads = LetterStream(client, sleep=lambda s: None)
    arn = kinesis_stream_arn("Catalog", "cdc")  # the job's per-table stream name, not a DynamoDB stream
    record = reads.record(StreamPosition(arn, "shardId-1", "42"))
    assert record is not None and record.new_image["n"] == {"N": "2"} and record.old_image["n"] == {"N": "1"}
    fake.trimmed["shardId-1"] = 2  # expired: Kinesis starts at the oldest record kept, not this one
    assert reads.record(StreamPosition(arn, "shardId-1", "42")) is None


def test_a_kinesis_job_reads_its_letters_from_its_kinesis_stream_not_dynamodb_streams(monkeypatch):
    from dataclasses import replace

    from ddb2bt.pipeline.recover.redrive import letter_streams
    from ddb2bt.transforms.config import KinesisSourceConfig

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    mapping = replace(CATALOG, source=replace(CATALOG.source, kinesis=KinesisSourceConfig("cdc", "millisecond")))
    client = letter_streams(mapping)
    assert isinstance(client, KinesisStreamsClient)
    assert type(letter_streams(CATALOG)).__name__ != "KinesisStreamsClient"
