"""The inverse of a mapping, rule by rule: which rules a Bigtable row can be read
back through into DynamoDB items, and exactly why the others cannot.

A rule inverts when every key attribute of its items can be read back from the
row (the row-key template parsed with its escaping, a qualifier template, an
``equals`` condition, a ``regex`` of literal text around named groups, or a
column that keeps the key) and every placed attribute comes back from its cells.
Some rules invert for the items DynamoDB already holds only: a key attribute that
nothing in the row spells (``sk`` matched only by a prefix) is read from the item
being replaced. Index rows, the migration's own families and anything a hook
computed are derived: never written back.

Pure: no I/O. ``ddb2bt.transforms.inverse_rows`` turns one row into items with it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ddb2bt.transforms.config import MappingConfig, RuleConfig
from ddb2bt.transforms.rowkey import Placeholder

INVERTS = "inverts"  # every item of the rule comes back from its row
EXISTING_ONLY = "existing_items_only"  # updates and deletes of items DynamoDB holds; not new items
NO = "does_not_invert"

# Encodings whose bytes give back the DynamoDB value and its type without help.
EXACT_ENCODINGS = frozenset({"utf8", "int64", "decimal", "float64", "bytes", "bool", "null", "dynamodb_json"})
ROW_KEY_TRANSFORMS_INVERTIBLE = frozenset({"pad", "reverse", "reverse_domain", "max_minus", "strip_prefix", "hex"})


@dataclass(frozen=True)
class RuleInversion:
    """Whether one rule inverts (``status``), why not (``reasons``), and what holds
    only with a caveat (``notes``); ``key_sources`` says where each key attribute
    comes back from."""

    rule: str
    status: str
    reasons: tuple = ()
    notes: tuple = ()
    key_sources: tuple = ()  # ((attribute, where it comes from), ...)

    @property
    def inverts(self) -> bool:
        return self.status != NO


@dataclass(frozen=True)
class LiteralRegex:
    """A ``regex`` condition of literal text around named groups
    (``Payment-(?P<payment>.+)``): the attribute is the literals and the captures."""

    pieces: tuple  # str literal or ("group", name)

    def build(self, captures: dict) -> Optional[str]:
        out = []
        for piece in self.pieces:
            if isinstance(piece, tuple):
                if piece[1] not in captures:
                    return None
                out.append(captures[piece[1]])
            else:
                out.append(piece)
        return "".join(out)

    @property
    def groups(self) -> tuple:
        return tuple(p[1] for p in self.pieces if isinstance(p, tuple))


_GROUP_OPEN = re.compile(r"\(\?P<([A-Za-z_][A-Za-z0-9_]*)>")
_META = set(".^$*+?{}[]|()")


def literal_regex(pattern: str) -> Optional[LiteralRegex]:
    """The pattern as literals and named groups, or None when any literal part is
    not plain text (then the attribute cannot be rebuilt from its captures)."""
    pieces: list = []
    pos = 0
    text = []
    while pos < len(pattern):
        m = _GROUP_OPEN.match(pattern, pos)
        if m:
            if text:
                pieces.append("".join(text))
                text = []
            depth, end = 1, m.end()
            while end < len(pattern) and depth:
                if pattern[end] == "\\":
                    end += 2
                    continue
                depth += {"(": 1, ")": -1}.get(pattern[end], 0)
                end += 1
            if depth:
                return None
            pieces.append(("group", m.group(1)))
            pos = end
            continue
        ch = pattern[pos]
        if ch == "\\":
            nxt = pattern[pos + 1:pos + 2]
            if not nxt or nxt.isalnum():
                return None  # \d, \w, \1 ...: a class or reference, not a literal
            text.append(nxt)
            pos += 2
            continue
        if ch in _META:
            return None
        text.append(ch)
        pos += 1
    if text:
        pieces.append("".join(text))
    return LiteralRegex(tuple(pieces))


def _placeholders(template) -> list:
    return [t for t in template.tokens if isinstance(t, Placeholder)] if template is not None else []


def key_sources(mapping: MappingConfig, rule: RuleConfig) -> dict:
    """{key attribute: where it comes back from} for the attributes the row spells."""
    found: dict = {}
    captures_known: set = set()
    templates = [("the row key", rule.row_key)] + [
        (f"the qualifier of {c.attribute}", c.qualifier_template) for c in rule.columns if c.qualifier_template]
    for where, template in templates:
        for ph in _placeholders(template):
            if ph.source.startswith("match."):
                captures_known.add(ph.source[len("match."):])
            elif all(name in ROW_KEY_TRANSFORMS_INVERTIBLE for name, _ in ph.transforms):
                found.setdefault(ph.source, where)
    for cond in rule.conditions:
        if cond.kind == "equals" and not isinstance(cond.value, bool):
            found.setdefault(cond.attribute, f"its 'equals: {cond.value}' condition")
        elif cond.kind == "regex":
            lit = literal_regex(cond.pattern.pattern)
            if lit is not None and lit.groups and set(lit.groups) <= captures_known:
                found.setdefault(cond.attribute, f"its regex {cond.pattern.pattern!r} and the captures")
    for key in mapping.source.key_attributes:
        column = rule.column_for(key)
        if column is not None and column.kind == "value" and column.timestamp is None:
            found.setdefault(key, f"column {column.family}:{column.qualifier.decode('utf-8', 'replace')}")
        elif rule.include_key_attributes and rule.other.mode == "column":
            found.setdefault(key, f"column {rule.other.family}:{key}")
        elif rule.item_column is not None and rule.item_column.include_keys:
            found.setdefault(key, "the item column")
    return found


def _column_notes(rule: RuleConfig) -> tuple:
    reasons, notes = [], []
    for col in rule.columns:
        name = col.attribute
        if col.kind == "set":
            notes.append(f"{name}: set members come back as the type the item had (a new set: strings)")
        elif col.encoding == "json":
            notes.append(f"{name}: json keeps maps, lists, numbers and strings; a set or binary value keeps its "
                         "type from the item it replaces (dynamodb_json keeps every type)")
        elif col.encoding == "auto":
            notes.append(f"{name}: encoding auto does not store the type; it comes from the item being replaced "
                         "(a new attribute: a string, or binary when not UTF-8)")
        if col.timestamp is not None:
            if col.timestamp.format == "iso8601":
                notes.append(f"{col.timestamp.attribute}: read back from the cell timestamp as ISO-8601 "
                             "(YYYY-MM-DDTHH:MM:SS[.mmm]); the item's own spelling is kept when it names the same "
                             "millisecond")
            elif col.timestamp.format == "epoch_seconds":
                notes.append(f"{col.timestamp.attribute}: epoch seconds are read back from the cell timestamp "
                             "(sub-second digits were rounded down to the millisecond)")
    if rule.other.mode == "column" and rule.other.encoding in ("auto", "json"):
        notes.append(f"other attributes (family {rule.other.family}): encoding {rule.other.encoding} does not store "
                     "the type; it comes from the item being replaced (a new attribute: a string, or binary when "
                     "not UTF-8)")
    if rule.other.mode == "ignore" and rule.item_column is None:
        notes.append("other_attributes: ignore: attributes the rule does not list never reached Bigtable; the "
                     "rollback updates only the listed attributes and keeps the others as DynamoDB holds them")
    if rule.indexes:
        notes.append(f"index rows ({', '.join(i.name for i in rule.indexes)}) are derived: never written back")
    return tuple(reasons), tuple(notes)


def rule_inversion(mapping: MappingConfig, rule: RuleConfig) -> RuleInversion:
    if rule.skip:
        return RuleInversion(rule.name, NO, ("skip: its items never reached Bigtable",))
    if rule.hook is not None:
        return RuleInversion(rule.name, NO, (f"hook {rule.hook}: the cells are computed by code that has no "
                                             "inverse; write these items back with your own script",))
    reasons, notes = _column_notes(rule)
    sources = key_sources(mapping, rule)
    missing = [k for k in mapping.source.key_attributes if k not in sources]
    partition = mapping.source.partition_key
    status = INVERTS
    if partition in missing:
        reasons += (f"the partition key {partition!r} is not spelled by the row key (or only through a salt): "
                    "the row cannot be traced to any item",)
    elif missing:
        status = EXISTING_ONLY
        cond = ", ".join(f"{c.attribute} {c.kind} {c.value if c.pattern is None else c.pattern.pattern!r}"
                         for c in rule.conditions) or "no condition"
        notes += (f"{', '.join(missing)} is not in the row key, a qualifier, an 'equals' condition or a column "
                  f"(the rule matches by {cond}): an item DynamoDB holds is updated or deleted with its own "
                  f"{', '.join(missing)}, a new item cannot be written back (add the attribute to a column)",)
    for ts_col in (c for c in rule.columns if c.timestamp is not None):
        if ts_col.timestamp.attribute in mapping.source.key_attributes:
            reasons += (f"{ts_col.attribute}: its cell timestamp holds the key attribute "
                        f"{ts_col.timestamp.attribute!r}, rounded to the millisecond",)
    if reasons:
        status = NO
    shared = sorted({f"{c.family}:{c.qualifier.decode('utf-8', 'replace')}" for other in mapping.rules
                     if other is not rule for o in other.columns for c in rule.columns
                     if c.qualifier_template is None and c.kind == "value" and o.qualifier_template is None
                     and (o.family, o.qualifier) == (c.family, c.qualifier)})
    if shared:
        notes += (f"{', '.join(shared)} is also a column of another rule: a cell is read back as the item "
                  "DynamoDB holds, a new one by the first of those rules in the mapping",)
    ordered = tuple((k, sources[k]) for k in mapping.source.key_attributes if k in sources)
    return RuleInversion(rule.name, status, reasons, notes, ordered)


def mapping_inversion(mapping: MappingConfig) -> tuple:
    """One RuleInversion per rule, in the mapping's order."""
    return tuple(rule_inversion(mapping, rule) for rule in mapping.rules)


def describe(inversions: tuple) -> list:
    """Lines for `validate` and `explain --reverse`."""
    lines = []
    for inv in inversions:
        label = {INVERTS: "inverts", EXISTING_ONLY: "inverts for items DynamoDB holds",
                 NO: "does not invert"}[inv.status]
        lines.append(f"rule {inv.rule}: {label}")
        for attr, where in inv.key_sources:
            lines.append(f"  key {attr}: from {where}")
        lines += [f"  why not: {r}" for r in inv.reasons]
        lines += [f"  note: {n}" for n in inv.notes]
    return lines
