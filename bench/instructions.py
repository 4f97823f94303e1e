"""Instructions per change, counted by valgrind: a measure of the replicator's own
work that the machine's speed does not move. On this shared 2-core box the CPU
time of the same code swings by ±30 % from one minute to the next, so a change
worth a few per cent cannot be told by timing; the instructions executed can.

    .venv/bin/python bench/instructions.py live                # the unpaced live job, per change
    .venv/bin/python bench/instructions.py live --start        # ... and the job's start, in instructions
    .venv/bin/python bench/instructions.py micro sink          # a bench/micro_hotpath.py case
    PYTHONPATH=<dir holding ddb2bt/{pipeline,transforms,examples}> .venv/bin/python bench/instructions.py live
                                                                # another checkout's code, for an A/B

live: bench/run.py's ddb2bt contestant, unpaced (the pacer off: the fake stream
is not AWS), run under ``valgrind --tool=cachegrind`` after a 50-change job (the
process's first imports are not the job's, as in bench/run.py), for two sizes of
stream (``--changes`` and four times it), each also without the job (the harness
alone: generating and filling the fake stream, the emulators' start-up, the
small job); per change is
(job − harness at the larger size − the same at the smaller) ÷ the changes
between, every thread of this process counted (the emulators are other
processes, not counted); ``--start`` adds the job's fixed cost (the smaller
job, less its changes at the per-change rate). micro: ``micro_hotpath.py CASE``
with 1 and 3 repeats; per change is the difference ÷ (2 × changes).

Counted, not timed: a Python-level difference shows, but the instructions of
unlike operations (a gRPC call, a dict lookup) cost unlike time, and waits
(locks, the network) do not show at all; compare code versions with it, and
keep timing (bench/run.py) for rates. Runs take minutes: valgrind runs a
program ~50× slower (live: ~1 min for 2,000 changes here). Needs valgrind
(``apt-get install valgrind``).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# cachegrind without its cache simulation: instructions only ("I refs"), at the least slow-down.
VALGRIND = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]
I_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")
LARGER = 4  # the larger stream: this many times --changes

# The live job alone, as bench/run.py's unpaced row runs it: after a small job
# (so that what a process does once, its first imports, is not the job's, as in
# bench/run.py, where the job is not the first pipeline of the process); JOB=0:
# everything but the measured job.
WARM_UP_CHANGES = 50
LIVE_SCRIPT = """
import os, sys
sys.path.insert(0, {root!r})
import bench.run as harness
from ddb2bt.pipeline.local.local_stack import LocalStack

records = harness.stream_records(int(os.environ["N"]))
warm_up = harness.stream_records({warm_up})
# The harness's watcher looks every 20 ms whether the job is done (for its rate):
# under valgrind, ~50x slower, it would look ~50x as often per change and count
# as the job's. Not needed here: the job ends on its own (its idle end).
harness.DONE_POLL_S = 3600.0
with LocalStack() as stack:
    stack.apply_env()
    with harness.unpaced():
        harness.run_ddb2bt(warm_up, "bench-project", "bench-instance",
                           harness.fresh_table("bench-project", "bench-instance"))
        if os.environ["JOB"] == "0":
            harness.run_live = lambda job, total: 0.0
        harness.run_ddb2bt(records, "bench-project", "bench-instance",
                           harness.fresh_table("bench-project", "bench-instance"))
"""


def count(argv: list, env: dict) -> int:
    """Instructions valgrind counted running ``argv`` (every thread of it)."""
    done = subprocess.run(VALGRIND + argv, env={**os.environ, **env}, capture_output=True, text=True, cwd=ROOT)
    found = I_REFS.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"{' '.join(argv)} failed under valgrind (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def live(changes: int, start: bool) -> None:
    script = LIVE_SCRIPT.format(root=str(ROOT), warm_up=WARM_UP_CHANGES)
    python = [sys.executable, "-c", script]
    runs = {}
    for n in (changes, LARGER * changes):
        for job in ("1", "0"):
            runs[(n, job)] = count(python, {"N": str(n), "JOB": job})
            print(f"  {n:>7,} changes, {'job' if job == '1' else 'harness alone'}: {runs[(n, job)]:,} instructions",
                  flush=True)
    small, large = changes, LARGER * changes
    job_small = runs[(small, "1")] - runs[(small, "0")]
    job_large = runs[(large, "1")] - runs[(large, "0")]
    per_change = (job_large - job_small) / (large - small)
    print(f"live, unpaced: {per_change:,.0f} instructions per change")
    if start:
        print(f"the job's start (and end): {job_small - per_change * small:,.0f} instructions")


def micro(case: str, changes: int) -> None:
    argv = [sys.executable, str(ROOT / "bench" / "micro_hotpath.py"), case, "--changes", str(changes)]
    once = count(argv + ["--repeat", "1"], {})
    thrice = count(argv + ["--repeat", "3"], {})
    print(f"micro {case}: {(thrice - once) / (2 * changes):,.0f} instructions per change")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    live_p = sub.add_parser("live", help="the unpaced live job")
    live_p.add_argument("--changes", type=int, default=2_000, help="the smaller stream (the larger is 4x)")
    live_p.add_argument("--start", action="store_true", help="also the job's fixed cost")
    micro_p = sub.add_parser("micro", help="a bench/micro_hotpath.py case")
    micro_p.add_argument("case")
    micro_p.add_argument("--changes", type=int, default=5_000)
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    import ddb2bt.pipeline as package

    print(f"code under test: {Path(package.__file__).resolve().parent}")
    if args.what == "live":
        live(args.changes, args.start)
    else:
        micro(args.case, args.changes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
