"""ChangeRecord ⇄ JSON (dead letters, `explain`, fixtures) and boto3 stream record →
ChangeRecord. The one place the stream's wire shape is interpreted."""
from __future__ import annotations

import json
from typing import Any, Iterator, Mapping

from ddb2bt.transforms.attrs import item_from_dynamodb_json, item_to_dynamodb_json
from ddb2bt.transforms.model import (NO_CHANGE_TIME, REMOVE, ChangeRecord, RecordBatch, StreamPosition,
                                     datetime_to_ms)

TTL_PRINCIPAL = "dynamodb.amazonaws.com"
# Records per runner element: a full GetRecords page.
BATCH_RECORDS = 1000
# Yielded by a producer that has nothing ready: the records so far go out now.
FLUSH = object()


def from_stream_record(raw: Mapping[str, Any], stream_arn: str, shard_id: str) -> ChangeRecord:
    """A record from GetRecords (boto3 form) → ChangeRecord. Missing fields are kept
    missing (not invented) so the mapping dead-letters them with a precise reason."""
    # Runs for every record read: each field is looked up once.
    ddb = raw.get("dynamodb") or _NO_FIELDS
    event_name = raw.get("eventName", "")
    created = ddb.get("ApproximateCreationDateTime")
    size = ddb.get("SizeBytes")
    # Only a REMOVE is a TTL expiry: the service identity on any other event is
    # not a deletion, and `ttl.deletions: ignore` must not drop it.
    is_ttl_delete = False
    if event_name == REMOVE:
        identity = raw.get("userIdentity") or _NO_FIELDS
        is_ttl_delete = identity.get("Type") == "Service" and identity.get("PrincipalId") == TTL_PRINCIPAL
    return ChangeRecord(
        event_name=event_name,
        keys=ddb.get("Keys") or {},
        new_image=ddb.get("NewImage"),
        old_image=ddb.get("OldImage"),
        change_ms=datetime_to_ms(created) if created is not None else NO_CHANGE_TIME,
        position=StreamPosition(stream_arn, shard_id, ddb.get("SequenceNumber", "")),
        event_id=raw.get("eventID", ""),
        is_ttl_delete=is_ttl_delete,
        size_bytes=size if type(size) is int else int(size or 0),
        # Kinesis records carry the change time in µs where the destination says
        # MICROSECOND (source/kinesis.py): the ordering guard's finer clock.
        change_us=raw.get("changeMicros", -1),
    )


_NO_FIELDS: Mapping = {}  # read only: stands in for an absent field


def record_to_json(record: ChangeRecord, include_values: bool = True) -> str:
    """JSON for a dead letter. Without values the images are left out and only the
    keys are kept — what a redrive needs to find the item again (it re-reads the
    current item; the images, where it needs them, from the stream position)."""
    out: dict = {
        "eventName": record.event_name,
        "eventID": record.event_id,
        "changeMs": record.change_ms,
        "keys": _safe_image(record.keys),
        "ttlDelete": record.is_ttl_delete,
    }
    if not include_values:
        out["valuesOmitted"] = True
    if isinstance(record.position, StreamPosition):  # a backfilled item has no stream position
        out["position"] = {
            "streamArn": record.position.stream_arn,
            "shardId": record.position.shard_id,
            "sequenceNumber": record.position.sequence_number,
        }
    if include_values:
        for name, image in (("newImage", record.new_image), ("oldImage", record.old_image)):
            if image is not None:
                out[name] = _safe_image(image)
    return json.dumps(out, sort_keys=True, separators=(",", ":"))


def _safe_image(image: Mapping) -> Any:
    try:
        return item_to_dynamodb_json(image)
    except Exception:  # a malformed image is exactly what a dead letter must keep
        return repr(image)


# How a dead letter stored by earlier versions without values shows its keys
# (they were redacted then; a redrive finds such an item through its stream position).
REDACTED = "<redacted>"


def keys_redacted(record_json: str) -> bool:
    """The stored letter's keys were redacted (an earlier version's --no-dlq-include-values)."""
    try:
        keys = json.loads(record_json).get("keys") or {}
    except (ValueError, AttributeError):
        return True
    return any(v == REDACTED for v in keys.values()) or not keys


def values_omitted(record_json: str) -> bool:
    """The stored letter holds no images (--no-dlq-include-values)."""
    try:
        data = json.loads(record_json)
    except ValueError:
        return True
    return bool(data.get("valuesOmitted")) or keys_redacted(record_json)


def key_text(record_json: str, show: bool = True) -> str:
    """The item key of a stored dead letter, for a listing: ``pk="hats" sk="x#1"``
    (strings quoted, numbers as digits, binary as base64, anything else as its
    DynamoDB JSON); ``pk=<redacted>`` where the letter was stored without values.
    ``show=False`` (the CLI's key policy, ddb2bt.pipeline.observe.redaction) redacts a
    stored key as ``pk=<redacted: --show-keys>``."""
    from ddb2bt.pipeline.observe.redaction import KEY_REDACTED

    try:
        keys = json.loads(record_json).get("keys") or {}
    except (ValueError, AttributeError):
        return "(unreadable record)"
    parts = []
    for name in sorted(keys):
        value = keys[name]
        if value == REDACTED:
            shown = REDACTED
        elif not show:
            shown = KEY_REDACTED
        elif isinstance(value, dict) and len(value) == 1:
            ((tag, inner),) = value.items()
            shown = json.dumps(inner, ensure_ascii=False) if tag == "S" else (
                inner if tag in ("N", "B") and isinstance(inner, str) else json.dumps(value, sort_keys=True))
        else:
            shown = json.dumps(value, sort_keys=True)
        parts.append(f"{name}={shown}")
    return " ".join(parts) or "(no key)"


def record_from_json(text: str) -> ChangeRecord:
    data = json.loads(text)
    pos = data.get("position")
    return ChangeRecord(
        event_name=data["eventName"],
        keys=item_from_dynamodb_json(data["keys"]),
        new_image=item_from_dynamodb_json(data["newImage"]) if "newImage" in data else None,
        old_image=item_from_dynamodb_json(data["oldImage"]) if "oldImage" in data else None,
        change_ms=data["changeMs"],
        position=StreamPosition(pos["streamArn"], pos["shardId"], pos["sequenceNumber"]) if pos else None,
        event_id=data.get("eventID", ""),
        is_ttl_delete=data.get("ttlDelete", False),
    )


def batch_records(elements: Iterator, size: int = 0) -> Iterator:
    """Consecutive ChangeRecords → RecordBatch of up to ``size`` (default
    BATCH_RECORDS), in order; other elements (markers) pass alone between them;
    ``FLUSH`` sends the records so far. Returns (as the generator's value) what
    ``elements`` returned. Used by the stream reader, whose records were each
    claimed before they were batched (a round stopped by a split still emits the
    primary's), and by the backfill reader."""
    size = size or BATCH_RECORDS
    batch: list = []
    while True:
        try:
            element = next(elements)
        except StopIteration as stop:
            if batch:
                yield RecordBatch(tuple(batch))
            return stop.value
        if type(element) is ChangeRecord:
            batch.append(element)
            if len(batch) >= size:
                yield RecordBatch(tuple(batch))
                batch = []
            continue
        if batch:
            yield RecordBatch(tuple(batch))
            batch = []
        if element is not FLUSH:
            yield element
