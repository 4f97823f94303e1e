"""Changing a running job's mapping (docs/cutover.md, "Changing the mapping"):
a column renamed, a family added and a rule removed. The documented path —
create-table for the new family, `migrate --restart`, `verify` — ends IDENTICAL
under the new mapping with no cell of the old one left; `status` is NOT READY
from the edit until a verify of the new mapping, and the start with the edited
mapping says what changed."""
from __future__ import annotations

import yaml
import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.transforms.config import load_mapping
from tests.conftest import ROOT, ready_but_for_the_tail
from tests.e2e.test_cutover import assert_target_is_exactly_the_mapping, preload, random_changes, setup

pytestmark = pytest.mark.e2e


def _two_rules(doc: dict) -> dict:
    """product_catalog with a rule of its own for hats (their price in SKU:HatPrice)."""
    general = doc["rules"][0]
    hats = {**general, "name": "hats", "match": {"attribute": "pk", "equals": "hats"},
            "columns": {**general["columns"], "Price": {"column": "SKU:HatPrice", "encoding": "int64"}}}
    doc["rules"] = [hats, general]
    return doc


def test_a_mapping_edit_on_a_running_job_ends_identical_under_the_new_mapping(stack, tmp_path, unique, capsys):
    path, mapping, ddb = setup(tmp_path, unique)
    doc = _two_rules(yaml.safe_load(path.read_text()))
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    items = preload(ddb, mapping.source.table, 240, seed=41)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    assert ddb2bt(["migrate", "--mapping", str(path), "--segments", "2", "--until-idle", "1",
                   "--poll-interval", "0.2"]) == 0
    assert ddb2bt(["verify", "--mapping", str(path)]) == 0
    capsys.readouterr()
    assert ddb2bt(["status", "--mapping", str(path)]) == 1  # the migrate ended: no tail runs
    out = capsys.readouterr().out
    assert ready_but_for_the_tail(out), out

    # The edit: Description renamed, Thumbnail moved to a new family, the hats rule removed.
    edited = yaml.safe_load(path.read_text())
    edited["families"]["Media"] = {"max_versions": 1}
    general = edited["rules"][1]
    general["columns"]["Description"] = {"column": "SKU:Desc", "encoding": "utf8"}
    general["columns"]["Thumbnail"] = {"column": "Media:Thumbnail", "encoding": "utf8"}
    edited["rules"] = [general]
    new_path = tmp_path / "edited.yaml"
    new_path.write_text(yaml.safe_dump(edited, sort_keys=False))
    new = load_mapping(str(new_path))
    capsys.readouterr()
    assert ddb2bt(["status", "--mapping", str(new_path)]) == 1
    out = capsys.readouterr().out
    assert "the mapping given is not the one the job runs" in out and "NOT READY" in out

    # The documented path, with the source still changing.
    random_changes(ddb, mapping.source.table, items, 60, seed=42)
    assert ddb2bt(["create-table", "--mapping", str(new_path)]) == 0  # the new family
    capsys.readouterr()
    assert ddb2bt(["migrate", "--restart", "--mapping", str(new_path), "--segments", "2", "--until-idle", "1",
                   "--poll-interval", "0.2"]) == 0
    notice = capsys.readouterr().err
    assert "the mapping of" in notice and "changed since this job last ran" in notice
    assert "rule hats: removed" in notice and "family Media: added" in notice
    assert "rule product column Description: SKU:Desc utf8 (was SKU:Description utf8)" in notice
    assert ddb2bt(["status", "--mapping", str(new_path)]) == 1
    assert "the last verify checked another mapping" in capsys.readouterr().out
    assert ddb2bt(["verify", "--mapping", str(new_path)]) == 0
    assert_target_is_exactly_the_mapping(new, ddb)  # nothing of the old mapping is left
    capsys.readouterr()
    assert ddb2bt(["status", "--mapping", str(new_path)]) == 1
    out = capsys.readouterr().out
    assert ready_but_for_the_tail(out), out
