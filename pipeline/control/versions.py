"""Version ownership: two items never share one cell version silently.

A versioned cell's timestamp comes from an attribute (a comment's ``CreatedAt``),
so two different items can map to the same (table, row, column, version) — two
comments on one video posted in the same second. Bigtable holds one value per
version: the later write would overwrite the earlier comment, and deleting
either would delete "both". So the sink keeps, in the state table (never in the
target: nothing of ours stays there), which item owns each version it wrote::

  {job}#ver#{table}#{row hex}#{family}#{qualifier hex}#{version ms}   meta:owner = item key

and, per batch, in stream order:
  * a write of a version nobody owns claims it (CheckAndMutateRow: atomic against
    the backfill and other writers); a version its own item owns is written as
    usual (edits, replays); a version another item owns is a clash: the change is
    refused whole as a dead letter ``version_clash`` naming both keys;
  * a delete of a version another item owns is dropped (only that mutation): one
    item's delete never removes another item's version; the owner's delete
    releases the version once written.

Versions written before this registry existed have no owner: the first writer
claims them, and deletes of them go through.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from ddb2bt.transforms.model import DeleteCells, Guard, SetCell

OWNER_FAMILY = "meta"  # the state table's own family: no new family to create
OWNER_QUALIFIER = b"owner"
VERSION_DIGITS = 13


class VersionOwners:
    """The ownership rows, on a state backend with ``read_keys``, ``claim`` and
    ``write_rows`` (``state.BigtableStateBackend``; the in-memory fake in tests)."""

    def __init__(self, backend, job: str, now_ms: Callable[[], int]) -> None:
        self._backend = backend
        self._job = job
        self._now_ms = now_ms

    def key(self, table: str, row: bytes, family: str, qualifier: bytes, version_ms: int) -> bytes:
        return (f"{self._job}#ver#{table}#{row.hex()}#{family}#{qualifier.hex()}#"
                f"{version_ms:0{VERSION_DIGITS}d}").encode()

    def owners(self, keys) -> dict:
        rows = self._backend.read_keys(sorted(set(keys)))
        return {k: cells.get((OWNER_FAMILY, OWNER_QUALIFIER)) for k, cells in rows.items()}

    def claimed_since(self, since_ms: int, skip_ms: Optional[int] = None) -> list:
        """[(table, row, family, qualifier, version ms, owner)] of every version
        whose owning change is at or after ``since_ms`` (claims are stamped with
        their change's time, see claim), except those stamped exactly ``skip_ms``
        (a backfill's cells' time). For the recovery's boundary sweep (docs/design.md
        §8.1.1); needs a backend with ``keys_written_since``."""
        prefix = f"{self._job}#ver#".encode()
        stamped = self._backend.keys_written_since(prefix, since_ms)
        keys = [k for k, ts in stamped.items() if ts != skip_ms]
        out = []
        for key, owner in sorted(self.owners(keys).items()):
            if not owner:
                continue
            table, row, family, qualifier, version = key[len(prefix):].decode().rsplit("#", 4)
            out.append((table, bytes.fromhex(row), family, bytes.fromhex(qualifier), int(version), owner))
        return out

    def claim(self, key: bytes, owner: bytes, change_ms: Optional[int] = None) -> bool:
        """Own ``key`` unless someone does already; True when claimed. The owner
        cell is stamped with the claiming change's time (``change_ms``; now when
        unknown): the recovery's sweep asks which versions changes since a time
        claimed (``claimed_since``)."""
        stamp = change_ms if change_ms is not None and change_ms > 0 else self._now_ms()
        return self._backend.claim(key, Guard(OWNER_FAMILY, OWNER_QUALIFIER, 0, True, 0),
                                   [SetCell(OWNER_FAMILY, OWNER_QUALIFIER, owner, stamp)])

    def claimed_before(self, key: bytes, before_ms: int) -> Optional[bool]:
        """Whether the owner of ``key`` was claimed by a change before
        ``before_ms`` (claims are stamped with their change's time); None when
        nobody owns it. For the re-copy sweep (docs/design.md §7.7)."""
        if not self.owners([key]).get(key):
            return None
        return key not in self._backend.keys_written_since(key, before_ms)

    def settle(self, final: dict, stamps: Optional[dict] = None) -> None:
        """{key: owner or None}: set owners and release versions (after the write).
        ``stamps``: {key: time of the change that owns it now} (see claim)."""
        now = self._now_ms()
        stamps = stamps or {}
        rows = []
        for key, owner in sorted(final.items()):
            # Every earlier owner cell goes first, over all time (end 0: no end): an
            # owner is stamped with its change's time, by AWS's clock, which may be
            # ahead of ours. Then the new owner, at its change's time.
            muts = [DeleteCells(OWNER_FAMILY, OWNER_QUALIFIER, 0, 0)]
            if owner is not None:
                muts.append(SetCell(OWNER_FAMILY, OWNER_QUALIFIER, owner, stamps.get(key) or now + 1))
            rows.append((key, muts))
        if rows:
            self._backend.write_rows(rows)


def resolve(owners: VersionOwners, entries: list, dead_letter: Callable) -> tuple:
    """Decide, in order, for ``entries`` [(MappedChange, RowChange)] of one batch.
    Returns (dead letters, ids of the refused MappedChanges, {id(RowChange):
    RowChange without the dropped deletes}, {key: owner or None} to settle once
    the batch is written, {key: time of the change that owns it}).
    ``dead_letter(element, reason, message)``."""
    wanted = {owners.key(c.table, c.row_key, f, q, v) for _, c in entries for f, q, v, _ in c.versioned}
    stored = owners.owners(wanted)
    view = dict(stored)
    final: dict = {}
    stamps: dict = {}
    dead: list = []
    dead_ids: set = set()
    replaced: dict = {}
    for element, change in entries:
        if id(element) in dead_ids:
            continue
        drop: set = set()
        claimed: list = []
        clash: Optional[tuple] = None
        record = getattr(element, "record", None)
        change_ms = getattr(record, "change_ms", None)
        for family, qualifier, version, is_write in change.versioned:
            key = owners.key(change.table, change.row_key, family, qualifier, version)
            have = view.get(key)
            if is_write:
                if have is None:
                    if stored.get(key) is None and key not in final:
                        if owners.claim(key, change.owner, change_ms):
                            claimed.append(key)
                            stored[key] = change.owner
                        else:  # claimed by another writer since we read
                            have = stored[key] = owners.owners([key]).get(key)
                    else:  # released earlier in this batch: ours once the batch is written
                        final[key] = change.owner
                        stamps[key] = change_ms
                if have is not None and have != change.owner:
                    clash = (family, qualifier, version, have)
                    break
                view[key] = change.owner
            elif have is not None and have != change.owner:
                drop.add((family, qualifier, version))
            elif have is not None:
                view[key] = None
                final[key] = None
        if clash is not None:
            family, qualifier, version, other = clash
            for key in claimed:  # give back what this refused change claimed
                final[key] = None
                view[key] = None
            dead_ids.add(id(element))
            dead.append(dead_letter(element, "version_clash", (
                f"item {change.owner.decode('utf-8', 'replace')} maps to cell {family}:"
                f"{qualifier.decode('utf-8', 'replace')} version {version} of row "
                f"{change.row_key.decode('utf-8', 'replace')} in {change.table}, which item "
                f"{other.decode('utf-8', 'replace')} already holds: Bigtable keeps one value per version, "
                "so this change is refused (make the version unique, e.g. a finer timestamp attribute)")))
            continue
        if drop:
            kept = tuple(m for m in change.mutations if not (
                type(m) is DeleteCells and (m.family, m.qualifier, m.start_ms) in drop
                and m.end_ms == m.start_ms + 1))
            replaced[id(change)] = replace(change, mutations=kept, size_bytes=-1)
    return dead, dead_ids, replaced, final, stamps
