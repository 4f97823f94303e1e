"""`create-table` turns the target table's change stream on when the mapping or
--change-stream asks, reads it back, and says so; the preflight check says
whether it is on. Against the test change-stream server in front of cbtemulator,
and against cbtemulator alone (which keeps no change stream: refused, named)."""
from __future__ import annotations

import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.connect.preflight import check_change_stream
from ddb2bt.pipeline.testing.change_stream_server import ChangeStreamServer
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.errors import ConfigError
from tests.conftest import write_mapping

pytestmark = pytest.mark.e2e
HOUR = 3600


@pytest.fixture(scope="module")
def front(stack):
    with ChangeStreamServer(f"127.0.0.1:{stack.bigtable_port}") as server:
        yield server


@pytest.fixture
def via_front(front, monkeypatch):
    monkeypatch.setenv("BIGTABLE_EMULATOR_HOST", front.address)
    return front


def test_the_flag_turns_the_change_stream_on_once(via_front, tmp_path, unique, capsys):
    path = write_mapping(tmp_path, target__table=f"cs_flag_{unique}")
    mapping = load_mapping(path)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    with pytest.raises(ConfigError, match="has no change stream.*create-table --mapping .* --change-stream"):
        check_change_stream(mapping)
    capsys.readouterr()
    assert ddb2bt(["create-table", "--mapping", str(path), "--change-stream", "48"]) == 0
    assert f"enabled the change stream of cs_flag_{unique} (retention 48 h)" in capsys.readouterr().out
    assert check_change_stream(mapping) == 48 * HOUR
    assert ddb2bt(["create-table", "--mapping", str(path), "--change-stream", "48"]) == 0
    assert "change stream" not in capsys.readouterr().out  # already so: nothing changed, nothing said
    assert ddb2bt(["create-table", "--mapping", str(path), "--change-stream"]) == 0  # the default: one day
    assert "from 48 h to 24 h" in capsys.readouterr().out
    assert check_change_stream(mapping) == 24 * HOUR


def test_the_mapping_asks_for_it(via_front, tmp_path, unique, capsys):
    path = write_mapping(tmp_path, target__table=f"cs_map_{unique}", target__change_stream_retention_hours=72)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    assert "retention 72 h" in capsys.readouterr().out
    assert check_change_stream(load_mapping(path)) == 72 * HOUR


def test_a_bigtable_without_change_streams_is_named_not_believed(stack, monkeypatch, tmp_path, unique, capsys):
    monkeypatch.setenv("BIGTABLE_EMULATOR_HOST", stack.env()["BIGTABLE_EMULATOR_HOST"])  # cbtemulator itself
    path = write_mapping(tmp_path, target__table=f"cs_plain_{unique}")
    assert ddb2bt(["create-table", "--mapping", str(path), "--change-stream"]) != 0
    err = capsys.readouterr().err
    assert "shows none: this Bigtable has no change streams" in err and "local up --change-streams" in err


def test_a_retention_outside_one_to_seven_days_is_refused(tmp_path, capsys):
    path = write_mapping(tmp_path, target__change_stream_retention_hours=12)
    with pytest.raises(ConfigError, match="target.change_stream_retention_hours: .*24 to 168 hours"):
        load_mapping(path)
    assert ddb2bt(["create-table", "--mapping", str(write_mapping(tmp_path)), "--change-stream", "200"]) != 0
    assert "--change-stream: a change stream keeps its changes 24 to 168 hours" in capsys.readouterr().err
