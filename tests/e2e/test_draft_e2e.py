"""`ddb2bt draft` on the local stack (issue 37): for each of the seed's example
tables and a single-table design with an overloaded GSI, TTL, sets, maps, lists
and 38-digit decimals, draft → validate → lint → create-table
--split-from-sample → migrate → verify, with no hand edit, ends IDENTICAL; the
pre-split target's CreateTable carried the drafted split points. And the bad
inputs: no such table, an empty table, a table with no stream."""
from __future__ import annotations

import time

import pytest
import yaml

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.connect.connections import dynamodb_client
from tests.unit.transforms.draft_tables import NOW_S, all_tables

pytestmark = pytest.mark.e2e
TAIL = ["--poll-interval", "0.2"]
TARGET = ["--bigtable-project", "local-project", "--bigtable-instance", "local-instance"]


@pytest.fixture
def create_requests(monkeypatch):
    """The CreateTable requests sent to the emulator, as sent: cbtemulator
    accepts initial_splits but keeps no tablets, so neither SampleRowKeys nor
    GetTable can show them afterwards."""
    from google.cloud.bigtable_admin_v2 import BaseBigtableTableAdminClient

    sent = []
    real = BaseBigtableTableAdminClient.create_table

    def create_table(self, request=None, **kwargs):
        sent.append(request)
        return real(self, request=request, **kwargs)

    monkeypatch.setattr(BaseBigtableTableAdminClient, "create_table", create_table)
    return sent


def put_table(ddb, source, name: str) -> None:
    ddb.create_table(**source.create_table_args(name))
    if source.ttl:
        ddb.update_time_to_live(TableName=name, TimeToLiveSpecification={"Enabled": True,
                                                                          "AttributeName": source.ttl})
    # The fixtures' TTL values are relative to their own clock (2023): shifted to
    # now, as a live table's are. Left in the past they are expired, and an
    # emulator that reaps expired items (ministack, every 60 s, without a stream
    # record) would empty the source in the middle of the test.
    shift = int(time.time()) - NOW_S
    for it in source.items:
        if source.ttl and source.ttl in it:
            it = {**it, source.ttl: {"N": str(int(it[source.ttl]["N"]) + shift)}}
        ddb.put_item(TableName=name, Item=it)


# One test per table, each its own tables, on any worker: as one test of them all
# it was the suite's longest (two and a half minutes on a loaded machine).
@pytest.mark.parametrize("source", all_tables(), ids=lambda source: source.label)
def test_draft_then_the_whole_cutover_of_every_example_and_a_single_table_design_ends_identical(
        stack, tmp_path, unique, capsys, create_requests, source):
    ddb = dynamodb_client()
    name = f"{source.label}_{unique}"
    put_table(ddb, source, name)
    path = tmp_path / f"{source.label}.yaml"
    report = tmp_path / f"{source.label}-report.txt"
    assert ddb2bt(["draft", "--table", name, "--out", str(path), "--report", str(report), *TARGET,
                   "--bigtable-table", name.lower()]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "Assessment of DynamoDB table" in out and report.read_text() in out
    assert ddb2bt(["validate", "-m", str(path), "--strict"]) == 0, capsys.readouterr()
    assert ddb2bt(["lint", "-m", str(path), "--sample", "1000", "--strict"]) == 0, capsys.readouterr().out
    capsys.readouterr()
    create_requests.clear()
    assert ddb2bt(["create-table", "-m", str(path), "--split-from-sample"]) == 0
    created = [r for r in create_requests if r["table_id"] == name.lower()]
    splits = [s.key for s in created[0]["initial_splits"]]
    assert splits and splits == sorted(splits), source.label  # a fresh table starts on several tablets
    assert f"{len(splits)} split point(s)" in capsys.readouterr().out
    # a change after the handoff reaches the target through the tail
    ddb.delete_item(TableName=name, Key={k: source.items[0][k] for k in (source.partition, source.sort)})
    assert ddb2bt(["migrate", "-m", str(path), "--segments", "2", "--until-idle", "1", *TAIL]) == 0
    assert ddb2bt(["verify", "-m", str(path), "--recheck-wait", "0"]) == 0, capsys.readouterr().out
    assert "IDENTICAL" in capsys.readouterr().out
    drafted = yaml.safe_load(path.read_text())
    rules = drafted["rules"]
    if source.label == "ProductCatalog":  # example 1: pk#sk and one family with the item's columns
        assert [r["row_key"] for r in rules] == ["{pk}#{sk}"] and len(drafted["families"]) == 1
        assert sorted(rules[0]["columns"]) == ["Description", "Price", "Thumbnail"]
        assert rules[0]["columns"]["Price"]["encoding"] == "int64"
    if source.label == "HROrders":  # example 4: entities by prefix, one data family, index rows per GSI
        assert {r["row_key"] for r in rules} == {"{PK}:{SK}"}  # PK values hold '#': another delimiter
        assert {r["other_attributes"]["family"] for r in rules} == {"d"} and set(drafted["families"]) == {"d", "idx"}
        assert {"hr_employee", "hr_employee_jh", "oe_order", "oe_order_item", "oe_product",
                "oe_product_warehouse", "oe_customer", "hr_region"} <= {r["name"] for r in rules}
        indexes = {i["name"]: i["row_key"] for r in rules for i in r.get("indexes", ())}  # each on its carriers
        assert indexes == {"gsi1": "idx:gsi1:{GSI1PK}:{GSI1SK}:{PK}:{SK}",
                           "gsi2": "idx:gsi2:{GSI2PK}:{GSI2SK}:{PK}:{SK}"}
    if source.label == "SingleTable":
        assert drafted["ttl"] == {"attribute": "ExpiresAt", "deletions": "apply"}
        assert not any("max_age_seconds" in f for f in drafted["families"].values())  # deletions come by the stream
        columns = rules[0]["columns"]
        assert columns["Tags"] == {"column": "d:Tags", "encoding": "json"}  # a set in one cell
        assert columns["Address"] == {"column": "d:Address", "encoding": "json"}
        assert columns["Balance"]["encoding"] == "decimal"


def test_nothing_to_draft_is_a_clear_error(stack, tmp_path, unique, capsys):
    ddb = dynamodb_client()
    assert ddb2bt(["draft", "--table", f"Missing_{unique}"]) == 1
    assert f"DynamoDB table 'Missing_{unique}' does not exist" in capsys.readouterr().err

    empty = f"Empty_{unique}"
    ddb.create_table(TableName=empty, BillingMode="PAY_PER_REQUEST",
                     AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
                     KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
                     StreamSpecification={"StreamEnabled": True, "StreamViewType": "NEW_AND_OLD_IMAGES"})
    out = tmp_path / "empty.yaml"
    assert ddb2bt(["draft", "--table", empty, "--out", str(out)]) == 1
    assert f"DynamoDB table '{empty}' has no items" in capsys.readouterr().err
    assert not out.exists()

    streamless = f"NoStream_{unique}"
    ddb.create_table(TableName=streamless, BillingMode="PAY_PER_REQUEST",
                     AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
                     KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}])
    ddb.put_item(TableName=streamless, Item={"pk": {"S": "a"}, "n": {"N": "1"}})
    out = tmp_path / "nostream.yaml"
    assert ddb2bt(["draft", "--table", streamless, "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert f"{streamless} has no stream: run and migrate need a NEW_AND_OLD_IMAGES stream" in captured.err
    assert "stream: OFF" in captured.out
    assert ddb2bt(["validate", "-m", str(out)]) == 0  # the draft itself is still written, and valid
