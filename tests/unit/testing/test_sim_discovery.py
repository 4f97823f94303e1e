"""Discovery at scale in the simulation: many workers starting at once list
every page of a large stream; together they stay within AWS's 10
DescribeStream calls per second per stream (the shared schedule,
pipeline/control/shared_rate.py), and the run is otherwise clean."""
from __future__ import annotations

from ddb2bt.pipeline.testing.sim.bigtable import BigtablePressure
from ddb2bt.pipeline.testing.sim.dataflow import DataflowChaos
from ddb2bt.pipeline.testing.sim.scenario import SimConfig, run_simulation
from ddb2bt.pipeline.testing.sim.writers import WriterMix

CALM = BigtablePressure(exhausted_share=0.0, partial_share=0.0, slow_share=0.0)


def test_sixteen_workers_starting_together_stay_within_the_describe_limit():
    # 400 shards (4 pages) on 16 workers: 64 calls in the first moments, six
    # times the per-second limit, if every worker lists as soon as it starts.
    config = SimConfig(seed=3, hours=0.002, shards=400, partitions=16, writers=WriterMix(per_second=2),
                       dataflow=DataflowChaos(workers=16, instances=1, process_failure_share=0.0,
                                              finish_failure_share=0.0, worker_losses_per_hour=0.0),
                       bigtable=CALM, settle_s=60.0, lease=True)  # Dataflow's: one lease shared by the workers
    report = run_simulation(config)
    describe = report.calls["DescribeStream per stream"]
    assert describe["calls"] >= 64, describe  # every worker listed the whole stream
    # the shared schedule: slots 1/6 s apart, 7 in this run's busiest second
    assert describe["over"] == 0 and describe["peak_per_s"] <= 7, describe
    assert report.clean, report.verdict.problems
