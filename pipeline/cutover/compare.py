"""Expected Bigtable layout of a set of items through a mapping, and the
difference from what the tables hold. The core of `verify`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from ddb2bt.transforms.config import MappingConfig
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.mapping import MARKER_FAMILY, expected_cells

SINGLE, VERSIONS, LIST = "single", "versions", "list"


@dataclass
class Expect:
    """What one column should hold: one value (at any timestamp), exact versions
    {timestamp ms: value}, or a list of values in timestamp order."""

    kind: str
    value: object


def expected_layout(mapping: MappingConfig, items,
                    on_unmappable: Optional[Callable[[dict, MappingError], None]] = None) -> dict:
    """{table: {row_key: {(family, qualifier): Expect}}} for items (boto3 form).
    An item the mapping refuses raises, or goes to ``on_unmappable(item, error)``
    and contributes nothing (its rows, if any, then show up as extra)."""
    out: dict = {t: {} for t in mapping.tables}
    for item in items:
        try:
            cells = expected_cells(mapping, item)
        except MappingError as exc:
            if on_unmappable is None:
                raise
            on_unmappable(item, exc)
            continue
        for cell in cells.values():
            row = out.setdefault(cell.table, {}).setdefault(cell.row_key, {})
            col = (cell.family, cell.qualifier)
            if cell.values is not None:
                row[col] = Expect(LIST, cell.values)
            elif cell.version_ms is None:
                row[col] = Expect(SINGLE, cell.value)
            else:
                row.setdefault(col, Expect(VERSIONS, {})).value[cell.version_ms] = cell.value
    return out


@dataclass
class LayoutDiff:
    missing_rows: list = field(default_factory=list)
    extra_rows: list = field(default_factory=list)
    missing_cells: list = field(default_factory=list)  # (row, family, qualifier)
    extra_cells: list = field(default_factory=list)  # columns no item owns
    different_cells: list = field(default_factory=list)  # value, versions or list differ
    extra_versions: list = field(default_factory=list)  # single-value columns holding older versions too

    @property
    def identical(self) -> bool:
        return not (self.missing_rows or self.extra_rows or self.missing_cells or self.extra_cells
                    or self.different_cells)

    def summary(self) -> str:
        return (f"missing rows {len(self.missing_rows)}, extra rows {len(self.extra_rows)}, "
                f"missing cells {len(self.missing_cells)}, extra cells {len(self.extra_cells)}, "
                f"different cells {len(self.different_cells)}, multi-version columns {len(self.extra_versions)}")


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
    # Touch markers are ddb2bt's own bookkeeping, not mapped data.
    actual_versions = {row: cols for row, cols in (
        (row, {c: v for c, v in cols.items() if c[0] != MARKER_FAMILY}) for row, cols in actual_versions.items())
        if cols}
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


def compare_mapping(mapping: MappingConfig, items, read: Callable[[str], dict]) -> dict:
    """{table: LayoutDiff} for every table the mapping writes; ``read(table)``
    returns read_table() output."""
    expected = expected_layout(mapping, items)
    return {table: diff_layout(expected.get(table, {}), read(table)) for table in mapping.tables}
