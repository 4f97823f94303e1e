"""ReadBigtableChanges (pipeline/source/change_stream.py) in a Beam pipeline,
against the test change-stream server in front of cbtemulator: every change
once, per row in commit order, across a partition split; its frontier saved in
the job's state table, from which a second job resumes."""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import apache_beam as beam
import pytest

from ddb2bt.pipeline.clients.bigtable.changestream import Frontier, table_name
from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec
from ddb2bt.pipeline.connect.preflight import ensure_state_table
from ddb2bt.pipeline.source.change_stream import ReadBigtableChanges, frontier_meta
from ddb2bt.pipeline.testing.change_stream_server import ChangeStreamServer

pytestmark = pytest.mark.e2e
PROJECT, INSTANCE = "p", "i"


@pytest.fixture(scope="module")
def front(stack):
    with ChangeStreamServer(f"127.0.0.1:{stack.bigtable_port}") as server:
        yield server


class Keep(beam.DoFn):
    """Appends each change's (row key, first value, partition) to a file (the
    pipeline's functions are pickled: a list here would be a copy)."""

    def __init__(self, path: str) -> None:
        self._path = path

    def process(self, change):
        with open(self._path, "a") as out:
            out.write(json.dumps([change.row_key.hex(), change.mutations[0].value.hex(), change.partition]) + "\n")


def _run(table: str, start_us, state, out: Path) -> list:
    with beam.Pipeline() as p:
        (p | ReadBigtableChanges(PROJECT, INSTANCE, table, start_time_us=start_us, state=state, until_idle_s=1.0,
                                 poll_s=0.1)
           | beam.ParDo(Keep(str(out))))
    lines = out.read_text().splitlines() if out.exists() else []
    return [(bytes.fromhex(k), bytes.fromhex(v), p) for k, v, p in map(json.loads, lines)]


def test_the_beam_reader_follows_a_split_and_a_new_job_resumes_from_the_saved_frontier(front, monkeypatch, unique,
                                                                                       tmp_path):
    monkeypatch.setenv("BIGTABLE_EMULATOR_HOST", front.address)
    from google.cloud.bigtable import Client

    client = Client(project=PROJECT, admin=True)
    table_id = f"cs_beam_{unique}"
    client.table_admin_client.create_table(request={
        "parent": f"projects/{PROJECT}/instances/{INSTANCE}", "table_id": table_id,
        "table": {"column_families": {"cf": {}}, "change_stream_config": {"retention_period": {"seconds": 3600}}}})
    ensure_state_table(PROJECT, INSTANCE, "ddb2bt_state")
    state = StateSpec(BigtableSpec(PROJECT, INSTANCE), job=f"rollback-{uuid.uuid4().hex[:6]}")
    table = client.instance(INSTANCE).table(table_id)

    def write(keys, value):
        for key in keys:
            row = table.direct_row(key)
            row.set_cell("cf", b"q", value)
            row.commit()

    start = int(time.time() * 1e6)
    keys = [f"k{i:02}".encode() for i in range(12)]
    write(keys, b"1")
    front.split(table_name(PROJECT, INSTANCE, table_id), b"k06")
    write(keys, b"2")
    written_by = int(time.time() * 1e6)
    first = _run(table_id, start, state, tmp_path / "first")
    assert sorted((k, v) for k, v, _ in first) == sorted([(k, b"1") for k in keys] + [(k, b"2") for k in keys])
    for key in keys:  # per row, the older change first (the parent partition read to its end before its halves)
        assert [v for k, v, _ in first if k == key] == [b"1", b"2"]
    assert {p for k, v, p in first if v == b"2"} == {":6b3036", "6b3036:"}  # the halves of the split at k06
    saved = Frontier.from_json(state.store().load_meta(frontier_meta(table_name(PROJECT, INSTANCE, table_id))))
    assert {p.id for p in saved.cursors} == {":6b3036", "6b3036:"}
    assert saved.low_watermark_us() > written_by  # every change up to it was read: the reader's lag
    write(keys[:3], b"3")
    second = _run(table_id, None, state, tmp_path / "second")  # no start time: only the saved frontier says where
    assert sorted((k, v) for k, v, _ in second) == [(k, b"3") for k in keys[:3]]
