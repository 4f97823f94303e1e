"""ddb2bt benchmarks: throughput against what users would use instead, lag,
backfill speed and memory — one machine, one run, same emulator.

    .venv/bin/python bench/run.py            # quick mode (< 5 min)
    .venv/bin/python bench/run.py --full     # the larger sizes
    .venv/bin/python bench/run.py --sections throughput,memory,lag,backfill,scaling   # without tables, verify

Unit of work: replicate N stream records of a realistic item shape (~10
attributes, ~1 KB; 60 % inserts, 30 % modifies, 10 % removes) from the same
pre-generated stream pages (a fake stream client, so DynamoDB's emulator is not
the bottleneck) into the same running cbtemulator, each contestant into its own
fresh table. Contestants:

  handwritten  what a Lambda handler does: map each record, mutate_row per row
  beam_sink    FnApiRunner, map to DirectRow, apache_beam.io.gcp.bigtableio.WriteToBigTable
  bulk         the same mutations through the data client's bulk_mutate_rows, 1,000 per batch
  ddb2bt       the real pipeline: source SDF over the fake client, mapping, sink;
               twice: paced (5 GetRecords/s per shard, as enforced on AWS) and
               unpaced (the pacer taken away: the fake stream is not AWS, and
               paced the one shard's cap, not the CPU, sets the rate). Its CPU is
               counted from the job's start to the last change applied, the
               interval its rate is measured over
  ceiling      pre-built MutateRowsRequest protobufs through the raw gRPC call

Also: lag at a steady write rate, peak memory draining a backlog, backfill
speed, scaling with shards and item sizes, and one job of 1 table against one
job of 4 tables (bench/tables.py).

Reported: changes/s, CPU seconds per 1M changes (this process and the emulator
separately), ratios ddb2bt (paced, and unpaced) / each, the unpaced row against
issue 36's targets (<= 40 us client CPU per change, >= 0.40 of the ceiling's
rate) and, beside it, the unpaced CPU per change once the job's start is taken
out (priced by a run of START_CHANGES right after); the export backfill against
the unpaced live rate (and the paced one), with what an exported item costs this
process and the emulator and so how many cores the export would need to go at the
live rate (against the machine's); as a table and as JSON in bench/results/.
``--sections`` runs some of the sections.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import os
import platform
import random
import string
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from ddb2bt.pipeline.local.local_stack import LocalStack  # noqa: E402
from ddb2bt.transforms.config import load_mapping  # noqa: E402
from ddb2bt.transforms.limits import DEFAULT_POLL_INTERVAL_S  # noqa: E402
from ddb2bt.transforms.mapping import map_change  # noqa: E402
from ddb2bt.transforms.model import INSERT, MODIFY, REMOVE, ChangeRecord, SetCell  # noqa: E402

MAPPING = load_mapping(ROOT / "examples/product_catalog.yaml")
RESULTS = ROOT / "bench" / "results"
ITEM_BYTES = 1000
# Lag run: the reader polls Bigtable this often (part of the measured lag: a
# cheap keys-only range read, so it can be frequent), and rows are awaited this
# long at the end.
LAG_READ_POLL_S = 0.005
LAG_ROWS_END = b"lag#:"  # past every "lag#<digits>" key, before the sentinel's
# How often the throughput runs look whether every change was applied: often
# enough to add < 1 % to a 4 s run, rarely enough not to compete for the GIL.
DONE_POLL_S = 0.02
LAG_GRACE_S = 10.0


def make_item(rng: random.Random, key: dict, size: int = ITEM_BYTES) -> dict:
    item = dict(key)
    filler = size - 250
    item["Description"] = {"S": "".join(rng.choices(string.ascii_letters + " ", k=max(10, filler)))}
    item["Price"] = {"N": str(rng.randint(1, 100000))}
    item["Thumbnail"] = {"S": f"https://storage.example.com/{rng.randrange(10**9)}.png"}
    item["Stock"] = {"N": str(rng.randint(0, 500))}
    item["Brand"] = {"S": rng.choice(["brandA", "brandB", "brandC"])}
    item["Color"] = {"SS": ["red", "blue"]}
    item["Rating"] = {"N": f"{rng.randint(0, 4)}.{rng.randint(0, 9)}"}
    item["Active"] = {"BOOL": rng.random() < 0.9}
    return item


# The records' spacing: a change a millisecond, 1,000 changes a second.
RECORD_SPACING_MS = 1
MS_PER_S = 1000
US_PER_S = 1_000_000


def stream_records(n: int, seed: int = 1, keys: int = 5000, size: int = ITEM_BYTES,
                   whole_seconds: bool = True) -> list:
    """(event, keys, new, old, ts) tuples: 60 % inserts, 30 % modifies, 10 % removes,
    a change every RECORD_SPACING_MS. ``whole_seconds``: each change's time rounded
    down to its second, as DynamoDB Streams' ApproximateCreationDateTime is on AWS
    (docs/design.md §2: ministack rounds too, moto does not); off, each change has
    a millisecond of its own (a Kinesis record's time has microseconds)."""
    rng = random.Random(seed)
    state: dict = {}
    out = []
    now = 1_700_000_000_000
    for _ in range(n):
        k = rng.randrange(keys)
        key = {"pk": {"S": f"cat{k % 50:02d}"}, "sk": {"S": f"item#{k:06d}"}}
        old = state.get(k)
        roll = rng.random()
        now += RECORD_SPACING_MS
        ts = now - now % MS_PER_S if whole_seconds else now
        if old is not None and roll < 0.1:
            del state[k]
            out.append((REMOVE, key, None, old, ts))
        elif old is not None and roll < 0.45:
            new = dict(old, Price={"N": str(rng.randint(1, 100000))})
            state[k] = new
            out.append((MODIFY, key, new, old, ts))
        else:
            new = make_item(rng, key, size)
            state[k] = new
            out.append((MODIFY if old else INSERT, key, new, old, ts))
    return out


def settle() -> None:
    """Move the harness's own data (pre-generated records, the fake stream's
    pages) out of the cyclic garbage collector's view. Without it every
    contestant pays for the collector re-scanning a million benchmark objects
    (~25 % of a run's CPU) — an artifact of holding the source in memory, which a
    real stream does not do. The same for every contestant."""
    gc.collect()
    gc.freeze()


class Meter:
    """Wall time, this process's CPU and the emulator's CPU over a block."""

    def __init__(self, emulator_pid: int) -> None:
        self._emu = psutil.Process(emulator_pid)

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.cpu0 = time.process_time()
        t = self._emu.cpu_times()
        self.emu0 = t.user + t.system
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.cpu0
        t = self._emu.cpu_times()
        self.emu = t.user + t.system - self.emu0


def fresh_table(project: str, instance: str) -> str:
    from ddb2bt.pipeline.clients.bigtable.admin import BigtableAdmin

    name = f"bench_{uuid.uuid4().hex[:8]}"
    BigtableAdmin(project, instance).ensure_table(name, MAPPING.table_families()[MAPPING.target.table])
    return name


def mapped(records: list, table: str) -> list:
    """The RowChanges of every record, mapped once (for the non-pipeline contestants
    mapping is timed inside them; this is only used by the ceiling)."""
    out = []
    for event, keys, new, old, ts in records:
        rec = ChangeRecord(event, keys, new, old, ts)
        for ch in map_change(MAPPING, rec):
            out.append((ch.row_key, ch.mutations))
    return out


def to_client_mutations(mutations) -> list:
    from google.cloud.bigtable.data import DeleteRangeFromColumn
    from google.cloud.bigtable.data import SetCell as CSetCell

    out = []
    for m in mutations:
        if isinstance(m, SetCell):
            out.append(CSetCell(m.family, m.qualifier, m.value, m.timestamp_ms * 1000))
        else:
            out.append(DeleteRangeFromColumn(m.family, m.qualifier, m.start_ms * 1000, m.end_ms * 1000))
    return out


def run_handwritten(records, project, instance, table) -> None:
    from google.cloud.bigtable.data import BigtableDataClient

    with BigtableDataClient(project=project) as client, client.get_table(instance, table) as t:
        for event, keys, new, old, ts in records:
            for ch in map_change(MAPPING, ChangeRecord(event, keys, new, old, ts)):
                t.mutate_row(ch.row_key, to_client_mutations(ch.mutations))


def run_bulk(records, project, instance, table) -> None:
    from google.cloud.bigtable.data import BigtableDataClient, RowMutationEntry

    batch = []
    with BigtableDataClient(project=project) as client, client.get_table(instance, table) as t:
        for event, keys, new, old, ts in records:
            for ch in map_change(MAPPING, ChangeRecord(event, keys, new, old, ts)):
                batch.append(RowMutationEntry(ch.row_key, to_client_mutations(ch.mutations)))
            if len(batch) >= 1000:
                t.bulk_mutate_rows(batch)
                batch = []
        if batch:
            t.bulk_mutate_rows(batch)


def run_beam_sink(records, project, instance, table) -> None:
    import apache_beam as beam
    from apache_beam.io.gcp.bigtableio import WriteToBigTable
    from apache_beam.options.pipeline_options import PipelineOptions
    from google.cloud.bigtable.row import DirectRow
    from google.cloud.bigtable.row_filters import TimestampRange

    from ddb2bt.pipeline.graph import local_runner

    def to_rows(rec):
        event, keys, new, old, ts = rec
        for ch in map_change(MAPPING, ChangeRecord(event, keys, new, old, ts)):
            row = DirectRow(ch.row_key)
            for m in ch.mutations:
                if isinstance(m, SetCell):
                    row.set_cell(m.family, m.qualifier, m.value,
                                 timestamp=dt.datetime.fromtimestamp(m.timestamp_ms / 1000, dt.timezone.utc))
                else:
                    row.delete_cell(m.family, m.qualifier, time_range=TimestampRange(
                        start=dt.datetime.fromtimestamp(m.start_ms / 1000, dt.timezone.utc),
                        end=dt.datetime.fromtimestamp(m.end_ms / 1000, dt.timezone.utc)))
            yield row

    options = PipelineOptions(["--direct_num_workers=1"])
    with beam.Pipeline(runner=local_runner(), options=options) as p:
        (p | beam.Create(records) | beam.FlatMap(to_rows)
         | WriteToBigTable(project_id=project, instance_id=instance, table_id=table))


def run_ddb2bt(records, project, instance, table, partitions: int = 1, shards: int = 0) -> float:
    """Returns the wall time until every record was applied (the idle wait at the
    end, which only exists to stop a local run, is excluded). ``shards``: the
    stream's shards (default: one per partition)."""

    from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec
    from ddb2bt.pipeline.testing.fakes import FAKE_CLIENTS, FakeStreamsClient, RegisteredClient
    from ddb2bt.pipeline.graph import LiveJob
    from ddb2bt.pipeline.connect.preflight import ensure_state_table
    from ddb2bt.pipeline.source.stream_source import ReaderOptions

    client = FakeStreamsClient(table=f"B{uuid.uuid4().hex[:6]}")
    shards = [f"shardId-{i:04d}" for i in range(shards or partitions)]
    for s in shards:
        client.add_shard(s)
    for i, (event, keys, new, old, ts) in enumerate(records):
        shard = shards[hash(keys["sk"]["S"]) % len(shards)]
        client.put(shard, event, keys, new, old, created_ms=ts)
    FAKE_CLIENTS[client.table] = client
    settle()
    ensure_state_table(project, instance, "ddb2bt_state")
    mapping = MAPPING.with_overrides(table=table)
    job = LiveJob(mapping=mapping, stream_arn=client.stream_arn,
                  reader=ReaderOptions(until_idle_s=0.5, poll_interval_s=0.05, discovery_interval_s=60),
                  state=StateSpec(BigtableSpec(project, instance), job=f"bench_{table}"),
                  partitions=partitions, client_factory=RegisteredClient(client.table))
    return run_live(job, len(records))


# The last run_live's wall and process CPU seconds over the same interval: from
# the job's start (pipeline construction included) to the last change applied.
# Around run_ddb2bt as a whole, a CPU meter would also charge the harness's own
# work to the replicator: filling the fake stream with the pre-generated records
# and the collector pass that freezes them (4.4-4.7 us per change unpaced, measured), and the
# idle wait after the last change, which only exists to stop a local run.
LAST_LIVE_RUN: dict = {}


class _NoPacer:
    """The pacer with AWS's limit taken away: for CPU figures only."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait(self, shard_id: str) -> None:
        pass

    def ready_in(self, shard_id: str, at_least_s: float = 0.0) -> float:
        return 0.0

    def forget(self, shard_id: str) -> None:
        pass

    def called_ago(self, shard_id: str, seconds: float) -> None:
        pass


class unpaced:
    """Within this block the live readers of this process have no pacer: the fake
    stream is not AWS, so its 5 GetRecords/s per shard only hide what the CPU does
    per change. Never in production code: the rows it measures say "unpaced"."""

    def __enter__(self):
        from ddb2bt.pipeline.source import stream_source

        self._paced = stream_source.ShardPacer
        stream_source.ShardPacer = _NoPacer
        return self

    def __exit__(self, *exc):
        from ddb2bt.pipeline.source import stream_source

        stream_source.ShardPacer = self._paced


def run_live(jobs, total: int) -> float:
    """Run the live pipeline of ``jobs`` (one LiveJob or several: one job) on the
    local runner; wall seconds until ``total`` changes were applied or skipped
    (the idle wait at the end, which only exists to stop a local run, excluded).
    The process CPU over the same interval lands in ``LAST_LIVE_RUN``."""
    from ddb2bt.pipeline.graph import add_live_replication

    LAST_LIVE_RUN.clear()  # a run that fails leaves no figures of the one before
    wall, cpu, _ = run_until_applied(lambda p: add_live_replication(p, jobs), total)
    LAST_LIVE_RUN.update(wall_s=wall, cpu_s=cpu, changes=total)
    return wall


def run_until_applied(build, total: int) -> tuple:
    """Build a pipeline (``build(p)``) and run it on the local runner: (wall
    seconds, this process's CPU seconds) from the job's start, its construction
    included, until ``total`` changes were applied or skipped, and whether that
    many were. What follows the last one is left out alike for every path: a live
    job's idle wait, and the local runner's end of a bundle and teardown (its
    state sampler alone joins a thread that wakes every 0.2 s, so a one-bundle
    backfill's wall time otherwise moved in steps of up to 0.2 s)."""
    from ddb2bt.pipeline.graph import make_pipeline
    from ddb2bt.pipeline.observe.metrics import default_metrics

    metrics = default_metrics()
    done_at = []

    def applied() -> float:
        return _total(metrics.changes_applied) + _total(metrics.changes_skipped)

    applied0 = applied()

    def watch():
        while not done_at:
            if applied() - applied0 >= total:
                done_at.append((time.perf_counter(), time.process_time()))
                return
            time.sleep(DONE_POLL_S)

    threading.Thread(target=watch, daemon=True).start()
    start, cpu0 = time.perf_counter(), time.process_time()
    p = make_pipeline([])
    build(p)
    p.run().wait_until_finish()
    end, cpu1 = time.perf_counter(), time.process_time()
    # The watcher looks every DONE_POLL_S: a job that ends within one look of its
    # last change has still applied them all (timed to the runner's end then).
    reached = bool(done_at) or applied() - applied0 >= total
    if done_at:
        end, cpu1 = done_at[0]
    done_at.append(None)  # the watcher may be between looks: this ends its loop
    return end - start, cpu1 - cpu0, reached


def _total(counter) -> float:
    from ddb2bt.pipeline.observe.metrics import counter_total

    return counter_total(counter)


def run_ceiling(requests, writer, table) -> None:
    for req in requests:
        for _ in writer._call(req, timeout=60):
            pass


def throughput(n: int, stack, project: str, instance: str) -> dict:
    from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
    from ddb2bt.pipeline.clients.bigtable.wire import build_request

    records = stream_records(n)
    settle()
    pid = stack.pids["bigtable"]
    out = {}

    def measure(name, fn, count=n, live=False):
        table = fresh_table(project, instance)
        with Meter(pid) as m:
            wall = fn(table)
        wall = wall if isinstance(wall, float) else m.wall
        # The live pipeline's CPU is taken over the same interval as its wall time
        # (LAST_LIVE_RUN); the others' whole call is the work measured.
        cpu = LAST_LIVE_RUN["cpu_s"] if live else m.cpu
        out[name] = {"label": LABELS[name], "changes": count, "seconds": round(wall, 3),
                     "changes_per_s": round(count / wall), "client_cpu_s_per_1M": round(cpu / count * 1e6, 1),
                     "emulator_cpu_s_per_1M": round(m.emu / count * 1e6, 1)}
        print(f"  {name:<14} {out[name]['changes_per_s']:>8,} changes/s, "
              f"{out[name]['client_cpu_s_per_1M']} client CPU us per change", flush=True)

    # the hand-written consumer is slow: measured on a quarter, figures per change
    q = n // 4
    measure("handwritten", lambda t: run_handwritten(records[:q], project, instance, t) or None, count=q)
    measure("beam_sink", lambda t: run_beam_sink(records, project, instance, t))
    measure("bulk", lambda t: run_bulk(records, project, instance, t))
    measure("ddb2bt", lambda t: run_ddb2bt(records, project, instance, t), live=True)
    with unpaced():
        measure("ddb2bt_unpaced", lambda t: run_ddb2bt(records, project, instance, t), live=True)
        # The same job on START_CHANGES only, right after: what the job's start
        # costs (Beam building and translating the graph, the DoFns' set-up),
        # so the row also says what a change costs once a job runs — a
        # continuous job's figure — beside the figure with the start spread
        # over this run's changes, which the target is read on.
        run_ddb2bt(records[:START_CHANGES], project, instance, fresh_table(project, instance))
        start_cpu = LAST_LIVE_RUN["cpu_s"]
        row = out["ddb2bt_unpaced"]
        row["start_cpu_s"] = round(start_cpu, 3)
        row["client_cpu_us_per_change_after_start"] = round(
            (row["client_cpu_s_per_1M"] * n / 1e6 - start_cpu) / (n - START_CHANGES) * 1e6, 1)
    writer = GrpcMutationWriter(project, instance)
    table = fresh_table(project, instance)
    entries = mapped(records, table)
    req_cls = writer._request_cls
    name = f"projects/{project}/instances/{instance}/tables/{table}"
    requests = [build_request(req_cls, name, None, entries[i:i + 1000]) for i in range(0, len(entries), 1000)]
    with Meter(pid) as m:
        run_ceiling(requests, writer, table)
    out["ceiling"] = {"label": LABELS["ceiling"], "changes": n, "seconds": round(m.wall, 3),
                      "changes_per_s": round(n / m.wall), "client_cpu_s_per_1M": round(m.cpu / n * 1e6, 1),
                      "emulator_cpu_s_per_1M": round(m.emu / n * 1e6, 1),
                      "note": "requests pre-built (not timed)"}
    print(f"  {'ceiling':<14} {out['ceiling']['changes_per_s']:>8,} changes/s")
    # Ratios of the same run: ddb2bt_ratio is the paced contestant's (the key's
    # meaning before the unpaced row existed), ddb2bt_unpaced_ratio the unpaced one's.
    paced, free = out["ddb2bt"]["changes_per_s"], out["ddb2bt_unpaced"]["changes_per_s"]
    for k, v in out.items():
        v["ddb2bt_ratio"] = round(paced / v["changes_per_s"], 2)
        v["ddb2bt_unpaced_ratio"] = round(free / v["changes_per_s"], 2)
    return out


# What each throughput row measures (also in the JSON, per row).
LABELS = {
    "handwritten": "hand-written consumer (map + mutate_row per row)",
    "beam_sink": "Beam's WriteToBigTable (FnApiRunner, DirectRow)",
    "bulk": "data client bulk_mutate_rows, 1,000 per batch",
    "ddb2bt": "ddb2bt, paced (5 GetRecords/s per shard, as on AWS)",
    "ddb2bt_unpaced": "ddb2bt, unpaced (pacer off: the fake stream is not AWS)",
    "ceiling": "ceiling: pre-built MutateRowsRequests, raw gRPC",
}
# The short run that prices a job's start (throughput's unpaced row): long
# enough to apply a page, short enough that its changes cost ~1 % of it.
START_CHANGES = 200
# Issue 36's targets for the unpaced row: CPU per change, and its rate against
# the raw-gRPC ceiling's in the same run.
TARGET_UNPACED_CPU_US = 40.0
TARGET_UNPACED_TO_CEILING = 0.40


def unpaced_summary(throughput_rows: dict) -> dict:
    """The unpaced row against issue 36's targets (one run's figures)."""
    row = throughput_rows["ddb2bt_unpaced"]
    cpu_us = row["client_cpu_s_per_1M"]  # s per 1M changes = us per change
    ratio = throughput_rows["ceiling"]["ddb2bt_unpaced_ratio"]
    return {"client_cpu_us_per_change": cpu_us, "target_cpu_us": TARGET_UNPACED_CPU_US,
            "cpu_met": cpu_us <= TARGET_UNPACED_CPU_US,
            # information, not the target's figure: the start taken out (see throughput())
            "client_cpu_us_per_change_after_start": row.get("client_cpu_us_per_change_after_start"),
            "start_cpu_s": row.get("start_cpu_s"), "to_ceiling": ratio,
            "target_to_ceiling": TARGET_UNPACED_TO_CEILING, "to_ceiling_met": ratio >= TARGET_UNPACED_TO_CEILING}


def memory_backlog(n: int, stack, project: str, instance: str) -> dict:
    """Peak RSS of a fresh process draining an n-change backlog."""
    import subprocess

    # Peak RSS from VmHWM: ru_maxrss survives exec on Linux and would report the
    # (large) bench parent's size at fork time instead of the drain's own peak.
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from bench.run import *; "
            f"from bench.run import _drain; _drain({n}, {project!r}, {instance!r}); "
            "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))")
    env = dict(os.environ)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    peak_kib = int(out.stdout.strip().splitlines()[-1])
    return {"changes": n, "peak_rss_mib": round(peak_kib / 1024), "seconds": round(time.perf_counter() - t0, 1)}


class LazyRecords:
    """A shard's records generated on demand (a sequence the fake client slices),
    so a million-change backlog costs no memory before the pipeline reads it —
    as with a real stream, where the backlog lives in DynamoDB."""

    def __init__(self, n: int, size: int) -> None:
        self._n = n
        self._size = size

    def __len__(self) -> int:
        return self._n

    def _make(self, i: int) -> dict:
        rng = random.Random(i)
        key = {"pk": {"S": f"cat{i % 50:02d}"}, "sk": {"S": f"item#{i % 200000:07d}"}}
        new = make_item(rng, key, self._size)
        ddb = {"Keys": key, "NewImage": new, "SequenceNumber": str(10**20 + i), "SizeBytes": self._size,
               "StreamViewType": "NEW_AND_OLD_IMAGES",
               "ApproximateCreationDateTime": dt.datetime.fromtimestamp(1_700_000_000 + i / 1000, dt.timezone.utc)}
        return {"eventID": str(i), "eventName": "INSERT", "dynamodb": ddb}

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._make(i) for i in range(*index.indices(self._n))]
        return self._make(index % self._n)


def _drain(n: int, project: str, instance: str) -> None:
    """Drain an n-change backlog through the real pipeline (lazily generated)."""
    from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec
    from ddb2bt.pipeline.testing.fakes import FAKE_CLIENTS, FakeStreamsClient, RegisteredClient
    from ddb2bt.pipeline.graph import LiveJob, add_live_replication, make_pipeline
    from ddb2bt.pipeline.connect.preflight import ensure_state_table
    from ddb2bt.pipeline.source.stream_source import ReaderOptions

    table = fresh_table(project, instance)
    client = FakeStreamsClient(table="Backlog")
    client.add_shard("shardId-0000").records = LazyRecords(n, 300)
    FAKE_CLIENTS[client.table] = client
    ensure_state_table(project, instance, "ddb2bt_state")
    job = LiveJob(mapping=MAPPING.with_overrides(table=table), stream_arn=client.stream_arn,
                  reader=ReaderOptions(until_idle_s=0.5, poll_interval_s=0.05, discovery_interval_s=60),
                  state=StateSpec(BigtableSpec(project, instance), job=f"drain_{table}"),
                  client_factory=RegisteredClient(client.table))
    p = make_pipeline([])
    add_live_replication(p, job)
    p.run().wait_until_finish()


def percentile(values: list, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def lag(seconds: float, rate: float, stack, project: str, instance: str) -> dict:
    """Source write → visible in Bigtable, with a writer at a steady rate into the
    moto-backed table and a reader polling Bigtable for the rows not yet seen
    (poll interval included). Writer and reader run in their own process
    (``_lag_probe``) so they do not share the pipeline's interpreter lock; the
    pipeline runs here and is stopped cleanly once the probe is done."""
    import subprocess

    from ddb2bt.pipeline.local import workload
    from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec, StreamsClientFactory, dynamodb_client
    from ddb2bt.pipeline.graph import LiveJob, add_live_replication, make_pipeline
    from ddb2bt.pipeline.connect.preflight import ensure_state_table
    from ddb2bt.pipeline.source.stream_source import ReaderOptions, request_stop

    name = f"Lag{uuid.uuid4().hex[:6]}"
    arn = workload.create_table(dynamodb_client(), name)
    table = fresh_table(project, instance)
    ensure_state_table(project, instance, "ddb2bt_state")
    token = f"lag-{uuid.uuid4().hex}"
    job = LiveJob(mapping=MAPPING.with_overrides(table=table), stream_arn=arn,
                  reader=ReaderOptions(discovery_interval_s=30, stop_token=token),  # the default poll interval
                  state=StateSpec(BigtableSpec(project, instance), job=f"lag_{table}"),
                  client_factory=StreamsClientFactory())
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from bench.run import _lag_probe; "
            f"_lag_probe({seconds!r}, {rate!r}, {name!r}, {project!r}, {instance!r}, {table!r})")
    probe = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    result: dict = {}

    def wait_probe():
        out, _ = probe.communicate()
        result.update(json.loads(out.strip().splitlines()[-1]) if probe.returncode == 0 else {})
        request_stop(token)

    waiter = threading.Thread(target=wait_probe, daemon=True)
    waiter.start()
    p = make_pipeline([])
    add_live_replication(p, job)
    p.run().wait_until_finish()
    waiter.join()
    if not result:
        raise RuntimeError(f"lag probe failed (exit {probe.returncode})")
    return result


def _lag_probe(seconds: float, rate: float, name: str, project: str, instance: str, table: str) -> None:
    """Reader of the lag run (own process). A sentinel item is written first and
    waited for, so the timed writes start once the pipeline is live (its start-up
    is not replication lag); then the writer (``_lag_writer``, a process of its
    own: its boto3 calls would hold this reader's interpreter lock) writes at
    ``rate`` while this process reads the rows not yet seen, keys only, every
    LAG_READ_POLL_S. A row counts as visible when the read that first returned it
    ended (an upper bound). Prints the result as JSON."""
    import subprocess

    from google.cloud.bigtable.data import BigtableDataClient, ReadRowsQuery

    from ddb2bt.pipeline.connect.connections import dynamodb_client

    ddb = dynamodb_client()
    seen: dict = {}
    with BigtableDataClient(project=project) as c, c.get_table(instance, table) as t:
        ddb.put_item(TableName=name, Item=make_item(random.Random(5), {"pk": {"S": "lag"}, "sk": {"S": "sentinel"}},
                                                     400))
        deadline = time.perf_counter() + 60
        while not t.read_rows(ReadRowsQuery(row_keys=[b"lag#sentinel"])):
            if time.perf_counter() > deadline:
                raise SystemExit("pipeline did not start within 60 s")
            time.sleep(0.05)
        fd, path = tempfile.mkstemp(prefix="ddb2bt-lag-", suffix=".json")
        os.close(fd)
        times = Path(path)
        code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from bench.run import _lag_writer; "
                f"_lag_writer({seconds!r}, {rate!r}, {name!r}, {str(times)!r})")
        writer = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
        try:
            written, slip_s = _read_lag_rows(t, writer, times, seen, seconds)
        finally:  # an error or an interrupt leaves no writer running and no file behind
            if writer.poll() is None:
                writer.kill()
                writer.wait()
            times.unlink(missing_ok=True)
    lags = [seen[k] - written[k] for k in written if k in seen]
    span = max(written.values()) - min(written.values()) if len(written) > 1 else 0.0
    print(json.dumps({"seconds": seconds, "rate_per_s": rate, "written": len(written), "visible": len(lags),
                      "achieved_rate_per_s": round((len(written) - 1) / span, 1) if span else None,
                      "writer_max_behind_s": round(slip_s, 3),
                      "p50_s": round(percentile(lags, 0.5), 3), "p99_s": round(percentile(lags, 0.99), 3),
                      "max_s": round(max(lags), 3) if lags else None, "reader_poll_s": LAG_READ_POLL_S,
                      "stream_poll_s": DEFAULT_POLL_INTERVAL_S}))


def _read_lag_rows(t, writer, times: Path, seen: dict, seconds: float) -> tuple:
    """The lag run's reading: every row from the lowest not seen yet (the
    writer's keys are in order; a row already seen past it is read again,
    harmlessly), keys only, every LAG_READ_POLL_S, until the writer has ended
    and every row it wrote was seen or LAG_GRACE_S passed (a row never seen
    counts as not visible: the result says how many were). Returns ({row key:
    write time}, how far the writer fell behind its schedule)."""
    from google.cloud.bigtable.data import ReadRowsQuery, RowRange
    from google.cloud.bigtable.data.row_filters import StripValueTransformerFilter

    keys_only = StripValueTransformerFilter(True)
    deadline = time.perf_counter() + seconds * 2 + LAG_GRACE_S + 60  # a writer that hangs does not hang the bench
    lowest, final = 0, None
    written: Optional[dict] = None
    while True:
        rows = t.read_rows(ReadRowsQuery(row_ranges=RowRange(_lag_row_key(lowest), LAG_ROWS_END),
                                         row_filter=keys_only))
        at = time.perf_counter()
        for row in rows:
            seen.setdefault(row.row_key, at)
        while _lag_row_key(lowest) in seen:
            lowest += 1
        if written is None and writer.poll() is not None:
            if writer.returncode != 0:
                raise SystemExit(f"lag writer failed (exit {writer.returncode})")
            report = json.loads(times.read_text())
            written = {_lag_row_key(i): at_s for i, at_s in enumerate(report["written"])}
            final = time.perf_counter() + LAG_GRACE_S  # late rows still count, up to this long
        if written is not None and (lowest >= len(written) or time.perf_counter() > final):
            return written, report["max_behind_s"]
        if at > deadline:
            raise SystemExit("lag writer did not finish in time")
        time.sleep(LAG_READ_POLL_S)


def _lag_row_key(i: int) -> bytes:
    """The product catalog mapping's row key of the lag run's item ``i``."""
    return f"lag#{i:08d}".encode()


def _lag_writer(seconds: float, rate: float, name: str, times: str) -> None:
    """Writer of the lag run (own process): ``rate`` × ``seconds`` items, item i
    due ``i / rate`` after the start (a writer that falls behind catches up:
    every item is written); saves each item's write time (``time.perf_counter``:
    the same monotonic clock in every process of the machine) and how far it
    fell behind to ``times``, as JSON (a file: 12,000 times would fill a pipe
    nobody reads until the writer ends)."""
    from ddb2bt.pipeline.connect.connections import dynamodb_client

    ddb = dynamodb_client()
    rng = random.Random(5)
    written: list = []
    behind = 0.0
    start = time.perf_counter()
    for i in range(round(seconds * rate)):
        due = start + i / rate
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
        behind = max(behind, now - due)
        written.append(time.perf_counter())  # before the call: its own time counts as lag
        ddb.put_item(TableName=name, Item=make_item(rng, {"pk": {"S": "lag"}, "sk": {"S": f"{i:08d}"}}, 400))
    Path(times).write_text(json.dumps({"written": written, "max_behind_s": behind}))


def backfill_speed(n: int, stack, project: str, instance: str, tmp: Path) -> dict:
    """Items/s from a local export (real layout) and from a parallel Scan of the
    moto table, against what the source alone delivers."""
    import gzip

    from ddb2bt.pipeline.local import workload
    from ddb2bt.pipeline.cutover.backfill import BackfillJob, PartReaders, add_backfill
    from ddb2bt.pipeline.source.snapshot import ExportSource, ScanSource
    from ddb2bt.pipeline.connect.connections import BigtableSpec, DynamoDBClientFactory, StateSpec, dynamodb_client
    from ddb2bt.pipeline.connect.preflight import ensure_state_table
    from ddb2bt.pipeline.sink.sink import SinkConfig
    from ddb2bt.transforms.attrs import item_to_dynamodb_json

    rng = random.Random(3)
    items = [make_item(rng, {"pk": {"S": f"cat{i % 50:02d}"}, "sk": {"S": f"item#{i:07d}"}}) for i in range(n)]
    export = tmp / f"export-{uuid.uuid4().hex[:6]}"
    (export / "data").mkdir(parents=True)
    files = []
    for f in range(4):
        name = f"data/{f:04d}.json.gz"
        with gzip.open(export / name, "wt") as fh:
            for it in items[f::4]:
                fh.write(json.dumps({"Item": item_to_dynamodb_json(it)}) + "\n")
        files.append(json.dumps({"dataFileS3Key": f"AWSDynamoDB/x/{name}"}))
    (export / "manifest-files.json").write_text("\n".join(files) + "\n")
    (export / "manifest-summary.json").write_text(json.dumps({"exportTime": "2030-01-01T00:00:00Z", "itemCount": n}))
    ensure_state_table(project, instance, "ddb2bt_state")
    out = {}
    source = ExportSource(str(export))
    t0 = time.perf_counter()
    readers = PartReaders(source, ("pk", "sk"), 1_900_000_000_000)
    from ddb2bt.transforms.model import ChangeRecord as _Record

    read = sum(1 for part in source.parts() for e in readers.read(part, None, 0) if isinstance(e, _Record))
    if read != n:  # the source must deliver every item exactly once
        raise RuntimeError(f"export source read {read} items, expected {n}")
    out["export_source_only_items_per_s"] = round(n / (time.perf_counter() - t0))

    def run(src, label, client_factory=None):
        table = fresh_table(project, instance)
        spec = StateSpec(BigtableSpec(project, instance), job=f"bf_{table}")
        settle()
        # Over the interval the live path is measured on: from the job's start to
        # the last item applied (run_until_applied).
        with Meter(stack.pids["bigtable"]) as m:
            wall, cpu, reached = run_until_applied(
                lambda p: add_backfill(p, BackfillJob(src, ("pk", "sk"), 1_900_000_000_000),
                                       MAPPING.with_overrides(table=table), spec, SinkConfig(), client_factory), n)
        if not reached:
            raise RuntimeError(f"the {label} run applied fewer than its {n} items")
        out[label] = round(n / wall)
        return cpu, m

    cpu, m = run(source, "export_items_per_s")
    # What an exported item costs this process (over the same interval) and
    # cbtemulator (over the whole run: it has nothing left to do after the last
    # item): with the live rate, how many cores the export would need to keep up
    # with it (issue 36's export target).
    out["export_client_cpu_us_per_item"] = round(cpu / n * US_PER_S, 1)
    out["export_emulator_cpu_us_per_item"] = round(m.emu / n * US_PER_S, 1)
    ddb = dynamodb_client()
    name = f"Bf{uuid.uuid4().hex[:6]}"
    workload.create_table(ddb, name)
    for i in range(0, n, 25):
        ddb.batch_write_item(RequestItems={name: [{"PutRequest": {"Item": it}} for it in items[i:i + 25]]})
    scan = ScanSource(name, 4)
    t0 = time.perf_counter()
    scanned = 0
    for seg in scan.parts():
        scanned += sum(1 for _ in PartReaders(scan, ("pk", "sk"), 1_900_000_000_000, ddb).read(seg, None, 0))
    out["scan_source_only_items_per_s"] = round(n / (time.perf_counter() - t0))
    run(scan, "scan_items_per_s", DynamoDBClientFactory())
    out["items"] = n
    return out


def export_cores_at_live_rate(backfill: dict, live: dict) -> dict:
    """Cores an export backfill needs to go as fast as the unpaced live path:
    the live rate times an exported item's CPU, this process's and the
    emulator's, against the machine's cores. Above them, no scheduling of the
    same work reaches the live rate on this machine (issue 36's export target)."""
    rate = live["changes_per_s"]
    client, emulator = backfill["export_client_cpu_us_per_item"], backfill["export_emulator_cpu_us_per_item"]
    # CPU seconds per 1M changes are µs a change: rate × µs / 1e6 is cores.
    needed = rate * (client + emulator) / US_PER_S
    live_cores = live["changes_per_s"] * (live["client_cpu_s_per_1M"] + live["emulator_cpu_s_per_1M"]) / US_PER_S
    return {"export_cores_needed_at_live_rate": round(needed, 2), "live_cores_used": round(live_cores, 2),
            "machine_cores": os.cpu_count()}


def scaling(n: int, stack, project: str, instance: str) -> dict:
    out = {}
    for shards in (1, 2, 4):
        records = stream_records(n)
        settle()
        wall = run_ddb2bt(records, project, instance, fresh_table(project, instance), partitions=shards)
        out[f"shards_{shards}"] = round(n / wall)
    for size in (256, 1000, 64 * 1024):
        m = n if size < 10_000 else max(1000, n // 10)
        records = stream_records(m, size=size)
        settle()
        wall = run_ddb2bt(records, project, instance, fresh_table(project, instance))
        out[f"item_{size}B"] = round(m / wall)
    return out


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}


def table_md(results: dict) -> str:
    lines = ["| contestant | changes/s | client CPU s / 1M | emulator CPU s / 1M | ddb2bt paced ÷ it "
             "| ddb2bt unpaced ÷ it |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {r.get('label', name)} | {r['changes_per_s']:,} | {r['client_cpu_s_per_1M']} | "
                     f"{r['emulator_cpu_s_per_1M']} | {r['ddb2bt_ratio']} | {r.get('ddb2bt_unpaced_ratio', '')} |")
    return "\n".join(lines)


SECTIONS = ("throughput", "memory", "lag", "backfill", "scaling", "tables", "verify")


def parse_sections(text: str) -> tuple:
    """``--sections a,b``: the sections to run, in the harness's order; an unknown
    name is an error that names it and the known ones."""
    asked = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in asked if name not in SECTIONS]
    if unknown or not asked:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {', '.join(unknown) or '(none given)'}: choose from {', '.join(SECTIONS)}")
    return tuple(name for name in SECTIONS if name in asked)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="larger sizes (takes longer)")
    parser.add_argument("--changes", type=int, help="changes per contestant (default 20,000; full 100,000)")
    parser.add_argument("--memory-changes", type=int, help="backlog for the memory run (default 100k; full 1M)")
    parser.add_argument("--lag-seconds", type=float, default=60.0, help="duration of the lag run (default 60)")
    parser.add_argument("--lag-rate", type=float, default=200.0, help="writes/s during the lag run (default 200)")
    parser.add_argument("--sections", type=parse_sections, default=SECTIONS,
                        help=f"comma-separated sections to run, of {','.join(SECTIONS)} (default: all). "
                             "E.g. --sections throughput,memory,lag,backfill,scaling leaves out the slow verify. "
                             "bench/results/latest.json is written only by a run of every section")
    args = parser.parse_args()
    sections = args.sections
    n = args.changes or (100_000 if args.full else 20_000)
    mem_n = args.memory_changes or (1_000_000 if args.full else 100_000)
    RESULTS.mkdir(parents=True, exist_ok=True)
    project, instance = MAPPING.target.project, MAPPING.target.instance
    import ddb2bt.pipeline as code

    # Which code ran (another checkout's may be put first on PYTHONPATH, for A/B runs).
    results: dict = {"machine": machine(), "sections": list(sections),
                     "code_under_test": str(Path(next(iter(code.__path__))).resolve().parent)}
    with LocalStack() as stack:
        stack.apply_env()
        if "throughput" in sections:
            print(f"throughput: {n:,} changes per contestant")
            results["throughput"] = throughput(n, stack, project, instance)
            results["unpaced"] = unpaced_summary(results["throughput"])
            print(f"  unpaced: {results['unpaced']}")
        if "memory" in sections:
            print(f"memory: draining a {mem_n:,}-change backlog")
            results["memory"] = memory_backlog(mem_n, stack, project, instance)
            print(f"  peak RSS {results['memory']['peak_rss_mib']} MiB")
        if "lag" in sections:
            print(f"lag: {args.lag_seconds:.0f} s at {args.lag_rate:.0f} writes/s")
            results["lag"] = lag(args.lag_seconds, args.lag_rate, stack, project, instance)
            print(f"  p50 {results['lag']['p50_s']} s, p99 {results['lag']['p99_s']} s, max {results['lag']['max_s']} s "
                  f"({results['lag']['written']} writes at {results['lag']['achieved_rate_per_s']}/s)")
        if "backfill" in sections:
            import tempfile

            # The live rates the export is held to, measured right before it: the same
            # spell of this shared box's speed (which swings by a third within minutes)
            # and the emulator as the earlier sections left it, not the throughput
            # section's rates of several minutes before, on a fresh emulator.
            print(f"backfill: first the live path alone, paced and unpaced, {n:,} changes")
            live = live_rates(n, stack, project, instance)
            with tempfile.TemporaryDirectory() as tmp:
                # As many items as the live run has changes: both runs pay a job's start-up
                # alike (a smaller backfill than live would be charged more of it per item).
                bf_n = n
                print(f"backfill: {bf_n:,} items from an export and from a Scan")
                bf = results["backfill"] = backfill_speed(bf_n, stack, project, instance, Path(tmp))
                bf["live"] = live
                # Issue 36: the backfill against the live path's unpaced rate (what its CPU
                # allows; the paced one is AWS's read limit on one shard), the paced beside it.
                bf["export_to_live"] = round(bf["export_items_per_s"] / live["ddb2bt_unpaced"]["changes_per_s"], 2)
                bf.update(export_cores_at_live_rate(bf, live["ddb2bt_unpaced"]))
                bf["export_to_paced_live"] = round(bf["export_items_per_s"] / live["ddb2bt"]["changes_per_s"], 2)
                bf["scan_to_raw_scan"] = round(bf["scan_items_per_s"] / bf["scan_source_only_items_per_s"], 2)
                print(f"  {bf}")
        if "scaling" in sections:
            print("scaling: shards and item sizes (paced)")
            results["scaling"] = scaling(n // 2, stack, project, instance)
            print(f"  {results['scaling']}")
        if "tables" in sections:
            from bench.tables import many_tables

            print(f"tables: {n:,} changes through one job of 1 table, then of 4 tables")
            results["tables"] = many_tables(n, project, instance)
        if "verify" in sections:
            from bench.verify import run_verify

            print("verify: 10,000 and 100,000 items (local bounded, before, from an export)")
            results["verify"] = run_verify()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = RESULTS / f"bench-{stamp}.json"
    path.write_text(json.dumps(results, indent=2))
    if sections == SECTIONS:
        (RESULTS / "latest.json").write_text(json.dumps(results, indent=2))
    if "throughput" in results:
        print()
        print(table_md(results["throughput"]))
    print(f"\nresults: {path}")
    return 0


def live_rates(n: int, stack, project: str, instance: str) -> dict:
    """The ddb2bt contestant alone, paced and unpaced (rows shaped as throughput's)."""
    records = stream_records(n)
    out = {}
    for name in ("ddb2bt", "ddb2bt_unpaced"):
        with unpaced() if name == "ddb2bt_unpaced" else contextlib.nullcontext():
            table = fresh_table(project, instance)
            with Meter(stack.pids["bigtable"]) as m:
                wall = run_ddb2bt(records, project, instance, table)
        out[name] = {"label": LABELS[name], "changes": n, "changes_per_s": round(n / wall),
                     "client_cpu_s_per_1M": round(LAST_LIVE_RUN["cpu_s"] / n * US_PER_S, 1),
                     "emulator_cpu_s_per_1M": round(m.emu / n * US_PER_S, 1)}
        print(f"  {name:<14} {out[name]['changes_per_s']:>8,} changes/s", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
