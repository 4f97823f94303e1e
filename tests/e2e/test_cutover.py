"""Backfill + live tail cutover on the emulators: migrate under a concurrent
writer, crashes during the backfill and during the tail, verify's detection of
each kind of divergence, status, and back-fill from an export (real layout)."""
from __future__ import annotations

import datetime as dt
import gzip
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
from ddb2bt.pipeline.clients.bigtable.reads import read_rows, read_table
from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.verify.compare import compare_mapping
from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec, dynamodb_client
from ddb2bt.pipeline.control.phases import Migration
from tests.conftest import ROOT, ready_but_for_the_tail, write_mapping
from ddb2bt.transforms.attrs import item_to_dynamodb_json
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.model import DeleteCells, SetCell

pytestmark = pytest.mark.e2e
BATCH = 25  # BatchWriteItem's limit


def setup(tmp_path, unique, base="product_catalog.yaml"):
    names = {"product_catalog.yaml": ("Catalog", "catalog"), "videos.yaml": ("Vids", "vids")}[base]
    path = write_mapping(tmp_path, base, source__table=f"{names[0]}_{unique}", target__table=f"{names[1]}_{unique}",
                         name=f"{names[1]}_{unique}")
    mapping = load_mapping(path)
    ddb = dynamodb_client()
    workload.create_table(ddb, mapping.source.table)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    return path, mapping, ddb


def preload(ddb, table, n, seed=1):
    rng = random.Random(seed)
    items = [workload.random_item(rng, workload.product_key(rng, 10**6) | {}) for _ in range(n)]
    unique = {(i["pk"]["S"], i["sk"]["S"]): i for i in items}
    batch = []
    for it in unique.values():
        batch.append({"PutRequest": {"Item": it}})
        if len(batch) == BATCH:
            ddb.batch_write_item(RequestItems={table: batch})
            batch = []
    if batch:
        ddb.batch_write_item(RequestItems={table: batch})
    return list(unique.values())


def random_changes(ddb, table, items, count, seed, stop=None):
    """Updates, deletes, re-inserts and attribute removals on existing keys."""
    rng = random.Random(seed)
    keys = [{"pk": i["pk"], "sk": i["sk"]} for i in items]
    for n in range(count):
        if stop is not None and stop.is_set():
            return n
        key = rng.choice(keys)
        roll = rng.random()
        if roll < 0.3:
            op = workload.Op("update", key, set_attrs={"Price": {"N": str(rng.randint(1, 999))},
                                                       "Stock": {"N": str(rng.randint(0, 9))}})
        elif roll < 0.5:
            op = workload.Op("remove_attrs", key, remove_attrs=("Thumbnail", "Stock"))
        elif roll < 0.75:
            op = workload.Op("delete", key)
        else:
            op = workload.Op("put", key, item=workload.random_item(rng, key))
        workload.apply_quietly(ddb, table, op)
    return count


def identical(mapping, ddb):
    items = workload.scan_all(ddb, mapping.source.table)
    t = mapping.target
    diffs = compare_mapping(mapping, items, lambda table: read_table(t.project, t.instance, table))
    return all(d.identical for d in diffs.values()), {k: d.summary() for k, d in diffs.items()}


def assert_target_is_exactly_the_mapping(mapping, ddb):
    """A raw ReadRows of every target table (all families, all versions) equals
    the mapping applied to a Scan of the source, row for row and cell for cell:
    no family of ours or anyone else's, no row without an owned cell."""
    from ddb2bt.pipeline.verify.compare import diff_layout, expected_layout

    items = workload.scan_all(ddb, mapping.source.table)
    clashes: list = []
    expected = expected_layout(mapping, items, clashes=clashes)
    assert clashes == []
    t = mapping.target
    for table in mapping.tables:
        raw = read_table(t.project, t.instance, table)
        families = {f for cols in raw.values() for f, _ in cols}
        assert families <= set(mapping.family_names), f"foreign families in {table}: {families}"
        assert set(raw) == set(expected[table]), "rows differ (a phantom row, or a missing one)"
        for key, cols in raw.items():
            assert set(cols) == set(expected[table][key]), key
        diff = diff_layout(expected[table], raw)
        assert diff.identical, diff.summary()


def store_of(mapping):
    return StateSpec(BigtableSpec(mapping.target.project, mapping.target.instance), job=mapping.name).store()


@pytest.mark.slow
def test_migrate_under_a_concurrent_writer_then_verify(stack, tmp_path, unique, capsys):
    path, mapping, ddb = setup(tmp_path, unique)
    items = preload(ddb, mapping.source.table, 5200)
    assert len(items) > 5000
    stop = threading.Event()
    changes = []
    writer = threading.Thread(target=lambda: changes.append(
        random_changes(ddb, mapping.source.table, items, 1500, seed=2, stop=stop)), daemon=True)
    writer.start()
    try:
        assert ddb2bt(["migrate", "--mapping", str(path), "--segments", "4", "--until-idle", "2",
                       "--poll-interval", "0.2"]) == 0
    finally:
        writer.join()
    assert changes[0] == 1500
    # the writer may have finished after the tail's last look: one catch-up run
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", "--poll-interval", "0.2"]) == 0
    # The independent check, reading Bigtable directly: exactly the mapping, and
    # nothing of ours left (no touch marker, no row holding only markers).
    assert_target_is_exactly_the_mapping(mapping, ddb)
    capsys.readouterr()
    report = tmp_path / "verify.json"
    assert ddb2bt(["verify", "--mapping", str(path), "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["identical"] and data["items"] == len(workload.scan_all(ddb, mapping.source.table))
    assert Migration(store_of(mapping)).phase == "LIVE"
    capsys.readouterr()
    assert ddb2bt(["status", "--mapping", str(path)]) == 1  # the migrate ended: no tail runs
    out = capsys.readouterr().out
    assert "phase: LIVE" in out and ready_but_for_the_tail(out) and "4/4 parts done" in out, out
    assert "bookkeeping in the target: none" in out
    _planted_cells_are_differences(path, mapping, capsys)


def _planted_cells_are_differences(path, mapping, capsys):
    """verify exits non-zero with one planted phantom row (a row holding only a
    touch marker, as a migration that never finished would leave) and,
    separately, one planted foreign cell; status is NOT READY while the marker
    family exists."""
    from ddb2bt.pipeline.control.markers import Bookkeeping
    from ddb2bt.pipeline.clients.bigtable.admin import BigtableAdmin
    from ddb2bt.transforms.config import FamilyConfig
    from ddb2bt.transforms.mapping import MARKER_FAMILY

    t = mapping.target
    bookkeeping = Bookkeeping.for_target(t.project, t.instance)
    writer = GrpcMutationWriter(t.project, t.instance)
    ts = 4_000_000_000_000
    bookkeeping.ensure([t.table])
    writer.mutate_rows(t.table, [(b"zz#deleted-item", [SetCell(MARKER_FAMILY, b't#{"pk":"zz"}', b"", ts)])])
    capsys.readouterr()
    report = path.parent / "phantom.json"
    assert ddb2bt(["verify", "--mapping", str(path), "--report", str(report)]) == 1
    counts = {k: v["count"] for k, v in json.loads(report.read_text())["tables"][t.table].items()}
    assert counts["extra_rows"] == 1 and counts["extra_cells"] == 0, counts
    assert ddb2bt(["status", "--mapping", str(path)]) == 1
    assert "bookkeeping cells may remain" in capsys.readouterr().out
    bookkeeping.drop([t.table])
    assert read_rows(t.project, t.instance, t.table, [b"zz#deleted-item"]) == {}, "the drop took the phantom row"
    # a foreign cell in an item's row
    BigtableAdmin(t.project, t.instance).add_family(t.table, FamilyConfig("foreign", max_versions=1))
    key = sorted(read_table(t.project, t.instance, t.table))[0]
    writer.mutate_rows(t.table, [(key, [SetCell("foreign", b"x", b"not the mapping's", ts)])])
    assert ddb2bt(["verify", "--mapping", str(path), "--report", str(report)]) == 1
    counts = {k: v["count"] for k, v in json.loads(report.read_text())["tables"][t.table].items()}
    assert counts["extra_cells"] == 1 and counts["extra_rows"] == 0, counts
    writer.close()


def _wait(predicate, timeout=120, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _spawn(args):
    return subprocess.Popen([sys.executable, "-m", "ddb2bt.pipeline.app.cli", *args], cwd=ROOT, env=dict(os.environ),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _kill(proc):
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_crash_during_backfill_and_during_tail_still_converges(stack, tmp_path, unique):
    path, mapping, ddb = setup(tmp_path, unique)
    items = preload(ddb, mapping.source.table, 3000, seed=3)
    store = store_of(mapping)
    # 1. killed in the middle of the backfill (a page budget slows it down enough to catch it:
    # moto charges 1 RCU a page, so 2 RCU/s is 80 items/s, ~37 s for the 3,000 items, ample
    # time for the 200 changes below even on a loaded machine)
    proc = _spawn(["migrate", "--mapping", str(path), "--segments", "4", "--max-rcu", "2", "--page-size", "40",
                   "--poll-interval", "0.2"])
    _wait(lambda: any(p.count for p in store.load_backfill_progress().values()), what="backfill progress")
    random_changes(ddb, mapping.source.table, items, 200, seed=4)
    _kill(proc)
    progress = store.load_backfill_progress()
    assert not all(p.done for p in progress.values()), "the crash should hit the backfill mid-way"
    assert Migration(store).phase == "BACKFILLING"
    handoff = Migration(store).handoff_ms
    # 2. restarted: resumes the same backfill (same handoff), then killed during the tail
    proc = _spawn(["migrate", "--mapping", str(path), "--segments", "4", "--max-rcu", "4", "--page-size", "40",
                   "--poll-interval", "0.2"])
    _wait(lambda: Migration(store).phase in ("CATCHING_UP", "LIVE"), what="the end of the backfill")
    assert Migration(store).handoff_ms == handoff
    arn = ddb.describe_table(TableName=mapping.source.table)["Table"]["LatestStreamArn"]
    before = store.load_checkpoints(arn)
    random_changes(ddb, mapping.source.table, items, 200, seed=5)
    # killed once the tail has checkpointed some of these changes (a condition, not a fixed wait)
    _wait(lambda: store.load_checkpoints(arn) != before, what="the tail to checkpoint the new changes")
    _kill(proc)
    # 3. restarted once more: tail only, until idle
    assert ddb2bt(["migrate", "--mapping", str(path), "--segments", "4", "--max-rcu", "4", "--page-size", "40",
                   "--until-idle", "1.5", "--poll-interval", "0.2"]) == 0
    ok, summary = identical(mapping, ddb)
    assert ok, summary
    assert ddb2bt(["verify", "--mapping", str(path)]) == 0


def test_verify_detects_each_kind_of_divergence(stack, tmp_path, unique, capsys):
    path, mapping, ddb = setup(tmp_path, unique)
    preload(ddb, mapping.source.table, 60, seed=6)
    assert ddb2bt(["migrate", "--mapping", str(path), "--segments", "2", "--until-idle", "1",
                   "--poll-interval", "0.2"]) == 0
    assert ddb2bt(["verify", "--mapping", str(path)]) == 0
    t = mapping.target
    rows = read_table(t.project, t.instance, t.table)
    keys = sorted(rows)
    writer = GrpcMutationWriter(t.project, t.instance)
    ts = 4_000_000_000_000
    writer.mutate_rows(t.table, [
        (keys[0], [DeleteCells(f, q, 0, ts) for (f, q) in rows[keys[0]]]),            # missing row
        (b"zz#not-an-item", [SetCell("SKU", b"Price", b"\x00" * 8, ts)]),            # extra row
        (keys[1], [DeleteCells("SKU", b"Price", 0, ts)]),                             # missing cell
        (keys[2], [SetCell("SKU", b"Orphan", b"left behind", ts)]),                   # orphan cell
        (keys[3], [SetCell("SKU", b"Description", b"tampered", ts)]),                 # different cell
    ])
    capsys.readouterr()
    report = tmp_path / "report.json"
    assert ddb2bt(["verify", "--mapping", str(path), "--report", str(report)]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT" in out and "tampered" not in out  # values redacted by default
    counts = {k: v["count"] for k, v in json.loads(report.read_text())["tables"][t.table].items()}
    assert counts["missing_rows"] == 1 and counts["extra_rows"] == 1 and counts["missing_cells"] == 1
    assert counts["extra_cells"] == 1 and counts["different_cells"] == 1
    assert ddb2bt(["verify", "--mapping", str(path), "--show-values"]) == 1
    assert "tampered" in capsys.readouterr().out
    assert ddb2bt(["status", "--mapping", str(path)]) == 1
    assert "the last verify found differences" in capsys.readouterr().out
    # a sampled verify checks the sampled rows (by row-key hash): it finds the
    # differences of exactly those (the extra row is not seen by a sample)
    from ddb2bt.pipeline.verify.verify import row_sampled

    tampered = [k for k in keys[:4] if row_sampled(t.table, k, 0.5)]
    assert ddb2bt(["verify", "--mapping", str(path), "--sample-rate", "0.5"]) == (1 if tampered else 0)


def write_export(root, items, export_time, table):
    """A DynamoDB export in the real layout (moto writes no manifests)."""
    data = root / "data"
    data.mkdir(parents=True)
    files = []
    for n in range(3):
        chunk = items[n::3]
        name = f"data/{n:04d}abcd.json.gz"
        with gzip.open(root / name, "wt", encoding="utf-8") as fh:
            for it in chunk:
                fh.write(json.dumps({"Item": item_to_dynamodb_json(it)}) + "\n")
        files.append({"itemCount": len(chunk), "md5Checksum": "x", "etag": "y",
                      "dataFileS3Key": f"AWSDynamoDB/01700000000000-abcd/{name}"})
    (root / "manifest-files.json").write_text("\n".join(json.dumps(f) for f in files) + "\n")
    (root / "manifest-summary.json").write_text(json.dumps({
        "version": "2020-06-30", "exportTime": export_time, "itemCount": len(items), "exportType": "FULL_EXPORT",
        "tableArn": f"arn:aws:dynamodb:us-east-1:123456789012:table/{table}",
        "outputFormat": "DYNAMODB_JSON", "manifestFilesS3Key": "AWSDynamoDB/01700000000000-abcd/manifest-files.json"}))


def test_backfill_from_a_local_and_an_s3_export(stack, tmp_path, unique):
    import boto3

    path, mapping, ddb = setup(tmp_path, unique)
    items = preload(ddb, mapping.source.table, 400, seed=7)
    # The export time in a later whole second than every preload write: the
    # backfill's cells (at that second - 1 ms) are then newer than the tail's
    # replay of each preload INSERT, so an unchanged item reads as the export
    # holds it, on every run (with both in one second the replay, 1 ms newer,
    # wins; how many items fell before the boundary used to depend on the load).
    time.sleep(1.0 - time.time() % 1.0)
    export_time = dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z")
    # What an export holds: the items as DynamoDB stores them, read back, not as
    # they were sent. DynamoDB normalises numbers (a Rating sent as "2.0" is
    # stored, streamed and exported as "2"); an export written from the sent
    # items backfilled "2.0", which no stream change after the export replaced.
    exported = workload.scan_all(ddb, mapping.source.table)
    time.sleep(1.1)  # changes after the export time, which the tail applies
    random_changes(ddb, mapping.source.table, items, 100, seed=8)
    export = tmp_path / "export"
    write_export(export, exported, export_time, mapping.source.table)
    assert ddb2bt(["backfill", "--mapping", str(path), "--from-export", str(export)]) == 0
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", "--poll-interval", "0.2"]) == 0
    ok, summary = identical(mapping, ddb)
    assert ok, summary
    # the same export from S3, into a fresh target
    s3 = boto3.client("s3")
    bucket = f"exports-{unique}"
    s3.create_bucket(Bucket=bucket)
    for f in sorted(export.rglob("*")):
        if f.is_file():
            s3.upload_file(str(f), bucket, f"AWSDynamoDB/x/{f.relative_to(export)}")
    path2 = write_mapping(tmp_path, source__table=mapping.source.table, target__table=f"s3copy_{unique}",
                          name=f"s3copy_{unique}")
    assert ddb2bt(["create-table", "--mapping", str(path2)]) == 0
    assert ddb2bt(["backfill", "--mapping", str(path2), "--from-export", f"s3://{bucket}/AWSDynamoDB/x"]) == 0
    assert ddb2bt(["run", "--mapping", str(path2), "--until-idle", "1", "--poll-interval", "0.2"]) == 0
    ok, summary = identical(load_mapping(path2), ddb)
    assert ok, summary


def test_an_export_older_than_the_stream_retention_is_refused(stack, tmp_path, unique, capsys):
    path, mapping, ddb = setup(tmp_path, unique)
    old = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=30)).isoformat()
    write_export(tmp_path / "old", [], old, mapping.source.table)
    assert ddb2bt(["backfill", "--mapping", str(path), "--from-export", str(tmp_path / "old")]) == 2
    assert "Take a new export" in capsys.readouterr().err


def test_versioned_columns_survive_the_overlap(stack, tmp_path, unique):
    """Comments (cells timestamped by CreatedAt) deleted or edited while the backfill
    runs are never resurrected by a late backfill write."""
    from tests.unit.transforms.test_examples import item

    path = write_mapping(tmp_path, "videos.yaml", source__table=f"Vids_{unique}", target__table=f"vids_{unique}",
                         name=f"vids_{unique}")
    mapping = load_mapping(path)
    ddb = dynamodb_client()
    workload.create_table(ddb, mapping.source.table)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    table = mapping.source.table
    comments = []
    for v in range(40):
        pk = f"{v:04d}"
        ddb.put_item(TableName=table, Item=item(pk=pk, sk="Video", UploadDate="2023-09-10T15:21:48",
                                                Formats={"480": f"https://s/{pk}"}))
        ddb.put_item(TableName=table, Item=item(pk=pk, sk="VideoStatsLikes", Count=v))
        for c in range(5):
            it = item(pk=pk, sk=f"VideoComment#{c}", Content=f"comment {c}",
                      CreatedAt=f"2023-09-1{c}T10:00:{v:02d}")
            ddb.put_item(TableName=table, Item=it)
            comments.append(it)
    rng = random.Random(9)
    stop = threading.Event()
    store = store_of(mapping)

    def churn():
        # Churn while the backfill runs (and a little before), then stop so the
        # tail can go idle and migrate can finish.
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            if Migration(store).phase in ("CATCHING_UP", "LIVE"):
                return
            c = rng.choice(comments)
            key = {"pk": c["pk"], "sk": c["sk"]}
            if rng.random() < 0.5:
                ddb.delete_item(TableName=table, Key=key)
            else:
                ddb.put_item(TableName=table, Item=dict(c, Content={"S": f"edited {rng.random()}"}))
            time.sleep(0.01)

    writer = threading.Thread(target=churn, daemon=True)
    writer.start()
    try:
        assert ddb2bt(["migrate", "--mapping", str(path), "--segments", "3", "--page-size", "10", "--max-rcu", "20",
                       "--until-idle", "1", "--poll-interval", "0.2"]) == 0
    finally:
        stop.set()
        writer.join()
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", "--poll-interval", "0.2"]) == 0
    ok, summary = identical(mapping, ddb)
    assert ok, summary
    assert ddb2bt(["verify", "--mapping", str(path)]) == 0


def test_a_running_tail_marks_touches_once_a_separate_backfill_begins(stack, tmp_path, unique):
    """`ddb2bt backfill` next to a running `ddb2bt run` (not `migrate`): the tail
    sees the phase and marks the items it writes, so the backfill's guards work."""
    from ddb2bt.pipeline.control.markers import Bookkeeping
    from ddb2bt.transforms.mapping import MARKER_FAMILY

    path, mapping, ddb = setup(tmp_path, unique)
    table = mapping.source.table

    def put(sk):
        ddb.put_item(TableName=table, Item={"pk": {"S": "hats"}, "sk": {"S": sk}, "Price": {"N": "1"}})

    def row(sk):
        rows = read_table(mapping.target.project, mapping.target.instance, mapping.target.table)
        return rows.get(f"hats#{sk}".encode())

    tail = _spawn(["run", "--mapping", str(path), "--poll-interval", "0.1"])
    try:
        put("before")
        _wait(lambda: row("before") is not None, what="the tail to replicate")
        assert not any(f == MARKER_FAMILY for f, _ in row("before")), "no backfill yet: no markers"
        Migration(store_of(mapping), sleep=lambda s: None).begin_backfill(
            {"kind": "scan", "segments": 1}, Bookkeeping.for_target(mapping.target.project, mapping.target.instance),
            mapping.tables)
        # The tail re-reads the phase every PHASE_CACHE_S: probes until one is written
        # marked (a condition with a deadline, not a fixed wait for the tail process).
        probes = iter(range(10**6))

        def a_probe_is_marked():
            sk = f"probe-{next(probes)}"
            put(sk)
            _wait(lambda: row(sk) is not None, what="the tail to replicate a probe")
            return any(f == MARKER_FAMILY for f, _ in row(sk))

        _wait(a_probe_is_marked, what="the tail to see the backfill's phase")
        put("during")
        _wait(lambda: row("during") is not None, what="the tail to replicate")
        assert any(f == MARKER_FAMILY for f, _ in row("during")), "the tail must mark while a backfill runs"
        # The separate backfill command finishes like migrate: once it is done, the
        # marker family is gone from the target, with every row that held only markers.
        ddb.delete_item(TableName=table, Key={"pk": {"S": "hats"}, "sk": {"S": "during"}})
        _wait(lambda: set(row("during") or {}) <= {(MARKER_FAMILY, q) for _, q in (row("during") or {})},
              what="the delete to replicate (a marker-only row left behind)")
        assert row("during"), "while backfilling, a deleted item leaves a row holding only its marker"
        assert ddb2bt(["backfill", "--mapping", str(path), "--segments", "1", "--restart"]) == 0
        rows = read_table(mapping.target.project, mapping.target.instance, mapping.target.table)
        assert not any(f == MARKER_FAMILY for cols in rows.values() for f, _ in cols), "markers left after finish"
        assert row("during") is None, "the marker-only row is gone"
        assert Bookkeeping.for_target(mapping.target.project, mapping.target.instance).remaining(mapping.tables) == []
        put("after")  # the tail goes on, unmarked, without a dead letter
        _wait(lambda: row("after") is not None, what="the tail to replicate after the finish")
        assert not any(f == MARKER_FAMILY for f, _ in row("after"))
        assert store_of(mapping).count_dead_letters() == 0
    finally:
        _kill(tail)
    assert ddb2bt(["verify", "--mapping", str(path)]) == 0


@pytest.mark.parametrize("values", ["--dlq-include-values", "--no-dlq-include-values"], ids=["images", "keys-only"])
def test_redrive_converges_to_the_current_item_and_never_resurrects(stack, tmp_path, unique, capsys, values):
    """Dead-lettered changes (a mapping that cannot encode Price 1.5 as int64)
    followed by changes the tail does apply: the item's REMOVE, or a MODIFY
    that removes an attribute. Once the mapping is fixed, `dlq redrive` leaves
    the item deleted and the attribute removed (re-applying the stored INSERT at
    its own time would bring both back: Bigtable keeps no tombstones). The same
    with Dataflow's default, letters without item values: the images are read
    back from the stream."""
    path, mapping, ddb = setup(tmp_path, unique)
    table = mapping.source.table

    def key(sk):
        return {"pk": {"S": "hats"}, "sk": {"S": sk}}

    ddb.put_item(TableName=table, Item=key("gone") | {"Price": {"N": "1.5"}, "Description": {"S": "old"}})
    ddb.delete_item(TableName=table, Key=key("gone"))
    ddb.put_item(TableName=table, Item=key("kept") | {"Price": {"N": "1.5"}, "Description": {"S": "old"},
                                                      "Thumbnail": {"S": "t.png"}})
    ddb.update_item(TableName=table, Key=key("kept"), UpdateExpression="SET Price = :p REMOVE Description",
                    ExpressionAttributeValues={":p": {"N": "2"}})
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", "--poll-interval", "0.2", values]) == 0
    store = store_of(mapping)
    assert sorted(e["reason"] for e in store.list_dead_letters()) == ["encoding", "encoding"]
    if values == "--no-dlq-include-values":
        # The item's values are nowhere in a letter. Its stream position is left out of the
        # check: the stream ARN's label is a time (…T10:00:01.512), which can read "1.5".
        for letter in store.list_dead_letters():
            record = json.loads(letter["record"])
            assert "newImage" not in record and "oldImage" not in record
            record.pop("position")
            assert "old" not in json.dumps(record) and "1.5" not in json.dumps(record)
    fixed = write_mapping(tmp_path, source__table=table, target__table=mapping.target.table, name=mapping.name,
                          rules__0__columns__Price__encoding="auto")
    capsys.readouterr()
    assert ddb2bt(["dlq", "redrive", "--mapping", str(fixed), "--dry-run"]) == 0
    assert "would resolve 2 dead letter(s) of 2 item(s)" in capsys.readouterr().out
    assert store.count_dead_letters() == 2
    assert ddb2bt(["dlq", "redrive", "--mapping", str(fixed)]) == 0
    assert "resolved 2 dead letter(s)" in capsys.readouterr().out
    assert store.count_dead_letters() == 0
    rows = read_table(mapping.target.project, mapping.target.instance, mapping.target.table)
    assert b"hats#gone" not in rows, "the deleted item stays deleted"
    assert ("SKU", b"Description") not in rows[b"hats#kept"], "the removed attribute stays removed"
    assert ddb2bt(["verify", "--mapping", str(fixed)]) == 0
    assert ddb2bt(["dlq", "redrive", "--mapping", str(fixed)]) == 0  # idempotent: nothing left


def test_version_clashes_are_refused_loudly_and_never_delete_the_other_comment(stack, tmp_path, unique, capsys):
    """Two comments on one video with the same CreatedAt map to one cell version:
    the later one is refused as a dead letter naming both keys (from the backfill
    and from the tail); verify reports the clash; deleting the refused comment
    keeps the other's text; redrive of the refused (now deleted) comments too."""
    from tests.unit.transforms.test_examples import item

    path, mapping, ddb = setup(tmp_path, unique, "videos.yaml")
    table = mapping.source.table
    ddb.put_item(TableName=table, Item=item(pk="0001", sk="Video", UploadDate="2023-09-10T15:21:48",
                                            Formats={"480": "https://s/1"}))
    same = "2023-09-12T10:00:07"
    for n in (1, 2):
        ddb.put_item(TableName=table, Item=item(pk="0001", sk=f"VideoComment#{n}", Content=f"text {n}",
                                                CreatedAt=same))
    assert ddb2bt(["migrate", "--mapping", str(path), "--segments", "2", "--until-idle", "1",
                   "--poll-interval", "0.2"]) == 0
    store = store_of(mapping)
    letters = store.list_dead_letters()
    # The stream holds the two puts too: the tail and the backfill each refuse
    # whichever comment came second to the version (the same one: first come).
    assert letters and {e["reason"] for e in letters} == {"version_clash"}
    assert all("VideoComment#1" in e["message"] and "VideoComment#2" in e["message"] for e in letters)
    refused_keys = {json.loads(e["record"])["keys"]["sk"]["S"] for e in letters}
    assert len(refused_keys) == 1
    refused = refused_keys.pop()
    stored = ({"VideoComment#1", "VideoComment#2"} - {refused}).pop()
    assert ddb2bt(["verify", "--mapping", str(path)]) == 1, "verify sees the collapse"
    # the tail refuses a third comment in the same second, too
    ddb.put_item(TableName=table, Item=item(pk="0001", sk="VideoComment#3", Content="text 3", CreatedAt=same))
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", "--poll-interval", "0.2"]) == 0
    assert {json.loads(e["record"])["keys"]["sk"]["S"] for e in store.list_dead_letters()} == {
        refused, "VideoComment#3"}

    def comment_texts():
        rows = read_table(mapping.target.project, mapping.target.instance, mapping.target.table)
        return [v for _, v in rows[b"0001"][("comments", b"UserComments")]]

    assert comment_texts() == [f"text {stored[-1]}".encode()]
    for sk in (refused, "VideoComment#3"):
        ddb.delete_item(TableName=table, Key={"pk": {"S": "0001"}, "sk": {"S": sk}})
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1", "--poll-interval", "0.2"]) == 0
    assert comment_texts() == [f"text {stored[-1]}".encode()], "deleting one comment kept the other's text"
    assert ddb2bt(["verify", "--mapping", str(path)]) == 0
    capsys.readouterr()
    assert ddb2bt(["dlq", "redrive", "--mapping", str(path)]) == 0
    assert "of 2 item(s)" in capsys.readouterr().out and store.count_dead_letters() == 0
    assert comment_texts() == [f"text {stored[-1]}".encode()], "a redrive of a deleted comment keeps the other"
    assert_target_is_exactly_the_mapping(mapping, ddb)
