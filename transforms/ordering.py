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
the new clock in one atomic step). An applied change moves the row from the
state the clock records to the item's new state: it writes every owned cell
whose value the clock does not record (a digest per owned cell), and deletes
every cell the clock says the item owned and the new state does not; an older
or duplicate change does nothing. So each row always holds exactly the mapping
of the newest applied change's image, and after a REMOVE the clock stays as the
tombstone that keeps older changes out, until it is older than any record the
source can still deliver (``tombstone_expired``, docs/design.md §10.7).

This module is the pure part: order keys, the clock's encoding, the decision and
the mutations. The I/O (reading clocks, the swap) is ``pipeline/sink/guarded.py``.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Optional

from ddb2bt.transforms.attrs import canonical_typed_json, dump_str
from ddb2bt.transforms.config import MappingConfig
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.compiled import compiled_owned_cells
from ddb2bt.transforms.mapping import delete_cell, owned_now_and_before, validate_record, write_cell
from ddb2bt.transforms.model import REMOVE, ChangeRecord, DeleteCells, SetCell
from ddb2bt.transforms.native import native_map_json

__all__ = ["CLOCK_FAMILY", "Clock", "GuardedRow", "OrderKey", "cell_digest", "clock_mutations", "decode_clock",
           "encode_clock", "converge_rows", "guarded_rows", "image_hash", "is_newer", "order_key", "row_mutations",
           "map_json", "slot_mutations", "swap_expectation", "tombstone_expired", "typed_map_json_py"]

CLOCK_FAMILY = "ddb2bt_clock"
# Clock value layout version (encode_clock): lets a later layout be read next to this one.
# Format 1 (``1:<µs>:<hash>:<cells>``) is still read; format 2 puts a token first;
# format 3 adds each owned cell's value digest (what lets a change write only the
# cells whose value differs). Formats 1 and 2 are read with unknown digests: the
# next change to such a row writes every cell once, as before.
CLOCK_FORMAT = 3
TOKEN_FORMATS = (2, 3)  # formats whose value starts with the token the swap compares
LEGACY_CLOCK_FORMAT = 1
# The swap compares only the token (blake2b-128 of the rest of the value): a
# predicate of fixed size. Comparing the whole value grew with the cells the item
# owns (~8 filter bytes per byte), past Bigtable's 20,480-byte row-filter limit
# at ~100 map keys (docs/design.md §10.2). 128 bits: two different clocks of a
# row never share a token in practice.
TOKEN_BYTES = 16
HASH_BYTES = 8  # blake2b-64 of an image: a collision needs ~2^32 states of one item
# blake2b-64 of one cell's value: an unchanged digest means "not rewritten", so a
# collision would keep a stale value; at 2^-64 per changed cell that is never in
# practice, and 16 hex characters per owned cell keep the clock small.
DIGEST_BYTES = 8
US_PER_MS = 1000
# Hash of "no image" (before an INSERT, after a REMOVE).
_NO_IMAGE = b"null"
# json.dumps(value, separators=(",", ":")), byte for byte: json.dumps builds a
# new encoder on every call with non-default separators (once per clock written).
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":")).encode


def image_hash(image) -> bytes:
    """A short digest of an item image, the same however its attributes and set
    members are ordered (canonical typed JSON). Stored in clocks and compared
    with later changes' hashes (§10.3), so its input never changes: the fast
    path writes exactly ``canonical_typed_json``'s text, and leaves any other
    shape to it (which raises where the image is not valid)."""
    if image is None:
        return hashlib.blake2b(_NO_IMAGE, digest_size=HASH_BYTES).digest()
    return hashlib.blake2b(map_json(image), digest_size=HASH_BYTES).digest()


def map_json(image) -> bytes:
    """``canonical_typed_json({"M": image})`` in UTF-8: an image's text as
    ``image_hash`` takes it, and an item's key as its clock's qualifier. The
    fast path (C where built: encoders_c.c; else ``_typed_json``) writes the
    usual shapes, the reference the rest (and raises where a value is bad)."""
    data = _fast_map_json(image) if type(image) is dict else None
    if data is None:
        data = canonical_typed_json({"M": dict(image)}).encode("utf-8")
    return data


def typed_map_json_py(image: dict) -> Optional[bytes]:
    """The Python fast path of ``map_json``: ``_typed_json``'s text, or None."""
    text = _typed_json({"M": image})
    return None if text is None else text.encode("utf-8")


# The C fast path where it runs (transforms/native.py), else the Python one.
_fast_map_json = native_map_json() or typed_map_json_py


def _typed_json(value) -> Optional[str]:
    """``attrs.canonical_typed_json(value)`` for the shapes of a decoded image
    (plain dicts and lists; S, N, BOOL, NULL, SS, M, L), without its per-value
    path strings, which only name a bad value in an error; None for anything
    else (B, NS, BS, another Mapping, a malformed value): the reference decides.
    ``tests/unit/transforms/test_ordering_guard_hash.py`` holds the two equal."""
    if type(value) is not dict or len(value) != 1:
        return None
    for tag, inner in value.items():
        if tag == "S" or tag == "N":
            return '{"' + tag + '":' + dump_str(inner) + "}" if type(inner) is str else None
        if tag == "M":
            if type(inner) is not dict:
                return None
            parts = []
            for key in inner:
                if type(key) is not str:
                    return None
            for key in sorted(inner):
                member = inner[key]
                if type(member) is dict and len(member) == 1:  # a string or number: most attributes, inline
                    text = member.get("S")
                    if type(text) is str:
                        parts.append(dump_str(key) + ':{"S":' + dump_str(text) + "}")
                        continue
                    text = member.get("N")
                    if type(text) is str:
                        parts.append(dump_str(key) + ':{"N":' + dump_str(text) + "}")
                        continue
                body = _typed_json(member)
                if body is None:
                    return None
                parts.append(dump_str(key) + ":" + body)
            return '{"M":{' + ",".join(parts) + "}}"
        if tag == "BOOL":
            return ('{"BOOL":true}' if inner else '{"BOOL":false}') if type(inner) is bool else None
        if tag == "NULL":
            return '{"NULL":true}' if inner is True else None
        if tag == "SS":
            if type(inner) is not list or any(type(member) is not str for member in inner):
                return None
            return '{"SS":[' + ",".join(dump_str(member) for member in sorted(inner)) + "]}"
        if tag == "L":
            if type(inner) is not list:
                return None
            parts = [_typed_json(member) for member in inner]
            return None if None in parts else '{"L":[' + ",".join(parts) + "]}"
    return None


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
    order and new-image hash, the cells it left the item owning here
    ((family, qualifier, version_ms or None), sorted) and, aligned with them,
    each cell's value digest (``cell_digest``; None: unknown, a clock written
    before format 3)."""

    us: int
    new_hash: bytes
    cells: tuple
    digests: tuple = ()

    def digest_of(self) -> dict:
        """{cell id: digest} of the cells whose value this clock records."""
        return {cell: d for cell, d in zip(self.cells, self.digests) if d is not None}


def cell_digest(cell) -> str:
    """A digest (hex) of what an owned cell holds: its value, or a list column's
    values in order (each length-prefixed, so element boundaries count)."""
    if cell.values is None:  # one call: the digest of b"V" then the value, as below
        return hashlib.blake2b(b"V" + (cell.value or b""), digest_size=DIGEST_BYTES).hexdigest()
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(b"L")
    for v in cell.values:
        h.update(len(v).to_bytes(8, "big"))
        h.update(v)
    return h.hexdigest()


def encode_clock(clock: Clock) -> bytes:
    """ASCII (``3:<token hex>:<µs>:<hash hex>:<cells JSON>``, the token a digest
    of what follows it): the swap compares the ``3:<token>:`` prefix with an RE2
    value filter, where only ASCII bytes match themselves (``swap_expectation``)."""
    digests = clock.digests or (None,) * len(clock.cells)
    cells = [[f, q.hex(), v, d] for (f, q, v), d in zip(clock.cells, digests)]
    body = f"{clock.us}:{clock.new_hash.hex()}:{_COMPACT_JSON(cells)}"
    token = hashlib.blake2b(body.encode("ascii"), digest_size=TOKEN_BYTES).hexdigest()
    return f"{CLOCK_FORMAT}:{token}:{body}".encode("ascii")


def decode_clock(value: bytes) -> Clock:
    fmt, rest = value.decode("ascii").split(":", 1)
    if int(fmt) in TOKEN_FORMATS:
        rest = rest.split(":", 1)[1]  # the token
    elif int(fmt) != LEGACY_CLOCK_FORMAT:
        raise ValueError(f"clock cell of format {fmt}, this version reads {LEGACY_CLOCK_FORMAT} to {CLOCK_FORMAT}")
    us, new_hash, cells = rest.split(":", 2)
    entries = json.loads(cells)
    ids = tuple((e[0], bytes.fromhex(e[1]), e[2]) for e in entries)
    digests = tuple(e[3] if len(e) > 3 else None for e in entries)
    return Clock(int(us), bytes.fromhex(new_hash), ids, digests)


def swap_expectation(value: bytes) -> tuple:
    """(bytes, prefix): what the swap checks the clock cell still holds. A
    clock with a token by its ``<format>:<token>:`` prefix, a fixed size whatever
    the item owns; a format-1 clock (written before the token) by its whole value."""
    for fmt in TOKEN_FORMATS:
        head = f"{fmt}:".encode("ascii")
        if value.startswith(head):
            return value[:len(head) + 2 * TOKEN_BYTES + 1], True
    return value, False


def tombstone_expired(clock: Clock, now_us: int, retention_us: int) -> bool:
    """Whether ``clock`` is a tombstone (its item owns nothing in the row) that
    no record the source can still deliver could need: its change is older than
    ``retention_us`` before ``now_us``. Every change older than the tombstone's
    was written to the source before it, so by then each has left the source's
    retention, and removing the tombstone lets nothing back in
    (docs/design.md §10.7). A live clock (owning cells) is never expired."""
    return not clock.cells and clock.us < now_us - retention_us


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
    source before). ``refresh``: families whose cells are written on every
    applied change even when unchanged (a max-age GC rule ages cells by their
    timestamp: skipping an unchanged cell would let a live item's cell expire,
    where an ordered source rewrites it with every change). ``whole``: write
    every owned cell whatever the clock's digests say (``converge_rows``: a
    repair exists to fix what went around the clock, e.g. a shared cell another
    item's REMOVE deleted, so it cannot trust the digests; docs/design.md §10.2)."""

    table: str
    row_key: bytes
    item: bytes  # the clock qualifier: the item's key as canonical typed JSON
    ts_ms: int  # cell timestamp of the writes (docs/design.md §3.1)
    order: OrderKey
    new_cells: tuple  # OwnedCell, sorted by key
    old_cells: tuple  # (family, qualifier, version_ms or None), sorted
    refresh: frozenset = frozenset()
    whole: bool = False


def _cell_id(cell) -> tuple:
    return (cell.family, cell.qualifier, cell.version_ms)


def guarded_rows(mapping: MappingConfig, record: ChangeRecord, cells=compiled_owned_cells) -> tuple:
    """ChangeRecord → tuple[GuardedRow], one per row the old or new image owns
    cells in (a row the change leaves empty still gets its clock: the tombstone).
    Raises MappingError like ``map_change``. ``cells(mapping, keys, image,
    with_values)``: an image's owned cells — the compiled rules', or the general
    engine's ``mapping.owned_cells``, the reference they are tested against."""
    validate_record(record)
    if (record.is_ttl_delete and record.event_name == REMOVE and mapping.ttl is not None
            and mapping.ttl.deletions == "ignore"):
        return ()
    new = cells(mapping, record.keys, record.new_image, True) if record.event_name != REMOVE else {}
    try:
        old = cells(mapping, record.keys, record.old_image, False)
    except MappingError:  # an old image that no longer maps owned nothing we can name
        old = {}
    return _guarded_rows(new, old, record.keys, record.change_ms, order_key(record), _aging_families(mapping))


def converge_rows(mapping: MappingConfig, keys, current, seen: tuple, ts_ms: int) -> tuple:
    """The guard's form of ``mapping.converge_change`` (``dlq redrive`` and
    ``repair`` of an out-of-order source): the item's ``current`` state (None:
    gone) as a change at ``ts_ms``, ordered at the last µs of that millisecond,
    one GuardedRow per row it or one of the ``seen`` images owns cells in. Through
    the guard it is written only if newer than the row's clock, replaces the
    item's state with the clock listing what it owns (so a later REMOVE deletes
    it), and, the item gone, leaves the clock as the tombstone that keeps a late
    older change out. ``old_cells`` (used only where a row has no clock yet)
    unite what the seen images owned; an image that cannot be mapped any more
    owned nothing; ``current`` that cannot be mapped raises MappingError. Every
    owned cell is written, not only those whose value differs from the clock's
    digest (``GuardedRow.whole``): the row may not hold what the clock records."""
    new, old = owned_now_and_before(mapping, keys, current, seen)
    order = OrderKey(ts_ms * US_PER_MS + US_PER_MS - 1, image_hash(seen[-1] if seen else None), image_hash(current))
    return _guarded_rows(new, old, keys, ts_ms, order, _aging_families(mapping), whole=True)


def _aging_families(mapping: MappingConfig) -> frozenset:
    return frozenset(f.name for f in mapping.families if f.max_age_seconds)


def _guarded_rows(new: dict, old: dict, keys, ts_ms: int, order, refresh: frozenset = frozenset(),
                  whole: bool = False) -> tuple:
    """One GuardedRow per row the new or the old cells are in: what the change
    owns there now, and the ids of what it owned before."""
    rows: dict = {}
    for key in sorted(new):
        cell = new[key]
        rows.setdefault((cell.table, cell.row_key), ([], []))[0].append(cell)
    for key in sorted(old):
        cell = old[key]
        rows.setdefault((cell.table, cell.row_key), ([], []))[1].append(_cell_id(cell))
    item = map_json(keys)  # the clock's qualifier: canonical_typed_json's text, as image_hash takes it
    return tuple(GuardedRow(t, k, item, ts_ms, order, tuple(n), tuple(sorted(set(o), key=_sort_id)), refresh,
                            whole)
                 for (t, k), (n, o) in rows.items())


def clock_mutations(row: GuardedRow, cells: tuple, digests: tuple = ()) -> list:
    """The clock cell's new value, replacing every older version of it."""
    value = encode_clock(Clock(row.order.us, row.order.new_hash, cells, digests))
    out = [SetCell(CLOCK_FAMILY, row.item, value, row.ts_ms)]
    if row.ts_ms > 0:  # an end of 0 would mean "no end" on the wire
        out.append(DeleteCells(CLOCK_FAMILY, row.item, 0, row.ts_ms))
    return out


def row_mutations(row: GuardedRow, stored: Optional[Clock]) -> Optional[tuple]:
    """The mutations that move the row from ``stored`` to ``row``'s state, or None
    when the change is not newer than the clock (nothing to do): the difference,
    O(cells that change), not the whole state (docs/design.md §10.2)."""
    if not is_newer(row.order, stored):
        return None
    if stored is None:
        return _move(row, row.old_cells, {})
    return _move(row, stored.cells, stored.digest_of())


def slot_mutations(rows, stored: Optional[Clock]) -> tuple:
    """(mutations or None, how many of ``rows`` are applied): several changes of
    one item to one row (one slot), decided in the order given exactly as one
    swap after another would decide them, sent as one swap from ``stored`` to
    the last applied change's state. The cells the earlier applied changes
    owned are deleted as their own swaps would have deleted them; their values
    are never written, the last change's state replacing them."""
    applied = []
    state = stored
    for row in rows:
        if is_newer(row.order, state):
            applied.append(row)
            state = Clock(row.order.us, row.order.new_hash, ())  # what is_newer reads of a clock
    if not applied:
        return None, 0
    before = set(stored.cells if stored is not None else applied[0].old_cells)
    for row in applied[:-1]:
        before.update(_cell_id(cell) for cell in row.new_cells)
    held = stored.digest_of() if stored is not None else {}
    return _move(applied[-1], tuple(sorted(before, key=_sort_id)), held), len(applied)


def _move(row: GuardedRow, owned_before, held: dict) -> tuple:
    """The mutations from a row whose item owns ``owned_before`` (the values of
    ``held``, {cell id: digest}, known) to ``row``'s state, and the new clock."""
    ts = row.ts_ms
    muts: list = []
    keep: dict = {}  # cell id -> digest of the value the row holds after this change
    for cell in row.new_cells:
        cell_id, digest = _cell_id(cell), cell_digest(cell)
        keep[cell_id] = digest
        if held.get(cell_id) == digest and cell.family not in row.refresh and not row.whole:
            # The row holds this value already: the clock records what the last
            # applied swap left, and every write of this item's cells here goes
            # through a swap of this clock. The cell keeps the timestamp it was
            # written at, older than this change, so no newer write hides behind it.
            continue
        # prune=True: the column's older versions go, so it holds one version
        # (docs/design.md §5.1); safe because nothing of this item is newer here.
        muts.extend(write_cell(cell, ts, True))
    for family, qualifier, version in owned_before:
        if (family, qualifier, version) not in keep:
            muts.append(delete_cell(_Cell(family, qualifier, version), ts))
    cells = tuple(sorted(keep, key=_sort_id))
    muts.extend(clock_mutations(row, cells, tuple(keep[c] for c in cells)))
    return tuple(muts)


def _sort_id(cell_id: tuple) -> tuple:
    family, qualifier, version = cell_id
    return (family, qualifier, -1 if version is None else version)


@dataclass(frozen=True, slots=True)
class _Cell:  # what delete_cell reads of an OwnedCell
    family: str
    qualifier: bytes
    version_ms: Optional[int]
