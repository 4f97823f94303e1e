"""The deterministic simulation of production, over many seeds
(pipeline/testing/sim; docs/reliability.md, "The simulation").

    .venv/bin/python bench/simulate.py --seeds N --hours H --shards S --workers W [--partitions P]
    .venv/bin/python bench/simulate.py --replay SEED ...   # one seed, its problems in full

Each seed is one run: the product's reading DoFn, reader, pacer, shard
directory and sink on a simulated clock, against a DynamoDB stream of S shards
that roll over and split, a Bigtable under pressure and a Dataflow runner of W
workers that moves, splits, fails and loses work; the oracle judges the run
(0 divergent cells, no wedge, AWS's and Bigtable's limits kept, dead letters
once). Prints a progress bar, a summary table and, for each failing seed, the
one command that replays it. Exit status 1 when any seed failed.

The table ends with the four figures of a run at scale (e.g. ``--shards 2000
--workers 16 --memory``): DescribeStream calls per second per stream, summed
over every worker, peak in any one second (AWS: 10); GetRecords per shard per
second, peak in any one second (AWS: 5); the peak footprint of one worker
(``--memory``); simulated hours per wall minute (and per CPU minute: the
machine may be shared).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ddb2bt.pipeline.testing.sim.dataflow import DataflowChaos  # noqa: E402
from ddb2bt.pipeline.testing.sim.scenario import SimConfig, run_simulation  # noqa: E402
from ddb2bt.pipeline.testing.sim.writers import WriterMix  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=10, help="how many seeds (from --first-seed)")
    p.add_argument("--first-seed", type=int, default=1)
    p.add_argument("--replay", type=int, help="run this one seed and print its report in full")
    p.add_argument("--hours", type=float, default=1.0, help="simulated hours the writers write, per seed")
    p.add_argument("--shards", type=int, default=8, help="open shards at the start")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--instances", type=int, default=3, help="DoFn instances per worker")
    p.add_argument("--partitions", type=int, help="stream partitions (default: one per 8 shards, at least 2)")
    p.add_argument("--start", choices=("trim_horizon", "latest"), default="trim_horizon")
    p.add_argument("--writes-per-s", type=float, default=5.0, help="the writers' changes per simulated second")
    p.add_argument("--shard-life-h", type=float, default=4.0, help="a shard's life before it rolls over")
    p.add_argument("--lease", action="store_true", help="the job's lease and partition leases, as on Dataflow")
    p.add_argument("--memory", action="store_true", help="measure each worker's footprint (slow at scale)")
    p.add_argument("--json", type=Path, help="write the summary here too")
    args = p.parse_args(argv)
    if args.partitions is None:
        args.partitions = max(2, math.ceil(args.shards / 8))
    for name in ("seeds", "shards", "workers", "instances", "partitions"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.hours <= 0:
        p.error("--hours must be positive")
    return args


def config_of(args, seed: int) -> SimConfig:
    from ddb2bt.pipeline.testing.sim.aws import StreamLimits

    return SimConfig(seed=seed, hours=args.hours, shards=args.shards, partitions=args.partitions, start=args.start,
                     writers_after_s=30.0 if args.start == "latest" else 0.0,
                     stream=StreamLimits(shard_life_s=args.shard_life_h * 3600),
                     writers=WriterMix(per_second=args.writes_per_s),
                     dataflow=DataflowChaos(workers=args.workers, instances=args.instances),
                     lease=args.lease, measure_memory=args.memory)


def replay_command(args, seed: int) -> str:
    return (f"python bench/simulate.py --replay {seed} --hours {args.hours:g} --shards {args.shards} "
            f"--workers {args.workers} --instances {args.instances} --partitions {args.partitions} "
            f"--start {args.start} --writes-per-s {args.writes_per_s:g} --shard-life-h {args.shard_life_h:g}"
            + (" --lease" if args.lease else ""))


def bar(done: int, total: int, fraction: float, failed: int, started: float) -> None:
    width = 30
    whole = (done + fraction) / total
    filled = int(whole * width)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] seed {done + 1}/{total} "
                     f"{whole:6.1%}  failed {failed}  {time.perf_counter() - started:7.0f}s")
    sys.stderr.flush()


def summarize(args, reports: list, wall_s: float, cpu_s: Optional[float] = None) -> dict:
    sim_s = sum(r.simulated_s for r in reports)
    faults: dict = {}
    for r in reports:
        for k, v in r.faults.items():
            faults[k] = faults.get(k, 0) + v
    describe = [r.calls.get("DescribeStream per stream", {}) for r in reports]
    get_records = [r.calls.get("GetRecords per shard", {}) for r in reports]
    open_shard_s = sum(r.simulated_s * r.config.shards for r in reports)
    return {
        "seeds": len(reports), "clean": sum(r.clean for r in reports),
        "failed seeds": [r.config.seed for r in reports if not r.clean],
        "shards": args.shards, "workers": args.workers, "instances per worker": args.instances,
        "partitions": args.partitions, "simulated hours": round(sim_s / 3600, 2),
        "simulated hours per wall minute": round(sim_s / 3600 / (wall_s / 60), 3) if wall_s else None,
        "simulated hours per CPU minute": round(sim_s / 3600 / (cpu_s / 60), 3) if cpu_s else None,
        "changes written": sum(r.stream["changes"] for r in reports),
        "bundles": sum(r.stream["bundles"] for r in reports),
        "DescribeStream per stream per s (mean, all workers)": round(sum(d.get("calls", 0) for d in describe)
                                                                   / sim_s, 3) if sim_s else None,
        "DescribeStream per stream per s (peak in any 1 s)": max((d.get("peak_per_s", 0) for d in describe),
                                                                default=0),
        "DescribeStream refused (over 10/s)": sum(d.get("over", 0) for d in describe),
        "GetRecords per shard per s (mean)": round(sum(g.get("calls", 0) for g in get_records) / open_shard_s, 3)
        if open_shard_s else None,
        "GetRecords per shard per s (peak in any 1 s)": max((g.get("peak_per_s", 0) for g in get_records), default=0),
        "GetRecords refused (over 5/s)": sum(g.get("over", 0) for g in get_records),
        "peak memory per worker (MB, its DoFns and process state)":
            round(max((r.stream.get("peak worker bytes", 0) for r in reports), default=0) / 1e6, 2)
            if args.memory else None,
        "max ack lag (s)": max((r.verdict.max_ack_lag_s for r in reports), default=0.0),
        "faults injected": faults, "wall s": round(wall_s, 1),
        "CPU s": round(cpu_s, 1) if cpu_s is not None else None,
        "peak RSS of the simulation (MB)": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


# The four figures of a run at scale, each with AWS's limit where it has one.
FIGURES = (("DescribeStream per stream per s, all workers (peak in any 1 s)",
            "DescribeStream per stream per s (peak in any 1 s)", 10),
           ("GetRecords per shard per s (peak in any 1 s)", "GetRecords per shard per s (peak in any 1 s)", 5),
           ("peak memory per worker (MB)", "peak memory per worker (MB, its DoFns and process state)", None),
           ("simulated hours per wall minute", "simulated hours per wall minute", None))


def figures(summary: dict) -> list:
    """[(name, value, limit text)]: the four figures, as the summary has them."""
    out = []
    for name, key, limit in FIGURES:
        value = summary.get(key)
        if value is None:
            out.append((name, "not measured (add --memory)", ""))
        elif limit is None:
            out.append((name, value, ""))
        else:
            out.append((name, value, f"limit {limit}: {'within' if value <= limit else 'EXCEEDED'}"))
    return out


def print_table(summary: dict) -> None:
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        if key == "faults injected":
            print(f"{key:<{width}}")
            for fault, n in value.items():
                print(f"  {fault:<{width - 2}}  {n}")
        else:
            print(f"{key:<{width}}  {value}")
    print(f"at {summary['shards']} shards x {summary['workers']} workers:")
    rows = figures(summary)
    width = max(len(name) for name, _, _ in rows)
    for name, value, limit in rows:
        print(f"  {name:<{width}}  {str(value):>8}  {limit}".rstrip())


def main(argv=None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.CRITICAL)  # the product's retries log at WARNING: the table says it
    if args.replay is not None:
        logging.getLogger().setLevel(logging.ERROR)
        report = run_simulation(config_of(args, args.replay))
        print(json.dumps({"seed": args.replay, "clean": report.clean, "problems": report.verdict.problems,
                          "faults": report.faults, "calls": report.calls, "run": report.stream,
                          "simulated_s": report.simulated_s, "wall_s": round(report.wall_s, 1)}, indent=1,
                         default=str))
        return 0 if report.clean else 1
    started, cpu_started = time.perf_counter(), time.process_time()
    reports = []
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    crashed: dict = {}  # seed -> the exception that ended its run (a finding too: the run goes on)
    for n, seed in enumerate(seeds):
        failed = sum(not r.clean for r in reports) + len(crashed)
        try:
            report = run_simulation(config_of(args, seed),
                                    progress=lambda f, n=n, failed=failed: bar(n, args.seeds, f, failed, started))
        except Exception as exc:  # noqa: BLE001 - any exception out of a run is that seed's failure
            crashed[seed] = f"the run raised {type(exc).__name__}: {exc}"
            sys.stderr.write(f"\nseed {seed} FAILED: {crashed[seed]}\n")
            continue
        reports.append(report)
        if not report.clean:
            sys.stderr.write(f"\nseed {seed} FAILED: {report.verdict.problems[0]}\n")
    bar(args.seeds - 1, args.seeds, 1.0, sum(not r.clean for r in reports) + len(crashed), started)
    sys.stderr.write("\n")
    summary = summarize(args, reports, time.perf_counter() - started, time.process_time() - cpu_started)
    summary["seeds"] += len(crashed)
    summary["failed seeds"] = sorted(summary["failed seeds"] + list(crashed))
    print_table(summary)
    failures = {r.config.seed: "; ".join(r.verdict.problems) for r in reports if not r.clean} | crashed
    for seed, why in sorted(failures.items()):
        print(f"FAILED seed {seed}: {why[:400]}")
        print(f"  replay: {replay_command(args, seed)}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
