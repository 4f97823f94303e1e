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

One ``step`` checks a slice of the current segment (at most ``limit`` items,
from where the last step stopped) and saves where it stands — segment, the key
to resume the Scan after, passes done, the items awaiting their second check —
in the state table (``{job}#meta#continuous_check``, compare-and-set), so a
restarted process or Dataflow worker goes on from there. Two drivers: a thread
next to a local job (``start_continuous_check``) and, on Dataflow, a
``PeriodicImpulse`` branch of the streaming job (continuous_beam.py). A step is
skipped while a migration is not LIVE (a backfill or its catch-up is not
divergence).
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from ddb2bt.pipeline.verify.recheck import RecheckOptions, recheck, stream_watermark
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.mapping import expected_cells
from ddb2bt.transforms.model import MODIFY, REMOVE, ChangeRecord, DeadLetter
from ddb2bt.pipeline.clients.bigtable.reads import read_rows
from ddb2bt.pipeline.clients.dynamodb import describe_table, get_item, scan_pages
from ddb2bt.pipeline.connect.connections import dynamodb_client, StreamsClientFactory
from ddb2bt.pipeline.control.phases import LIVE, parse_phase
from ddb2bt.pipeline.verify.verify import redact
from ddb2bt.pipeline.observe.metrics import default_metrics, UNNAMED_TABLE
from ddb2bt.transforms.attrs import item_from_dynamodb_json, item_to_dynamodb_json

__all__ = ["ContinuousCheck", "ContinuousOptions", "CheckPosition", "StoredPosition", "DIVERGENT"]

log = logging.getLogger(__name__)

DIVERGENT = "divergent"  # the dead-letter reason of a divergent item
KINDS = ("missing_rows", "extra_rows", "missing_cells", "extra_cells", "different_cells", "version_clashes")
# Items checked together: one wait for the tail per step, pages stay small.
STEP_ITEMS = 100
# The state-table meta row holding the check's position (CheckPosition as JSON).
POSITION_META = "continuous_check"
# Items awaiting their second check, kept with the position: bounded so the row
# stays small even if a whole table diverged (beyond it, an item is reported a
# pass later; the alert has fired long before).
MAX_SUSPECTED = 1000


@dataclass(frozen=True)
class ContinuousOptions:
    items_per_s: float = 10.0  # read budget: items checked per second (each: 2 GetItems + its rows)
    segments: int = 64  # one full pass = this many Scan segments, one after the other
    wait_s: float = 120.0  # how long a step waits for the tail before it gives up on its items


@dataclass(frozen=True)
class CheckPosition:
    """Where the check stands (saved after every step): the Scan segment of
    ``segments`` being walked, the key to resume it after (a DynamoDB-JSON token;
    None: its start), full passes finished, and the ids (hashes, no key values)
    of the items found different once and awaiting their second check."""

    segments: int = 0
    segment: int = 0
    resume: Optional[str] = None
    passes: int = 0
    suspected: tuple = field(default_factory=tuple)

    def to_json(self) -> str:
        return json.dumps({"segments": self.segments, "segment": self.segment, "resume": self.resume,
                           "passes": self.passes, "suspected": list(self.suspected)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: Optional[str]) -> "CheckPosition":
        if not text:
            return cls()
        try:
            d = json.loads(text)
            return cls(int(d["segments"]), int(d["segment"]), d.get("resume"), int(d.get("passes", 0)),
                       tuple(str(s) for s in d.get("suspected", ())))
        except (ValueError, KeyError, TypeError):
            log.warning("continuous check: unreadable position in the state table; starting a new pass")
            return cls()


class StoredPosition:
    """The check's position in the state store (one meta row per job): ``load()``
    and ``save(before, after)``, a compare-and-set against what the step began
    from, so two steps racing (a retried bundle, a second worker) never move it
    back; the loser's save is dropped (it checked items, harmlessly, twice)."""

    def __init__(self, store) -> None:
        self.store = store
        self._raw: dict = {}  # position -> the exact stored text it was read from

    def load(self) -> CheckPosition:
        raw = self.store.load_meta(POSITION_META)
        position = CheckPosition.from_json(raw)
        self._raw = {position: raw}
        return position

    def save(self, before: CheckPosition, after: CheckPosition) -> bool:
        return self.store.swap_meta(POSITION_META, self._raw.get(before), after.to_json())


class ContinuousCheck:
    """One table's check. ``scan_segment(segment, total, start_key)`` → the
    segment's items after ``start_key`` (None: from its start; pages, lazily);
    ``get_item(keys)``; ``read_rows(table, keys)``; ``tail_passed(t_ms)``;
    ``store`` a StateStore (dead letters, the migration phase and, through
    ``position`` — a StoredPosition of it unless given — where the check
    stands); ``metrics`` a TableMetrics. Time and sleep injected."""

    def __init__(self, mapping, scan_segment: Callable, get_item: Callable, read_rows: Callable,
                 tail_passed: Callable[[int], bool], store, metrics, options: ContinuousOptions = ContinuousOptions(),
                 now_ms: Callable[[], int] = lambda: time.time_ns() // 10**6,
                 sleep: Callable[[float], None] = time.sleep, position=None) -> None:
        self.mapping, self.scan_segment, self.get_item, self.read_rows = mapping, scan_segment, get_item, read_rows
        self.tail_passed, self.store, self.metrics, self.options = tail_passed, store, metrics, options
        self.now_ms, self.sleep = now_ms, sleep
        self.position = position if position is not None else StoredPosition(store)
        # Items found different once, awaiting their next check: only an item still
        # different when its segment comes round again is counted and recorded. A
        # real divergence persists (Bigtable keeps it until repaired), so it is
        # reported one pass later; a one-off race of a check against the tail is not
        # (a rare false "extra row" was seen under load and not yet explained).
        # Loaded from and saved with the position by every step.
        self.suspected: set = set()
        metrics.verify_kinds(KINDS)  # each kind's counter at 0 from the start: its first confirmation is a rise

    def step(self, limit: Optional[int] = None) -> int:
        """Check the next slice of the table — at most ``limit`` items (None: the
        rest of the current segment) from where the last step stopped, on into
        the next segments while the slice is not full, up to the end of a pass —
        and save the new position; returns the items checked. After the last
        segment of a pass the pass's end time is exported. Nothing is checked
        while a migration of the table is not LIVE."""
        if limit is not None and limit < 1:
            raise ValueError(f"a step checks at least one item, got limit={limit}")
        if not self._live():
            return 0
        before = self.position.load()
        segments = self.options.segments
        # The first step, or --continuous-check-segments changed (a resume key is
        # a key of one segmentation): a pass from the first segment.
        at = first = before if before.segments == segments else \
            CheckPosition(segments, passes=before.passes, suspected=before.suspected)
        self.suspected = set(at.suspected)
        checked, started = 0, time.monotonic()
        while True:
            n, last = self._walk(at, None if limit is None else limit - checked, checked, started)
            checked += n
            if last is not None:  # the slice is full: the next step resumes after the last item checked
                keys = self.mapping.source.key_attributes
                at = replace(at, resume=_token({k: last[k] for k in keys if k in last}))
                break
            segment = (at.segment + 1) % segments
            at = replace(at, segment=segment, resume=None, passes=at.passes + (segment == 0))
            if limit is None or segment == 0 or checked >= limit:
                break  # a pass's end also ends the step: its time is exported once
        after = replace(at, suspected=tuple(sorted(self.suspected))[:MAX_SUSPECTED])
        if not self.position.save(before, after):
            log.debug("continuous check of %s: another step moved the position meanwhile; keeping its",
                      self.mapping.source.table)
        elif after.passes > first.passes:
            self.metrics.verify_pass_finished(self.now_ms() / 1000)
        return checked

    def _walk(self, at: CheckPosition, budget: Optional[int], checked: int, started: float):
        """Check ``at``'s segment from its resume key, at most ``budget`` items;
        returns (items checked, the last one checked if the budget ran out before
        the segment's end, else None)."""
        n, batch, last = 0, [], None
        for item in self.scan_segment(at.segment, at.segments, _untoken(at.resume)):
            if budget is not None and n + len(batch) >= budget:
                if batch:
                    n += self._check(batch)
                    last = batch[-1]
                    self._pace(checked + n, started)
                return n, last
            batch.append(item)
            if len(batch) >= STEP_ITEMS:
                n += self._check(batch)
                last, batch = batch[-1], []
                self._pace(checked + n, started)
        if batch:
            n += self._check(batch)
            self._pace(checked + n, started)
        return n, None

    def _live(self) -> bool:
        phase = parse_phase(self.store.load_meta("phase"))
        if phase is None or phase == LIVE:
            return True
        log.debug("continuous check of %s: waiting for the migration to be LIVE (%s)", self.mapping.source.table,
                  phase.value)
        return False

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
        self.metrics.verify_checked_items(len(items))
        return len(items)

    def _record(self, suspects: dict, result) -> set:
        """Counts and records the items still different on their second check in a
        row; returns the ids of every item found different now."""
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
                self.metrics.verify_divergence(kind)
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

    def run_forever(self, stop: threading.Event, limit: Optional[int] = None) -> None:
        """Steps (of ``limit`` items) until ``stop``; a failing step is logged and
        retried after a pause (the check must never take the replication down)."""
        while not stop.is_set():
            try:
                if not self._live():
                    stop.wait(STEP_INTERVAL_S)  # a migration not LIVE yet: look again later
                    continue
                if self.step(limit) == 0:
                    stop.wait(STEP_INTERVAL_S)  # an empty table: no loop of Scans
            except Exception as exc:  # noqa: BLE001 — logged, the tail goes on
                log.warning("continuous check step failed (%s: %s); retrying", type(exc).__name__, exc)
                stop.wait(STEP_INTERVAL_S)


def _item_id(keys: dict) -> str:
    # A digest, not the key: the ids are saved with the position in the state table.
    return hashlib.sha256(repr(sorted(keys.items())).encode()).hexdigest()[:ITEM_ID_HEX]


ITEM_ID_HEX = 24  # 96 bits: no two items of a table share an id in practice


def _token(key: dict) -> Optional[str]:
    """An item's key (boto3 AttributeValue form) as a Scan resume token."""
    return json.dumps(item_to_dynamodb_json(key), sort_keys=True) if key else None


def _untoken(token: Optional[str]) -> Optional[dict]:
    return item_from_dynamodb_json(json.loads(token)) if token else None


def connect_check(mapping, store, options: ContinuousOptions, stream_arn: Optional[str] = None,
                  streams_factory: Optional[Callable] = None) -> ContinuousCheck:
    """``mapping``'s check against the real services: DynamoDB (Scan, GetItem),
    the target's rows, the tail's progress through ``streams_factory``'s client
    (the source's own: DynamoDB Streams or the Kinesis adapter) and ``store``.
    Its metrics carry the job's name (the state key) as ``table``, like the
    sink's. What the local thread and the Dataflow step (continuous_beam.py) run."""
    ddb = dynamodb_client(mapping.source.region)
    t = mapping.target
    job = getattr(store, "job", None) or UNNAMED_TABLE
    arn = stream_arn or describe_table(ddb, mapping.source.table, metrics_table=job).get("LatestStreamArn")
    streams = (streams_factory or StreamsClientFactory(mapping.source.region))()

    def scan_segment(segment: int, total: int, start_key: Optional[dict] = None):
        for page in scan_pages(ddb, mapping.source.table, segment=segment, total_segments=total,
                               start_key=start_key, consistent_read=False, page_limit=STEP_ITEMS,
                               metrics_table=job):
            yield from page.items

    return ContinuousCheck(mapping, scan_segment,
                           lambda keys: get_item(ddb, mapping.source.table, keys, metrics_table=job),
                           lambda table, keys: read_rows(t.project, t.instance, table, keys),
                           stream_watermark(streams, arn, store), store,
                           default_metrics().for_table(job), options)


def start_continuous_check(mapping, store, options: ContinuousOptions, stop: threading.Event,
                           stream_arn: Optional[str] = None, streams_factory: Optional[Callable] = None,
                           slice_items: Optional[int] = None) -> threading.Thread:
    """A daemon thread checking ``mapping``'s table against the real services
    (next to a local job: the FnApiRunner cannot run the PeriodicImpulse branch,
    see continuous_beam.py), ``slice_items`` per step (default: one step's worth
    of the read budget, as on Dataflow)."""
    check = connect_check(mapping, store, options, stream_arn, streams_factory)
    thread = threading.Thread(target=check.run_forever, args=(stop, slice_items or step_items(options)),
                              daemon=True, name=f"continuous-check-{mapping.name}")
    thread.start()
    return thread


# One step every this many seconds (Dataflow: the PeriodicImpulse's interval):
# short enough that a step is a small unit of work a worker can lose and redo,
# long enough that the tail wait and the position's save are a small part of it.
STEP_INTERVAL_S = 10.0


def step_items(options: ContinuousOptions, interval_s: float = STEP_INTERVAL_S) -> int:
    """Items one step checks: the read budget of one interval (at least 1)."""
    return max(1, round(options.items_per_s * interval_s))
