"""`ddb2bt sweep-tombstones` against the emulators (docs/design.md §10.7): a
deleted item's tombstone older than the Kinesis stream's retention plus the
margin is removed, a recent one and a live clock are kept, a dry run removes
nothing, and a keep shorter than the retention is refused. The old changes are
stamped in the past (their change time is the clock's), so no test waits."""
from __future__ import annotations

import time

import boto3
import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.clients.bigtable.reads import read_table
from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
from ddb2bt.pipeline.sink.guarded import apply_guarded
from ddb2bt.transforms.attrs import from_plain
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.model import INSERT, REMOVE, ChangeRecord
from ddb2bt.transforms.ordering import CLOCK_FAMILY, guarded_rows
from tests.conftest import write_mapping

pytestmark = pytest.mark.e2e

DAY_US = 24 * 3600 * 1_000_000
OLD = 3 * DAY_US  # older than moto's default retention (24 h) + the 24 h margin


def keys(sk: str) -> dict:
    return {"pk": from_plain("hats"), "sk": from_plain(sk)}


def image(sk: str) -> dict:
    return {**keys(sk), "Description": from_plain("a hat")}


def record(event, sk, us) -> ChangeRecord:
    new, old = (image(sk), None) if event == INSERT else (None, image(sk))
    return ChangeRecord(event, keys(sk), new, old, us // 1000, change_us=us)


def test_sweep_tombstones_removes_only_tombstones_past_the_retention(stack, tmp_path, unique, capsys):
    path = write_mapping(tmp_path, source__table=f"Src_{unique}", target__table=f"t_{unique}", name=f"s_{unique}",
                         source__kinesis={"stream": f"cdc_{unique}"})
    boto3.client("kinesis").create_stream(StreamName=f"cdc_{unique}", ShardCount=1)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    mapping = load_mapping(path)
    t = mapping.target
    now_us = time.time_ns() // 1000
    writer = GrpcMutationWriter(t.project, t.instance)
    try:
        for change in (record(INSERT, "old-gone", now_us - OLD - 1_000_000), record(REMOVE, "old-gone", now_us - OLD),
                       record(INSERT, "new-gone", now_us - 2_000_000), record(REMOVE, "new-gone", now_us - 1_000_000),
                       record(INSERT, "old-live", now_us - OLD)):
            assert apply_guarded(writer, guarded_rows(mapping, change)).applied == 1
    finally:
        writer.close()
    rows = lambda: read_table(t.project, t.instance, t.table)  # noqa: E731
    before = rows()
    assert set(before) == {b"hats#old-gone", b"hats#new-gone", b"hats#old-live"}
    capsys.readouterr()

    assert ddb2bt(["sweep-tombstones", "--mapping", str(path), "--dry-run"]) == 0
    assert "1 would be removed (dry run)" in capsys.readouterr().out and rows() == before

    assert ddb2bt(["sweep-tombstones", "--mapping", str(path), "--keep-hours", "1"]) == 2
    assert "--keep-hours" in capsys.readouterr().err and rows() == before
    # The retention itself is too short: the reader still accepts a record an
    # hour older than that (RECORD_AGE_MARGIN_S).
    assert ddb2bt(["sweep-tombstones", "--mapping", str(path), "--keep-hours", "24"]) == 2
    assert "--keep-hours" in capsys.readouterr().err and rows() == before

    assert ddb2bt(["sweep-tombstones", "--mapping", str(path)]) == 0
    out = capsys.readouterr().out
    assert "kept 48 h (the stream's retention 24 h + 24 h): 1 removed, 0 kept" in out, out
    after = rows()
    assert set(after) == {b"hats#new-gone", b"hats#old-live"}, "only the old tombstone's row went"
    assert {f for f, _ in after[b"hats#new-gone"]} == {CLOCK_FAMILY}
    assert {f for f, _ in after[b"hats#old-live"]} == {CLOCK_FAMILY, "SKU"}


def test_sweep_tombstones_refuses_a_mapping_without_kinesis(stack, tmp_path, unique, capsys):
    path = write_mapping(tmp_path, source__table=f"Src_{unique}", target__table=f"t_{unique}", name=f"s_{unique}")
    assert ddb2bt(["sweep-tombstones", "--mapping", str(path)]) == 2
    assert "source.kinesis" in capsys.readouterr().err
