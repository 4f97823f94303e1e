"""A dead letter's ChangeRecord ⇄ JSON: what the state store keeps
(``state.py``), what ``dlq list/show`` print and what a redrive reads back. On
the control floor beside the store, so the store imports nothing above it."""
from __future__ import annotations

import json
from typing import Any, Mapping

from ddb2bt.pipeline.observe.redaction import KEY_REDACTED
from ddb2bt.transforms.attrs import item_from_dynamodb_json, item_to_dynamodb_json
from ddb2bt.transforms.model import ChangeRecord, StreamPosition


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
