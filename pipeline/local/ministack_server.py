"""Runs ministack (a local AWS emulator, the default) in this process, for the local
stack (``local_stack.LocalStack(dynamodb="ministack")``).

Started as a script by ministack's own Python (the virtualenv deploy/local/setup.sh
makes, .venv-ministack: ministack pins one botocore release, which would hold
ddb2bt's boto3 back), so it imports nothing of ddb2bt.

Why a launcher rather than ``python -m ministack``: ministack keeps its streams'
retention (24 h, as AWS does) in a module variable, not in an option. Setting it
here, before the server starts, lets a stack of its own trim within seconds, so
``TrimmedDataAccessException`` and the product's loud stop (docs/design.md §8) can
be tested and rehearsed locally. Everything else (bind address, port, services) is
ministack's own environment, set by the local stack.

It also gives point-in-time recovery's earliest restorable time as AWS does: the
time PITR was turned on (ministack answers "now" on every DescribeContinuousBackups,
so `ddb2bt recover` would find every change older than the call unrecoverable, and
the recovery rehearsal of docs/recover.md could never be practised on it).
"""
from __future__ import annotations

import json
import os
import sys
import time

# ministack's stream retention (24 h, as on AWS) can be shortened for a stack of its
# own, so trimming can be rehearsed and tested in seconds (set by the local stack).
MINISTACK_RETENTION_ENV = "DDB2BT_MINISTACK_STREAM_RETENTION_S"


def pitr_from_when_enabled(dynamodb) -> None:
    """Make ministack's DynamoDB (the module) answer EarliestRestorableDateTime with
    the time PITR was turned on on the table, as AWS does (within its recovery
    period, 35 days, longer than any local stack lives)."""
    enabled_at: dict = {}  # table name -> when PITR was turned on (epoch seconds)
    update, describe = dynamodb._update_continuous_backups, dynamodb._describe_continuous_backups

    def with_earliest(response: tuple, name: str) -> tuple:
        status, headers, body = response
        if status != 200 or name not in enabled_at:
            return response
        data = json.loads(body)
        pitr = data["ContinuousBackupsDescription"]["PointInTimeRecoveryDescription"]
        if pitr.get("PointInTimeRecoveryStatus") != "ENABLED":
            return response
        pitr["EarliestRestorableDateTime"] = enabled_at[name]
        pitr["LatestRestorableDateTime"] = time.time()
        return status, headers, json.dumps(data).encode("utf-8")

    def update_continuous_backups(data):
        name = dynamodb._normalize_table_name(data.get("TableName"))
        was_on = dynamodb._pitr_settings.get(name, False)  # a deleted table's setting is gone with it
        response = update(data)
        if dynamodb._pitr_settings.get(name, False):
            if not was_on or name not in enabled_at:
                enabled_at[name] = time.time()
        else:
            enabled_at.pop(name, None)
        return with_earliest(response, name)

    def describe_continuous_backups(data):
        name = dynamodb._normalize_table_name(data.get("TableName"))
        return with_earliest(describe(data), name)

    # ministack looks its handlers up in the module on every request
    dynamodb._update_continuous_backups = update_continuous_backups
    dynamodb._describe_continuous_backups = describe_continuous_backups


def main() -> None:
    from ministack.services import dynamodb

    retention = os.environ.get(MINISTACK_RETENTION_ENV)
    if retention:
        dynamodb._STREAM_RETENTION_SECONDS = float(retention)
    pitr_from_when_enabled(dynamodb)
    from ministack.app import main as serve

    sys.argv = [sys.argv[0]]  # ministack parses its own (foreground) arguments
    serve()


if __name__ == "__main__":
    main()
