"""Scenarios of the deterministic simulation (pipeline/testing/sim) that each
play one production hazard and judge the run by the whole oracle. The general
checks of the simulation itself are in test_sim.py."""
from __future__ import annotations

from dataclasses import replace

import pytest

from ddb2bt.pipeline.control.partitions import PARTITION_IDLE_RELEASE_S
from ddb2bt.pipeline.testing.sim.bigtable import BigtablePressure
from ddb2bt.pipeline.testing.sim.dataflow import DataflowChaos
from ddb2bt.pipeline.testing.sim.scenario import TARGET, SimConfig, run_simulation
from ddb2bt.pipeline.testing.sim.writers import WriterMix

# Dataflow's leases on (a lease per partition, released by its heartbeat once
# the partition goes unused for PARTITION_IDLE_RELEASE_S), and for ten minutes
# every MutateRows on the target is held 15 s before Bigtable answers (a hot,
# overloaded target). A bundle's last batch commits in finish_bundle, after its
# reading round ended, and each commit now outlasts the idle release: the
# partition's lease must stay held through the commit, or its checkpoint finds
# the lease released, the bundle fails (LeaseLost), its retry does the same,
# and the partition stops acknowledging for as long as the overload lasts.
STALL_S = PARTITION_IDLE_RELEASE_S + 5
SLOW_COMMITS = SimConfig(
    hours=0.25, shards=2, partitions=2, lease=True, max_ack_lag_s=300, settle_s=900,
    writers=WriterMix(per_second=1.0, burst_share=0, unmappable_share=0),
    dataflow=DataflowChaos(workers=1, instances=1, stickiness=1.0, rebalance_share=0, process_failure_share=0,
                           finish_failure_share=0, worker_losses_per_hour=0),
    bigtable=BigtablePressure(exhausted_share=0, partial_share=0, slow_share=0, stall_from_s=60, stall_for_s=600,
                              stall_call_s=STALL_S, stall_tables=(TARGET,)))


@pytest.mark.parametrize("seed", [1, 2])
def test_a_commit_longer_than_the_idle_release_keeps_its_partition(seed):
    report = run_simulation(replace(SLOW_COMMITS, seed=seed))
    assert report.faults["slow calls"] >= 20  # the commits were held, each past the idle release
    assert report.faults["partition leases released idle"] > 0  # the heartbeats' idle release ran meanwhile
    assert report.clean, f"{report.verdict.problems}; scenario SLOW_COMMITS, seed {seed}"
    assert "LeaseLost" not in report.stream["errors"], f"{report.stream['errors']}"


# The same overload on every table: the state table's writes are held too, the
# reader's report among them, saved after the round read its records and before
# the sink commits them in finish_bundle. The round keeps its partition's lease
# in use through its report, or the lease is released as idle before the commit
# begins and every retry of the bundle fails the same way (LeaseLost).
SLOW_EVERY_WRITE = replace(SLOW_COMMITS, bigtable=replace(SLOW_COMMITS.bigtable, stall_tables=()))


@pytest.mark.parametrize("seed", [1, 2])
def test_a_report_longer_than_the_idle_release_keeps_its_partition(seed):
    report = run_simulation(replace(SLOW_EVERY_WRITE, seed=seed))
    assert report.faults["slow calls"] >= 20 and report.faults["partition leases released idle"] > 0
    assert report.clean, f"{report.verdict.problems}; scenario SLOW_EVERY_WRITE, seed {seed}"
    assert "LeaseLost" not in report.stream["errors"], f"{report.stream['errors']}"


def test_the_launch_takes_the_job_lease_through_a_refusing_bigtable():
    """The launcher retries taking the job's lease (coordinator.hold); so does the
    simulation's: seeds whose CheckAndMutateRow is refused RESOURCE_EXHAUSTED at
    launch run (the long run once stopped at such a seed)."""
    import random

    from ddb2bt.pipeline.testing.sim.bigtable import BigtablePressure, SimBigtable
    from ddb2bt.pipeline.testing.sim.clock import SimClock, simulated_time
    from ddb2bt.pipeline.testing.sim.leases import SimHeartbeats, job_lease

    refused = 0
    for seed in range(10):
        clock = SimClock()
        bigtable = SimBigtable(clock, random.Random(seed), BigtablePressure(exhausted_share=0.5))
        heartbeats = SimHeartbeats(clock, bigtable)
        with simulated_time(clock), heartbeats.installed():
            assert job_lease(heartbeats, "__state__", "sim").job == "sim"
        refused += bigtable.exhausted
    assert refused >= 3  # about half the launches met a refusal, and every one took its lease


def test_a_seed_whose_run_raises_is_a_failing_seed_with_its_replay_not_the_end_of_the_run(monkeypatch, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "bench" / "simulate.py"
    spec = importlib.util.spec_from_file_location("bench_simulate", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ran = []

    def run_simulation(config, progress=None):
        ran.append(config.seed)
        raise RuntimeError("boom")

    monkeypatch.setattr(bench, "run_simulation", run_simulation)
    assert bench.main(["--seeds", "2", "--first-seed", "7", "--hours", "0.01"]) == 1
    out = capsys.readouterr().out
    assert ran == [7, 8]  # the second seed still ran
    assert "FAILED seed 7: the run raised RuntimeError: boom" in out
    assert "replay: python bench/simulate.py --replay 8" in out
