"""``ddb2bt sweep-tombstones``: remove the ordering guard's tombstones once no
record that could need them can still arrive (docs/design.md §10.7). The state
writes are compare-and-swaps in ``pipeline/sink/tombstones.py``; the CLI only
parses and calls this.
"""
from __future__ import annotations

import time

from ddb2bt.transforms.errors import ConfigError
from ddb2bt.pipeline.services.jobs import load_all, state_spec
from ddb2bt.pipeline.connect.reachability import check_reachable
from ddb2bt.pipeline.sink.tombstones import (DEFAULT_MARGIN_HOURS, US_PER_HOUR, SweepStats, clock_scanner,
                                             keep_us, sweep_tombstones)
from ddb2bt.pipeline.source.kinesis import RECORD_AGE_MARGIN_S, resolve_kinesis

__all__ = ["cmd_sweep_tombstones"]

SECONDS_PER_HOUR = 3600  # the reader's margin is in seconds, --keep-hours in hours


def cmd_sweep_tombstones(args) -> int:
    """Remove the ordering guard's tombstones older than the Kinesis stream's
    retention plus a margin (docs/design.md §10.7)."""
    mappings = load_all(args)
    for mapping in mappings:
        if mapping.source.kinesis is None:
            raise ConfigError(f"mapping {mapping.name!r} reads a DynamoDB stream: its writes are in stream order, "
                              "without the ordering guard, so it leaves no tombstones to sweep", "source.kinesis")
    check_reachable(mappings, dynamodb="skip")
    now_us = time.time_ns() // 1000
    for mapping in mappings:
        retention_hours = resolve_kinesis(mapping).retention_hours
        # The reader accepts a record up to the retention plus its margin (Kinesis
        # trims lazily): a tombstone must outlive every record it may still meet.
        margin_hours = RECORD_AGE_MARGIN_S / SECONDS_PER_HOUR
        oldest_read_hours = retention_hours + margin_hours
        if args.keep_hours is not None and args.keep_hours < oldest_read_hours:
            raise ConfigError(f"{args.keep_hours:g} h is shorter than the retention of Kinesis stream "
                              f"{mapping.source.kinesis.stream!r} ({retention_hours} h) plus the "
                              f"{margin_hours:g} h the reader still accepts a record: an older "
                              "change of a deleted item may still arrive, and without its tombstone it would bring "
                              "the item back", "--keep-hours")
        keep = keep_us(retention_hours) if args.keep_hours is None else int(args.keep_hours * US_PER_HOUR)
        spec = state_spec(args, mapping)
        t = mapping.target
        scan = clock_scanner(t.project, t.instance, spec.bigtable.state_profile)
        writer = spec.bigtable.writer()
        stats = SweepStats()
        try:
            for table in mapping.tables:
                sweep_tombstones(writer, scan(table, now_us - keep), now_us, keep, args.dry_run, stats)
        finally:
            writer.close()
        kept = f"kept {keep / US_PER_HOUR:g} h" + (
            f" (the stream's retention {retention_hours} h + {DEFAULT_MARGIN_HOURS} h)" if args.keep_hours is None
            else "")
        done = (f"{stats.expired} would be removed (dry run)" if args.dry_run else
                f"{stats.removed} removed, {stats.moved} kept (the item changed since they were read)")
        print(f"{mapping.name}: tombstones older than {kept}: {done}"
              + (f"; {stats.unreadable} clock(s) unreadable, kept" if stats.unreadable else ""))
    return 0
