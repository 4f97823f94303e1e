"""The way back after a cutover: Bigtable rows written back to DynamoDB as the items
they hold (docs/rollback.md, docs/design.md §12).

State-based: a change names a row; the row's *current* cells are read from
Bigtable after the change, read back through the mapping's inverse
(``transforms/inverse_rows.py``) next to the items DynamoDB holds for that row, and
the difference written as whole items, each conditional on the version it replaces
(the commit time of the change after which the row was read). A change stream
record may carry only part of a row (one cell of an item), so writing from the
record alone would need the rest of the item; reading the row gives the whole
item, and writing the same state twice changes nothing: replays and restarts are
harmless.

``RowsBack`` writes a set of rows back; ``RollbackJob`` feeds it from the change
stream, pass after pass, and keeps its checkpoint in the job's state table;
``reconcile`` writes every row back (``rollback run --full``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from ddb2bt.pipeline.sink.dynamodb_writer import DynamoDBWriter
from ddb2bt.transforms.config import MappingConfig
from ddb2bt.transforms.inverse import NO, mapping_inversion
from ddb2bt.transforms.inverse_rows import (
    invert_row, main_row_of, parse_template, plan_writes, rule_constants,
)

log = logging.getLogger(__name__)

APPLIED_META = "rollback_applied_us"  # every change committed before this is written back
FRONTIER_META = "rollback_frontier"  # where each change-stream partition is read from next (JSON)
POLL_S = 0.5  # between passes that found nothing
BATCH_ROWS = 500  # rows read and written back together
USER = "USER"  # a change made by a client, not by garbage collection


@dataclass
class RollbackOutcome:
    rows: int = 0
    puts: int = 0
    deletes: int = 0
    stale: int = 0
    unexplained: int = 0
    samples: list = field(default_factory=list)  # a few (row, family, qualifier, why) not written back

    def add(self, other: "RollbackOutcome") -> None:
        self.rows += other.rows
        self.puts += other.puts
        self.deletes += other.deletes
        self.stale += other.stale
        self.unexplained += other.unexplained
        self.samples = (self.samples + other.samples)[:10]

    def line(self) -> str:
        return (f"{self.rows} row(s) read back: {self.puts} item(s) put, {self.deletes} deleted, {self.stale} "
                f"refused as older than what DynamoDB holds, {self.unexplained} cell(s) not written back")


class RowsBack:
    """Writes rows back. ``read_rows(keys)`` → {row: cells} (read_rows' form);
    ``query_partition(attribute, value)`` → the items of one partition;
    ``key_types``: the table's key attributes' DynamoDB types."""

    def __init__(self, mapping: MappingConfig, table: str, read_rows: Callable, query_partition: Callable,
                 writer: DynamoDBWriter, key_types: dict) -> None:
        self._mapping, self._table = mapping, table
        self._read_rows, self._query = read_rows, query_partition
        self._writer, self._types = writer, key_types
        statuses = {i.rule: i.status for i in mapping_inversion(mapping)}
        self._rules = [r for r in mapping.rules if statuses[r.name] != NO]

    def partitions_of(self, row_key: bytes) -> list:
        """The partition key values the row can hold items of (one per rule whose row key parses)."""
        pk = self._mapping.source.partition_key
        out: list = []
        for rule in self._rules:
            known, captures = {}, {}
            if parse_template(rule.row_key, row_key, self._types, known, captures):
                rule_constants(rule, self._types, known, captures)
                if pk in known and known[pk] not in out:
                    out.append(known[pk])
        return out

    def previous(self, row_key: bytes, queried: Optional[dict] = None) -> tuple:
        """The items the row's main row holds now in DynamoDB. ``queried``: the
        partitions already read for this batch ({repr of the key value: items}),
        so rows of one partition cost one Query, not one each."""
        pk = self._mapping.source.partition_key
        items: list = []
        for value in self.partitions_of(row_key):
            seen = None if queried is None else queried.get(repr(value))
            if seen is None:
                seen = self._query(pk, value)
                if queried is not None:
                    queried[repr(value)] = seen
            items += seen
        return tuple(it for it in items if main_row_of(self._mapping, it) == row_key)

    def apply(self, rows: dict, cells: Optional[dict] = None, previous: Optional[dict] = None) -> RollbackOutcome:
        """``rows``: {row key: version (commit time, µs) after which it is read}.
        ``cells``/``previous``: already read (the full reconcile), else read here."""
        cells = self._read_rows(list(rows)) if cells is None else cells
        out = RollbackOutcome(rows=len(rows))
        writes: list = []
        queried: dict = {}  # every read comes before the batch's writes: one Query per partition
        for row, version in rows.items():
            held = self.previous(row, queried) if previous is None else tuple(previous.get(row, ()))
            inverse = invert_row(self._mapping, row, cells.get(row, {}), self._types, held)
            writes += plan_writes(self._mapping, inverse, held, self._table, version)
            out.unexplained += len(inverse.unexplained)
            out.samples += [(row, f, q, why) for f, q, why in inverse.unexplained][:10 - len(out.samples)]
        done = self._writer.write(writes)
        out.puts, out.deletes, out.stale = done.puts, done.deletes, done.stale
        return out


def changed_rows(changes: Iterable) -> dict:
    """{row: newest commit time (µs)} of the client-made changes (garbage
    collection is no change of the application's data)."""
    rows: dict = {}
    for change in changes:
        if change.source == USER and change.commit_time_us > rows.get(change.row_key, -1):
            rows[change.row_key] = change.commit_time_us
    return rows


class RollbackJob:
    """Passes over the change stream, each bounded: every partition read up to the
    time the pass began (``read(frontier, end_us)`` → RowChange values, advancing
    the frontier), the rows it names written back, then the frontier saved in the
    job's state table (``FRONTIER_META``; ``APPLIED_META``: its low watermark, the
    commit time before which every change is written back). A restart resumes at
    the saved frontier; a pass cut short by a crash is read again (harmless: the
    writes are idempotent). ``start(start_us)`` and ``load(text)`` make a frontier."""

    def __init__(self, rows_back: RowsBack, read: Callable, start: Callable, load: Callable, store,
                 now_us: Callable[[], int], metrics=None, metrics_table: str = "", batch_rows: int = BATCH_ROWS,
                 fence: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, poll_s: float = POLL_S) -> None:
        self._rows_back, self._read, self._start, self._load = rows_back, read, start, load
        self._store, self._now_us, self._metrics, self._table = store, now_us, metrics, metrics_table
        self._batch_rows, self._fence = batch_rows, fence
        self._clock, self._sleep, self._poll_s = clock, sleep, poll_s

    def frontier(self, cutover_us: int):
        saved = self._store.load_meta(FRONTIER_META)
        return self._load(saved) if saved else self._start(cutover_us)

    def one_pass(self, frontier) -> tuple:
        """(outcome, changes read) of one bounded pass; the frontier saved after it."""
        end_us = self._now_us()
        changes = self._read(frontier, end_us)
        rows = changed_rows(changes)
        total = RollbackOutcome()
        keys = list(rows)
        for i in range(0, len(keys), self._batch_rows):
            total.add(self._apply({k: rows[k] for k in keys[i:i + self._batch_rows]}))
        self._fence()
        applied = frontier.low_watermark_us() or end_us
        self._store.save_meta(FRONTIER_META, frontier.to_json())
        self._store.save_meta(APPLIED_META, str(applied))
        if self._metrics is not None:
            self._metrics.applied_until_s(self._table, applied / 1e6)
        return total, len(changes)

    def run(self, cutover_us: int, until_idle_s: float, follow: bool = False) -> RollbackOutcome:
        """Passes until none found a change for ``until_idle_s`` (``follow``: until stopped)."""
        frontier = self.frontier(cutover_us)
        total = RollbackOutcome()
        last_change = self._clock()
        while True:
            outcome, read = self.one_pass(frontier)
            total.add(outcome)
            if read:
                last_change = self._clock()
            elif not follow and self._clock() - last_change >= until_idle_s:
                return total
            else:
                self._sleep(self._poll_s)

    def _apply(self, batch: dict) -> RollbackOutcome:
        self._fence()
        done = self._rows_back.apply(batch)
        if self._metrics is not None:
            self._metrics.wrote(self._table, done.puts, done.deletes, done.stale, done.unexplained)
        return done


def reconcile(rows_back: RowsBack, mapping: MappingConfig, bigtable_rows: dict, items: Iterable, version_us: int,
              batch_rows: int = BATCH_ROWS) -> RollbackOutcome:
    """Every row written back, and every item whose row is gone deleted: DynamoDB
    made equal to the inverse of the whole table (``rollback run --full``).
    ``version_us``: a time before the rows were read."""
    by_row: dict = {}
    for item in items:
        row = main_row_of(mapping, item)
        if row is not None:
            by_row.setdefault(row, []).append(item)
    keys = sorted(set(bigtable_rows) | set(by_row))
    total = RollbackOutcome()
    for i in range(0, len(keys), batch_rows):
        chunk = keys[i:i + batch_rows]
        total.add(rows_back.apply({k: version_us for k in chunk}, cells=bigtable_rows, previous=by_row))
    log.info("reconciled %d row(s), %d item(s) held", len(keys), sum(len(v) for v in by_row.values()))
    return total


