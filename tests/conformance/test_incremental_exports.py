"""DynamoDB incremental exports in the published layout (tests/conformance/incremental/,
written by make_incremental_fixtures.py): AWSDynamoDB/<ExportId>/ with _started,
manifest-summary.json (exportType INCREMENTAL_EXPORT, exportFromTime, exportToTime,
outputView), manifest-files.json, and gzipped DYNAMODB_JSON data files in the
shared AWSDynamoDB/data/ folder, each line {Metadata: {WriteTimestampMicros},
Keys, NewImage?, OldImage?}. Two abutting windows (a modify with an attribute and
a set member removed, a deletion, an item changed in both windows, a re-insert of
the deleted key, an empty partition) recover the target to the mapping of the
final items; every export a recovery cannot use is refused, naming why, before
anything is written."""
from __future__ import annotations

import datetime as dt

import pytest
from prometheus_client import CollectorRegistry

from ddb2bt.pipeline.verify.compare import expected_layout
from ddb2bt.pipeline.control.phases import LIVE, RECOVERING, Migration
from ddb2bt.pipeline.recover.recover import (Gap, Recovery, RecoveryRefused, check_coverage, check_pitr,
                                             inexact_features, open_export, read_changes)
from ddb2bt.pipeline.observe.metrics import PipelineMetrics
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.sink.sink import BatchingWriter, SinkConfig
from ddb2bt.pipeline.control.state import RESUME_AT_TRIM_HORIZON, StateStore
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.attrs import item_from_dynamodb_json
from ddb2bt.transforms.errors import ConfigError
from ddb2bt.transforms.mapping import map_change
from ddb2bt.transforms.model import INSERT, ChangeRecord, MappedChange
from tests.conformance.harness import HERE, mapping

INCREMENTAL = HERE / "incremental"
STREAM = "arn:aws:dynamodb:us-east-1:123456789012:table/Catalog/stream/2023-01-01T00:00:00.000"
NOW_MS = 1_700_100_000_000  # when the recovery runs (the state table's cells need a real time)
FAST = SinkConfig(retry=RetryPolicy(0.001, 0.001, 1.0))
W1_FROM, BOUNDARY, W2_TO = 1699992000, 1699999200, 1700006400  # 20:00, 22:00, 00:00 UTC
# The job applied its last change in the second before 22:00; the stream's oldest
# record is at 23:30 (its checkpoint's successors are trimmed).
GAP = Gap(first_ms=(BOUNDARY - 1) * 1000 + 250, last_ms=(BOUNDARY - 1) * 1000 + 250, end_ms=1700004600_000,
          trimmed_shards=("shardId-1",), stream_arn=STREAM)


def exports_of(name: str) -> list:
    return sorted((INCREMENTAL / name / "AWSDynamoDB").glob("0*"))


def recovered_exports() -> list:
    """The two windows and the empty one before them: window 1 holds the job's
    last applied change, and the boundary sweep judges what is stamped just
    before it against the window before (docs/design.md §8.1.1)."""
    return [open_export(str(p), "Catalog", "us-east-1") for p in exports_of("lookback") + exports_of("two_windows")]


def S(v):
    return {"S": v}


def N(v):
    return {"N": str(v)}


def img(pk, sk, **attrs):
    return item_from_dynamodb_json({"pk": S(pk), "sk": S(sk), **attrs})


# The table at 20:00 (every window-1 OldImage) and at 00:00 (every last NewImage).
BEFORE = [img("hats", "fedora#1", Count=N(2), Label=S("x"), Tags={"SS": ["felt", "wool"]}),
          img("shoes", "b", Count=N(7), Label=S("boot")),
          img("hats", "beret", Count=N(0))]
AFTER = [img("hats", "fedora#1", Count=N(3), Tags={"SS": ["felt"]}),
         img("hats", "beret", Count=N(2), Attrs={"M": {"size": N(56)}}),
         img("shoes", "b", Count=N(8))]


def test_the_published_layout_is_read_as_published():
    first, second = (open_export(str(p), "Catalog", "us-east-1") for p in exports_of("two_windows"))
    assert (first.from_ms, first.to_ms, second.from_ms, second.to_ms) == (
        W1_FROM * 1000, BOUNDARY * 1000, BOUNDARY * 1000, W2_TO * 1000)
    assert first.view == "NEW_AND_OLD_IMAGES" and first.manifest.item_count == 3
    # data files live in the shared AWSDynamoDB/data/ folder; an empty partition is an empty file
    assert [rel for rel, _ in first.files] == ["data/a1b2c3d4e5f6a7b8c9d0e1f2a3.json.gz",
                                              "data/b1c2d3e4f5a6b7c8d9e0f1a2b3.json.gz"]
    lines = list(read_changes(first, first.files[0][0]))
    deleted = [c for c in lines if c.new_image is None]
    assert len(lines) == 3 and len(deleted) == 1 and deleted[0].old_image["Label"] == {"S": "boot"}
    assert lines[0].write_us == 1699995600123456  # {"N": "..."} as AWS writes it
    assert list(read_changes(first, first.files[1][0])) == []


def test_two_windows_recover_the_target_to_the_final_items():
    config = mapping("catalog_ttl_apply.yaml")
    table = config.target.table
    bt = InMemoryBigtable(families={table: set(config.family_names)})
    store = StateStore(bt, config.name, lambda: NOW_MS)
    # What the job had applied before it stopped: the items as they were at 20:00.
    seed = BatchingWriter(bt, None, FAST, sleep=lambda s: None)
    for item in BEFORE:
        rec = ChangeRecord(INSERT, {k: item[k] for k in ("pk", "sk")}, item, None, (W1_FROM - 3600) * 1000)
        seed.add(MappedChange(rec, map_change(config, rec)))
    seed.flush()
    exports = recovered_exports()
    migration = Migration(store, now_ms=lambda: NOW_MS, sleep=lambda s: None)
    seen = []
    registry = CollectorRegistry()
    metrics = PipelineMetrics(registry).for_table(config.name)
    recovery = Recovery(config, store, BatchingWriter(bt, None, FAST, sleep=lambda s: None), migration,
                        progress=lambda done, total: seen.append((done, total)), metrics=metrics)
    result = recovery.run(GAP, exports)
    assert migration.phase == RECOVERING
    assert registry.get_sample_value("ddb2bt_recovered_items_total", {"table": config.name}) == 5
    assert (result.files, result.items, result.dead_letters) == (4, 5, 0)
    assert seen[-1] == (4, 4)
    recovery.resume_tail(GAP)
    assert migration.phase == LIVE
    assert store.load_checkpoints(STREAM)["shardId-1"].sequence_number == RESUME_AT_TRIM_HORIZON

    expected = expected_layout(config, AFTER)[table]
    have = bt.versions(table)
    assert set(have) == set(expected)  # nothing resurrected, nothing missing
    for row, cols in expected.items():
        assert set(have[row]) == set(cols), row  # Label and the "wool" member are gone
        for col, want in cols.items():
            assert have[row][col][max(have[row][col])] == want.value
    # each cell at the second of its item's last write (as its stream change would be)
    assert max(have[b"hats#beret"][("d", b"Count")]) == 1700001000_000


def test_a_crash_resumes_after_the_last_finished_data_file():
    config = mapping("catalog_ttl_apply.yaml")
    bt = InMemoryBigtable(families={config.target.table: set(config.family_names)})
    store = StateStore(bt, config.name, lambda: NOW_MS)
    exports = recovered_exports()
    migration = Migration(store, now_ms=lambda: NOW_MS, sleep=lambda s: None)
    writes = []

    def fence():
        writes.append(1)
        # the look-back window's empty file (its flush) and window 1's first data
        # file (3 lines + its flush) are done; crash in the next
        if len(writes) == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Recovery(config, store, BatchingWriter(bt, None, FAST, sleep=lambda s: None), migration, fence=fence).run(
            GAP, exports)
    result = Recovery(config, store, BatchingWriter(bt, None, FAST, sleep=lambda s: None), migration).run(
        GAP, exports)
    assert (result.files_skipped, result.files) == (2, 2)


@pytest.mark.parametrize("name, message", [
    ("other_table", "this is an export of table 'Orders'"),
    ("new_image_view", "the export's view is NEW_IMAGE: a deleted item then has only its keys"),
    ("still_running", "has begun but not finished"),
])
def test_an_export_recovery_cannot_use_is_refused(name, message):
    with pytest.raises(ConfigError) as err:
        for path in exports_of(name):
            open_export(str(path), "Catalog", "us-east-1")
    assert message in str(err.value)


def test_a_full_export_given_as_incremental_is_refused():
    (full,) = (HERE / "exports" / "full_dynamodb_json" / "AWSDynamoDB").iterdir()
    with pytest.raises(RecoveryRefused) as err:
        open_export(str(full), "Catalog", "us-east-1")
    assert "this is a full export (exportType FULL_EXPORT)" in str(err.value)
    assert "Recovery needs incremental exports" in str(err.value)


def test_a_hole_between_windows_is_refused_naming_it():
    exports = [open_export(str(p), "Catalog", "us-east-1") for p in exports_of("hole")]
    with pytest.raises(RecoveryRefused) as err:
        check_coverage(exports, GAP)
    assert "leave a hole from 2023-11-14T22:00:00Z to 2023-11-14T23:00:00Z" in str(err.value)
    assert "ExportFromTime=1699999200, ExportToTime=1700002800" in str(err.value)


def test_overlapping_windows_and_a_window_across_the_boundary_are_refused():
    two = [open_export(str(p), "Catalog", "us-east-1") for p in exports_of("two_windows")]
    hole_first = open_export(str(exports_of("hole")[0]), "Catalog", "us-east-1")  # the same first window again
    with pytest.raises(RecoveryRefused, match="overlap"):
        check_coverage(two + [hole_first], GAP)
    later = Gap(GAP.first_ms + 60_000, GAP.last_ms + 60_000, GAP.end_ms, GAP.trimmed_shards, STREAM)
    with pytest.raises(RecoveryRefused, match="no window ends at 2023-11-14T22:01:00Z"):
        check_coverage(two, later)
    ahead = Gap(GAP.first_ms, GAP.last_ms, W2_TO * 1000 + 1, GAP.trimmed_shards, STREAM)
    with pytest.raises(RecoveryRefused, match="the exports end at 2023-11-15T00:00:00Z"):
        check_coverage(two, ahead)


def _pitr(status="ENABLED", earliest=None):
    desc = {"PointInTimeRecoveryStatus": status}
    if earliest is not None:
        desc["EarliestRestorableDateTime"] = dt.datetime.fromtimestamp(earliest, dt.timezone.utc)
    return lambda: {"ContinuousBackupsDescription": {"PointInTimeRecoveryDescription": desc}}


def test_pitr_that_does_not_reach_back_leaves_only_a_full_backfill():
    check_pitr(_pitr(earliest=W1_FROM), "Catalog", GAP)  # reaches back: fine
    with pytest.raises(RecoveryRefused) as err:
        check_pitr(_pitr(earliest=BOUNDARY + 60), "Catalog", GAP)
    assert "reaches back only to 2023-11-14T22:01:00Z" in str(err.value)
    assert "The only way back is a full backfill" in str(err.value)
    with pytest.raises(RecoveryRefused, match="point-in-time recovery of Catalog is DISABLED"):
        check_pitr(_pitr("DISABLED"), "Catalog", GAP)


def test_a_mapping_feature_final_images_cannot_restore_is_named():
    assert inexact_features(mapping("catalog_ttl_apply.yaml")) == []
    (why,) = inexact_features(mapping("catalog.yaml"))
    assert why.startswith("ttl.deletions: ignore")
