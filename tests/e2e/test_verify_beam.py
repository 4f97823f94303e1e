"""The Beam verify (FnApiRunner) gives the local verify's report on the same
tables: a planted missing row, extra row, stale cell, foreign cell and version
clash, each counted once, the same examples, the same exit code."""
from __future__ import annotations

import json

import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.connect.connections import dynamodb_client
from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
from ddb2bt.pipeline.clients.bigtable.reads import read_table
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.model import DeleteCells, SetCell
from tests.conftest import write_mapping

pytestmark = pytest.mark.e2e


def comparable(report: dict) -> dict:
    return {k: v for k, v in report.items() if k not in ("checked_at_ms", "recheck")}


def test_beam_verify_reports_what_the_local_verify_reports(stack, tmp_path, unique, capsys):
    path = write_mapping(tmp_path, "videos.yaml", source__table=f"Vids_{unique}", target__table=f"vids_{unique}",
                         name=f"vids_{unique}")
    mapping = load_mapping(path)
    ddb = dynamodb_client()
    workload.create_table(ddb, mapping.source.table)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    put = lambda **kw: ddb.put_item(TableName=mapping.source.table, Item={k: {"S": v} for k, v in kw.items()})
    for n in range(1, 7):
        pk = f"{n:04d}"
        put(pk=pk, sk="Video", Formats="[]", UploadDate=f"2023-09-0{n}T10:00:00")
        put(pk=pk, sk=f"VideoComment#{n}", Content=f"comment {n}", CreatedAt=f"2023-09-1{n}T10:00:00")
    # version clash: a second comment on 0004 at the very same CreatedAt
    put(pk="0004", sk="VideoComment#x", Content="same second", CreatedAt="2023-09-14T10:00:00")
    assert ddb2bt(["migrate", "--mapping", str(path), "--segments", "2", "--until-idle", "1",
                   "--poll-interval", "0.2"]) == 0
    t = mapping.target
    rows = read_table(t.project, t.instance, t.table)
    ts = 4_000_000_000_000
    GrpcMutationWriter(t.project, t.instance).mutate_rows(t.table, [
        (b"0001", [DeleteCells(f, q, 0, ts) for (f, q) in rows[b"0001"]]),                  # missing row
        (b"zz-ghost", [SetCell("stats", b"Likes", b"\x00" * 8, ts)]),                      # extra row
        (b"0002", [SetCell("comments", b"UserComments", b"stale", 1694426400000)]),        # stale cell
        (b"0003", [SetCell("stats", b"Foreign", b"nobody's", ts)]),                        # foreign cell
    ])
    local, beam = tmp_path / "local.json", tmp_path / "beam.json"
    assert ddb2bt(["verify", "--mapping", str(path), "--report", str(local), "--recheck-wait", "0"]) == 1
    capsys.readouterr()
    assert ddb2bt(["verify", "--mapping", str(path), "--report", str(beam), "--runner=DirectRunner"]) == 1
    captured = capsys.readouterr()
    assert "DIFFERENT" in captured.out and "nobody's" not in captured.out, captured.err[-3000:]
    local_report, beam_report = json.loads(local.read_text()), json.loads(beam.read_text())
    counts = {k: v["count"] for k, v in local_report["tables"][t.table].items()}
    # the clash's cell holds one of the two items' values: a different cell too when the other one won
    assert counts.pop("different_cells") in (1, 2)
    assert counts == {"missing_rows": 1, "extra_rows": 1, "missing_cells": 0, "extra_cells": 1,
                      "version_clashes": 1, "multi_version_columns": 0}, counts
    assert comparable(beam_report) == comparable(local_report)
    # the Beam verify re-checked its differences (the default wait) and every one stayed
    r = beam_report["recheck"]
    assert r["rows"] >= 4 and r["resolved"] == 0 and not r["timed_out"] and r["rounds"] >= 2, r
