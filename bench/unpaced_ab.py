"""Client CPU per change of the live path, unpaced, this checkout against another
commit, interleaved (A, B, A, B, ...), each run a fresh process: on a shared
machine only CPU time compared side by side means anything.

    .venv/bin/python bench/unpaced_ab.py --base ce8bc7b             # 4 rounds, 2 runs of 20,000 each
    .venv/bin/python bench/unpaced_ab.py --base main --rounds 6 --changes 20000

The measured run is bench/run.py's unpaced ddb2bt row (one shard, the pacer
taken away: the fake stream is not AWS): this process's CPU (every thread; not
the emulator's) from the job's start to the last change applied, per change.
``--base``: a commit (or branch) of this repository, whose pipeline, transforms
and examples are exported to a temporary directory and put first on the path of
its runs; the harness (bench/) is this checkout's for both. Each run says which
code it ran. Prints every run, then min / median / max per side.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CODE_DIRS = ("pipeline", "transforms", "examples")
# The first run of a process pays imports, channels and the compiled mapping's
# generation: it warms up on this many changes and is not reported.
WARM_UP_CHANGES = 2000
RESULT_TAG = "RESULT"


def child(n: int, reps: int) -> None:
    """One process's runs: warm up, then ``reps`` measured runs, one line each."""
    from bench.run import LAST_LIVE_RUN, MAPPING, fresh_table, run_ddb2bt, stream_records, unpaced
    import ddb2bt.pipeline.sink.sink as sink_module
    from ddb2bt.pipeline.local.local_stack import LocalStack

    code = Path(sink_module.__file__).resolve().parent.parent.parent
    project, instance = MAPPING.target.project, MAPPING.target.instance
    with LocalStack() as stack, unpaced():
        stack.apply_env()
        records = stream_records(n)
        run_ddb2bt(records[:WARM_UP_CHANGES], project, instance, fresh_table(project, instance))
        for _ in range(reps):
            wall = run_ddb2bt(records, project, instance, fresh_table(project, instance))
            print(f"{RESULT_TAG} {LAST_LIVE_RUN['cpu_s'] / n * 1e6:.2f} {n / wall:.0f} {code}", flush=True)


def export(commit: str, into: Path) -> Path:
    """The commit's code as an importable ``ddb2bt`` package under ``into``."""
    package = into / "ddb2bt"
    package.mkdir(parents=True)
    archive = into / "code.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), commit, *CODE_DIRS], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(package)  # noqa: S202 — our own repository's archive
    return into


def run_side(label: str, path: str, n: int, reps: int) -> list:
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, __file__, "--child", "--changes", str(n), "--reps", str(reps)],
                         capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"{label} run failed:\n{out.stderr[-3000:]}")
    runs = []
    for line in out.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            _, cpu_us, rate, code = line.split(" ", 3)
            runs.append(float(cpu_us))
            print(f"  {label:<6} {float(cpu_us):6.1f} us CPU per change  {int(rate):>7,} changes/s  ({code})",
                  flush=True)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="the commit or branch to compare this checkout with (required)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of (base, this) (default 4)")
    parser.add_argument("--changes", type=int, default=20_000, help="changes per run (default 20,000)")
    parser.add_argument("--reps", type=int, default=2, help="measured runs per process (default 2)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.changes, args.reps)
        return 0
    if not args.base:
        parser.error("--base is required: the commit or branch to compare this checkout with")
    sides: dict = {"base": [], "this": []}
    with tempfile.TemporaryDirectory(prefix="ddb2bt-ab-") as tmp:
        base_path = str(export(args.base, Path(tmp)))
        print(f"base: {args.base} (exported to {base_path}); this: {ROOT}; {time.strftime('%Y-%m-%d %H:%M')}")
        for i in range(args.rounds):
            print(f"round {i + 1}/{args.rounds} (load average {os.getloadavg()[0]:.1f})", flush=True)
            sides["base"] += run_side("base", base_path, args.changes, args.reps)
            sides["this"] += run_side("this", "", args.changes, args.reps)
    for label, runs in sides.items():
        print(f"{label}: min {min(runs):.1f}, median {statistics.median(runs):.1f}, max {max(runs):.1f} "
              f"us CPU per change over {len(runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
