"""The backfill's splittable read (pipeline/cutover/backfill_sdf.py, issue 22):
a part split and resumed from its checkpoint in the middle of an export file and
of a Scan segment, every item read once; on the FnApiRunner, a reader that
checkpoints itself after every chunk still emits every item exactly once and
resumes each time right after the last item it emitted."""
from __future__ import annotations

import json
from dataclasses import dataclass

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that, equal_to

from ddb2bt.pipeline.cutover.backfill import BackfillJob
from ddb2bt.pipeline.source.snapshot import ExportSource, ScanSource, segment_name
from ddb2bt.pipeline.cutover.backfill_sdf import (BackfillPart, PartRestriction, PartTracker,
                                                  _ReadBackfillPartsFn)
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.control.state import BackfillCheckpoint, StateStore
from ddb2bt.pipeline.testing.fakes import FAKE_CLIENTS, InMemoryBigtable, RegisteredClient
from ddb2bt.transforms.model import BackfillPosition, PartDone, RecordBatch

from tests.unit.cutover.test_backfill import HANDOFF, FakeScan, write_export

SEGMENT = segment_name(0, 1)
FILE = "data/a.json.gz"
CALLS: list = []  # (resume, count) at each call of the splittable reader (FnApiRunner test)


class Runner:
    """What the runner does around one call: a tracker, a checkpoint split after
    ``split_after`` claims (as a drain or an update would ask), the residual."""

    def __init__(self, restriction: PartRestriction, split_after=None) -> None:
        self.tracker = PartTracker(restriction)
        self.split_after = split_after
        self.claims = 0
        self.deferred = False

    def current_restriction(self):
        return self.tracker.current_restriction()

    def try_claim(self, claim) -> bool:
        if self.split_after is not None and self.claims == self.split_after:
            self.residual = self.tracker.try_split(0)[1]  # the runner's checkpoint, mid-part
        ok = self.tracker.try_claim(claim)
        self.claims += ok
        return ok

    def defer_remainder(self) -> None:
        self.deferred = True


def call(fn, part, runner) -> list:
    """One process() call: the records it emitted, in order, and any PartDone."""
    out = []
    for element in fn.process(part, runner):
        out.extend(element.records if isinstance(element, RecordBatch) else [element])
    if runner.deferred:  # a self-checkpoint: the SDK splits at once after the call
        runner.residual = runner.tracker.try_split(0)[1]
    return out


def make_fn(source, state=None, client=None, checkpoint_s=1e9):
    state = state or StateStore(InMemoryBigtable(), "job", lambda: 1)
    fn = _ReadBackfillPartsFn(BackfillJob(source, ("pk",), HANDOFF, scan_retry=RetryPolicy(0.001, 0.001, 1.0)),
                              lambda: state, (lambda: client) if client is not None else None, checkpoint_s)
    fn.setup()
    return fn, state


def keys(elements) -> list:
    return [e.keys["pk"]["S"] for e in elements if not isinstance(e, PartDone)]


def test_a_scan_segment_split_mid_page_resumes_right_after_the_last_emitted_item():
    scan = FakeScan(25, page=10)
    fn, _ = make_fn(ScanSource("T", 1, page_limit=10), client=scan)
    part = BackfillPart("scan", SEGMENT)
    first = Runner(PartRestriction(), split_after=1 + 13)  # the ResumeFrom claim, then 13 items
    got = call(fn, part, first)
    assert keys(got) == [f"k{i:03d}" for i in range(13)]
    assert first.tracker.current_restriction().done  # the primary ends at the last claim
    residual = first.residual
    assert residual.count == 13 and json.loads(residual.resume) == {"pk": {"S": "k012"}}
    scans_before = len(scan.calls)
    rest = call(fn, part, Runner(residual))
    assert keys(rest) == [f"k{i:03d}" for i in range(13, 25)]  # every item once
    assert isinstance(rest[-1], PartDone) and rest[-1].count == 25
    # the resumed scan starts at the split's key: nothing before it is read again
    assert scan.calls[scans_before]["ExclusiveStartKey"] == {"pk": {"S": "k012"}}


def test_an_export_file_split_mid_file_resumes_at_the_next_line(tmp_path):
    write_export(tmp_path, [json.dumps({"Item": {"pk": {"S": f"k{i:03d}"}}}) for i in range(9)])
    fn, _ = make_fn(ExportSource(str(tmp_path)))
    part = BackfillPart("export", FILE)
    first = Runner(PartRestriction(), split_after=1 + 4)
    assert keys(call(fn, part, first)) == [f"k{i:03d}" for i in range(4)]
    assert first.residual == PartRestriction("4", 4, loaded=True)  # by position: after line 4
    second = Runner(first.residual, split_after=3)
    assert keys(call(fn, part, second)) == ["k004", "k005", "k006"]
    rest = call(fn, part, Runner(second.residual))
    assert keys(rest) == ["k007", "k008"] and rest[-1] == PartDone("export", FILE, 9)


def test_the_first_call_resumes_from_the_state_tables_progress_and_a_done_part_reads_nothing(tmp_path):
    write_export(tmp_path, [json.dumps({"Item": {"pk": {"S": f"k{i:03d}"}}}) for i in range(5)])
    state = StateStore(InMemoryBigtable(), "job", lambda: 1)
    state.save_backfill_progress([BackfillCheckpoint("export", FILE, "3", 3)])
    fn, _ = make_fn(ExportSource(str(tmp_path)), state)
    assert keys(call(fn, BackfillPart("export", FILE), Runner(PartRestriction()))) == ["k003", "k004"]
    state.save_backfill_progress([BackfillCheckpoint("export", FILE, "5", 5, done=True)])
    runner = Runner(PartRestriction())
    assert call(fn, BackfillPart("export", FILE), runner) == []
    assert runner.tracker.current_restriction().done


def test_only_checkpoint_splits_are_accepted():
    tracker = PartTracker(PartRestriction("k", 3, loaded=True))
    assert tracker.try_split(0.5) is None  # one resume position per part: no fractional split
    primary, residual = tracker.try_split(0)
    assert primary.done and residual == PartRestriction("k", 3, loaded=True)
    assert not tracker.try_claim(BackfillPosition("scan", SEGMENT, "x", 4))  # the primary is closed
    assert tracker.try_split(0) is None


@dataclass(frozen=True)
class RegisteredState:
    name: str

    def __call__(self):
        return StateStore(FAKE_CLIENTS[self.name], "job", lambda: 1)


class _CountingFn(_ReadBackfillPartsFn):
    def _claimed(self, part, r, tracker):
        CALLS.append((r.resume, r.count))
        yield from super()._claimed(part, r, tracker)


def test_on_the_fnapi_runner_the_reader_checkpoints_itself_and_resumes_without_rereading():
    CALLS.clear()
    scan = FAKE_CLIENTS["sdf-scan"] = FakeScan(45, page=10)
    FAKE_CLIENTS["sdf-state"] = InMemoryBigtable()
    job = BackfillJob(ScanSource("T", 1, page_limit=10), ("pk",), HANDOFF, scan_retry=RetryPolicy(0.001, 0.001, 1.0))
    try:
        options = PipelineOptions(["--runner=FnApiRunner", "--direct_num_workers=1"])
        with beam.Pipeline(options=options) as p:
            read = (p | beam.Create([BackfillPart("scan", SEGMENT)])
                    | beam.ParDo(_CountingFn(job, RegisteredState("sdf-state"), RegisteredClient("sdf-scan"),
                                             checkpoint_s=0.0)))  # checkpoint after every chunk
            got = read | beam.FlatMap(lambda e: [r.keys["pk"]["S"] for r in e.records]
                                      if isinstance(e, RecordBatch) else [])
            assert_that(got, equal_to([f"k{i:03d}" for i in range(45)]))  # each item exactly once
    finally:
        del FAKE_CLIENTS["sdf-scan"], FAKE_CLIENTS["sdf-state"]
    # one call per 10-item page: the reader deferred its remainder after each one
    # (the last call finds the segment's end after the 45th item and emits PartDone)
    assert [count for _, count in CALLS] == [0, 10, 20, 30, 40, 45]
    # each call resumed right after the last item the previous one emitted ...
    resumed = [json.loads(resume)["pk"]["S"] if resume else None for resume, _ in CALLS]
    assert resumed == [None, "k009", "k019", "k029", "k039", "k044"]
    # ... and the service was asked for each item once
    starts = [c.get("ExclusiveStartKey", {}).get("pk", {}).get("S") for c in scan.calls]
    assert starts == resumed
    assert sum(len(scan.items[[i["pk"]["S"] for i in scan.items].index(s) + 1 if s else 0:][:10])
               for s in starts) == 45


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_fractional_splits_are_refused_in_the_middle_of_a_part_too(fraction):
    tracker = PartTracker(PartRestriction())
    tracker.try_claim(BackfillPosition("export", FILE, "1", 1))
    assert tracker.try_split(fraction) is None and not tracker.current_restriction().done
