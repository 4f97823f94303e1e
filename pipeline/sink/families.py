"""The sink's check that a change names only column families its table has
(``FamilyCheck``): the emulator reports an unknown family as INTERNAL (which
looks retryable) and the service rejects it, so either way such a change must
be dead-lettered before it is written, never retried (docs/design.md §9)."""
from __future__ import annotations

from typing import Callable, Optional

from ddb2bt.transforms.mapping import MARKER_FAMILY
from ddb2bt.transforms.model import DeadLetter, MappedChange

__all__ = ["FamilyCheck"]


class FamilyCheck:
    """``rows(change, dead)``: the rows to write of a mapped change, or none when
    it is a dead letter already or names a family its table lacks (its dead
    letter then appended to ``dead``).

    ``known(table)`` gives the table's families (None: they cannot be listed,
    the writes' own errors tell); it may have ``refresh(table)`` to ask again
    when a family is missing (it may predate a create-table). A table and the
    families of a row found known are remembered until ``new_batch()`` or a
    refresh: the sink asks once per batch, not once per row (this runs for
    every change), and a family list is cached for longer than a batch lives
    anyway."""

    def __init__(self, known: Callable[[str], Optional[frozenset]],
                 dead_letter: Callable[[MappedChange, str, str, str], DeadLetter]) -> None:
        self._known = known
        self._dead_letter = dead_letter
        self._ok: set = set()  # (table, families tuple) known in this batch

    def new_batch(self) -> None:
        self._ok.clear()

    def rows(self, element: MappedChange, dead: list) -> tuple:
        if element.dead_letter is not None:
            dead.append(element.dead_letter)
            return ()
        rows = element.rows
        ok = self._ok
        for row in rows:
            families = row.families  # a tuple for the compiled mapping's rows (model.EncodedMutations)
            if type(families) is not tuple or (row.table, families) not in ok:
                return self._checked(element, dead)
        return rows

    def _checked(self, element: MappedChange, dead: list) -> tuple:
        for row in element.rows:
            families = self._known(row.table)
            if families is None:
                self._remember(row)
                continue
            # The marker family comes and goes with a backfill (control.markers);
            # a cached family list may be stale, so only the write itself decides
            # (a marker write that fails is stripped and retried, see batching._commit).
            if not isinstance(families, (set, frozenset)):
                families = frozenset(families)
            if families.issuperset(row.families):  # C-level, no set built, no mutations decoded
                self._remember(row)
                continue
            used = set(row.families)
            missing = sorted(f for f in used - families if f != MARKER_FAMILY)
            refresh = getattr(self._known, "refresh", None)
            if missing and refresh is not None:
                # The list may predate a create-table: ask again (a recent listing
                # will do) before dead-lettering the change.
                fresh = refresh(row.table)
                missing = [f for f in missing if fresh is not None and f not in fresh]
                # The listing asked again may say other than what this batch
                # remembered (a family dropped, a table now listable): ask anew.
                self._ok.clear()
            if missing:
                dead.append(self._dead_letter(
                    element, "unknown_family",
                    f"table {row.table} has no column family {', '.join(missing)} (run ddb2bt create-table)",
                    "UnknownFamily",
                ))
                return ()
            self._remember(row)
        return element.rows

    def _remember(self, row) -> None:
        families = row.families
        if type(families) is tuple:
            self._ok.add((row.table, families))
