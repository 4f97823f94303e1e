"""The guarded backfill write strategies (the backfill/tail overlap, docs/design.md §7).

A backfilled item is written at the handoff second minus 1 ms, so a streamed
value always wins; but Bigtable keeps no tombstones, so a streamed delete that
was applied *before* a slow backfill batch would be undone by it. While the
backfill runs the tail marks every item it touches (``ddb2bt_touch``, see
``bookkeeping``); ``mapping.map_change`` gives each backfill row a ``Guard`` and
the sink applies it with one of these two strategies:

* ``write_conditional`` — rows with versioned cells (timestamps from an
  attribute, not older than the tail's): one CheckAndMutateRow each, applied only
  if the item's marker has no version since the handoff second (distinct rows
  concurrently, one row's changes in order);
* ``repair_touched`` — other rows are written in batches and, once acknowledged,
  those whose item the tail touched lose the backfill's own cells again (deletes
  over ``[0, backfill_ms + 1)``, never reaching the tail's newer cells).

Either way an item the tail touched after the handoff ends up exactly as the
tail wrote it.

The repair has a crash window: a process that dies (or loses its lease, or hits
its deadline) after the plain write and before the repair leaves the rows
written and unrepaired, and on resume the Scan no longer returns an item the
tail deleted meanwhile. So the sink records each batch's guarded rows in the
state table *before* writing them (``encode_intent``: the row, its marker and
the backfill's columns — no values), clears the record after the repair, and
repairs every record left of a part before that part is marked done
(``repair_intents``), i.e. before the finish can drop the markers. The functions take the writer, the retry policy and the clock from
the sink, which calls them after a batch's plain writes.
"""
from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from ddb2bt.pipeline.clients.retry import RetryPolicy, retrying
from ddb2bt.pipeline.clients.bigtable.errors import FATAL_CODES, INVALID_ARGUMENT, BigtablePermanent, EntryStatus
from ddb2bt.transforms.model import DeleteCells, Guard, RowChange, SetCell


# CheckAndMutateRow takes one row per call, so a batch of conditional rows is a
# batch of round trips (~1-5 ms each against the service: ~200-1,000 rows/s one
# after another). Distinct rows are independent — the sink promises order per row
# only (docs/design.md §4) — so this many are in flight at once; the changes of
# one row stay in order, on one thread. Bounded so a batch does not flood the
# service (a batch is ≤ 1,000 rows: at most a few dozen round trips each).
CONDITIONAL_CONCURRENCY = 16


def write_conditional(writer, conditional: list, retry: RetryPolicy, sleep: Callable[[float], None],
                      dead_letter: Callable, metrics=None, concurrency: Optional[int] = None) -> list:
    """[(MappedChange, RowChange)] in order → dead letters (in that order). Skipped
    rows (the tail touched the item) count as superseded. Each row is one atomic
    CheckAndMutateRow, so a tail write that lands between the batch being read and
    the row being written still wins; distinct rows are written concurrently, one
    row's changes in order. Returns only once every call has finished (nothing is
    in flight when the sink checkpoints); a fatal failure is raised then."""
    concurrency = CONDITIONAL_CONCURRENCY if concurrency is None else concurrency
    by_row: dict = {}
    for i, (_, change) in enumerate(conditional):
        by_row.setdefault((change.table, change.row_key), []).append(i)
    dead: list = [None] * len(conditional)

    def write_row(indices: list) -> None:
        for i in indices:
            element, change = conditional[i]
            dead[i] = _write_one(writer, element, change, retry, sleep, dead_letter, metrics)

    rows = list(by_row.values())
    if len(rows) <= 1 or concurrency <= 1:
        for indices in rows:
            write_row(indices)
    else:
        with ThreadPoolExecutor(min(concurrency, len(rows)), thread_name_prefix="ddb2bt-conditional") as pool:
            futures = [pool.submit(write_row, indices) for indices in rows]
        for future in futures:  # every call has finished here (the pool's exit waits)
            future.result()  # re-raises a fatal failure (table gone, no permission)
    return [d for d in dead if d is not None]


def _write_one(writer, element, change, retry: RetryPolicy, sleep: Callable[[float], None], dead_letter: Callable,
               metrics):
    """One conditional row: None, or its dead letter (a permanent, non-fatal failure)."""
    def attempt():
        return writer.check_and_mutate(change.table, change.row_key, change.guard, change.mutations)
    try:
        applied = retrying(retry, f"CheckAndMutateRow on {change.table}", None, sleep)(attempt)
    except BigtablePermanent as exc:
        if getattr(exc, "code", "") in FATAL_CODES:
            raise
        reason = EntryStatus(INVALID_ARGUMENT, exc.message).permanent_reason or "write_failed"
        return dead_letter(element, reason, exc.message, "BigtableWriteError")
    if not applied and metrics:
        metrics.backfill_superseded.inc()
    return None


def repair_touched(writer, guarded: list, retry: RetryPolicy, sleep: Callable[[float], None],
                   write_rows: Callable[[str, list], list], metrics=None) -> None:
    """After the batch is acknowledged: backfill RowChanges whose item the tail
    touched since the handoff lose the backfill's own cells. ``write_rows(table,
    [(row_key, mutations)])`` returns the rows that failed for good."""
    by_table: dict = {}
    for change in guarded:
        by_table.setdefault(change.table, []).append(change)
    for table, changes in by_table.items():
        since = min(c.guard.since_ms for c in changes)
        family = changes[0].guard.family
        touched = retrying(retry, f"touch markers of {table}", None, sleep)(
            lambda: writer.cells_since(table, [c.row_key for c in changes], family, since))
        repairs: dict = {}
        for c in changes:
            if (c.row_key, c.guard.qualifier) not in touched:
                continue
            end = c.guard.backfill_ms + 1
            columns = sorted(c.set_columns)
            repairs.setdefault(c.row_key, []).extend(DeleteCells(f, q, 0, end) for f, q in columns)
        if repairs:
            failed = write_rows(table, list(repairs.items()))
            if failed:
                raise BigtablePermanent(f"repair of backfill rows in {table} failed: {failed[0][1].message}")
            if metrics:
                metrics.backfill_superseded.inc(len(repairs))


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def encode_intent(guarded: list) -> str:
    """Guarded RowChanges → what a repair needs of them, as JSON: the row, its
    marker, the handoff and the backfill's columns (never a value). The text of
    ``json.dumps([{"t": table, "k": b64(row), "f": family, "q": b64(marker),
    "s": since, "b": backfill, "c": sorted([family, b64(qualifier)])}, ...],
    separators=(",", ":"))``, assembled from pieces kept per table, family and
    column set: a batch's rows share a few of each, and this runs for every row
    of an export backfill."""
    heads, texts = _INTENT_HEADS, _INTENT_COLUMNS
    if len(texts) > _MAX_INTENT_TEXTS:  # items of many shapes: kept bounded
        texts.clear()
    parts = []
    for c in guarded:
        guard = c.guard
        head = heads.get((c.table, guard.family))
        if head is None:
            head = heads[(c.table, guard.family)] = (
                '{"t":' + json.dumps(c.table) + ',"k":"', '","f":' + json.dumps(guard.family) + ',"q":"')
        order = c.set_column_order
        columns = texts.get(order)
        if columns is None:
            # sorted as the encoded pairs (base64 does not keep the qualifiers' byte order)
            columns = texts[order] = json.dumps(sorted((f, _b64(q)) for f, q in order), separators=(",", ":"))
        parts.append(f'{head[0]}{_b64(c.row_key)}{head[1]}{_b64(guard.qualifier)}","s":{int(guard.since_ms)},'
                     f'"b":{int(guard.backfill_ms)},"c":{columns}}}')
    return "[" + ",".join(parts) + "]"


# encode_intent's pieces: (table, family) -> the text around the row and marker
# (not bounded: a job's tables times its one marker family); a sorted column
# tuple -> its JSON list (emptied past _MAX_INTENT_TEXTS: a table's items may
# have many shapes).
_INTENT_HEADS: dict = {}
_INTENT_COLUMNS: dict = {}
_MAX_INTENT_TEXTS = 4096


def decode_intent(payload: str) -> list:
    """``encode_intent``'s rows as RowChanges that ``repair_touched`` takes (the
    SetCells name the columns only)."""
    out = []
    for r in json.loads(payload):
        columns = tuple(SetCell(f, base64.b64decode(q), b"", 0) for f, q in r["c"])
        out.append(RowChange(r["t"], base64.b64decode(r["k"]), columns,
                             Guard(r["f"], base64.b64decode(r["q"]), r["s"], False, r["b"])))
    return out


def repair_intents(writer, payloads, retry: RetryPolicy, sleep: Callable[[float], None],
                   write_rows: Callable[[str, list], list], metrics=None) -> None:
    """Repair the guarded rows of recorded intents (a crash may have come between
    their write and their repair). Idempotent: only the backfill's own cells of
    touched items are deleted, never the tail's."""
    rows = [c for payload in payloads for c in decode_intent(payload)]
    by_since: dict = {}
    for c in rows:  # one marker read per table and handoff
        by_since.setdefault((c.table, c.guard.since_ms, c.guard.family), []).append(c)
    for group in by_since.values():
        repair_touched(writer, group, retry, sleep, write_rows, metrics)
