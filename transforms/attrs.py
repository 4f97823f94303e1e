"""DynamoDB AttributeValues: shape checks, DynamoDB-JSON ⇄ boto3 form, and the
canonical JSON used for maps, lists and serialized items.

Values are kept in boto3's low-level form end to end (``{"N": "30"}``, ``{"B": b".."}``)
so numbers keep the exact digits DynamoDB holds and binary is never double-encoded.

Canonical JSON (documented in docs/mapping.md, Encodings): UTF-8, keys sorted by code point, no
insignificant whitespace, numbers as JSON numbers with DynamoDB's digits (only
re-spelled where DynamoDB's spelling is not valid JSON, e.g. ``.5`` → ``0.5``),
binary as standard base64 strings, sets as arrays sorted by value, NULL as null.
"""
from __future__ import annotations

import base64
import json
import re
from decimal import Decimal, InvalidOperation
from collections.abc import Mapping  # not typing.Mapping: isinstance on it is ~10x slower
from typing import Any

from ddb2bt.transforms.errors import MappingError

TYPE_TAGS = ("S", "N", "B", "BOOL", "NULL", "SS", "NS", "BS", "M", "L")
_TAG_SET = frozenset(TYPE_TAGS)
_JSON_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?\Z")


_BYTES = (bytes, bytearray, memoryview)
_PAYLOAD_OK = {
    "S": lambda v: isinstance(v, str),
    "N": lambda v: isinstance(v, str),
    "B": lambda v: isinstance(v, _BYTES),
    "BOOL": lambda v: isinstance(v, bool),
    "NULL": lambda v: v is True,
    "SS": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "NS": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "BS": lambda v: isinstance(v, list) and all(isinstance(x, _BYTES) for x in v),
    "M": lambda v: isinstance(v, Mapping) and all(isinstance(k, str) for k in v),
    "L": lambda v: isinstance(v, list),
}


def type_of(value: Any, where: str = "value") -> str:
    """The single type tag of an AttributeValue, or MappingError('bad_attribute').
    The payload's shape is checked too ({"S": 1} is refused here, once, instead of
    failing somewhere inside an encoder)."""
    if type(value) is dict and len(value) == 1:  # the hot path: boto3 gives plain dicts
        for tag, payload in value.items():
            if tag in _TAG_SET and _PAYLOAD_OK[tag](payload):
                return tag
    if not isinstance(value, Mapping) or len(value) != 1:
        raise MappingError(f"{where}: not a DynamoDB AttributeValue", reason="bad_attribute")
    ((tag, payload),) = value.items()
    if tag not in TYPE_TAGS:
        raise MappingError(f"{where}: unknown DynamoDB type {tag!r}", reason="bad_attribute")
    if not _PAYLOAD_OK[tag](payload):
        raise MappingError(f"{where}: a {tag} value must be {_EXPECTED[tag]}, got {type(payload).__name__}",
                           reason="bad_attribute")
    return tag


_EXPECTED = {"S": "a string", "N": "a string of digits", "B": "bytes", "BOOL": "true or false",
             "NULL": "true", "SS": "a list of strings", "NS": "a list of number strings",
             "BS": "a list of bytes", "M": "a map with string keys", "L": "a list"}


def parse_number(text: Any, where: str = "value") -> Decimal:
    if not isinstance(text, str):
        raise MappingError(f"{where}: N must be a string of digits", reason="bad_attribute")
    try:
        number = Decimal(text)
    except InvalidOperation:
        raise MappingError(f"{where}: {text!r} is not a number", reason="bad_attribute") from None
    if not number.is_finite():
        raise MappingError(f"{where}: {text!r} is not a finite number", reason="bad_attribute")
    return number


# DynamoDB's number type: up to 38 significant digits, and a magnitude (when not
# zero) from 1E-130 to 9.9999999999999999999999999999999999999E+125. DynamoDB
# refuses anything else, so a value outside it cannot come from the table.
MAX_SIGNIFICANT_DIGITS = 38
MIN_MAGNITUDE = Decimal("1E-130")
MAX_MAGNITUDE = Decimal("9.9999999999999999999999999999999999999E+125")


def _significant(number: Decimal) -> tuple:
    """(digits without leading/trailing zeros, exponent of the last kept digit).
    Done on the tuple: Decimal.normalize() would round to the context's 28 digits."""
    _, digits, exponent = number.as_tuple()
    digits = list(digits)
    while digits and digits[-1] == 0:
        digits.pop()
        exponent += 1
    while digits and digits[0] == 0:
        digits.pop(0)
    return tuple(digits), exponent


def check_dynamodb_number(number: Decimal, where: str = "value") -> Decimal:
    """``number`` if DynamoDB could hold it; otherwise MappingError('bad_number')
    saying which of DynamoDB's limits it breaks."""
    if not number.is_finite():
        raise MappingError(f"{where}: {number} is not a finite number (DynamoDB has no NaN or Infinity)",
                           reason="bad_number")
    digits, _ = _significant(number)
    if len(digits) > MAX_SIGNIFICANT_DIGITS:
        raise MappingError(f"{where}: {len(digits)} significant digits; DynamoDB keeps at most "
                           f"{MAX_SIGNIFICANT_DIGITS} (it would refuse this number)", reason="bad_number")
    if digits and not MIN_MAGNITUDE <= number.copy_abs() <= MAX_MAGNITUDE:  # abs() would round to 28 digits
        raise MappingError(f"{where}: magnitude out of DynamoDB's range 1E-130 to 9.99…E+125 (it would refuse "
                           "this number)", reason="bad_number")
    return number


def canonical_number(number: Decimal) -> str:
    """The number as DynamoDB spells it back: positional notation (no exponent),
    no leading or trailing zeros, ``0`` for any zero. ``1.50`` → ``1.5``,
    ``1e-7`` → ``0.0000001``, ``1E+2`` → ``100``."""
    if not number.is_finite():
        raise ValueError(f"{number} is not a finite number")
    digits, exponent = _significant(number)
    if not digits:
        return "0"
    return format(Decimal((number.is_signed(), digits, exponent)), "f")


def json_number(text: str, where: str = "value") -> str:
    """DynamoDB's digits as a JSON number token (unchanged when already valid JSON)."""
    if _JSON_NUMBER.match(text):
        return text
    number = parse_number(text, where)
    spelled = format(number, "f") if -30 < number.adjusted() < 30 else format(number, "E")
    if not _JSON_NUMBER.match(spelled):  # e.g. "1E+2" → "1E+2" is valid; guard anyway
        spelled = format(number.normalize(), "E")
    return spelled


def dump_str(value: str) -> str:
    # json.dumps(ensure_ascii=False) escapes only '"', '\\' and U+0000-U+001F;
    # a printable string has none of the latter, so without the first two it
    # is quoted as is (5x faster on the hot path: keys, markers, set members).
    if value.isprintable() and '"' not in value and "\\" not in value:
        return '"' + value + '"'
    return json.dumps(value, ensure_ascii=False)


def _sorted_numbers(values: list, where: str) -> list:
    return sorted(values, key=lambda t: (parse_number(t, where), t))


def canonical_json(value: Any, where: str = "value") -> str:
    """Canonical JSON of one AttributeValue (untyped: ``{"M": {"a": {"N": "1"}}}`` → ``{"a":1}``)."""
    tag = type_of(value, where)
    inner = value[tag]
    if tag == "S":
        return dump_str(inner)
    if tag == "N":
        return json_number(inner, where)
    if tag == "B":
        return dump_str(base64.b64encode(as_bytes(inner, where)).decode("ascii"))
    if tag == "BOOL":
        return "true" if inner else "false"
    if tag == "NULL":
        return "null"
    if tag == "SS":
        return "[" + ",".join(dump_str(s) for s in sorted(inner)) + "]"
    if tag == "NS":
        return "[" + ",".join(json_number(n, where) for n in _sorted_numbers(list(inner), where)) + "]"
    if tag == "BS":
        members = sorted(as_bytes(b, where) for b in inner)
        return "[" + ",".join(dump_str(base64.b64encode(b).decode("ascii")) for b in members) + "]"
    if tag == "M":
        parts = [f"{dump_str(k)}:{canonical_json(v, f'{where}.{k}')}" for k, v in sorted(inner.items())]
        return "{" + ",".join(parts) + "}"
    # L
    return "[" + ",".join(canonical_json(v, f"{where}[{i}]") for i, v in enumerate(inner)) + "]"


def canonical_typed_json(value: Any, where: str = "value") -> str:
    """Canonical JSON of the *typed* AttributeValue (``{"N":"1"}``): reversible to
    the exact DynamoDB type without any schema."""
    tag = type_of(value, where)
    inner = value[tag]
    if tag in ("S", "N"):
        body = dump_str(inner)
    elif tag == "B":
        body = dump_str(base64.b64encode(as_bytes(inner, where)).decode("ascii"))
    elif tag in ("BOOL", "NULL"):
        body = "true" if inner else "false"
    elif tag == "SS":
        body = "[" + ",".join(dump_str(s) for s in sorted(inner)) + "]"
    elif tag == "NS":
        body = "[" + ",".join(dump_str(n) for n in _sorted_numbers(list(inner), where)) + "]"
    elif tag == "BS":
        members = sorted(as_bytes(b, where) for b in inner)
        body = "[" + ",".join(dump_str(base64.b64encode(b).decode("ascii")) for b in members) + "]"
    elif tag == "M":
        body = "{" + ",".join(
            f"{dump_str(k)}:{canonical_typed_json(v, f'{where}.{k}')}" for k, v in sorted(inner.items())
        ) + "}"
    else:
        body = "[" + ",".join(canonical_typed_json(v, f"{where}[{i}]") for i, v in enumerate(inner)) + "]"
    return "{" + dump_str(tag) + ":" + body + "}"


def as_bytes(value: Any, where: str = "value") -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise MappingError(f"{where}: binary value is not bytes", reason="bad_attribute")


def _tag(value: Any, where: str = "value") -> str:
    """The type tag only (DynamoDB JSON carries B as base64 text, not bytes)."""
    if type(value) is dict and len(value) == 1:  # the hot path: json.loads gives plain dicts
        for tag in value:
            if tag in _TAG_SET:
                return tag
    if not isinstance(value, Mapping) or len(value) != 1:
        raise MappingError(f"{where}: not a DynamoDB AttributeValue", reason="bad_attribute")
    (tag,) = value.keys()
    if tag not in TYPE_TAGS:
        raise MappingError(f"{where}: unknown DynamoDB type {tag!r}", reason="bad_attribute")
    return tag


def from_dynamodb_json(value: Any) -> Any:
    """DynamoDB JSON as found in files and exports (B as base64 text) → boto3 form."""
    tag = _tag(value)
    inner = value[tag]
    if tag == "B":
        return {"B": base64.b64decode(inner, validate=True)}
    if tag == "BS":
        return {"BS": [base64.b64decode(b, validate=True) for b in inner]}
    if tag == "M":
        return {"M": {k: from_dynamodb_json(v) for k, v in inner.items()}}
    if tag == "L":
        return {"L": [from_dynamodb_json(v) for v in inner]}
    return value if type(value) is dict else {tag: inner}  # the same in both forms: no copy


def item_from_dynamodb_json(item: Mapping[str, Any]) -> dict:
    if type(item) is dict:
        # The common item (every export line, every Kinesis image) holds only
        # values spelled alike in both forms, which from_dynamodb_json returns
        # as they are: told by one look at each value, without a call per value
        # (half this function's CPU).
        for value in item.values():
            if type(value) is not dict or len(value) != 1:
                break
            for tag in value:
                if tag not in _SAME_IN_BOTH_FORMS:
                    break
            else:
                continue
            break
        else:
            return dict(item)
    return {name: from_dynamodb_json(v) for name, v in item.items()}


# The tags whose values DynamoDB JSON and the boto3 form spell alike (B and BS
# differ: base64 text against bytes; M and L hold values that may).
_SAME_IN_BOTH_FORMS = frozenset(("S", "N", "BOOL", "NULL", "SS", "NS"))


def to_dynamodb_json(value: Any) -> Any:
    """boto3 form → JSON-serialisable DynamoDB JSON (B as base64 text)."""
    tag = type_of(value)
    inner = value[tag]
    if tag == "B":
        return {"B": base64.b64encode(as_bytes(inner)).decode("ascii")}
    if tag == "BS":
        return {"BS": [base64.b64encode(as_bytes(b)).decode("ascii") for b in inner]}
    if tag == "M":
        return {"M": {k: to_dynamodb_json(v) for k, v in inner.items()}}
    if tag == "L":
        return {"L": [to_dynamodb_json(v) for v in inner]}
    return {tag: inner}


def item_to_dynamodb_json(item: Mapping[str, Any]) -> dict:
    return {name: to_dynamodb_json(v) for name, v in item.items()}


def from_plain(value: Any) -> Any:
    """Plain JSON (as a person writes it for ``explain``) → AttributeValue.
    ints/floats become N, str S, bool BOOL, None NULL, dict M, list L."""
    if isinstance(value, bool):
        return {"BOOL": value}
    if value is None:
        return {"NULL": True}
    if isinstance(value, (int, Decimal)):
        return {"N": str(value)}
    if isinstance(value, float):
        return {"N": repr(value)}
    if isinstance(value, str):
        return {"S": value}
    if isinstance(value, (bytes, bytearray)):
        return {"B": bytes(value)}
    if isinstance(value, Mapping):
        return {"M": {str(k): from_plain(v) for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        return {"L": [from_plain(v) for v in value]}
    raise MappingError(f"cannot convert {type(value).__name__} to a DynamoDB value", reason="bad_attribute")
