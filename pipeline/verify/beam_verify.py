"""`ddb2bt verify` as a Beam job (Dataflow, or the FnApiRunner locally).

The same comparison as the local verify (verify.py), spread over workers:

    VerifySourceParts (Create: Scan segments, or an export's data files)
      → ReadSourceItems → ExpectRows ─┐                     (item → its rows' cells)
    VerifyTargetTables (Create) → SplitTargetRanges          (SampleRowKeys)
      → SpreadRanges → ReadTargetRows ─┤                    (a key range each)
                                       JoinByRow (CoGroupByKey on (table, row key))
      → CompareRows → SummarizeVerify (a combiner: counts, the first examples in
        row-key order) → WriteVerifyReport (a file or gs://)

The report is the local verify's (the same counts and examples, keys and values
redacted unless asked), one per mapping, written as `ddb2bt verify --report`
writes it. Memory per worker is one row's contributions plus the combiner's
bounded examples; the join scales with workers. With ``--from-export`` the
source is an export on S3 (or a directory), read without one RCU.

Differences are re-checked as the local verify's are (recheck.py) when the
table has a re-check wait: CompareRows sends a divergent row (with the items
that own it) to its ``divergent`` output instead of counting it, and
RecheckRows takes them in batches, waits until the tail has passed a fresh
time, reads the owners and rows again and counts only what is still
different (twice; docs/design.md §11). The source and the target are read at
the same time here, not target first: a row of an item created meanwhile can
be found as an extra row, whose owner the re-check reads back from its key.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Union

import apache_beam as beam
from apache_beam.typehints import Any

from ddb2bt.pipeline.source.snapshot import ExportSource, ScanSource, parse_segment
from ddb2bt.pipeline.verify.compare import LayoutDiff, add_cells, diff_layout, without_clocks
from ddb2bt.transforms.attrs import canonical_typed_json
from ddb2bt.transforms.config import MappingConfig
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.mapping import expected_cells
from ddb2bt.pipeline.clients.bigtable.channel import close_bounded
from ddb2bt.pipeline.clients.bigtable.reads import data_client, iter_table, read_rows, table_ranges
from ddb2bt.pipeline.clients.dynamodb import TokenBucket, describe_table, get_item, scan_pages
from ddb2bt.pipeline.connect.connections import DynamoDBClientFactory, StreamsClientFactory
from ddb2bt.pipeline.verify.recheck import recheck, stream_watermark
from ddb2bt.pipeline.verify.verify import Findings, findings_of
from ddb2bt.pipeline.graph import is_local, make_pipeline

__all__ = ["VerifyTable", "VerifyMappings", "build_verify", "run_verify_job"]

EXPECTED, ACTUAL = "expected", "actual"
DIVERGENT = "divergent"  # CompareRows' output of rows to re-check
# Divergent rows re-checked together: one wait for the tail per batch, and a
# worker holds no more than this many rows' cells at once.
RECHECK_BATCH_ROWS = 1000


def batch_divergent_rows() -> beam.PTransform:
    """The divergent rows of a bundle in batches of RECHECK_BATCH_ROWS (the last
    one smaller). Fixed, not Beam's adaptive sizing from 1 up: every batch waits
    for the tail for seconds whatever its size, so batches of 1, 2, 4 ... made
    one verify of a busy table wait for the tail dozens of times in a row."""
    return beam.BatchElements(min_batch_size=RECHECK_BATCH_ROWS, max_batch_size=RECHECK_BATCH_ROWS)


@dataclass(frozen=True)
class VerifyTable:
    """One mapping to verify and where its source is read from."""

    mapping: MappingConfig
    source: Union[ScanSource, ExportSource]
    show_values: bool = False
    show_keys: bool = False  # the one key-redaction policy (ddb2bt.pipeline.observe.redaction)
    state: Any = None  # a StateSpec: the tail's checkpoints, for re-checks; None: no re-checks
    recheck: Any = None  # RecheckOptions; None or disabled: differences are reported as found

    @property
    def rechecks(self) -> bool:
        return self.state is not None and self.recheck is not None and self.recheck.enabled


class _ReadSourceItemsFn(beam.DoFn):
    """A Scan segment or an export data file → its items (boto3 form)."""

    def __init__(self, source, metrics_table: Optional[str] = None) -> None:
        self._source = source
        self._metrics_table = metrics_table  # the job's name: the table label of the calls counted

    def setup(self) -> None:
        self._client = None
        if isinstance(self._source, ScanSource):
            self._client = DynamoDBClientFactory(self._source.region)()

    def process(self, part: str):
        src = self._source
        if isinstance(src, ScanSource):
            segment, total = parse_segment(part)
            # --max-rcu: each segment keeps to its share, so all together stay within it
            # however many of them run at once.
            bucket = TokenBucket(src.max_rcu / total) if src.max_rcu else None
            for page in scan_pages(self._client, src.table, segment=segment, total_segments=total,
                                   consistent_read=src.consistent_read, page_limit=None, what=f"Scan {part}",
                                   metrics_table=self._metrics_table, bucket=bucket):
                yield from page.items
        else:
            yield from src.items(part)


class _ExpectRowsFn(beam.DoFn):
    """item → ((table, row key), (keys, cells)) per row it maps to; an item the
    mapping refuses → the ``unmappable`` output."""

    UNMAPPABLE = "unmappable"

    def __init__(self, mapping: MappingConfig) -> None:
        self._mapping = mapping

    def process(self, item: dict):
        keys = {k: item[k] for k in self._mapping.source.key_attributes if k in item}
        yield beam.pvalue.TaggedOutput("items", 1)
        try:
            cells = expected_cells(self._mapping, item)
        except MappingError as exc:
            yield beam.pvalue.TaggedOutput(self.UNMAPPABLE, (canonical_typed_json({"M": keys}), keys, exc.reason,
                                                             exc.message))
            return
        by_row: dict = {}
        for cell in cells.values():
            by_row.setdefault((cell.table, cell.row_key), []).append(cell)
        for at, row_cells in by_row.items():
            yield at, (keys, row_cells)


class _SplitTargetFn(beam.DoFn):
    def __init__(self, project: str, instance: str) -> None:
        self._project, self._instance = project, instance

    def process(self, table: str):
        for start, end in table_ranges(self._project, self._instance, table):
            yield table, start, end


class _ReadTargetRowsFn(beam.DoFn):
    def __init__(self, project: str, instance: str) -> None:
        self._project, self._instance = project, instance

    def setup(self) -> None:
        self._client = data_client(self._project)

    def teardown(self) -> None:
        client = getattr(self, "_client", None)
        if client is not None:
            close_bounded(client.close, "Bigtable data client")

    def process(self, element):
        table, start, end = element
        for row_key, cells in iter_table(self._project, self._instance, table, client=self._client,
                                         start_key=start, end_key=end):
            yield (table, row_key), cells


class _CompareRowFn(beam.DoFn):
    """((table, row), {expected: [(keys, cells)], actual: [cells]}) → a partial
    report (see _Summary) for that row, only when there is something to count."""

    def __init__(self, show: bool, show_keys: bool = False, recheck: bool = False) -> None:
        self._show, self._show_keys, self._recheck = show, show_keys, recheck

    def process(self, element):
        (table, row_key), sides = element
        want: dict = {}
        owners: dict = {}
        clashes: list = []
        expected = list(sides[EXPECTED])
        for keys, cells in expected:
            add_cells(want, owners, clashes, keys, cells)
        actual = list(sides[ACTUAL])
        # a Kinesis job's clock cells are its own, not the mapping's (docs/design.md §10)
        have = without_clocks({row_key: actual[0]}) if actual else {}
        want_t = want.get(table, {})
        diff = diff_layout(want_t, have)
        diff.version_clashes = clashes
        if self._recheck and diff.rows():
            # counted by RecheckRows, if it stays different; only the row's expected count here
            yield beam.pvalue.TaggedOutput(DIVERGENT, (table, row_key, [keys for keys, _ in expected], want_t,
                                                       have, diff))
            diff = LayoutDiff(extra_versions=diff.extra_versions)
        yield findings_of(table, diff, want_t, have, self._show, rows_expected=len(want_t),
                          show_keys=self._show_keys)


class _RecheckRowsFn(beam.DoFn):
    """A batch of divergent rows → the findings of those still different once the
    tail has caught up (recheck.py), with the re-check's counts."""

    def __init__(self, table: "VerifyTable") -> None:
        self._table = table

    def setup(self) -> None:
        m = self._table.mapping
        self._ddb = DynamoDBClientFactory(m.source.region)()
        arn = describe_table(self._ddb, m.source.table, metrics_table=self._table.state.job).get("LatestStreamArn")
        self._store = self._table.state.store()
        self._tail_passed = stream_watermark(StreamsClientFactory(m.source.region)(), arn, self._store)

    def teardown(self) -> None:
        store = getattr(self, "_store", None)
        if store is not None:
            store.close()  # its data client and the writer it made

    def process(self, batch):
        t = self._table
        m = t.mapping
        suspects = {(table, row): owners for table, row, owners, _, _, _ in batch}
        outcome = recheck(m, suspects, lambda keys: get_item(self._ddb, m.source.table, keys, metrics_table=t.state.job),
                          lambda table, keys: read_rows(m.target.project, m.target.instance, table, keys),
                          self._tail_passed, t.recheck)
        findings = Findings(t.show_values, t.show_keys)
        findings.add_recheck(outcome.to_json())
        for table, (want_t, have_t, diff) in outcome.still.items():
            findings.add(table, diff, want_t, have_t)
        for table, row, _, want_t, have, diff in batch:
            if (table, row) in outcome.unconfirmed:  # the wait ended: reported as first found
                findings.add(table, diff.only_rows({row}), want_t, have)
        yield findings


class _Summary(beam.CombineFn):
    """Partial reports → one: counts summed, examples the first few in row-key
    order (the local verify keeps the same ones)."""

    def create_accumulator(self):
        return Findings.empty()

    def add_input(self, acc, partial):
        acc.merge(partial)
        return acc

    def merge_accumulators(self, accs):
        accs = list(accs)
        first = accs[0]
        for other in accs[1:]:
            first.merge(other)
        return first

    def extract_output(self, acc):
        return acc


def _unmappable_partial(entry, show: bool):
    f = Findings.empty(show)
    canonical, keys, reason, message = entry
    f.add_unmappable(canonical, keys, reason, message)
    return f


def _items_partial(n: int, show: bool):
    f = Findings.empty(show)
    f.items = n
    return f


class VerifyMappings(beam.PTransform):
    """Verify one mapping: its source against its target tables; outputs one
    ``(mapping name, report JSON)``."""

    def __init__(self, table: VerifyTable) -> None:
        super().__init__()
        self._table = table

    def expand(self, p):
        t = self._table
        m, show, show_keys = t.mapping, t.show_values, t.show_keys
        parts = t.source.parts()
        rows = (p
                | "VerifySourceParts" >> beam.Create(parts)
                | "SpreadParts" >> beam.Reshuffle()
                | "ReadSourceItems" >> beam.ParDo(_ReadSourceItemsFn(
                    t.source, t.state.job if t.state is not None else t.mapping.name))
                | "ExpectRows" >> beam.ParDo(_ExpectRowsFn(m)).with_outputs(_ExpectRowsFn.UNMAPPABLE, "items",
                                                                            main="rows"))
        actual = (p
                  | "VerifyTargetTables" >> beam.Create(list(m.tables))
                  | "SplitTargetRanges" >> beam.ParDo(_SplitTargetFn(m.target.project, m.target.instance))
                  | "SpreadRanges" >> beam.Reshuffle()
                  | "ReadTargetRows" >> beam.ParDo(_ReadTargetRowsFn(m.target.project, m.target.instance)))
        compared = ({EXPECTED: rows.rows, ACTUAL: actual}
                    | "JoinByRow" >> beam.CoGroupByKey()
                    | "CompareRows" >> beam.ParDo(_CompareRowFn(show, show_keys, t.rechecks)).with_outputs(
                        DIVERGENT, main="findings"))
        rechecked = (compared[DIVERGENT]
                     | "BatchDivergentRows" >> batch_divergent_rows()
                     | "RecheckRows" >> beam.ParDo(_RecheckRowsFn(t)).with_output_types(Any)) if t.rechecks else None
        unmappable = (rows[_ExpectRowsFn.UNMAPPABLE]
                      | "UnmappableItems" >> beam.Map(_unmappable_partial, show).with_output_types(Any))
        items = (rows["items"] | "CountItems" >> beam.CombineGlobally(sum)
                 | "ItemsPartial" >> beam.Map(_items_partial, show).with_output_types(Any))
        name, tables, sampled = m.name, list(m.tables), False
        partials = (compared.findings, unmappable, items) + ((rechecked,) if rechecked is not None else ())
        return (partials
                | "AllFindings" >> beam.Flatten().with_output_types(Any)
                | "SummarizeVerify" >> beam.CombineGlobally(_Summary()).with_output_types(Any)
                | "ToReport" >> beam.Map(lambda f: (name, f.report(tables, show, sampled, show_keys).to_json())))


def _write_report(named: list, path: str) -> None:
    from apache_beam.io.filesystems import FileSystems

    named = sorted(named)
    if len(named) == 1:
        body = named[0][1]
    else:
        body = {"identical": all(r["identical"] for _, r in named), "tables": dict(named)}
    with FileSystems.create(path) as f:
        f.write(json.dumps(body, indent=2, ensure_ascii=False).encode())


def build_verify(p: beam.Pipeline, tables: list, report_path: str) -> None:
    """Add the verify of ``tables`` (VerifyTable) to ``p``; the report goes to
    ``report_path`` (a local path or gs://)."""
    reports = [p | f"Verify[{t.mapping.name}]" >> VerifyMappings(t) for t in tables]
    (reports | "AllReports" >> beam.Flatten()
     | "CollectReports" >> beam.combiners.ToList()
     | "WriteVerifyReport" >> beam.Map(_write_report, report_path))


def run_verify_job(tables: list, beam_args: list, report_path: str) -> tuple:
    """Run the Beam verify: ``(result, report)``. Locally it waits and returns
    the report (the caller prints it and exits 0 only when identical); on a
    remote runner the report is None once launched (it appears at
    ``report_path`` when the job ends)."""
    p = make_pipeline(beam_args, streaming=False)
    build_verify(p, tables, report_path)
    result = p.run()
    if not is_local(beam_args):
        return result, None
    result.wait_until_finish()
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.open(report_path) as f:
        return result, json.loads(f.read().decode())
