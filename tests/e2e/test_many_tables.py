"""Many tables, one job, on the emulators: one `run` replicating concurrent
writes to two tables exactly; `migrate` of three tables (one backfill each)
killed with SIGKILL mid-run and restarted, every table resuming and reaching
LIVE; adding a table to a job (stop → start with one more mapping): the
existing table resumes from its checkpoints, the new one starts from scratch."""
from __future__ import annotations

import json
import random
import threading
import time

import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec, dynamodb_client
from ddb2bt.pipeline.control.phases import LIVE, Migration
from ddb2bt.pipeline.local import workload
from ddb2bt.transforms.attrs import from_plain
from ddb2bt.transforms.config import load_mapping
from tests.conftest import write_mapping
from tests.e2e.test_cutover import (_kill, _spawn, _wait, assert_target_is_exactly_the_mapping, preload,
                                    random_changes)

pytestmark = pytest.mark.e2e
TAIL = ["--poll-interval", "0.2"]


def table_of(tmp_path, unique, base, source, target):
    path = write_mapping(tmp_path, base, source__table=f"{source}_{unique}", target__table=f"{target}_{unique}",
                         name=f"{target}_{unique}")
    mapping = load_mapping(path)
    workload.create_table(dynamodb_client(), mapping.source.table, mapping.source.partition_key,
                          mapping.source.sort_key)
    return path, mapping


def invoice_item(rng, number: int, payment=None) -> dict:
    """An invoice (payment None) or one of its payments; DateCreated — the cell
    version — is fixed per item, so two items never claim one version."""
    sk = f"Invoice-{number:04d}" if payment is None else f"Payment-{payment:04d}"
    created = 1_694_000_000 + number * 1000 + (0 if payment is None else payment + 1)
    return {k: from_plain(v) for k, v in {
        "pk": f"Invoice-{number:04d}", "sk": sk,
        "DateCreated": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)),
        "Details": {"amount_usd": rng.randint(1, 999), "note": rng.choice(["a", "b", "c"])}}.items()}


def invoice_changes(ddb, table, count, seed, stop=None) -> int:
    """Puts (new and overwritten invoices and payments) and deletes."""
    rng = random.Random(seed)
    for n in range(count):
        if stop is not None and stop.is_set():
            return n
        number, payment = rng.randrange(40), rng.choice([None, rng.randrange(5)])
        it = invoice_item(rng, number, payment)
        if rng.random() < 0.2:
            ddb.delete_item(TableName=table, Key={"pk": it["pk"], "sk": it["sk"]})
        else:
            ddb.put_item(TableName=table, Item=it)
    return count


def store_of(mapping):
    return StateSpec(BigtableSpec(mapping.target.project, mapping.target.instance), job=mapping.name).store()


@pytest.mark.slow
def test_one_run_replicates_concurrent_writes_to_two_tables(stack, tmp_path, unique, capsys):
    catalog_path, catalog = table_of(tmp_path, unique, "product_catalog.yaml", "Catalog", "catalog")
    invoices_path, invoices = table_of(tmp_path, unique, "invoices.yaml", "Invoices", "invoices")
    both = ["--mapping", str(catalog_path), "--mapping", str(invoices_path)]
    assert ddb2bt(["create-table", *both]) == 0
    ddb = dynamodb_client()
    items = preload(ddb, catalog.source.table, 200)
    done: list = []
    writers = [threading.Thread(target=lambda: done.append(random_changes(ddb, catalog.source.table, items, 600, 3))),
               threading.Thread(target=lambda: done.append(invoice_changes(ddb, invoices.source.table, 600, 4)))]
    for w in writers:
        w.start()
    try:
        assert ddb2bt(["run", *both, "--until-idle", "8", *TAIL]) == 0
    finally:
        for w in writers:
            w.join()
    assert done == [600, 600]
    out = capsys.readouterr().out
    assert "done:" in out and "0 dead-lettered" in out
    # the process's metrics, per table (each table's name in the job)
    from prometheus_client import REGISTRY

    for mapping in (catalog, invoices):
        assert REGISTRY.get_sample_value("ddb2bt_changes_applied_total", {"table": mapping.name, "event": "INSERT"})
        assert REGISTRY.get_sample_value("ddb2bt_checkpoint_timestamp_seconds", {"table": mapping.name})
        assert REGISTRY.get_sample_value("ddb2bt_shards", {"table": mapping.name, "state": "open"}) == 1
    for mapping in (catalog, invoices):
        assert_target_is_exactly_the_mapping(mapping, ddb)
        # each table's checkpoints under its own name, for its own stream only
        arn = ddb.describe_table(TableName=mapping.source.table)["Table"]["LatestStreamArn"]
        assert store_of(mapping).load_checkpoints(arn), mapping.name
    other = ddb.describe_table(TableName=invoices.source.table)["Table"]["LatestStreamArn"]
    assert store_of(catalog).load_checkpoints(other) == {}
    report = tmp_path / "verify.json"
    assert ddb2bt(["verify", *both, "--report", str(report)]) == 0
    assert "2 of 2 table(s) IDENTICAL" in capsys.readouterr().out
    data = json.loads(report.read_text())
    assert data["identical"] and set(data["tables"]) == {catalog.name, invoices.name}
    # status: one line per table and the total (no migration ran: NOT READY, saying why)
    assert ddb2bt(["status", *both]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [catalog.name, invoices.name, "total"]
    assert lines[-1].startswith("total: 0 of 2 table(s) READY")


@pytest.mark.slow
def test_migrate_three_tables_killed_then_resumed(stack, tmp_path, unique, capsys):
    tables = [table_of(tmp_path, unique, "product_catalog.yaml", "CatalogA", "cata"),
              table_of(tmp_path, unique, "product_catalog.yaml", "CatalogB", "catb"),
              table_of(tmp_path, unique, "invoices.yaml", "Invoices", "inv")]
    flags = [arg for path, _ in tables for arg in ("--mapping", str(path))]
    assert ddb2bt(["create-table", *flags]) == 0
    ddb = dynamodb_client()
    preloaded = [preload(ddb, tables[0][1].source.table, 3000, seed=1),
                 preload(ddb, tables[1][1].source.table, 3000, seed=2)]
    invoice_changes(ddb, tables[2][1].source.table, 300, seed=5)
    command = ["migrate", *flags, "--segments", "4", "--page-size", "100", "--until-idle", "2", *TAIL]
    proc = _spawn(command)
    first = store_of(tables[0][1])
    try:
        # mid-run: the first table's backfill has written some of its parts
        _wait(lambda: any(p.count for p in first.load_backfill_progress().values()), what="backfill progress")
        random_changes(ddb, tables[0][1].source.table, preloaded[0], 100, seed=7)
    finally:
        _kill(proc)
    assert Migration(first).phase != LIVE
    # changes while the job is down, to every table
    random_changes(ddb, tables[1][1].source.table, preloaded[1], 100, seed=8)
    invoice_changes(ddb, tables[2][1].source.table, 100, seed=9)
    assert ddb2bt(["--log-level", "WARNING", *command]) == 0
    capsys.readouterr()
    for _, mapping in tables:
        assert Migration(store_of(mapping)).phase == LIVE, mapping.name
        assert_target_is_exactly_the_mapping(mapping, ddb)
    assert ddb2bt(["verify", *flags]) == 0
    assert "3 of 3 table(s) IDENTICAL" in capsys.readouterr().out


def changes_read(out: str) -> int:
    """applied + dead-lettered + skipped, from a run's last line."""
    import re

    found = re.search(r"done: (\d+) change\(s\) applied, (\d+) dead-lettered, (\d+) skipped", out)
    assert found, out
    return sum(int(n) for n in found.groups())


def test_adding_a_table_to_a_job_resumes_the_others(stack, tmp_path, unique, capsys):
    a_path, a = table_of(tmp_path, unique, "product_catalog.yaml", "First", "first")
    b_path, b = table_of(tmp_path, unique, "invoices.yaml", "Second", "second")
    ddb = dynamodb_client()
    assert ddb2bt(["create-table", "--mapping", str(a_path), "--mapping", str(b_path)]) == 0
    assert len(preload(ddb, a.source.table, 100, seed=1)) == 100  # 100 new items: 100 stream records
    assert ddb2bt(["run", "--mapping", str(a_path), "--until-idle", "1", *TAIL]) == 0
    assert changes_read(capsys.readouterr().out) == 100
    rng = random.Random(2)
    for number in range(50):  # the new table has its history: 50 new items
        ddb.put_item(TableName=b.source.table, Item=invoice_item(rng, number))
    assert len(preload(ddb, a.source.table, 30, seed=3)) == 30
    assert ddb2bt(["run", "--mapping", str(a_path), "--mapping", str(b_path), "--until-idle", "1", *TAIL]) == 0
    # the first table resumed after its checkpoints (30 new changes, none of its
    # first 100 again); the added one started from its stream's beginning (50)
    assert changes_read(capsys.readouterr().out) == 80
    for mapping in (a, b):
        assert_target_is_exactly_the_mapping(mapping, ddb)


@pytest.mark.parametrize("stream", [None, "KEYS_ONLY"])
def test_a_table_without_a_usable_stream_is_refused_before_anything_starts(stack, tmp_path, unique, capsys,
                                                                          monkeypatch, stream):
    import ddb2bt.pipeline.services.jobs as jobs

    good_path, good = table_of(tmp_path, unique, "product_catalog.yaml", "Good", "good")
    bad_path = write_mapping(tmp_path, "invoices.yaml", source__table=f"Bad_{unique}", target__table=f"bad_{unique}",
                             name=f"bad_{unique}")
    spec = {"StreamSpecification": {"StreamEnabled": True, "StreamViewType": stream}} if stream else {}
    dynamodb_client().create_table(
        TableName=f"Bad_{unique}", BillingMode="PAY_PER_REQUEST",
        AttributeDefinitions=[{"AttributeName": a, "AttributeType": "S"} for a in ("pk", "sk")],
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}, {"AttributeName": "sk", "KeyType": "RANGE"}], **spec)
    both = ["--mapping", str(good_path), "--mapping", str(bad_path)]
    assert ddb2bt(["create-table", *both]) == 0

    def no_lease(*a, **k):
        raise AssertionError("a lease was taken before every table was checked")

    monkeypatch.setattr(jobs, "acquire_lease", no_lease)
    for command in (["run", "--until-idle", "1"], ["migrate", "--until-idle", "1"]):
        assert ddb2bt([command[0], *both, *command[1:]]) == 2
        err = capsys.readouterr().err
        assert f"Bad_{unique}" in err and ("no stream enabled" in err if stream is None else "KEYS_ONLY" in err)
    assert Migration(store_of(good)).phase is None  # nothing of the good table's was begun
