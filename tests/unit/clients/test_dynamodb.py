"""The one DynamoDB access module: ARN parsing, the Scan pager (resume, limits,
throttling retried, permanent errors not), shard listing and GetItem."""
from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from ddb2bt.pipeline.clients import dynamodb
from ddb2bt.pipeline.clients.dynamodb import (
    SourceTableMissing, StreamArn, StreamThrottled, TokenBucket, classify_aws_error, get_item, list_shards,
    parallel_scan, scan_items, scan_pages, table_of_stream,
)
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.transforms.errors import PermanentError, StreamGoneError

FAST = RetryPolicy(initial_s=0.001, max_backoff_s=0.002, deadline_s=5.0)
ARN = "arn:aws:dynamodb:eu-west-1:123456789012:table/Orders-2/stream/2024-05-01T10:00:00.123"


def client_error(code: str, status: int = 400) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "Op")


class FakeTable:
    """A Scan/GetItem double with boto3's call shapes: keys are {"pk": {"S": ...}}."""

    def __init__(self, n: int, fail_first: list | None = None) -> None:
        self.items = [{"pk": {"S": f"k{i:04d}"}, "v": {"N": str(i)}} for i in range(n)]
        self.fail_first = list(fail_first or [])
        self.calls: list = []

    def _maybe_fail(self):
        if self.fail_first:
            raise self.fail_first.pop(0)

    def scan(self, **kw):
        self.calls.append(kw)
        self._maybe_fail()
        mine = [it for i, it in enumerate(self.items)
                if "TotalSegments" not in kw or i % kw["TotalSegments"] == kw["Segment"]]
        start = kw.get("ExclusiveStartKey")
        if start:
            mine = [it for it in mine if it["pk"]["S"] > start["pk"]["S"]]
        limit = kw.get("Limit", 10_000)
        page = mine[:limit]
        out = {"Items": page, "ConsumedCapacity": {"CapacityUnits": 0.5 * len(page)}}
        if len(mine) > limit:
            out["LastEvaluatedKey"] = {"pk": page[-1]["pk"]}
        return out

    def get_item(self, TableName, Key, ConsistentRead):
        assert ConsistentRead is True  # redrive and repairs must see the latest write
        self._maybe_fail()
        found = [it for it in self.items if it["pk"] == Key["pk"]]
        return {"Item": found[0]} if found else {}


def test_stream_arn_parts_and_refusal():
    arn = StreamArn.parse(ARN)
    assert (arn.region, arn.account, arn.table, arn.label) == ("eu-west-1", "123456789012", "Orders-2",
                                                               "2024-05-01T10:00:00.123")
    for bad in ("", "arn:aws:dynamodb:eu-west-1:1:table/T", "arn:aws:s3:::bucket/stream/x", "table/T/stream/x"):
        with pytest.raises(ValueError, match="not a DynamoDB stream ARN"):
            StreamArn.parse(bad)
    assert table_of_stream(ARN) == "Orders-2"
    assert table_of_stream("not-an-arn") == "not-an-arn"


def test_scan_pages_resume_and_limit():
    t = FakeTable(25)
    pages = list(scan_pages(t, "T", page_limit=10, retry=FAST))
    assert [len(p.items) for p in pages] == [10, 10, 5]
    assert pages[0].start_key is None and pages[1].start_key == pages[0].last_key and pages[-1].last_key is None
    resumed = list(scan_pages(t, "T", page_limit=10, start_key=pages[0].last_key, retry=FAST))
    assert [it["pk"]["S"] for p in resumed for it in p.items] == [f"k{i:04d}" for i in range(10, 25)]
    assert [it["pk"]["S"] for it in scan_items(t, "T", limit=7)] == [f"k{i:04d}" for i in range(7)]


def test_scan_retries_throttling_and_5xx_but_not_permanent_errors():
    t = FakeTable(3, fail_first=[client_error("ProvisionedThroughputExceededException"),
                                 client_error("Whatever", status=503)])
    assert len(list(scan_items(t, "T", retry=FAST))) == 3
    assert len(t.calls) == 3
    t = FakeTable(3, fail_first=[client_error("ValidationException")])
    with pytest.raises(PermanentError, match="ValidationException"):
        list(scan_items(t, "T", retry=FAST))
    t = FakeTable(3, fail_first=[client_error("ResourceNotFoundException")])
    with pytest.raises(SourceTableMissing, match="DynamoDB table 'T' does not exist"):
        list(scan_items(t, "T", retry=FAST))


def test_scan_charges_the_read_budget():
    charged = []

    class Bucket(TokenBucket):
        def consume(self, units: float) -> None:
            charged.append(units)

    list(scan_pages(FakeTable(12), "T", page_limit=5, bucket=Bucket(None), retry=FAST))
    assert charged == [2.5, 2.5, 1.0]


def test_each_attempt_is_counted_on_the_counter_handed_in(monkeypatch):
    # The clients floor imports no metrics: the counter is handed in (the
    # connections hand the process's in, observe.metrics.count_aws_call).
    monkeypatch.setattr(dynamodb, "_COUNTER", list(dynamodb._COUNTER))  # restored after the test
    counted: list = []
    dynamodb.count_calls_with(lambda api, table: counted.append((api, table)))
    table = FakeTable(3, fail_first=[client_error("ProvisionedThroughputExceededException")])
    assert len(list(scan_items(table, "T", retry=FAST, metrics_table="orders"))) == 3
    assert counted == [("Scan", "orders"), ("Scan", "orders")]  # the throttled attempt and its retry


def test_the_connections_hand_the_process_counter_in_where_clients_are_made(monkeypatch):
    from ddb2bt.pipeline.connect import connections
    from ddb2bt.pipeline.observe.metrics import count_aws_call

    monkeypatch.setattr(dynamodb, "_COUNTER", [lambda api, table: None])  # restored after the test
    connections.dynamodb_client("eu-west-1")
    assert dynamodb._COUNTER == [count_aws_call]


def test_parallel_scan_reads_every_segment_once():
    seen = []
    items = parallel_scan(FakeTable(40), "T", 4, consistent_read=True, on_page=seen.append,
                          keep=lambda it: int(it["v"]["N"]) % 2 == 0, retry=FAST)
    assert sorted(int(it["v"]["N"]) for it in items) == list(range(0, 40, 2))
    assert sum(seen) == 40


def test_get_item_current_state_or_none():
    t = FakeTable(3, fail_first=[client_error("ThrottlingException")])
    assert get_item(t, "T", {"pk": {"S": "k0001"}}, retry=FAST)["v"] == {"N": "1"}
    assert get_item(t, "T", {"pk": {"S": "gone"}}, retry=FAST) is None


def test_list_shards_paginates_with_retries():
    class Streams:
        calls = 0

        def describe_stream(self, StreamArn, Limit, ExclusiveStartShardId=None):
            Streams.calls += 1
            if Streams.calls == 1:
                raise client_error("LimitExceededException")
            assert Limit == dynamodb.DESCRIBE_LIMIT
            if ExclusiveStartShardId is None:
                return {"StreamDescription": {"Shards": [{"ShardId": "a"}], "LastEvaluatedShardId": "a"}}
            return {"StreamDescription": {"Shards": [
                {"ShardId": "b", "ParentShardId": "a",
                 "SequenceNumberRange": {"StartingSequenceNumber": "1", "EndingSequenceNumber": "9"}}]}}

    listing = list_shards(Streams(), ARN, retry=FAST)
    assert listing.shards == {"a": None, "b": "a"} and listing.closed_ids == frozenset({"b"})


def test_classification_once_at_the_boundary():
    assert isinstance(classify_aws_error(client_error("LimitExceededException"), "GetRecords"), StreamThrottled)
    assert isinstance(classify_aws_error(client_error("ResourceNotFoundException"), "DescribeStream"),
                      StreamGoneError)
    assert isinstance(classify_aws_error(client_error("ResourceNotFoundException"), "Scan"), SourceTableMissing)


# --- the Scan page decoder (botocore's before-parse hook) ---------------------------------


def _botocore_scan():
    import botocore.session
    from botocore.parsers import create_parser

    shape = botocore.session.get_session().get_service_model("dynamodb").operation_model("Scan").output_shape
    return create_parser("json"), shape


def _parse_both(body: dict, status: int = 200) -> tuple:
    """(what botocore alone returns, what it returns after decode_scan_items)."""
    import json

    parser, shape = _botocore_scan()
    raw = json.dumps(body).encode()
    plain = parser.parse({"status_code": status, "headers": {}, "body": raw}, shape)
    response = {"status_code": status, "headers": {}, "body": raw}
    custom: dict = {}
    dynamodb.decode_scan_items(response_dict=response, customized_response_dict=custom)
    fast = parser.parse(response, shape)
    fast.update(custom)
    return plain, fast, custom


WIRE_ITEM = {
    "pk": {"S": "k1"}, "n": {"N": "-1.5E+3"}, "b": {"B": "AAEC/w=="}, "t": {"BOOL": True}, "f": {"BOOL": False},
    "z": {"NULL": True}, "ss": {"SS": ["a", "b"]}, "ns": {"NS": ["1", "2.5"]}, "bs": {"BS": ["AA==", "/w=="]},
    "m": {"M": {"x": {"B": "AQ=="}, "l": {"L": [{"S": "é"}, {"M": {}}, {"L": []}, {"BS": ["AQ=="]}]}}},
    "e": {"S": ""},
}


def test_scan_decoder_gives_exactly_what_botocore_gives():
    body = {"Items": [WIRE_ITEM, {"pk": {"S": "k2"}}], "Count": 2, "ScannedCount": 2,
            "LastEvaluatedKey": {"pk": {"S": "k2"}, "bk": {"B": "AQI="}},
            "ConsumedCapacity": {"TableName": "T", "CapacityUnits": 2}}
    plain, fast, custom = _parse_both(body)
    assert fast == plain
    assert plain["Items"][0]["b"] == {"B": b"\x00\x01\x02\xff"}  # B decoded to bytes, as boto3 gives it
    assert set(custom) == {"Items", "LastEvaluatedKey"}  # really decoded here, not by botocore
    assert fast["ConsumedCapacity"] == {"TableName": "T", "CapacityUnits": 2}  # the rest is still botocore's
    plain, fast, custom = _parse_both({"Items": [], "Count": 0, "ScannedCount": 0})
    assert fast == plain and custom == {"Items": []}


@pytest.mark.parametrize("body", [
    {"Items": [{"pk": {"S": "k"}, "x": {"UNKNOWN": "v"}}]},  # a type this does not know
    {"Items": [{"pk": {"S": "k", "N": "1"}}]},  # two tags in one value
    {"Items": [{"pk": "k"}]},  # not an AttributeValue
    {"Items": {"pk": {"S": "k"}}},  # not a list
])
def test_scan_decoder_leaves_what_it_does_not_know_to_botocore(body):
    import json

    raw = json.dumps(body).encode()
    response = {"status_code": 200, "headers": {}, "body": raw}
    custom: dict = {}
    dynamodb.decode_scan_items(response_dict=response, customized_response_dict=custom)
    assert custom == {} and response["body"] == raw


def test_scan_decoder_leaves_errors_alone():
    body = {"__type": "com.amazonaws.dynamodb.v20120810#ResourceNotFoundException", "message": "no table",
            "Items": []}
    response = {"status_code": 400, "headers": {}, "body": __import__("json").dumps(body).encode()}
    before = dict(response)
    custom: dict = {}
    dynamodb.decode_scan_items(response_dict=response, customized_response_dict=custom)
    assert custom == {} and response == before


def test_scan_pages_decode_a_real_clients_pages_like_botocore(stack, unique):
    """Through the AWS emulator's server: every type, several pages, the same items and keys
    with and without the decoder."""
    import boto3

    from ddb2bt.pipeline.connect.connections import dynamodb_client
    from ddb2bt.pipeline.local import workload

    item = {k: v for k, v in _parse_both({"Items": [WIRE_ITEM]})[0]["Items"][0].items() if k != "pk"}
    client = dynamodb_client()
    table = f"Fast{unique}"
    workload.create_table(client, table)
    for i in range(30):
        client.put_item(TableName=table, Item={**item, "pk": {"S": f"k{i:03d}"}, "sk": {"S": "s"}})
    plain_client = boto3.client("dynamodb")  # no decoder registered: botocore parses everything
    plain = []
    start = None
    while True:
        page = plain_client.scan(TableName=table, Limit=7, **({"ExclusiveStartKey": start} if start else {}))
        plain.append((page["Items"], page.get("LastEvaluatedKey")))
        start = page.get("LastEvaluatedKey")
        if not start:
            break
    fast = [(p.items, p.last_key) for p in scan_pages(client, table, page_limit=7, retry=FAST)]
    assert fast == plain and sum(len(items) for items, _ in fast) == 30
    assert fast[0][0][0]["b"] == {"B": b"\x00\x01\x02\xff"}


# --- the GetRecords page decoder (the same hook, for stream pages) ------------------------


def _parse_records_both(body: dict, status: int = 200) -> tuple:
    """(what botocore alone returns for a GetRecords body, what it returns after
    decode_stream_records, what the hook decoded itself)."""
    import json

    import botocore.session
    from botocore.parsers import create_parser

    shape = botocore.session.get_session().get_service_model(
        "dynamodbstreams").operation_model("GetRecords").output_shape
    parser = create_parser("json")
    raw = json.dumps(body).encode()
    plain = parser.parse({"status_code": status, "headers": {}, "body": raw}, shape)
    response = {"status_code": status, "headers": {}, "body": raw}
    custom: dict = {}
    dynamodb.decode_stream_records(response_dict=response, customized_response_dict=custom)
    fast = parser.parse(response, shape)
    fast.update(custom)
    return plain, fast, custom


def _wire_record(i: int, event: str = "MODIFY", created=1764045600) -> dict:
    record = {"eventID": f"e{i}", "eventName": event, "eventVersion": "1.1", "eventSource": "aws:dynamodb",
              "awsRegion": "us-east-1",
              "dynamodb": {"ApproximateCreationDateTime": created, "Keys": {"pk": {"S": f"k{i}"}},
                           "SequenceNumber": f"{100 + i:021d}", "SizeBytes": 57 + i,
                           "StreamViewType": "NEW_AND_OLD_IMAGES"}}
    if event != "INSERT":
        record["dynamodb"]["OldImage"] = {**WIRE_ITEM, "pk": {"S": f"k{i}"}}
    if event != "REMOVE":
        record["dynamodb"]["NewImage"] = {**WIRE_ITEM, "pk": {"S": f"k{i}"}, "v": {"N": str(i)}}
    else:
        record["userIdentity"] = {"PrincipalId": "dynamodb.amazonaws.com", "Type": "Service"}
    return record


def test_records_decoder_gives_exactly_what_botocore_gives():
    body = {"Records": [_wire_record(0, "INSERT"), _wire_record(1), _wire_record(2, "REMOVE"),
                        _wire_record(3, created=1764045600.123456)],
            "NextShardIterator": "it-2"}
    plain, fast, custom = _parse_records_both(body)
    assert fast == plain
    assert set(custom) == {"Records"}  # the records decoded here, not by botocore
    assert fast["NextShardIterator"] == "it-2"  # the rest is still botocore's
    created = fast["Records"][0]["dynamodb"]["ApproximateCreationDateTime"]
    assert created == plain["Records"][0]["dynamodb"]["ApproximateCreationDateTime"] and created.tzinfo
    assert fast["Records"][1]["dynamodb"]["OldImage"]["b"] == {"B": b"\x00\x01\x02\xff"}
    # An empty page (and a closed shard's last one, without an iterator) too.
    for body in ({"Records": [], "NextShardIterator": "it-3"}, {"Records": []}):
        plain, fast, custom = _parse_records_both(body)
        assert fast == plain and custom == {"Records": []}


@pytest.mark.parametrize("change", [
    lambda r: r.update(newField="x"),  # a field the model lacks: botocore would drop it
    lambda r: r["dynamodb"].update(Extra=1),
    lambda r: r["dynamodb"].update(SizeBytes="57"),  # not the type the model says
    lambda r: r["dynamodb"].update(ApproximateCreationDateTime="2026-11-25T04:00:00Z"),
    lambda r: r.update(eventName=None),  # null: botocore leaves the member out
    lambda r: r["dynamodb"]["NewImage"].update(x={"UNKNOWN": "v"}),
    lambda r: r.update(userIdentity={"PrincipalId": "p", "Type": "Service", "Other": "o"}),
])
def test_records_decoder_leaves_what_it_does_not_know_to_botocore(change):
    import json

    record = _wire_record(1)
    change(record)
    raw = json.dumps({"Records": [_wire_record(0), record], "NextShardIterator": "it"}).encode()
    response = {"status_code": 200, "headers": {}, "body": raw}
    custom: dict = {}
    dynamodb.decode_stream_records(response_dict=response, customized_response_dict=custom)
    assert custom == {} and response["body"] == raw


def test_records_decoder_leaves_errors_alone():
    body = {"__type": "com.amazonaws.dynamodb.v20120810#TrimmedDataAccessException", "message": "trimmed",
            "Records": []}
    response = {"status_code": 400, "headers": {}, "body": __import__("json").dumps(body).encode()}
    before = dict(response)
    custom: dict = {}
    dynamodb.decode_stream_records(response_dict=response, customized_response_dict=custom)
    assert custom == {} and response == before


def test_stream_pages_decode_a_real_clients_pages_like_botocore(stack, unique):
    """Through the AWS emulator's server: a reader's client decodes GetRecords pages with the
    hook, and every record equals what a plain client gets for the same iterator."""
    import boto3

    from ddb2bt.pipeline.connect.connections import StreamsClientFactory, dynamodb_client
    from ddb2bt.pipeline.local import workload

    item = {k: v for k, v in _parse_both({"Items": [WIRE_ITEM]})[0]["Items"][0].items() if k != "pk"}
    client = dynamodb_client()
    table = f"FastRec{unique}"
    workload.create_table(client, table)
    for i in range(12):
        client.put_item(TableName=table, Item={**item, "pk": {"S": f"k{i:03d}"}, "sk": {"S": "s"}})
    client.delete_item(TableName=table, Key={"pk": {"S": "k000"}, "sk": {"S": "s"}})
    arn = client.describe_table(TableName=table)["Table"]["LatestStreamArn"]
    streams = StreamsClientFactory()()
    dynamodb.fast_records_decoding(streams)
    plain_client = boto3.client("dynamodbstreams")  # no decoder: botocore parses everything
    shard = streams.describe_stream(StreamArn=arn)["StreamDescription"]["Shards"][0]["ShardId"]

    def page(c):
        it = c.get_shard_iterator(StreamArn=arn, ShardId=shard, ShardIteratorType="TRIM_HORIZON")
        return c.get_records(ShardIterator=it["ShardIterator"])["Records"]

    fast, plain = page(streams), page(plain_client)
    assert len(fast) == 13 and fast == plain
    assert fast[3]["dynamodb"]["NewImage"]["b"] == {"B": b"\x00\x01\x02\xff"}


class _Item(dict):
    """An item the test can hold weakly."""


def test_scan_pages_let_go_of_a_page_before_fetching_the_next():
    """The pager keeps no page's items while it fetches the next one: a consumer
    done with a page holds at most one in memory (docs/benchmarks.md, Verify)."""
    import gc
    import weakref

    # The metrics module is imported by the first AWS call; importing it keeps
    # the frames of whoever called first (through Beam's import), with their
    # locals: imported here, the first Scan is not that caller.
    from ddb2bt.pipeline.observe import metrics  # noqa: F401

    handed_out: list = []
    alive_at_fetch: list = []

    class Pages:
        def scan(self, ExclusiveStartKey=None, **kw):
            gc.collect()
            if ExclusiveStartKey is not None:
                alive_at_fetch.append(sum(ref() is not None for ref in handed_out))
            start = 0 if ExclusiveStartKey is None else ExclusiveStartKey["n"]
            items = [_Item(n=start + i) for i in range(5)]
            handed_out.extend(weakref.ref(it) for it in items)
            return {"Items": items, **({"LastEvaluatedKey": {"n": start + 5}} if start < 15 else {})}

    seen = 0
    for page in scan_pages(Pages(), "T", page_limit=None, retry=FAST):
        seen += len(page.items)
        del page
    assert seen == 20 and alive_at_fetch == [0, 0, 0]
