"""The migration's bookkeeping in the target tables: the touch-marker family.

While a backfill runs, tail changes mark the items they touch in a family of
ours (``ddb2bt_touch``), so the backfill's guards can tell a scanned image from a
newer streamed one. Nothing else of ours is ever written to a target table. The
family exists only between ``ensure`` (when a backfill begins) and ``drop`` (the
finish): one admin call per table removes every marker cell, and with them every
row that held only markers (an item deleted during the backfill) — no waiting
for garbage collection, which Bigtable runs lazily.

A marker write racing the drop fails with "unknown family"; the sink then strips
the marker mutations and writes the row again (``strip_markers``), so it never
becomes a dead letter or fails the job.
"""
from __future__ import annotations

import logging
from typing import Sequence

from ddb2bt.transforms.config import FamilyConfig
from ddb2bt.transforms.mapping import MARKER_FAMILY, MARKER_MAX_AGE_S
from ddb2bt.pipeline.clients.bigtable.admin import process_admin

log = logging.getLogger(__name__)

# A safety net only: the finish drops the family; this GC rule bounds what a
# migration abandoned half-way would leave.
MARKER_FAMILY_CONFIG = FamilyConfig(MARKER_FAMILY, max_age_seconds=MARKER_MAX_AGE_S)


class Bookkeeping:
    """Creates and drops the marker family through an admin object with
    ``exists(table)``, ``families(table)``, ``add_family(table, FamilyConfig)`` and
    ``drop_family(table, name)`` (``BigtableAdmin``; a fake in tests)."""

    def __init__(self, admin, markers: bool = True) -> None:
        self._admin = admin
        # False for a source read through the ordering guard (Kinesis): its backfill
        # is a change like any other to the guard and reads no marker
        # (docs/design.md §10.6), so no family is created; drop and remaining
        # still clean up one an older version created.
        self._markers = markers

    @classmethod
    def for_target(cls, project: str, instance: str, markers: bool = True) -> "Bookkeeping":
        return cls(process_admin(project, instance), markers)  # one admin client per process (its quota is low)

    @classmethod
    def for_mapping(cls, mapping) -> "Bookkeeping":
        """The bookkeeping a mapping's migration needs: none for a Kinesis source."""
        return cls.for_target(mapping.target.project, mapping.target.instance,
                              markers=mapping.source.kinesis is None)

    def ensure(self, tables: Sequence[str]) -> None:
        if not self._markers:
            return
        for table in tables:
            if MARKER_FAMILY not in self._admin.families(table):
                self._admin.add_family(table, MARKER_FAMILY_CONFIG)
                log.info("added the touch-marker family to %s for the backfill", table)

    def drop(self, tables: Sequence[str]) -> None:
        for table in tables:
            if MARKER_FAMILY in self._admin.families(table):
                self._admin.drop_family(table, MARKER_FAMILY)
                log.info("dropped the touch-marker family of %s: no bookkeeping left", table)

    def remaining(self, tables: Sequence[str]) -> list:
        """Tables that still hold the marker family (bookkeeping cells may remain)."""
        return [t for t in tables if self._admin.exists(t) and MARKER_FAMILY in self._admin.families(t)]


def strip_markers(mutations: Sequence) -> list:
    """The mutations without touch markers (for a write that raced the drop)."""
    return [m for m in mutations if m.family != MARKER_FAMILY]


def has_markers(mutations: Sequence) -> bool:
    return any(m.family == MARKER_FAMILY for m in mutations)
