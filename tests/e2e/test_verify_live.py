"""verify of a live table: a writer keeps changing the source while verify runs
and the tail (its own process) replicates; differences in flight are re-checked
away (IDENTICAL), a planted divergence is still found, and only it. Both the
local verify and the Beam verify (FnApiRunner)."""
from __future__ import annotations

import json
import threading

import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
from ddb2bt.pipeline.clients.bigtable.reads import read_table
from ddb2bt.transforms.model import SetCell
from tests.e2e.test_cutover import _kill, _spawn, preload, random_changes, setup

pytestmark = pytest.mark.e2e
FUTURE_MS = 4_000_000_000_000  # a planted cell no replicated change can replace


@pytest.mark.parametrize("runner", [[], ["--runner=DirectRunner"]], ids=["local", "beam"])
def test_verify_under_a_concurrent_writer_is_identical_and_finds_a_planted_divergence(stack, tmp_path, unique,
                                                                                         capsys, runner):
    path, mapping, ddb = setup(tmp_path, unique)
    items = preload(ddb, mapping.source.table, 300, seed=11)
    quiet = preload(ddb, mapping.source.table, 20, seed=12)  # the writer never touches these
    key = lambda i: (i["pk"]["S"], i["sk"]["S"])
    busy = [i for i in items if key(i) not in {key(q) for q in quiet}]
    assert ddb2bt(["migrate", "--mapping", str(path), "--segments", "2", "--until-idle", "1",
                   "--poll-interval", "0.2"]) == 0
    tail = _spawn(["run", "--mapping", str(path), "--poll-interval", "0.2"])
    stop = threading.Event()

    def write():
        seed = 100
        while not stop.is_set():
            random_changes(ddb, mapping.source.table, busy, 50, seed=seed, stop=stop)
            seed += 1

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        report = tmp_path / "live.json"
        code = ddb2bt(["verify", "--mapping", str(path), "--segments", "2", "--report", str(report)] + runner)
        body = json.loads(report.read_text())
        assert code == 0, json.dumps(body["tables"], indent=1)
        assert body["identical"] and body["recheck"]["timed_out"] is False
        # a planted extra row and a tampered cell of an item nobody writes to
        t = mapping.target
        quiet_row = f"{quiet[0]['pk']['S']}#{quiet[0]['sk']['S']}".encode()
        assert quiet_row in read_table(t.project, t.instance, t.table)
        GrpcMutationWriter(t.project, t.instance).mutate_rows(t.table, [
            (b"zz#planted", [SetCell("SKU", b"Price", b"\x00" * 8, FUTURE_MS)]),
            (quiet_row, [SetCell("SKU", b"Planted", b"x", FUTURE_MS)]),
        ])
        capsys.readouterr()
        assert ddb2bt(["verify", "--mapping", str(path), "--segments", "2", "--report", str(report)] + runner) == 1
        counts = {k: v["count"] for k, v in json.loads(report.read_text())["tables"][t.table].items()}
        assert (counts["extra_rows"], counts["extra_cells"]) == (1, 1), counts
        assert counts["missing_rows"] == counts["missing_cells"] == counts["different_cells"] == 0, counts
    finally:
        stop.set()
        writer.join()
        _kill(tail)
