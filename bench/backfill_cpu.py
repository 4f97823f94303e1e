"""CPU cost of the backfill paths, per 1,000 items: this process's CPU time
(time.process_time: the Beam runner, the mapping and the sink all run here) and
the emulators' (cbtemulator, moto), for an export backfill and a Scan backfill of
the same items as ``bench/run.py``'s ``backfill_speed``. CPU time, not wall time:
it does not depend on what else the machine runs (issue 16: the shared 2-core box).

    .venv/bin/python bench/backfill_cpu.py --items 10000 --rounds 3
    .venv/bin/python bench/backfill_cpu.py --items 10000 --profile export   # cProfile, top entries

Optionally ``--tasks N`` (BackfillJob.tasks). ``--versioned``: video comments
(``examples/videos.yaml``: one version per comment, ten comments a row), whose rows
are written with CheckAndMutateRow (docs/design.md §7.4), with
``--conditional-concurrency N`` calls in flight (guards.CONDITIONAL_CONCURRENCY).

Where a batch's time goes and what a second core buys (issue 36):

    .venv/bin/python bench/backfill_cpu.py --items 20000 --only export --steps
    .venv/bin/python bench/backfill_cpu.py --items 100000 --only export --tasks 2 --workers 2
    .venv/bin/python bench/backfill_cpu.py --items 20000 --only export --parallel-requests 1   # one MutateRows a batch

``--steps``: the wall and CPU time of each step of the sink's batch commit (on
the sink thread), and how long the pipeline thread waited for the batch in
flight, in ms per batch. ``--workers N``: Beam's own multi-process mode of the
local runner (``--direct_running_mode=multi_processing``: N SDK worker
processes, the export's tasks spread over them; ``--tasks`` at least N), a
measurement, not a ddb2bt option (docs/benchmarks.md says why); the workers'
CPU is counted with this process's.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import gzip
import importlib
import json
import os
import pstats
import random
import string
from typing import Optional
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import psutil  # noqa: E402

import run as bench  # noqa: E402  (bench/run.py: the item shape, the mapping, fresh tables)

HANDOFF_MS = 1_900_000_000_000
KEYS = ("pk", "sk")
TOP_ENTRIES = 25
EXPORT_FILES = 4  # as bench/run.py writes its export
SCAN_SEGMENTS = 4


VIDEOS = bench.load_mapping(ROOT / "examples/videos.yaml")
COMMENTS_PER_VIDEO = 10
COMMENT_CHARS = 200


def _items(n: int, versioned: bool = False) -> list:
    rng = random.Random(3)
    if versioned:  # distinct CreatedAt seconds: every comment is its own version
        return [{"pk": {"S": f"vid{i // COMMENTS_PER_VIDEO:06d}"}, "sk": {"S": f"VideoComment#{i:07d}"},
                 "Content": {"S": "".join(rng.choices(string.ascii_letters, k=COMMENT_CHARS))},
                 "CreatedAt": {"S": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(1_600_000_000 + i))}}
                for i in range(n)]
    return [bench.make_item(rng, {"pk": {"S": f"cat{i % 50:02d}"}, "sk": {"S": f"item#{i:07d}"}}) for i in range(n)]


def _export(items: list, tmp: Path) -> Path:
    from ddb2bt.transforms.attrs import item_to_dynamodb_json

    export = tmp / f"export-{uuid.uuid4().hex[:6]}"
    (export / "data").mkdir(parents=True)
    files = []
    for f in range(EXPORT_FILES):
        name = f"data/{f:04d}.json.gz"
        with gzip.open(export / name, "wt") as fh:
            for it in items[f::EXPORT_FILES]:
                fh.write(json.dumps({"Item": item_to_dynamodb_json(it)}) + "\n")
        files.append(json.dumps({"dataFileS3Key": f"AWSDynamoDB/x/{name}"}))
    (export / "manifest-files.json").write_text("\n".join(files) + "\n")
    (export / "manifest-summary.json").write_text(json.dumps({"exportTime": "2030-01-01T00:00:00Z",
                                                               "itemCount": len(items)}))
    return export


def _children_cpu(stack) -> float:
    total = 0.0
    for proc in psutil.Process().children(recursive=True):
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def _print_yappi(stats, key: str) -> None:
    rows = sorted(stats, key=lambda s: getattr(s, key), reverse=True)[:TOP_ENTRIES]
    print(f"--- yappi, all threads, CPU clock, by {key}")
    for s in rows:
        print(f"{s.ttot:8.3f} {s.tsub:8.3f} {s.ncall:9d}  {s.module.replace(str(ROOT), '')}:{s.lineno} {s.name}")


# The steps of a batch's commit (BatchingWriter._commit_owned, on the sink thread)
# and the pipeline thread's wait for the batch in flight, timed by --steps:
# (module, class, method).
STEPS = (
    ("ddb2bt.pipeline.sink.batching", "BatchingWriter", "_wait_in_flight"),
    ("ddb2bt.pipeline.sink.batching", "BatchingWriter", "_commit"),
    ("ddb2bt.pipeline.sink.repairs", "GuardedWrites", "record_intents"),
    ("ddb2bt.pipeline.sink.requests", "RequestWriter", "write_split"),
    ("ddb2bt.pipeline.sink.repairs", "GuardedWrites", "repair_touched"),
    ("ddb2bt.pipeline.sink.repairs", "GuardedWrites", "repair_left_over"),
    ("ddb2bt.pipeline.control.state", "StateStore", "save_backfill_progress"),
    ("ddb2bt.pipeline.control.state", "StateStore", "clear_repair_intents"),
)


class StepClock:
    """Wall and thread-CPU seconds spent in each of STEPS (wrapped in place)."""

    def __init__(self) -> None:
        self.wall: collections.Counter = collections.Counter()
        self.cpu: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self._originals: list = []

    def install(self) -> None:
        for module, cls_name, name in STEPS:
            cls = getattr(importlib.import_module(module), cls_name)
            original = getattr(cls, name)
            self._originals.append((cls, name, original))
            setattr(cls, name, self._timed(name, original))

    def uninstall(self) -> None:
        for cls, name, original in self._originals:
            setattr(cls, name, original)
        self._originals = []

    def _timed(self, name: str, fn):
        def timed(*args, **kwargs):
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[name] += time.perf_counter() - w
                self.cpu[name] += time.thread_time() - c
                self.calls[name] += 1
        return timed

    def per_batch_ms(self) -> dict:
        """{step: [wall ms, CPU ms]} per batch committed."""
        batches = max(1, self.calls["_commit"])
        return {name: [round(self.wall[name] / batches * 1000, 1), round(self.cpu[name] / batches * 1000, 1)]
                for _, _, name in STEPS if self.calls[name]}


def _pipeline(workers: int):
    """The local pipeline, or (``workers`` > 1) one run by Beam's multi-process
    mode: ``workers`` SDK worker processes, the first stage's elements (the
    backfill's tasks) spread over them."""
    from ddb2bt.pipeline.graph import local_runner, make_pipeline

    if workers <= 1:
        return make_pipeline([])
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    options = PipelineOptions([f"--direct_num_workers={workers}", "--direct_running_mode=multi_processing"],
                              save_main_session=False)
    return beam.Pipeline(runner=local_runner(), options=options)


def _reaped_cpu() -> float:
    """CPU of this process's children that ended and were waited for (Beam's
    SDK worker processes, once the pipeline stops them)."""
    t = os.times()
    return t.children_user + t.children_system


def _run(src, n: int, project: str, instance: str, stack, client_factory, tasks: int, mapping, rows_expected: int,
         profile: bool, workers: int = 1, parallel_requests: Optional[int] = None) -> dict:
    from ddb2bt.pipeline.cutover.backfill import BackfillJob, add_backfill
    from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec
    from ddb2bt.pipeline.clients.bigtable.reads import read_table
    from ddb2bt.pipeline.sink.sink import SinkConfig

    from ddb2bt.pipeline.clients.bigtable.admin import BigtableAdmin

    table = f"bench_{uuid.uuid4().hex[:8]}"
    BigtableAdmin(project, instance).ensure_table(table, mapping.table_families()[mapping.target.table])
    spec = StateSpec(BigtableSpec(project, instance), job=f"bf_{table}")
    p = _pipeline(workers)
    add_backfill(p, BackfillJob(src, KEYS, HANDOFF_MS, tasks=tasks), mapping.with_overrides(table=table), spec,
                 SinkConfig() if parallel_requests is None else SinkConfig(parallel_requests=parallel_requests),
                 client_factory)
    bench.settle()
    prof = None
    if profile == "yappi":  # every thread (readers, sink thread), CPU clock
        import yappi

        yappi.set_clock_type("cpu")
        yappi.start()
    elif profile:
        prof = cProfile.Profile()  # the main thread only (the mapping, the DoFns)
    before = _children_cpu(stack)
    c0, w0 = time.process_time() + _reaped_cpu(), time.perf_counter()
    if prof:
        prof.enable()
    p.run().wait_until_finish()
    if prof:
        prof.disable()
    if profile == "yappi":
        yappi.stop()
    cpu, wall = time.process_time() + _reaped_cpu() - c0, time.perf_counter() - w0
    others = _children_cpu(stack) - before
    rows = len(read_table(project, instance, table))
    if rows != rows_expected:
        raise RuntimeError(f"backfill wrote {rows} rows, expected {rows_expected}")
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(TOP_ENTRIES)
        pstats.Stats(prof).sort_stats("tottime").print_stats(TOP_ENTRIES)
    if profile == "yappi":
        stats = yappi.get_func_stats()
        for key in ("ttot", "tsub"):
            _print_yappi(stats, key)
        yappi.get_thread_stats().print_all()
    return {"cpu_s_per_1k": round(cpu / n * 1000, 4), "children_cpu_s_per_1k": round(others / n * 1000, 4),
            "wall_items_per_s": round(n / wall)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=1)
    parser.add_argument("--versioned", action="store_true", help="video comments: conditional rows (export only)")
    parser.add_argument("--conditional-concurrency", type=int, help="CheckAndMutateRow calls in flight")
    parser.add_argument("--parallel-requests", type=int,
                        help="SinkConfig.parallel_requests (default: the sink's; 1: one MutateRows per batch)")
    parser.add_argument("--only", choices=("export", "scan"), help="one path only")
    parser.add_argument("--profile", choices=("export", "scan"), help="one profiled run of this path")
    parser.add_argument("--profiler", choices=("cprofile", "yappi"), default="cprofile",
                        help="cprofile: the main thread; yappi (pip install yappi): every thread")
    parser.add_argument("--steps", action="store_true",
                        help="wall and CPU ms per batch of each step of the sink's commit, and the pipeline "
                             "thread's wait for the batch in flight")
    parser.add_argument("--workers", type=int, default=1,
                        help="Beam's multi-process mode with this many SDK worker processes (a measurement; "
                             "--tasks at least as many); --steps then sees nothing (the sinks run in the workers)")
    args = parser.parse_args()
    if args.workers > 1 and args.tasks < args.workers:
        parser.error("--workers N needs --tasks N or more: the tasks are what is spread over the workers")
    from ddb2bt.pipeline.connect.connections import DynamoDBClientFactory, dynamodb_client
    from ddb2bt.pipeline.source.snapshot import ExportSource, ScanSource
    from ddb2bt.pipeline.local import workload
    from ddb2bt.pipeline.local.local_stack import LocalStack
    from ddb2bt.pipeline.connect.preflight import ensure_state_table

    project, instance = bench.MAPPING.target.project, bench.MAPPING.target.instance
    from ddb2bt.pipeline.sink import guards

    if args.conditional_concurrency:
        guards.CONDITIONAL_CONCURRENCY = args.conditional_concurrency
    n = args.items
    items = _items(n, args.versioned)
    mapping = VIDEOS if args.versioned else bench.MAPPING
    rows_expected = -(-n // COMMENTS_PER_VIDEO) if args.versioned else n
    with LocalStack() as stack, tempfile.TemporaryDirectory() as tmp:
        stack.apply_env()
        ensure_state_table(project, instance, "ddb2bt_state")
        export = ExportSource(str(_export(items, Path(tmp))))
        kinds = [k for k in ("export", "scan") if (args.profile or args.only or k) == k]
        if args.versioned:
            kinds = ["export"]
        scan = None
        if "scan" in kinds:
            ddb = dynamodb_client()
            name = f"Bf{uuid.uuid4().hex[:6]}"
            workload.create_table(ddb, name)
            for i in range(0, n, 25):
                ddb.batch_write_item(RequestItems={name: [{"PutRequest": {"Item": it}} for it in items[i:i + 25]]})
            scan = ScanSource(name, SCAN_SEGMENTS)
        rounds = 1 if args.profile else args.rounds
        for r in range(rounds):
            for kind in kinds:
                src, factory = (export, None) if kind == "export" else (scan, DynamoDBClientFactory())
                clock = None
                if args.steps:
                    clock = StepClock()
                    clock.install()
                out = _run(src, n, project, instance, stack, factory, args.tasks, mapping, rows_expected,
                           profile=args.profile and args.profiler, workers=args.workers,
                           parallel_requests=args.parallel_requests)
                if clock is not None:
                    out["steps_ms_per_batch_wall_cpu"] = clock.per_batch_ms()
                    clock.uninstall()
                concurrency = getattr(guards, "CONDITIONAL_CONCURRENCY", None)  # None: a tree without it (A/B)
                print(json.dumps({"round": r, "kind": kind, "items": n, "tasks": args.tasks, "workers": args.workers,
                                  "versioned": args.versioned, "conditional_concurrency": concurrency,
                                  "parallel_requests": args.parallel_requests, **out}),
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
