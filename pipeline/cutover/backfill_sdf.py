"""The backfill's splittable read, for Dataflow's drain, update and scaling.

The threaded reader (``backfill._ReadBackfillFn``) reads a whole task — several
parts — in one call for as long as that takes: a drain or an ``--update`` of a
``migrate`` job waits for whole tasks, and Dataflow reports the work as stuck.
Here each *part* (a Scan segment or an export data file) is one element of a
splittable DoFn whose restriction is the part's position:

* an export data file: the item ordinal (line) after which to go on;
* a Scan segment: the key range still to read — from the last claimed item's
  primary key (an ExclusiveStartKey) to the segment's end.

Every record is claimed before it is emitted. The reader checkpoints itself
every ``checkpoint_s`` (``defer_remainder``) and accepts the runner's checkpoint
splits (``try_split(0)``): the primary ends at the last claimed item, the
residual resumes right after it, so nothing is read twice and nothing skipped.
Splits of the *remainder at a fraction* are refused: a part's progress in the
state table is one resume position (``BackfillCheckpoint``), which two readers
of one part would overwrite; the parallelism is the number of parts
(``--segments``, or the export's files), spread over workers by a Reshuffle.

On a drain the restriction is truncated (nothing more is read); the sink has
checkpointed what was written, so the next launch resumes each part from the
state table. Used on Dataflow; the local runner keeps the threaded reader
(FnApiRunner reads the elements of an SDF one after another, the threads read
a task's Scan segments and S3 export parts in parallel, a local export's parts
one after another, beside the writer).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import apache_beam as beam
from apache_beam.transforms.core import RestrictionProvider

from ddb2bt.pipeline.cutover.backfill import EXPORT, SCAN, BackfillJob, PartReaders, BackfillReaderFn
from ddb2bt.pipeline.source.snapshot import ScanSource
from ddb2bt.pipeline.source.restriction import CheckpointOnlyTracker
from ddb2bt.pipeline.source.records import FLUSH, batch_records
from ddb2bt.transforms.model import BackfillPosition, PartDone

__all__ = ["BackfillPart", "PartRestriction", "PartTracker", "ReadBackfillParts", "CHECKPOINT_S"]

# A bundle reads for at most this long, then the reader checkpoints itself: a
# drain or an update waits at most about this long for the backfill (plus the
# sink's flush), and Dataflow sees steady progress instead of one hours-long item.
CHECKPOINT_S = 30.0


@dataclass(frozen=True)
class BackfillPart:
    """One Scan segment or export data file: one element of the splittable read."""

    kind: str  # SCAN | EXPORT
    name: str


@dataclass(frozen=True)
class PartRestriction:
    """What is left of a part: read on after ``resume`` (a key token or a line
    number; None: from the start), ``count`` items before it. ``loaded``: the
    state table's progress was taken into account; ``done``: nothing is left."""

    resume: Optional[str] = None
    count: int = 0
    loaded: bool = False
    done: bool = False


@dataclass(frozen=True)
class ResumeFrom:
    """Claim: the part's stored progress (taken once, at the first call)."""

    resume: Optional[str]
    count: int


def apply_part_claim(r: PartRestriction, claim) -> PartRestriction:
    if isinstance(claim, BackfillPosition):
        return PartRestriction(claim.resume, claim.count, True, False)
    if isinstance(claim, PartDone):
        return PartRestriction(r.resume, claim.count, True, True)
    if isinstance(claim, ResumeFrom):
        return PartRestriction(claim.resume, claim.count, True, False)
    raise TypeError(f"unknown claim {claim!r}")


class PartTracker(CheckpointOnlyTracker):
    """Tracks a PartRestriction: claims move it on, a checkpoint split ends the
    primary at the last claim and hands the rest on as the residual (only
    checkpoints: see the module docstring for why not more)."""

    what = "backfill part"

    def __init__(self, restriction: PartRestriction) -> None:
        super().__init__(restriction, apply_part_claim)

    def completed(self) -> float:
        return self._r.count


class PartRestrictionProvider(RestrictionProvider):
    def initial_restriction(self, element: BackfillPart) -> PartRestriction:
        return PartRestriction()

    def create_tracker(self, restriction: PartRestriction) -> PartTracker:
        return PartTracker(restriction)

    def restriction_size(self, element, restriction) -> int:
        return 0 if restriction.done else 1

    def split(self, element, restriction):
        yield restriction  # a part is the unit of parallelism (no initial split)

    def truncate(self, element, restriction):
        # Dataflow drain: read no more. What was written is checkpointed by the
        # sink; the next launch resumes the part from the state table.
        return None


class _ReadBackfillPartsFn(BackfillReaderFn):
    """BackfillPart → RecordBatch | PartDone, splittable (module docstring)."""

    def __init__(self, job: BackfillJob, state_factory: Callable, client_factory: Optional[Callable] = None,
                 checkpoint_s: float = CHECKPOINT_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(job, state_factory, client_factory)
        self._checkpoint_s = checkpoint_s
        self._clock = clock

    def process(self, part: BackfillPart,
                tracker=beam.DoFn.RestrictionParam(PartRestrictionProvider())):
        r = tracker.current_restriction()
        if r.done:
            return
        if not r.loaded:  # the first call: go on from where an earlier job's sink got
            ckpt = self._state.load_backfill_progress(part.kind).get((part.kind, part.name))
            if ckpt is not None and ckpt.done:
                tracker.try_claim(PartDone(part.kind, part.name, ckpt.count))
                return
            if not tracker.try_claim(ResumeFrom(ckpt.resume if ckpt else None, ckpt.count if ckpt else 0)):
                return
            r = tracker.current_restriction()
        yield from batch_records(self._claimed(part, r, tracker))

    def _claimed(self, part: BackfillPart, r: PartRestriction, tracker):
        """The part's records from ``r`` on, each claimed before it is handed on;
        stops at a refused claim (a split) or, after ``checkpoint_s``, by
        deferring the rest to a later call (self-checkpoint)."""
        retry = {"retry": self._job.scan_retry} if self._job.scan_retry is not None else {}
        counter = self._metrics.backfill_items.labels(part.kind)
        readers = PartReaders(self._job.source, self._job.key_attributes, self._job.handoff_ms, self._client,
                              self._bucket, on_items=counter.inc, metrics_table=self._metrics.table,
                              between_attempts=self._coordinator.check_held, **retry)
        started = self._clock()
        for chunk in readers.read_chunks(part.name, r.resume, r.count):
            for element in chunk:
                claim = element if isinstance(element, PartDone) else element.position
                if not tracker.try_claim(claim):
                    return
                yield element
            yield FLUSH
            if tracker.current_restriction().done:
                return
            if self._clock() - started >= self._checkpoint_s:
                tracker.defer_remainder()
                return


class ReadBackfillParts(beam.PTransform):
    """Read a backfill's parts with the splittable reader: parts → RecordBatch |
    PartDone. ``reshuffle`` spreads the parts over workers first."""

    def __init__(self, job: BackfillJob, state_factory: Callable, client_factory: Optional[Callable] = None,
                 reshuffle: bool = True, checkpoint_s: float = CHECKPOINT_S) -> None:
        super().__init__()
        self._job, self._state_factory, self._client_factory = job, state_factory, client_factory
        self._reshuffle, self._checkpoint_s = reshuffle, checkpoint_s

    def expand(self, pbegin):
        from ddb2bt.transforms.model import StreamElement

        kind = SCAN if isinstance(self._job.source, ScanSource) else EXPORT
        parts = [BackfillPart(kind, name) for name in self._job.source.parts()]
        pcoll = pbegin | "BackfillParts" >> beam.Create(parts)
        if self._reshuffle:
            pcoll = pcoll | "SpreadParts" >> beam.Reshuffle()
        return pcoll | "ReadParts" >> beam.ParDo(_ReadBackfillPartsFn(
            self._job, self._state_factory, self._client_factory, self._checkpoint_s)).with_output_types(
            StreamElement)
