"""The boundary sweep with versioned cells (docs/design.md §8.1.1): cases an
independent review found, kept as tests."""
from __future__ import annotations

from ddb2bt.pipeline.source.exports import ExportManifest
from ddb2bt.pipeline.control.phases import Migration
from ddb2bt.pipeline.recover.recover import (ExportChange, Gap, IncrementalExport, Recovery, Window,
                                             _backfill_inside_the_sweep, check_coverage, plan_windows)
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.sink.sink import BatchingWriter, SinkConfig
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.mapping import map_change
from ddb2bt.transforms.model import INSERT, ChangeRecord, MappedChange
from tests.unit.cutover.cutover_common import item

FAST = SinkConfig(retry=RetryPolicy(0.001, 0.001, 1.0), overlap_writes=False)
STREAM = "arn:aws:dynamodb:us-east-1:000000000000:table/T/stream/2024-01-01T00:00:00.000"
S = 1_700_000_000  # seconds


def world(mapping):
    bt = InMemoryBigtable(families={mapping.target.table: set(mapping.family_names)})
    wall = [S * 1000]
    store = StateStore(bt, "job", lambda: wall[0])
    tail = BatchingWriter(bt, None, FAST, sleep=lambda s: None, versions=store.versions())
    return bt, store, tail, wall


def apply(mapping, tail, rec):
    for ch in map_change(mapping, rec):
        tail.add(MappedChange(rec, (ch,)))
    assert not list(tail.flush() or ())


def exp(loc, a, b, n):
    m = ExportManifest("INCREMENTAL_EXPORT", "DYNAMODB_JSON", "arn:aws:dynamodb:us-east-1:1:table/T", None, n)
    return IncrementalExport(loc, m, a * 1000, b * 1000, "NEW_AND_OLD_IMAGES", (("data/a.json.gz", n),))


def recover(mapping, store, windows_lines, gap):
    exports, lines = [], {}
    for i, ((a, b), ls) in enumerate(windows_lines):
        loc = f"mem://e{i}"
        lines[loc] = ls
        exports.append(exp(loc, a, b, len(ls)))
    check_coverage(exports, gap)
    return exports, lines


VIDEOS = load_mapping("examples/videos.yaml")


def test_a_version_freed_by_a_lost_delete_is_free_before_a_line_takes_it():
    """Comment X (version v) is inserted (applied, the shard's stop C) and deleted,
    then comment Y of the same video takes the same version (both lost, same
    second as C: inside the window before the boundary). A job that never stopped
    ends with Y's comment at v. The recovery applies Y's line before the sweep
    released X's stale claim would be refused (version_clash): the sweep
    releases versions before any window is applied."""
    bt, store, tail, wall = world(VIDEOS)
    t = (S + 500) * 1000  # C, whole second
    kx = item(pk="0123", sk="VideoComment#1")
    ky = item(pk="0123", sk="VideoComment#2")
    x = item(pk="0123", sk="VideoComment#1", Content="x", CreatedAt="2023-09-10T00:00:01")
    y = item(pk="0123", sk="VideoComment#2", Content="y", CreatedAt="2023-09-10T00:00:01")
    wall[0] = t
    apply(VIDEOS, tail, ChangeRecord(INSERT, kx, x, None, t))  # applied: the stop
    # lost, same second: REMOVE x, INSERT y
    B = t // 1000 + 1
    gap = Gap(first_ms=t, last_ms=t, end_ms=t + 1000, trimmed_shards=("s0",), stream_arn=STREAM, applied_ms=t)
    assert gap.boundary_s == B
    w1 = (B - 900, B)
    w2 = (B, B + 900)
    # X inserted and deleted inside w1: AWS leaves it out. Y: created in w1.
    lines1 = [ExportChange(ky, y, None, t * 1000 + 5)]
    lookback = (B - 1800, B - 900)  # the window before the swept one (check_coverage)
    exports, lines = recover(VIDEOS, store, [(lookback, []), (w1, lines1), (w2, [])], gap)
    wall[0] = (B + 2000) * 1000
    batcher = BatchingWriter(bt, None, FAST, sleep=lambda s: None, versions=store.versions())
    migration = Migration(store, now_ms=lambda: wall[0], sleep=lambda s: None)
    result = Recovery(VIDEOS, store, batcher, migration, read=lambda e, rel: iter(lines[e.location])).run(gap, exports)
    row = bt.versions(VIDEOS.target.table).get(b"0123", {})
    # What a job that never stopped holds: Y's comment at its version.
    assert result.dead_letters == 0
    assert row.get(("comments", b"UserComments")), row


def test_a_dead_lettered_last_line_keeps_the_versions_a_running_job_keeps():
    """A comment whose last image cannot be mapped (CreatedAt removed) is
    dead-lettered, not applied: a running job keeps its version, and so does
    the sweep."""
    bt, store, tail, wall = world(VIDEOS)
    kx = item(pk="0123", sk="VideoComment#1")
    x = item(pk="0123", sk="VideoComment#1", Content="x", CreatedAt="2023-09-10T00:00:01")
    t1 = (S + 500) * 1000
    apply(VIDEOS, tail, ChangeRecord(INSERT, kx, x, None, t1))  # claim at t1 >= lo
    B = t1 // 1000 + 1
    gap = Gap(first_ms=t1, last_ms=t1, end_ms=t1 + 1000, trimmed_shards=("s0",), stream_arn=STREAM, applied_ms=t1)
    broken = item(pk="0123", sk="VideoComment#1", Content="x2")  # no CreatedAt: MappingError (timestamp)
    lines1 = [ExportChange(kx, x, None, t1 * 1000 + 3)]
    lines2 = [ExportChange(kx, broken, x, (B + 10) * 1_000_000)]  # lost, after the boundary
    exports, lines = recover(VIDEOS, store, [((S - 900, S), []), ((S, B), lines1), ((B, B + 900), lines2)], gap)
    wall[0] = (B + 2000) * 1000
    batcher = BatchingWriter(bt, None, FAST, sleep=lambda s: None, versions=store.versions())
    migration = Migration(store, now_ms=lambda: wall[0], sleep=lambda s: None)
    result = Recovery(VIDEOS, store, batcher, migration, read=lambda e, rel: iter(lines[e.location])).run(gap, exports)
    row = bt.versions(VIDEOS.target.table).get(b"0123", {})
    assert row.get(("comments", b"UserComments")), "the version a running job keeps was deleted"


def test_a_backfill_handoff_inside_wider_exports_than_planned_is_named():
    """Any abutting windows covering the gap are accepted: a first window wider
    than the plan's widens what the sweep reads, and the handoff check follows it."""
    t1 = (S + 86_000) * 1000
    gap = Gap(first_ms=t1, last_ms=t1, end_ms=t1 + 1000, trimmed_shards=("s0",), stream_arn=STREAM, applied_ms=t1)
    b = gap.boundary_s
    handoff = (b - 7200) * 1000 + 300  # 2 h before the boundary: outside the planned 15 min window
    given = [exp("l", b - 86_900, b - 86_000, 0), exp("a", b - 86_000, b, 0), exp("b", b, b + 3600, 0)]
    check_coverage(given, gap)
    assert _backfill_inside_the_sweep(handoff, gap, plan_windows(gap, (b + 10_000) * 1000)) == []
    (why,) = _backfill_inside_the_sweep(handoff, gap, [Window(e.from_ms // 1000, e.to_ms // 1000) for e in given])
    assert "handoff" in why
