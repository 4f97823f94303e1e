"""The recovery's plan (recover/recover.py): which shards are trimmed and what is
missing, read from the (fake) stream; the export windows that cover it."""
from __future__ import annotations

import pytest

from ddb2bt.pipeline.recover.recover import (END_OVERLAP_S, LATEST_RESTORABLE_LAG_S, MAX_WINDOW_S, MIN_WINDOW_S,
                                             Gap, export_commands, find_gap, plan_windows)
from ddb2bt.pipeline.control.state import RESUME_AT_TRIM_HORIZON, ShardCheckpoint
from ddb2bt.pipeline.testing.fakes import FakeStreamsClient

HOUR_MS = 3_600_000
T0 = 1_700_000_000_000


def put(client, shard, n, ms):
    keys = {"pk": {"S": f"k{n}"}}
    return client.put(shard, "INSERT", keys, {**keys, "n": {"N": str(n)}}, None, created_ms=ms)


def test_find_gap_names_the_trimmed_shards_the_last_applied_changes_and_the_oldest_held_record():
    client = FakeStreamsClient(table="T")
    for shard in ("busy", "lagging", "intact", "gone"):
        client.add_shard(shard)
    busy = [put(client, "busy", i, T0 + i * HOUR_MS) for i in range(40)]
    lagging = [put(client, "lagging", i, T0 + i * HOUR_MS + 500) for i in range(40)]
    intact = [put(client, "intact", i, T0 + 30 * HOUR_MS + i) for i in range(3)]
    gone = [put(client, "gone", 0, T0)]
    client.shards["busy"].trimmed_before = 20
    client.shards["lagging"].trimmed_before = 21
    client.shards["gone"].listed = False  # aged out with a change after its checkpoint unread
    checkpoints = {
        "busy": ShardCheckpoint(client.stream_arn, "busy", busy[5], change_ms=T0 + 5 * HOUR_MS),
        "lagging": ShardCheckpoint(client.stream_arn, "lagging", lagging[3], change_ms=T0 + 3 * HOUR_MS + 500),
        "intact": ShardCheckpoint(client.stream_arn, "intact", intact[0], change_ms=T0 + 30 * HOUR_MS),
        "gone": ShardCheckpoint(client.stream_arn, "gone", gone[0], change_ms=T0 - HOUR_MS),
        "done": ShardCheckpoint(client.stream_arn, "done", "1", finished=True),
        "recovered": ShardCheckpoint(client.stream_arn, "recovered", RESUME_AT_TRIM_HORIZON),
    }
    gap = find_gap(client, client.stream_arn, checkpoints, now_ms=T0 + 45 * HOUR_MS)
    assert gap.trimmed_shards == ("busy", "gone", "lagging")
    assert (gap.first_ms, gap.last_ms) == (T0 - HOUR_MS, T0 + 5 * HOUR_MS)
    assert gap.end_ms == T0 + 21 * HOUR_MS + 500  # the latest of the trimmed shards' oldest held records
    assert dict(gap.resume_after) == {"busy": busy[20], "lagging": lagging[21]}
    assert gap.applied_ms == T0 + 30 * HOUR_MS  # the intact shard is ahead: the exports must pass it
    # "lagging" was seen at its head 2 h before: trimmed, nothing lost (docs/design.md §8.2)
    proven = find_gap(client, client.stream_arn, checkpoints, now_ms=T0 + 45 * HOUR_MS,
                      heads={"lagging": T0 + 43 * HOUR_MS, "busy": T0 + 5 * HOUR_MS})
    assert proven.trimmed_shards == ("busy", "gone")
    assert dict(proven.resume_after) == {"busy": busy[20]}


def test_nothing_trimmed_is_no_gap():
    client = FakeStreamsClient(table="T")
    client.add_shard("s")
    seq = put(client, "s", 0, T0)
    assert find_gap(client, client.stream_arn, {"s": ShardCheckpoint(client.stream_arn, "s", seq)}, T0) is None


@pytest.mark.parametrize("hours", [0.1, 3, 30, 50])
def test_the_windows_abut_cross_no_boundary_and_respect_the_published_limits(hours):
    last = T0 + 123_456
    gap = Gap(first_ms=last - 2 * HOUR_MS, last_ms=last, end_ms=last + int(hours * HOUR_MS), trimmed_shards=("s",))
    now = gap.end_ms + 20 * HOUR_MS
    windows = plan_windows(gap, now)
    assert windows[0].from_s <= gap.start_s
    assert all(a.to_s == b.from_s for a, b in zip(windows, windows[1:])), "abutting"
    assert any(w.to_s == gap.boundary_s for w in windows), "a window ends at the second after the last change"
    assert all(MIN_WINDOW_S <= w.to_s - w.from_s <= MAX_WINDOW_S for w in windows)
    assert windows[-1].to_s == max(-(-gap.end_ms // 1000) + END_OVERLAP_S, gap.boundary_s + MIN_WINDOW_S)
    assert windows[-1].to_s <= now // 1000 - LATEST_RESTORABLE_LAG_S
    commands = export_commands(windows, "arn:aws:dynamodb:us-east-1:1:table/T", "bucket", "recover")
    assert len(commands) == len(windows)
    assert (f"--incremental-export-specification ExportFromTime={windows[0].from_s},ExportToTime={windows[0].to_s},"
            "ExportViewType=NEW_AND_OLD_IMAGES") in commands[0]
    assert "--export-type INCREMENTAL_EXPORT" in commands[0] and "--s3-prefix recover" in commands[0]


def test_the_exports_reach_past_every_change_the_job_applied_or_are_refused():
    """An intact shard far ahead of the trimmed ones: the boundary sweep takes an
    item's last image in the exports as its state after every change the job wrote
    (docs/design.md §8.1.1), so the windows end after that change."""
    from ddb2bt.pipeline.source.exports import ExportManifest
    from ddb2bt.pipeline.recover.recover import (RECORD_CLOCK_MARGIN_S, IncrementalExport, RecoveryRefused,
                                                 check_coverage)

    last = T0 + 123_456
    gap = Gap(first_ms=last, last_ms=last, end_ms=last + HOUR_MS, trimmed_shards=("s",), applied_ms=last + 5 * HOUR_MS)
    windows = plan_windows(gap, now_ms=last + 30 * HOUR_MS)
    # past that change by PITR's clock too: its record's second + 1 s + the margin
    assert windows[-1].to_s == (last + 5 * HOUR_MS) // 1000 + 1 + RECORD_CLOCK_MARGIN_S

    def export(w):
        manifest = ExportManifest("INCREMENTAL_EXPORT", "DYNAMODB_JSON", "arn:aws:dynamodb:us-east-1:1:table/T", None, 0)
        return IncrementalExport(f"mem://{w.from_s}", manifest, w.from_s * 1000, w.to_s * 1000, "NEW_AND_OLD_IMAGES", ())

    check_coverage([export(w) for w in windows], gap)
    short = plan_windows(Gap(first_ms=last, last_ms=last, end_ms=last + HOUR_MS, trimmed_shards=("s",)),
                         now_ms=last + 30 * HOUR_MS)
    with pytest.raises(RecoveryRefused) as err:
        check_coverage([export(w) for w in short], gap)
    assert "the job applied changes until" in str(err.value) and "intact" in str(err.value)


def test_the_exports_begin_a_window_before_the_first_swept_one_or_are_refused():
    """A change inside the first swept window may carry a stream record time up to
    SWEEP_LOOKBACK_MS before its start; the sweep judges such a cell against the
    window before it (docs/design.md §8.1.1). The plan asks for a shortest window
    there; exports that begin where the first swept window begins are refused,
    naming the window to add."""
    from ddb2bt.pipeline.source.exports import ExportManifest
    from ddb2bt.pipeline.recover.recover import SWEEP_LOOKBACK_MS, IncrementalExport, RecoveryRefused, check_coverage
    from ddb2bt.pipeline.recover.straddle import swept_windows

    last = T0 + 123_456
    gap = Gap(first_ms=last - 2 * HOUR_MS, last_ms=last, end_ms=last + HOUR_MS, trimmed_shards=("s",))
    windows = plan_windows(gap, now_ms=last + 30 * HOUR_MS)

    def export(w):
        manifest = ExportManifest("INCREMENTAL_EXPORT", "DYNAMODB_JSON", "arn:aws:dynamodb:us-east-1:1:table/T", None, 0)
        return IncrementalExport(f"mem://{w.from_s}", manifest, w.from_s * 1000, w.to_s * 1000, "NEW_AND_OLD_IMAGES", ())

    exports = [export(w) for w in windows]
    (first,) = swept_windows(exports, gap.first_ms, gap.boundary_s * 1000)
    assert exports[0].to_ms == first.from_ms and exports[0].to_ms - exports[0].from_ms == MIN_WINDOW_S * 1000
    assert exports[0].from_ms <= first.from_ms - SWEEP_LOOKBACK_MS
    assert check_coverage(exports, gap) == exports
    with pytest.raises(RecoveryRefused) as err:
        check_coverage(exports[1:], gap)
    message = str(err.value)
    assert "the boundary sweep" in message and "record time" in message, message
    assert (f"ExportFromTime={first.from_ms // 1000 - MIN_WINDOW_S}, ExportToTime={first.from_ms // 1000}"
            in message), message


def test_a_backfill_handoff_inside_the_swept_span_is_named_before_writing():
    from ddb2bt.pipeline.recover.recover import _backfill_inside_the_sweep

    last = T0 + 123_456
    gap = Gap(first_ms=last, last_ms=last, end_ms=last + HOUR_MS, trimmed_shards=("s",))
    windows = plan_windows(gap, now_ms=last + 30 * HOUR_MS)  # the one before the boundary: 15 min
    assert _backfill_inside_the_sweep(None, gap, windows) == []
    assert _backfill_inside_the_sweep(last - 20 * 60_000, gap, windows) == []  # before the swept window
    (why,) = _backfill_inside_the_sweep(last - 5 * 60_000, gap, windows)
    assert "handoff" in why and "verify" in why
    assert _backfill_inside_the_sweep(last + HOUR_MS, gap, windows) == []  # after the boundary: not swept
