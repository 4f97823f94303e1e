"""The pure heart of the replicator: ``map_change(mapping, record)``.

One DynamoDB change becomes the ordered mutations of the Bigtable rows it owns,
following the correctness contract (design notes §1):

* every SetCell carries the change's own timestamp (whole ms), never -1;
* a written column also deletes its *older* versions (``[0, ts)``), so each owned
  column holds exactly one version without depending on garbage collection, and a
  replay of an older change can never remove the newer value;
* a removed attribute or item deletes the columns the *old* image names over
  ``[0, ts + 1 ms)`` — time-bounded, never DeleteFromRow, so replays are harmless.

The same function serves the live tail, the backfill (records synthesised from
scanned items at the handoff timestamp) and verification (the expected layout).
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

from transforms.attrs import type_of
from transforms.config import MappingConfig, MatchCondition, RuleConfig
from transforms.encoding import encode
from transforms.errors import MappingError
from transforms.limits import check_row_change
from transforms.model import (
    EVENT_NAMES,
    INSERT,
    MODIFY,
    REMOVE,
    ChangeRecord,
    DeleteCells,
    Item,
    RowChange,
    SetCell,
)
from transforms.rowkey import build_key

# Bigtable's delete range end is exclusive: +1 ms makes the change's own cells part of it.
_INCLUSIVE_END_MS = 1


def _matches(cond: MatchCondition, keys: Item, item: Optional[Item], captures: dict) -> bool:
    value = keys.get(cond.attribute)
    if value is None and item is not None:
        value = item.get(cond.attribute)
    if cond.kind == "present":
        return (value is not None) == cond.value
    if value is None:
        return False
    tag = type_of(value, cond.attribute)
    scalar = value[tag]
    if cond.kind == "equals":
        if isinstance(cond.value, bool):
            return tag == "BOOL" and scalar == cond.value
        return tag in ("S", "N") and str(scalar) == str(cond.value)
    if tag != "S":
        return False
    if cond.kind == "prefix":
        return scalar.startswith(cond.value)
    m = cond.pattern.fullmatch(scalar)
    if m is None:
        return False
    captures.update({k: v for k, v in m.groupdict().items() if v is not None})
    return True


def select_rule(mapping: MappingConfig, keys: Item, item: Optional[Item]) -> tuple:
    """First rule whose conditions all hold → (rule, captures), or (None, {})."""
    for rule in mapping.rules:
        captures: dict = {}
        if all(_matches(c, keys, item, captures) for c in rule.conditions):
            return rule, captures
    return None, {}


def _placed_attributes(rule: RuleConfig, mapping: MappingConfig, image: Item) -> Iterable:
    """(attribute, family, qualifier, encoding) for every attribute of the image
    that the rule places in a column; raises for attributes it must not drop."""
    key_attrs = mapping.source.key_attributes
    for name in sorted(image):
        if name in key_attrs and not rule.include_key_attributes and rule.column_for(name) is None:
            continue
        column = rule.column_for(name)
        if column is not None:
            yield name, column.family, column.qualifier, column.encoding
        elif rule.other.mode == "column":
            yield name, rule.other.family, name.encode("utf-8"), rule.other.encoding
        elif rule.other.mode == "dead_letter":
            raise MappingError(
                f"attribute {name!r} is not mapped by rule {rule.name!r} "
                "(add it under columns, or set other_attributes)",
                reason="unmapped_attribute",
            )


def owned_columns(rule: RuleConfig, mapping: MappingConfig, image: Item) -> list:
    """The (family, qualifier) columns an image's item owns; no values encoded, so
    a delete never fails because an old value would not encode any more."""
    out = []
    key_attrs = mapping.source.key_attributes
    for name in sorted(image):
        if name in key_attrs and not rule.include_key_attributes and rule.column_for(name) is None:
            continue
        column = rule.column_for(name)
        if column is not None:
            out.append((column.family, column.qualifier))
        elif rule.other.mode == "column":
            out.append((rule.other.family, name.encode("utf-8")))
    return out


def cells_for_item(rule: RuleConfig, mapping: MappingConfig, image: Item) -> dict:
    """{(family, qualifier): value bytes} that the item should hold."""
    cells = {}
    for name, family, qualifier, encoding in _placed_attributes(rule, mapping, image):
        cells[(family, qualifier)] = encode(encoding, image[name], where=name)
    return cells


def validate_record(record: ChangeRecord) -> None:
    if record.event_name not in EVENT_NAMES:
        raise MappingError(f"unknown eventName {record.event_name!r}", reason="bad_record")
    if not record.keys:
        raise MappingError("record has no Keys", reason="bad_record")
    if record.event_name in (INSERT, MODIFY) and record.new_image is None:
        raise MappingError(
            f"{record.event_name} without NewImage: the stream must use NEW_AND_OLD_IMAGES", reason="bad_record"
        )
    if record.event_name in (MODIFY, REMOVE) and record.old_image is None:
        raise MappingError(
            f"{record.event_name} without OldImage: the stream must use NEW_AND_OLD_IMAGES", reason="bad_record"
        )
    if record.change_ms < 0:
        raise MappingError(f"negative change time {record.change_ms}", reason="bad_record")


def map_change(mapping: MappingConfig, record: ChangeRecord) -> tuple:
    """ChangeRecord → tuple[RowChange, ...] (empty when a rule skips the item).

    Raises MappingError (with a dead-letter ``reason``) when the record cannot be
    mapped; the caller dead-letters the whole record so nothing is half-applied.
    """
    validate_record(record)
    ts = record.change_ms
    rule, captures = select_rule(mapping, record.keys, record.item)
    if rule is None:
        if mapping.unmatched == "skip":
            return ()
        raise MappingError("no mapping rule matches this item", reason="no_matching_rule")
    if rule.skip:
        return ()

    row_key = build_key(rule.row_key, record.keys, record.item, captures)
    mutations: list = []
    new_cells = cells_for_item(rule, mapping, record.new_image) if record.event_name != REMOVE else {}
    for (family, qualifier), value in sorted(new_cells.items()):
        mutations.append(SetCell(family, qualifier, value, ts))
        if ts > 0:  # an end of 0 would mean "no end" on the wire
            # Older versions go: exactly one version per owned column, replay-safe.
            mutations.append(DeleteCells(family, qualifier, 0, ts))
    if record.old_image is not None:
        for family, qualifier in sorted(set(owned_columns(rule, mapping, record.old_image))):
            if (family, qualifier) not in new_cells:
                mutations.append(DeleteCells(family, qualifier, 0, ts + _INCLUSIVE_END_MS))
    if not mutations:
        return ()
    change = RowChange(table=mapping.target.table, row_key=row_key, mutations=tuple(mutations))
    check_row_change(change)
    return (change,)


def expected_row(mapping: MappingConfig, item: Item) -> Optional[tuple]:
    """(row_key, {(family, qualifier): value}) an item should produce, for
    verification and tests; None when the item is skipped."""
    keys = {k: item[k] for k in mapping.source.key_attributes if k in item}
    rule, captures = select_rule(mapping, keys, item)
    if rule is None or rule.skip:
        return None
    return build_key(rule.row_key, keys, item, captures), cells_for_item(rule, mapping, item)
