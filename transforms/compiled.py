"""The mapping compiled: each rule turned, once, into specialised code.

``compile_mapping(mapping)`` builds (once per MappingConfig, kept on it) a callable
with ``map_change``'s contract — ``(record, mark_touched) -> tuple[RowChange, ...]``
— whose per-change work is straight-line: rule selection and row-key templates are
generated Python functions (the mapping's text only ever enters them as bound
constants, never as source), each attribute's placement is decided once per
attribute name and keeps its encoder bound, literal qualifiers and their sizes are
precomputed, and mutations, sizes and versions are produced in one pass — the
mutations only as the bytes the sink sends, ``RowChange.wire`` (``transforms.wire``;
the tests hold them to the protobuf library's), their tuples decoded from those
bytes only if something reads ``RowChange.mutations`` (``model.EncodedMutations``).

The general engine (``mapping.general_map_change``) stays the reference and the
specification: the compiled path produces exactly its RowChanges (docs/design.md §3,
§5, §7: the same cells, mutations in the same order, the same sizes, guards and
versions). It only takes the happy path itself. Anything it does not handle — a
hook rule, a value in an unusual shape, a key part needing escaping of binary data,
a limit that might be broken, or any error — makes it hand the whole record to the
general engine, which then maps it or raises the very dead-letter reason and message
it always did. So the compiled path never has to reproduce an error message, only
to never accept what the general engine refuses: every check it skips is one it
proves cannot fail (``_UNCHECKED_ROW_BYTES``), every value it does not recognise
goes to the general helper that would have seen it.
"""
from __future__ import annotations

import datetime as _dt
from typing import Callable, Optional

from ddb2bt.transforms.attrs import dump_str, canonical_json, canonical_typed_json, json_number
from ddb2bt.transforms.config import ColumnConfig, IndexConfig, MappingConfig, MatchCondition, RuleConfig, memo
from ddb2bt.transforms.encoding import ENCODERS, decimal_payload, INT64_STRUCT, FALSE_BYTE, TRUE_BYTE
from ddb2bt.transforms.limits import MAX_QUALIFIER_BYTES, MAX_ROW_KEY_BYTES, MAX_TIMESTAMP_MS, checked_size
from ddb2bt.transforms.mapping import (PLAN_COLUMN, INCLUSIVE_END_MS, PLAN_PLAIN, PLAN_SKIP, PLAN_UNMAPPED, INDEX_POINTER,
                                       MARKER_FAMILY, MARKER_PREFIX, MAX_PLANNED_ATTRIBUTES, attribute_plan,
                                       column_cells, condition_matches, CellOwner, OwnedCell, general_map_change,
                                       owned_cells, parse_timestamp_ms, validate_record)
from ddb2bt.transforms.model import (INSERT, MODIFY, MUTATION_OVERHEAD_BYTES, REMOVE, EncodedMutations,
                                     build_guard, build_row_change)
from ddb2bt.transforms.rowkey import ESCAPE, TRANSFORMS, KeyTemplate, part_value
from ddb2bt.transforms.rowwriter import (INLINE_AUTO, INLINE_INT64, INLINE_S, LOOKED_UP, MAX_ROW_WRITERS,
                                         SAFE_INT64_DIGITS, plain_row_writer, writer_key)
from ddb2bt.transforms.wire import (DELETE_TIME_RANGE, ENTRY_MUTATION, MUT_DELETE_FROM_COLUMN, MUT_SET_CELL,
                                    ONE_BYTE_VARINT, RANGE_END, SET_TIMESTAMP, SET_VALUE, US_PER_MS, VARINT_TABLE_SIZE,
                                    VARINTS, column_fields, decode_mutations, delete_cells, range_field, set_cell,
                                    timestamp_field, timestamp_varint)

# A row whose request bytes are at most this cannot break any of Bigtable's
# per-row limits (limits.checked_size): every part a limit bounds — row key,
# qualifier, value — is counted in those bytes, the smallest such limit is the
# qualifier's (16 KiB), and each mutation counts at least MUTATION_OVERHEAD_BYTES,
# so such a row has far fewer than MAX_MUTATIONS_PER_REQUEST. The row key's own
# limit (4 KiB) and emptiness are checked separately; larger rows go through
# checked_size itself.
_UNCHECKED_ROW_BYTES = MAX_QUALIFIER_BYTES
_EMPTY: dict = {}  # captures of a rule without regex conditions (never written to)
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
_EPOCH_NAIVE = _dt.datetime(1970, 1, 1)
_ONE_MS = _dt.timedelta(milliseconds=1)


class _Fallback(Exception):
    """The compiled path does not take this record: the general engine maps it."""


# --- encoders: the common shape inline, anything else through the general one ---


def _fast_utf8(value) -> bytes:
    if type(value) is dict and len(value) == 1:
        text = value.get("S")
        if type(text) is str:
            return text.encode("utf-8")  # a lone surrogate raises: the general engine reports it
    return ENCODERS["utf8"](value, "")


def _fast_int64(value) -> bytes:
    if type(value) is dict and len(value) == 1:
        text = value.get("N")
        if type(text) is str and len(text) <= SAFE_INT64_DIGITS and text.isdigit() and text.isascii():
            return INT64_STRUCT.pack(int(text))
    return ENCODERS["int64"](value, "")


def _plain_decimal(text: str) -> bytes:
    """decimal_payload: ASCII digits with at most one point are a finite number
    as they are; anything else is parsed by the general encoder."""
    if text.isascii() and text.replace(".", "", 1).isdigit():
        return text.encode("ascii")
    return decimal_payload(text, "")


def _fast_decimal(value) -> bytes:
    if type(value) is dict and len(value) == 1:
        text = value.get("N")
        if type(text) is str:
            return _plain_decimal(text)
    return ENCODERS["decimal"](value, "")


def _fast_auto(value) -> bytes:
    if type(value) is dict and len(value) == 1:
        text = value.get("S")
        if type(text) is str:
            return text.encode("utf-8")
        text = value.get("N")
        if type(text) is str:
            return _plain_decimal(text)
        flag = value.get("BOOL")
        if type(flag) is bool:
            return TRUE_BYTE if flag else FALSE_BYTE
        if "B" not in value and "NULL" not in value:  # the rest is canonical JSON
            return _json_text(value).encode("utf-8")
    return ENCODERS["auto"](value, "")


def _json_text(value) -> str:
    """attrs.canonical_json for strings, numbers, maps and lists (its very text:
    the same pieces joined the same way); anything else through it."""
    if type(value) is dict and len(value) == 1:
        inner = value.get("S")
        if type(inner) is str:
            return dump_str(inner)
        inner = value.get("N")
        if type(inner) is str:
            return json_number(inner, "")
        inner = value.get("M")
        if type(inner) is dict and all(type(k) is str for k in inner):
            return "{" + ",".join([dump_str(k) + ":" + _json_text(v) for k, v in sorted(inner.items())]) + "}"
        inner = value.get("L")
        if type(inner) is list:
            return "[" + ",".join([_json_text(v) for v in inner]) + "]"
        inner = value.get("SS")
        if type(inner) is list and all(type(member) is str for member in inner):
            return "[" + ",".join([dump_str(member) for member in sorted(inner)]) + "]"
    return canonical_json(value)


def _fast_json(value) -> bytes:
    return _json_text(value).encode("utf-8")


def _key_json(keys) -> bytes:
    """canonical_typed_json({"M": keys}) encoded, for keys of strings and numbers
    (a backfill writes it for every item: its marker). Each key attribute's
    name and type tag are written once (``_KEY_HEADS``); a table has one or two."""
    parts = []
    heads = _KEY_HEADS
    for name in (sorted(keys) if len(keys) > 1 else keys):
        value = keys[name]
        if type(name) is str and type(value) is dict and len(value) == 1:
            tag, text = "S", value.get("S")
            if text is None:
                tag, text = "N", value.get("N")
            if type(text) is str:
                head = heads.get((name, tag))
                if head is None:
                    head = dump_str(name) + ':{"' + tag + '":'
                    if len(heads) < _MAX_KEY_HEADS:
                        heads[(name, tag)] = head
                parts.append(head + dump_str(text) + "}")
                continue
        return canonical_typed_json({"M": dict(keys)}).encode("utf-8")
    return ('{"M":{' + ",".join(parts) + "}}").encode("utf-8")


# _key_json's '"name":{"S":' per (key attribute, tag), bounded like the column cache.
_KEY_HEADS: dict = {}
_MAX_KEY_HEADS = 1024


def _general_encoder(name: str) -> Callable:
    encoder = ENCODERS[name]
    return lambda value: encoder(value, "")


FAST_ENCODERS = {name: _general_encoder(name) for name in ENCODERS}
FAST_ENCODERS.update(utf8=_fast_utf8, int64=_fast_int64, decimal=_fast_decimal, auto=_fast_auto, json=_fast_json)
_FAST_BY_GENERAL = {ENCODERS[name]: FAST_ENCODERS[name] for name in ENCODERS}


def _iso8601_ms(where: str) -> Callable:
    def parse(value) -> int:
        if type(value) is dict and len(value) == 1:
            text = value.get("S")
            if type(text) is str:
                parsed = _dt.datetime.fromisoformat(text)  # ValueError: the general engine says why
                if parsed.tzinfo is None:  # UTC, as the general engine reads it
                    ms = (parsed - _EPOCH_NAIVE) // _ONE_MS
                else:
                    ms = (parsed - _EPOCH) // _ONE_MS
                if 0 <= ms <= MAX_TIMESTAMP_MS:
                    return ms
        return parse_timestamp_ms(value, "iso8601", where)
    return parse


def _timestamp_parser(fmt: str, where: str) -> Callable:
    if fmt == "iso8601":
        return _iso8601_ms(where)
    return lambda value: parse_timestamp_ms(value, fmt, where)


# --- code generation ------------------------------------------------------------


class _Source:
    """Generated source and the constants it names. Nothing from the mapping file
    is written into the source: every value is a bound constant ``_kN``."""

    def __init__(self) -> None:
        self.lines: list = []
        self.names: dict = {"_Fallback": _Fallback, "_EMPTY": _EMPTY, "dict": dict, "len": len, "type": type,
                            "str": str, "condition_matches": condition_matches}
        self._consts: dict = {}

    def const(self, value) -> str:
        key = (type(value), id(value))
        name = self._consts.get(key)
        if name is None:
            name = f"_k{len(self._consts)}"
            self._consts[key] = name
            self.names[name] = value
        return name

    def add(self, indent: int, text: str) -> None:
        self.lines.append("    " * indent + text)

    def function(self, name: str) -> Callable:
        namespace = dict(self.names)
        exec(compile("\n".join(self.lines) + "\n", f"<ddb2bt compiled {name}>", "exec"), namespace)
        return namespace[name]


def _emit_lookup(src: _Source, indent: int, var: str, attribute: str, item: str, missing: Optional[str]) -> None:
    """``var`` = the attribute from the keys, else the item (mapping._lookup)."""
    name = src.const(attribute)
    src.add(indent, f"{var} = keys.get({name})")
    src.add(indent, f"if {var} is None:")
    src.add(indent + 1, f"{var} = {item}.get({name})")
    if missing is not None:
        src.add(indent + 1, f"if {var} is None:")
        src.add(indent + 2, missing)


def _emit_string(src: _Source, indent: int, text: str, value: str, tags: tuple) -> None:
    """``text`` = the payload when ``value`` is a well-formed one-tag dict of one
    of ``tags`` holding a str, else None (the general helper then sees it)."""
    src.add(indent, f"{text} = None")
    src.add(indent, f"if type({value}) is dict and len({value}) == 1:")
    src.add(indent + 1, f"{text} = {value}.get({tags[0]!r})")
    for tag in tags[1:]:
        src.add(indent + 1, f"if {text} is None:")
        src.add(indent + 2, f"{text} = {value}.get({tag!r})")
    src.add(indent + 1, f"if type({text}) is not str:")
    src.add(indent + 2, f"{text} = None")


def _key_builder(template: KeyTemplate, where: str) -> Callable:
    """rowkey.build_key as straight-line code: ``(keys, item, captures) -> bytes``,
    or None when an attribute is missing (the caller decides: an index row is
    sparse, a main row goes to the general engine). Parts are processed in the
    template's order, as build_key does, so the first problem is the same one."""
    src = _Source()
    src.add(0, "def build(keys, item, captures):")
    last = len(template.tokens) - 1
    delimiter = template.delimiter
    pieces = []
    for i, tok in enumerate(template.tokens):
        if isinstance(tok, bytes):
            pieces.append(src.const(tok))
            continue
        part = f"p{i}"
        ph_where = f"{where}{{{tok.source}}}"
        if tok.source.startswith("match."):
            src.add(1, f"t = captures.get({src.const(tok.source[len('match.'):])})")
            src.add(1, "if t is None:")
            src.add(2, "raise _Fallback")  # build_key: 'no capture named ...'
            src.add(1, "if True:")
        else:
            _emit_lookup(src, 1, "v", tok.source, "item", "return None")
            _emit_string(src, 1, "t", "v", ("S", "N"))
            src.add(1, "if t is not None:")
        for name, arg in tok.transforms:
            fn = TRANSFORMS[name][1]
            src.add(2, f"t = {src.const(fn)}(t, {src.const(arg)}, {src.const(ph_where)})")
        src.add(2, f"{part} = t.encode('utf-8')")
        if not tok.source.startswith("match."):
            general = (lambda ph, w: lambda v: part_value(ph, v, w))(tok, ph_where)
            src.add(1, "else:")
            src.add(2, f"{part} = {src.const(general)}(v)")
        if i != last:  # rowkey.escape
            esc, esc2 = src.const(ESCAPE), src.const(ESCAPE + ESCAPE)
            delim, delim2 = src.const(delimiter), src.const(ESCAPE + delimiter)
            src.add(1, f"if {esc} in {part} or {delim} in {part}:")
            src.add(2, f"{part} = {part}.replace({esc}, {esc2}).replace({delim}, {delim2})")
        pieces.append(part)
    src.add(1, f"return b''.join(({', '.join(pieces)},))")
    return src.function("build")


def _emit_conditions(src: _Source, indent: int, conditions: tuple, item: str, cap: str,
                     values: Optional[dict] = None) -> str:
    """Lookups for the conditions' attributes, and the expression that is true when
    all hold (mapping.conditions_hold: in order, stopping at the first false).
    A value not a plain string is judged by the general ``condition_matches``. ``values``:
    the attributes already looked up by earlier code of the same function (a
    lookup cannot fail and reads the same value every time, so once is enough)."""
    values = {} if values is None else values
    for cond in conditions:
        if cond.attribute not in values:
            n = len(values)
            values[cond.attribute] = (f"v{n}", f"s{n}")
            _emit_lookup(src, indent, f"v{n}", cond.attribute, item, None)
            _emit_string(src, indent, f"s{n}", f"v{n}", ("S",))
    terms = []
    for cond in conditions:
        v, s = values[cond.attribute]
        general = f"condition_matches({src.const(cond)}, keys, {item}, {cap})"
        if cond.kind == "present":
            terms.append(f"({v} is not None)" if cond.value else f"({v} is None)")
        elif cond.kind == "equals" and isinstance(cond.value, bool):
            terms.append(f"(False if {s} is not None else {general})")
        elif cond.kind == "equals":
            terms.append(f"({s} == {src.const(str(cond.value))} if {s} is not None else {general})")
        elif cond.kind == "prefix":
            terms.append(f"({s}.startswith({src.const(cond.value)}) if {s} is not None else {general})")
        else:
            terms.append(f"({src.const(_regex(cond))}({s}, {cap}) if {s} is not None else {general})")
    return " and ".join(terms) if terms else "True"


def _regex(cond: MatchCondition) -> Callable:
    fullmatch = cond.pattern.fullmatch

    def match(text: str, captures: dict) -> bool:
        m = fullmatch(text)
        if m is None:
            return False
        captures.update({k: v for k, v in m.groupdict().items() if v is not None})
        return True
    return match


def _selector(rules: tuple, compiled: list) -> Callable:
    """mapping.select_rule as one function: ``(keys, item) -> (compiled rule, captures)``,
    ``(None, None)`` when no rule matches."""
    src = _Source()
    src.add(0, "def select(keys, item):")
    values: dict = {}  # attributes looked up so far, shared by the rules
    for rule, crule in zip(rules, compiled):
        has_regex = any(c.kind == "regex" for c in rule.conditions)
        cap = "cap" if has_regex else "_EMPTY"
        src.add(1, "if True:")
        if has_regex:
            src.add(2, "cap = {}")
        expr = _emit_conditions(src, 2, rule.conditions, "item", cap, values)
        src.add(2, f"if {expr}:")
        src.add(3, f"return {src.const(crule)}, {cap}")
    src.add(1, "return None, None")
    return src.function("select")


def _condition(conditions: tuple) -> Optional[Callable]:
    """conditions_hold as a function ``(keys, item) -> bool``; None: always true."""
    if not conditions:
        return None
    src = _Source()
    src.add(0, "def holds(keys, item):")
    has_regex = any(c.kind == "regex" for c in conditions)
    if has_regex:
        src.add(1, "cap = {}")
    expr = _emit_conditions(src, 1, conditions, "item", "cap" if has_regex else "_EMPTY")
    src.add(1, f"return bool({expr})")
    return src.function("holds")


# --- rules ------------------------------------------------------------------------


class _PlainOrder(tuple):
    """_CompiledRule.plain_order's answer, and ``columns``: the (family,
    qualifier) of its cells in order, every one a SetCell of the row
    (EncodedMutations.columns, what a repair intent records of a backfill row)."""

    columns: tuple
    writers: dict  # rowwriter.writer_key(...) -> its generated row writer (CompiledMapping._new_writer)


class _CompiledRule:
    """One rule: ``cells(keys, image, captures, with_values) -> (row, {cell key: payload})``
    with the general engine's cell keys (OwnedCell.key) and as payload the value
    (None without values) or, for a list column, the tuple of element values."""

    def __init__(self, mapping: MappingConfig, rule: RuleConfig) -> None:
        self.rule = rule
        self.skip = rule.skip
        self.hook = rule.hook is not None
        if self.skip or self.hook:
            return
        self.table = mapping.target.table
        self.key_attrs = mapping.source.key_attributes
        self.row_key = _key_builder(rule.row_key, "row_key")
        # The row key's attributes, when all are key attributes (no captures): a
        # record's keys, when they hold them all, then give the row key alone, the
        # same for both images of a MODIFY (the built key reads ``keys`` first).
        sources = rule.row_key.sources
        self.row_key_sources = sources if all(name in self.key_attrs for name in sources) else None
        # The general engine's shortcut for a MODIFY's old image applies (mapping._old_cells).
        self.single_row = rule.item_column is None and not rule.indexes
        self.plans: dict = {}
        self._shapes: dict = {}  # an image's attribute names, in order -> plain_order's answer
        self._columns: dict = {}
        self._indexes = tuple(self._index(mapping, index) for index in rule.indexes)

    def plan(self, name) -> tuple:
        """mapping.attribute_plan with the encoder's fast form, or a compiled column."""
        if type(name) is not str:
            raise _Fallback  # the general engine sorts the names first
        plan = attribute_plan(self.rule, self.key_attrs, name)
        if plan[0] == PLAN_PLAIN:
            plan = (PLAN_PLAIN, plan[1], plan[2], _FAST_BY_GENERAL[plan[3]])
        elif plan[0] == PLAN_COLUMN:
            plan = (PLAN_COLUMN, self._column(plan[1]))
        if len(self.plans) < MAX_PLANNED_ATTRIBUTES:
            self.plans[name] = plan
        return plan

    def _column(self, col: ColumnConfig) -> Callable:
        fn = self._columns.get(col.attribute)
        if fn is None:
            fn = self._columns[col.attribute] = _column(self.table, col)
        return fn

    def _index(self, mapping: MappingConfig, index: IndexConfig) -> Callable:
        holds = _condition(index.conditions)
        build = _key_builder(index.row_key, f"index {index.name}")
        table = index.table or mapping.target.table
        family = index.family
        project = tuple((name, name.encode("utf-8")) for name in index.project)
        auto = FAST_ENCODERS["auto"]

        def cells_of(cells: dict, keys, image, main_row: bytes, with_values: bool) -> None:
            if holds is not None and not holds(keys, image):
                return
            row = build(keys, image, _EMPTY)
            if row is None:
                return  # sparse, like a GSI
            key = (table, row, family, INDEX_POINTER, None, False)
            if key in cells:
                raise _Fallback
            cells[key] = main_row if with_values else None
            for name, qualifier in project:
                if name in image:
                    key = (table, row, family, qualifier, None, False)
                    if key in cells:
                        raise _Fallback
                    cells[key] = auto(image[name]) if with_values else None
        return cells_of

    def plain_order(self, image) -> Optional[tuple]:
        """The image's cells when the rule writes one row and each attribute of
        the image is a plain column or not placed: ((attribute, encoder, family,
        qualifier, (family, qualifier)), ...) in the order ``cells``' keys sort
        in for one row, by (family, qualifier); else None (``cells`` makes them).
        Kept per shape of image — its attribute names in order: the plans decide,
        and they never change."""
        shape = tuple(image)
        order = self._shapes.get(shape, _UNKNOWN)
        if order is _UNKNOWN:
            if len(self._shapes) >= _MAX_SHAPES:
                return None  # not kept, so no row writer would be either: the cell loop writes it
            order = self._shapes[shape] = self._plain_order(shape)
        return order

    def _plain_order(self, shape: tuple) -> Optional[tuple]:
        if not self.single_row:
            return None
        cells = []
        for name in shape:
            plan = self.plans.get(name) or self.plan(name)
            if plan[0] == PLAN_PLAIN:
                cells.append((plan[1], plan[2], name, plan[3]))
            elif plan[0] != PLAN_SKIP:
                return None
        cells.sort(key=lambda cell: cell[:2])
        if not cells or any(a[:2] == b[:2] for a, b in zip(cells, cells[1:])):
            return None  # no cells; or two attributes claim one cell, which cells() hands over
        order = _PlainOrder((name, encoder, family, qualifier, (family, qualifier))
                            for family, qualifier, name, encoder in cells)
        order.columns = tuple(cell[4] for cell in order)  # sorted, each once (checked above)
        order.writers = {}
        return order

    def cells(self, keys, image, captures, with_values: bool) -> tuple:
        row = self.row_key(keys, image, captures)
        if row is None:
            raise _Fallback
        table = self.table
        plans = self.plans
        cells: dict = {}
        for name, value in image.items():
            plan = plans.get(name)
            if plan is None:
                plan = self.plan(name)
            kind = plan[0]
            if kind == PLAN_PLAIN:
                key = (table, row, plan[1], plan[2], None, False)
                if key in cells:
                    raise _Fallback  # two attributes claim one cell
                cells[key] = plan[3](value) if with_values else None
            elif kind == PLAN_COLUMN:
                plan[1](cells, value, keys, image, captures, row, with_values)
            elif kind == PLAN_UNMAPPED:
                raise _Fallback
        rule = self.rule
        if rule.item_column is not None:
            ic = rule.item_column
            key = (table, row, ic.family, ic.qualifier, None, False)
            if key in cells:
                raise _Fallback
            value = None
            if with_values:
                whole = {k: v for k, v in image.items() if ic.include_keys or k not in self.key_attrs}
                text = canonical_json({"M": whole}) if ic.encoding == "json" else canonical_typed_json({"M": whole})
                value = text.encode("utf-8")
            cells[key] = value
        for index in self._indexes:
            index(cells, keys, image, row, with_values)
        return row, cells


def _column(table: str, col: ColumnConfig) -> Callable:
    """A listed column beyond a plain one: ``(cells, value, keys, image, captures,
    row, with_values)`` adds its cells."""
    family = col.family
    if col.kind != "value":  # set, map, list_versions: the general helper, its cells converted
        def general(cells, value, keys, image, captures, row, with_values):
            owner = CellOwner(with_values)
            column_cells(owner, col, value, table, row, keys, image, captures)
            for key, cell in owner.cells.items():
                if key in cells:
                    raise _Fallback
                cells[key] = cell.values if cell.values is not None else cell.value
        return general
    qualifier = col.qualifier
    build = _key_builder(col.qualifier_template, f"{col.attribute} qualifier") if col.qualifier_template else None
    encoder = FAST_ENCODERS[col.encoding]
    ts_attr = col.timestamp.attribute if col.timestamp is not None else None
    parse = _timestamp_parser(col.timestamp.format, ts_attr) if col.timestamp is not None else None

    def value_cell(cells, value, keys, image, captures, row, with_values):
        q = qualifier
        if build is not None:
            q = build(keys, image, captures)
            if q is None:
                raise _Fallback
        version = None
        if ts_attr is not None:
            stamp = keys.get(ts_attr)
            if stamp is None:
                stamp = image.get(ts_attr)
                if stamp is None:
                    raise _Fallback
            version = parse(stamp)
        key = (table, row, family, q, version, False)
        if key in cells:
            raise _Fallback
        cells[key] = encoder(value) if with_values else None
    return value_cell


# --- the mapping ----------------------------------------------------------------


class CompiledMapping:
    """``map_change`` for one mapping, compiled. Call it as ``(record, mark_touched)``.
    ``fallbacks`` counts the records handed to the general engine (errors included)."""

    def __init__(self, mapping: MappingConfig) -> None:
        self.mapping = mapping
        self.fallbacks = 0
        self._unmatched_skip = mapping.unmatched == "skip"
        self._ttl_ignore = mapping.ttl is not None and mapping.ttl.deletions == "ignore"
        self._rules = [_CompiledRule(mapping, rule) for rule in mapping.rules]
        self._select = _selector(mapping.rules, self._rules)
        self._stamp = (None,)  # _stamp() and _ranges() of the last change's time
        self._ranges = (None,)
        # (family, qualifier) -> (their wire fields, its length, the size model's
        # bytes of a mutation of it, a time range's length, the bytes of a
        # DeleteFromColumn of the column before a time range of that length or
        # None): what every mutation of a column needs. A written column's
        # pruning delete is that head and the change's range (their lengths, so
        # the head, stay the same change after change).
        self._column_fields: dict = {}
        self._writers_left = MAX_ROW_WRITERS  # generated row writers this mapping may still make (rowwriter)

    def _column(self, family: str, qualifier: bytes, range_len: int = 0) -> tuple:
        fields, n = column_fields((family, qualifier))
        body = n + range_len
        delete_head = None
        if body < LOOKED_UP:  # as transforms.wire.delete_cells writes it
            delete_head = b"".join((ENTRY_MUTATION, VARINTS[body + (2 if body < _ONE_BYTE else 3)],
                                    MUT_DELETE_FROM_COLUMN, VARINTS[body], fields))
        column = (fields, n, len(family) + len(qualifier) + MUTATION_OVERHEAD_BYTES, range_len, delete_head)
        if len(self._column_fields) < MAX_PLANNED_ATTRIBUTES:  # bounded, like the attribute plans
            self._column_fields[(family, qualifier)] = column
        return column

    def _new_writer(self, plain: _PlainOrder, ts_len: int, range_len: int, pruned: bool, image) -> Optional[Callable]:
        """A row writer for ``plain``'s shape at these lengths, kept on it; None
        once this mapping made MAX_ROW_WRITERS (a sparse table's many shapes:
        each writer is code, so they are bounded; the rest take the cell loop)."""
        if self._writers_left <= 0:
            return None
        self._writers_left -= 1
        write = plain_row_writer(plain, self._column, ts_len, range_len, pruned, _INLINE, image)
        plain.writers[writer_key(ts_len, range_len, pruned)] = write
        return write

    def __call__(self, record, mark_touched: bool = False) -> tuple:
        try:
            return self._map(record, mark_touched)
        except Exception:  # noqa: BLE001 — whatever it is, the general engine decides (and raises it)
            self.fallbacks += 1
            return general_map_change(self.mapping, record, mark_touched)

    def _image_cells(self, keys, image, with_values: bool, plain_ok: bool = False) -> tuple:
        """(compiled rule or None, row, cells, plain) of one image (mapping.owned_cells).
        ``plain_ok``: the rule's plain_order instead of the cells when it has one
        (``plain``; the cells then left empty), else None."""
        crule, captures = self._select(keys, image)
        if crule is None:
            if self._unmatched_skip:
                return None, None, _EMPTY, None
            raise _Fallback  # no_matching_rule
        if crule.skip:
            return None, None, _EMPTY, None
        if crule.hook:
            raise _Fallback
        if plain_ok:
            plain = crule.plain_order(image)
            if plain is not None:
                row = crule.row_key(keys, image, captures)
                if row is None:
                    raise _Fallback
                return crule, row, _EMPTY, plain
        row, cells = crule.cells(keys, image, captures, with_values)
        return crule, row, cells, None

    def _old_cells(self, keys, old, new_image, new_rule, new_row, new_plain=None) -> dict:
        """mapping._old_cells: a MODIFY's old image mapped to the same rule and row,
        naming no attribute the new image lacks and placing each one as a plain
        cell (or not at all), owns only cells the new image owns too. ``new_plain``:
        the new image's plain order, if it has one — then each of its attributes,
        so each of the old image's, is a plain cell or not placed, unlooked-up."""
        if (new_rule is not None and new_image is not None and new_rule.single_row
                and old.keys() <= new_image.keys()):
            crule, captures = self._select(keys, old)
            if crule is new_rule:
                simple = new_plain is not None
                if not simple:
                    plans = crule.plans
                    for name in old:
                        plan = plans.get(name)
                        if plan is None or plan[0] not in _SIMPLE:
                            break
                    else:
                        simple = True
                if simple and (_keys_give_row(crule, keys) or crule.row_key(keys, old, captures) == new_row):
                    return _EMPTY
        return self._image_cells(keys, old, False)[2]

    def _map(self, record, mark_touched) -> tuple:
        event = record.event_name
        keys = record.keys
        new_image = record.new_image
        old_image = record.old_image
        ts = record.change_ms
        if event == MODIFY:
            valid = new_image is not None and old_image is not None
        elif event == INSERT:
            valid = new_image is not None
        else:
            valid = event == REMOVE and old_image is not None
        if not (valid and keys and 0 <= ts <= MAX_TIMESTAMP_MS):
            validate_record(record)  # raises the general engine's reason
            raise _Fallback  # a change time too large for a cell: the general engine decides
        if record.is_ttl_delete and event == REMOVE and self._ttl_ignore:
            return ()
        new_rule = new_row = plain = None
        new = _EMPTY
        if event != REMOVE:
            new_rule, new_row, new, plain = self._image_cells(keys, new_image, True, True)
        old = _EMPTY if old_image is None else self._old_cells(keys, old_image, new_image, new_rule, new_row, plain)
        if plain is not None and old:  # the old image's cells are told from the new one's cell keys
            new, plain = self._image_cells(keys, new_image, True)[2], None
        since = record.backfill_since_ms
        prune = event != INSERT or since is not None or self._ttl_ignore
        # (table, row) -> [its mutations' count, request bytes, their wire bytes
        # (transforms.wire), their families]: the mutations are never built as
        # tuples here, RowChange.mutations decodes the bytes if anyone reads them.
        rows: dict = {}
        versions: dict = {}  # (table, row) -> [(family, qualifier, version, is_write)]
        row_key = entry = family_seen = None
        size = count = 0
        # A change's cells share its timestamp (and AWS's changes their second):
        # its fields are encoded once, the delete ranges only for changes that delete.
        stamp = self._stamp
        if stamp[0] != ts:
            stamp = self._stamp = _stamp(ts)
        ts_field = stamp[1]
        ts_len = len(ts_field)
        prune_range = old_range = None
        range_len = 0
        if prune or old:
            ranges = self._ranges
            if ranges[0] != ts:
                ranges = self._ranges = _ranges(ts)
            prune_range, old_range = ranges[1], ranges[2]
            range_len = len(prune_range)
        columns, varints = self._column_fields, VARINTS
        if plain is not None:  # the common image: its one row written by its shape's own code (rowwriter)
            pruned = prune and ts != 0  # an end of 0 would mean "no end" on the wire
            write = plain.writers.get((ts_len, range_len if pruned else 0, pruned))  # rowwriter.writer_key
            if write is None:
                write = self._new_writer(plain, ts_len, range_len, pruned, new_image)
            if write is not None:
                rows[(new_rule.table, new_row)] = write(new_image, len(new_row), ts_field, prune_range)
            else:  # no writer left to make: its cells, written by the loop below
                new, plain = self._image_cells(keys, new_image, True)[2], None
        for key in (sorted(new) if len(new) > 1 else new):
            table, row, family, qualifier, version, is_list = key
            if row_key is None or row != row_key[1] or table != row_key[0]:
                if entry is not None:
                    entry[0], entry[1] = count, size
                row_key = (table, row)  # cells are sorted: a row's cells are consecutive
                entry = rows[row_key] = [0, 0, [], [family]]
                wire = entry[2].append  # a mutation's bytes, or (put) its pieces
                put = entry[2].extend
                add_family = entry[3].append
                family_seen = family
                size = len(row)
                count = 0
            elif family != family_seen:  # sorted: a row's cells of one family are consecutive too
                add_family(family)
                family_seen = family
            payload = new[key]
            column = columns.get((family, qualifier)) or self._column(family, qualifier, range_len)
            fixed = column[2]
            if version is not None:
                count += 1
                wire(set_cell(family, qualifier, payload, timestamp_field(version)))
                size += fixed + len(payload)
                versions.setdefault(row_key, []).append((family, qualifier, version, True))
            elif is_list:
                n = len(payload)
                if n == 0:
                    count += 1
                    wire(delete_cells(family, qualifier, range_field(0, ts + INCLUSIVE_END_MS)))
                    size += fixed
                    continue
                first = ts - n + 1
                if first < 1:
                    raise _Fallback
                count += 1 + n
                wire(delete_cells(family, qualifier, range_field(0, first)))
                size += fixed
                for i, element in enumerate(payload):
                    wire(set_cell(family, qualifier, element, timestamp_field(first + i)))
                    size += fixed + len(element)
            else:
                # The common cells, written inline (transforms.wire.set_cell and
                # delete_cells, the reference, write the same bytes; this runs for
                # most mutations): the lengths are added up, and looked up while
                # every one is below the varint table's end. A plain image's row
                # writer (transforms.rowwriter) writes the same cells the same way
                # (inline in both: a call per cell is ~2 % of the live path's CPU);
                # the differential tests hold both.
                column, n, _, head_range_len, delete_head = column
                value_len = len(payload)
                body = n + ts_len + value_len + (2 if value_len < _ONE_BYTE else 3)
                if 0 < value_len and body < LOOKED_UP:
                    put((ENTRY_MUTATION, varints[body + (2 if body < _ONE_BYTE else 3)], MUT_SET_CELL,
                         varints[body], column, ts_field, SET_VALUE, varints[value_len], payload))
                else:
                    wire(set_cell(family, qualifier, payload, ts_field))
                if prune and ts:  # an end of 0 would mean "no end" on the wire
                    count += 2
                    if head_range_len != range_len:  # a column first seen by a change that did not prune
                        delete_head = self._column(family, qualifier, range_len)[4]
                    if delete_head is not None:
                        put((delete_head, prune_range))
                    else:
                        wire(delete_cells(family, qualifier, prune_range))
                    size += fixed + fixed + value_len
                else:
                    count += 1
                    size += fixed + value_len
        if entry is not None:
            entry[0], entry[1] = count, size
        versioned_rows = set(versions) if since is not None else None
        if old:
            for key in sorted(old):
                if key in new:
                    continue
                table, row, family, qualifier, version, _ = key
                rk = (table, row)
                entry = rows.get(rk)
                if entry is None:
                    entry = rows[rk] = [0, len(row), [], []]
                if family not in entry[3]:
                    entry[3].append(family)
                if version is not None:
                    entry[2].append(delete_cells(family, qualifier, range_field(version, version + INCLUSIVE_END_MS)))
                    versions.setdefault(rk, []).append((family, qualifier, version, False))
                else:
                    if old_range is None:
                        raise _Fallback
                    entry[2].append(delete_cells(family, qualifier, old_range))
                entry[0] += 1
                entry[1] += len(family) + len(qualifier) + MUTATION_OVERHEAD_BYTES
        key_json = None
        marker = b""
        if mark_touched or since is not None:
            key_json = _key_json(keys)
            marker = MARKER_PREFIX + key_json
            if mark_touched and since is None:
                fixed = len(MARKER_FAMILY) + len(marker) + MUTATION_OVERHEAD_BYTES
                marker_wire = set_cell(MARKER_FAMILY, marker, b"", ts_field)
                for entry in rows.values():
                    entry[2].append(marker_wire)
                    entry[0] += 1
                    entry[1] += fixed
                    if MARKER_FAMILY not in entry[3]:
                        entry[3].append(MARKER_FAMILY)
        owner = b""
        if versions:
            owner = key_json if key_json is not None else _key_json(keys)
        # The plain row's SetCells are its plain order's columns, unless a touch marker joined them.
        set_columns = plain.columns if plain is not None and not (mark_touched and since is None) else None
        changes = []
        for rk, (count, size, wire_parts, families) in rows.items():
            table, row = rk
            wire = b"".join(wire_parts)
            if size > _UNCHECKED_ROW_BYTES or not row or len(row) > MAX_ROW_KEY_BYTES:
                size = checked_size(row, decode_mutations(wire))
            guard = None
            if since is not None:
                # Guard(MARKER_FAMILY, marker, since, conditional=..., backfill_ms=ts), slots filled directly
                guard = _guard(MARKER_FAMILY, marker, since, rk in versioned_rows, ts)
            entries = versions.get(rk)
            # RowChange(table, row, mutations, guard, size, versioned, owner) and its wire, slots filled
            # directly; the mutations decoded from the wire when read
            changes.append(_row_change(table, row, _new(EncodedMutations, (count, tuple(families), set_columns)), guard,
                                       size, tuple(sorted(entries)) if entries else (), owner, wire))
        return tuple(changes)


def _keys_give_row(crule: _CompiledRule, keys) -> bool:
    """Whether ``keys`` alone give the rule's row key (_CompiledRule.row_key_sources):
    then both images of a change have the row key built for either."""
    sources = crule.row_key_sources
    if sources is None:
        return False
    for name in sources:
        if keys.get(name) is None:
            return False
    return True


def _stamp(ts: int) -> tuple:
    """(ts, a SetCell's timestamp field at ts): timestamp_field, the usual case
    with the varint's high part reused from the previous change."""
    if not _SHORT_MS < ts < MAX_TIMESTAMP_MS:
        return ts, timestamp_field(ts)
    return ts, SET_TIMESTAMP + timestamp_varint(ts * US_PER_MS)


def _ranges(ts: int) -> tuple:
    """(ts, the time range [0, ts) a written column prunes, the range [0, ts + 1)
    a removed one is deleted over, or None past the largest timestamp: its
    deletes go to the general engine): range_field's, the usual case as above."""
    end = ts + INCLUSIVE_END_MS
    if not _SHORT_MS < ts < MAX_TIMESTAMP_MS:
        return ts, range_field(0, ts), range_field(0, end) if end <= MAX_TIMESTAMP_MS else None
    micros = timestamp_varint(ts * US_PER_MS)
    end_micros = timestamp_varint(end * US_PER_MS)
    return (ts, DELETE_TIME_RANGE + VARINTS[len(micros) + 1] + RANGE_END + micros,
            DELETE_TIME_RANGE + VARINTS[len(end_micros) + 1] + RANGE_END + end_micros)


# Timestamps (ms) whose microseconds need more than the varint table: timestamp_varint's.
_SHORT_MS = VARINT_TABLE_SIZE // US_PER_MS
_ONE_BYTE = ONE_BYTE_VARINT  # a length below this is a 1-byte varint, else (below the table's end) 2


# The encoders whose usual case a generated row writer writes inline (rowwriter).
_INLINE = {_fast_utf8: INLINE_S, _fast_auto: INLINE_AUTO, _fast_int64: INLINE_INT64}
_SIMPLE = (PLAN_PLAIN, PLAN_SKIP)
# plain_order's answers are kept for this many shapes of image per rule (then
# worked out per change): a table's items have few shapes, a sparse one many.
_MAX_SHAPES = 1024
_UNKNOWN = object()  # a shape not yet seen
# EncodedMutations are built as their NamedTuple's __new__ builds them, without its frame.
_new = tuple.__new__
# RowChange.wire is not an __init__ argument (so dataclasses.replace drops it: see
# model.RowChange); the compiled mapping fills it with the other slots (its size given).
_row_change = build_row_change
_guard = build_guard


def compiled_owned_cells(mapping: MappingConfig, keys, image, with_values: bool = True) -> dict:
    """``mapping.owned_cells`` through the mapping's compiled rules: the same
    {cell key: OwnedCell}, built from the compiled cells (the ordering guard's
    hot path: a Kinesis change maps both its images this way). Whatever the
    compiled rules do not take — a hook, no rule, two attributes on one cell, a
    value that does not encode — the general engine decides, raising its
    MappingError. ``tests/unit/transforms/test_compiled_mapping.py`` holds the
    two equal."""
    if image is None:
        return {}
    try:
        cells = compile_mapping(mapping)._image_cells(keys, image, with_values)[2]
    except Exception:  # noqa: BLE001 — whatever it is, the general engine decides (and raises it)
        return owned_cells(mapping, keys, image, with_values)
    # A cell key is (table, row, family, qualifier, version_ms, is_list); a list
    # column's payload is its elements' values.
    return {key: OwnedCell(key[0], key[1], key[2], key[3], key[4], None, value) if key[5]
            else OwnedCell(key[0], key[1], key[2], key[3], key[4], value, None)
            for key, value in cells.items()}


def compile_mapping(mapping: MappingConfig) -> CompiledMapping:
    """The mapping's compiled form, built on first use and kept on the mapping
    (not pickled: config.MappingConfig.__getstate__ leaves it out)."""
    return memo(mapping, COMPILED_ATTRIBUTE, lambda: CompiledMapping(mapping))


COMPILED_ATTRIBUTE = "_compiled"
