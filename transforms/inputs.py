"""What a user has at hand → boto3 form, exactly, refusing what DynamoDB would refuse.

``ddb2bt explain`` takes any of these (detected in this order):

1. a DynamoDB stream record as JSON (``{"eventName": …, "dynamodb": {…}}``, as in a
   Lambda event or ``aws dynamodbstreams get-records``), or a Lambda event
   ``{"Records": [record, …]}``;
2. ``{"Item": {…}}``: a GetItem response or a line of a DYNAMODB_JSON export;
3. a DynamoDB JSON item: every top-level value is one typed AttributeValue
   (``{"pk": {"S": "hats"}, "Price": {"N": "30"}}``);
4. plain JSON (``{"pk": "hats", "Price": 30}``): strings → S, numbers → N, true/false
   → BOOL, null → NULL, objects → M, arrays → L.

Numbers are never read through a float: every JSON number keeps its exact token
(π keeps all its digits, a 36-digit integer all 36). In DynamoDB JSON the N
string is kept as written; in plain JSON a number becomes N spelled as DynamoDB
spells it (``1e-7`` → ``0.0000001``, ``1.50`` → ``1.5``). Either way a number
DynamoDB would refuse (more than 38 significant digits, magnitude outside
1E-130..9.99…E+125) is refused with the reason, as are invalid base64 in ``B``/``BS``,
empty or duplicate-member sets, and a payload of the wrong shape. Once a document
is recognised as DynamoDB JSON it is never re-read as plain JSON: an error in it
is reported, not papered over.

Pure: no I/O. The result is boto3's form (``B`` as bytes, ``ApproximateCreationDateTime``
as a datetime), the same form botocore's parser gives the stream reader, so
``ddb2bt.pipeline.source.records.from_stream_record`` reads both alike.
"""
from __future__ import annotations

import base64
import binascii
import datetime as _dt
import json
from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal, InvalidOperation
from typing import Any, Optional

from ddb2bt.transforms.attrs import TYPE_TAGS, canonical_number, check_dynamodb_number
from ddb2bt.transforms.errors import MappingError

ITEM, STREAM_RECORDS = "item", "stream_records"
# Keys a GetItem response may carry next to "Item".
_GET_ITEM_EXTRA = frozenset({"ConsumedCapacity", "ResponseMetadata"})
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
_IDENTITY_KEYS = {"type": "Type", "principalId": "PrincipalId"}


@dataclass(frozen=True)
class UserInput:
    """A parsed input: one item (``kind == ITEM``) or stream records in boto3 form."""

    kind: str
    item: Optional[dict] = None
    records: tuple = ()
    shape: str = ""  # what it was recognised as, for the user ("DynamoDB JSON item", ...)


class _Number(str):
    """A JSON number's exact token."""


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and not isinstance(value, _Number)


def _refuse_constant(name: str) -> Any:
    raise MappingError(f"{name} is not a number DynamoDB can hold", reason="bad_number")


def loads_exact(text: str) -> Any:
    """json.loads keeping every number's token (no float, no Decimal re-spelling)."""
    try:
        return json.loads(text, parse_float=_Number, parse_int=_Number, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise MappingError(f"not valid JSON: {exc}", reason="bad_input") from None


def parse_user_input(text: str) -> UserInput:
    data = loads_exact(text)
    if not isinstance(data, dict):
        raise MappingError(f"expected a JSON object (an item or a stream record), got {type(data).__name__}",
                           reason="bad_input")
    if isinstance(data.get("Records"), list):
        records = tuple(stream_record(r, f"Records[{i}]") for i, r in enumerate(data["Records"]))
        if not records:
            raise MappingError("the event has no Records", reason="bad_input")
        return UserInput(STREAM_RECORDS, records=records, shape="Lambda event")
    if isinstance(data.get("dynamodb"), dict):
        return UserInput(STREAM_RECORDS, records=(stream_record(data, "record"),), shape="stream record")
    if "Item" in data and isinstance(data["Item"], dict) and set(data) - {"Item"} <= _GET_ITEM_EXTRA:
        inner = data["Item"]
        if is_dynamodb_json(inner):
            return UserInput(ITEM, item=typed_item(inner, "Item"), shape='{"Item": …} (DynamoDB JSON)')
        return UserInput(ITEM, item=plain_item(inner, "Item"), shape='{"Item": …} (plain JSON)')
    if data and is_dynamodb_json(data):
        return UserInput(ITEM, item=typed_item(data), shape="DynamoDB JSON item")
    return UserInput(ITEM, item=plain_item(data), shape="plain JSON item")


def is_dynamodb_json(item: dict) -> bool:
    """Every value is one typed AttributeValue (a one-key object whose key is a type tag)."""
    return bool(item) and all(isinstance(v, dict) and len(v) == 1 and next(iter(v)) in TYPE_TAGS
                              for v in item.values())


# --- DynamoDB JSON ---------------------------------------------------------------------


def typed_item(item: Any, where: str = "") -> dict:
    if not isinstance(item, dict):
        raise MappingError(f"{where or 'item'}: must be an object of attributes", reason="bad_attribute")
    return {name: typed_value(v, f"{where}.{name}" if where else name) for name, v in item.items()}


def _number_text(payload: Any, where: str) -> str:
    if not _is_text(payload):
        raise MappingError(f"{where}: N must be a string of digits (DynamoDB JSON quotes numbers), "
                           f"got {payload!r}", reason="bad_attribute")
    try:
        number = Decimal(payload)
    except InvalidOperation:
        raise MappingError(f"{where}: {payload!r} is not a number", reason="bad_number") from None
    check_dynamodb_number(number, where)
    return str(payload)


def _binary(payload: Any, where: str) -> bytes:
    if not _is_text(payload):
        raise MappingError(f"{where}: B must be base64 text", reason="bad_attribute")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MappingError(f"{where}: {payload!r} is not valid base64 ({exc})", reason="bad_attribute") from None


def _set(members: Any, tag: str, where: str, member) -> list:
    if not isinstance(members, list):
        raise MappingError(f"{where}: {tag} must be a list", reason="bad_attribute")
    if not members:
        raise MappingError(f"{where}: an empty {tag}: DynamoDB does not allow empty sets", reason="bad_attribute")
    out = [member(m, f"{where}[{i}]") for i, m in enumerate(members)]
    seen = [Decimal(m) for m in out] if tag == "NS" else out
    if len(set(seen)) != len(seen):
        raise MappingError(f"{where}: {tag} has duplicate members: DynamoDB does not allow them",
                           reason="bad_attribute")
    return out


def _string(payload: Any, where: str) -> str:
    if not _is_text(payload):
        raise MappingError(f"{where}: S must be a string, got {payload!r}", reason="bad_attribute")
    return str(payload)


def typed_value(value: Any, where: str) -> dict:
    """One DynamoDB JSON AttributeValue → boto3 form, strictly."""
    if not isinstance(value, dict) or len(value) != 1:
        raise MappingError(f"{where}: not a DynamoDB AttributeValue (one type tag such as {{\"S\": …}})",
                           reason="bad_attribute")
    ((tag, payload),) = value.items()
    if tag == "S":
        return {"S": _string(payload, where)}
    if tag == "N":
        return {"N": _number_text(payload, where)}
    if tag == "B":
        return {"B": _binary(payload, where)}
    if tag == "BOOL":
        if not isinstance(payload, bool):
            raise MappingError(f"{where}: BOOL must be true or false", reason="bad_attribute")
        return {"BOOL": payload}
    if tag == "NULL":
        if payload is not True:
            raise MappingError(f"{where}: NULL must be true", reason="bad_attribute")
        return {"NULL": True}
    if tag == "SS":
        return {"SS": _set(payload, tag, where, _string)}
    if tag == "NS":
        return {"NS": _set(payload, tag, where, _number_text)}
    if tag == "BS":
        return {"BS": _set(payload, tag, where, _binary)}
    if tag == "M":
        if not isinstance(payload, dict):
            raise MappingError(f"{where}: M must be an object", reason="bad_attribute")
        return {"M": {k: typed_value(v, f"{where}.{k}") for k, v in payload.items()}}
    if tag == "L":
        if not isinstance(payload, list):
            raise MappingError(f"{where}: L must be a list", reason="bad_attribute")
        return {"L": [typed_value(v, f"{where}[{i}]") for i, v in enumerate(payload)]}
    raise MappingError(f"{where}: unknown DynamoDB type {tag!r}", reason="bad_attribute")


# --- plain JSON ------------------------------------------------------------------------


def plain_item(item: dict, where: str = "") -> dict:
    return {str(k): plain_value(v, f"{where}.{k}" if where else str(k)) for k, v in item.items()}


def plain_value(value: Any, where: str) -> dict:
    if isinstance(value, bool):
        return {"BOOL": value}
    if value is None:
        return {"NULL": True}
    if isinstance(value, _Number):
        return {"N": canonical_number(check_dynamodb_number(Decimal(value), where))}
    if isinstance(value, str):
        return {"S": value}
    if isinstance(value, dict):
        return {"M": plain_item(value, where)}
    if isinstance(value, list):
        return {"L": [plain_value(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    raise MappingError(f"{where}: cannot convert {type(value).__name__} to a DynamoDB value", reason="bad_attribute")


# --- stream records --------------------------------------------------------------------


def change_time(value: Any, where: str) -> _dt.datetime:
    """ApproximateCreationDateTime as JSON has it: epoch seconds (a Lambda event,
    boto3's JSON) or an ISO-8601 string (the AWS CLI) → an aware datetime, exact
    to the millisecond (rounded down, as the stream reader does)."""
    if isinstance(value, _Number):
        ms = (Decimal(value) * 1000).to_integral_value(rounding=ROUND_FLOOR)
        return _EPOCH + _dt.timedelta(milliseconds=int(ms))
    if isinstance(value, str):
        try:
            parsed = _dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise MappingError(f"{where}: {value!r} is not a time", reason="bad_record") from None
        return parsed if parsed.tzinfo else parsed.replace(tzinfo=_dt.timezone.utc)
    raise MappingError(f"{where}: {value!r} is not a time", reason="bad_record")


def stream_record(raw: Any, where: str) -> dict:
    """A stream record as JSON → the boto3 form GetRecords gives (B as bytes, the
    change time as a datetime). Fields it lacks stay missing, so the mapping says
    precisely what is wrong (e.g. no ApproximateCreationDateTime)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("dynamodb"), dict):
        raise MappingError(f"{where}: a stream record needs a 'dynamodb' object", reason="bad_record")
    out = {k: v for k, v in raw.items() if k != "dynamodb"}
    identity = raw.get("userIdentity")
    if isinstance(identity, dict):
        # Lambda events spell it {"type", "principalId"}; GetRecords {"Type", "PrincipalId"}.
        out["userIdentity"] = {_IDENTITY_KEYS.get(k, k): v for k, v in identity.items()}
    ddb = raw["dynamodb"]
    converted: dict = {}
    for name, value in ddb.items():
        path = f"{where}.dynamodb.{name}"
        if name in ("Keys", "NewImage", "OldImage"):
            converted[name] = typed_item(value, path)
        elif name == "ApproximateCreationDateTime":
            converted[name] = change_time(value, path)
        elif name == "SizeBytes":
            converted[name] = int(value)
        else:
            converted[name] = str(value) if isinstance(value, _Number) else value
    out["dynamodb"] = converted
    return out
