"""The pure heart of the replicator: ``map_change(mapping, record)``.

Model: a mapping says which **cells an item owns** — in its own row, in rows it
shares with other items (Example 2 folds a video's items into one row), and in
index rows that replace GSIs. A change's mutations are the *difference* between
the cells the old image owned and the cells the new image owns, written per the
correctness contract (docs/design.md §3 and §5):

* an ordinary cell is written at the change's own timestamp (whole ms, never -1)
  and its older versions are deleted (``[0, ts)``), so each such column holds
  exactly one version and a replay of an older change never wins;
* a *versioned* cell (timestamp from an attribute, e.g. a comment's CreatedAt) is
  written at that timestamp and deleted as exactly that version ``[v, v + 1 ms)``;
* a *list* column holds one version per element at ``ts − (n−1−i)`` ms (newest
  last), older versions deleted below the first element;
* a cell the old image owned and the new one does not is deleted over
  ``[0, ts + 1 ms)`` (versioned: exactly its version) — time-bounded, never
  DeleteFromRow, so replays are harmless. This one rule removes attributes,
  deletes items, moves index rows whose key changed, and follows an item that
  changed entity type.

The same function serves the live tail, the backfill (records synthesised from
scanned items) and verification (``expected_cells``).
"""
from __future__ import annotations

import datetime as _dt
from decimal import Decimal
from typing import Mapping, NamedTuple, Optional

from ddb2bt.transforms.attrs import as_bytes, canonical_json, canonical_typed_json, parse_number, type_of
from ddb2bt.transforms.config import (ColumnConfig, IndexConfig, MappingConfig, MatchCondition, RuleConfig, memo,
                               resolve_hook)
from ddb2bt.transforms.encoding import ENCODERS, encode
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.limits import MAX_TIMESTAMP_MS, checked_size
from ddb2bt.transforms.model import (
    EVENT_NAMES,
    INSERT,
    NO_CHANGE_TIME,
    MODIFY,
    REMOVE,
    ChangeRecord,
    DeleteCells,
    Item,
    RowChange,
    SetCell,
    Guard,
    build_change_record,
)
from ddb2bt.transforms.rowkey import build_key

# Bigtable's delete range end is exclusive: +1 ms makes the change's own cells part of it.
INCLUSIVE_END_MS = 1
INDEX_POINTER = b"row"  # the index row's cell holding the main row key
# Touch markers (backfill/tail overlap, versioned columns only): a family of ours
# in the target table, garbage-collected after a week; never compared by verify.
MARKER_FAMILY = "ddb2bt_touch"
MARKER_MAX_AGE_S = 7 * 24 * 3600
MARKER_PREFIX = b"t#"


class OwnedCell(NamedTuple):
    """A cell an item owns. ``version_ms`` None: written at the change time, one
    version. ``values`` is set for list columns (one version per element).
    A NamedTuple: an image of ten attributes builds ten of these per change."""

    table: str
    row_key: bytes
    family: str
    qualifier: bytes
    version_ms: Optional[int] = None
    value: Optional[bytes] = None
    values: Optional[tuple] = None

    @property
    def key(self) -> tuple:
        return (self.table, self.row_key, self.family, self.qualifier, self.version_ms, self.values is not None)


# --- rule selection -------------------------------------------------------------


def _lookup(keys: Item, item: Optional[Item], name: str):
    value = keys.get(name)
    if value is None and item is not None:
        value = item.get(name)
    return value


def condition_matches(cond: MatchCondition, keys: Item, item: Optional[Item], captures: dict) -> bool:
    value = _lookup(keys, item, cond.attribute)
    if cond.kind == "present":
        return (value is not None) == cond.value
    if value is None:
        return False
    tag = type_of(value, cond.attribute)
    scalar = value[tag]
    if cond.kind == "equals":
        if isinstance(cond.value, bool):
            return tag == "BOOL" and scalar == cond.value
        if tag == "N" and isinstance(cond.value, (int, float)):
            return parse_number(scalar) == Decimal(str(cond.value))
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


def conditions_hold(conditions: tuple, keys: Item, item: Optional[Item], captures: Optional[dict] = None) -> bool:
    found: dict = {}
    ok = all(condition_matches(c, keys, item, found) for c in conditions)
    if ok and captures is not None:
        captures.update(found)
    return ok


def select_rule(mapping: MappingConfig, keys: Item, item: Optional[Item]) -> tuple:
    """First rule whose conditions all hold → (rule, captures), or (None, {})."""
    for rule in mapping.rules:
        captures: dict = {}
        if conditions_hold(rule.conditions, keys, item, captures):
            return rule, captures
    return None, {}


# --- owned cells ----------------------------------------------------------------


# Where seconds end and milliseconds begin (the plausibility rule): 10^11 seconds
# is the year 5138, 10^11 milliseconds is 1973-03-03T09:46:40Z. An epoch_seconds
# value at or above it is in milliseconds (or finer); an epoch_millis value below
# it is in seconds. Either read in the wrong unit would put the cell ~1000x away
# (the year ~56,000, or January 1970, which a max_age family then collects).
EPOCH_UNIT_BOUNDARY = 10**11


def _plausible_epoch(number: Decimal, fmt: str, raw, where: str) -> None:
    if fmt == "epoch_seconds" and number >= EPOCH_UNIT_BOUNDARY:
        year = 1970 + int(number / 31_556_952)
        raise MappingError(f"{where}: {raw} as epoch_seconds is the year ~{year:,}; it looks like milliseconds "
                           "(use format: epoch_millis)", reason="timestamp_unit")
    if fmt == "epoch_millis" and number < EPOCH_UNIT_BOUNDARY:
        when = (_dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc) + _dt.timedelta(milliseconds=int(number)))
        raise MappingError(f"{where}: {raw} as epoch_millis is {when:%Y-%m-%dT%H:%M:%SZ}, before 1973-03-03; it "
                           "looks like seconds (use format: epoch_seconds)", reason="timestamp_unit")


def parse_timestamp_ms(value, fmt: str, where: str) -> int:
    """A cell timestamp from an attribute value, in whole milliseconds (rounded
    down: Bigtable accepts only whole-ms timestamps). An epoch value whose
    magnitude says it is in the other unit is refused (EPOCH_UNIT_BOUNDARY)."""
    tag = type_of(value, where)
    raw = value[tag]
    try:
        if fmt == "iso8601":
            if tag != "S":
                raise ValueError("an ISO-8601 timestamp must be a string")
            parsed = _dt.datetime.fromisoformat(raw)
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=_dt.timezone.utc)
            ms = (parsed - _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)) // _dt.timedelta(milliseconds=1)
        else:
            if tag not in ("N", "S"):
                raise ValueError("an epoch timestamp must be a number")
            number = parse_number(raw, where)
            _plausible_epoch(number, fmt, raw, where)
            scaled = number * 1000 if fmt == "epoch_seconds" else number
            ms = int(scaled.to_integral_value(rounding="ROUND_FLOOR"))
    except MappingError as exc:
        if exc.reason == "timestamp_unit":
            raise
        raise MappingError(f"{where}: cannot read {raw!r} as a {fmt} timestamp ({exc})", reason="timestamp") from None
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise MappingError(f"{where}: cannot read {raw!r} as a {fmt} timestamp ({exc})", reason="timestamp") from None
    if not 0 <= ms <= MAX_TIMESTAMP_MS:
        raise MappingError(f"{where}: timestamp {ms} ms is out of range", reason="timestamp")
    return ms


def _set_members(value, where: str) -> list:
    tag = type_of(value, where)
    if tag == "SS":
        return [m.encode("utf-8") for m in value["SS"]]
    if tag == "NS":
        return [m.encode("ascii") for m in value["NS"]]
    if tag == "BS":
        return [as_bytes(m, where) for m in value["BS"]]
    if tag == "L":  # a list used as a set: only scalar members
        return [_scalar_bytes(v, f"{where}[{i}]") for i, v in enumerate(value["L"])]
    raise MappingError(f"{where}: 'as: set' needs SS, NS, BS or L, got {tag}", reason="encoding")


def _scalar_bytes(value, where: str) -> bytes:
    tag = type_of(value, where)
    if tag == "S":
        return value["S"].encode("utf-8")
    if tag == "N":
        return value["N"].encode("ascii")
    if tag == "B":
        return as_bytes(value["B"], where)
    raise MappingError(f"{where}: set members must be S, N or B, got {tag}", reason="encoding")


class CellOwner:
    """Collects the cells of one image, refusing two claims on one cell."""

    def __init__(self, with_values: bool) -> None:
        self.with_values = with_values
        self.cells: dict = {}
        self.rule: Optional[RuleConfig] = None  # the rule and main row the image mapped to
        self.row: Optional[bytes] = None

    def add(self, cell: OwnedCell, what: str) -> None:
        key = cell.key
        if key in self.cells:
            raise MappingError(
                f"{what} and another attribute both map to {cell.family}:{cell.qualifier.decode('utf-8', 'replace')}",
                reason="column_collision")
        self.cells[key] = cell


def column_cells(owner: CellOwner, col: ColumnConfig, value, table: str, row: bytes, keys: Item, image: Item,
                  captures: Mapping) -> None:
    where = col.attribute
    values = owner.with_values
    if col.kind == "set":
        for member in _set_members(value, where):
            owner.add(OwnedCell(table, row, col.family, member, value=col.set_marker if values else None), where)
        return
    if col.kind == "map":
        if type_of(value, where) != "M":
            raise MappingError(f"{where}: 'as: map' needs M, got {type_of(value, where)}", reason="encoding")
        for k, v in value["M"].items():
            cell_value = encode(col.encoding, v, f"{where}.{k}") if values else None
            owner.add(OwnedCell(table, row, col.family, k.encode("utf-8"), value=cell_value), f"{where}.{k}")
        return
    qualifier = col.qualifier
    if col.qualifier_template is not None:
        qualifier = build_key(col.qualifier_template, keys, image, captures, where=f"{where} qualifier")
    if col.kind == "list_versions":
        if type_of(value, where) != "L":
            raise MappingError(f"{where}: 'as: list_versions' needs L", reason="encoding")
        elements = tuple(encode(col.encoding, v, f"{where}[{i}]") for i, v in enumerate(value["L"])) if values else ()
        owner.add(OwnedCell(table, row, col.family, qualifier, values=elements), where)
        return
    version = None
    if col.timestamp is not None:
        ts_value = _lookup(keys, image, col.timestamp.attribute)
        if ts_value is None:
            raise MappingError(f"{where}: timestamp attribute {col.timestamp.attribute!r} is missing",
                               reason="timestamp")
        version = parse_timestamp_ms(ts_value, col.timestamp.format, col.timestamp.attribute)
    cell_value = encode(col.encoding, value, where) if values else None
    owner.add(OwnedCell(table, row, col.family, qualifier, version, cell_value), where)


# What to do with an attribute, decided once per (rule, attribute name) and cached:
# the per-attribute checks (listed column? key? consumed? other attributes?) are
# the same for every item, and this loop runs for every attribute of every image.
PLAN_SKIP = 0  # not placed (key attribute, consumed by a template, ignored)
PLAN_PLAIN = 1  # one cell at the change time: (PLAN_PLAIN, family, qualifier, encoder)
PLAN_COLUMN = 2  # a listed column needing the general path: (PLAN_COLUMN, ColumnConfig)
PLAN_UNMAPPED = 3  # other_attributes: dead_letter
# Distinct attribute names whose plan is cached per rule; items with unbounded
# dynamic attribute names get their plan computed each time beyond this.
MAX_PLANNED_ATTRIBUTES = 10_000


def attribute_plan(rule: RuleConfig, key_attrs: tuple, name: str) -> tuple:
    column = rule.column_for(name)
    if column is not None:
        if column.kind == "value" and column.qualifier_template is None and column.timestamp is None:
            return (PLAN_PLAIN, column.family, column.qualifier, ENCODERS[column.encoding])
        return (PLAN_COLUMN, column)
    if name in key_attrs and not rule.include_key_attributes:
        return (PLAN_SKIP,)
    if name in rule.consumed:
        return (PLAN_SKIP,)  # used by the row key, a qualifier or a timestamp
    if rule.item_column is not None and rule.other.mode == "dead_letter":
        return (PLAN_SKIP,)  # the item column already keeps every attribute
    if rule.other.mode == "column":
        return (PLAN_PLAIN, rule.other.family, name.encode("utf-8"), ENCODERS[rule.other.encoding])
    if rule.other.mode == "dead_letter":
        return (PLAN_UNMAPPED,)
    return (PLAN_SKIP,)


def _plans(rule: RuleConfig) -> dict:
    return memo(rule, "_attribute_plans", dict)


def _rule_cells(owner: CellOwner, mapping: MappingConfig, rule: RuleConfig, keys: Item, image: Item,
                captures: Mapping) -> None:
    table = mapping.target.table
    if rule.hook is not None:
        _hook_cells(owner, rule, keys, image)
        return
    row = build_key(rule.row_key, keys, image, captures)
    owner.rule, owner.row = rule, row
    key_attrs = mapping.source.key_attributes
    plans = _plans(rule)
    cells = owner.cells
    with_values = owner.with_values
    for name in sorted(image):
        plan = plans.get(name)
        if plan is None:
            plan = attribute_plan(rule, key_attrs, name)
            if len(plans) < MAX_PLANNED_ATTRIBUTES:
                plans[name] = plan
        kind = plan[0]
        if kind == PLAN_PLAIN:
            _, family, qualifier, encoder = plan
            cell = OwnedCell(table, row, family, qualifier, None,
                             encoder(image[name], name) if with_values else None, None)
            key = (table, row, family, qualifier, None, False)  # == cell.key, without the call
            if key in cells:
                owner.add(cell, name)  # raises: two attributes claim one cell
            cells[key] = cell
        elif kind == PLAN_COLUMN:
            column_cells(owner, plan[1], image[name], table, row, keys, image, captures)
        elif kind == PLAN_UNMAPPED:
            raise MappingError(
                f"attribute {name!r} is not mapped by rule {rule.name!r} "
                "(add it under columns, or set other_attributes)",
                reason="unmapped_attribute",
            )
    if rule.item_column is not None:
        ic = rule.item_column
        whole = {k: v for k, v in image.items() if ic.include_keys or k not in key_attrs}
        value = None
        if owner.with_values:
            text = canonical_json({"M": whole}) if ic.encoding == "json" else canonical_typed_json({"M": whole})
            value = text.encode("utf-8")
        owner.add(OwnedCell(table, row, ic.family, ic.qualifier, value=value), "item_column")
    for index in rule.indexes:
        _index_cells(owner, mapping, index, keys, image, row)


def _index_cells(owner: CellOwner, mapping: MappingConfig, index: IndexConfig, keys: Item, image: Item,
                 main_row: bytes) -> None:
    if not conditions_hold(index.conditions, keys, image):
        return
    try:
        row = build_key(index.row_key, keys, image, where=f"index {index.name}")
    except MappingError as exc:
        if exc.reason == "missing_key_attribute":
            return  # sparse, like a GSI: items without the index attributes are not indexed
        raise
    table = index.table or mapping.target.table
    owner.add(OwnedCell(table, row, index.family, INDEX_POINTER, value=main_row if owner.with_values else None),
              f"index {index.name}")
    for name in index.project:
        if name in image:
            value = encode("auto", image[name], name) if owner.with_values else None
            owner.add(OwnedCell(table, row, index.family, name.encode("utf-8"), value=value), f"index {index.name}")


def _hook_cells(owner: CellOwner, rule: RuleConfig, keys: Item, image: Item) -> None:
    """``module:function(keys, image)`` returns cells as (table, row_key, family,
    qualifier, value, version_ms or None); the engine turns them into mutations."""
    func = resolve_hook(rule.hook)
    try:
        produced = list(func(dict(keys), dict(image)))
    except MappingError:
        raise
    except Exception as exc:  # a bug in user code is this record's problem, not the job's
        raise MappingError(f"hook {rule.hook} failed: {type(exc).__name__}: {exc}", reason="hook_error") from None
    for i, cell in enumerate(produced):
        try:
            table, row, family, qualifier, value, version = cell
            ok = (isinstance(table, str) and isinstance(row, bytes) and isinstance(family, str)
                  and isinstance(qualifier, bytes) and isinstance(value, bytes)
                  and (version is None or isinstance(version, int)))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise MappingError(f"hook {rule.hook} cell {i} is not (table, row_key bytes, family, qualifier "
                               "bytes, value bytes, version_ms|None)", reason="hook_error")
        owner.add(OwnedCell(table, row, family, qualifier, version, value if owner.with_values else None),
                  f"hook cell {i}")


def owned_cells(mapping: MappingConfig, keys: Item, image: Optional[Item], with_values: bool = True) -> dict:
    """{cell key: OwnedCell} the item owns (empty when skipped or absent). Without
    values, nothing is encoded: a delete never fails because an old value would
    not encode any more."""
    if image is None:
        return {}
    rule, captures = select_rule(mapping, keys, image)
    if rule is None:
        if mapping.unmatched == "skip":
            return {}
        raise MappingError("no mapping rule matches this item", reason="no_matching_rule")
    if rule.skip:
        return {}
    owner = CellOwner(with_values)
    _rule_cells(owner, mapping, rule, keys, image, captures)
    return owner.cells


def _owned(mapping: MappingConfig, keys: Item, image: Item) -> CellOwner:
    """owned_cells of a new image, keeping the rule and row it mapped to."""
    owner = CellOwner(True)
    rule, captures = select_rule(mapping, keys, image)
    if rule is None:
        if mapping.unmatched == "skip":
            return owner
        raise MappingError("no mapping rule matches this item", reason="no_matching_rule")
    if not rule.skip:
        _rule_cells(owner, mapping, rule, keys, image, captures)
    return owner


def _old_cells(mapping: MappingConfig, record: ChangeRecord, new: CellOwner) -> dict:
    """The cells the old image owned (keys only: nothing is encoded).

    Fast path for the common MODIFY: when the old image maps with the same rule to
    the same row, names no attribute the new image lacks, and every one of its
    attributes is a plain cell or not placed, each of its cells is one of the new
    image's cells too — nothing to delete, so nothing to compute (~25 % of a
    MODIFY's mapping time)."""
    old, keys = record.old_image, record.keys
    if old is None:
        return {}
    rule = new.rule
    if (rule is not None and record.new_image is not None and rule.hook is None and rule.item_column is None
            and not rule.indexes and old.keys() <= record.new_image.keys()):
        old_rule, captures = select_rule(mapping, keys, old)
        plans = _plans(rule)
        if (old_rule is rule and all(plans.get(name, _UNPLANNED)[0] in _SIMPLE for name in old)
                and build_key(rule.row_key, keys, old, captures) == new.row):
            return {}
    return owned_cells(mapping, keys, old, with_values=False)


_UNPLANNED = (None,)
_SIMPLE = (PLAN_PLAIN, PLAN_SKIP)


# --- change → mutations ---------------------------------------------------------


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
    if record.change_ms == NO_CHANGE_TIME:
        raise MappingError("record has no ApproximateCreationDateTime: it is the time every cell of the change is "
                           "written at, and no other time is safe to invent", reason="bad_record")
    if record.change_ms < 0:
        raise MappingError(f"negative change time {record.change_ms}", reason="bad_record")


def write_cell(cell: OwnedCell, ts: int, prune: bool) -> list:
    if cell.values is not None:
        n = len(cell.values)
        first = ts - n + 1  # element i at ts-(n-1-i): the newest element at the change time
        if n == 0:
            return [DeleteCells(cell.family, cell.qualifier, 0, ts + INCLUSIVE_END_MS)]
        if first < 1:
            raise MappingError(f"list of {n} elements needs timestamps before the epoch", reason="timestamp")
        out = [DeleteCells(cell.family, cell.qualifier, 0, first)]
        out += [SetCell(cell.family, cell.qualifier, v, first + i) for i, v in enumerate(cell.values)]
        return out
    if cell.version_ms is not None:
        return [SetCell(cell.family, cell.qualifier, cell.value, cell.version_ms)]
    if not prune or ts == 0:  # an end of 0 would mean "no end" on the wire
        return [SetCell(cell.family, cell.qualifier, cell.value, ts)]
    return [SetCell(cell.family, cell.qualifier, cell.value, ts), DeleteCells(cell.family, cell.qualifier, 0, ts)]


def delete_cell(cell: OwnedCell, ts: int) -> DeleteCells:
    if cell.version_ms is not None:
        return DeleteCells(cell.family, cell.qualifier, cell.version_ms, cell.version_ms + INCLUSIVE_END_MS)
    return DeleteCells(cell.family, cell.qualifier, 0, ts + INCLUSIVE_END_MS)


def item_owner(keys: Item) -> bytes:
    """An item as the owner of its versioned cells (RowChange.owner, the version
    owner records of pipeline/control/versions.py): its key as canonical typed JSON."""
    return canonical_typed_json({"M": dict(keys)}).encode("utf-8")


def marker_qualifier(keys: Item) -> bytes:
    """The touch-marker qualifier of an item: its key as canonical typed JSON."""
    return MARKER_PREFIX + canonical_typed_json({"M": dict(keys)}).encode("utf-8")


def general_map_change(mapping: MappingConfig, record: ChangeRecord, mark_touched: bool = False) -> tuple:
    """The general engine: the reference ``map_change`` (same contract, see there).
    Every mapping runs through its compiled form (``compiled.compile_mapping``),
    which hands this function every record it does not take itself and must give
    exactly its result; this function is what that is tested against."""
    validate_record(record)
    if (record.is_ttl_delete and record.event_name == REMOVE and mapping.ttl is not None
            and mapping.ttl.deletions == "ignore"):
        return ()
    ts = record.change_ms
    owner = _owned(mapping, record.keys, record.new_image) if record.event_name != REMOVE else CellOwner(True)
    new = owner.cells
    old = _old_cells(mapping, record, owner)
    rows: dict = {}  # (table, row_key) -> [mutations]; insertion order = first touch
    # Each write deletes the column's older versions, so a column holds one version.
    # Not needed for a stream INSERT: the item did not exist just before it, and
    # the REMOVE that ended any earlier life deleted every cell it owned up to its
    # own time (a replay re-applies that REMOVE before this INSERT again). It is a
    # third of the mutations of a typical stream, so it is worth skipping. Kept for
    # backfill records (older tail writes may sit below their handoff time) and
    # when TTL deletions are ignored (the expired life's cells were kept).
    prune = (record.event_name != INSERT or record.backfill_since_ms is not None
             or (mapping.ttl is not None and mapping.ttl.deletions == "ignore"))
    for key in sorted(new):
        cell = new[key]
        rows.setdefault((cell.table, cell.row_key), []).extend(write_cell(cell, ts, prune))
    for key in sorted(old):
        if key not in new:
            cell = old[key]
            rows.setdefault((cell.table, cell.row_key), []).append(delete_cell(cell, ts))
    qualifier = marker_qualifier(record.keys) if (mark_touched or record.backfill_since_ms is not None) else b""
    if mark_touched and record.backfill_since_ms is None:
        for row in rows.values():
            row.append(SetCell(MARKER_FAMILY, qualifier, b"", ts))
    versioned_rows = {(c.table, c.row_key) for c in new.values() if c.version_ms is not None}
    versions = _versions(new, old)
    owner = item_owner(record.keys) if versions else b""
    changes = []
    for (t, k), m in rows.items():
        if not m:
            continue
        guard = None
        if record.backfill_since_ms is not None:
            guard = Guard(MARKER_FAMILY, qualifier, record.backfill_since_ms,
                          conditional=(t, k) in versioned_rows, backfill_ms=ts)
        mutations = tuple(m)
        changes.append(RowChange(t, k, mutations, guard, checked_size(k, mutations),
                                 versions.get((t, k), ()), owner))
    return tuple(changes)


def map_change(mapping: MappingConfig, record: ChangeRecord, mark_touched: bool = False) -> tuple:
    """ChangeRecord → tuple[RowChange, ...], one per touched row, mutations in a
    deterministic order. Empty when nothing changes (skipped item, key-only item,
    TTL deletion the mapping ignores).

    The backfill/tail overlap (docs/design.md §7). Backfill cells carry the handoff
    second minus 1 ms, so a scanned value never overrides a streamed one. But a
    delete leaves no tombstone in Bigtable: if the tail applies an item's delete
    (or an attribute's removal) *before* a slower backfill batch writes the item's
    older scanned state, that state would be resurrected; and cells timestamped by
    an attribute (comments) are not older than the tail's at all. So:
    * while a backfill runs (``mark_touched``), every tail change also sets a touch
      marker for the item in each row it writes — same row entry, so atomic with
      the item's cells;
    * a backfill record (``record.backfill_since_ms`` set) gets a Guard per row:
      rows with versioned cells are written with CheckAndMutateRow, only if the
      item's marker has no version since the handoff second; other rows are
      written in batches and, once acknowledged, if the item's marker shows a
      touch, the backfill's own cells (timestamp ≤ handoff − 1 ms) are deleted
      again. Either way an item the tail touched after the handoff ends up exactly
      as the tail wrote it — a full image, since the stream has NEW_AND_OLD_IMAGES.

    Raises MappingError (with a dead-letter ``reason``) when the record cannot be
    mapped; the caller dead-letters the whole record so nothing is half-applied.

    Runs the mapping's compiled form (``compiled.compile_mapping``, built on first
    use), which gives exactly ``general_map_change``'s result, at a fraction of the
    CPU (bench/mapping_cpu.py).
    """
    compiled = mapping.__dict__.get("_compiled")  # compiled.COMPILED_ATTRIBUTE
    if compiled is None:
        from ddb2bt.transforms.compiled import compile_mapping  # inside: compiled.py imports this module (a module cycle)

        compiled = compile_mapping(mapping)
    return compiled(record, mark_touched)


def _versions(new: dict, old: dict) -> dict:
    """{(table, row): ((family, qualifier, version_ms, is_write), ...)} of the
    versioned cells a change writes (new) or deletes (old and not new)."""
    out: dict = {}
    for key, cell in new.items():
        if cell.version_ms is not None:
            out.setdefault((cell.table, cell.row_key), []).append((cell.family, cell.qualifier, cell.version_ms, True))
    for key, cell in old.items():
        if cell.version_ms is not None and key not in new:
            out.setdefault((cell.table, cell.row_key), []).append((cell.family, cell.qualifier, cell.version_ms, False))
    return {row: tuple(sorted(entries)) for row, entries in out.items()}


def owned_now_and_before(mapping: MappingConfig, keys: Item, current: Optional[Item], seen: tuple) -> tuple:
    """(cells ``current`` owns, with values; cells any of the ``seen`` images
    owned, without): what a redrive writes and what it may delete. An image that
    cannot be mapped any more owned nothing; ``current`` that cannot be mapped
    raises MappingError."""
    new = owned_cells(mapping, keys, current) if current is not None else {}
    old: dict = {}
    for image in seen:
        try:
            old.update(owned_cells(mapping, keys, image, with_values=False))
        except MappingError:
            continue
    return new, old


def converge_change(mapping: MappingConfig, keys: Item, current: Optional[Item], seen: tuple,
                    ts: int) -> tuple:
    """The row changes that make an item's cells equal what ``current`` owns
    (None: the item is gone), for a replay that must never resurrect anything
    (``ddb2bt dlq redrive``): ``current``'s cells are written at ``ts`` with their
    older versions deleted, as a backfill writes them, and every cell that one of
    the ``seen`` images owned and ``current`` does not is deleted up to ``ts``
    (a versioned cell: exactly its version). No stored image is ever re-applied:
    only the current state is written. An image that cannot be mapped any more
    owned no cells and is passed over; ``current`` that cannot be mapped raises."""
    new, old = owned_now_and_before(mapping, keys, current, seen)
    rows: dict = {}
    for key in sorted(new):
        cell = new[key]
        rows.setdefault((cell.table, cell.row_key), []).extend(write_cell(cell, ts, True))
    for key in sorted(old):
        if key not in new:
            cell = old[key]
            rows.setdefault((cell.table, cell.row_key), []).append(delete_cell(cell, ts))
    versions = _versions(new, old)
    owner = item_owner(keys) if versions else b""
    return tuple(RowChange(t, k, tuple(m), None, checked_size(k, m), versions.get((t, k), ()), owner)
                 for (t, k), m in rows.items() if m)


def backfill_record(keys: Item, item: Item, handoff_ms: int, position=None) -> ChangeRecord:
    """A scanned or exported item as a change: an INSERT one millisecond before the
    handoff second, guarded against the live tail (see map_change)."""
    since = handoff_second_ms(handoff_ms)
    # ChangeRecord(INSERT, keys, item, None, backfill_cell_ms(handoff_ms), position=position,
    # backfill_since_ms=since), its slots filled directly (model.slot_builder: once per
    # back-filled item); every field in order, the others at their defaults
    return build_change_record(INSERT, keys, item, None, backfill_cell_ms(handoff_ms), position,
                               "",  # event_id
                               False,  # is_ttl_delete
                               0,  # size_bytes
                               since,  # backfill_since_ms
                               -1)  # change_us: only change_ms is known


def backfill_cell_ms(handoff_ms: int) -> int:
    """The one timestamp of a backfill's cells: the handoff second minus 1 ms."""
    return handoff_second_ms(handoff_ms) - 1


def handoff_second_ms(handoff_ms: int) -> int:
    """The handoff time rounded down to the whole second (AWS stream timestamps
    are whole seconds: every change after the handoff is at or after this)."""
    return handoff_ms - handoff_ms % 1000


# --- expected layout (verification) --------------------------------------------


def expected_cells(mapping: MappingConfig, item: Item) -> dict:
    """{cell key: OwnedCell} the final item should have in Bigtable."""
    keys = {k: item[k] for k in mapping.source.key_attributes if k in item}
    return owned_cells(mapping, keys, item)


def expected_row(mapping: MappingConfig, item: Item) -> Optional[tuple]:
    """(row_key, {(family, qualifier): value}) of the item's main-table ordinary
    cells; None when skipped. Kept for simple single-row mappings."""
    cells = expected_cells(mapping, item)
    if not cells:
        return None
    main = [c for c in cells.values() if c.table == mapping.target.table]
    if not main:
        return None
    return main[0].row_key, {(c.family, c.qualifier): c.value for c in main if c.values is None}
