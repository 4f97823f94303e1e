"""The rollback's DynamoDB writer against moto's DynamoDB: every write conditional
on the version it replaces; a replayed or reordered write never overwrites a newer
one, a delete's tombstone keeps a late put out, transactions batch 25 items."""
import os

import boto3
import pytest
from moto import mock_aws

from ddb2bt.pipeline.sink.dynamodb_writer import DynamoDBWriter, ensure_versions_table, versions_table_name
from ddb2bt.transforms.inverse_rows import DeleteItem, PutItem

TABLE = "Catalog"


@pytest.fixture
def ddb(monkeypatch):
    for name, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    for name in [n for n in os.environ if n.startswith("AWS_ENDPOINT_URL")]:
        monkeypatch.delenv(name)  # moto in this process, not a local stack another test pointed us at
    with mock_aws():
        client = boto3.client("dynamodb", region_name="us-east-1")
        client.create_table(TableName=TABLE, BillingMode="PAY_PER_REQUEST",
                            KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
                            AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}])
        assert ensure_versions_table(client, versions_table_name(TABLE)) is True
        assert ensure_versions_table(client, versions_table_name(TABLE)) is False
        yield client


def put(pk, version, **attrs):
    key = {"pk": {"S": pk}}
    return PutItem(TABLE, dict(key, **{k: {"S": v} for k, v in attrs.items()}), key, version)


def get(client, pk):
    return client.get_item(TableName=TABLE, Key={"pk": {"S": pk}}, ConsistentRead=True).get("Item")


def test_a_put_writes_the_item_without_any_attribute_of_ddb2bt(ddb):
    out = DynamoDBWriter(ddb, versions_table_name(TABLE)).write([put("a", 10, colour="red")])
    assert (out.written, out.stale) == (1, 0)
    assert get(ddb, "a") == {"pk": {"S": "a"}, "colour": {"S": "red"}}


def test_an_older_or_replayed_version_never_overwrites_a_newer_one(ddb):
    writer = DynamoDBWriter(ddb, versions_table_name(TABLE))
    writer.write([put("a", 20, colour="new")])
    out = writer.write([put("a", 10, colour="old"), put("a", 20, colour="replayed")])
    assert (out.written, out.stale) == (0, 2)
    assert get(ddb, "a")["colour"] == {"S": "new"}
    assert writer.write([put("a", 21, colour="newer")]).written == 1
    assert get(ddb, "a")["colour"] == {"S": "newer"}


def test_a_delete_leaves_a_tombstone_so_a_late_older_put_cannot_bring_the_item_back(ddb):
    writer = DynamoDBWriter(ddb, versions_table_name(TABLE))
    writer.write([put("a", 10, colour="red")])
    assert writer.write([DeleteItem(TABLE, {"pk": {"S": "a"}}, 30)]).written == 1
    assert get(ddb, "a") is None
    assert writer.write([put("a", 20, colour="late")]).stale == 1
    assert get(ddb, "a") is None
    assert writer.write([DeleteItem(TABLE, {"pk": {"S": "a"}}, 25)]).stale == 1


def test_a_batch_with_one_stale_write_writes_all_the_others(ddb):
    writer = DynamoDBWriter(ddb, versions_table_name(TABLE))
    writer.write([put("p7", 100, colour="newest")])
    batch = [put(f"p{i}", 50, colour=str(i)) for i in range(30)]  # two transactions; p7 is stale
    out = writer.write(batch)
    assert (out.written, out.stale) == (29, 1)
    assert get(ddb, "p7")["colour"] == {"S": "newest"}
    assert all(get(ddb, f"p{i}")["colour"] == {"S": str(i)} for i in range(30) if i != 7)


def test_writes_are_paced_by_the_write_budget(ddb):
    slept = []
    clock = [0.0]
    writer = DynamoDBWriter(ddb, versions_table_name(TABLE), max_wcu=4.0, clock=lambda: clock[0],
                            sleep=slept.append)
    writer.write([put(f"q{i}", 1, colour="x") for i in range(25)])
    assert slept and sum(slept) > 0
