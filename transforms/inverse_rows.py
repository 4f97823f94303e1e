"""One Bigtable row read back into the DynamoDB items it holds (state-based).

``invert_row`` takes the row's current cells ({(family, qualifier): [(timestamp
ms, value)] newest first}, as the readers return them), the key attributes'
DynamoDB types, and the items DynamoDB holds today for this row (``previous``:
their types, the spelling of a timestamp, a key attribute the row does not spell,
and attributes a rule never placed come from them). Every item it returns is
checked by mapping it forward again: its cells must be exactly cells of the row.
Cells no item explains are returned as ``unexplained``, never guessed at.

Pure: no I/O.
"""
from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from decimal import Decimal
from typing import Optional

from ddb2bt.transforms.attrs import canonical_number, canonical_typed_json, type_of
from ddb2bt.transforms.config import RESERVED_FAMILY_PREFIX, MappingConfig, RuleConfig, memo
from ddb2bt.transforms.encoding import decode, encode
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.inverse import EXACT_ENCODINGS, EXISTING_ONLY, NO, literal_regex, mapping_inversion
from ddb2bt.transforms.mapping import owned_cells, parse_timestamp_ms, select_rule
from ddb2bt.transforms.rowkey import MAX_INT64, Placeholder, build_key, split_key


@dataclass(frozen=True)
class InvertedItem:
    rule: str
    keys: tuple  # key_of(item): ((attribute, canonical typed JSON), ...) in key order
    item: dict  # the whole item to put (AttributeValues, boto3 form)


@dataclass(frozen=True)
class RowInverse:
    row_key: bytes
    items: tuple  # InvertedItem, ...
    deleted: tuple  # key_values of the previous items the row no longer holds
    unexplained: tuple  # (family, qualifier, why), ...: cells no item explains (not written back)


@dataclass(frozen=True)
class PutItem:
    """Put the whole item, unless DynamoDB holds a version at or after ``version_us``."""

    table: str
    item: dict
    key: dict
    version_us: int


@dataclass(frozen=True)
class DeleteItem:
    """Delete the item, unless DynamoDB holds a version at or after ``version_us``."""

    table: str
    key: dict
    version_us: int


def plan_writes(mapping: MappingConfig, inverse: RowInverse, previous: tuple, table: str,
                version_us: int) -> tuple:
    """The writes that make DynamoDB hold what the row holds: a PutItem of each
    item that differs from the one DynamoDB holds (whole items, so a change that
    carried part of the row still writes the item the row holds now), a
    DeleteItem of each item the row no longer holds. Nothing for an item already
    equal: a forward write read back, or a replay, writes nothing."""
    held = {key_of(mapping, p): canonical_typed_json({"M": p}) for p in previous}
    out: list = []
    for got in inverse.items:
        if held.get(got.keys) != canonical_typed_json({"M": got.item}):
            out.append(PutItem(table, got.item, key_values(mapping, got.item), version_us))
    out += [DeleteItem(table, key, version_us) for key in inverse.deleted]
    return tuple(out)


def key_of(mapping: MappingConfig, item: dict) -> tuple:
    """The item's key, hashable: ((attribute, canonical typed JSON of the value), ...)."""
    return tuple((k, canonical_typed_json(item[k])) for k in mapping.source.key_attributes if k in item)


def key_values(mapping: MappingConfig, item: dict) -> dict:
    """The item's key attributes as AttributeValues (a DeleteItem's Key)."""
    return {k: item[k] for k in mapping.source.key_attributes if k in item}


def derived_families(mapping: MappingConfig) -> frozenset:
    """Families whose cells are never written back: index rows, ddb2bt's own."""
    return frozenset(i.family for r in mapping.rules for i in r.indexes)


def owned_row_cells(mapping: MappingConfig, item: dict) -> dict:
    """{(family, qualifier): value-or-versions} of the item's cells in its main row
    (index cells and other tables left out): what the forward mapping writes."""
    keys = key_values(mapping, item)
    derived = derived_families(mapping)
    out: dict = {}
    for cell in owned_cells(mapping, keys, item).values():
        if cell.table != mapping.target.table or cell.family in derived:
            continue
        if cell.values is not None:
            out[(cell.family, cell.qualifier)] = ("list", cell.values)
        elif cell.version_ms is None:
            out[(cell.family, cell.qualifier)] = ("value", cell.value)
        else:
            out.setdefault((cell.family, cell.qualifier), ("versions", {}))[1][cell.version_ms] = cell.value
    return out


def main_row_of(mapping: MappingConfig, item: dict) -> Optional[bytes]:
    """The main row the item's rule maps it to (None: skipped, hook, or refused)."""
    try:
        rule, captures = select_rule(mapping, key_values(mapping, item), item)
        if rule is None or rule.skip or rule.hook is not None:
            return None
        return build_key(rule.row_key, key_values(mapping, item), item, captures)
    except MappingError:
        return None


# --- decoding one value ------------------------------------------------------------


def decode_value(encoding: str, data: bytes, hint) -> dict:
    """A cell's value. ``hint`` (the attribute as DynamoDB holds it, or None) wins
    when it encodes to these very bytes (its type and spelling are kept); else its
    type is used when the bytes decode as that type; else the encoding's own type
    (``auto``/``json`` without a hint: a string, binary when not UTF-8)."""
    if hint is not None:
        try:
            if encode(encoding, hint) == data:
                return hint
            value = decode(encoding, data, type_of(hint))
            if encode(encoding, value) == data:
                return value
        except (MappingError, ValueError, UnicodeDecodeError):
            pass
    if encoding in EXACT_ENCODINGS:
        return decode(encoding, data)
    if encoding == "json":
        try:
            return decode("json", data)
        except ValueError:
            return {"S": data.decode("utf-8", "replace")}
    null = encode(encoding, {"NULL": True})
    if data == null and null != encode(encoding, {"S": ""}):
        return {"NULL": True}  # an encoding that tells NULL from the empty string
    try:
        return {"S": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"B": bytes(data)}


def timestamp_value(fmt: str, ms: int, hint) -> dict:
    if hint is not None:
        try:
            if parse_timestamp_ms(hint, fmt, "hint") == ms:
                return hint
        except MappingError:
            pass
    if fmt == "epoch_millis":
        return {"N": str(ms)}
    if fmt == "epoch_seconds":
        return {"N": canonical_number(Decimal(ms) / 1000)}
    when = _dt.datetime(1970, 1, 1) + _dt.timedelta(milliseconds=ms)
    text = when.strftime("%Y-%m-%dT%H:%M:%S")
    return {"S": text + (f".{ms % 1000:03d}" if ms % 1000 else "")}


def _part_value(ph: Placeholder, raw: bytes, tag: str) -> dict:
    """A row-key part back to the attribute value (the transforms undone, last first)."""
    if tag == "B":
        return {"B": bytes.fromhex(raw.decode("ascii")) if any(n == "hex" for n, _ in ph.transforms) else raw}
    text = raw.decode("utf-8")
    for name, arg in reversed(ph.transforms):
        if name == "pad":
            text = str(int(text))
        elif name in ("reverse", "reverse_domain"):
            text = text[::-1] if name == "reverse" else ".".join(reversed(text.split(".")))
        elif name == "max_minus":
            text = str(MAX_INT64 - int(text))
        elif name == "strip_prefix":
            text = arg + text
        elif name == "salt":
            return {}
    return {"N": canonical_number(Decimal(text))} if tag == "N" else {"S": text}


def parse_template(template, data: bytes, types: dict, known: dict, captures: dict) -> bool:
    """Fill ``known`` (attributes) and ``captures`` (match.NAME) from a key or
    qualifier; False when the bytes do not fit the template."""
    try:
        parts = split_key(template, data)
    except ValueError:
        return False
    holders = [t for t in template.tokens if isinstance(t, Placeholder)]
    for ph, raw in zip(holders, parts):
        try:
            if ph.source.startswith("match."):
                captures[ph.source[len("match."):]] = raw.decode("utf-8")
                continue
            value = _part_value(ph, raw, types.get(ph.source, "S"))
        except (ValueError, UnicodeDecodeError, ArithmeticError):
            return False
        if value:
            if known.get(ph.source, value) != value:
                return False
            known[ph.source] = value
    return True


def rule_constants(rule: RuleConfig, types: dict, known: dict, captures: dict) -> None:
    """Attributes the rule's conditions fix: ``equals`` values, literal regexes."""
    for cond in rule.conditions:
        if cond.attribute in known:
            continue
        if cond.kind == "equals" and not isinstance(cond.value, bool):
            text = str(cond.value)
            numeric = isinstance(cond.value, (int, float)) or types.get(cond.attribute) == "N"
            known[cond.attribute] = {"N": canonical_number(Decimal(text))} if numeric else {"S": text}
        elif cond.kind == "regex":
            lit = literal_regex(cond.pattern.pattern)
            built = lit.build(captures) if lit is not None else None
            if built is not None:
                known[cond.attribute] = {"S": built}


# --- one row -> its items -------------------------------------------------------------


def _newest(versions) -> bytes:
    return versions[0][1]


def _rule_slots(mapping: MappingConfig, rule: RuleConfig, status: str, row_key: bytes, row: dict, types: dict,
                previous: tuple) -> list:
    """[(known attributes, captures, previous item or None)] of the items ``rule``
    can have in this row."""
    known, captures = {}, {}
    if not parse_template(rule.row_key, row_key, types, known, captures):
        return []
    slots = [(known, captures)]
    folded = [c for c in rule.columns if c.qualifier_template is not None and c.kind == "value"]
    if folded:  # qualifiers that hold a key part: one item per qualifier
        col, slots = folded[0], []
        for family, qualifier in row:
            k, c = dict(known), dict(captures)
            if family == col.family and parse_template(col.qualifier_template, qualifier, types, k, c):
                slots.append((k, c))
    for k, c in slots:
        rule_constants(rule, types, k, c)
    key_attrs = mapping.source.key_attributes
    by_key = {key_of(mapping, p): p for p in previous}
    out = []
    if status == EXISTING_ONLY:  # the key attribute the row does not spell comes from DynamoDB's item
        for p in previous:
            if select_rule(mapping, key_values(mapping, p), p)[0] is not rule:
                continue
            for k, c in slots:
                if all(p.get(a) == v for a, v in k.items() if a in key_attrs):
                    out.append(({**k, **key_values(mapping, p)}, c, p))
                    break
        return out
    for k, c in slots:
        if all(a in k for a in key_attrs):
            out.append((k, c, by_key.get(key_of(mapping, k))))
    return out


def _value_columns(rule: RuleConfig, item: dict, captures: dict, row: dict, prev: Optional[dict],
                   shared: frozenset = frozenset()) -> set:
    claimed = set()
    for col in rule.columns:
        hint = prev.get(col.attribute) if prev else None
        if col.kind == "set":
            members = sorted(q for f, q in row if f == col.family)
            if members:
                claimed |= {(col.family, q) for q in members}
                tag = type_of(hint) if hint is not None else "SS"
                if tag == "BS":
                    item[col.attribute] = {"BS": members}
                elif tag == "L":
                    item[col.attribute] = {"L": [decode_value("auto", m, None) for m in members]}
                else:
                    item[col.attribute] = {tag: [m.decode("utf-8" if tag == "SS" else "ascii") for m in members]}
            continue
        if col.kind == "map":
            keys = sorted(q for f, q in row if f == col.family)
            if keys:
                claimed |= {(col.family, q) for q in keys}
                inner = hint.get("M", {}) if hint is not None else {}
                item[col.attribute] = {"M": {q.decode("utf-8"): decode_value(col.encoding, _newest(row[(col.family, q)]),
                                                                          inner.get(q.decode("utf-8")))
                                             for q in keys}}
            continue
        qualifier = col.qualifier
        if col.qualifier_template is not None:
            try:
                qualifier = build_key(col.qualifier_template, item, item, captures)
            except MappingError:
                continue
        versions = row.get((col.family, qualifier))
        if not versions:
            continue
        claimed.add((col.family, qualifier))
        if col.kind == "list_versions":
            elements = hint.get("L", []) if hint is not None else []
            ordered = [v for _, v in sorted(versions)]
            item[col.attribute] = {"L": [decode_value(col.encoding, v, elements[i] if i < len(elements) else None)
                                         for i, v in enumerate(ordered)]}
            continue
        chosen = versions[0]
        if col.timestamp is not None:
            ts_hint = prev.get(col.timestamp.attribute) if prev else None
            if ts_hint is not None:
                try:
                    at = parse_timestamp_ms(ts_hint, col.timestamp.format, col.timestamp.attribute)
                    own = next((v for v in versions if v[0] == at), None)
                except MappingError:
                    own = None
                if own is None and (col.family, qualifier) in shared:
                    claimed.discard((col.family, qualifier))
                    continue  # a column several items hold as versions: this item's version is gone
                chosen = own or chosen
            item[col.timestamp.attribute] = timestamp_value(col.timestamp.format, chosen[0], ts_hint)
        item[col.attribute] = decode_value(col.encoding, chosen[1], hint)
    return claimed


def shared_columns(mapping: MappingConfig, rule: RuleConfig, previous: tuple) -> frozenset:
    """Columns two or more of the items DynamoDB holds for the row keep under
    ``rule`` (versions of one column, one item each: comments at their times)."""
    seen: dict = {}
    for p in previous:
        try:
            if select_rule(mapping, key_values(mapping, p), p)[0] is not rule:
                continue
            for col in owned_row_cells(mapping, p):
                seen[col] = seen.get(col, 0) + 1
        except MappingError:
            continue
    return frozenset(col for col, n in seen.items() if n > 1)


def _other_columns(mapping: MappingConfig, rule: RuleConfig, item: dict, row: dict, claimed: set,
                   prev: Optional[dict]) -> None:
    if rule.other.mode == "column":
        listed = {(c.family, c.qualifier) for c in rule.columns}
        for (family, qualifier), versions in sorted(row.items()):
            if family != rule.other.family or (family, qualifier) in claimed or (family, qualifier) in listed:
                continue
            try:
                name = qualifier.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if name in item and name not in mapping.source.key_attributes:
                continue
            claimed.add((family, qualifier))
            if name not in mapping.source.key_attributes:
                item[name] = decode_value(rule.other.encoding, _newest(versions), prev.get(name) if prev else None)
    ic = rule.item_column
    if ic is not None and (ic.family, ic.qualifier) in row:
        claimed.add((ic.family, ic.qualifier))
        whole = decode(ic.encoding, _newest(row[(ic.family, ic.qualifier)]))
        for name, value in whole.get("M", {}).items():
            hint = prev.get(name) if prev else None
            if hint is not None and ic.encoding == "json" and encode("json", hint) == encode("json", value):
                value = hint
            item.setdefault(name, value)
    if rule.other.mode == "ignore" and ic is None and prev:
        placed = {c.attribute for c in rule.columns} | set(rule.consumed) | set(mapping.source.key_attributes)
        for name, value in prev.items():
            if name not in placed:
                item.setdefault(name, value)  # never reached Bigtable: kept as DynamoDB holds it


def _explains(mapping: MappingConfig, rule: RuleConfig, item: dict, row: dict) -> Optional[set]:
    """The row's columns the item maps to, or None when mapping it forward again does
    not give exactly cells of this row (then it is not what the row holds)."""
    try:
        if select_rule(mapping, key_values(mapping, item), item)[0] is not rule:
            return None
        cells = owned_row_cells(mapping, item)
    except MappingError:
        return None
    for col, (kind, want) in cells.items():
        have = row.get(col)
        if not have:
            return None
        if kind == "value" and _newest(have) != want:
            return None
        if kind == "versions" and any(dict(have).get(ts) != v for ts, v in want.items()):
            return None
        if kind == "list" and tuple(v for _, v in sorted(have)) != want:
            return None
    # a versioned column is shared version by version (one comment per version)
    return {col + (ts,) for col, (kind, want) in cells.items() if kind == "versions" for ts in want} | {
        col for col, (kind, _) in cells.items() if kind != "versions"}


def invert_row(mapping: MappingConfig, row_key: bytes, cells: dict, key_types: dict,
               previous: tuple = ()) -> RowInverse:
    """The items a row holds now. ``previous``: the items DynamoDB holds whose main
    row is this row (without ddb2bt's own attributes)."""
    previous = tuple(p for p in previous if main_row_of(mapping, p) == row_key)
    derived = derived_families(mapping)
    row = {col: versions for col, versions in cells.items()
           if versions and col[0] not in derived and not col[0].startswith(RESERVED_FAMILY_PREFIX)}
    statuses = memo(mapping, "_inverse_statuses", lambda: {i.rule: i.status for i in mapping_inversion(mapping)})
    candidates = []
    for order, rule in enumerate(mapping.rules):
        if statuses[rule.name] == NO:
            continue
        shared = shared_columns(mapping, rule, previous)
        for known, captures, prev in _rule_slots(mapping, rule, statuses[rule.name], row_key, row, key_types,
                                                 previous):
            item = dict(known)
            claimed = _value_columns(rule, item, captures, row, prev, shared)
            _other_columns(mapping, rule, item, row, claimed, prev)
            if not claimed:
                continue  # no cell of this item in the row: it is not there (or was deleted)
            cols = _explains(mapping, rule, item, row)
            if cols is not None:
                candidates.append((prev is None, order, rule, item, cols))
    # Two rules can read one cell (two entity types on one column): the item DynamoDB
    # holds wins, else the first rule in the mapping's order.
    items, explained = [], set()
    for _, _, rule, item, cols in sorted(candidates, key=lambda c: (c[0], c[1])):
        if cols & explained:
            continue
        explained |= cols
        items.append(InvertedItem(rule.name, key_of(mapping, item), item))
    kept = {i.keys for i in items}
    for p in previous:  # an item that owns no cell at all is invisible in Bigtable: left alone
        if key_of(mapping, p) not in kept and not owned_row_cells_safe(mapping, p):
            kept.add(key_of(mapping, p))
    deleted = tuple(key_values(mapping, p) for p in previous
                    if key_of(mapping, p) not in kept and _invertible_rule(mapping, p, statuses))
    columns = {c[:2] for c in explained}
    versioned = {c[:2] for c in explained if len(c) == 3}
    why = "no item of an invertible rule reads back to this cell"
    unexplained = tuple((f, q, why) for f, q in sorted(set(row) - columns)) + tuple(
        (f, q, f"version {ts}: {why}") for f, q in sorted(versioned) for ts, _ in row[(f, q)]
        if (f, q, ts) not in explained)
    return RowInverse(row_key, tuple(items), deleted, unexplained)


def owned_row_cells_safe(mapping: MappingConfig, item: dict) -> dict:
    try:
        return owned_row_cells(mapping, item)
    except MappingError:
        return {}


def _invertible_rule(mapping: MappingConfig, item: dict, statuses: dict) -> bool:
    try:
        rule = select_rule(mapping, key_values(mapping, item), item)[0]
    except MappingError:
        return False
    return rule is not None and statuses.get(rule.name, NO) != NO
