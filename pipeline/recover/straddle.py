"""The recovery's boundary sweep: the cells an item's lost change would have
deleted, found in the target (docs/design.md §8.1.1).

A trimmed shard stopped at its last applied change C. The export window that
holds C starts earlier, so for an item with changes on both sides of C (some
applied, a later one lost) the window's old image is older than what Bigtable
holds: a cell that only the applied, stop-time image owned is in neither image
of the line (or there is no line at all: an item created and deleted inside a
window is left out of it), and the line's diff keeps it. Neither the exports nor
the stream hold that image; the target does. Every ordinary cell the job wrote
carries its change's time, so right after a window [a, b) that can hold such a
change is applied:

* a cell of an ordinary column written at ``a <= ts < b`` was written by a change
  inside the window, by an item the window lists or leaves out as absent at b;
* if no line's image at b (``NewImage``) owns the column, a change of that item
  between ``ts`` and b removed it; that removal was not applied (an applied one
  deletes every version up to its own time), so it is lost (or waits in an
  intact shard's replay, which deletes it again): deleting the column up to
  ``ts`` is what the job would have done.

So the sweep reads every target table once, with a time filter applied by
Bigtable (only cells from the window's start on come back), and compares them
with the window's new images, both sides spilled to hash buckets (spill.py, as
`verify` does): memory is one bucket, at any table size.

Attribute-timestamped (versioned) cells do not carry their change's time; each
has an owner record (§5.3), stamped with the time of the change that claimed it.
A version claimed by a change since the first swept window's start whose owner's
last image in the exports does not hold it was written before the exports' end
(they reach past every applied change, ``check_coverage``) and removed before
it, by a change that was not applied; an owner no line lists was created and
deleted inside a window. Either way it is deleted exactly and released.

A column is judged on its newest cell: the scan reads from the window's start
on, and a column whose newest cell is after the window belongs to a later change
(the lower elements of a list column are stamped below their change's time).

Under skew (docs/design.md §8.1.1): a cell carries its change's stream record
time, which can be up to recover.SWEEP_LOOKBACK_MS before PITR's write time, by
which the windows are cut. So the first swept window is read from that much
before its start (an item created there and deleted by a lost change is in no
line, with its cells before the window), and every cell is judged by its item's
state at the window's end: its line's new image or, for an item the window does
not list, its state at the start (its last line in the windows before, written
since then): an unchanged item's cell is not stale.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.mapping import item_owner, owned_cells
from ddb2bt.pipeline.verify.spill import bucket_count, paired_groups, Spill, SpillDir
from ddb2bt.transforms.model import ChangeRecord, DeleteCells, MappedChange, REMOVE, RowChange

__all__ = ["SweepResult", "BoundarySweep", "inexact_features", "sweep_inexact_features", "swept_windows"]

# In the owned side of the comparison: the whole row is kept (see _owned_columns).
WHOLE_ROW = ("*", b"")
# Families of ours in the target (touch markers) are never swept.
RESERVED_FAMILY_PREFIX = "ddb2bt_"
INCLUSIVE_END_MS = 1  # a delete's end is exclusive: [0, ts + 1) includes ts
# The progress callback hears of the scan every this many rows: often enough for a
# bar to move on a large table, rarely enough to cost nothing next to the reads.
PROGRESS_EVERY_ROWS = 1000


@dataclass(frozen=True)
class SweepResult:
    windows: int = 0
    rows_read: int = 0  # rows with a cell in a swept window's time range
    cells_deleted: int = 0  # columns deleted up to their newest stale version
    versions_released: int = 0


def swept_windows(exports: Sequence, first_ms: int, boundary_ms: int) -> list:
    """The windows that can hold a change lost right after an applied one: before
    the boundary and ending after the earliest trimmed shard's last applied
    change (a lost change comes after that change, and before its window's end).
    Windows wholly before it hold only changes every trimmed shard applied."""
    return [e for e in exports if first_ms < e.to_ms <= boundary_ms]


def _templates(mapping):
    """(table, KeyTemplate) of every row the mapping can write."""
    for rule in mapping.rules:
        if rule.row_key is not None:
            yield mapping.target.table, rule.row_key
        for index in rule.indexes:
            yield index.table or mapping.target.table, index.row_key


def _versioned_columns(mapping) -> tuple:
    """({(family, qualifier)} of attribute-timestamped columns with a fixed
    qualifier, {family} of those with a templated one)."""
    fixed, templated = set(), set()
    for rule in mapping.rules:
        for col in rule.columns:
            if col.timestamp is not None:
                if col.qualifier_template is not None:
                    templated.add(col.family)
                else:
                    fixed.add((col.family, col.qualifier))
    return fixed, templated


def sweep_inexact_features(mapping) -> list:
    """What the sweep cannot find, each with why (said before anything is written)."""
    out = []
    for rule in mapping.rules:
        if rule.hook is not None:
            out.append(f"rule {rule.name!r} is a hook: the tables and versioned columns it writes are not "
                       "declared, so a cell only an item's stop-time image owned may stay (docs/design.md §8.1.1)")
    _, templated = _versioned_columns(mapping)
    mixed = set()
    for rule in mapping.rules:
        ordinary = {c.family for c in rule.columns if c.timestamp is None} | {ix.family for ix in rule.indexes}
        if rule.other.mode == "column":
            ordinary.add(rule.other.family)
        if rule.item_column is not None:
            ordinary.add(rule.item_column.family)
        mixed |= ordinary & templated
    for family in sorted(mixed):
        out.append(f"family {family!r} holds both attribute-timestamped columns with a templated qualifier and "
                   "ordinary ones: the sweep cannot tell them apart, so it leaves that family's ordinary cells "
                   "as they are")
    return out


class BoundarySweep:
    """``writer``: the target's reader (``cells_between``); ``batcher``: a
    BatchingWriter with version owners; ``owners``: the VersionOwners registry
    (None: versions are not swept); ``read(export, rel)``: a data file's lines;
    ``fence``: checked before every write; ``spill_dir``: where the buckets go
    (a private temporary directory by default); ``progress(rows)``: the rows
    read so far, for a progress bar."""

    def __init__(self, mapping, writer, batcher, owners, read: Callable, fence: Callable[[], object] = lambda: None,
                 spill_dir: Optional[str] = None, backfill_ms: Optional[int] = None,
                 progress: Callable[[int], None] = lambda rows: None) -> None:
        self.mapping, self.writer, self.batcher, self.owners = mapping, writer, batcher, owners
        self.read, self.fence, self.spill_dir, self.progress = read, fence, spill_dir, progress
        # The timestamp of the last backfill's cells (and version claims): never a
        # change's, so never swept (docs/design.md §3.3).
        self.backfill_ms = backfill_ms
        self.exports_end_ms = 0  # set when versions are swept: the state their deletes restore
        self._fixed, self._templated = _versioned_columns(mapping)

    def _versioned(self, family: str, qualifier: bytes) -> bool:
        return family in self._templated or (family, qualifier) in self._fixed

    def _lines(self, files: Sequence) -> Iterator:
        for export, rel in files:
            yield from self.read(export, rel)

    def _tables(self) -> list:
        return sorted({table for table, _ in _templates(self.mapping)} | {self.mapping.target.table})

    def run(self, window_files: Sequence, lo_ms: int, hi_ms: int, lookback_files: Sequence = (),
            read_from_ms: Optional[int] = None) -> SweepResult:
        """The ordinary cells of one window [lo_ms, hi_ms), ``window_files`` its
        [(export, data file)], once the windows up to it are applied.

        ``read_from_ms`` (at most ``lo_ms``): read from there instead. A change
        inside the window may carry a record time before ``lo_ms`` (the stream's
        clock is behind PITR's, recover.SWEEP_LOOKBACK_MS), and an item created
        and deleted inside it is in no line: its cell is stale. A cell stamped
        there may also be an unchanged item's, written by a change just before
        ``lo_ms``: ``lookback_files`` (the data files of the windows before,
        reaching back to ``read_from_ms``, in time order) hold that item's state
        at ``lo_ms`` — its last line there whose write is at or after
        ``read_from_ms`` — and, if the window does not list the item, what that
        state owns is kept."""
        result = SweepResult()
        read_from = lo_ms if read_from_ms is None else min(read_from_ms, lo_ms)
        if lo_ms < hi_ms:
            estimate = sum(count or 0 for export, rel in window_files
                           for name, count in export.files if name == rel)
            with SpillDir(self.spill_dir, "recover-sweep") as where:
                buckets = bucket_count(estimate)
                held, owned = Spill(where.path, "held", buckets), Spill(where.path, "owned", buckets)
                rows_read = 0
                for table in self._tables():
                    last, newest = None, {}
                    # From lo on, with no upper bound: a column is judged on its newest
                    # cell. One written after the window belongs to a later change (a
                    # list's lower elements fall inside the window: its own write), and
                    # a read never sees what lies below it.
                    for row, family, qualifier, ts in self.writer.cells_between(table, read_from):
                        if family.startswith(RESERVED_FAMILY_PREFIX) or self._versioned(family, qualifier):
                            continue
                        if row != last:
                            self._hold(held, table, last, newest, hi_ms)
                            rows_read, last, newest = rows_read + 1, row, {}
                            if rows_read % PROGRESS_EVERY_ROWS == 0:
                                self.progress(rows_read)
                        newest[(family, qualifier)] = max(ts, newest.get((family, qualifier), ts))
                    self._hold(held, table, last, newest, hi_ms)
                # An item's state at the window's end: its line's new image, or, if
                # the window does not list it, its state at the start (few: only items
                # written since read_from, _states_before).
                states = self._states_before(lookback_files, read_from)
                for change in self._lines(window_files):
                    states.pop(item_owner(change.keys), None)
                    for table, row, column in self._owned_columns(change):
                        owned.add(table, row, column)
                for change in states.values():
                    for table, row, column in self._owned_columns(change):
                        owned.add(table, row, column)
                self.progress(rows_read)
                held.flush()
                owned.flush()
                deleted = 0
                for have, want in paired_groups(held, owned):
                    mine = {(t, r, col) for t, r, col in want}
                    stale: dict = {}
                    for table, row, (family, qualifier, ts) in have:
                        if (table, row, (family, qualifier)) not in mine and (table, row, WHOLE_ROW) not in mine:
                            stale.setdefault((table, row), {})[(family, qualifier)] = ts
                    deleted += self._delete_stale(stale, hi_ms - 1)
                result = SweepResult(rows_read=rows_read, cells_deleted=deleted)
        self.fence()
        self._check(self.batcher.flush())
        return SweepResult(1, result.rows_read, result.cells_deleted)

    def _states_before(self, files: Sequence, since_ms: int) -> dict:
        """{item: its last line} of the items written at or after ``since_ms`` in
        ``files`` (time order): their state at the files' end. Only these items
        can own a cell stamped since (a cell's time is at or before its change's
        write time); they are the items written in SWEEP_LOOKBACK_MS, so few.
        An item the swept window lists is judged by its line there instead: a
        cell stamped inside the window by a change after it (PITR's clock ahead)
        that its new image does not own is stale although this state owned it."""
        last: dict = {}
        for change in self._lines(files):
            if change.write_us >= since_ms * 1000:
                last[item_owner(change.keys)] = change
            else:  # written before: its state here owns no cell stamped since
                last.pop(item_owner(change.keys), None)
        return last

    def _hold(self, held, table: str, row, newest: dict, hi_ms: int) -> None:
        """A scanned row's columns whose newest cell is a change's inside the window."""
        for (family, qualifier), ts in newest.items():
            if ts < hi_ms and ts != self.backfill_ms:
                held.add(table, row, (family, qualifier, ts))

    def _owned_columns(self, change) -> list:
        """(table, row, (family, qualifier)) of what a line's new image owns. A line
        whose new image cannot be mapped was dead-lettered, not applied: a job that
        never stopped would have kept what the item held, so its rows (those of its
        old image) are kept whole."""
        if change.new_image is None:
            return []
        try:
            cells = owned_cells(self.mapping, change.keys, change.new_image, False)
        except MappingError:
            try:
                old = owned_cells(self.mapping, change.keys, change.old_image, False)
            except MappingError:
                old = {}
            return sorted({(c.table, c.row_key, WHOLE_ROW) for c in old.values()})
        # Versioned cells too: a hook's are not declared, and must not look stale.
        return [(c.table, c.row_key, (c.family, c.qualifier)) for c in cells.values()]

    def _delete_stale(self, stale: dict, at_ms: int) -> int:
        count = 0
        for (table, row), cols in sorted(stale.items()):
            muts = tuple(DeleteCells(f, q, 0, ts + INCLUSIVE_END_MS) for (f, q), ts in sorted(cols.items()))
            self.fence()
            self._write(MappedChange(_record(at_ms), (RowChange(table, row, muts),)))
            count += len(muts)
        return count

    def release_versions(self, since_ms: int, files: Sequence) -> int:
        """Versions claimed by changes since ``since_ms`` (the first swept window's
        start) that their owners' last images in ``files`` (every window's, in time
        order) do not hold: deleted exactly and released. Run before any window is
        applied: a line taking such a version must find it free, as it was when a
        job that never stopped wrote it. Returns how many."""
        count = self._release_versions(since_ms, files)
        if count:
            self.fence()
            self._check(self.batcher.flush())
        return count

    def _release_versions(self, since_ms: int, files: Sequence) -> int:
        if self.owners is None or not (self._fixed or self._templated):
            return 0
        claims = self.owners.claimed_since(since_ms, skip_ms=self.backfill_ms)
        if not claims:
            return 0
        self.exports_end_ms = max((export.to_ms for export, _ in files), default=since_ms + 1) - 1
        wanted = {owner for *_, owner in claims}
        final: dict = {}  # owner -> {(table, row, family, qualifier, version)} of its last image
        for change in self._lines(files):
            kid = item_owner(change.keys)
            if kid not in wanted:
                continue
            cells = {}
            if change.new_image is not None:
                try:
                    cells = owned_cells(self.mapping, change.keys, change.new_image, False)
                except MappingError:
                    final[kid] = None  # dead-lettered, not applied: what it holds stays, as in a running job
                    continue
            final[kid] = {(c.table, c.row_key, c.family, c.qualifier, c.version_ms) for c in cells.values()
                          if c.version_ms is not None}
        count = 0
        for table, row, family, qualifier, version, owner in claims:
            if owner in final and final[owner] is None:
                continue
            if (table, row, family, qualifier, version) in final.get(owner, ()):
                continue  # still held at the exports' end
            # Not held at the end, or an owner no line lists: its change is inside
            # a window, so it was created and deleted there (AWS leaves it out).
            self.fence()
            self._write(MappedChange(_record(self.exports_end_ms), (RowChange(
                table, row, (DeleteCells(family, qualifier, version, version + INCLUSIVE_END_MS),),
                versioned=((family, qualifier, version, False),), owner=owner),)))
            count += 1
        return count

    def _write(self, mapped) -> None:
        self._check(self.batcher.add(mapped))

    def _check(self, letters) -> None:
        letters = list(letters or ())
        if letters:  # a delete has no limit to break and no version to clash: a bug if it happens
            raise MappingError(f"the boundary sweep's delete was refused: {letters[0]}", reason="sweep")


def _record(at_ms: int):
    """The ChangeRecord a sweep's delete travels with: at the time of the state it
    restores (the sink's lag and counts see it like the recovery's own changes;
    nothing is checkpointed: recovery writes carry no position)."""
    return ChangeRecord(REMOVE, {}, None, None, at_ms)


def inexact_features(mapping) -> list:
    """Mapping features an incremental export cannot restore exactly, each with why
    (said before anything is written: by `recover`, and by `validate`, which loads
    this module and not the recovery itself, Beam and all)."""
    out = []
    ttl = getattr(mapping.source, "ttl", None) or getattr(mapping, "ttl", None)
    if ttl is not None and getattr(ttl, "deletions", "apply") == "ignore":
        out.append("ttl.deletions: ignore — an export shows a TTL expiry as a plain deletion (it has no "
                   "userIdentity), so items that expired during the gap would be deleted in Bigtable, where a "
                   "running job keeps them")

    return out + sweep_inexact_features(mapping)
