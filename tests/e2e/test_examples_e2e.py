"""Every shipped example end to end: DynamoDB (the local emulator) → stream → pipeline →
Bigtable (emulator), including updates and deletes, compared cell by cell with
the mapping of the final table, plus the seed documents' layouts."""
from __future__ import annotations

import struct

import pytest

from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.clients.bigtable.reads import read_table
from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.verify.compare import compare_mapping
from ddb2bt.pipeline.connect.connections import dynamodb_client
from tests.conftest import write_mapping
from tests.unit.transforms.test_examples import INVOICE_SEED, VIDEO_SEED, item, ms
from ddb2bt.transforms.config import load_mapping

pytestmark = pytest.mark.e2e


def replicate(path, mapping, ops):
    ddb = dynamodb_client()
    workload.create_table(ddb, mapping.source.table, mapping.source.partition_key, mapping.source.sort_key)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    for op, it in ops:
        if op == "put":
            ddb.put_item(TableName=mapping.source.table, Item=it)
        else:
            ddb.delete_item(TableName=mapping.source.table,
                            Key={k: it[k] for k in mapping.source.key_attributes})
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1.5", "--poll-interval", "0.2"]) == 0
    items = workload.scan_all(ddb, mapping.source.table)
    read = lambda table: read_table(mapping.target.project, mapping.target.instance, table)
    diffs = compare_mapping(mapping, items, read)
    for table, diff in diffs.items():
        assert diff.identical, f"{table}: {diff.summary()}"
    return {t: read(t) for t in mapping.tables}


def test_videos_example(stack, tmp_path, unique):
    path = write_mapping(tmp_path, "videos.yaml", source__table=f"Videos_{unique}", target__table=f"videos_{unique}",
                         name=f"videos_{unique}")
    mapping = load_mapping(path)
    ops = [("put", it) for it in VIDEO_SEED]
    ops += [("delete", VIDEO_SEED[2]),  # one comment deleted: exactly its version goes
            ("put", dict(VIDEO_SEED[4], Count={"N": "157"})),  # a view counted
            ("delete", VIDEO_SEED[5])]  # video 0124's Video item deleted: only its cells go
    tables = replicate(path, mapping, ops)
    rows = tables[mapping.target.table]
    r0123 = rows[b"0123"]
    assert [v for _, v in r0123[("comments", b"UserComments")]] == [b"I really like this. Special effects are amazing."]
    assert r0123[("stats", b"Views")][0][1] == struct.pack(">q", 157)
    assert r0123[("video", b"Formats")][0][0] == ms("2023-09-10T15:21:48")
    r0124 = rows[b"0124"]
    assert ("video", b"Formats") not in r0124
    comments = r0124[("comments", b"UserComments")]
    assert [t for t, _ in comments] == sorted((t for t, _ in comments), reverse=True)  # newest first
    assert len(comments) == 2


def test_invoices_example(stack, tmp_path, unique):
    path = write_mapping(tmp_path, "invoices.yaml", source__table=f"Invoices_{unique}",
                         target__table=f"invoices_{unique}", name=f"invoices_{unique}")
    mapping = load_mapping(path)
    ops = [("put", it) for it in INVOICE_SEED] + [("delete", INVOICE_SEED[5])]
    rows = replicate(path, mapping, ops)[mapping.target.table]
    assert set(rows[b"0123"]) == {("Invoice", b"Details"), ("Payment", b"0680"), ("Payment", b"0789")}
    assert set(rows[b"0124"]) == {("Invoice", b"Details"), ("Payment", b"0327")}
    assert rows[b"0123"][("Payment", b"0680")] == [
        (ms("2023-09-10T15:21:40"), '{"address":"123 Abc St…","amount_usd":120,"bill_to":"John…"}'.encode())]


def test_hr_orders_example_with_index_rows(stack, tmp_path, unique):
    path = write_mapping(tmp_path, "hr_orders.yaml", source__table=f"HR_{unique}", target__table=f"hr_{unique}",
                         name=f"hr_{unique}", rules__3__indexes__1__table=f"hr_open_{unique}")
    mapping = load_mapping(path)
    emp = item(PK="HR-EMPLOYEE#0001", SK="HR-EMPLOYEE#0001", Name="John Smith", HireDate="2021-03-01",
               Warehouse="WAREHOUSE#1", JobTitle="Engineer")
    emp2 = item(PK="HR-EMPLOYEE#0002", SK="HR-EMPLOYEE#0002", Name="Ana Lima", HireDate="2022-05-01",
                Warehouse="WAREHOUSE#2", JobTitle="Analyst")
    orders = [item(PK=f"OE-ORDER#O{i}", SK=f"OE-ORDER#O{i}", CustomerID=f"C{i % 3}", OrderStatus="OPEN",
                   OrderDate=f"2023-09-{10 + i}", Total=10 * i) for i in range(1, 9)]
    ops = [("put", emp), ("put", emp2),
           ("put", item(PK="HR-EMPLOYEE#0001", SK="JH#2021-03-01", Job={"title": "Engineer", "department": "R&D"})),
           ("put", item(PK="OE-PRODUCT#P1", SK="OE-PRODUCT#P1", Name="Widget", Price=49.75)),
           ("put", item(PK="OE-PRODUCT#P1", SK="WAREHOUSE#W1", Quantity=120)),
           ("put", item(PK="OE-CUSTOMER#C1", SK="OE-CUSTOMER#C1", Name="Acme", AccountRep="HR-EMPLOYEE#0002")),
           ("put", item(PK="HR-REGION#1", SK="Europe", Countries=3))]
    ops += [("put", o) for o in orders]
    ops += [("put", dict(emp, Name={"S": "John A. Smith"}, Warehouse={"S": "WAREHOUSE#3"})),  # index keys move
            ("put", dict(orders[0], OrderStatus={"S": "SHIPPED"})),  # leaves the OPEN index
            ("put", dict(orders[1], OrderDate={"S": "2023-10-01"})),  # moves within it
            ("delete", orders[2]),  # gone from every index
            ("delete", emp2)]
    tables = replicate(path, mapping, ops)
    main, open_idx = tables[mapping.target.table], tables[f"hr_open_{unique}"]
    by_name = sorted(k for k in main if k.startswith(b"idx#emp_by_name#"))
    assert by_name == [b"idx#emp_by_name#John A. Smith#HR-EMPLOYEE\\#0001#HR-EMPLOYEE#0001"]
    assert [k for k in main if k.startswith(b"idx#emp_by_warehouse#")] == [
        b"idx#emp_by_warehouse#WAREHOUSE\\#3#HR-EMPLOYEE\\#0001#HR-EMPLOYEE#0001"]
    open_orders = sorted(k.split(b"#", 1)[1] for k in open_idx)
    assert len(open_orders) == 6  # 8 orders − 1 shipped − 1 deleted
    assert b"2023-10-01#OE-ORDER\\#O2#OE-ORDER#O2" in open_orders
    assert len({k.split(b"#", 1)[0] for k in open_idx}) > 1  # really spread over shards
    assert main[b"product#P1"][("inventory", b"W1")][0][1] == struct.pack(">q", 120)
