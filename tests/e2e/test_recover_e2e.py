"""`ddb2bt recover` end to end: three jobs (product_catalog, videos with versioned
comments, hr_orders with index rows) replicate through the real Beam pipeline to
cbtemulator and stop; their tables (moto) keep changing for 30 hours — inserts,
modifies that remove attributes, deletes, re-inserts of deleted keys — and the
(fake, since moto cannot trim) stream then trims past the jobs' checkpoints. The
run now refuses, naming `ddb2bt recover`. The incremental exports of the missing
span are written from the change history as AWS writes them (published layout,
abutting windows from `plan_windows`; one job's from S3); `recover` applies them (one of them
crashes midway and is rerun) and the tail resumes from the stream's oldest
record. Each target then equals the mapping of a Scan of its table.

Fakes: the stream (trimming) and DescribeTable/DescribeContinuousBackups (PITR
and its exports do not exist in moto)."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import random

import pytest

from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec, dynamodb_client
from ddb2bt.pipeline.verify.compare import diff_layout, expected_layout
from ddb2bt.pipeline.recover.recover import RecoverOptions, iso, recover_job
from ddb2bt.pipeline.graph import LiveJob, make_pipeline
from ddb2bt.pipeline.io import ReplicateToBigtable
from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.connect.preflight import ensure_state_table
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.clients.bigtable.admin import ensure_mapping_table
from ddb2bt.pipeline.clients.bigtable.reads import read_table
from ddb2bt.pipeline.source.stream_source import ReaderOptions
from ddb2bt.pipeline.testing.fakes import FAKE_CLIENTS, FakeStreamsClient, RegisteredClient
from ddb2bt.transforms.attrs import from_plain, item_to_dynamodb_json
from ddb2bt.transforms.config import load_mapping
from tests.conftest import patch_everywhere, write_mapping

pytestmark = pytest.mark.e2e
HOUR_MS = 3_600_000
T0 = 1_700_000_000_000


def item(**kw):
    return {k: from_plain(v) for k, v in kw.items()}


def catalog(pk, sk, n):
    attrs = {"pk": pk, "sk": sk, "Price": n}
    if n % 2:
        attrs["Description"] = f"d{n}"  # removed by the next even version
    return item(**attrs)


def video(pk, sk, n):
    if sk == "Video":
        return item(pk=pk, sk=sk, UploadDate=f"2023-09-10T15:21:{n:02d}", Formats={"480": f"u{n}"})
    return item(pk=pk, sk=sk, Content=f"c{n}", CreatedAt=f"2023-09-1{sk[-1]}T00:00:{n:02d}")


def employee(pk, sk, n):
    attrs = {"PK": pk, "SK": sk, "Name": f"n{n % 4}", "Warehouse": f"w{n % 3}"}  # index rows move
    if n % 2:
        attrs["JobTitle"] = f"t{n}"
    return item(**attrs)


CASES = [  # example, key names, keys, item maker
    ("product_catalog.yaml", ("pk", "sk"), [("hats", "a#1"), ("hats", "b"), ("shoes", "a#1")], catalog),
    ("videos.yaml", ("pk", "sk"), [("0123", "Video"), ("0123", "VideoComment#1"), ("0123", "VideoComment#2")],
     video),
    ("hr_orders.yaml", ("PK", "SK"), [("HR-EMPLOYEE#1", "EMPLOYEE"), ("HR-EMPLOYEE#2", "EMPLOYEE")], employee),
]


class Source:
    """One table: moto holds the items, the fake stream their changes, the
    history what an incremental export is made from."""

    def __init__(self, mapping, names, ddb, make):
        self.mapping, self.names, self.ddb, self.make = mapping, names, ddb, make
        self.stream = FakeStreamsClient(table=mapping.source.table)
        self.stream.add_shard("shardId-1")
        self.history: list = []  # (ms, key, before, after)
        self.items: dict = {}

    def op(self, key, n, ms, delete=False):
        keys = item(**dict(zip(self.names, key)))
        before = self.items.get(key)
        after = None if delete else self.make(*key, n)
        if before is None and after is None:
            return
        if after is None:
            self.ddb.delete_item(TableName=self.mapping.source.table, Key=keys)
            self.items.pop(key)
            self.stream.put("shardId-1", "REMOVE", keys, None, before, created_ms=ms - ms % 1000)
        else:
            self.ddb.put_item(TableName=self.mapping.source.table, Item=after)
            self.items[key] = after
            self.stream.put("shardId-1", "MODIFY" if before else "INSERT", keys, after, before,
                            created_ms=ms - ms % 1000)
        self.history.append((ms, key, before, after))

    def state_at(self, ms) -> dict:
        state: dict = {}
        for t, key, _, after in self.history:
            if t < ms:
                state[key] = after
        return state

    def export(self, root, n, from_s, to_s) -> str:
        """The incremental export of [from_s, to_s) as AWS writes it: one line per item
        changed in the window, its images at the start and the end and its last write."""
        at_a, at_b = self.state_at(from_s * 1000), self.state_at(to_s * 1000)
        last = {k: t for t, k, _, _ in self.history if from_s * 1000 <= t < to_s * 1000}
        lines = []
        for k, t in sorted(last.items()):
            old, new = at_a.get(k), at_b.get(k)
            if old is None and new is None:
                continue
            line = {"Metadata": {"WriteTimestampMicros": {"N": str(t * 1000 + 123)}},
                    "Keys": item_to_dynamodb_json(item(**dict(zip(self.names, k))))}
            if new is not None:
                line["NewImage"] = item_to_dynamodb_json(new)
            if old is not None:
                line["OldImage"] = item_to_dynamodb_json(old)
            lines.append(json.dumps(line, default=str))
        export_id = f"0{to_s}000-{n:08x}"
        base = root / "AWSDynamoDB"
        (base / export_id).mkdir(parents=True)
        (base / "data").mkdir(exist_ok=True)
        (base / export_id / "_started").write_bytes(b"")
        buf = io.BytesIO()
        with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as f:
            f.write("".join(ln + "\n" for ln in lines).encode())
        name = f"{hashlib.md5(export_id.encode()).hexdigest()[:26]}.json.gz"
        (base / "data" / name).write_bytes(buf.getvalue())
        (base / export_id / "manifest-files.json").write_text(json.dumps(
            {"itemCount": len(lines), "md5Checksum": "", "etag": "", "dataFileS3Key": f"AWSDynamoDB/data/{name}"}))
        table_arn = self.stream.stream_arn.split("/stream/")[0]
        (base / export_id / "manifest-summary.json").write_text(json.dumps({
            "version": "2023-08-01", "exportArn": f"{table_arn}/export/{export_id}", "tableArn": table_arn,
            "itemCount": len(lines), "outputFormat": "DYNAMODB_JSON", "exportType": "INCREMENTAL_EXPORT",
            "exportFromTime": iso(from_s * 1000).replace("Z", ".000Z"),
            "exportToTime": iso(to_s * 1000).replace("Z", ".000Z"), "outputView": "NEW_AND_OLD_IMAGES"}))
        return str(base / export_id)


class DescribeShim:
    """DescribeTable (the fake stream's ARN) and DescribeContinuousBackups (PITR)."""

    def __init__(self, source: Source):
        self.source = source

    def describe_table(self, TableName):
        names = self.source.names
        return {"Table": {"TableName": TableName, "LatestStreamArn": self.source.stream.stream_arn,
                          "StreamSpecification": {"StreamEnabled": True, "StreamViewType": "NEW_AND_OLD_IMAGES"},
                          "KeySchema": [{"AttributeName": names[0], "KeyType": "HASH"},
                                        {"AttributeName": names[1], "KeyType": "RANGE"}], "ItemCount": 0}}

    def describe_continuous_backups(self, TableName):
        import datetime as dt

        return {"ContinuousBackupsDescription": {"PointInTimeRecoveryDescription": {
            "PointInTimeRecoveryStatus": "ENABLED",
            "EarliestRestorableDateTime": dt.datetime.fromtimestamp(T0 / 1000 - 3600, dt.timezone.utc)}}}


def state_spec(mapping):
    return StateSpec(BigtableSpec(mapping.target.project, mapping.target.instance), job=mapping.name)


def replicate(sources):
    jobs = []
    for s in sources:
        FAKE_CLIENTS[s.stream.table] = s.stream
        jobs.append(LiveJob(
            mapping=s.mapping, stream_arn=s.stream.stream_arn, partitions=1, state=state_spec(s.mapping),
            reader=ReaderOptions(until_idle_s=1.0, poll_interval_s=0.05, discovery_interval_s=0.2,
                                 retry=RetryPolicy(0.01, 0.05, 10.0)),
            client_factory=RegisteredClient(s.stream.table)))
    p = make_pipeline([])
    p | "ReplicateToBigtable" >> ReplicateToBigtable.from_jobs(jobs)
    p.run().wait_until_finish()


class Crash(Exception):
    pass


def test_recover_from_incremental_exports_converges_for_three_mappings(stack, tmp_path, unique, monkeypatch,
                                                                      capsys):
    ddb = dynamodb_client()
    sources = []
    for base, names, keys, make in CASES:
        path = write_mapping(tmp_path, base, source__table=f"Rec{unique}{base[:4]}", target__table=f"rec_{unique}_"
                             f"{base[:4]}", name=f"rec_{unique}_{base[:4]}")
        mapping = load_mapping(path)
        ddb.create_table(TableName=mapping.source.table, BillingMode="PAY_PER_REQUEST",
                         AttributeDefinitions=[{"AttributeName": n, "AttributeType": "S"} for n in names],
                         KeySchema=[{"AttributeName": names[0], "KeyType": "HASH"},
                                    {"AttributeName": names[1], "KeyType": "RANGE"}])
        ensure_mapping_table(mapping)
        ensure_state_table(mapping.target.project, mapping.target.instance, "ddb2bt_state")
        source = Source(mapping, names, ddb, make)
        source.keys, source.path = keys, str(path)
        sources.append(source)

    rng = random.Random(24)
    # 1. replicate a first hour of changes, then the jobs stop. The last key's last
    # applied change and a lost one share a second: the item straddles the stop
    # (its applied image owns cells, an index row and a comment version that
    # neither the window's old nor its new image owns: the boundary sweep's case,
    # docs/design.md §8.1.1).
    for s in sources:
        for i, key in enumerate(s.keys * 2):
            s.op(key, rng.randrange(60), T0 + i * 60_000)
        s.straddle_ms = T0 + len(s.keys) * 2 * 60_000
        s.op(s.keys[-1], 1, s.straddle_ms)
    replicate(sources)
    for s in sources:
        s.op(s.keys[-1], 2, s.straddle_ms + 400)  # same second, after the checkpoint: lost
    # 2. 60 hours of changes while stopped. The first 34 h (trimmed later) touch every
    # key: modifies removing attributes, deletes, re-inserts, the last key deleted at
    # the end; the last 22 h (still in the stream) touch only the first key.
    for s in sources:
        ms = T0 + 2 * HOUR_MS
        for i in range(12):
            key = s.keys[i % len(s.keys)]
            s.op(key, rng.randrange(60), ms, delete=(i % 5 == 3))
            ms += rng.choice([120, 150, 170]) * 60_000 + rng.randrange(1000)
        s.op(s.keys[-1], 0, T0 + 35 * HOUR_MS, delete=True)
        for i in range(4):
            s.op(s.keys[0], rng.randrange(60), T0 + (37 + 5 * i) * HOUR_MS + rng.randrange(1000))
    now = T0 + 60 * HOUR_MS
    # 3. the stream trims everything older than 24 hours
    for s in sources:
        shard = s.stream.shards["shardId-1"]
        shard.trimmed_before = sum(1 for r in shard.records
                                   if r["dynamodb"]["ApproximateCreationDateTime"].timestamp() * 1000 < now - 24 * HOUR_MS)
        assert 0 < shard.trimmed_before < len(shard.records)
    with pytest.raises(Exception) as err:
        replicate(sources[:1])
    assert "LOST" in str(err.value) and "ddb2bt recover" in str(err.value)

    # 4. through the CLI (first job): status says how to recover; recover prints the plan
    from ddb2bt.pipeline.connect import connections
    from ddb2bt.pipeline.app.cli import main as ddb2bt

    first = sources[0]
    # the CLI's modules bind these names at import (from-imports): patched where each is used
    patch_everywhere(monkeypatch, connections, "dynamodb_client", lambda region=None: DescribeShim(first))
    patch_everywhere(monkeypatch, connections, "StreamsClientFactory", lambda region=None: lambda: first.stream)
    capsys.readouterr()
    assert ddb2bt(["status", "-m", first.path]) == 1
    assert f"trimmed: recover with ddb2bt recover --mapping {first.path}" in capsys.readouterr().out
    assert ddb2bt(["recover", "-m", first.path, "--s3-bucket", "my-exports"]) == 0
    printed = capsys.readouterr().out
    assert "trimmed: 1 shard(s) lost changes" in printed
    assert "aws dynamodb export-table-to-point-in-time --table-arn" in printed and "--s3-bucket my-exports" in printed

    # 5. recover: the plan, the exports AWS would write for it, then apply (one crashes and reruns)
    for n, s in enumerate(sources):
        spec = state_spec(s.mapping)
        shim = DescribeShim(s)
        plan = recover_job(s.mapping, spec, RecoverOptions(s3_bucket="b"), streams_client=s.stream, dynamodb=shim,
                           now_ms=now)
        assert plan.gap is not None and plan.gap.trimmed_shards == ("shardId-1",) and plan.result is None
        assert plan.commands and all("--export-type INCREMENTAL_EXPORT" in c for c in plan.commands)
        exports = tuple(s.export(tmp_path / f"exports{n}", i, w.from_s, w.to_s) for i, w in enumerate(plan.windows))
        if n == 1:  # this job's exports from S3 (moto), as AWS leaves them: s3://bucket/AWSDynamoDB/...
            import boto3

            s3, bucket = boto3.client("s3"), f"recover-{unique}"
            s3.create_bucket(Bucket=bucket)
            for f in sorted((tmp_path / "exports1").rglob("*")):
                if f.is_file():
                    s3.upload_file(str(f), bucket, str(f.relative_to(tmp_path / "exports1")))
            exports = tuple(f"s3://{bucket}/" + e.split("/exports1/", 1)[1] for e in exports)
        options = RecoverOptions(exports=exports)
        # the data files up to the boundary: the window before the swept one (the
        # sweep's look-back, docs/design.md §8.1.1) and the swept one
        before = sum(1 for w in plan.windows if w.to_s <= plan.gap.boundary_s)
        if n == 0:  # crash at the first write after the window before the boundary was finished
            finished = []

            def fence():
                if len(finished) >= before:
                    raise Crash()
            with pytest.raises(Crash):
                recover_job(s.mapping, spec, options, streams_client=s.stream, dynamodb=shim, now_ms=now,
                            fence=fence, progress=lambda done, total: finished.append(done) if done else None)
        if n == 0:  # the rerun through the CLI: lease held, progress bar, resumed after the finished file
            args = ["recover", "-m", s.path] + [a for e in exports for a in ("--from-export", e)]
            assert ddb2bt(args) == 0
            out, err = capsys.readouterr()
            assert f"({before} done before a restart), 0 dead letter(s)" in out, out
            assert "boundary sweep" in err and "row" in err, err  # its progress bar
            # the crash hit the sweep's first delete (after the window before the
            # boundary): the rerun sweeps, and deletes what the lost change removed
            swept = out.split("boundary sweep (docs/recover.md): ", 1)[1].split(",")
            assert swept[0] == "1 window(s)" and int(swept[2].split()[0]) >= 1, out
            continue
        done = recover_job(s.mapping, spec, options, streams_client=s.stream, dynamodb=shim, now_ms=now)
        assert done.result is not None and done.result.dead_letters == 0

    # 6. the tail resumes at the oldest record the stream holds
    replicate(sources)
    for s in sources:
        items = workload.scan_all(ddb, s.mapping.source.table)
        table = s.mapping.target.table
        actual = read_table(s.mapping.target.project, s.mapping.target.instance, table)
        diff = diff_layout(expected_layout(s.mapping, items)[table], actual)
        assert diff.identical, (s.mapping.name, diff.summary())


def test_what_the_sweep_reads_agrees_with_the_fake_on_the_emulator(stack, tmp_path, unique, monkeypatch):
    """What the boundary sweep reads, from cbtemulator and from the in-memory fake
    given the same writes: the cells of a time range, over a table read in
    several key ranges (as SampleRowKeys would split a large one); and the state
    rows stamped since a time."""
    from ddb2bt.pipeline.clients.bigtable import writer as bigtable_writer
    from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
    from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
    from ddb2bt.transforms.model import DeleteCells, SetCell

    path = write_mapping(tmp_path, "product_catalog.yaml", target__table=f"sweep_{unique}", name=f"sweep_{unique}")
    mapping = load_mapping(path)
    ensure_mapping_table(mapping)
    family = sorted(mapping.family_names)[0]
    entries = []
    for i in range(7):
        row = f"{'ab'[i % 2]}#{i}".encode()
        entries.append((row, [SetCell(family, b"q", b"v", T0 + i * 1000), SetCell(family, b"r", b"w", T0 - 5000),
                              SetCell(family, b"s", b"x", T0 + 9000)]))
    entries.append((b"b#gone", [SetCell(family, b"q", b"v", T0), DeleteCells(family, b"q", 0, 0)]))
    real = GrpcMutationWriter(mapping.target.project, mapping.target.instance)
    fake = InMemoryBigtable()
    try:
        assert all(s.ok for s in real.mutate_rows(mapping.target.table, entries))
        fake.mutate_rows(mapping.target.table, entries)
        want = list(fake.cells_between(mapping.target.table, T0 + 1000, T0 + 9000))
        assert len(want) == 6 and all(T0 + 1000 <= ts < T0 + 9000 and q == b"q" for _, _, q, ts in want), want
        assert list(real.cells_between(mapping.target.table, T0 + 1000, T0 + 9000)) == want
        # The emulator answers SampleRowKeys with one range: split it as a large table would be.
        monkeypatch.setattr(bigtable_writer, "table_ranges", lambda *a, **k: [(None, b"a#3"), (b"a#3", b"b#"),
                                                                          (b"b#", None)])
        assert list(real.cells_between(mapping.target.table, T0 + 1000, T0 + 9000)) == want
        since = list(fake.cells_between(mapping.target.table, T0 + 1000))  # no end: the sweep's scan
        assert len(since) == 13 and list(real.cells_between(mapping.target.table, T0 + 1000)) == since
    finally:
        real.close()
    # State rows stamped since a time (the version owners the sweep looks at).
    spec = StateSpec(BigtableSpec(mapping.target.project, mapping.target.instance), job=mapping.name)
    ensure_state_table(mapping.target.project, mapping.target.instance, spec.table)
    writer = spec.bigtable.writer()
    try:
        backend = spec.store(writer)._backend
        rows = [(f"{mapping.name}#ver#k{i}".encode(), [SetCell("meta", b"owner", b"o", T0 + i * 1000)])
                for i in range(4)]
        backend.write_rows(rows)
        fake.write_rows(rows)
        prefix = f"{mapping.name}#ver#".encode()
        got = backend.keys_written_since(prefix, T0 + 2000)
        assert got == fake.keys_written_since(prefix, T0 + 2000) == {
            f"{mapping.name}#ver#k2".encode(): T0 + 2000, f"{mapping.name}#ver#k3".encode(): T0 + 3000}
    finally:
        writer.close()


def test_recover_for_a_job_that_never_ran_here_says_so(stack, unique, capsys):
    """No state table: no checkpoint can be trimmed; said plainly, nothing taken
    or written (not a NOT_FOUND from the lease's first read)."""
    from ddb2bt.pipeline.app.cli import main as ddb2bt

    state = f"never_{unique}"
    assert ddb2bt(["recover", "-m", "example:product_catalog", "--state-table", state,
                   "--from-export", "/nonexistent"]) == 1
    err = capsys.readouterr().err
    assert "ddb2bt_state" not in err and f"/{state}: it never ran here, so nothing is trimmed" in err, err
