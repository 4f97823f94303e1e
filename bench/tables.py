"""Many tables in one job: changes/s of one job replicating 1 table against the
same job replicating 4 tables, the same total number of changes, each table its
own stream (a fake client with pre-generated pages, as in `run_ddb2bt`), mapping
copy, target table and state. Part of ``bench/run.py`` (section ``tables``);
alone::

    .venv/bin/python bench/tables.py [--changes N]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.run import MAPPING, fresh_table, run_live, settle, stream_records  # noqa: E402

TABLE_COUNTS = (1, 4)


def _table_mapping(table: str, source: str, name: str):
    return dataclasses.replace(MAPPING.with_overrides(table=table), name=name,
                               source=dataclasses.replace(MAPPING.source, table=source))


def run_tables(records_per_table: list, project: str, instance: str) -> float:
    """One job over len(records_per_table) tables; wall seconds until every
    change of every table was applied (the idle wait at the end excluded)."""
    from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec
    from ddb2bt.pipeline.graph import LiveJob
    from ddb2bt.pipeline.connect.preflight import ensure_state_table
    from ddb2bt.pipeline.source.stream_source import ReaderOptions
    from ddb2bt.pipeline.testing.fakes import FAKE_CLIENTS, FakeStreamsClient, RegisteredClient

    ensure_state_table(project, instance, "ddb2bt_state")
    jobs, total = [], 0
    for records in records_per_table:
        client = FakeStreamsClient(table=f"T{uuid.uuid4().hex[:6]}")
        client.add_shard("shardId-0000")
        for event, keys, new, old, ts in records:
            client.put("shardId-0000", event, keys, new, old, created_ms=ts)
        FAKE_CLIENTS[client.table] = client
        target = fresh_table(project, instance)
        jobs.append(LiveJob(mapping=_table_mapping(target, client.table, f"bench_{target}"),
                            stream_arn=client.stream_arn,
                            reader=ReaderOptions(until_idle_s=0.5, poll_interval_s=0.05, discovery_interval_s=60),
                            state=StateSpec(BigtableSpec(project, instance), job=f"bench_{target}"),
                            client_factory=RegisteredClient(client.table)))
        total += len(records)
    settle()
    return run_live(jobs, total)


def many_tables(n: int, project: str, instance: str, counts=TABLE_COUNTS) -> dict:
    """changes/s for each table count, n changes in total (n / k per table)."""
    out = {}
    for k in counts:
        per = n // k
        # different seeds: each table its own keys and values
        records = [stream_records(per, seed=10 + i) for i in range(k)]
        wall = run_tables(records, project, instance)
        out[f"tables_{k}"] = round(per * k / wall)
        print(f"  {k} table(s) in one job: {out[f'tables_{k}']:>8,} changes/s", flush=True)
    out["ratio_4_to_1"] = round(out[f"tables_{counts[-1]}"] / out[f"tables_{counts[0]}"], 2)
    out["changes"] = n
    return out


def main() -> int:
    from ddb2bt.pipeline.local.local_stack import LocalStack

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=20_000, help="changes in total per run (default 20,000)")
    args = parser.parse_args()
    with LocalStack() as stack:
        stack.apply_env()
        print(json.dumps(many_tables(args.changes, MAPPING.target.project, MAPPING.target.instance), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
