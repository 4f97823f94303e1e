"""The forward path runs unchanged through the change-stream server of
`local up --change-streams` (every call it makes is forwarded), and what it
writes shows in the target table's change stream: the ground the way back
stands on when rehearsed locally."""
from __future__ import annotations

import time

import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.clients.bigtable.changestream import data_api_client, read_changes, table_name
from ddb2bt.pipeline.connect.connections import dynamodb_client
from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.local.local_stack import LocalStack
from ddb2bt.transforms.config import load_mapping
from tests.conftest import write_mapping
from tests.e2e.test_cutover import preload

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def streams_stack(tmp_path_factory):
    with LocalStack(log_dir=tmp_path_factory.mktemp("cs-stack"), change_streams=True) as stack:
        yield stack


def test_migrate_and_verify_through_the_front_and_the_writes_show_in_the_stream(streams_stack, monkeypatch,
                                                                                 tmp_path, unique):
    for k, v in streams_stack.env().items():
        monkeypatch.setenv(k, v)
    path = write_mapping(tmp_path, source__table=f"CsCatalog_{unique}", target__table=f"cs_catalog_{unique}",
                         name=f"cs_catalog_{unique}")
    mapping = load_mapping(path)
    ddb = dynamodb_client()
    workload.create_table(ddb, mapping.source.table)
    assert ddb2bt(["create-table", "--mapping", str(path), "--change-stream"]) == 0
    items = preload(ddb, mapping.source.table, 120)
    start_us = int(time.time() * 1e6)
    assert ddb2bt(["migrate", "--mapping", str(path), "--segments", "2", "--until-idle", "1",
                   "--poll-interval", "0.2"]) == 0
    assert ddb2bt(["verify", "--mapping", str(path)]) == 0
    api = data_api_client()
    try:
        changes = list(read_changes(api, table_name(mapping.target.project, mapping.target.instance,
                                                     mapping.target.table), start_us, 1.0, poll_s=0.1))
    finally:
        api.transport.close()
    written = {c.row_key for c in changes}
    assert len(written) >= len(items)  # every item's row was written through the front and is in the stream
    assert {c.source for c in changes} == {"USER"}
