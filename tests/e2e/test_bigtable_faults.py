"""Bigtable going away mid-run: the job must fail clearly (or recover) — never
report success with data missing."""
from __future__ import annotations

import threading
import time

import pytest

from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.connect.connections import dynamodb_client
from ddb2bt.pipeline.local.local_stack import LocalStack
from ddb2bt.pipeline.clients.bigtable.reads import read_table
from ddb2bt.transforms.config import load_mapping
from tests.conftest import write_mapping

pytestmark = pytest.mark.e2e
RUN_WRITES_WITHIN_S = 120  # generous: a run's first write on a loaded machine (typically seconds)
POLL_S = 0.1


@pytest.mark.slow
def test_emulator_restart_mid_run_fails_the_job_loudly(tmp_path, monkeypatch, capsys):
    with LocalStack(log_dir=tmp_path / "logs") as own:  # its own stack: the restart wipes everything
        for k, v in own.env().items():
            monkeypatch.setenv(k, v)
        path = write_mapping(tmp_path, name="restart_job")
        ddb = dynamodb_client()
        workload.create_table(ddb, "ProductCatalog")
        assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
        result = []
        started = threading.Event()

        def run():
            started.set()
            result.append(ddb2bt(["run", "--mapping", str(path), "--until-idle", "3", "--poll-interval", "0.1"]))

        t = threading.Thread(target=run, daemon=True)
        t.start()
        started.wait()
        ops = workload.operations(3, 400, 50)
        target = load_mapping(path).target
        for i, op in enumerate(ops):
            workload.apply_quietly(ddb, "ProductCatalog", op)
            if i == 150:
                # Mid-run: once the run has written to its target (its thread's start
                # is not enough: on a loaded machine the restart came before its
                # preflight, which then refused the missing table with exit 2).
                deadline = time.monotonic() + RUN_WRITES_WITHIN_S
                while not read_table(target.project, target.instance, target.table):
                    assert time.monotonic() < deadline and t.is_alive(), (result, "the run never wrote")
                    time.sleep(POLL_S)
                own.restart_bigtable()  # all tables gone, including the state table
        t.join(180)
        assert not t.is_alive()
        assert result == [1], "a run that lost its target must not report success"
        err = capsys.readouterr().err
        assert "ddb2bt: error:" in err and "not found" in err.lower()


def test_replication_converges_under_injected_grpc_faults(stack, tmp_path, unique):
    """UNAVAILABLE / DEADLINE_EXCEEDED / RESOURCE_EXHAUSTED on a share of calls,
    per-entry UNAVAILABLE inside MutateRows responses (applied but reported failed)
    and added latency: every change still lands exactly once in effect."""
    from ddb2bt.pipeline.testing import faults
    from ddb2bt.pipeline.clients.bigtable.reads import read_table
    from ddb2bt.pipeline.verify.compare import diff_layout, expected_layout
    from ddb2bt.transforms.config import load_mapping

    path = write_mapping(tmp_path, source__table=f"Faulty_{unique}", target__table=f"faulty_{unique}",
                         name=f"faulty_{unique}")
    mapping = load_mapping(path)
    ddb = dynamodb_client()
    workload.create_table(ddb, mapping.source.table)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    for op in workload.operations(13, 500, 80):
        workload.apply_quietly(ddb, mapping.source.table, op)
    faults.INJECTED.clear()
    injector = faults.FaultInterceptor.from_spec("unavailable=0.15,deadline_exceeded=0.05,resource_exhausted=0.05,"
                                                 "entry_unavailable=0.2,latency_ms=5,seed=7")
    assert ddb2bt(["run", "--mapping", str(path), "--until-idle", "1.5", "--poll-interval", "0.2"],
                  bigtable_interceptors=[injector]) == 0
    assert sum(faults.INJECTED.values()) >= 3, faults.INJECTED
    assert faults.INJECTED.get("entry_unavailable", 0) >= 1
    items = workload.scan_all(ddb, mapping.source.table)
    actual = read_table(mapping.target.project, mapping.target.instance, mapping.target.table)
    diff = diff_layout(expected_layout(mapping, items)[mapping.target.table], actual)
    assert diff.identical, diff.summary()
