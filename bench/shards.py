"""Shards and pacing (issue 36): how the live path's rate grows with the
stream's shards in one process, and its CPU per change with the AWS pacing off.

    .venv/bin/python bench/shards.py [--changes N]

Rows (each on the same fake stream and the same running cbtemulator as
bench/run.py):

  paced, one partition     1 / 2 / 4 shards read by one partition (the default:
                           --partitions auto gives one partition up to 8 shards);
                           5 GetRecords/s per shard, as on AWS
  paced, one per shard     1 / 2 / 4 partitions of one shard each
  unpaced                  1 shard, the pacer off (the fake stream is not AWS):
                           what the CPU does per change (counted from the job's
                           start to the last change applied); its ratio to the
                           raw-gRPC ceiling is bench/run.py's (same run)

Run nothing else meanwhile; figures are one run on this machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import (LAST_LIVE_RUN, MAPPING, RESULTS, fresh_table, run_ddb2bt, settle,  # noqa: E402
                       stream_records, unpaced)
from ddb2bt.pipeline.local.local_stack import LocalStack  # noqa: E402


def measure(stack, records, project, instance, **kw) -> dict:
    settle()
    wall = run_ddb2bt(records, project, instance, fresh_table(project, instance), **kw)
    # CPU over the interval the rate is measured on: the job's start to the last
    # change applied (bench/run.py's LAST_LIVE_RUN says why).
    n, cpu = len(records), LAST_LIVE_RUN["cpu_s"]
    return {"changes_per_s": round(n / wall), "client_cpu_us_per_change": round(cpu / n * 1e6, 1),
            "process_busy": round(cpu / wall, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=20_000, help="changes per row (default 20,000)")
    args = parser.parse_args()
    project, instance = MAPPING.target.project, MAPPING.target.instance
    out: dict = {"changes": args.changes, "paced_one_partition": {}, "paced_partition_per_shard": {}}
    with LocalStack() as stack:
        stack.apply_env()
        records = stream_records(args.changes)
        for shards in (1, 2, 4):
            out["paced_one_partition"][shards] = r = measure(stack, records, project, instance, partitions=1,
                                                             shards=shards)
            print(f"paced, 1 partition, {shards} shard(s): {r}", flush=True)
        for shards in (1, 2, 4):
            out["paced_partition_per_shard"][shards] = r = measure(stack, records, project, instance,
                                                                   partitions=shards)
            print(f"paced, {shards} partition(s) of 1 shard: {r}", flush=True)
        with unpaced():
            out["unpaced_1_shard"] = r = measure(stack, records, project, instance, partitions=1)
        print(f"unpaced, 1 shard: {r}", flush=True)
    for key in ("paced_one_partition", "paced_partition_per_shard"):
        rows = out[key]
        rows["4_over_1"] = round(rows[4]["changes_per_s"] / rows[1]["changes_per_s"], 2)
    path = RESULTS / f"shards-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
