"""The per-item ordering guard: changes delivered out of order or twice still
converge (docs/design.md §10).

Kinesis Data Streams for DynamoDB may deliver one item's changes out of order
and more than once. Bigtable keeps no tombstones, so an older change applied
after a newer delete would bring the item back. The guard keeps, in each target
row an item writes, one *clock cell* of that item:

  family ``ddb2bt_clock``, qualifier = the item's key as canonical typed JSON,
  value = (order key of the change last applied, hash of its new image,
          the cells that change left the item owning in this row)

and applies a change to the row only if it is newer than the clock, as a
compare-and-swap of the clock cell (CheckAndMutateRow: the row's mutations and
the new clock in one atomic step). An applied change writes the item's *whole*
new state in the row (every owned cell, not a diff) and deletes every cell the
clock says the item owned and the new state does not; an older or duplicate
change does nothing. So each row always holds exactly the mapping of the
newest applied change's image, and after a REMOVE the clock stays as the
tombstone that keeps older changes out.

This module is the pure part: order keys, the clock's encoding, the decision and
the mutations. The I/O (reading clocks, the swap) is ``pipeline/sink/guarded.py``.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Optional

from ddb2bt.transforms.attrs import canonical_typed_json
from ddb2bt.transforms.config import MappingConfig
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.mapping import delete_cell, owned_cells, owned_now_and_before, validate_record, write_cell
from ddb2bt.transforms.model import REMOVE, ChangeRecord, DeleteCells, SetCell

__all__ = ["CLOCK_FAMILY", "Clock", "GuardedRow", "OrderKey", "clock_mutations", "decode_clock", "encode_clock",
           "converge_rows", "guarded_rows", "image_hash", "is_newer", "order_key", "row_mutations",
           "swap_expectation"]

CLOCK_FAMILY = "ddb2bt_clock"
# Clock value layout version (encode_clock): lets a later layout be read next to this one.
# Format 1 (``1:<µs>:<hash>:<cells>``) is still read; format 2 puts a token first.
CLOCK_FORMAT = 2
LEGACY_CLOCK_FORMAT = 1
# The swap compares only the token (blake2b-128 of the rest of the value): a
# predicate of fixed size. Comparing the whole value grew with the cells the item
# owns (~8 filter bytes per byte), past Bigtable's 20,480-byte row-filter limit
# at ~100 map keys (docs/design.md §10.2). 128 bits: two different clocks of a
# row never share a token in practice.
TOKEN_BYTES = 16
HASH_BYTES = 8  # blake2b-64 of an image: a collision needs ~2^32 states of one item
US_PER_MS = 1000
# Hash of "no image" (before an INSERT, after a REMOVE).
_NO_IMAGE = b"null"


def image_hash(image) -> bytes:
    """A short digest of an item image, the same however its attributes and set
    members are ordered (canonical typed JSON)."""
    body = _NO_IMAGE if image is None else canonical_typed_json({"M": dict(image)}).encode("utf-8")
    return hashlib.blake2b(body, digest_size=HASH_BYTES).digest()


@dataclass(frozen=True, slots=True)
class OrderKey:
    """When a change happened, as precisely as the source says (µs), and the
    hashes of its images, which order two changes of one timestamp (below)."""

    us: int
    old_hash: bytes
    new_hash: bytes


def order_key(record: ChangeRecord) -> OrderKey:
    us = record.change_us if record.change_us >= 0 else record.change_ms * US_PER_MS
    return OrderKey(us, image_hash(record.old_image), image_hash(record.new_image))


@dataclass(frozen=True, slots=True)
class Clock:
    """What a row's clock cell for one item says: the last applied change's
    order and new-image hash, and the cells it left the item owning here
    ((family, qualifier, version_ms or None), sorted)."""

    us: int
    new_hash: bytes
    cells: tuple


def encode_clock(clock: Clock) -> bytes:
    """ASCII (``2:<token hex>:<µs>:<hash hex>:<cells JSON>``, the token a digest
    of what follows it): the swap compares the ``2:<token>:`` prefix with an RE2
    value filter, where only ASCII bytes match themselves (``swap_expectation``)."""
    cells = [[f, q.hex(), v] for f, q, v in clock.cells]
    body = f"{clock.us}:{clock.new_hash.hex()}:{json.dumps(cells, separators=(',', ':'))}"
    token = hashlib.blake2b(body.encode("ascii"), digest_size=TOKEN_BYTES).hexdigest()
    return f"{CLOCK_FORMAT}:{token}:{body}".encode("ascii")


def decode_clock(value: bytes) -> Clock:
    fmt, rest = value.decode("ascii").split(":", 1)
    if int(fmt) == CLOCK_FORMAT:
        rest = rest.split(":", 1)[1]  # the token
    elif int(fmt) != LEGACY_CLOCK_FORMAT:
        raise ValueError(f"clock cell of format {fmt}, this version reads {LEGACY_CLOCK_FORMAT} and {CLOCK_FORMAT}")
    us, new_hash, cells = rest.split(":", 2)
    return Clock(int(us), bytes.fromhex(new_hash), tuple((f, bytes.fromhex(q), v) for f, q, v in json.loads(cells)))


def swap_expectation(value: bytes) -> tuple:
    """(bytes, prefix): what the swap checks the clock cell still holds. A
    format-2 clock by its ``2:<token>:`` prefix, a fixed size whatever the item
    owns; a format-1 clock (written before the token) by its whole value."""
    head = f"{CLOCK_FORMAT}:".encode("ascii")
    if value.startswith(head):
        return value[:len(head) + 2 * TOKEN_BYTES + 1], True
    return value, False


def is_newer(key: OrderKey, stored: Optional[Clock]) -> bool:
    """Whether a change with ``key`` comes after the one ``stored`` recorded.

    A later timestamp is newer. At an equal timestamp (MILLISECOND precision, or
    the backfill's fixed time) the images decide: a change whose old image is the
    stored new image is its successor in the item's history; anything else at that
    timestamp (a duplicate, the predecessor, an unrelated change) is not newer, so
    the first applied wins. docs/design.md §10.3 says what this cannot order."""
    if stored is None:
        return True
    if key.us != stored.us:
        return key.us > stored.us
    return key.old_hash == stored.new_hash and key.new_hash != stored.new_hash


@dataclass(frozen=True, slots=True)
class GuardedRow:
    """One change's effect on one row, as a state, not a diff: the cells the new
    image owns here (with values) and the cells the old image owned here (used
    only when the row has no clock for the item yet, e.g. written by an ordered
    source before)."""

    table: str
    row_key: bytes
    item: bytes  # the clock qualifier: the item's key as canonical typed JSON
    ts_ms: int  # cell timestamp of the writes (docs/design.md §3.1)
    order: OrderKey
    new_cells: tuple  # OwnedCell, sorted by key
    old_cells: tuple  # (family, qualifier, version_ms or None), sorted


def _cell_id(cell) -> tuple:
    return (cell.family, cell.qualifier, cell.version_ms)


def guarded_rows(mapping: MappingConfig, record: ChangeRecord) -> tuple:
    """ChangeRecord → tuple[GuardedRow], one per row the old or new image owns
    cells in (a row the change leaves empty still gets its clock: the tombstone).
    Raises MappingError like ``map_change``."""
    validate_record(record)
    if (record.is_ttl_delete and record.event_name == REMOVE and mapping.ttl is not None
            and mapping.ttl.deletions == "ignore"):
        return ()
    new = owned_cells(mapping, record.keys, record.new_image) if record.event_name != REMOVE else {}
    try:
        old = owned_cells(mapping, record.keys, record.old_image, with_values=False)
    except MappingError:  # an old image that no longer maps owned nothing we can name
        old = {}
    return _guarded_rows(new, old, record.keys, record.change_ms, order_key(record))


def converge_rows(mapping: MappingConfig, keys, current, seen: tuple, ts_ms: int) -> tuple:
    """The guard's form of ``mapping.converge_change`` (``dlq redrive`` and
    ``repair`` of an out-of-order source): the item's ``current`` state (None:
    gone) as a change at ``ts_ms``, ordered at the last µs of that millisecond,
    one GuardedRow per row it or one of the ``seen`` images owns cells in. Through
    the guard it is written only if newer than the row's clock, replaces the
    whole state with the clock listing what it owns (so a later REMOVE deletes
    it), and, the item gone, leaves the clock as the tombstone that keeps a late
    older change out. ``old_cells`` (used only where a row has no clock yet)
    unite what the seen images owned; an image that cannot be mapped any more
    owned nothing; ``current`` that cannot be mapped raises MappingError."""
    new, old = owned_now_and_before(mapping, keys, current, seen)
    order = OrderKey(ts_ms * US_PER_MS + US_PER_MS - 1, image_hash(seen[-1] if seen else None), image_hash(current))
    return _guarded_rows(new, old, keys, ts_ms, order)


def _guarded_rows(new: dict, old: dict, keys, ts_ms: int, order) -> tuple:
    """One GuardedRow per row the new or the old cells are in: what the change
    owns there now, and the ids of what it owned before."""
    rows: dict = {}
    for key in sorted(new):
        cell = new[key]
        rows.setdefault((cell.table, cell.row_key), ([], []))[0].append(cell)
    for key in sorted(old):
        cell = old[key]
        rows.setdefault((cell.table, cell.row_key), ([], []))[1].append(_cell_id(cell))
    item = canonical_typed_json({"M": dict(keys)}).encode("utf-8")
    return tuple(GuardedRow(t, k, item, ts_ms, order, tuple(n), tuple(sorted(set(o), key=_sort_id)))
                 for (t, k), (n, o) in rows.items())


def clock_mutations(row: GuardedRow, cells: tuple) -> list:
    """The clock cell's new value, replacing every older version of it."""
    value = encode_clock(Clock(row.order.us, row.order.new_hash, cells))
    out = [SetCell(CLOCK_FAMILY, row.item, value, row.ts_ms)]
    if row.ts_ms > 0:  # an end of 0 would mean "no end" on the wire
        out.append(DeleteCells(CLOCK_FAMILY, row.item, 0, row.ts_ms))
    return out


def row_mutations(row: GuardedRow, stored: Optional[Clock]) -> Optional[tuple]:
    """The mutations that move the row from ``stored`` to ``row``'s state, or None
    when the change is not newer than the clock (nothing to do)."""
    if not is_newer(row.order, stored):
        return None
    ts = row.ts_ms
    muts: list = []
    keep = set()
    for cell in row.new_cells:
        keep.add(_cell_id(cell))
        # prune=True: the column's older versions go, so it holds one version
        # (docs/design.md §5.1); safe because nothing of this item is newer here.
        muts.extend(write_cell(cell, ts, True))
    owned_before = stored.cells if stored is not None else row.old_cells
    for family, qualifier, version in owned_before:
        if (family, qualifier, version) not in keep:
            muts.append(delete_cell(_Cell(family, qualifier, version), ts))
    muts.extend(clock_mutations(row, tuple(sorted(keep, key=_sort_id))))
    return tuple(muts)


def _sort_id(cell_id: tuple) -> tuple:
    family, qualifier, version = cell_id
    return (family, qualifier, -1 if version is None else version)


@dataclass(frozen=True, slots=True)
class _Cell:  # what delete_cell reads of an OwnedCell
    family: str
    qualifier: bytes
    version_ms: Optional[int]
