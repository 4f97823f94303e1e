"""Changing a running job's mapping: the outline and fingerprint of what a
mapping writes (transforms/fingerprint.py), the job's record of the mapping it
runs (control/mapping_change.py), and status READY only after a verify of that
mapping (docs/cutover.md, "Changing the mapping")."""
from __future__ import annotations

import json

import pytest
import yaml

from ddb2bt.pipeline.control.mapping_change import change_notice, fingerprint_of, record_mapping, running_mapping
from ddb2bt.pipeline.cutover.status import Facts, assess, gather
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.testing.fakes import FakeStreamsClient, InMemoryBigtable
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.fingerprint import describe_changes, mapping_outline, outline_fingerprint

NOW = 1_700_000_000_000
HR = "examples/hr_orders.yaml"


def edited(tmp_path, edit, name="m.yaml"):
    doc = yaml.safe_load(open(HR))
    edit(doc)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return load_mapping(str(path))


def test_reformatting_or_redescribing_a_mapping_is_no_change(tmp_path):
    def cosmetic(doc):
        doc["description"] = "another description"
    same = edited(tmp_path, cosmetic)
    assert fingerprint_of(same) == fingerprint_of(load_mapping(HR))
    assert describe_changes(mapping_outline(load_mapping(HR)), mapping_outline(same)) == []


def test_a_renamed_column_an_added_family_and_a_removed_rule_are_each_named(tmp_path):
    def edit(doc):
        doc["rules"][1]["columns"]["JobTitle"]["column"] = "emp:Title"
        doc["families"]["extra"] = {"max_versions": 1}
        doc["rules"] = [r for r in doc["rules"] if r["name"] != "job_history"]
    old, new = mapping_outline(load_mapping(HR)), mapping_outline(edited(tmp_path, edit))
    assert outline_fingerprint(old) != outline_fingerprint(new)
    lines = describe_changes(old, new)
    assert "rule employee column JobTitle: emp:Title utf8 (was emp:JobTitle utf8)" in lines
    assert "family extra: added (max_versions=1 max_age_seconds=None gc=union)" in lines
    assert "rule job_history: removed (was …)" in lines
    assert any(line.startswith("rule order: employee, ") for line in lines)


def test_a_changed_row_key_is_named(tmp_path):
    def edit(doc):
        doc["rules"][1]["row_key"] = "e#{PK}"
    lines = describe_changes(mapping_outline(load_mapping(HR)), mapping_outline(edited(tmp_path, edit)))
    assert lines == ["rule employee row key: e#{PK} (was emp#{PK|strip_prefix:HR-EMPLOYEE#})"]


def test_the_job_records_its_mapping_and_a_start_with_another_is_told_what_changed(tmp_path):
    store = StateStore(InMemoryBigtable(), "job", lambda: NOW)
    first = load_mapping(HR)
    assert record_mapping(store, first, lambda: NOW) is None  # the first record
    assert record_mapping(store, first, lambda: NOW + 1) is None  # the same mapping again
    assert running_mapping(store)["since_ms"] == NOW

    def edit(doc):
        doc["rules"][1]["columns"]["JobTitle"]["column"] = "emp:Title"
    change = record_mapping(store, edited(tmp_path, edit), lambda: NOW + 2)
    assert change is not None and change.previous == fingerprint_of(first)
    assert change.changes == ("rule employee column JobTitle: emp:Title utf8 (was emp:JobTitle utf8)",)
    notice = change_notice("hr_orders", change, "--mapping m.yaml")
    assert "ddb2bt migrate --restart --mapping m.yaml" in notice and "emp:Title" in notice
    assert "changed items keep the cells the new mapping no longer writes" in notice
    assert "a deleted item's rows under the old mapping's row keys stay" in notice
    recorded = running_mapping(store)
    assert (recorded["since_ms"], recorded["previous"]) == (NOW + 2, fingerprint_of(first))


def test_status_is_ready_only_after_a_verify_of_the_mapping_the_job_runs(tmp_path):
    store = StateStore(InMemoryBigtable(), "job", lambda: NOW)
    old = load_mapping(HR)
    record_mapping(store, old, lambda: NOW)
    store.save_meta("verify", json.dumps({"identical": True, "sampled": False, "checked_at_ms": NOW + 5,
                                          "mapping": fingerprint_of(old)}))

    def facts(mapping):
        f = gather(store, FakeStreamsClient(), None, now_ms=NOW + 10, mapping=mapping)
        return f

    assert not any("mapping" in r for r in assess(facts(old))[1])

    def edit(doc):
        doc["rules"][1]["columns"]["JobTitle"]["column"] = "emp:Title"
    new = edited(tmp_path, edit)
    # the file was edited, the job not restarted with it yet
    _, reasons = assess(facts(new), "-m m.yaml")
    assert any(r.startswith("the mapping given is not the one the job runs (rule employee column JobTitle")
               for r in reasons)
    # the job runs it now: the old verify no longer counts
    record_mapping(store, new, lambda: NOW + 20)
    _, reasons = assess(facts(new), "-m m.yaml")
    assert any(r.startswith("the last verify checked another mapping") for r in reasons)
    store.save_meta("verify", json.dumps({"identical": True, "sampled": False, "checked_at_ms": NOW + 30,
                                          "mapping": fingerprint_of(new)}))
    _, reasons = assess(facts(new), "-m m.yaml")
    assert not any("mapping" in r for r in reasons), reasons


def test_a_verify_recorded_before_fingerprints_counts_until_the_mapping_changes():
    f = Facts(now_ms=NOW, phase="LIVE", handoff_ms=None, backfill_parts=1, backfill_done_parts=1, backfill_items=1,
              backfill_expected=None, backfill_done_ms=None,
              last_verify={"identical": True, "sampled": False, "checked_at_ms": NOW - 10},
              running_mapping={"fingerprint": "b", "previous": None, "since_ms": NOW - 100})
    assert not any("another mapping" in r for r in assess(f)[1])
    f.running_mapping = {"fingerprint": "b", "previous": "a", "since_ms": NOW - 5}
    assert any("another mapping" in r for r in assess(f)[1])


def test_a_changed_mapping_is_recorded_only_once_the_remote_job_launched(monkeypatch, tmp_path):
    """A Dataflow launch (or --update) that is refused must not leave the state
    saying the new mapping runs; an accepted one records it."""
    import argparse
    from types import SimpleNamespace

    import ddb2bt.pipeline.graph as graph
    import ddb2bt.pipeline.io as io
    import ddb2bt.pipeline.services.replicate as replicate

    store = StateStore(InMemoryBigtable(), "job", lambda: NOW)
    old = load_mapping(HR)
    record_mapping(store, old, lambda: NOW)

    def edit(doc):
        doc["rules"][1]["columns"]["JobTitle"]["column"] = "emp:Title"
    new = edited(tmp_path, edit)
    job = SimpleNamespace(mapping=new, state=SimpleNamespace(store=lambda: store), stream_arn="arn:s/stream/1",
                          partitions=1, reader=SimpleNamespace(start="trim_horizon"))
    monkeypatch.setattr(replicate, "build_live_jobs", lambda args, mappings: [job])
    monkeypatch.setattr(replicate, "load_all", lambda args: [new])
    monkeypatch.setattr(replicate, "start_metrics_server", lambda *a: None)
    class Transform:
        def __rrshift__(self, label):
            return self

    monkeypatch.setattr(io.ReplicateToBigtable, "from_jobs", classmethod(lambda cls, jobs: Transform()))

    class Launch:
        def __init__(self, refused):
            self.refused = refused

        def __or__(self, other):
            return None

        def run(self):
            if self.refused:
                raise RuntimeError("The workflow could not be updated: the new job is not compatible")
            return SimpleNamespace(job=None)

    args = argparse.Namespace(mapping="m.yaml", beam_args=["--runner=DataflowRunner"], metrics_port=-1,
                              metrics_host="127.0.0.1", until_idle=None, continuous_check=None, dry=False)
    monkeypatch.setattr(graph, "make_pipeline", lambda beam_args: Launch(refused=True))
    monkeypatch.setattr(replicate, "write_summary", lambda *a, **k: "")
    with pytest.raises(RuntimeError, match="could not be updated"):
        replicate.cmd_run(args)
    assert running_mapping(store)["fingerprint"] == fingerprint_of(old)  # the old mapping still runs
    monkeypatch.setattr(graph, "make_pipeline", lambda beam_args: Launch(refused=False))
    replicate.cmd_run(args)
    assert running_mapping(store)["fingerprint"] == fingerprint_of(new)


def test_the_re_copy_is_not_advised_to_the_re_copy_itself(tmp_path):
    store = StateStore(InMemoryBigtable(), "job", lambda: NOW)
    record_mapping(store, load_mapping(HR), lambda: NOW)

    def edit(doc):
        doc["rules"][1]["columns"]["JobTitle"]["column"] = "emp:Title"
    change = record_mapping(store, edited(tmp_path, edit), lambda: NOW + 1)
    notice = change_notice("hr_orders", change, "--mapping m.yaml", recopying=True)
    assert "migrate --restart --mapping" not in notice and "This re-copy (migrate --restart)" in notice
    assert "ddb2bt verify --mapping m.yaml" in notice
