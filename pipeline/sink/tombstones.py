"""Removing the ordering guard's tombstones once no record can need them
(docs/design.md §10.7).

A REMOVE through the guard leaves the item's clock cell with no owned cells: the
tombstone that keeps a late, older change of the item from resurrecting it
(docs/design.md §10.2). Such a change can arrive only while the source still
holds it, so once a tombstone is older than the source's retention plus a
margin, nothing can need it any more. ``ddb2bt sweep-tombstones`` finds those
and deletes each with a compare-and-swap on its token: a clock that a change
moved after it was read (the item came back) is left alone, so the sweep is safe
with the tail running. A live clock (one that owns cells) is never removed.

Garbage collection on the clock family cannot do this: a max-age rule would
drop live clocks too (an item unchanged for that long), after which an older
change would be applied over the item's newer state.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

from ddb2bt.transforms.model import DeleteCells
from ddb2bt.transforms.ordering import CLOCK_FAMILY, US_PER_MS, decode_clock, swap_expectation, tombstone_expired
from ddb2bt.pipeline.clients.bigtable.reads import iter_table, ms_datetime, table_ranges

__all__ = ["DEFAULT_MARGIN_HOURS", "SweepStats", "clock_scanner", "keep_us", "sweep_tombstones"]

log = logging.getLogger(__name__)

# Kept beyond the source's retention: a record is written to Kinesis a little
# after its ApproximateCreationDateTime, and a record read before it expired may
# still be on its way to Bigtable (a slow or retried bundle, a stalled worker).
# One day covers a job that stalled overnight; raise it with --keep-hours for a
# job that may sit stalled for longer.
DEFAULT_MARGIN_HOURS = 24
US_PER_HOUR = 3600 * 1_000_000
# The value of a clock that owns nothing ends with an empty cell list (every
# format: encode_clock): Bigtable filters on it, so only tombstones travel.
TOMBSTONE_VALUE_REGEX = rb"(?s).*:\[\]"


def keep_us(retention_hours: float, margin_hours: float = DEFAULT_MARGIN_HOURS) -> int:
    """How long a tombstone is kept: the source's retention plus the margin."""
    return int((retention_hours + margin_hours) * US_PER_HOUR)


@dataclass
class SweepStats:
    expired: int = 0  # tombstones older than the retention (removed, or with dry_run would be)
    removed: int = 0  # deleted by a swap
    moved: int = 0  # the clock changed after it was read (the item came back): kept
    unreadable: int = 0  # a clock this version cannot decode: kept, logged


def sweep_tombstones(writer, clocks: Iterable, now_us: int, keep: int, dry_run: bool = False,
                     stats: Optional[SweepStats] = None) -> SweepStats:
    """Delete the tombstones among ``clocks`` ((table, row key, qualifier, value)
    of clock cells) older than ``keep`` µs before ``now_us``, each with a
    CheckAndMutateRow that applies only if the clock still holds the value read.
    ``writer`` is a ClockWriter (``swap_row``); ``now_us`` is injected (tests)."""
    stats = stats if stats is not None else SweepStats()
    for table, row_key, qualifier, value in clocks:
        try:
            clock = decode_clock(value)
        except (ValueError, UnicodeDecodeError) as exc:
            stats.unreadable += 1
            log.warning("clock cell in %s not read (kept): %s", table, exc)
            continue
        if not tombstone_expired(clock, now_us, keep):
            continue
        stats.expired += 1
        if dry_run:
            continue
        expected, prefix = swap_expectation(value)
        # Every version of the cell: an end of 0 is "no end" on the wire.
        if writer.swap_row(table, row_key, CLOCK_FAMILY, qualifier, expected,
                           [DeleteCells(CLOCK_FAMILY, qualifier, 0, 0)], prefix=prefix):
            stats.removed += 1
        else:
            stats.moved += 1
    return stats


def clock_scanner(project: str, instance: str, app_profile: Optional[str] = None,
                  client=None) -> Callable[[str, int], Iterator]:
    """fn(table, before_us) → (table, row key, qualifier, value) of every clock
    cell that may be a tombstone older than ``before_us``: the newest version of
    each, written before that time, with an empty cell list. Bigtable applies the
    filter, so a table's live rows do not travel; the table is read range by
    range (``iter_table`` resumes a broken stream after its last row)."""
    from google.cloud.bigtable.data import row_filters

    def scan(table: str, before_us: int) -> Iterator:
        # A clock cell is written at its change's millisecond (floor of its µs):
        # one before ``before_us`` has a timestamp at most that millisecond.
        end_ms = before_us // US_PER_MS + 1
        chain = row_filters.RowFilterChain([
            row_filters.FamilyNameRegexFilter(CLOCK_FAMILY),
            row_filters.CellsColumnLimitFilter(1),
            row_filters.TimestampRangeFilter(end=ms_datetime(end_ms)),
            row_filters.ValueRegexFilter(TOMBSTONE_VALUE_REGEX)])
        for start, end in table_ranges(project, instance, table, client):
            for row, cells in iter_table(project, instance, table, client=client, start_key=start, end_key=end,
                                         row_filter=chain, app_profile=app_profile):
                for (family, qualifier), versions in sorted(cells.items()):
                    if family == CLOCK_FAMILY and versions:
                        yield table, row, qualifier, versions[0][1]

    return scan
