"""Backfill sources: a parallel Scan of the live table, or a DynamoDB export
(the real point-in-time layout), as ChangeRecords for the same mapping and sink.

Graph: BackfillTasks (Create) → ReadBackfill → MapChanges → WriteToBigtable.
Each task holds several *parts* (scan segments or export data files) that one
DoFn element reads in threads through a bounded queue: in parallel where the
reading waits on the network (Scan segments, S3 objects), one part at a time
from a local export, whose reading is only decoding (on Dataflow, tasks spread
over workers).

Every item becomes an INSERT at the handoff second minus 1 ms, guarded against
the live tail (``ddb2bt.transforms.mapping.map_change``). Progress is checkpointed per
part in the state table by the sink, after the writes it covers: a scan segment
resumes from its last evaluated key, an export file from its line number.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import apache_beam as beam

from ddb2bt.transforms.attrs import item_from_dynamodb_json, item_to_dynamodb_json
from ddb2bt.transforms.errors import PermanentError
from ddb2bt.transforms.mapping import backfill_record
from ddb2bt.transforms.model import BackfillPosition, PartDone, StreamElement, build_backfill_position
from ddb2bt.pipeline.observe.metrics import default_metrics
from ddb2bt.pipeline.source.records import FLUSH, batch_records
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.clients.dynamodb import MAX_SCAN_THREADS, TokenBucket, scan_pages
from ddb2bt.pipeline.control.coordinator import coordinator_for
from ddb2bt.pipeline.source.snapshot import ExportSource, ScanSource, parse_segment

log = logging.getLogger(__name__)

SCAN, EXPORT = "scan", "export"
# BackfillPosition(...), its slots filled directly: once per exported item.
_position = build_backfill_position
QUEUE_ITEMS = 10_000  # bounded: readers wait for the writer instead of filling memory
# Records a reader thread hands over at once: one queue operation (lock, GIL
# hand-off) per chunk instead of per record; small next to a batch (1,000 rows)
# so the writer never waits long for a chunk to fill. A Scan page's last chunk is
# handed over before the next page is requested.
CHUNK_ITEMS = 100
QUEUE_CHUNKS = QUEUE_ITEMS // CHUNK_ITEMS
# An export part reports its items to the progress counter this often.
EXPORT_PROGRESS_ITEMS = 1000
# Parts a task reads at once (each in its own thread). A Scan segment's pages and
# an S3 export's objects (a client, a TLS handshake and a first byte per part)
# are network round trips, which threads overlap. A local export's lines are only
# decoded, in Python, holding the GIL: a second decoding thread only takes it from
# the mapping and the sink's write thread, whose RPCs then wait longer for it
# (bench/backfill_cpu.py, one thread against four: medians +15 %, pairwise x1.12;
# see docs/benchmarks.md). So a local export's parts are read one at a time.
NETWORK_PART_THREADS = MAX_SCAN_THREADS
LOCAL_EXPORT_THREADS = 1
_DONE = object()


@dataclass(frozen=True)
class BackfillTask:
    parts: tuple


def plan_tasks(parts: list, tasks: int) -> list:
    """Spread parts over ``tasks`` elements (round-robin: neighbours differ)."""
    tasks = max(1, min(tasks, len(parts)))
    return [BackfillTask(tuple(parts[i::tasks])) for i in range(tasks)]


def _token(key: Optional[dict]) -> Optional[str]:
    if not key:
        return None
    # The hot path (one token per scanned item): S and N keys are spelled the same
    # in boto3 form and in DynamoDB JSON, so the key dumps as it is.
    if all(type(v) is dict and len(v) == 1 and ("S" in v or "N" in v) for v in key.values()):
        return json.dumps(key, sort_keys=True)
    return json.dumps(item_to_dynamodb_json(key), sort_keys=True)


def _untoken(token: Optional[str]) -> Optional[dict]:
    return item_from_dynamodb_json(json.loads(token)) if token else None


class PartReaders:
    """Reads parts (the I/O); Beam-free so tests can drive it directly."""

    def __init__(self, source, key_attributes: tuple, handoff_ms: int, client=None,
                 bucket: Optional[TokenBucket] = None, retry: RetryPolicy = RetryPolicy(0.2, 20.0, 600.0),
                 on_items: Callable[[int], None] = lambda n: None, metrics_table: Optional[str] = None,
                 between_attempts: Optional[Callable[[], None]] = None) -> None:
        self._source = source
        self._between_attempts = between_attempts  # the job coordinator's lease check, between Scan retries
        self._metrics_table = metrics_table  # the job's name: the table label of the calls counted
        self._keys = key_attributes
        self._handoff_ms = handoff_ms
        self._client = client
        self._bucket = bucket or TokenBucket(None)
        self._retry = retry
        self._on_items = on_items

    def _record(self, item: dict, position: BackfillPosition, keys: Optional[dict] = None):
        if keys is None:
            keys = {k: item[k] for k in self._keys if k in item}
        return backfill_record(keys, item, self._handoff_ms, position)

    def read(self, part: str, resume: Optional[str], count: int) -> Iterator:
        """The part's records from ``resume`` on, then its PartDone."""
        for chunk in self.read_chunks(part, resume, count):
            yield from chunk

    def read_chunks(self, part: str, resume: Optional[str], count: int) -> Iterator[list]:
        """``read`` in lists of up to CHUNK_ITEMS elements, in order (the PartDone last)."""
        if isinstance(self._source, ScanSource):
            yield from self._scan(part, resume, count)
        else:
            yield from self._export(part, resume)

    def _scan(self, part: str, resume: Optional[str], count: int) -> Iterator[list]:
        segment, total = parse_segment(part)
        src = self._source
        for page in scan_pages(self._client, src.table, segment=segment, total_segments=total,
                               start_key=_untoken(resume), consistent_read=src.consistent_read,
                               page_limit=src.page_limit, bucket=self._bucket, retry=self._retry,
                               what=f"Scan {part}", metrics_table=self._metrics_table,
                               between_attempts=self._between_attempts):
            items = page.items
            self._on_items(len(items))
            keys = self._keys
            chunk: list = []
            for item in items:
                count += 1
                key = {k: item[k] for k in keys if k in item}
                # Resume right after this item: any item's primary key is a valid
                # ExclusiveStartKey (LastEvaluatedKey is just the last one's), so a
                # restart re-reads nothing that was written, even inside a page
                # (a page can hold a whole segment).
                chunk.append(self._record(item, BackfillPosition(SCAN, part, _token(key), count), key))
                if len(chunk) >= CHUNK_ITEMS:
                    yield chunk
                    chunk = []
            if chunk:
                yield chunk  # before the next page is requested
        yield [PartDone(SCAN, part, count)]

    def _export(self, part: str, resume: Optional[str]) -> Iterator[list]:
        skip = int(resume or 0)
        line_no = 0  # the item's ordinal in its file (a line of DYNAMODB_JSON, a value of ION)
        batch = 0
        chunk: list = []
        try:
            for item in self._source.items(part):
                line_no += 1
                if line_no <= skip:
                    continue
                batch += 1
                if batch >= EXPORT_PROGRESS_ITEMS:
                    self._on_items(batch)
                    batch = 0
                chunk.append(self._record(item, _position(EXPORT, part, str(line_no), line_no)))
                if len(chunk) >= CHUNK_ITEMS:
                    yield chunk
                    chunk = []
        except Exception:
            if chunk:  # a damaged line: the items before it are still handed over, as one by one
                yield chunk
            raise
        if chunk:
            yield chunk
        self._on_items(batch)
        expected = self._source.expected_items(part)
        if expected is not None and expected != line_no:
            # A short or truncated file would otherwise leave items silently missing.
            raise PermanentError(f"{part} holds {line_no} items but manifest-files.json says {expected}: the "
                                 "export is incomplete or damaged; take a new export")
        yield [PartDone(EXPORT, part, line_no)]


@dataclass(frozen=True)
class BackfillJob:
    source: object  # ScanSource | ExportSource
    key_attributes: tuple
    handoff_ms: int
    tasks: int = 1
    # How long one Scan page may keep failing with throttling/5xx before the backfill
    # stops (--dynamodb-deadline); the readers' default otherwise.
    scan_retry: Optional[RetryPolicy] = None


class BackfillReaderFn(beam.DoFn):
    """What both backfill readers hold (the threaded one here, the splittable one
    in backfill_sdf.py): the state store, the DynamoDB client and the job's read
    budget, split over the parts that may run at once (one per worker thread).
    Public: the splittable reader derives from it."""

    def __init__(self, job: BackfillJob, state_factory: Callable, client_factory: Optional[Callable] = None) -> None:
        self._job = job
        self._state_factory = state_factory
        self._client_factory = client_factory

    def setup(self) -> None:
        # The job's coordinator: a Scan's retries stop once the job's lease is lost.
        self._coordinator = coordinator_for(self._state_factory, self._state_factory)
        self._state = self._coordinator.guard(self._state_factory())
        self._metrics = default_metrics().for_table(self._state.job)
        self._client = self._client_factory() if self._client_factory else None
        src = self._job.source
        rate = src.max_rcu / self._job.tasks if isinstance(src, ScanSource) and src.max_rcu else None
        self._bucket = TokenBucket(rate)

    def teardown(self) -> None:
        for resource in (getattr(self, "_state", None), getattr(self, "_client", None)):
            close = getattr(resource, "close", None)
            if close:
                close()


class _ReadBackfillFn(BackfillReaderFn):
    """BackfillTask → RecordBatch | PartDone, reading the task's parts in threads:
    a Scan's segments and an S3 export's parts at once, a local export's parts one
    after another (NETWORK_PART_THREADS, LOCAL_EXPORT_THREADS), beside the writer."""

    def process(self, task: BackfillTask):
        kind = SCAN if isinstance(self._job.source, ScanSource) else EXPORT
        progress = self._state.load_backfill_progress(kind)
        todo = [(p, progress.get((kind, p))) for p in task.parts]
        todo = [(p, c) for p, c in todo if not (c and c.done)]
        if not todo:
            return
        counter = self._metrics.backfill_items.labels(kind)
        retry = {"retry": self._job.scan_retry} if self._job.scan_retry is not None else {}
        readers = PartReaders(self._job.source, self._job.key_attributes, self._job.handoff_ms, self._client,
                              self._bucket, on_items=counter.inc, metrics_table=self._metrics.table,
                              between_attempts=self._coordinator.check_held, **retry)
        out: queue.Queue = queue.Queue(maxsize=QUEUE_CHUNKS)
        stop = threading.Event()

        def run(part: str, ckpt) -> None:
            try:
                for chunk in readers.read_chunks(part, ckpt.resume if ckpt else None, ckpt.count if ckpt else 0):
                    while not stop.is_set():
                        try:
                            out.put(chunk, timeout=0.5)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                out.put(_DONE)
            except BaseException as exc:  # surfaced in the main thread below
                out.put(exc)

        local_export = isinstance(self._job.source, ExportSource) and not self._job.source.is_s3
        at_once = LOCAL_EXPORT_THREADS if local_export else NETWORK_PART_THREADS
        threads = [threading.Thread(target=run, args=(p, c), daemon=True, name=f"backfill-{p}")
                   for p, c in todo[:at_once]]
        pending = list(todo[at_once:])
        for t in threads:
            t.start()
        running = len(threads)

        def elements():
            nonlocal running
            while running:
                try:
                    element = out.get_nowait()
                except queue.Empty:
                    yield FLUSH  # nothing ready: send the records so far before waiting
                    element = out.get()
                if element is _DONE:
                    running -= 1
                    if pending:
                        p, c = pending.pop(0)
                        t = threading.Thread(target=run, args=(p, c), daemon=True, name=f"backfill-{p}")
                        t.start()
                        running += 1
                    continue
                if isinstance(element, BaseException):
                    raise element
                yield from element  # a chunk

        try:
            # Records travel in batches, as on the live path: as many as are ready,
            # up to a page; a part's PartDone after its records.
            yield from batch_records(elements())
        finally:
            stop.set()


def add_backfill(p: beam.Pipeline, job: BackfillJob, mapping, state, sink_config, client_factory=None,
                 reshuffle: bool = False, pushgateway: Optional[str] = None,
                 splittable: Optional[bool] = None) -> beam.PCollection:
    """Add the backfill path to ``p``; returns the dead-letter PCollection.
    ``splittable`` (default: with ``reshuffle``, i.e. on Dataflow): read with the
    splittable reader (``backfill_sdf``: checkpoints, drain, update), else with
    the threaded one (on the local runner: a task's Scan segments and S3 export
    parts in parallel, a local export's parts one after another, beside the writer)."""
    from ddb2bt.pipeline.sink.sink import write_to_bigtable
    from ddb2bt.transforms.dofns import map_changes
    import ddb2bt.pipeline.source.coders  # noqa: F401  (registers the StreamElement coder)

    if mapping.source.kinesis is not None and not sink_config.ordering_guard:
        # An out-of-order tail: backfilled items go through the ordering guard too
        # (docs/design.md §10.6), never around it.
        from dataclasses import replace

        sink_config = replace(sink_config, ordering_guard=True)
    if reshuffle if splittable is None else splittable:
        from ddb2bt.pipeline.cutover.backfill_sdf import ReadBackfillParts

        read = p | "ReadBackfill" >> ReadBackfillParts(job, state, client_factory, reshuffle=reshuffle)
    else:
        tasks = plan_tasks(job.source.parts(), job.tasks)
        pcoll = p | "BackfillTasks" >> beam.Create(tasks)
        if reshuffle:
            # Spread tasks over workers. Safe: this is before reading, not between
            # reading and writing (per-row order is not at stake in a backfill anyway).
            pcoll = pcoll | "SpreadTasks" >> beam.Reshuffle()
        read = pcoll | "ReadBackfill" >> beam.ParDo(_ReadBackfillFn(job, state, client_factory)).with_output_types(
            StreamElement)
    return (
        read
        | "MapBackfill" >> map_changes(mapping)
        | "WriteBackfill" >> write_to_bigtable(state.bigtable, state, sink_config, pushgateway=pushgateway)
    )
