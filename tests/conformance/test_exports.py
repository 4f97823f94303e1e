"""DynamoDB exports in the real S3 layout (AWSDynamoDB/<ExportId>/ with _started,
manifest-summary.json, manifest-files.json and gzipped data files, empty partitions
included), in DYNAMODB_JSON and ION, full and incremental: each either back-fills
to the exact cells in ``exports/<name>.expect.json`` or is refused, before anything
is written, with the exact message there."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ddb2bt.pipeline.cutover.backfill import PartReaders
from ddb2bt.pipeline.source.snapshot import ExportSource
from ddb2bt.transforms.errors import ConfigError, PermanentError
from ddb2bt.transforms.model import ChangeRecord, PartDone
from tests.conformance.harness import HERE, mapping, outcome
from tests.conftest import patch_everywhere

EXPORTS = sorted(p for p in (HERE / "exports").iterdir() if p.is_dir())
# An export this far ahead of this host's clock is refused (the limit is 5 s) even
# after the few seconds the test takes between writing the manifest and the check.
FUTURE_GAP_S = 10


def export_dir(name: str) -> Path:
    (found,) = (HERE / "exports" / name / "AWSDynamoDB").iterdir()
    return found


def backfill(name: str, mapping_name: str) -> dict:
    """What a backfill makes of the export: the handoff time, and per data file its
    item count and each item's cells (as backfill INSERTs one ms before the handoff second)."""
    config = mapping(mapping_name)
    source = ExportSource(str(export_dir(name)))
    source.check(config.source.table, config.source.region)
    handoff = source.export_time_ms()
    readers = PartReaders(source, config.source.key_attributes, handoff)
    parts = []
    for part in source.parts():
        elements = list(readers.read(part, None, 0))
        assert isinstance(elements[-1], PartDone) and elements[-1].part == part
        records = [e for e in elements if isinstance(e, ChangeRecord)]
        parts.append({"part": part, "count": elements[-1].count, "items": [outcome(config, r) for r in records]})
    return {"handoff_ms": handoff, "item_count": source.item_count(), "parts": parts}


@pytest.mark.parametrize("path", EXPORTS, ids=[p.name for p in EXPORTS])
def test_export_fixture(path):
    expect = json.loads((path.parent / f"{path.name}.expect.json").read_text())
    assert (export_dir(path.name) / "_started").exists()  # the real layout, _started included
    refusal = expect.get("refusal")
    if refusal is None:
        got = backfill(path.name, expect["mapping"])
        assert got == {k: expect[k] for k in ("handoff_ms", "item_count", "parts")}
        return
    error = {"ConfigError": ConfigError, "PermanentError": PermanentError}[refusal["error"]]
    with pytest.raises(error) as err:
        backfill(path.name, expect["mapping"])
    # the export's own location is named as "<export>" in the fixture
    assert str(err.value).replace(str(export_dir(path.name)), "<export>") == refusal["message"]


def test_an_ion_export_gives_the_very_cells_of_the_same_dynamodb_json_export():
    # Same items, written by DynamoDB in its two formats: Ion decimals such as 7.250
    # and 1d-130 come out spelled as DynamoDB JSON (and the stream) spell them.
    as_json = backfill("full_dynamodb_json", "catalog.yaml")
    as_ion = backfill("full_ion", "catalog.yaml")
    for part in as_json["parts"] + as_ion["parts"]:
        part["part"] = part["part"].replace(".ion.gz", ".json.gz")
    assert as_ion == as_json
    assert sum(p["count"] for p in as_json["parts"]) == 3 and [p["count"] for p in as_json["parts"]] == [2, 0, 1]


@pytest.mark.parametrize("name,message", [
    ("incremental_dynamodb_json", "this is an incremental export"),
    ("another_table", "this is an export of table 'Orders'"),
    ("still_running", "has begun but not finished"),
])
def test_backfill_refuses_the_export_before_touching_bigtable(name, message, monkeypatch, capsys):
    """The check runs first: no state table, no handoff, no tail, no cell."""
    import ddb2bt.pipeline.app.cli as cli
    from ddb2bt.pipeline.services import replicate
    import ddb2bt.pipeline.connect.preflight as preflight

    def forbidden(*a, **k):
        raise AssertionError("touched Bigtable before the export was checked")

    # the services bind these at import: patched wherever they were bound
    patch_everywhere(monkeypatch, preflight, "ensure_state_table", forbidden)
    patch_everywhere(monkeypatch, preflight, "check_target", forbidden)
    monkeypatch.setattr(replicate, "build_live_jobs", forbidden)  # migrate's service
    for command in ("backfill", "migrate"):
        argv = [command, "-m", str(HERE / "mappings" / "catalog.yaml"), "--from-export", str(export_dir(name))]
        assert cli.main(argv) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("offset_s,refused", [
    (-3600, "ahead of this host's clock"),  # an exportTime an hour in this clock's future
    (-6, "ahead of this host's clock"),  # just past how far this clock may lag AWS's
    (-4, None),  # within it: a clock a few seconds behind AWS's, a fresh export
    (3600, None),
    (23 * 3600 + 1, "the stream keeps 24h"),  # older than the stream's retention, less the margin
])
def test_an_export_from_the_future_or_older_than_the_stream_is_refused(offset_s, refused):
    """The handoff is the export's time: one ahead of this host's clock would put
    every back-filled cell above the tail's changes until then (docs/design.md §7.1)."""
    from ddb2bt.pipeline.cutover.controller import BackfillOptions, backfill_source

    config = mapping("catalog.yaml")
    location = str(export_dir("full_dynamodb_json"))
    export_ms = ExportSource(location).export_time_ms()
    options = BackfillOptions(from_export=location)
    now_ms = lambda: export_ms + offset_s * 1000  # noqa: E731
    if refused is None:
        source, spec, handoff, expected = backfill_source(options, config, now_ms)
        assert handoff == export_ms and spec["kind"] == "export" and expected == 3
        return
    with pytest.raises(ConfigError, match=refused) as raised:
        backfill_source(options, config, now_ms)
    assert raised.value.field == "--from-export"


def test_an_export_from_the_future_is_refused_before_touching_bigtable(tmp_path, monkeypatch, capsys):
    """The export's time is checked with the rest of the export, first: no state
    table, no lease, no tail, no cell (a 6 s gap is told in seconds)."""
    import datetime as dt
    import shutil
    import time

    import ddb2bt.pipeline.app.cli as cli
    from ddb2bt.pipeline.services import replicate
    import ddb2bt.pipeline.connect.preflight as preflight

    def forbidden(*a, **k):
        raise AssertionError("touched Bigtable before the export was checked")

    patch_everywhere(monkeypatch, preflight, "ensure_state_table", forbidden)
    patch_everywhere(monkeypatch, preflight, "check_target", forbidden)
    monkeypatch.setattr(replicate, "build_live_jobs", forbidden)
    for ahead_s, told in ((2 * 3600, r"is 2\.0 h ahead"), (FUTURE_GAP_S, r"is \d+ s ahead")):
        export = tmp_path / f"ahead{ahead_s}"
        shutil.copytree(export_dir("full_dynamodb_json"), export)
        summary = json.loads((export / "manifest-summary.json").read_text())
        at = dt.datetime.fromtimestamp(time.time() + ahead_s, dt.timezone.utc)
        summary["exportTime"] = at.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        (export / "manifest-summary.json").write_text(json.dumps(summary))
        for command in ("backfill", "migrate"):
            argv = [command, "-m", str(HERE / "mappings" / "catalog.yaml"), "--from-export", str(export)]
            assert cli.main(argv) == 2
            err = capsys.readouterr().err
            assert "ahead of this host's clock" in err and re.search(told, err), err
