"""Expected Bigtable layout of a set of items through a mapping, and the
difference from what a table holds. The first brick of `verify`."""
from __future__ import annotations

from dataclasses import dataclass, field

from transforms.config import MappingConfig
from transforms.mapping import expected_row


def expected_layout(mapping: MappingConfig, items) -> dict:
    """{row_key: {(family, qualifier): value}} for items (boto3 form)."""
    out: dict = {}
    for item in items:
        row = expected_row(mapping, item)
        if row is None:
            continue
        key, cells = row
        if cells:
            out.setdefault(key, {}).update(cells)
    return out


@dataclass
class LayoutDiff:
    missing_rows: list = field(default_factory=list)
    extra_rows: list = field(default_factory=list)
    missing_cells: list = field(default_factory=list)  # (row, family, qualifier)
    extra_cells: list = field(default_factory=list)  # cells no item owns
    different_cells: list = field(default_factory=list)
    extra_versions: list = field(default_factory=list)  # columns holding more than one version

    @property
    def identical(self) -> bool:
        return not (self.missing_rows or self.extra_rows or self.missing_cells or self.extra_cells
                    or self.different_cells)

    def summary(self) -> str:
        return (f"missing rows {len(self.missing_rows)}, extra rows {len(self.extra_rows)}, "
                f"missing cells {len(self.missing_cells)}, extra cells {len(self.extra_cells)}, "
                f"different cells {len(self.different_cells)}, multi-version columns {len(self.extra_versions)}")


def diff_layout(expected: dict, actual_versions: dict) -> LayoutDiff:
    """``actual_versions``: read_table() output (all versions, newest first)."""
    d = LayoutDiff()
    for key in sorted(set(expected) - set(actual_versions)):
        d.missing_rows.append(key)
    for key in sorted(set(actual_versions) - set(expected)):
        d.extra_rows.append(key)
    for key in sorted(set(expected) & set(actual_versions)):
        want = expected[key]
        have = actual_versions[key]
        for col in sorted(set(want) - set(have)):
            d.missing_cells.append((key, *col))
        for col in sorted(set(have) - set(want)):
            d.extra_cells.append((key, *col))
        for col in sorted(set(want) & set(have)):
            if have[col][0][1] != want[col]:
                d.different_cells.append((key, *col))
            if len(have[col]) > 1:
                d.extra_versions.append((key, *col))
    return d
