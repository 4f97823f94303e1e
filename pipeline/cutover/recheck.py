"""Re-checking `verify`'s differences once the live tail has caught up with them.

A verify of a table that is being written reads the source and the target at
different moments, so an item changed in between looks different although the
replication is right: the tail simply has not applied that change yet. A
difference is therefore only reported when it stays: for every divergent row,
verify waits until the tail has passed the moment of the re-check (every shard
has applied all records created before it: ``tail_passed``), reads the row's
owning items again (GetItem, strongly consistent) and the row again, and
compares. A row that matches now was in flight; a row that differs in the same
way twice is reported. Rows whose items keep changing are re-checked up to
``rounds`` times, then reported as they were last seen.

Why this is exact for rows verify found: the target is read before the source
is scanned (see verify.py), so a row of an item created during verify is seen
as *missing* (its owner known: re-read), and a row of an item deleted during
verify as *extra* (re-read: gone once the tail applied the delete). What it
cannot resolve: an extra row whose item was deleted and created again while
verify ran (it then has no owner verify saw); such a row is reported.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ddb2bt.pipeline.cutover.compare import LayoutDiff, add_cells, diff_layout
from ddb2bt.transforms.config import MappingConfig
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.mapping import expected_cells

__all__ = ["RecheckOptions", "RecheckResult", "recheck", "stream_watermark"]

log = logging.getLogger(__name__)

# Records reach a DynamoDB stream shortly after the write (typically well under
# a second); "the tail is at the head" only covers a moment once this has passed.
STREAM_VISIBILITY_MS = 3000
POLL_S = 1.0


@dataclass(frozen=True)
class RecheckOptions:
    wait_s: float = 300.0  # how long to wait for the tail to pass a re-check's time; 0 disables re-checks
    rounds: int = 3  # re-checks of a row that keeps changing
    max_rows: int = 10_000  # divergent rows held for re-checking (bounded memory); beyond: reported as found

    @property
    def enabled(self) -> bool:
        return self.wait_s > 0


@dataclass
class RecheckResult:
    rows: int = 0  # rows re-checked
    resolved: int = 0  # ...that matched once the tail had caught up
    rounds: int = 0
    timed_out: bool = False  # the tail did not pass in time: what is left is reported unconfirmed
    still: dict = field(default_factory=dict)  # table -> (want, have, LayoutDiff) of rows still different

    def to_json(self) -> dict:
        return {"rows": self.rows, "resolved": self.resolved, "rounds": self.rounds, "timed_out": self.timed_out}


def _signature(diff: LayoutDiff) -> tuple:
    return (tuple(diff.missing_rows), tuple(diff.extra_rows), tuple(diff.missing_cells), tuple(diff.extra_cells),
            tuple(diff.different_cells), tuple((c.row_key, c.family, c.qualifier, c.version_ms)
                                               for c in diff.version_clashes))


def recheck(mapping: MappingConfig, suspects: dict, get_item: Callable[[dict], Optional[dict]],
            read_rows: Callable[[str, list], dict], tail_passed: Callable[[int], bool],
            options: RecheckOptions = RecheckOptions(), now_ms: Callable[[], int] = lambda: time.time_ns() // 10**6,
            sleep: Callable[[float], None] = time.sleep, first: Optional[dict] = None) -> RecheckResult:
    """``suspects``: {(table, row_key): [owner item keys]} (an extra row has no
    owner). ``first``: {table: signature} of what verify found, so a difference
    seen again unchanged stops the re-checks early. Returns what is still
    different (with the latest reads) and counts."""
    result = RecheckResult(rows=len(suspects))
    remaining = dict(suspects)
    previous = dict(first or {})
    clock = time.monotonic
    while remaining and result.rounds < options.rounds:
        at = now_ms()
        started = clock()
        while not tail_passed(at):
            if clock() - started > options.wait_s:
                log.warning("verify: the tail did not pass the re-check time within %.0fs (is it running?); "
                            "%d row(s) reported unconfirmed", options.wait_s, len(remaining))
                result.timed_out = True
                return result
            sleep(POLL_S)
        result.rounds += 1
        fresh: dict = {}
        for owners in remaining.values():
            for keys in owners:
                k = repr(sorted(keys.items()))
                if k not in fresh:
                    fresh[k] = (keys, get_item(keys))
        want: dict = {}
        owned: dict = {}
        clashes: list = []
        for keys, current in fresh.values():
            if current is None:
                continue
            try:
                cells = expected_cells(mapping, current)
            except MappingError:
                continue  # refused now: its rows compare as extra; verify's unmappable count has it
            add_cells(want, owned, clashes, keys, [c for c in cells.values() if (c.table, c.row_key) in remaining])
        still: dict = {}
        signatures: dict = {}
        for table in mapping.tables:
            rows = sorted(r for t, r in remaining if t == table)
            if not rows:
                continue
            have = read_rows(table, rows)
            want_t = {r: cols for r, cols in want.get(table, {}).items() if (table, r) in remaining}
            diff = diff_layout(want_t, have)
            diff.version_clashes = [c for c in clashes if c.table == table]
            if not diff.identical:
                still[table] = (want_t, have, diff)
                signatures[table] = _signature(diff)
        divergent = {(t, r) for t, (_, _, d) in still.items() for r in _rows_of(d)}
        result.resolved += len(set(remaining) - divergent)
        remaining = {k: v for k, v in remaining.items() if k in divergent}
        result.still = still
        if signatures and signatures == {t: previous.get(t) for t in signatures}:
            break  # the same difference twice in a row: it stays
        previous = signatures
    return result


def _rows_of(diff: LayoutDiff) -> set:
    rows = set(diff.missing_rows) | set(diff.extra_rows)
    rows |= {e[0] for e in diff.missing_cells + diff.extra_cells + diff.different_cells}
    rows |= {c.row_key for c in diff.version_clashes}
    return rows


def stream_watermark(streams, stream_arn: Optional[str], store, now_ms: Callable[[], int] = lambda: time.time_ns()
                     // 10**6) -> Callable[[int], bool]:
    """``passed(t)``: has the tail applied every stream record created up to
    ``t`` ms? Each unfinished shard's oldest record after its checkpoint (the
    tail checkpoints only what Bigtable holds) must be newer than ``t``, or the
    shard fully applied at a moment when records up to ``t`` are visible. No
    stream: nothing can arrive through a tail, so always passed."""
    from ddb2bt.pipeline.cutover.status import pending_since
    from ddb2bt.pipeline.dynamodb import list_shards

    if not stream_arn:
        return lambda t: True

    def passed(t: int) -> bool:
        listed = list_shards(streams, stream_arn).shards
        checkpoints = store.load_checkpoints(stream_arn)
        now = now_ms()
        for shard_id in listed:
            c = checkpoints.get(shard_id)
            if c is not None and c.finished:
                continue
            pending = pending_since(streams, stream_arn, shard_id, c.sequence_number if c else None)
            if pending is None:
                if now - t < STREAM_VISIBILITY_MS:
                    return False
            elif pending <= t:
                return False
        return True

    return passed
