"""Cell value encodings. Each is reversible: ``decode(enc, encode(enc, v))``
gives back ``v`` (for ``auto``, given the attribute's DynamoDB type). A value that
does not fit its declared encoding raises ``MappingError(reason="encoding")`` —
never a silent coercion.

=============  ==========================  ===============================================
encoding       accepts                     bytes in the cell
=============  ==========================  ===============================================
utf8           S                           the string, UTF-8
int64          N, integral, 64-bit range   8-byte big-endian two's complement (Increment-compatible)
decimal        N                           the number's digits as ASCII, exactly as DynamoDB holds them
float64        N equal to the double       8-byte IEEE-754 big-endian double
               nearest to it (see below)
bytes          B                           the raw bytes (never base64: no double encoding)
bool           BOOL                        one byte, 0x01 true / 0x00 false
null           NULL                        empty
json           any                         canonical JSON (see ``ddb2bt.transforms.attrs``)
dynamodb_json  any                         canonical JSON of the typed value: {"N":"30"}
auto           any                         S→utf8, N→decimal, B→bytes, BOOL→bool,
                                           NULL→the byte 0xFF (AUTO_NULL), SS/NS/BS/M/L→json
=============  ==========================  ===============================================

What "reversible" means, exactly (``tests/unit/transforms/test_encoding_exact.py`` checks it
with hypothesis over DynamoDB's whole number range, 38 digits, 1E-130..9.99E+125):

* ``utf8``, ``bytes``, ``bool``, ``null``, ``decimal``, ``dynamodb_json``: the very
  value, number digits spelled as they came (``decimal`` keeps ``1E-130`` as
  ``1E-130`` and ``0.0000001`` as ``0.0000001``). Set members come back sorted.
* ``int64``: the integer, in positional digits.
* ``float64`` accepts a number when the double nearest to it, written as the
  shortest decimal that reads back as that double (Python's ``repr``), equals the
  number: ``0.1`` is accepted (its double is 0.1000000000000000055…, whose shortest
  form is ``0.1``), ``0.1000000000000000055`` and a 38-digit integer are refused.
  It decodes to that shortest form spelled as DynamoDB spells numbers (no exponent,
  no trailing zeros): ``100`` → ``100``, not ``100.0``; ``1e-7`` → ``0.0000001``.
* ``json``: every number keeps its digits and spelling (a valid JSON number token is
  written as is, and read back as the same token: ``0.0000001`` stays
  ``0.0000001``); a spelling that is not valid JSON (``.5``) is written as ``0.5``.
  JSON has no sets and no binary: give the source attribute's type (``SS``, ``NS``,
  ``BS``, ``B``) when decoding a top-level value; inside a map or list, sets come
  back as lists and binary as its base64 text (use ``dynamodb_json`` to keep them).
"""
from __future__ import annotations

import base64
import json
import math
import struct
from decimal import Decimal
from typing import Any, Callable, Optional

from ddb2bt.transforms.attrs import (
    as_bytes,
    canonical_json,
    canonical_number,
    canonical_typed_json,
    json_number,
    parse_number,
    type_of,
)
from ddb2bt.transforms.errors import MappingError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
INT64_STRUCT = struct.Struct(">q")
_FLOAT64 = struct.Struct(">d")
TRUE_BYTE = b"\x01"
FALSE_BYTE = b"\x00"
# ``auto``'s NULL: one byte that is never UTF-8 text, never a number's digits and
# never JSON, so a NULL reads apart from an empty string (utf8's b"") without the
# attribute's type. (``null``, whose attribute is NULL by declaration, keeps b"".)
AUTO_NULL = b"\xff"


def _want(value: Any, tags: tuple, encoding: str, where: str) -> Any:
    tag = type_of(value, where)
    if tag not in tags:
        raise MappingError(
            f"{where}: encoding {encoding!r} needs {'/'.join(tags)}, got {tag}", reason="encoding"
        )
    return value[tag]


# Payload encoders (the value inside {"S": ...}): shared by the declared encodings,
# which check the type first, and by ``auto``, which already knows it.


def _utf8_payload(text: str, where: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates cannot be stored as UTF-8
        raise MappingError(f"{where}: string is not valid Unicode", reason="encoding") from None


def decimal_payload(text: str, where: str) -> bytes:
    parse_number(text, where)
    return text.encode("ascii")


def _bool_payload(flag: bool, where: str) -> bytes:
    return TRUE_BYTE if flag else FALSE_BYTE


def _null_payload(_: Any, where: str) -> bytes:
    return b""


def _utf8(value: Any, where: str) -> bytes:
    return _utf8_payload(_want(value, ("S",), "utf8", where), where)


def _int64(value: Any, where: str) -> bytes:
    number = parse_number(_want(value, ("N",), "int64", where), where)
    if number != number.to_integral_value():
        raise MappingError(f"{where}: {number} is not an integer (encoding int64)", reason="encoding")
    integer = int(number)
    if not INT64_MIN <= integer <= INT64_MAX:
        raise MappingError(f"{where}: {integer} does not fit in 64 bits (encoding int64)", reason="encoding")
    return INT64_STRUCT.pack(integer)


def _decimal(value: Any, where: str) -> bytes:
    return decimal_payload(_want(value, ("N",), "decimal", where), where)


def _float64(value: Any, where: str) -> bytes:
    number = parse_number(_want(value, ("N",), "float64", where), where)
    as_float = float(number)
    if math.isinf(as_float) or Decimal(repr(as_float)) != number:
        nearest = "overflow" if math.isinf(as_float) else repr(as_float)
        raise MappingError(f"{where}: {number} is not a float64: the nearest double reads back as {nearest} "
                           "(use decimal to keep every digit)", reason="encoding")
    return _FLOAT64.pack(as_float)


def _bytes(value: Any, where: str) -> bytes:
    return as_bytes(_want(value, ("B",), "bytes", where), where)


def _bool(value: Any, where: str) -> bytes:
    return _bool_payload(_want(value, ("BOOL",), "bool", where), where)


def _null(value: Any, where: str) -> bytes:
    return _null_payload(_want(value, ("NULL",), "null", where), where)


def _json(value: Any, where: str) -> bytes:
    return canonical_json(value, where).encode("utf-8")


def _dynamodb_json(value: Any, where: str) -> bytes:
    return canonical_typed_json(value, where).encode("utf-8")


def _auto_null(_: Any, where: str) -> bytes:
    return AUTO_NULL


_AUTO_PAYLOAD = {"S": _utf8_payload, "N": decimal_payload, "B": as_bytes, "BOOL": _bool_payload,
                 "NULL": _auto_null}


def _auto(value: Any, where: str) -> bytes:
    tag = type_of(value, where)  # checked once here; the payload encoders trust it
    scalar = _AUTO_PAYLOAD.get(tag)
    return scalar(value[tag], where) if scalar is not None else _json(value, where)


ENCODERS: dict[str, Callable[[Any, str], bytes]] = {
    "utf8": _utf8,
    "int64": _int64,
    "decimal": _decimal,
    "float64": _float64,
    "bytes": _bytes,
    "bool": _bool,
    "null": _null,
    "json": _json,
    "dynamodb_json": _dynamodb_json,
    "auto": _auto,
}
ENCODINGS = tuple(ENCODERS)


def encode(encoding: str, value: Any, where: str = "value") -> bytes:
    return ENCODERS[encoding](value, where)


# --- decoding (used by verification and `explain`) ---------------------------------


class _NumberToken(str):
    """A JSON number's token, exactly as written (json.loads hands it over as text:
    going through Decimal would re-spell 0.0000001 as 1E-7)."""


def _from_json(obj: Any) -> Any:
    """Untyped canonical JSON → AttributeValue (numbers → N with their very digits)."""
    if isinstance(obj, bool):
        return {"BOOL": obj}
    if obj is None:
        return {"NULL": True}
    if isinstance(obj, _NumberToken):
        return {"N": str(obj)}
    if isinstance(obj, str):
        return {"S": obj}
    if isinstance(obj, dict):
        return {"M": {k: _from_json(v) for k, v in obj.items()}}
    return {"L": [_from_json(v) for v in obj]}


def _from_typed_json(obj: Any) -> Any:
    (tag, inner), = obj.items()
    if tag == "B":
        return {"B": base64.b64decode(inner)}
    if tag == "BS":
        return {"BS": [base64.b64decode(b) for b in inner]}
    if tag == "M":
        return {"M": {k: _from_typed_json(v) for k, v in inner.items()}}
    if tag == "L":
        return {"L": [_from_typed_json(v) for v in inner]}
    if tag == "NULL":
        return {"NULL": True}
    return {tag: inner}


def decode(encoding: str, data: bytes, dynamodb_type: Optional[str] = None) -> Any:
    """Bytes from a cell → AttributeValue. ``json`` cannot tell a set from a list
    or binary from a string; pass ``dynamodb_type`` (the source attribute's type)
    where it matters, or use ``dynamodb_json``."""
    if encoding == "auto" and (dynamodb_type == "NULL" or (dynamodb_type is None and data == AUTO_NULL)):
        # Given the type NULL, a cell written before AUTO_NULL existed (empty) reads as NULL too.
        return {"NULL": True}
    if encoding == "auto":
        encoding = {"S": "utf8", "N": "decimal", "B": "bytes", "BOOL": "bool", "NULL": "null"}.get(
            dynamodb_type or "", "json"
        )
    if encoding == "utf8":
        return {"S": data.decode("utf-8")}
    if encoding == "int64":
        return {"N": str(INT64_STRUCT.unpack(data)[0])}
    if encoding == "decimal":
        return {"N": data.decode("ascii")}
    if encoding == "float64":
        # The shortest decimal that reads back as the stored double, spelled as
        # DynamoDB spells numbers: 100 → "100" (repr would say "100.0").
        return {"N": canonical_number(Decimal(repr(_FLOAT64.unpack(data)[0])))}
    if encoding == "bytes":
        return {"B": bytes(data)}
    if encoding == "bool":
        return {"BOOL": data == TRUE_BYTE}
    if encoding == "null":
        return {"NULL": True}
    if encoding == "dynamodb_json":
        return _from_typed_json(json.loads(data.decode("utf-8")))
    if encoding == "json":
        value = _from_json(json.loads(data.decode("utf-8"), parse_float=_NumberToken, parse_int=_NumberToken))
        if dynamodb_type in ("SS", "NS", "BS") and "L" in value:
            members = value["L"]
            if dynamodb_type == "SS":
                return {"SS": [m["S"] for m in members]}
            if dynamodb_type == "NS":
                return {"NS": [m["N"] for m in members]}
            return {"BS": [base64.b64decode(m["S"]) for m in members]}
        if dynamodb_type == "B" and "S" in value:
            return {"B": base64.b64decode(value["S"])}
        return value
    raise ValueError(f"unknown encoding {encoding!r}")


__all__ = ["AUTO_NULL", "ENCODINGS", "encode", "decode", "json_number"]
