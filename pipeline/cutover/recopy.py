"""The re-copy sweep: after a new backfill of a table that was migrated before
(``migrate --restart``, ``backfill --restart``), remove what no item owns any
more (docs/design.md §7.7).

A backfill writes what the Scan sees; it cannot delete. When changes were lost
(a stream replaced, a trimmed tail, a row deleted in Bigtable behind the job's
back) the target may hold rows and cells of items that no longer exist, or
columns an item no longer has. The sweep reads every target table and scans
the source again (after the backfill, so after the handoff T), and deletes a
column that no scanned item owns in its row only when its newest cell is older
than the backfill's cells (``floor_to_second(T) − 1 ms``): such a cell was
written by a change before T, whose effect, or a later one, every Scan after T
sees. A cell a change after T writes carries T's second or later, so the
tail's cells are never taken. From an ordered source such a change writes every
cell its item owns; through the ordering guard (a Kinesis source) it skips a
cell whose value the item's clock records, which keeps its time before T. So
before deleting a column that a clock in the row lists with a value digest, the
sweep clears those digests by a swap on the clock's token (docs/design.md
§7.7, §10.2): the item's next change writes the cell again whatever it held,
and a clock that moved since the read (the item changed) keeps the column. Each
such delete is CheckAndMutateRows of exactly the cells read (at most
DELETES_PER_REQUEST each), applied only while the column has nothing newer, so a tail write
landing between the read and the delete wins. In a versioned column items still
own, a version no scanned item holds goes when its owner record says a change
before T claimed it (one after T is the tail's), and is released.

Both sides are spilled to hash buckets and compared a bucket at a time, as
``verify`` does: memory is one bucket at any table size.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from ddb2bt.transforms.ordering import CLOCK_FAMILY, Clock, decode_clock, encode_clock, swap_expectation
from ddb2bt.pipeline.verify.spill import Spill, SpillDir, bucket_count, paired_groups
from ddb2bt.transforms.model import MUTATION_OVERHEAD_BYTES, DeleteCells, SetCell
from ddb2bt.pipeline.clients.bigtable.errors import BigtablePermanent, BigtableRetryable
from ddb2bt.pipeline.clients.bigtable.reads import iter_table
from ddb2bt.pipeline.clients.dynamodb import TokenBucket, describe_table
from ddb2bt.pipeline.connect.connections import dynamodb_client
from ddb2bt.pipeline.verify.compare import VERSIONS
from ddb2bt.pipeline.verify.verify import expected_of_records, Findings, scan_expected

log = logging.getLogger(__name__)

# Families ddb2bt keeps for itself in a target table: the touch markers (dropped
# by the finish) and the ordering guard's clocks (docs/design.md §10). The sweep
# judges only the mapping's cells.
OWN_FAMILY_PREFIX = "ddb2bt_"
# One delete request's bounds: well within Bigtable's 100,000 mutations and
# 256 MiB per request (transforms.limits), whatever a column holds (a folded
# column may keep more than 100,000 versions in one row).
DELETES_PER_REQUEST = 10_000
DELETE_REQUEST_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class StaleColumn:
    """Cells no scanned item owns: a whole column (``owned`` False: no item owns
    the column in its row, all of it older than the backfill), or versions of a
    versioned column that items still own (``owned`` True: the versions no
    scanned item holds, to be checked against their owner records)."""

    table: str
    row_key: bytes
    family: str
    qualifier: bytes
    newest_ms: int
    versions: tuple  # the cells' timestamps as read
    owned: bool = False
    # (item qualifier, timestamp, value) of each clock in the row, as read, that
    # records a value digest for a cell of this column (the ordering guard):
    # cleared before the delete, so the item's next change writes the cell again.
    clocks: tuple = ()


@dataclass(frozen=True)
class SweepResult:
    rows_read: int
    items: int
    deleted: int  # stale columns (or versions) deleted
    kept_newer: int  # stale when read, but written meanwhile or claimed after the handoff: kept
    unmappable: int  # items the mapping refuses: their rows are left as they are


@dataclass(frozen=True)
class _Unless:
    """The CheckAndMutateRow predicate: the column has a cell at or after ``since_ms``."""

    family: str
    qualifier: bytes
    since_ms: int


def stale_columns(table: str, want: dict, have: dict, backfill_ms: int) -> list:
    """The pure rule, one table of one bucket. ``want``: {row: {(family,
    qualifier): Expect}} of the scanned items; ``have``: {row: {(family,
    qualifier): [(ts ms, value)...]}} as read. A column is stale when no scanned
    item owns it in its row and its newest cell is older than the backfill's
    (``backfill_ms``): written by a change before the handoff. In a versioned
    column that scanned items own, the versions none of them holds are
    candidates (``owned``): their owner records decide (``deleter``)."""
    out = []
    for row_key in sorted(have):
        owned = want.get(row_key, {})
        digested = _digested_columns(have[row_key])
        for (family, qualifier), cells in sorted(have[row_key].items()):
            if family.startswith(OWN_FAMILY_PREFIX) or not cells:
                continue
            stamps = tuple(sorted({ts for ts, _ in cells}))
            expect = owned.get((family, qualifier))
            if expect is None:
                if stamps[-1] < backfill_ms:
                    out.append(StaleColumn(table, row_key, family, qualifier, stamps[-1], stamps,
                                           clocks=digested.get((family, qualifier), ())))
            elif expect.kind == VERSIONS:
                extra = tuple(v for v in stamps if v not in expect.value)
                if extra:
                    out.append(StaleColumn(table, row_key, family, qualifier, stamps[-1], extra, owned=True,
                                           clocks=digested.get((family, qualifier), ())))
    return out


def _digested_columns(columns: dict) -> dict:
    """{(family, qualifier): ((item, ts, clock value), ...)}: the clocks of a row
    (its newest cell each, as read) that record a value digest for a cell of the
    column. A clock that cannot be read is left to the guard, which refuses it."""
    out: dict = {}
    for (family, item), cells in sorted(columns.items()):
        if family != CLOCK_FAMILY or not cells:
            continue
        ts, raw = max(cells, key=lambda c: c[0])
        try:
            clock = decode_clock(raw)
        except ValueError:
            continue
        for (f, q, _), digest in zip(clock.cells, clock.digests):
            if digest is not None and (item, ts, raw) not in out.get((f, q), ()):
                out[(f, q)] = out.get((f, q), ()) + ((item, ts, raw),)
    return out


def forget_digests(column: StaleColumn) -> list:
    """[(item, expected, prefix, mutations)]: for each clock that records a value
    digest of a cell of ``column``, the swap that rewrites it, at its own
    timestamp, with those digests unknown (docs/design.md §10.2)."""
    out = []
    for item, ts, raw in column.clocks:
        clock = decode_clock(raw)
        digests = tuple(None if (f, q) == (column.family, column.qualifier) else d
                        for (f, q, _), d in zip(clock.cells, clock.digests))
        value = encode_clock(Clock(clock.us, clock.new_hash, clock.cells, digests))
        expected, prefix = swap_expectation(raw)
        out.append((item, expected, prefix, [SetCell(CLOCK_FAMILY, item, value, ts)]))
    return out


def sweep(mapping, ddb, scan_target: Callable[[str], Iterable], delete: Callable[[StaleColumn], bool],
          backfill_ms: int, segments: int = 8, estimated_items: int = 0,
          workdir: Optional[str] = None, bucket: Optional[TokenBucket] = None) -> SweepResult:
    """Read every target table, scan the source, delete the stale columns
    (``delete(column) -> False`` when the column got a newer cell meanwhile).
    The Scan is paced by ``bucket`` (the backfill's --max-rcu) and strongly
    consistent: a column is judged stale by what no item owns, and an item
    an eventually consistent read missed would lose a cell the ordering guard
    kept from before the handoff (docs/design.md §7.7)."""
    buckets = bucket_count(estimated_items)
    findings = Findings()
    rows_read = deleted = kept = 0
    with SpillDir(workdir, purpose="recopy-sweep") as spill_dir:
        # Target first, like verify: a row of an item created meanwhile is then
        # owned by the scan that follows, never taken for a stale one.
        actual = Spill(spill_dir.path, "actual", buckets)
        for table in mapping.tables:
            for row_key, cells in scan_target(table):
                actual.add(table, row_key, cells)
                rows_read += 1
        actual.flush()
        expected = Spill(spill_dir.path, "expected", buckets)
        items = scan_expected(mapping, ddb, segments, True, lambda n: None, None, expected, findings, mapping.name,
                              bucket=bucket)
        expected.flush()
        for exp_records, act_records in paired_groups(expected, actual):
            want = expected_of_records(mapping, exp_records)[0]
            have: dict = {}
            for table, row_key, cells in act_records:
                have.setdefault(table, {})[row_key] = cells
            for table, rows in have.items():
                for column in stale_columns(table, want.get(table, {}), rows, backfill_ms):
                    if delete(column):
                        deleted += 1
                    else:
                        kept += 1
    return SweepResult(rows_read, items, deleted, kept, findings._unmappable_count)


def delete_chunks(versions, column_bytes: int, per_request: int = DELETES_PER_REQUEST,
                  budget_bytes: int = DELETE_REQUEST_BYTES) -> Iterable[tuple]:
    """``versions`` in runs of at most ``per_request``, each run's DeleteCells
    (``column_bytes``: family and qualifier, plus the mutation's overhead) within
    ``budget_bytes``: one request per run stays within Bigtable's 100,000
    mutations and 256 MiB per request however many versions a column holds."""
    each = column_bytes + MUTATION_OVERHEAD_BYTES
    size = max(1, min(per_request, budget_bytes // each))
    versions = tuple(versions)
    for i in range(0, len(versions), size):
        yield versions[i:i + size]


def deleter(writer, owners=None, backfill_ms: int = 0) -> Callable[[StaleColumn], bool]:
    """``delete(column) -> bool`` through ``writer`` (GrpcMutationWriter), with
    ``owners`` the version-ownership registry (None: none kept). Every delete is
    exact (the versions read, ``[v, v + 1)``), never a range that could take a
    cell written since, in requests within Bigtable's limits (delete_chunks).
    A whole stale column is deleted by atomic CheckAndMutateRows, each only if
    nothing newer than what was read arrived meanwhile (the tail's writes are
    newer). A stale version of an owned
    versioned column goes only if its owner claimed it before the handoff second
    (or nobody owns it and it is older than the backfill): a version claimed
    after the handoff is the tail's. Deleted versions are released."""
    handoff_second = backfill_ms + 1  # floor_to_second(T)

    def release(column: StaleColumn, versions) -> None:
        if owners is not None and versions:
            owners.settle({owners.key(column.table, column.row_key, column.family, column.qualifier, v): None
                           for v in versions})

    def exact(column: StaleColumn, versions) -> list:
        return [DeleteCells(column.family, column.qualifier, v, v + 1) for v in versions]

    def chunked(column: StaleColumn, versions) -> list:
        """The versions in runs each deleted by one request within Bigtable's
        limits (delete_chunks): a folded column may hold more than 100,000."""
        return list(delete_chunks(versions, len(column.family) + len(column.qualifier)))

    def forget(column: StaleColumn) -> bool:
        """Clear the clocks' digests of the column first: a delete around the
        clock must leave it describing what the row holds. False: a clock
        moved since the read (its item changed; the column is the tail's)."""
        for item, expected, prefix, mutations in forget_digests(column):
            if not writer.swap_row(column.table, column.row_key, CLOCK_FAMILY, item, expected, mutations,
                                   prefix=prefix):
                return False
        return True

    def delete(column: StaleColumn) -> bool:
        if not forget(column):
            return False
        if not column.owned:
            # Each run is one atomic CheckAndMutateRow, applied only while the column has
            # nothing newer than what was read: a tail write landing between two runs keeps
            # the rest (older versions under a newer cell: a later sweep takes them).
            unless = _Unless(column.family, column.qualifier, column.newest_ms + 1)
            for run in chunked(column, column.versions):
                if not writer.check_and_mutate(column.table, column.row_key, unless, exact(column, run)):
                    return False
                release(column, run)
            return True
        stale = []
        for v in column.versions:
            key = owners.key(column.table, column.row_key, column.family, column.qualifier, v) \
                if owners is not None else None
            before = owners.claimed_before(key, handoff_second) if key is not None else None
            if before or (before is None and v < backfill_ms):
                stale.append(v)
        if not stale:
            return False
        for run in chunked(column, stale):
            statuses = writer.mutate_rows(column.table, [(column.row_key, exact(column, run))])
            bad = next((st for st in statuses if st is not None and not st.ok), None)
            if bad is not None:  # the sweep stops; it is still owed, so a rerun sweeps again
                raise (BigtableRetryable if bad.retryable else BigtablePermanent)(
                    f"the re-copy sweep's delete in {column.table} failed: {bad.message}")
            release(column, run)
        return True

    return delete


def sweep_target(mapping, state_spec, backfill_ms: int, segments: int = 8,
                 max_rcu: Optional[float] = None) -> SweepResult:
    """The sweep against the mapping's source and target (``run_backfill`` calls
    it), its Scan within ``max_rcu`` capacity units per second like the backfill's."""
    ddb = dynamodb_client(mapping.source.region)
    t = mapping.target
    expected = describe_table(ddb, mapping.source.table).get("ItemCount", 0)
    writer = state_spec.bigtable.writer()
    store = state_spec.store()
    try:
        return sweep(mapping, ddb, lambda table: iter_table(t.project, t.instance, table),
                     deleter(writer, store.versions(), backfill_ms), backfill_ms, segments=segments,
                     estimated_items=int(expected), bucket=TokenBucket(max_rcu) if max_rcu else None)
    finally:
        writer.close()
        store.close()
