"""CPU cost of the backfill paths, per 1,000 items: this process's CPU time
(time.process_time: the Beam runner, the mapping and the sink all run here) and
the emulators' (cbtemulator, moto), for an export backfill and a Scan backfill of
the same items as ``bench/run.py``'s ``backfill_speed``. CPU time, not wall time:
it does not depend on what else the machine runs (issue 16: the shared 2-core box).

    .venv/bin/python bench/backfill_cpu.py --items 10000 --rounds 3
    .venv/bin/python bench/backfill_cpu.py --items 10000 --profile export   # cProfile, top entries

Optionally ``--tasks N`` (BackfillJob.tasks) and ``--processes N``
(BackfillJob.processes, where the backfill supports it).
"""
from __future__ import annotations

import argparse
import cProfile
import gzip
import json
import pstats
import random
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


def _items(n: int) -> list:
    rng = random.Random(3)
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


def _run(src, n: int, project: str, instance: str, stack, client_factory, tasks: int, processes: int,
         profile: bool) -> dict:
    from ddb2bt.pipeline.cutover.backfill import BackfillJob, add_backfill
    from ddb2bt.pipeline.connections import BigtableSpec, StateSpec
    from ddb2bt.pipeline.graph import make_pipeline
    from ddb2bt.pipeline.sink.bigtable_io import read_table
    from ddb2bt.pipeline.sink.sink import SinkConfig

    table = bench.fresh_table(project, instance)
    spec = StateSpec(BigtableSpec(project, instance), job=f"bf_{table}")
    p = make_pipeline([])
    extra = {"processes": processes} if processes > 1 else {}
    add_backfill(p, BackfillJob(src, KEYS, HANDOFF_MS, tasks=tasks, **extra),
                 bench.MAPPING.with_overrides(table=table), spec, SinkConfig(), client_factory)
    bench.settle()
    prof = None
    if profile == "yappi":  # every thread (readers, sink thread), CPU clock
        import yappi

        yappi.set_clock_type("cpu")
        yappi.start()
    elif profile:
        prof = cProfile.Profile()  # the main thread only (the mapping, the DoFns)
    before = _children_cpu(stack)
    c0, w0 = time.process_time(), time.perf_counter()
    if prof:
        prof.enable()
    p.run().wait_until_finish()
    if prof:
        prof.disable()
    if profile == "yappi":
        yappi.stop()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    others = _children_cpu(stack) - before
    rows = len(read_table(project, instance, table))
    if rows != n:
        raise RuntimeError(f"backfill wrote {rows} rows, expected {n}")
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
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--only", choices=("export", "scan"), help="one path only")
    parser.add_argument("--profile", choices=("export", "scan"), help="one profiled run of this path")
    parser.add_argument("--profiler", choices=("cprofile", "yappi"), default="cprofile",
                        help="cprofile: the main thread; yappi (pip install yappi): every thread")
    args = parser.parse_args()
    from ddb2bt.pipeline.connections import DynamoDBClientFactory, dynamodb_client
    from ddb2bt.pipeline.cutover.backfill import ExportSource, ScanSource
    from ddb2bt.pipeline.local import workload
    from ddb2bt.pipeline.local.local_stack import LocalStack
    from ddb2bt.pipeline.preflight import ensure_state_table

    project, instance = bench.MAPPING.target.project, bench.MAPPING.target.instance
    n = args.items
    items = _items(n)
    with LocalStack() as stack, tempfile.TemporaryDirectory() as tmp:
        stack.apply_env()
        ensure_state_table(project, instance, "ddb2bt_state")
        export = ExportSource(str(_export(items, Path(tmp))))
        kinds = [k for k in ("export", "scan") if (args.profile or args.only or k) == k]
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
                out = _run(src, n, project, instance, stack, factory, args.tasks, args.processes,
                           profile=args.profile and args.profiler)
                print(json.dumps({"round": r, "kind": kind, "items": n, "tasks": args.tasks,
                                  "processes": args.processes, **out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
