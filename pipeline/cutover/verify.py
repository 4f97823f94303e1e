"""`ddb2bt verify`: is Bigtable exactly the mapping of the DynamoDB table?

Full mode reads the whole source (parallel Scan segments, in threads) and every
table the mapping writes, and reports missing rows, extra rows, missing cells,
cells no item owns any more (orphans) and differing cells. Sampled mode
(``--sample-rate r``) picks items deterministically by key hash and compares only
their rows (extra rows elsewhere cannot be seen then; the report says so).
Nothing is ignored: a cell of a family the mapping does not own (ddb2bt's own
touch markers, should a migration not have finished, included) is an extra cell
and a row without any owned cell an extra row — differences, not notes. Two
items that map to the same cell version are a difference too (``version
clashes``): the table can hold only one of them.
"""
from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable

from ddb2bt.transforms.attrs import canonical_typed_json
from ddb2bt.transforms.config import MappingConfig
from ddb2bt.pipeline.cutover.compare import LayoutDiff, diff_layout, expected_layout, without_clocks
from ddb2bt.pipeline.dynamodb import parallel_scan
from ddb2bt.pipeline.redaction import Redaction

EXAMPLES_PER_KIND = 5
REDACTED = "<redacted: use --show-values>"
SAMPLE_SPACE = 2**32


def sampled(keys: dict, rate: float) -> bool:
    """Deterministic: the same item is in or out of the sample on every run."""
    return zlib.crc32(canonical_typed_json({"M": keys}).encode()) < rate * SAMPLE_SPACE


def scan_source(ddb, table: str, segments: int, consistent: bool, on_page: Callable[[int], None],
                keep: Callable[[dict], bool] = lambda item: True) -> list:
    return parallel_scan(ddb, table, segments, consistent_read=consistent, on_page=on_page, keep=keep)


@dataclass
class VerifyReport:
    identical: bool
    sampled: bool
    items: int
    rows_expected: int
    tables: dict = field(default_factory=dict)  # table -> counts and examples
    checked_at_ms: int = 0
    # Items the mapping refuses (they would be dead letters): count and examples.
    unmappable_items: dict = field(default_factory=lambda: {"count": 0, "examples": []})

    def to_json(self) -> dict:
        return {"identical": self.identical, "sampled": self.sampled, "items": self.items,
                "rows_expected": self.rows_expected, "tables": self.tables, "checked_at_ms": self.checked_at_ms,
                "unmappable_items": self.unmappable_items,
                "note": "extra rows are not checked in sampled mode" if self.sampled else ""}


def _show(value: bytes, show: bool) -> str:
    return value.decode("utf-8", "backslashreplace") if show else REDACTED


def _unmappable(found: list, show: bool, policy: Redaction = Redaction()) -> dict:
    """Unmappable items as differences: the reason, and the item's key (redacted
    unless --show-keys, ddb2bt.pipeline.redaction)."""
    examples = [{"key": {name: (value if policy.show_keys else policy.key("")) for name, value in keys.items()},
                 "reason": exc.reason, "message": exc.message if show else exc.reason}
                for keys, exc in found[:EXAMPLES_PER_KIND]]
    return {"count": len(found), "examples": examples}


def _examples(diff: LayoutDiff, expected: dict, actual: dict, show: bool, policy: Redaction = Redaction()) -> dict:
    out = {}
    row_text = lambda row: policy.key(row.decode("utf-8", "backslashreplace"))  # row keys are built from keys
    for kind in ("missing_rows", "extra_rows", "missing_cells", "extra_cells", "different_cells"):
        entries = getattr(diff, kind)
        shown = []
        for entry in entries[:EXAMPLES_PER_KIND]:
            if isinstance(entry, bytes):
                shown.append({"row": row_text(entry)})
                continue
            row, family, qualifier = entry
            ex = {"row": row_text(row),
                  "column": f"{family}:{qualifier.decode('utf-8', 'backslashreplace')}"}
            if kind == "different_cells":
                want = expected[row][(family, qualifier)]
                have = actual[row][(family, qualifier)]
                ex["expected"] = _show(want.value, show) if isinstance(want.value, bytes) else (
                    "…versions…" if not show else repr(want.value))
                ex["actual"] = _show(have[0][1], show)
            shown.append(ex)
        out[kind] = {"count": len(entries), "examples": shown}
    out["version_clashes"] = {"count": len(diff.version_clashes), "examples": [
        {"row": row_text(c.row_key),
         "column": f"{c.family}:{c.qualifier.decode('utf-8', 'backslashreplace')}", "version_ms": c.version_ms,
         "items": list(c.keys) if policy.show_keys else [policy.key("")] * len(c.keys)}
        for c in diff.version_clashes[:EXAMPLES_PER_KIND]]}
    out["multi_version_columns"] = {"count": len(diff.extra_versions),
                                    "note": "older versions below the newest; read paths never see them"}
    return out


def verify(mapping: MappingConfig, ddb, read_table: Callable, read_rows: Callable, segments: int = 8,
           sample_rate: float = 1.0, consistent: bool = True, show_values: bool = False,
           on_page: Callable[[int], None] = lambda n: None, show_keys: bool = False) -> VerifyReport:
    """``read_table(table)`` → read_table() output; ``read_rows(table, keys)`` → same for those rows."""
    is_sample = sample_rate < 1.0
    policy = Redaction(show_keys=show_keys or show_values, show_values=show_values)
    keys_of = lambda item: {k: item[k] for k in mapping.source.key_attributes if k in item}
    keep = (lambda item: sampled(keys_of(item), sample_rate)) if is_sample else (lambda item: True)
    items = scan_source(ddb, mapping.source.table, segments, consistent, on_page, keep)
    unmappable: list = []
    clashes: list = []
    expected = expected_layout(mapping, items, lambda item, exc: unmappable.append((keys_of(item), exc)),
                               clashes=clashes)
    report = VerifyReport(identical=not unmappable, sampled=is_sample, items=len(items),
                          rows_expected=sum(len(rows) for rows in expected.values()),
                          checked_at_ms=time.time_ns() // 1_000_000,
                          unmappable_items=_unmappable(unmappable, show_values, policy))
    for table in mapping.tables:
        want = expected.get(table, {})
        have = read_rows(table, sorted(want)) if is_sample else read_table(table)
        diff = diff_layout(want, without_clocks(have))  # a Kinesis job's clock cells are its own (design §10)
        if is_sample:
            diff.extra_rows = []
        diff.version_clashes = [c for c in clashes if c.table == table]
        report.tables[table] = _examples(diff, want, have, show_values, policy)
        report.identical &= diff.identical
    return report


def print_report(report: VerifyReport, out=print) -> None:
    mode = "sampled" if report.sampled else "full"
    out(f"verify ({mode}): {report.items} items, {report.rows_expected} expected rows → "
        + ("IDENTICAL" if report.identical else "DIFFERENT"))
    if report.unmappable_items["count"]:
        out(f"  unmappable items (the mapping refuses them; the live path dead-letters them): "
            f"{report.unmappable_items['count']}")
        for ex in report.unmappable_items["examples"]:
            out(f"    unmappable: {json.dumps(ex, ensure_ascii=False)}")
    for table, kinds in report.tables.items():
        counts = ", ".join(f"{k.replace('_', ' ')} {v['count']}" for k, v in kinds.items())
        out(f"  {table}: {counts}")
        for kind, info in kinds.items():
            for ex in info.get("examples", []):
                out(f"    {kind}: {json.dumps(ex, ensure_ascii=False)}")
    if report.sampled:
        out("  (sampled: rows no sampled item owns — extra rows — are not checked)")


def verify_target(mapping: MappingConfig, store, segments: int = 8, sample_rate: float = 1.0,
                  consistent: bool = True, show_values: bool = False, progress: bool = True,
                  show_keys: bool = False) -> VerifyReport:
    """`ddb2bt verify`: compare, with a progress bar, and record the summary in the
    state table (``status`` reads it)."""
    from ddb2bt.pipeline.connections import dynamodb_client
    from ddb2bt.pipeline.cutover.controller import run_in_thread
    from ddb2bt.pipeline.dynamodb import describe_table
    from ddb2bt.pipeline.sink.bigtable_io import read_rows, read_table
    from ddb2bt.transforms.errors import ConfigError

    if not 0 < sample_rate <= 1:
        raise ConfigError("must be in (0, 1]", "--sample-rate")
    ddb = dynamodb_client(mapping.source.region)
    t = mapping.target
    expected = describe_table(ddb, mapping.source.table).get("ItemCount", 0)
    scanned = [0]

    def run() -> VerifyReport:
        return verify(mapping, ddb, lambda table: read_table(t.project, t.instance, table),
                      lambda table, keys: read_rows(t.project, t.instance, table, keys),
                      segments=segments, sample_rate=sample_rate, consistent=consistent, show_values=show_values,
                      on_page=lambda n: scanned.__setitem__(0, scanned[0] + n), show_keys=show_keys)

    report = run_in_thread("verify", run, expected, (lambda: scanned[0]) if progress else None)
    summary = {k: v for k, v in report.to_json().items() if k != "tables"}
    store.save_meta("verify", json.dumps(summary))
    return report
