"""Expected Bigtable layout of a set of items through a mapping, and the
difference from what the tables hold. The core of `verify`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from ddb2bt.transforms.config import MappingConfig
from ddb2bt.transforms.attrs import canonical_typed_json
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.mapping import expected_cells
from ddb2bt.transforms.ordering import CLOCK_FAMILY

SINGLE, VERSIONS, LIST = "single", "versions", "list"


@dataclass
class Expect:
    """What one column should hold: one value (at any timestamp), exact versions
    {timestamp ms: value}, or a list of values in timestamp order."""

    kind: str
    value: object


@dataclass(frozen=True)
class VersionClash:
    """Two items that map to the same cell version: Bigtable can hold only one."""

    table: str
    row_key: bytes
    family: str
    qualifier: bytes
    version_ms: int
    keys: tuple  # the items' keys as canonical typed JSON, sorted


def expected_layout(mapping: MappingConfig, items,
                    on_unmappable: Optional[Callable[[dict, MappingError], None]] = None,
                    clashes: Optional[list] = None) -> dict:
    """{table: {row_key: {(family, qualifier): Expect}}} for items (boto3 form).
    An item the mapping refuses raises, or goes to ``on_unmappable(item, error)``
    and contributes nothing (its rows, if any, then show up as extra). Items that
    collide on one cell version are appended to ``clashes`` (when given): the
    layout can hold only one of them, so the target can never equal the table and
    the caller must report it."""
    out: dict = {t: {} for t in mapping.tables}
    owners: dict = {}  # (table, row, family, qualifier, version) -> item key, versioned cells only
    for item in items:
        try:
            cells = expected_cells(mapping, item)
        except MappingError as exc:
            if on_unmappable is None:
                raise
            on_unmappable(item, exc)
            continue
        keys = {k: item[k] for k in mapping.source.key_attributes if k in item}
        add_cells(out, owners, clashes, keys, cells.values())
    return out


def item_keys_json(keys: dict) -> str:
    return canonical_typed_json({"M": keys})


def add_cells(out: dict, owners: dict, clashes: Optional[list], keys: dict, cells) -> None:
    """Add one item's owned cells to ``out`` ({table: {row: {col: Expect}}}).
    ``owners`` remembers which item holds each cell version, so two items on one
    version become a ``VersionClash``. Used by the in-memory layout and, bucket by
    bucket, by the bounded verify (a row and all its contributions are always in
    one bucket, so clashes are found there too)."""
    key = None
    for cell in cells:
        if cell.values is not None and not cell.values:
            continue  # an empty list is written as no cell at all (mapping._write)
        row = out.setdefault(cell.table, {}).setdefault(cell.row_key, {})
        col = (cell.family, cell.qualifier)
        if cell.values is not None:
            row[col] = Expect(LIST, cell.values)
        elif cell.version_ms is None:
            row[col] = Expect(SINGLE, cell.value)
        else:
            if key is None:
                key = item_keys_json(keys)
            at = (cell.table, cell.row_key, cell.family, cell.qualifier, cell.version_ms)
            other = owners.setdefault(at, key)
            versions = row.setdefault(col, Expect(VERSIONS, {})).value
            if other != key:
                if clashes is not None:
                    clashes.append(VersionClash(*at, tuple(sorted((other, key)))))
                if other < key:
                    continue  # the smallest key's value is expected, in whatever order items come
                owners[at] = key
            versions[cell.version_ms] = cell.value


# The kinds of difference listed by row (version clashes are listed by item pair).
DIFF_KINDS = ("missing_rows", "extra_rows", "missing_cells", "extra_cells", "different_cells")


@dataclass
class LayoutDiff:
    missing_rows: list = field(default_factory=list)
    extra_rows: list = field(default_factory=list)
    missing_cells: list = field(default_factory=list)  # (row, family, qualifier)
    extra_cells: list = field(default_factory=list)  # columns no item owns
    different_cells: list = field(default_factory=list)  # value, versions or list differ
    extra_versions: list = field(default_factory=list)  # single-value columns holding older versions too
    version_clashes: list = field(default_factory=list)  # VersionClash: items the layout cannot both hold

    @property
    def identical(self) -> bool:
        return not (self.missing_rows or self.extra_rows or self.missing_cells or self.extra_cells
                    or self.different_cells or self.version_clashes)

    def rows(self) -> set:
        """Every row with a difference of any kind."""
        rows = set(self.missing_rows) | set(self.extra_rows)
        rows |= {e[0] for e in self.missing_cells + self.extra_cells + self.different_cells}
        return rows | {c.row_key for c in self.version_clashes}

    def only_rows(self, rows: set) -> "LayoutDiff":
        """The differences of ``rows`` only (older versions not carried)."""
        out = LayoutDiff()
        for kind in ("missing_rows", "extra_rows"):
            setattr(out, kind, [r for r in getattr(self, kind) if r in rows])
        for kind in ("missing_cells", "extra_cells", "different_cells"):
            setattr(out, kind, [e for e in getattr(self, kind) if e[0] in rows])
        out.version_clashes = [c for c in self.version_clashes if c.row_key in rows]
        return out

    def extend(self, other: "LayoutDiff", sort: bool = False) -> None:
        """Adds ``other``'s differences (older versions not carried)."""
        for kind in DIFF_KINDS + ("version_clashes",):
            getattr(self, kind).extend(getattr(other, kind))
        if sort:
            for kind in DIFF_KINDS:
                getattr(self, kind).sort()

    def summary(self) -> str:
        return (f"missing rows {len(self.missing_rows)}, extra rows {len(self.extra_rows)}, "
                f"missing cells {len(self.missing_cells)}, extra cells {len(self.extra_cells)}, "
                f"different cells {len(self.different_cells)}, version clashes {len(self.version_clashes)}, "
                f"multi-version columns {len(self.extra_versions)}")


def _column_matches(want: Expect, have: list) -> bool:
    """``have``: [(timestamp ms, value)] newest first."""
    if want.kind == SINGLE:
        return have[0][1] == want.value
    if want.kind == VERSIONS:
        return dict(have) == want.value and len(have) == len(want.value)
    return tuple(v for _, v in sorted(have)) == tuple(want.value)


def diff_layout(expected: dict, actual_versions: dict) -> LayoutDiff:
    """One table. ``expected``: {row: {col: Expect}}; ``actual_versions``:
    read_table() output (all versions, newest first)."""
    d = LayoutDiff()
    # Everything counts: a cell of a family the mapping does not own (ddb2bt's own
    # touch markers left behind included) is an extra cell, a row holding no
    # owned cell an extra row.
    d.missing_rows = sorted(set(expected) - set(actual_versions))
    d.extra_rows = sorted(set(actual_versions) - set(expected))
    for key in sorted(set(expected) & set(actual_versions)):
        want, have = expected[key], actual_versions[key]
        d.missing_cells += [(key, *col) for col in sorted(set(want) - set(have))]
        d.extra_cells += [(key, *col) for col in sorted(set(have) - set(want))]
        for col in sorted(set(want) & set(have)):
            if not _column_matches(want[col], have[col]):
                d.different_cells.append((key, *col))
            elif want[col].kind == SINGLE and len(have[col]) > 1:
                d.extra_versions.append((key, *col))
    return d


def without_clocks(actual_versions: dict) -> dict:
    """read_table() output without the ordering guard's clock cells (a Kinesis
    job's own bookkeeping, docs/design.md §10); a row holding only clocks (a
    deleted item's tombstone) is no row of the mapping's."""
    out = {}
    for row, cols in actual_versions.items():
        kept = {c: v for c, v in cols.items() if c[0] != CLOCK_FAMILY}
        if kept:
            out[row] = kept
    return out


def compare_mapping(mapping: MappingConfig, items, read: Callable[[str], dict]) -> dict:
    """{table: LayoutDiff} for every table the mapping writes; ``read(table)``
    returns read_table() output."""
    clashes: list = []
    expected = expected_layout(mapping, items, clashes=clashes)
    out = {table: diff_layout(expected.get(table, {}), without_clocks(read(table))) for table in mapping.tables}
    for clash in clashes:
        out[clash.table].version_clashes.append(clash)
    return out
