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
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

from ddb2bt.transforms.attrs import canonical_typed_json
from ddb2bt.transforms.config import MappingConfig
from ddb2bt.transforms.errors import MappingError, ConfigError
from ddb2bt.transforms.mapping import expected_cells
from ddb2bt.pipeline.verify.compare import DIFF_KINDS, LayoutDiff, add_cells, diff_layout, without_clocks
from ddb2bt.pipeline.verify.recheck import RecheckOptions, RecheckResult, recheck, stream_watermark
from ddb2bt.pipeline.control.mapping_change import fingerprint_of
from ddb2bt.pipeline.verify.spill import Spill, SpillDir, bucket_count, paired_groups
from ddb2bt.pipeline.observe.progress import run_in_thread
from ddb2bt.pipeline.clients.dynamodb import MAX_SCAN_THREADS, TokenBucket, describe_table, get_item, scan_pages
from ddb2bt.pipeline.observe.redaction import Redaction
from ddb2bt.pipeline.clients.bigtable.reads import iter_table, read_rows
from ddb2bt.pipeline.connect.connections import dynamodb_client, StreamsClientFactory

EXAMPLES_PER_KIND = 5
REDACTED = "<redacted: use --show-values>"
SAMPLE_SPACE = 2**32


def sampled(keys: dict, rate: float) -> bool:
    """Deterministic: the same item is in or out of the sample on every run
    (the sample of unmappable items, which have no rows)."""
    return zlib.crc32(canonical_typed_json({"M": keys}).encode()) < rate * SAMPLE_SPACE


def row_sampled(table: str, row_key: bytes, rate: float) -> bool:
    """Deterministic: the same row is in or out of the sample on every run. The
    sample is drawn by row, not by item: a row several items fold into
    (a one-to-many mapping) is compared against every one of them, so a sample
    never reports a cell of an item left out of it as extra."""
    return zlib.crc32(row_key, zlib.crc32(table.encode())) < rate * SAMPLE_SPACE


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
    # Differences re-checked after the tail caught up (recheck.py); None: not asked.
    recheck: Optional[dict] = None
    buckets: int = 0  # hash buckets the comparison used (spill.py)

    def to_json(self) -> dict:
        out = {"identical": self.identical, "sampled": self.sampled, "items": self.items,
               "rows_expected": self.rows_expected, "tables": self.tables, "checked_at_ms": self.checked_at_ms,
               "unmappable_items": self.unmappable_items,
               "note": "extra rows are not checked in sampled mode" if self.sampled else ""}
        if self.recheck is not None:
            out["recheck"] = self.recheck
        return out


def redact(value, show: bool):
    """The one place verify decides whether a key or value is shown (everything
    is redacted unless --show-values): shared with the key-redaction policy of
    other commands when they meet."""
    if show:
        return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else value
    return REDACTED


def _show(value: bytes, show: bool) -> str:
    return redact(value, show)


def _key(text, show_keys: bool) -> str:
    """An item key or a row key (built from keys) under the one key-redaction
    policy of every command (ddb2bt.pipeline.observe.redaction: --show-keys)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "backslashreplace")
    return Redaction(show_keys=show_keys).key(text)


def verify(mapping: MappingConfig, ddb, scan_target: Callable, read_rows: Callable, segments: int = 8,
           sample_rate: float = 1.0, consistent: bool = True, show_values: bool = False,
           on_page: Callable[[int], None] = lambda n: None, estimated_items: int = 0,
           workdir: Optional[str] = None, recheck_with: Optional["Rechecker"] = None,
           show_keys: bool = False, metrics_table: Optional[str] = None,
           bucket: Optional[TokenBucket] = None) -> VerifyReport:
    """Bounded memory (docs/design.md §11): the target tables are read first
    (``scan_target(table)`` → iterable of ``(row_key, cells)``), then the source
    is scanned in parallel segments; both sides are spilled to hash buckets on
    disk and compared bucket by bucket (spill.py). Sampled mode spills only the
    sampled items' rows and reads those rows per bucket (``read_rows(table,
    keys)``). Differences are re-checked once the tail has caught up with them
    when ``recheck_with`` is given (recheck.py). ``metrics_table`` labels the
    DynamoDB calls counted (the job's name; default the mapping's)."""
    is_sample = sample_rate < 1.0
    keep = (lambda table, row_key: row_sampled(table, row_key, sample_rate)) if is_sample else None
    buckets = bucket_count(estimated_items)
    findings = Findings(show_values, show_keys)
    with SpillDir(workdir) as spill_dir:
        actual = None
        if not is_sample:
            # Target first: a row of an item created while verify runs is then
            # seen as missing (its owner known, so a re-check can resolve it),
            # never as an extra row no item owns (recheck.py).
            actual = Spill(spill_dir.path, "actual", buckets)
            for table in mapping.tables:
                for row_key, cells in scan_target(table):
                    actual.add(table, row_key, cells)
            actual.flush()
        expected = Spill(spill_dir.path, "expected", buckets)
        scanned = scan_expected(mapping, ddb, segments, consistent, on_page, keep, expected, findings,
                                metrics_table or mapping.name, sample_rate, bucket=bucket)
        expected.flush()
        report = VerifyReport(identical=True, sampled=is_sample, items=scanned, rows_expected=0,
                              checked_at_ms=time.time_ns() // 1_000_000)
        suspects: dict = {}
        held = {t: LayoutDiff() for t in mapping.tables}  # differences awaiting their re-check
        held_rows: dict = {t: ({}, {}) for t in mapping.tables}  # (want, have) of those rows
        for exp_records, act_records in paired_groups(expected, actual):
            want, owners, clashes, row_owners = expected_of_records(mapping, exp_records)
            if is_sample:
                have = {t: without_clocks(read_rows(t, sorted(want.get(t, {})))) for t in mapping.tables}
            else:
                have = {t: {} for t in mapping.tables}
                for table, row_key, cells in act_records:
                    have.setdefault(table, {})[row_key] = cells
                # A Kinesis job's clock cells (and rows holding only a deleted
                # item's clock) are its own, not the mapping's (docs/design.md §10).
                have = {t: without_clocks(rows) for t, rows in have.items()}
            for table in mapping.tables:
                want_t, have_t = want.get(table, {}), have.get(table, {})
                report.rows_expected += len(want_t)
                diff = diff_layout(want_t, have_t)
                if is_sample:
                    diff.extra_rows = []
                diff.version_clashes = [c for c in clashes if c.table == table]
                findings.extra_versions[table] = findings.extra_versions.get(table, 0) + len(diff.extra_versions)
                rows = sorted(diff.rows())
                if recheck_with is not None and len(suspects) + len(rows) <= recheck_with.options.max_rows:
                    for row in rows:
                        suspects[(table, row)] = row_owners.get((table, row), [])
                        if row in want_t:
                            held_rows[table][0][row] = want_t[row]
                        if row in have_t:
                            held_rows[table][1][row] = have_t[row]
                    held[table].extend(diff)
                else:
                    if rows and recheck_with is not None:
                        findings.not_rechecked += len(rows)
                    findings.add(table, diff, want_t, have_t)
        if suspects:
            for d in held.values():
                _sort(d)
            outcome = recheck_with.run(suspects)
            report.recheck = {**outcome.to_json(), "not_rechecked": findings.not_rechecked}
            for table, (want_t, have_t, d) in outcome.still.items():
                findings.add(table, d, want_t, have_t)
            if outcome.timed_out:  # what the wait left unconfirmed is reported as first found
                for table, d in held.items():
                    rows = {r for t, r in outcome.unconfirmed if t == table}
                    findings.add(table, d.only_rows(rows), *held_rows[table])
        elif recheck_with is not None:
            report.recheck = {"rows": 0, "resolved": 0, "rounds": 0, "timed_out": False, "unsettled": 0,
                              "not_rechecked": findings.not_rechecked}
    report.unmappable_items = findings.unmappable_json()
    report.tables = {t: findings.table_json(t) for t in mapping.tables}
    report.identical = not findings.any()
    report.buckets = buckets
    return report


class Rechecker:
    """Binds recheck() to its clients (verify_target builds one; tests inject fakes)."""

    def __init__(self, mapping: MappingConfig, get_item: Callable, read_rows: Callable, tail_passed: Callable,
                 options: RecheckOptions = RecheckOptions(), sleep: Callable[[float], None] = time.sleep) -> None:
        self.mapping, self.get_item, self.read_rows, self.tail_passed = mapping, get_item, read_rows, tail_passed
        self.options, self.sleep = options, sleep

    def run(self, suspects: dict) -> RecheckResult:
        return recheck(self.mapping, suspects, self.get_item, self.read_rows, self.tail_passed, self.options,
                       sleep=self.sleep)


def scan_expected(mapping: MappingConfig, ddb, segments: int, consistent: bool, on_page: Callable[[int], None],
                  keep: Optional[Callable[[str, bytes], bool]], expected: Spill, findings: "Findings",
                  metrics_table: str, sample_rate: float = 1.0, bucket: Optional[TokenBucket] = None) -> int:
    """Scan the source in parallel segments; each item's owned cells go to the
    spill, one record per (table, row) it maps to — of the sampled rows only
    when ``keep(table, row_key)`` is given. Returns the items compared (those
    with a kept row). ``bucket``: the read budget (--max-rcu), shared by the
    segments' threads: each page's consumed capacity is charged to it."""
    count = [0]
    lock = threading.Lock()

    def segment(i: int) -> None:
        kept = 0
        for page in scan_pages(ddb, mapping.source.table, segment=i, total_segments=segments,
                               consistent_read=consistent, page_limit=None, metrics_table=metrics_table,
                               bucket=bucket):
            # Each item is released once spilled, and the page before the next
            # one is fetched: a segment thread holds at most one decoded page.
            items = page.items
            del page
            for n in range(len(items)):
                item, items[n] = items[n], None
                keys = {k: item[k] for k in mapping.source.key_attributes if k in item}
                try:
                    cells = expected_cells(mapping, item)
                except MappingError as exc:
                    if keep is None or sampled(keys, sample_rate):  # no rows to sample by: by item
                        findings.unmappable(keys, exc)
                    continue
                by_row: dict = {}
                for cell in cells.values():
                    if keep is None or keep(cell.table, cell.row_key):
                        by_row.setdefault((cell.table, cell.row_key), []).append(cell)
                if by_row or keep is None:
                    kept += 1
                for (table, row_key), row_cells in by_row.items():
                    expected.add(table, row_key, (keys, row_cells))
            on_page(len(items))
            items = item = None
        with lock:
            count[0] += kept

    with ThreadPoolExecutor(max_workers=min(segments, MAX_SCAN_THREADS)) as pool:
        list(pool.map(segment, range(segments)))
    return count[0]


def expected_of_records(mapping: MappingConfig, records: list) -> tuple:
    """One bucket's expected layout from its spilled (table, row, (keys, cells))."""
    want: dict = {t: {} for t in mapping.tables}
    owners: dict = {}
    clashes: list = []
    row_owners: dict = {}
    for table, row_key, (keys, cells) in records:
        add_cells(want, owners, clashes, keys, cells)
        row_owners.setdefault((table, row_key), []).append(keys)
    return want, owners, clashes, row_owners





def _sort(diff: LayoutDiff) -> None:
    for kind in DIFF_KINDS:
        getattr(diff, kind).sort()
    diff.version_clashes.sort(key=lambda c: (c.row_key, c.family, c.qualifier, c.version_ms))


def _entry_sort_key(kind: str, entry) -> tuple:
    if kind == "version_clashes":
        return (entry.row_key, entry.family, entry.qualifier.decode("latin-1"), entry.version_ms)
    if isinstance(entry, bytes):
        return (entry,)
    return (entry[0], entry[1], entry[2].decode("latin-1"))


class Findings:
    """Counts, and the first EXAMPLES_PER_KIND examples in row-key order, of every
    kind of difference per table, however many buckets (or Beam workers) they
    come from: the report is the same whatever the bucket count, and the same
    from the Beam verify (beam_verify.py), whose combiner merges these."""

    def __init__(self, show: bool = False, show_keys: bool = False) -> None:
        self.show = show
        self.show_keys = show or show_keys  # values without their keys say nothing
        self.counts: dict = {}  # (table, kind) -> count
        self.examples: dict = {}  # (table, kind) -> [(sort key, example)] smallest first, bounded
        self.extra_versions: dict = {}
        self.not_rechecked = 0
        self.recheck: Optional[dict] = None  # the re-checks' outcome, summed (the Beam verify's; see add_recheck)
        self.items = 0
        self.rows_expected = 0
        self._unmappable: list = []  # [(canonical key, keys, reason, message)] smallest first, bounded
        self._unmappable_count = 0
        self._lock = threading.Lock()

    @classmethod
    def empty(cls, show: bool = False, show_keys: bool = False) -> "Findings":
        return cls(show, show_keys)

    def __getstate__(self) -> dict:  # Beam encodes accumulators: no lock travels
        state = dict(self.__dict__)
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def unmappable(self, keys: dict, exc) -> None:
        self.add_unmappable(canonical_typed_json({"M": keys}), keys, exc.reason, exc.message)

    def add_unmappable(self, canonical: str, keys: dict, reason: str, message: str) -> None:
        with self._lock:
            self._unmappable_count += 1
            self._unmappable.append((canonical, keys, reason, message))
            self._unmappable.sort(key=lambda e: e[0])
            del self._unmappable[EXAMPLES_PER_KIND:]

    def unmappable_json(self) -> dict:
        examples = [{"key": {name: (value if self.show_keys else _key("", False)) for name, value in keys.items()},
                     "reason": reason, "message": message if self.show else reason}
                    for _, keys, reason, message in self._unmappable]
        return {"count": self._unmappable_count, "examples": examples}

    def add(self, table: str, diff: LayoutDiff, want: dict, have: dict) -> None:
        for kind in DIFF_KINDS + ("version_clashes",):
            entries = getattr(diff, kind)
            if not entries:
                continue
            self.counts[(table, kind)] = self.counts.get((table, kind), 0) + len(entries)
            shown = self.examples.setdefault((table, kind), [])
            for entry in sorted(entries, key=lambda e: _entry_sort_key(kind, e))[:EXAMPLES_PER_KIND]:
                shown.append((_entry_sort_key(kind, entry), _example(kind, entry, want, have, self.show, self.show_keys)))
            shown.sort(key=lambda e: e[0])
            del shown[EXAMPLES_PER_KIND:]

    def merge(self, other: "Findings") -> None:
        for key, n in other.counts.items():
            self.counts[key] = self.counts.get(key, 0) + n
        for key, shown in other.examples.items():
            mine = self.examples.setdefault(key, [])
            mine.extend(shown)
            mine.sort(key=lambda e: e[0])
            del mine[EXAMPLES_PER_KIND:]
        for table, n in other.extra_versions.items():
            self.extra_versions[table] = self.extra_versions.get(table, 0) + n
        self.not_rechecked += other.not_rechecked
        if other.recheck is not None:
            self.add_recheck(other.recheck)
        self.items += other.items
        self.rows_expected += other.rows_expected
        self._unmappable_count += other._unmappable_count
        self._unmappable = sorted(self._unmappable + other._unmappable, key=lambda e: e[0])[:EXAMPLES_PER_KIND]

    def add_recheck(self, outcome: dict) -> None:
        """Adds one re-check's outcome (RecheckResult.to_json()) to the report's:
        counts summed, rounds the most any took, timed out if any did."""
        mine = self.recheck or {"rows": 0, "resolved": 0, "rounds": 0, "timed_out": False, "unsettled": 0}
        self.recheck = {"rows": mine["rows"] + outcome["rows"], "resolved": mine["resolved"] + outcome["resolved"],
                        "rounds": max(mine["rounds"], outcome["rounds"]),
                        "timed_out": mine["timed_out"] or outcome["timed_out"],
                        "unsettled": mine["unsettled"] + outcome["unsettled"]}

    def any(self) -> bool:
        return self._unmappable_count > 0 or any(self.counts.values())

    def table_json(self, table: str) -> dict:
        out = {kind: {"count": self.counts.get((table, kind), 0),
                      "examples": [ex for _, ex in self.examples.get((table, kind), [])]}
               for kind in DIFF_KINDS + ("version_clashes",)}
        out["multi_version_columns"] = {"count": self.extra_versions.get(table, 0),
                                        "note": "older versions below the newest; read paths never see them"}
        return out

    def report(self, tables: list, show: bool, is_sample: bool, show_keys: bool = False) -> VerifyReport:
        """The whole report (the Beam verify's end; the local one fills its own)."""
        self.show, self.show_keys = show, show or show_keys
        return VerifyReport(identical=not self.any(), sampled=is_sample, items=self.items,
                            rows_expected=self.rows_expected, tables={t: self.table_json(t) for t in tables},
                            checked_at_ms=time.time_ns() // 1_000_000, unmappable_items=self.unmappable_json(),
                            recheck=None if self.recheck is None else {**self.recheck,
                                                                       "not_rechecked": self.not_rechecked})


def findings_of(table: str, diff: LayoutDiff, want: dict, have: dict, show: bool, rows_expected: int = 0,
                show_keys: bool = False) -> Findings:
    """One row's (or bucket's) findings, to be merged."""
    f = Findings(show, show_keys)
    f.add(table, diff, want, have)
    f.rows_expected = rows_expected
    if diff.extra_versions:
        f.extra_versions[table] = len(diff.extra_versions)
    return f


def _example(kind: str, entry, want: dict, have: dict, show: bool, show_keys: bool = False) -> dict:
    if kind == "version_clashes":
        return {"row": _key(entry.row_key, show_keys),
                "column": f"{entry.family}:{entry.qualifier.decode('utf-8', 'backslashreplace')}",
                "version_ms": entry.version_ms, "items": [_key(k, show_keys) for k in entry.keys]}
    if isinstance(entry, bytes):
        return {"row": _key(entry, show_keys)}
    row, family, qualifier = entry
    ex = {"row": _key(row, show_keys),
          "column": f"{family}:{qualifier.decode('utf-8', 'backslashreplace')}"}
    if kind == "different_cells":
        w = want[row][(family, qualifier)]
        h = have[row][(family, qualifier)]
        ex["expected"] = _show(w.value, show) if isinstance(w.value, bytes) else redact(repr(w.value), show)
        ex["actual"] = _show(h[0][1], show)
    return ex


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
    if report.recheck and report.recheck["rows"]:
        r = report.recheck
        out(f"  re-checked {r['rows']} divergent row(s) after the tail caught up: {r['resolved']} were changes "
            f"in flight" + ("; the tail did not catch up in time, the rest is unconfirmed" if r["timed_out"] else "")
            + (f"; {r['unsettled']} changed on every re-check (busy items: not proven either way, run verify "
               f"again when they are quiet)" if r.get("unsettled") else "")
            + (f"; {r['not_rechecked']} more not re-checked (over the limit)" if r["not_rechecked"] else ""))
    if report.sampled:
        out("  (sampled: rows no sampled item owns — extra rows — are not checked)")


def verify_target(mapping: MappingConfig, store, segments: int = 8, sample_rate: float = 1.0,
                  consistent: bool = True, show_values: bool = False, progress: bool = True,
                  recheck_options: RecheckOptions = RecheckOptions(), workdir: Optional[str] = None,
                  show_keys: bool = False, max_rcu: Optional[float] = None) -> VerifyReport:
    """`ddb2bt verify`: compare, with a progress bar, and record the summary in the
    state table (``status`` reads it)."""
    if not 0 < sample_rate <= 1:
        raise ConfigError("must be in (0, 1]", "--sample-rate")
    ddb = dynamodb_client(mapping.source.region)
    t = mapping.target
    job = getattr(store, "job", None) or mapping.name  # the metrics' table label
    described = describe_table(ddb, mapping.source.table, metrics_table=job)
    expected = described.get("ItemCount", 0)
    scanned = [0]
    rechecker = None
    if recheck_options.enabled:
        tail_passed = stream_watermark(StreamsClientFactory(mapping.source.region)(),
                                       described.get("LatestStreamArn"), store)
        rechecker = Rechecker(mapping, lambda keys: get_item(ddb, mapping.source.table, keys, metrics_table=job),
                              lambda table, keys: read_rows(t.project, t.instance, table, keys), tail_passed,
                              recheck_options)

    def run() -> VerifyReport:
        return verify(mapping, ddb, lambda table: iter_table(t.project, t.instance, table),
                      lambda table, keys: read_rows(t.project, t.instance, table, keys),
                      segments=segments, sample_rate=sample_rate, consistent=consistent, show_values=show_values,
                      on_page=lambda n: scanned.__setitem__(0, scanned[0] + n), estimated_items=expected,
                      workdir=workdir, recheck_with=rechecker, show_keys=show_keys, metrics_table=job,
                      bucket=TokenBucket(max_rcu) if max_rcu else None)

    report = run_in_thread("verify", run, expected, (lambda: scanned[0]) if progress else None)
    summary = {k: v for k, v in report.to_json().items() if k != "tables"}
    # The mapping this verify checked: status is READY only for the one the job runs.
    summary["mapping"] = fingerprint_of(mapping)
    store.save_meta("verify", json.dumps(summary))
    return report
