"""Row-key templates, e.g. ``{pk}#{sk}`` or ``tenant#{tenant}#{id|pad:10}``.

A template is literal text and ``{source|transform|transform:arg}`` placeholders.
``source`` is an attribute name (keys first, then the item image) or
``match.NAME`` for a regex capture of the entity rule that matched.

Injectivity (two different items can never share a row): every placeholder value
except the template's final token is escaped — ``\\`` becomes ``\\\\`` and the
delimiter ``d`` becomes ``\\d`` — and two placeholders must always be separated
by literal text containing the delimiter. The final value needs no escaping: the
decoder finds all earlier parts by their first unescaped delimiter and the rest is
the last part. So ``{pk}#{sk}`` with pk ``hats`` and sk ``fedoras#brandA`` is
``hats#fedoras#brandA`` exactly as in the Bigtable-for-DynamoDB-users document,
while a pk of ``a#b`` becomes ``a\\#b#…`` and cannot collide with pk ``a``.

Transforms (applied left to right to the value's text):
  pad:N           zero-pad an integer to N digits (negative numbers are refused:
                  they do not sort correctly as text)
  reverse         reverse the characters (sequential ids → spread writes)
  reverse_domain  com.google.drive ⇄ drive.google.com
  max_minus       2**63-1 − integer, zero-padded to 19 digits (newest first)
  strip_prefix:P  drop a required prefix P (``Invoice-0123`` → ``0123``)
  hex             binary key part as lowercase hex (keys stay readable)
  salt:N          the value's deterministic shard 0..N-1 (CRC-32 mod N), zero-padded:
                  a readable write-sharding prefix (``{OrderId|salt:15}#…``)
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from ddb2bt.transforms.attrs import as_bytes, parse_number, type_of
from ddb2bt.transforms.errors import ConfigError, MappingError

ESCAPE = b"\\"
MAX_INT64 = 2**63 - 1
MAX_INT64_DIGITS = len(str(MAX_INT64))
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


def _integer(text: str, where: str) -> int:
    number = parse_number(text, where)
    if number != number.to_integral_value():
        raise MappingError(f"{where}: {text!r} is not an integer", reason="row_key")
    return int(number)


def _pad(value: str, arg: str, where: str) -> str:
    integer = _integer(value, where)
    if integer < 0:
        raise MappingError(f"{where}: cannot zero-pad negative {integer}", reason="row_key")
    text = str(integer)
    if len(text) > int(arg):
        raise MappingError(f"{where}: {integer} has more than {arg} digits", reason="row_key")
    return text.zfill(int(arg))


def _max_minus(value: str, arg: str, where: str) -> str:
    integer = _integer(value, where)
    if not 0 <= integer <= MAX_INT64:
        raise MappingError(f"{where}: {integer} outside 0..2^63-1", reason="row_key")
    return str(MAX_INT64 - integer).zfill(MAX_INT64_DIGITS)


def _salt(value: str, arg: str, where: str) -> str:
    buckets = int(arg)
    return str(zlib.crc32(value.encode("utf-8")) % buckets).zfill(len(str(buckets - 1)))


def _strip_prefix(value: str, arg: str, where: str) -> str:
    if not value.startswith(arg):
        raise MappingError(f"{where}: value does not start with {arg!r}", reason="row_key")
    return value[len(arg):]


TRANSFORMS: dict[str, tuple[bool, Callable[[str, str, str], str]]] = {
    # name: (takes an argument, function(value, arg, where))
    "pad": (True, _pad),
    "reverse": (False, lambda v, a, w: v[::-1]),
    "reverse_domain": (False, lambda v, a, w: ".".join(reversed(v.split(".")))),
    "max_minus": (False, _max_minus),
    "strip_prefix": (True, _strip_prefix),
    "hex": (False, lambda v, a, w: v),  # handled on bytes, see part_value
    "salt": (True, _salt),
}


@dataclass(frozen=True, slots=True)
class Placeholder:
    source: str
    transforms: tuple  # tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class KeyTemplate:
    text: str
    tokens: tuple  # tuple[bytes | Placeholder, ...]
    delimiter: bytes

    @property
    def sources(self) -> tuple:
        return tuple(t.source for t in self.tokens if isinstance(t, Placeholder))


def parse_template(text: Any, delimiter: str, field: str) -> KeyTemplate:
    if not isinstance(text, str) or not text:
        raise ConfigError("must be a non-empty template string such as '{pk}#{sk}'", field)
    tokens: list = []
    pos = 0
    for m in _PLACEHOLDER.finditer(text):
        if m.start() > pos:
            tokens.append(text[pos:m.start()].encode("utf-8"))
        tokens.append(_parse_placeholder(m.group(1), field))
        pos = m.end()
    if pos < len(text):
        tokens.append(text[pos:].encode("utf-8"))
    for literal in (t for t in tokens if isinstance(t, bytes)):
        if b"{" in literal or b"}" in literal:
            raise ConfigError(f"unbalanced braces in {text!r}", field)
    delim = delimiter.encode("utf-8")
    for before, after in zip(tokens, tokens[1:]):
        if isinstance(before, Placeholder) and isinstance(after, Placeholder):
            raise ConfigError(
                f"placeholders {{{before.source}}} and {{{after.source}}} must be separated by the "
                f"delimiter {delimiter!r}, or two items could map to one row",
                field,
            )
    for i, tok in enumerate(tokens[:-1]):
        if isinstance(tok, Placeholder) and isinstance(tokens[i + 1], bytes) and delim not in tokens[i + 1]:
            raise ConfigError(
                f"the text after {{{tok.source}}} must contain the delimiter {delimiter!r} "
                "so the key can be split unambiguously",
                field,
            )
    return KeyTemplate(text=text, tokens=tuple(tokens), delimiter=delim)


def _parse_placeholder(body: str, field: str) -> Placeholder:
    pieces = [p.strip() for p in body.split("|")]
    source = pieces[0]
    if not source:
        raise ConfigError("empty placeholder '{}'", field)
    transforms = []
    for piece in pieces[1:]:
        name, _, arg = piece.partition(":")
        if name not in TRANSFORMS:
            raise ConfigError(
                f"unknown key transform {name!r} in {{{body}}} (known: {', '.join(sorted(TRANSFORMS))})", field
            )
        takes_arg = TRANSFORMS[name][0]
        if takes_arg and not arg:
            raise ConfigError(f"key transform {name!r} needs an argument, e.g. {name}:10", field)
        if name == "pad" and not arg.isdigit():
            raise ConfigError(f"pad needs a digit count, got {arg!r}", field)
        if name == "salt" and (not arg.isdigit() or not 2 <= int(arg) <= 1000):
            raise ConfigError(f"salt needs a bucket count between 2 and 1000, got {arg!r}", field)
        if not takes_arg and arg:
            raise ConfigError(f"key transform {name!r} takes no argument", field)
        transforms.append((name, arg))
    return Placeholder(source=source, transforms=tuple(transforms))


def escape(value: bytes, delimiter: bytes) -> bytes:
    return value.replace(ESCAPE, ESCAPE + ESCAPE).replace(delimiter, ESCAPE + delimiter)


def _resolve(source: str, keys: Mapping, item: Optional[Mapping], captures: Mapping, where: str) -> Any:
    if source.startswith("match."):
        name = source[len("match."):]
        if name not in captures:
            raise MappingError(f"{where}: no capture named {name!r}", reason="row_key")
        return {"S": captures[name]}
    value = keys.get(source)
    if value is None and item is not None:
        value = item.get(source)
    if value is None:
        raise MappingError(f"{where}: attribute {source!r} is missing", reason="missing_key_attribute")
    return value


def part_value(ph: Placeholder, value: Any, where: str) -> bytes:
    tag = type_of(value, where)
    if tag == "B":
        raw = as_bytes(value["B"], where)
        if any(name == "hex" for name, _ in ph.transforms):
            return raw.hex().encode("ascii")
        if ph.transforms:
            raise MappingError(f"{where}: only 'hex' applies to a binary key part", reason="row_key")
        return raw
    if tag == "S":
        text = value["S"]
    elif tag == "N":
        text = value["N"]
    else:
        raise MappingError(f"{where}: a key part must be S, N or B, got {tag}", reason="row_key")
    for name, arg in ph.transforms:
        text = TRANSFORMS[name][1](text, arg, where)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise MappingError(f"{where}: key part is not valid Unicode", reason="row_key") from None


def build_key(
    template: KeyTemplate,
    keys: Mapping,
    item: Optional[Mapping],
    captures: Mapping = {},
    where: str = "row_key",
) -> bytes:
    out = bytearray()
    last = len(template.tokens) - 1
    for i, tok in enumerate(template.tokens):
        if isinstance(tok, bytes):
            out += tok
            continue
        raw = part_value(tok, _resolve(tok.source, keys, item, captures, where), f"{where}{{{tok.source}}}")
        out += raw if i == last else escape(raw, template.delimiter)
    return bytes(out)


def split_key(template: KeyTemplate, key: bytes) -> list:
    """Inverse of ``build_key`` for the placeholder values (after transforms).
    Used by tests to prove injectivity and by verification to explain rows."""
    values: list = []
    pos = 0
    tokens = template.tokens
    for i, tok in enumerate(tokens):
        if isinstance(tok, bytes):
            if not key.startswith(tok, pos):
                raise ValueError("key does not match template")
            pos += len(tok)
            continue
        if i == len(tokens) - 1:
            values.append(key[pos:])
            pos = len(key)
            continue
        nxt = tokens[i + 1]  # a literal containing the delimiter (validated)
        head = nxt.split(template.delimiter)[0] + template.delimiter
        buf = bytearray()
        while True:
            if pos >= len(key):
                raise ValueError("key does not match template")
            if key.startswith(ESCAPE, pos):
                buf += key[pos + 1:pos + 2]
                pos += 2
                continue
            if key.startswith(head, pos) and head.endswith(template.delimiter):
                break
            buf += key[pos:pos + 1]
            pos += 1
        values.append(bytes(buf))
    if pos != len(key):
        raise ValueError("key has trailing bytes")
    return values
