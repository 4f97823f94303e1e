"""What the retry policy (ddb2bt.pipeline.clients.retry, built on tenacity) costs a
call that succeeds at once, on the sink's path: the sink builds one policy object
per MutateRows request (``retrying(...)(attempt)``, pipeline/sink/requests.py),
so that is what is timed here, against calling the attempt bare.

    .venv/bin/python bench/retry_overhead.py                 # per call, and per change on the sink's path
    .venv/bin/python bench/retry_overhead.py --calls 20000 --repeat 7

Per call: CPU (thread time) of ``--calls`` calls, ``--repeat`` rounds; min /
median / max over the rounds, in microseconds. Per change: the same overhead
times the policy calls a change costs in bench/micro_hotpath.py's sink case (the
20,000 changes of bench/run.py, pre-mapped, through BatchingWriter; every policy
call counted), set against that case's CPU per change. Compare code versions by
running this with another checkout first on the path, as bench/micro_hotpath.py.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def per_call_us(calls: int, make_call) -> float:
    t0 = time.thread_time()
    for _ in range(calls):
        make_call()
    return (time.thread_time() - t0) / calls * 1e6


def spread(values: list) -> str:
    values = sorted(values)
    return f"min {values[0]:.2f} / median {values[len(values) // 2]:.2f} / max {values[-1]:.2f}"


def policy_calls_per_change(changes: int) -> tuple:
    """The sink case of bench/micro_hotpath.py run once with every policy call
    counted; returns (policy calls per change, the case's CPU us per change)."""
    from bench.micro_hotpath import sink_case
    from ddb2bt.pipeline.clients import retry

    counted = [0]
    real_call = retry.Retrying.__call__

    def counting(self, fn):
        counted[0] += 1
        return real_call(self, fn)

    run = sink_case(changes)
    gc.collect()
    gc.freeze()
    run()  # warm-up
    retry.Retrying.__call__ = counting
    try:
        t0 = time.process_time()
        run()
        cpu_us = (time.process_time() - t0) / changes * 1e6
    finally:
        retry.Retrying.__call__ = real_call
    return counted[0] / changes, cpu_us


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--changes", type=int, default=20_000)
    args = parser.parse_args()
    import ddb2bt.pipeline as package
    from ddb2bt.pipeline.clients.retry import DEFAULT_POLICY, retrying

    print(f"code under test: {Path(package.__file__).resolve().parent}")

    def attempt():
        return None

    def on_retry(exc):
        return None

    def through_the_policy():
        return retrying(DEFAULT_POLICY, "MutateRows on t", on_retry, time.sleep,
                        where="Bigtable (127.0.0.1:1)")(attempt)

    bare, policy = [], []
    for round_ in range(args.repeat + 1):  # interleaved; the first round warms up and is not kept
        b, p = per_call_us(args.calls, attempt), per_call_us(args.calls, through_the_policy)
        if round_:
            bare.append(b)
            policy.append(p)
    overhead = sorted(p - b for p, b in zip(policy, bare))
    print(f"bare call: {spread(bare)} us")
    print(f"through the policy (built per call, as the sink does): {spread(policy)} us")
    print(f"overhead per call: {spread(overhead)} us")
    calls, sink_us = policy_calls_per_change(args.changes)
    median = overhead[len(overhead) // 2]
    print(f"sink path: {calls:.4f} policy calls per change; the sink case's CPU {sink_us:.1f} us per change; "
          f"overhead {median * calls:.3f} us per change ({median * calls / sink_us:.2%} of it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
