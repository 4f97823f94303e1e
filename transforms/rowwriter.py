"""The compiled mapping's common row, written by code generated for the
image's shape: straight-line code per attribute, its column's constants bound in.

Most of the live path's changes are an image whose every attribute is a plain
column or not placed (``compiled._CompiledRule.plain_order``): one row, one
SetCell per attribute (and, when it prunes, one DeleteFromColumn before the
change's time). Walking such an image cell by cell — the loop, unpacking each
cell's plan and its column's constants, the family bookkeeping, the sums, a
call per encoder — cost more than the encoding. A shape's cells, columns and
families never change, so for each (shape, timestamp field length, time range
length, pruning) that work is done once, writing a function in which every
per-column value is a constant; only what depends on the values (their
encoding, their lengths) runs per change, and the encoders' usual cases run
inline. The bytes are those ``CompiledMapping._map`` writes for any cell
(transforms.wire's, the protobuf library's): tests/unit/transforms/test_row_writer.py
and the differential tests compare them with the general engine's.

Nothing from the mapping file is written into the generated source: attribute
names, columns and encoders are bound constants ``_kN``.

Where the package was built with a C compiler, the same row is written by
``rowwriter_c.c`` (``NATIVE``): one pass over the shape's columns in C, the
row's mutations returned as one bytes object, about a fifth of the generated
Python's CPU (docs/benchmarks.md). The generated Python stays the reference and the
fallback: ``DDB2BT_ROW_WRITER=python`` chooses it (to rule the C writer out
when in doubt), and tests/unit/transforms/test_row_writer.py holds the two to
the same bytes (and to the general engine's).
"""
from __future__ import annotations

from typing import Callable, Optional

from ddb2bt.transforms.attrs import dump_str
from ddb2bt.transforms.encoding import FALSE_BYTE, INT64_MAX, INT64_STRUCT, TRUE_BYTE
from ddb2bt.transforms.wire import (ENTRY_MUTATION, MUT_SET_CELL, ONE_BYTE_VARINT, SET_VALUE, VARINT_TABLE_SIZE,
                                    VARINTS, delete_cells, set_cell)

from ddb2bt.transforms.native import NATIVE, NATIVE_BUILT, ROW_WRITER_ENV, rowwriter_c

__all__ = ["plain_row_writer", "writer_key", "INLINE_S", "INLINE_AUTO", "INLINE_INT64", "LOOKED_UP", "MAX_ROW_WRITERS",
           "NATIVE", "NATIVE_BUILT", "ROW_WRITER_ENV", "SAFE_INT64_DIGITS"]

# How an attribute's encoder is written into the generated code: its usual
# cases inline, anything else through the encoder itself, which decides (and
# raises) as it always does. The kinds (compiled._INLINE names the encoders):
INLINE_S = "s"  # utf8: a one-tag {"S": text} is text.encode()
INLINE_AUTO = "auto"  # auto: S as utf8, N of plain digits as their text, BOOL as one byte, SS as JSON
INLINE_INT64 = "int64"  # int64: N of up to 18 digits packed big-endian
# The C writer's codes for them (rowwriter_c.c: KIND_*); 0: the encoder is called.
_NATIVE_KINDS = {None: 0, INLINE_S: 1, INLINE_AUTO: 2, INLINE_INT64: 3}


# int64: a string of at most this many ASCII digits is a non-negative integer below
# 2**63 (19 digits could overflow), so it needs no Decimal and no range check.
SAFE_INT64_DIGITS = len(str(INT64_MAX)) - 1
# The inline encoding looks a body's length and its mutation's (at most 3 bytes
# more: tag and a 2-byte length) up in VARINTS: bodies below this are.
LOOKED_UP = VARINT_TABLE_SIZE - 3
# Row writers one compiled mapping makes, at most: a few per shape of image (an
# insert's, a modify's, a backfill's), so this covers tables of dozens of shapes;
# a sparse table's rarer shapes take the compiled cell loop (the same bytes). Each
# writer is a code object of ~20 lines per attribute: this bounds their memory.
MAX_ROW_WRITERS = 256


def _string_set(members: list) -> Optional[bytes]:
    """auto's encoding of a string set, canonical JSON (compiled._json_text's: the
    members sorted, each a JSON string), or None unless every member is a str
    (the encoder then decides)."""
    for member in members:
        if type(member) is not str:
            return None
    return ("[" + ",".join([dump_str(member) for member in sorted(members)]) + "]").encode("utf-8")


def _encode(kind: Optional[str], enc: str, seen) -> list:
    """Lines setting ``p`` to the encoding of ``v``: the kind's usual cases
    inline (an auto value's tag as in ``seen``, the image the writer was made
    for, tried first: a column's values mostly keep their type), else ``enc(v)``."""
    if kind is None:
        return [f"    p = {enc}(v)"]
    if kind == INLINE_S:
        cases = [("S", "type(t) is str", "t.encode('utf-8')")]
    elif kind == INLINE_INT64:
        cases = [("N", f"type(t) is str and len(t) <= {SAFE_INT64_DIGITS} and t.isdigit() and t.isascii()",
                  "_pack(int(t))")]
    else:  # INLINE_AUTO, as compiled._fast_auto
        cases = [("S", "type(t) is str", "t.encode('utf-8')"),
                 ("N", "type(t) is str and t.isascii() and t.replace('.', '', 1).isdigit()", "t.encode('ascii')"),
                 ("BOOL", "type(t) is bool", "_TRUE if t else _FALSE"),
                 ("SS", "type(t) is list and (s := _string_set(t)) is not None", "s")]
        first = next(iter(seen)) if type(seen) is dict and len(seen) == 1 else None
        cases.sort(key=lambda case: case[0] != first)  # stable: the rest keep their order
    lines = ["    if type(v) is dict and len(v) == 1:"]
    indent = "        "
    for tag, test, value in cases:
        lines += [f"{indent}t = v.get({tag!r})",
                  f"{indent}if {test}:",
                  f"{indent}    p = {value}",
                  f"{indent}else:"]
        indent += "    "
    lines += [f"{indent}p = {enc}(v)",
              "    else:",
              f"        p = {enc}(v)"]
    return lines


def plain_row_writer(plain: tuple, column_of: Callable, ts_len: int, range_len: int, prune: bool,
                     inline: dict, sample, native: Optional[bool] = None) -> Callable:
    """``write(image, row_len, ts_field, prune_range) -> [count, size, wire
    pieces, families]``: the row entry of ``CompiledMapping._map`` (how many
    mutations, their request bytes, their wire bytes in pieces, their families)
    of an image of ``plain``'s shape, for timestamp fields of ``ts_len`` bytes
    and, when ``prune``, each column's delete over ``prune_range`` (a time range
    of ``range_len`` bytes). ``column_of(family,
    qualifier, range_len)``: the mapping's column constants (CompiledMapping._column).
    ``inline``: {encoder: INLINE_*} of the encoders whose usual cases are written
    inline; ``sample``: the image it is made for (its auto values' tags are
    tried first). ``native``: the C writer (default: ``NATIVE``), which needs
    neither ``ts_len`` nor ``range_len`` nor ``sample`` (it measures each row)."""
    if NATIVE if native is None else native:
        return _native_writer(plain, column_of, range_len, prune, inline)
    consts: dict = {}

    def const(value) -> str:
        name = f"_k{len(consts)}"
        consts[name] = value
        return name

    lines = ["def write(image, row_len, ts_field, prune_range):",
             "    pieces = []",
             "    put = pieces.extend",
             "    wire = pieces.append",
             "    total = 0"]
    fixed_sum = 0
    families: list = []
    for name, encode, family, qualifier, _ in plain:
        fields, n, fixed, _, delete_head = column_of(family, qualifier, range_len)
        if not families or families[-1] != family:  # sorted: a family's cells are consecutive
            families.append(family)
        fixed_sum += fixed + (fixed if prune else 0)
        enc = const(encode)
        lines.append(f"    v = image[{const(name)}]")
        lines += _encode(inline.get(encode), enc, sample.get(name))
        # the cell as _map writes a common one, its column's length and fields constants here
        lines += ["    n = len(p)",
                  "    total += n",
                  f"    b = {n + ts_len} + n + (2 if n < {ONE_BYTE_VARINT} else 3)",
                  f"    if 0 < n and b < {LOOKED_UP}:",
                  f"        put((_EM, _V[b + (2 if b < {ONE_BYTE_VARINT} else 3)], _MSC, _V[b], {const(fields)},"
                  " ts_field, _SV, _V[n], p))",
                  "    else:",
                  f"        wire(_set_cell({const(family)}, {const(qualifier)}, p, ts_field))"]
        if prune:
            if delete_head is not None:
                lines.append(f"    put(({const(delete_head)}, prune_range))")
            else:
                lines.append(f"    wire(_delete_cells({const(family)}, {const(qualifier)}, prune_range))")
    count = len(plain) * (2 if prune else 1)
    lines.append(f"    return [{count}, row_len + {fixed_sum} + total, pieces, list({const(tuple(families))})]")
    scope = {"_EM": ENTRY_MUTATION, "_MSC": MUT_SET_CELL, "_SV": SET_VALUE, "_V": VARINTS, "_set_cell": set_cell,
             "_delete_cells": delete_cells, "_pack": INT64_STRUCT.pack, "_TRUE": TRUE_BYTE, "_FALSE": FALSE_BYTE,
             "_string_set": _string_set,
             "dict": dict, "len": len, "type": type, "str": str, "bool": bool, "int": int, "list": list}
    scope.update(consts)
    exec(compile("\n".join(lines) + "\n", "<ddb2bt compiled row>", "exec"), scope)
    return scope["write"]


def _native_writer(plain: tuple, column_of: Callable, range_len: int, prune: bool, inline: dict) -> Callable:
    """The C writer (rowwriter_c.RowWriter) of ``plain``'s shape: the same
    arguments, the same answer, its row's wire bytes in one piece."""
    if rowwriter_c is None:
        raise RuntimeError("the C row writer is not built (install ddb2bt where a C compiler is; see "
                           "docs/development.md)")
    columns, families = [], []
    fixed_sum = 0
    for name, encode, family, qualifier, _ in plain:
        fields, _, fixed, _, _ = column_of(family, qualifier, range_len)
        if not families or families[-1] != family:  # sorted: a family's cells are consecutive
            families.append(family)
        fixed_sum += fixed + (fixed if prune else 0)
        columns.append((name, _NATIVE_KINDS[inline.get(encode)], encode, fields))
    return rowwriter_c.RowWriter(tuple(columns), prune, len(plain) * (2 if prune else 1), fixed_sum, tuple(families),
                                dump_str, TRUE_BYTE, FALSE_BYTE)


def writer_key(ts_len: int, range_len: int, prune: bool) -> tuple:
    """What a generated writer is specialized for, beside the shape."""
    return ts_len, range_len if prune else 0, prune
