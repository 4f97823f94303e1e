"""The cutover and the way back, end to end on the local stack with the test
change-stream server: migrate → LIVE → verify → the forward job stopped → the
application writes to Bigtable (new items, updates, deletes, items the forward path
created) → rollback run → rollback verify IDENTICAL, and DynamoDB holds exactly the
items the application's writes mean."""
from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import time

import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.clients.bigtable.changestream import table_name
from ddb2bt.pipeline.recover.rollback import FRONTIER_META
from ddb2bt.pipeline.sink.dynamodb_writer import DynamoDBWriter, versions_table_name
from ddb2bt.pipeline.testing.change_stream_server import request_garbage_collection, request_split
from ddb2bt.transforms.inverse_rows import PutItem
from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec, dynamodb_client
from ddb2bt.pipeline.control.phases import CUT_OVER, Migration
from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.local.local_stack import MOTO, LocalStack
from ddb2bt.transforms.attrs import canonical_typed_json
from ddb2bt.transforms.config import load_mapping
from tests.conftest import ready_but_for_the_tail, write_mapping
from google.cloud.bigtable.row_filters import TimestampRange

from tests.unit.transforms.test_examples import INVOICE_SEED, VIDEO_SEED, item, ms
from tests.unit.transforms.test_inverse import HR_SEED

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cs_stack(tmp_path_factory):
    """A stack whose Bigtable has change streams (the test server in front of cbtemulator)."""
    with LocalStack(log_dir=tmp_path_factory.mktemp("rollback-stack"), dynamodb=MOTO, change_streams=True) as stack:
        previous = stack.apply_env()
        try:
            yield stack
        finally:
            for k, v in previous.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def canon(items):
    return sorted(canonical_typed_json({"M": i}) for i in items)


def bigtable_table(mapping):
    from google.cloud.bigtable import Client

    return Client(project=mapping.target.project, admin=True).instance(mapping.target.instance).table(
        mapping.target.table)


def at_ms(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.timezone.utc)


def migrate_to_live(path, mapping, seed, capsys, change_stream_by="prepare"):
    ddb = dynamodb_client()
    workload.create_table(ddb, mapping.source.table, mapping.source.partition_key, mapping.source.sort_key)
    if change_stream_by == "create-table":
        assert ddb2bt(["create-table", "--mapping", str(path), "--change-stream"]) == 0
        assert "change stream of" in capsys.readouterr().out
    else:
        assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
        assert ddb2bt(["rollback", "prepare", "--mapping", str(path), "--retention-hours", "24"]) == 0
    for it in seed:
        ddb.put_item(TableName=mapping.source.table, Item=it)
    assert ddb2bt(["migrate", "--mapping", str(path), "--segments", "2", "--until-idle", "1.5",
                   "--poll-interval", "0.2"]) == 0
    assert ddb2bt(["verify", "--mapping", str(path)]) == 0
    capsys.readouterr()
    # migrate --until-idle has ended: every condition of READY holds but a running tail
    assert ddb2bt(["status", "--mapping", str(path)]) == 1
    out = capsys.readouterr().out
    assert ready_but_for_the_tail(out), out
    # The cutover: the forward job has stopped (migrate --until-idle ended); the way
    # back starts before the application writes to Bigtable, and finds nothing yet.
    assert ddb2bt(["rollback", "run", "--mapping", str(path), "--until-idle", "0.5"]) == 0
    assert "0 row(s) read back" in capsys.readouterr().out
    assert Migration(StateSpec(BigtableSpec(mapping.target.project, mapping.target.instance),
                               job=mapping.name).store()).phase == CUT_OVER
    return ddb


def roll_back(path, mapping, ddb, capsys):
    capsys.readouterr()
    assert ddb2bt(["rollback", "run", "--mapping", str(path), "--until-idle", "1.5", "--max-wcu", "500"]) == 0
    run = capsys.readouterr().out
    assert ddb2bt(["rollback", "verify", "--mapping", str(path), "--show-keys"]) == 0, run
    verify = capsys.readouterr().out
    assert "IDENTICAL" in verify
    assert ddb2bt(["rollback", "status", "--mapping", str(path)]) == 0
    status = capsys.readouterr().out
    assert "READY to switch back" in status and "NOT READY" not in status
    return run, workload.scan_all(ddb, mapping.source.table)


def test_product_catalog_cutover_and_the_way_back(cs_stack, tmp_path, unique, capsys):
    path = write_mapping(tmp_path, "product_catalog.yaml", source__table=f"Catalog_{unique}",
                         target__table=f"catalog_{unique}", name=f"catalog_{unique}")
    mapping = load_mapping(path)
    seed = [item(pk="hats", sk="fedoras#brandA", Description="A fedora", Price=30, Colour="red"),
            item(pk="hats", sk="caps#brandB", Description="A cap", Price=12, Rating=4.5),
            item(pk="a#b", sk="x\\y", Description="escaped keys", Price=1)]
    ddb = migrate_to_live(path, mapping, seed, capsys)

    # The application now writes to Bigtable.
    table = bigtable_table(mapping)
    now = at_ms(1_800_000_000_000)
    row = table.direct_row(b"hats#fedoras#brandA")  # an item the forward path created: updated
    row.set_cell("SKU", b"Price", (31).to_bytes(8, "big", signed=True), timestamp=now)
    row.set_cell("SKU", b"Colour", b"blue", timestamp=now)  # keeps its type (S) from the item
    row.set_cell("SKU", b"Rating", b"4.9", timestamp=now)  # a new attribute: a string
    row.commit()
    row = table.direct_row(b"hats#caps#brandB")  # a forward-created item deleted
    row.delete()
    row.commit()
    row = table.direct_row(b"shoes\\#boots#brand#C")  # a new item: its pk escaped, its sk (the last part) not
    row.set_cell("SKU", b"Description", b"Boots", timestamp=now)
    row.set_cell("SKU", b"Price", (90).to_bytes(8, "big", signed=True), timestamp=now)
    row.commit()
    row = table.direct_row(b"a\\#b#x\\y")  # one cell of an item removed
    row.delete_cell("SKU", b"Price")
    row.commit()

    run, items = roll_back(path, mapping, ddb, capsys)
    assert "3 item(s) put, 1 deleted" in run
    assert canon(items) == canon([
        item(pk="hats", sk="fedoras#brandA", Description="A fedora", Price=31, Colour="blue", Rating="4.9"),
        item(pk="shoes#boots", sk="brand#C", Description="Boots", Price=90),
        item(pk="a#b", sk="x\\y", Description="escaped keys")])

    # A replay (the whole table again) changes nothing; the forward job cannot start again.
    capsys.readouterr()
    assert ddb2bt(["rollback", "run", "--mapping", str(path), "--full"]) == 0
    assert "0 item(s) put, 0 deleted" in capsys.readouterr().out
    assert canon(workload.scan_all(ddb, mapping.source.table)) == canon(items)
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "0.5"]) == 2
    assert "was cut over" in capsys.readouterr().err
    # Nor anything else that copies DynamoDB into Bigtable over the application's writes.
    for command in (["backfill"], ["dlq", "redrive"], ["repair"]):
        assert ddb2bt(command + ["--mapping", str(path)]) == 2, command
        assert "was cut over" in capsys.readouterr().err, command
    assert canon(workload.scan_all(ddb, mapping.source.table)) == canon(items)


def test_invoices_cutover_and_the_way_back(cs_stack, tmp_path, unique, capsys):
    path = write_mapping(tmp_path, "invoices.yaml", source__table=f"Invoices_{unique}",
                         target__table=f"invoices_{unique}", name=f"invoices_{unique}")
    mapping = load_mapping(path)
    ddb = migrate_to_live(path, mapping, INVOICE_SEED, capsys, change_stream_by="create-table")

    table = bigtable_table(mapping)
    created = 1_700_000_000_000
    row = table.direct_row(b"0123")
    row.set_cell("Payment", b"0999", b'{"amount_usd":5,"bill_to":"Zoe"}', timestamp=at_ms(created))  # a new payment
    row.delete_cell("Payment", b"0789")  # a payment the forward path created, deleted
    row.commit()
    row = table.direct_row(b"0124")  # the invoice's details updated: a new version at a new time
    row.delete_cell("Invoice", b"Details")
    row.set_cell("Invoice", b"Details", b'{"discount":0.3}', timestamp=at_ms(created + 1000))
    row.commit()

    run, items = roll_back(path, mapping, ddb, capsys)
    assert "2 item(s) put, 1 deleted" in run
    expected = [it for it in INVOICE_SEED if it["sk"]["S"] not in ("Payment-0789", "Invoice-0124")]
    expected += [item(pk="Invoice-0123", sk="Payment-0999", DateCreated="2023-11-14T22:13:20",
                      Details={"amount_usd": 5, "bill_to": "Zoe"}),
                 item(pk="Invoice-0124", sk="Invoice-0124", DateCreated="2023-11-14T22:13:21",
                      Details={"discount": 0.3})]
    assert canon(items) == canon(expected)

    # A new invoice: its sk is nowhere in the row (the rule inverts for existing items
    # only), so it is reported, not guessed; nothing says READY or IDENTICAL.
    row = table.direct_row(b"0125")
    row.set_cell("Invoice", b"Details", b'{"discount":0}', timestamp=at_ms(created))
    row.commit()
    capsys.readouterr()
    assert ddb2bt(["rollback", "run", "--mapping", str(path), "--until-idle", "1", "--show-keys"]) == 1
    out = capsys.readouterr().out
    assert "1 cell(s) not written back" in out and "row b'0125' Invoice:Details" in out
    assert ddb2bt(["rollback", "status", "--mapping", str(path)]) == 1
    assert "1 cell(s) changed since the cutover were not written back" in capsys.readouterr().out
    assert ddb2bt(["rollback", "verify", "--mapping", str(path)]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT: 1 row(s) differ" in out and "IDENTICAL" not in out
    # an item in DynamoDB the mapping refuses (no rule matches it) is no IDENTICAL either
    ddb.put_item(TableName=mapping.source.table, Item=item(pk="Invoice-0123", sk="Refund-1"))
    row = table.direct_row(b"0125")
    row.delete()
    row.commit()
    assert ddb2bt(["rollback", "verify", "--mapping", str(path)]) == 1
    out = capsys.readouterr().out
    assert "1 DynamoDB item(s) the mapping refuses (no_matching_rule)" in out and "IDENTICAL" not in out
    ddb.delete_item(TableName=mapping.source.table, Key={"pk": {"S": "Invoice-0123"}, "sk": {"S": "Refund-1"}})
    assert canon(workload.scan_all(ddb, mapping.source.table)) == canon(expected)


def test_videos_rules_that_invert_are_rolled_back(cs_stack, tmp_path, unique, capsys):
    path = write_mapping(tmp_path, "videos.yaml", source__table=f"Videos_{unique}", target__table=f"videos_{unique}",
                         name=f"videos_{unique}")
    mapping = load_mapping(path)
    ddb = migrate_to_live(path, mapping, VIDEO_SEED, capsys)
    table = bigtable_table(mapping)
    upload, later = 1_700_000_000_000, at_ms(1_800_000_000_000)  # a video's time; a counter's (after the forward's)
    row = table.direct_row(b"0125")  # a new video (rule video: sk from its 'equals' condition)
    row.set_cell("video", b"Formats", b'{"480":"https://storage.example/0125/480"}', timestamp=at_ms(upload))
    row.set_cell("stats", b"Likes", (1).to_bytes(8, "big", signed=True), timestamp=later)
    row.commit()
    row = table.direct_row(b"0123")  # a like counted; the audio-glitch comment (an existing item) deleted
    row.set_cell("stats", b"Likes", (4).to_bytes(8, "big", signed=True), timestamp=later)
    glitch = ms("2023-09-10T16:30:42")
    row.delete_cell("comments", b"UserComments", time_range=TimestampRange(start=at_ms(glitch),
                                                                             end=at_ms(glitch + 1)))
    row.commit()
    row = table.direct_row(b"0124")  # a view counted on the legacy item the column also reads as
    row.set_cell("stats", b"Views", (46).to_bytes(8, "big", signed=True), timestamp=later)
    row.commit()

    run, items = roll_back(path, mapping, ddb, capsys)
    expected = [it for it in VIDEO_SEED if not (it["pk"]["S"] == "0123" and it["sk"]["S"] == "VideoComment#86751345")]
    expected = [dict(it, Count={"N": "4"}) if it["sk"]["S"] == "VideoStatsLikes" else
                dict(it, ViewCount={"N": "46"}) if it["sk"]["S"] == "VideoStats" else it for it in expected]
    expected += [item(pk="0125", sk="Video", UploadDate="2023-11-14T22:13:20",
                      Formats={"480": "https://storage.example/0125/480"}),
                 item(pk="0125", sk="VideoStatsLikes", Count=1)]
    assert canon(items) == canon(expected)
    assert "4 item(s) put, 1 deleted" in run


def test_hr_orders_rules_that_invert_are_rolled_back(cs_stack, tmp_path, unique, capsys):
    path = write_mapping(tmp_path, "hr_orders.yaml", source__table=f"HR_{unique}", target__table=f"hr_{unique}",
                         name=f"hr_{unique}", rules__3__indexes__1__table=f"hr_open_{unique}")
    mapping = load_mapping(path)
    ddb = migrate_to_live(path, mapping, HR_SEED, capsys)
    table = bigtable_table(mapping)
    now = at_ms(1_800_000_000_000)
    row = table.direct_row(b"emp#0001")  # a new job history entry; an existing employee's title changed
    row.set_cell("jobs", b"2024-01-01", b'{"department":"R&D","title":"Lead"}', timestamp=now)
    row.set_cell("emp", b"JobTitle", b"Lead", timestamp=now)
    row.commit()
    row = table.direct_row(b"order#O1")  # an order line gone
    row.delete_cell("lines", b"P1")
    row.commit()
    row = table.direct_row(b"product#P1")  # stock in a new warehouse
    row.set_cell("inventory", b"W2", (7).to_bytes(8, "big", signed=True), timestamp=now)
    row.commit()
    row = table.direct_row(b"entity#HR-REGION\\#2#Asia")  # a new reference entity
    row.set_cell("entity", b"Countries", b"12", timestamp=now)
    row.commit()

    run, items = roll_back(path, mapping, ddb, capsys)
    assert "4 item(s) put, 1 deleted" in run
    expected = [dict(it, JobTitle={"S": "Lead"}) if it["SK"]["S"] == "HR-EMPLOYEE#0001" else it
                for it in HR_SEED if it["SK"]["S"] != "ITEM#P1"]
    expected += [item(PK="HR-EMPLOYEE#0001", SK="JH#2024-01-01", Job={"title": "Lead", "department": "R&D"}),
                 item(PK="OE-PRODUCT#P1", SK="WAREHOUSE#W2", Quantity=7),
                 item(PK="HR-REGION#2", SK="Asia", Countries="12")]  # auto: a new attribute is a string
    assert canon(items) == canon(expected)


def test_the_way_back_survives_sigkill_a_split_garbage_collection_and_a_replay(cs_stack, tmp_path, unique, capsys):
    path = write_mapping(tmp_path, "product_catalog.yaml", source__table=f"Kill_{unique}",
                         target__table=f"kill_{unique}", name=f"kill_{unique}")
    mapping = load_mapping(path)
    seed = [item(pk="hats", sk="fedoras#brandA", Description="A fedora", Price=30)]
    ddb = migrate_to_live(path, mapping, seed, capsys)
    table = bigtable_table(mapping)
    address = f"127.0.0.1:{cs_stack.bigtable_port}"
    name = table_name(mapping.target.project, mapping.target.instance, mapping.target.table)
    now = 1_800_000_000_000

    def write(n0, n1, price, at):
        for n in range(n0, n1):
            row = table.direct_row(f"k{n:02d}#item".encode())
            row.set_cell("SKU", b"Price", price.to_bytes(8, "big", signed=True), timestamp=at_ms(at))
            row.commit()

    write(0, 30, 1, now)
    request_split(address, name, b"k15")  # a partition split in the middle of the stream
    write(0, 30, 2, now + 1000)  # every item changed again, on both sides of the split
    # garbage collection of the older versions: a change of Bigtable's, not the application's
    for n in (3, 20):
        request_garbage_collection(address, name, f"k{n:02d}#item".encode(), "SKU", b"Price", (now + 1000) * 1000)

    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-m", "ddb2bt.pipeline.app.cli", "rollback", "run", "--mapping",
                             str(path), "--follow", "--until-idle", "1", "--max-wcu", "20"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while len(workload.scan_all(ddb, mapping.source.table)) < 6 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        assert len(workload.scan_all(ddb, mapping.source.table)) >= 6, "the rollback wrote nothing to kill"
    finally:
        proc.kill()  # SIGKILL: no release of its lease, no checkpoint of the pass
        proc.communicate()
    partial = len(workload.scan_all(ddb, mapping.source.table))
    assert partial < 31, "killed after everything was written: the restart would prove nothing"

    # The restart resumes (the dead holder's lease is free) and writes the rest.
    assert ddb2bt(["rollback", "run", "--mapping", str(path), "--until-idle", "1.5"]) == 0
    expected = seed + [item(pk=f"k{n:02d}", sk="item", Price=2) for n in range(30)]
    assert canon(workload.scan_all(ddb, mapping.source.table)) == canon(expected)

    # A replayed batch (the checkpoint set back to the cutover) writes nothing.
    store = StateSpec(BigtableSpec(mapping.target.project, mapping.target.instance), job=mapping.name).store()
    store.save_meta(FRONTIER_META, "")  # no saved frontier: read again from the cutover
    capsys.readouterr()
    assert ddb2bt(["rollback", "run", "--mapping", str(path), "--until-idle", "1.5"]) == 0
    assert "30 row(s) read back: 0 item(s) put, 0 deleted" in capsys.readouterr().out
    assert canon(workload.scan_all(ddb, mapping.source.table)) == canon(expected)

    # An older version never overwrites a newer one: the versions table refuses it.
    writer = DynamoDBWriter(ddb, versions_table_name(mapping.source.table))
    stale = item(pk="k05", sk="item", Price=1)
    cutover_us = Migration(store).cutover_ms * 1000  # before every commit the rollback wrote
    out = writer.write([PutItem(mapping.source.table, stale, {"pk": stale["pk"], "sk": stale["sk"]}, cutover_us)])
    assert (out.written, out.stale) == (0, 1)
    assert ddb2bt(["rollback", "verify", "--mapping", str(path)]) == 0


def test_the_way_back_is_refused_while_the_forward_job_runs(cs_stack, tmp_path, unique, capsys):
    path = write_mapping(tmp_path, "product_catalog.yaml", source__table=f"Busy_{unique}",
                         target__table=f"busy_{unique}", name=f"busy_{unique}")
    mapping = load_mapping(path)
    ddb = dynamodb_client()
    workload.create_table(ddb, mapping.source.table, mapping.source.partition_key, mapping.source.sort_key)
    assert ddb2bt(["create-table", "--mapping", str(path), "--change-stream"]) == 0
    ddb.put_item(TableName=mapping.source.table, Item=item(pk="hats", sk="cap", Price=1))
    assert ddb2bt(["migrate", "--mapping", str(path), "--until-idle", "1", "--poll-interval", "0.2"]) == 0
    forward = subprocess.Popen([sys.executable, "-m", "ddb2bt.pipeline.app.cli", "run", "--mapping", str(path),
                                "--poll-interval", "0.2"], env=dict(os.environ), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        seen = ""
        while "replicating" not in seen:  # logged once the forward tail holds its lease
            line = forward.stdout.readline()
            assert line, f"the forward job ended: {seen}"
            seen += line
        capsys.readouterr()
        assert ddb2bt(["rollback", "run", "--mapping", str(path), "--until-idle", "0.5"]) != 0
        assert "lease" in capsys.readouterr().err.lower()
        store = StateSpec(BigtableSpec(mapping.target.project, mapping.target.instance), job=mapping.name).store()
        assert Migration(store).phase == "LIVE"  # not cut over: the forward tail still runs
        assert ddb2bt(["rollback", "status", "--mapping", str(path)]) == 1
        out = capsys.readouterr().out
        assert "not ready: the migration is LIVE, not CUT_OVER" in out and "NOT READY to switch back" in out
        assert "nothing has been written back yet" in out
    finally:
        forward.kill()
        forward.communicate()
