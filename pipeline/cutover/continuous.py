"""The continuous check: while the tail runs, compare items with their rows, a
few at a time, for as long as the migration lasts.

Between cutover and the day the old table is switched off nothing else checks
that the copy stays identical. This check walks the source in a rotating Scan
segment (``segments`` of them: one pass over the whole table is ``segments``
steps), within a read budget (``items_per_s``), and for every item read checks
its rows exactly like verify's live re-check (recheck.py): the item read at g,
the tail waited for until it applied every record up to g, the rows read, the
item read again; only an item that did not change across that and whose rows
differ is *divergent*. A divergent item is

* counted: ``ddb2bt_verify_divergent_total{table, kind}`` (alert
  ``DDB2BTVerifyDivergence``), next to ``ddb2bt_verify_checked_total{table}``
  and ``ddb2bt_verify_last_full_pass_timestamp_seconds{table}``;
* logged with its key redacted (verify.redact);
* recorded as a dead letter (reason ``divergent``, stage ``verify``, the item's
  current image) so ``ddb2bt dlq list --reason divergent`` shows it and
  ``ddb2bt repair`` (a redrive of those dead letters) rewrites the item's
  current state.

Item by item, the check sees missing rows and cells, stale cells and cells of
other families in the item's own rows; a row no item owns at all (extra row)
is for the full `verify`.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ddb2bt.pipeline.cutover.recheck import RecheckOptions, recheck
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.mapping import expected_cells
from ddb2bt.transforms.model import MODIFY, REMOVE, ChangeRecord, DeadLetter

__all__ = ["ContinuousCheck", "ContinuousOptions", "DIVERGENT"]

log = logging.getLogger(__name__)

DIVERGENT = "divergent"  # the dead-letter reason of a divergent item
KINDS = ("missing_rows", "extra_rows", "missing_cells", "extra_cells", "different_cells", "version_clashes")
# Items checked together: one wait for the tail per step, pages stay small.
STEP_ITEMS = 100


@dataclass(frozen=True)
class ContinuousOptions:
    items_per_s: float = 10.0  # read budget: items checked per second (each: 2 GetItems + its rows)
    segments: int = 64  # one full pass = this many Scan segments, one after the other
    wait_s: float = 120.0  # how long a step waits for the tail before it gives up on its items


class ContinuousCheck:
    """One table's check. ``scan_segment(segment, total)`` → the segment's items
    (pages, lazily); ``get_item(keys)``; ``read_rows(table, keys)``;
    ``tail_passed(t_ms)``; ``store`` a StateStore (dead letters); ``metrics``
    a TableMetrics. Time and sleep injected."""

    def __init__(self, mapping, scan_segment: Callable, get_item: Callable, read_rows: Callable,
                 tail_passed: Callable[[int], bool], store, metrics, options: ContinuousOptions = ContinuousOptions(),
                 now_ms: Callable[[], int] = lambda: time.time_ns() // 10**6,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.mapping, self.scan_segment, self.get_item, self.read_rows = mapping, scan_segment, get_item, read_rows
        self.tail_passed, self.store, self.metrics, self.options = tail_passed, store, metrics, options
        self.now_ms, self.sleep = now_ms, sleep
        self.segment = 0
        self.passes = 0
        # Items found different once, awaiting their next check: only an item still
        # different when its segment comes round again is counted and recorded. A
        # real divergence persists (Bigtable keeps it until repaired), so it is
        # reported one pass later; a one-off race of a check against the tail is not
        # (a rare false "extra row" was seen under load and not yet explained).
        self.suspected: set = set()

    def step(self) -> int:
        """Check the next segment; returns the items checked. After the last
        segment of a pass, the pass's end time is exported."""
        checked = 0
        batch: list = []
        started = time.monotonic()
        for item in self.scan_segment(self.segment, self.options.segments):
            batch.append(item)
            if len(batch) >= STEP_ITEMS:
                checked += self._check(batch)
                batch = []
                self._pace(checked, started)
        if batch:
            checked += self._check(batch)
            self._pace(checked, started)
        self.segment = (self.segment + 1) % self.options.segments
        if self.segment == 0:
            self.passes += 1
            self.metrics.verify_last_pass.labels(self.metrics.table).set(self.now_ms() / 1000)
        return checked

    def _pace(self, checked: int, started: float) -> None:
        ahead = checked / self.options.items_per_s - (time.monotonic() - started)
        if ahead > 0:
            self.sleep(ahead)

    def _check(self, items: list) -> int:
        m = self.mapping
        suspects: dict = {}
        for item in items:
            keys = {k: item[k] for k in m.source.key_attributes if k in item}
            try:
                cells = expected_cells(m, item)
            except MappingError:
                continue  # a dead letter of its own already (the live path refused it)
            for cell in cells.values():
                suspects.setdefault((cell.table, cell.row_key), [])
                if keys not in suspects[(cell.table, cell.row_key)]:
                    suspects[(cell.table, cell.row_key)].append(keys)
        if suspects:
            result = recheck(m, suspects, self.get_item, self.read_rows, self.tail_passed,
                             RecheckOptions(wait_s=self.options.wait_s, rounds=3, max_rows=len(suspects)),
                             now_ms=self.now_ms, sleep=self.sleep)
            if not result.timed_out:
                found = self._record(suspects, result)
                checked_ids = {_item_id({k: item[k] for k in m.source.key_attributes if k in item}) for item in items}
                self.suspected -= checked_ids - found  # checked again and equal now: forgotten
        self.metrics.verify_checked.labels(self.metrics.table).inc(len(items))
        return len(items)

    def _record(self, suspects: dict, result) -> set:
        """Counts and records the items still different on their second check in a
        row; returns the ids of every item found different now."""
        from ddb2bt.pipeline.cutover.verify import redact

        by_item: dict = {}  # key id -> (keys, {kinds})
        for table, (_, _, diff) in result.still.items():
            for kind in KINDS:
                for entry in getattr(diff, kind):
                    row = entry.row_key if kind == "version_clashes" else (
                        entry if isinstance(entry, bytes) else entry[0])
                    for keys in suspects.get((table, row), []):
                        by_item.setdefault(_item_id(keys), (keys, set()))[1].add(kind)
        now = self.now_ms()
        letters = []
        for item_id, (keys, kinds) in by_item.items():
            if item_id not in self.suspected:
                self.suspected.add(item_id)
                log.info("continuous check: an item of %s differs from Bigtable (%s); checked again on the next "
                         "pass before it is reported", self.mapping.source.table, ", ".join(sorted(kinds)))
                continue
            self.suspected.discard(item_id)
            for kind in sorted(kinds):
                self.metrics.verify_divergent.labels(self.metrics.table, kind).inc()
            current = self.get_item(keys)
            log.warning("continuous check: item %s of %s differs from Bigtable (%s); recorded as a dead letter "
                        "(reason %s): ddb2bt repair rewrites it", redact(keys, False), self.mapping.source.table,
                        ", ".join(sorted(kinds)), DIVERGENT)
            record = ChangeRecord(MODIFY if current is not None else REMOVE, keys, current, None, now)
            letters.append(DeadLetter(DIVERGENT, "Divergence", f"rows differ: {', '.join(sorted(kinds))}",
                                      "verify", record, now))
        if letters:
            self.store.save_dead_letters(letters)
        return set(by_item)

    def run_forever(self, stop: threading.Event) -> None:
        """Steps until ``stop``; a failing step is logged and retried after a pause
        (the check must never take the replication down)."""
        while not stop.is_set():
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 — logged, the tail goes on
                log.warning("continuous check step failed (%s: %s); retrying", type(exc).__name__, exc)
                stop.wait(10.0)


def _item_id(keys: dict) -> str:
    return repr(sorted(keys.items()))


def start_continuous_check(mapping, store, options: ContinuousOptions, stop: threading.Event,
                           stream_arn: Optional[str] = None) -> threading.Thread:
    """A daemon thread checking ``mapping``'s table against the real services."""
    from ddb2bt.pipeline.connections import StreamsClientFactory, dynamodb_client
    from ddb2bt.pipeline.cutover.recheck import stream_watermark
    from ddb2bt.pipeline.dynamodb import describe_table, get_item, scan_pages
    from ddb2bt.pipeline.metrics import default_metrics
    from ddb2bt.pipeline.sink.bigtable_io import read_rows

    ddb = dynamodb_client(mapping.source.region)
    t = mapping.target
    arn = stream_arn or describe_table(ddb, mapping.source.table).get("LatestStreamArn")

    def scan_segment(segment: int, total: int):
        for page in scan_pages(ddb, mapping.source.table, segment=segment, total_segments=total,
                               consistent_read=False, page_limit=STEP_ITEMS):
            yield from page.items

    check = ContinuousCheck(mapping, scan_segment, lambda keys: get_item(ddb, mapping.source.table, keys),
                            lambda table, keys: read_rows(t.project, t.instance, table, keys),
                            stream_watermark(StreamsClientFactory(mapping.source.region)(), arn, store),
                            store, default_metrics().for_table(mapping.name), options)
    thread = threading.Thread(target=check.run_forever, args=(stop,), daemon=True,
                              name=f"continuous-check-{mapping.name}")
    thread.start()
    return thread
