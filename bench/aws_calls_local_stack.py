"""The Streams calls of a real `ddb2bt run` and `ddb2bt status` on the local
stack (moto + the Bigtable emulator), counted at the boto3 client (every call
the process sends, with its time): GetRecords per second on the backlogged
shard, DescribeStream calls per minute with ``--partitions 4``, and what
`status` calls. The measurement issue 22 made through a counting proxy.

    .venv/bin/python bench/aws_calls_local_stack.py [--items 10000] [--idle 60]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CALLS: list = []  # (operation, monotonic time)


def count_streams_calls() -> None:
    """Every dynamodbstreams client the process builds records its calls."""
    import boto3

    original = boto3.client

    def client(service, *args, **kwargs):
        made = original(service, *args, **kwargs)
        if service == "dynamodbstreams":
            made.meta.events.register("before-call.dynamodbstreams.*",
                                      lambda model, **_: CALLS.append((model.name, time.monotonic())))
        return made

    boto3.client = client


def max_per_second(times: list) -> int:
    times = sorted(times)
    return max((sum(1 for t in times[i:] if t < start + 1.0) for i, start in enumerate(times)), default=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--idle", type=float, default=60.0)
    args = parser.parse_args()
    from ddb2bt.pipeline.app import cli
    from ddb2bt.pipeline.connect.connections import dynamodb_client
    from ddb2bt.pipeline.local import workload
    from ddb2bt.pipeline.local.local_stack import LocalStack
    from tests.conftest import write_mapping

    stack = LocalStack(log_dir=Path(tempfile.mkdtemp()))
    stack.start()
    stack.apply_env()
    try:
        count_streams_calls()
        unique = uuid.uuid4().hex[:8]
        path = write_mapping(Path(tempfile.mkdtemp()), source__table=f"Rates_{unique}",
                             target__table=f"rates_{unique}", name=f"rates_{unique}")
        ddb = dynamodb_client()
        workload.create_table(ddb, f"Rates_{unique}")
        assert cli.main(["create-table", "--mapping", str(path)]) == 0
        for i in range(args.items):  # a backlog on the stream's shard
            ddb.put_item(TableName=f"Rates_{unique}", Item={"pk": {"S": f"p{i}"}, "sk": {"S": "a"}})
        started = time.monotonic()
        assert cli.main(["run", "--mapping", str(path), "--partitions", "4", "--until-idle", str(args.idle),
                         "--poll-interval", "0.25"]) == 0
        minutes = (time.monotonic() - started) / 60
        run_calls = list(CALLS)
        CALLS.clear()
        cli.main(["status", "--mapping", str(path)])
        status_calls = sorted({op for op, _ in CALLS})
    finally:
        stack.stop()
    get_records = [t for op, t in run_calls if op == "GetRecords"]
    describe = [t for op, t in run_calls if op == "DescribeStream"]
    print(f"run --partitions 4 for {minutes:.1f} min over {args.items} backlogged changes:")
    print(f"  most GetRecords calls in one second (one shard): {max_per_second(get_records)}")
    print(f"  DescribeStream calls per minute: {len(describe) / minutes:.1f}")
    print(f"status made: {', '.join(status_calls) or 'no Streams call'}")


if __name__ == "__main__":
    main()
