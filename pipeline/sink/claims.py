"""Version claims on the sink's side (ddb2bt.pipeline.control.versions): before a batch is
written, changes whose versioned cells another item owns are refused and
deletes of other items' versions dropped; once it is written, the new
ownership is recorded."""
from __future__ import annotations

from typing import Callable

from ddb2bt.pipeline.control.versions import VersionOwners, resolve
from ddb2bt.pipeline.sink.batch import Batch

__all__ = ["VersionClaims"]


class VersionClaims:
    """The claims of one sink's batches; not thread-safe (one batch at a time is
    committed)."""

    def __init__(self, versions: VersionOwners, metrics, dead_letter: Callable) -> None:
        self._versions = versions
        self._metrics = metrics
        self._dead_letter = dead_letter
        self._settle_stamps: dict = {}  # {version key: its new owner's change time}, per batch

    def resolve(self, batch: Batch, settle: dict) -> list:
        """Refuse changes whose versioned cells another item owns and drop deletes
        of other items' versions (versions.py), before anything is written.
        Fills ``settle`` with the ownership to record once the batch is written."""
        entries = [(e, c) for row in batch.rows.values() for e, c in row.parts if c.versioned]
        entries += [(e, c) for e, c in batch.conditional if c.versioned]
        if not entries:
            return []
        dead, dead_ids, replaced, final, stamps = resolve(
            self._versions, entries, lambda e, reason, msg: self._dead_letter(e, reason, msg, "VersionClash"))
        settle.update(final)
        self._settle_stamps.update(stamps)
        if dead and self._metrics:
            self._metrics.version_clashes.inc(len(dead))
        if not (dead_ids or replaced):
            return dead
        for key, row in list(batch.rows.items()):
            if not any(id(e) in dead_ids or id(c) in replaced for e, c in row.parts):
                continue
            parts = [(e, replaced.get(id(c), c)) for e, c in row.parts if id(e) not in dead_ids]
            parts = [(e, c) for e, c in parts if c.mutations]  # only another item's version to delete: nothing
            if not parts:
                del batch.rows[key]
                continue
            row.parts = parts
            row.mutations = [m for _, c in parts for m in c.mutations]
            row.wire = None  # encoded again from the mutations kept
            row.size = sum(c.size_bytes for _, c in parts)
        batch.conditional = [(e, c) for e, c in ((e, replaced.get(id(c), c)) for e, c in batch.conditional
                                                 if id(e) not in dead_ids) if c.mutations]
        return dead

    def settle(self, settle: dict) -> None:
        """Record the ownership ``resolve`` decided, once the batch is written."""
        if settle:
            self._versions.settle(settle, self._settle_stamps)
        self._settle_stamps.clear()
