"""Crash soak: kill `ddb2bt run` / `ddb2bt migrate` with SIGKILL at random moments
while a writer keeps changing the table (optionally with Bigtable faults injected
at the gRPC layer), then catch up and prove the target identical.

    .venv/bin/python bench/soak.py                       # 20 trials of each mode
    .venv/bin/python bench/soak.py --trials 50 --mode migrate --faults \\
        "unavailable=0.1,entry_unavailable=0.1,latency_ms=5"

Writes bench/results/soak-<time>.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from ddb2bt.pipeline.local import workload  # noqa: E402
from ddb2bt.pipeline.clients.bigtable.reads import read_table
from ddb2bt.pipeline.verify.compare import compare_mapping  # noqa: E402
from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec, dynamodb_client  # noqa: E402
from ddb2bt.pipeline.local.local_stack import LocalStack  # noqa: E402
from ddb2bt.transforms.config import load_mapping  # noqa: E402

DEFAULT_FAULTS = "unavailable=0.05,deadline_exceeded=0.02,resource_exhausted=0.02,entry_unavailable=0.05,latency_ms=2"


def ddb2bt_argv(args: list, faults: str = "", fault_log: Path | None = None) -> list:
    """The command line of a ddb2bt run, with Bigtable faults injected through the
    testing package's runner when ``faults`` is set."""
    if not faults:
        return [sys.executable, "-m", "ddb2bt.pipeline.app.cli", *args]
    # --log before the spec: after it, the runner's catch-all argument would take it
    # as part of the ddb2bt command line.
    log = ["--log", str(fault_log)] if fault_log else []
    return [sys.executable, "-m", "ddb2bt.pipeline.testing.faults", *log, faults, "--", *args]


def cli(args: list, env: dict, faults: str = "", fault_log: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen(ddb2bt_argv(args, faults, fault_log), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def soak(mode: str, trials: int, faults: str, seed: int, workdir: Path) -> dict:
    rng = random.Random(seed)
    data = yaml.safe_load((ROOT / "examples/product_catalog.yaml").read_text())
    data["source"]["table"] = f"Soak{mode.title()}"
    data["target"]["table"] = f"soak_{mode}"
    data["name"] = f"soak_{mode}"
    path = workdir / f"soak-{mode}.yaml"
    path.write_text(yaml.safe_dump(data))
    mapping = load_mapping(path)
    ddb = dynamodb_client()
    workload.create_table(ddb, mapping.source.table)
    env = dict(os.environ)
    subprocess.run([sys.executable, "-m", "ddb2bt.pipeline.app.cli", "create-table", "--mapping", str(path)], cwd=ROOT,
                   env=env, check=True, capture_output=True)
    if mode == "migrate":  # something to back-fill
        for op in workload.operations(seed, 1500, 400):
            workload.apply_quietly(ddb, mapping.source.table, op)
    stop = threading.Event()
    written = [0]

    def writer() -> None:
        for op in workload.operations(seed + 1, 10**9, 400):
            if stop.is_set():
                return
            workload.apply_quietly(ddb, mapping.source.table, op)
            written[0] += 1
            time.sleep(0.01)

    fault_log = workdir / f"faults-{mode}.log"
    args = ["run", "--mapping", str(path), "--poll-interval", "0.2"] if mode == "tail" else \
        ["migrate", "--mapping", str(path), "--segments", "4", "--page-size", "25", "--max-rcu", "20",
         "--poll-interval", "0.2"]
    threading.Thread(target=writer, daemon=True).start()
    kills = []
    started = time.monotonic()
    for trial in range(trials):
        proc = cli(args, env, faults, fault_log)
        life = rng.uniform(1.0, 6.0)  # includes start-up: some kills land before the first write
        time.sleep(life)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            kills.append(round(life, 2))
        else:
            kills.append(f"exited {proc.returncode}")
    stop.set()
    time.sleep(0.5)
    final = ["run", "--mapping", str(path), "--until-idle", "2", "--poll-interval", "0.2"] if mode == "tail" else \
        ["migrate", "--mapping", str(path), "--segments", "4", "--until-idle", "2", "--poll-interval", "0.2"]
    catch_up = subprocess.run(ddb2bt_argv(final, faults, fault_log), cwd=ROOT, env=env,
                              capture_output=True, text=True)
    items = workload.scan_all(ddb, mapping.source.table)
    t = mapping.target
    diffs = compare_mapping(mapping, items, lambda table: read_table(t.project, t.instance, table))
    divergent = sum(len(getattr(d, k)) for d in diffs.values()
                    for k in ("missing_rows", "extra_rows", "missing_cells", "extra_cells", "different_cells"))
    verify = subprocess.run([sys.executable, "-m", "ddb2bt.pipeline.app.cli", "verify", "--mapping", str(path)], cwd=ROOT,
                            env=env, capture_output=True, text=True)
    store = StateSpec(BigtableSpec(t.project, t.instance), job=mapping.name).store()
    injected: dict = {}
    if fault_log.exists():
        for line in fault_log.read_text().split():
            injected[line] = injected.get(line, 0) + 1
    return {"faults_injected": injected, "mode": mode, "trials": trials, "sigkills": sum(1 for k in kills if not isinstance(k, str)),
            "kill_after_s": kills, "faults": faults or "none", "changes_written_during_soak": written[0],
            "items": len(items), "catch_up_exit": catch_up.returncode, "verify_exit": verify.returncode,
            "divergent_cells": divergent, "dead_letters": store.count_dead_letters(),
            "seconds": round(time.monotonic() - started, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--mode", choices=("tail", "migrate", "both"), default="both")
    parser.add_argument("--faults", default=DEFAULT_FAULTS, help="fault spec (ddb2bt.pipeline.testing.faults) ('' for none)")
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    results = []
    with LocalStack() as stack, tempfile.TemporaryDirectory() as tmp:
        stack.apply_env()
        for mode in (("tail", "migrate") if args.mode == "both" else (args.mode,)):
            print(f"soak: {mode}, {args.trials} trials, faults: {args.faults or 'none'}", flush=True)
            results.append(soak(mode, args.trials, args.faults, args.seed, Path(tmp)))
            r = results[-1]
            print(f"  SIGKILLs {r['sigkills']}, faults injected {r['faults_injected']}, catch-up exit "
                  f"{r['catch_up_exit']}, verify exit {r['verify_exit']}, divergent cells {r['divergent_cells']}, "
                  f"dead letters {r['dead_letters']}", flush=True)
    out = ROOT / "bench" / "results" / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"results: {out}")
    return 0 if all(r["divergent_cells"] == 0 and r["verify_exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
