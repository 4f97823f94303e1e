"""Thin Beam wrappers around the pure mapping engine."""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterator

import apache_beam as beam

from ddb2bt.transforms.config import MappingConfig
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.mapping import map_change
from ddb2bt.transforms.model import (ChangeRecord, DeadLetter, MappedBatch, MappedChange, RecordBatch, StreamElement,
                                     build_mapped_change, stream_of)
from ddb2bt.transforms.ordering import guarded_rows
from ddb2bt.transforms.rowwriter import NATIVE, NATIVE_BUILT, ROW_WRITER_ENV

log = logging.getLogger(__name__)

__all__ = ["map_record", "map_record_guarded", "PerStreamFn", "map_changes", "map_changes_per_stream"]


def map_record(mapping: MappingConfig, record: ChangeRecord, now_ms: Callable[[], int],
               mark_touched: bool = False) -> MappedChange:
    """ChangeRecord → MappedChange; a record that cannot be mapped becomes a dead
    letter (whole, so nothing is half-applied) instead of an exception."""
    try:
        # MappedChange(record, rows, dead_letter=None), its slots filled directly (once per change)
        return _mapped_change(record, map_change(mapping, record, mark_touched), None)
    except MappingError as exc:
        return MappedChange(
            record=record,
            dead_letter=DeadLetter(
                reason=exc.reason,
                error_class=type(exc).__name__,
                message=exc.message,
                stage="map",
                record=record,
                failed_at_ms=now_ms(),
            ),
        )


def map_record_guarded(mapping: MappingConfig, record: ChangeRecord, now_ms: Callable[[], int]) -> MappedChange:
    """Like ``map_record``, for a source that may deliver out of order (Kinesis):
    the rows are ``ordering.GuardedRow`` states for the ordering guard
    (docs/design.md §10), not diffs."""
    try:
        return MappedChange(record=record, rows=guarded_rows(mapping, record))
    except MappingError as exc:
        return MappedChange(record=record, dead_letter=DeadLetter(
            reason=exc.reason, error_class=type(exc).__name__, message=exc.message, stage="map", record=record,
            failed_at_ms=now_ms()))


_mapped_change = build_mapped_change


_TOLD: list = []  # whether this process said which row writer it runs


def _say_row_writer() -> None:
    """Once per process: which writer writes the mapping's plain rows
    (transforms/rowwriter.py). Without the C one a change costs several
    microseconds more CPU, which an operator sizing workers should hear of."""
    if _TOLD:
        return
    _TOLD.append(True)
    if NATIVE:
        log.debug("mapping: plain rows written by the C row writer")
    elif NATIVE_BUILT:
        log.info("mapping: the C module is off (%s=python): plain rows, and a Kinesis source's ordering guard, "
                 "encoded by the Python references", ROW_WRITER_ENV)
    else:
        log.warning("mapping: the C row writer is not built (no C compiler when ddb2bt was installed): the "
                    "generated Python writes every row, the same bytes at ~8 us more CPU a change (and a Kinesis "
                    "source's ordering guard ~15 % more); install "
                    "build-essential and python3-dev, then reinstall ddb2bt")


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class _MapChangesFn(beam.DoFn):
    """ChangeRecord → MappedChange, RecordBatch → MappedBatch; other elements
    (shard markers) pass through in order, because the sink needs them in stream
    order to checkpoint correctly.

    ``marking``: an object with ``setup()`` and ``active() -> bool`` telling whether
    a backfill is running (then tail changes carry touch markers); None: never."""

    def __init__(self, mapping: MappingConfig, now_ms: Callable[[], int] = _wall_ms, marking=None) -> None:
        self._mapping = mapping
        self._now_ms = now_ms
        self._marking = marking
        # A Kinesis source delivers out of order: its changes go to the ordering
        # guard as states (no touch markers: the guard orders the backfill too).
        self._guarded = mapping.source.kinesis is not None

    def setup(self) -> None:
        _say_row_writer()
        if self._marking is not None:
            self._marking.setup()

    def process(self, element) -> Iterator:
        if self._guarded and type(element) in (RecordBatch, ChangeRecord):
            records = element.records if type(element) is RecordBatch else (element,)
            mapped = tuple(map_record_guarded(self._mapping, r, self._now_ms) for r in records)
            yield MappedBatch(mapped) if type(element) is RecordBatch else mapped[0]
        elif type(element) is RecordBatch:
            mark = self._marking is not None and self._marking.active()
            mapping, now_ms = self._mapping, self._now_ms
            yield MappedBatch(tuple(map_record(mapping, r, now_ms, mark and r.backfill_since_ms is None)
                                    for r in element.records))
        elif isinstance(element, ChangeRecord):
            mark = self._marking is not None and element.backfill_since_ms is None and self._marking.active()
            yield map_record(self._mapping, element, self._now_ms, mark)
        else:
            yield element


class PerStreamFn(beam.DoFn):
    """Routes every element to its own table's DoFn by the stream it came from
    (``stream_of``): a multi-table job maps and writes all its tables in one
    fused stage, so nothing is shuffled and each stream's elements keep their
    order (docs/design.md §4.3). Each inner DoFn keeps its own state: batches,
    checkpoints, dead letters, lease. Public: the mapping stage and the sink
    both route through it."""

    def __init__(self, fns: dict) -> None:
        self._fns = dict(fns)

    def setup(self) -> None:
        for fn in self._fns.values():
            fn.setup()

    def start_bundle(self) -> None:
        for fn in self._fns.values():
            fn.start_bundle()

    def process(self, element):
        out = self._fns[stream_of(element)].process(element)
        if out is not None:
            yield from out

    def finish_bundle(self):
        for fn in self._fns.values():
            out = fn.finish_bundle()
            if out is not None:
                yield from out

    def teardown(self) -> None:
        for fn in self._fns.values():
            fn.teardown()


# The stages' public transforms are the ParDo itself, not a composite around it:
# a composite would add a level to every step name, and Dataflow updates a
# running job in place by step name (docs/operations.md, runners).
def map_changes(mapping: MappingConfig, *, marking=None) -> beam.ParDo:
    """The mapping stage: ``RecordBatch | ShardClosed`` → ``MappedBatch |
    ShardClosed`` in order (``marking``: see ``_MapChangesFn``)."""
    return beam.ParDo(_MapChangesFn(mapping, marking=marking)).with_output_types(StreamElement)


def map_changes_per_stream(per_stream: dict) -> beam.ParDo:
    """The mapping stage of a multi-table job: ``{stream ARN: (mapping,
    marking)}``, each stream's changes mapped by its own table's mapping."""
    return beam.ParDo(PerStreamFn({arn: _MapChangesFn(mapping, marking=marking)
                                   for arn, (mapping, marking) in per_stream.items()})).with_output_types(StreamElement)
