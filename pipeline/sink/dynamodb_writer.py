"""The rollback's DynamoDB writer: whole items put or deleted, each conditional on
the version it replaces, so a replayed or reordered change never overwrites a
newer one (docs/design.md §12.2).

The version (the Bigtable commit time, in microseconds, of the change after which
the row was read) is kept in a side table beside the application's table, never
on the item: the application reads its items unchanged. One item's write and its
version's are one ``TransactWriteItems`` (atomic): the version row's condition
``attribute_not_exists(v) OR v < :v`` refuses an older write, and a delete keeps
its version row (a tombstone), so a late write of an item deleted since cannot
bring it back. Up to ``ITEMS_PER_TRANSACTION`` items go in one transaction; when
the service cancels it, the items whose condition failed are dropped (a newer
version is there: nothing to do) and the others are sent again. Calls are
retried with the clients' retry policy and paced by a write budget (--max-wcu).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from botocore.exceptions import BotoCoreError, ClientError

from ddb2bt.pipeline.clients.dynamodb import (
    StreamThrottled, TokenBucket, classify_aws_error, count_api_call, endpoint_of,
)
from ddb2bt.pipeline.clients.retry import DEFAULT_POLICY, RetryPolicy, retrying
from ddb2bt.transforms.attrs import canonical_typed_json
from ddb2bt.transforms.inverse_rows import DeleteItem, PutItem

VERSION_KEY = "item"  # the side table's key: the item's key as canonical typed JSON
VERSION_ATTRIBUTE = "v"  # the version (commit time, microseconds) of the state written
DELETED_ATTRIBUTE = "deleted"
ITEMS_PER_TRANSACTION = 25  # two actions each: within TransactWriteItems' 100
NEWER_HELD = "ConditionalCheckFailed"


def versions_table_name(table: str) -> str:
    """The side table of versions for the application's table ``table``."""
    return f"{table}.ddb2bt-rollback"


@dataclass(frozen=True)
class WriteOutcome:
    written: int = 0
    stale: int = 0  # refused: a newer version was already written
    capacity_units: float = 0.0
    deletes: int = 0  # of ``written``, the deletes

    @property
    def puts(self) -> int:
        return self.written - self.deletes


def _version_put(versions_table: str, write, deleted: bool) -> dict:
    return {"Put": {
        "TableName": versions_table,
        "Item": {VERSION_KEY: {"S": canonical_typed_json({"M": write.key})},
                 VERSION_ATTRIBUTE: {"N": str(write.version_us)}, DELETED_ATTRIBUTE: {"BOOL": deleted}},
        "ConditionExpression": "attribute_not_exists(#v) OR #v < :v",
        "ExpressionAttributeNames": {"#v": VERSION_ATTRIBUTE},
        "ExpressionAttributeValues": {":v": {"N": str(write.version_us)}},
    }}


def transaction_actions(versions_table: str, write) -> list:
    """The two actions of one write: the version row (conditional) and the item."""
    if isinstance(write, PutItem):
        return [_version_put(versions_table, write, False), {"Put": {"TableName": write.table, "Item": write.item}}]
    return [_version_put(versions_table, write, True), {"Delete": {"TableName": write.table, "Key": write.key}}]


def transactions(writes: Sequence) -> list:
    """The writes in order, cut into transactions of at most ITEMS_PER_TRANSACTION
    items in which no item appears twice (DynamoDB refuses two actions on one item)."""
    out: list = []
    keys: set = set()
    for write in writes:
        key = canonical_typed_json({"M": write.key}) + "\0" + write.table
        if not out or len(out[-1]) >= ITEMS_PER_TRANSACTION or key in keys:
            out.append([])
            keys = set()
        out[-1].append(write)
        keys.add(key)
    return out


class Cancelled(Exception):
    """A transaction the service cancelled; ``stale``: the indexes of the writes
    whose version condition failed (a newer version is held)."""

    def __init__(self, stale: set) -> None:
        super().__init__(f"{len(stale)} stale")
        self.stale = stale


class DynamoDBWriter:
    """Writes PutItem/DeleteItem values to one DynamoDB table and its versions table."""

    def __init__(self, client, versions_table: str, *, max_wcu: Optional[float] = None,
                 retry: RetryPolicy = DEFAULT_POLICY, metrics_table: Optional[str] = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self._client, self._versions = client, versions_table
        self._bucket = TokenBucket(max_wcu, clock=clock, sleep=sleep)
        self._retry, self._metrics_table, self._sleep = retry, metrics_table, sleep

    def write(self, writes: Sequence) -> WriteOutcome:
        written = stale = deletes = 0
        units = 0.0
        for chunk in transactions(writes):
            pending = chunk
            while pending:
                try:
                    units += self._send(pending)
                    written += len(pending)
                    deletes += sum(1 for w in pending if isinstance(w, DeleteItem))
                    pending = []
                except Cancelled as cancelled:
                    stale += len(cancelled.stale)
                    pending = [w for i, w in enumerate(pending) if i not in cancelled.stale]
        return WriteOutcome(written, stale, units, deletes)

    def _send(self, writes: list) -> float:
        actions = [a for w in writes for a in transaction_actions(self._versions, w)]

        def attempt() -> dict:
            count_api_call("TransactWriteItems", self._metrics_table)
            try:
                return self._client.transact_write_items(TransactItems=actions, ReturnConsumedCapacity="TOTAL")
            except ClientError as exc:
                error = exc.response.get("Error", {})
                if error.get("Code") == "TransactionCanceledException":
                    reasons = exc.response.get("CancellationReasons") or []
                    stale = {i // 2 for i, r in enumerate(reasons) if (r or {}).get("Code") == NEWER_HELD}
                    others = [r for r in reasons if (r or {}).get("Code") not in (None, "None", NEWER_HELD)]
                    if stale and not others:
                        raise Cancelled(stale) from None
                    if any((r or {}).get("Code") in ("TransactionConflict", "ThrottlingError",
                                                     "ProvisionedThroughputExceeded") for r in others):
                        raise StreamThrottled(f"TransactWriteItems: {error.get('Message', '')}",
                                              code="TransactionConflict") from exc
                raise classify_aws_error(exc, "TransactWriteItems", self._versions) from exc
            except BotoCoreError as exc:
                raise classify_aws_error(exc, "TransactWriteItems", self._versions) from exc

        response = retrying(self._retry, f"TransactWriteItems of {len(writes)} item(s)", retry_on=(StreamThrottled,),
                            where=endpoint_of(self._client), sleep=self._sleep)(attempt)
        units = sum(float(c.get("CapacityUnits", 0.0)) for c in response.get("ConsumedCapacity") or [])
        self._bucket.consume(units or 4.0 * len(writes))
        return units


def ensure_versions_table(client, name: str) -> bool:
    """Creates the versions table (on demand) when absent; True when it was created."""
    try:
        client.describe_table(TableName=name)
        return False
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") != "ResourceNotFoundException":
            raise classify_aws_error(exc, "DescribeTable", name) from exc
    client.create_table(TableName=name, BillingMode="PAY_PER_REQUEST",
                        KeySchema=[{"AttributeName": VERSION_KEY, "KeyType": "HASH"}],
                        AttributeDefinitions=[{"AttributeName": VERSION_KEY, "AttributeType": "S"}])
    client.get_waiter("table_exists").wait(TableName=name, WaiterConfig={"Delay": 1, "MaxAttempts": 60})
    return True
