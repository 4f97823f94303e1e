"""One simulated run: a seed and a configuration in, a report out.

Everything random — the writers, the shards' lives, Bigtable's faults, where
each bundle runs, which fail, the product's own retry jitter — is drawn from
the one seed, and time is the simulated clock's: the same seed and
configuration replay the same run, call for call.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.observe.metrics import default_metrics
from ddb2bt.pipeline.sink.config import SinkConfig
from ddb2bt.pipeline.source.stream_sdf import StreamSource
from ddb2bt.pipeline.source.stream_source import ReaderOptions, StreamPartition
from ddb2bt.pipeline.testing.fakes import FAKE_CLIENTS, RegisteredClient
from ddb2bt.pipeline.testing.sim.aws import SimStream, StreamLimits
from ddb2bt.pipeline.testing.sim.bigtable import BigtablePressure, SimBigtable
from ddb2bt.pipeline.testing.sim.clock import SimClock, simulated_time
from ddb2bt.pipeline.testing.sim.dataflow import DataflowChaos, PartitionRun, SimDataflow
from ddb2bt.pipeline.testing.sim.leases import SimHeartbeats, job_lease
from ddb2bt.pipeline.testing.sim.ledger import CallLedger
from ddb2bt.pipeline.testing.sim.oracle import Oracle, Verdict
from ddb2bt.pipeline.testing.sim.workers import SimInstance, SimSink, SimWorker
from ddb2bt.pipeline.testing.sim.writers import WriterMix, Writers
from ddb2bt.transforms.config import parse_mapping

__all__ = ["SimConfig", "SimReport", "run_simulation", "MAPPING"]

TARGET = "catalog"
STATE_TABLE = "__state__"  # the in-memory Bigtable's state table (fakes.InMemoryBigtable)
MAPPING = parse_mapping({
    "version": 1, "name": "sim", "source": {"table": "SimTable", "key": {"partition": "pk", "sort": "sk"}},
    "target": {"project": "sim", "instance": "sim", "table": TARGET},
    "families": {"SKU": {"max_versions": 1}},
    "rules": [{"name": "item", "row_key": "{pk}#{sk}",
               "columns": {"Description": {"column": "SKU:Description", "encoding": "utf8"},
                           "Price": {"column": "SKU:Price", "encoding": "int64"}},
               "other_attributes": {"mode": "column", "family": "SKU", "encoding": "auto"}}],
}, "<simulation>")


@dataclass(frozen=True)
class SimConfig:
    seed: int = 1
    hours: float = 1.0  # simulated time the writers write
    shards: int = 8  # open shards at the start
    partitions: int = 6
    start: str = "trim_horizon"
    # The writers begin this long after the job (at --start latest a change made
    # before the readers' first iterators is not owed).
    writers_after_s: float = 0.0
    settle_s: float = 1800.0  # after the writers stop, time the job has to acknowledge everything
    max_ack_lag_s: float = 900.0  # no change unacknowledged longer while the job runs
    stream: StreamLimits = StreamLimits()
    writers: WriterMix = WriterMix()
    bigtable: BigtablePressure = BigtablePressure()
    dataflow: DataflowChaos = DataflowChaos()
    reader: ReaderOptions = ReaderOptions(sleep_when_idle=False)
    # The job's lease and its partitions' leases (Dataflow's: shared by the
    # workers, each partition owned by one worker process), heartbeats and all.
    lease: bool = False
    measure_memory: bool = False  # every 10 simulated minutes, each worker's footprint (slow at scale)
    sink: SinkConfig = SinkConfig(overlap_writes=False, parallel_requests=1,
                                  retry=RetryPolicy(initial_s=0.2, max_backoff_s=10.0, deadline_s=60.0))

    def command(self) -> str:
        """The bench command that replays this run (for a run built from the
        bench's options; a test's scenario names its own configuration too)."""
        d = self.dataflow
        return (f"python bench/simulate.py --replay {self.seed} --hours {self.hours:g} --shards {self.shards} "
                f"--workers {d.workers} --instances {d.instances} --partitions {self.partitions} "
                f"--start {self.start} --writes-per-s {self.writers.per_second:g} "
                f"--shard-life-h {self.stream.shard_life_s / 3600:g}" + (" --lease" if self.lease else ""))


@dataclass
class SimReport:
    config: SimConfig
    verdict: Verdict
    simulated_s: float = 0.0
    faults: dict = field(default_factory=dict)
    calls: dict = field(default_factory=dict)
    stream: dict = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def clean(self) -> bool:
        return self.verdict.clean


# What the DoFns reach by name: Beam pickles a DoFn with its sources, and a
# simulated service (its clock, its locks) must not travel with it. A run
# registers its stream (fakes.FAKE_CLIENTS) and its state-store factories here.
STATE_STORES: dict = {}


@dataclass(frozen=True)
class SimStateSpec:
    """The job's StateSpec as the reading DoFn uses it: a picklable factory of
    its state store (the run's, found by ``key``)."""

    job: str
    key: str

    def __call__(self) -> StateStore:
        return self.store()

    def store(self, writer=None) -> StateStore:
        """The job's state store, through ``writer`` (a fenced one) when given."""
        return STATE_STORES[self.key](writer)


def _rng(parent: random.Random) -> random.Random:
    return random.Random(parent.getrandbits(64))


def run_simulation(config: SimConfig, progress: Optional[Callable[[float], None]] = None) -> SimReport:
    """Runs ``config`` (see the module docstring); ``progress(fraction)`` is told as it goes."""
    import time as wall

    started = wall.perf_counter()
    root = random.Random(config.seed)
    clock, ledger = SimClock(), CallLedger()
    saved_random = random.getstate()
    random.seed(root.getrandbits(64))  # the product's own jitter (retry back-offs)
    key = f"sim-{id(clock)}"
    try:
        with simulated_time(clock):
            run = _Run(config, root, clock, ledger, key)
            with run.heartbeats.installed():
                report = run.run(progress)
    finally:
        random.setstate(saved_random)
        STATE_STORES.pop(key, None)
        FAKE_CLIENTS.pop(key, None)
    report.wall_s = wall.perf_counter() - started
    return report


class _Run:
    def __init__(self, config: SimConfig, root: random.Random, clock: SimClock, ledger: CallLedger,
                 key: str) -> None:
        self.config, self.clock, self.ledger = config, clock, ledger
        self.stream = SimStream(clock, _rng(root), ledger, config.shards, config.stream)
        self.bigtable = SimBigtable(clock, _rng(root), config.bigtable, families={TARGET: {"SKU"}})
        self.writers = Writers(self.stream, _rng(root), config.writers)
        self.state = StateStore(self.bigtable, "sim", clock.wall_ms)
        self.rng = _rng(root)
        self.heartbeats = SimHeartbeats(clock, self.bigtable)
        reader, sink_config = replace(config.reader, start=config.start), config.sink
        if config.lease:
            with self.heartbeats.installed():
                lease = job_lease(self.heartbeats, STATE_TABLE, "sim")
            reader, sink_config = replace(reader, lease=lease), replace(sink_config, lease=lease)
        STATE_STORES[key] = lambda writer=None: StateStore(writer or self.bigtable, "sim", clock.wall_ms)
        FAKE_CLIENTS[key] = self.stream
        spec = SimStateSpec("sim", key)
        sources = [StreamSource(self.stream.stream_arn, reader, RegisteredClient(key), spec, config.partitions)]

        def make_sink() -> SimSink:
            return SimSink(self.bigtable, spec, MAPPING, sink_config, clock, {TARGET: frozenset({"SKU"})})

        chaos = config.dataflow
        workers = [SimWorker(n, chaos.instances, clock, lambda: SimInstance(sources, make_sink), self.heartbeats)
                   for n in range(chaos.workers)]
        runs = [PartitionRun(StreamPartition(self.stream.stream_arn, i, config.partitions),
                             reader_restriction()) for i in range(config.partitions)]
        self.dataflow = SimDataflow(clock, _rng(root), chaos, workers, runs)
        self.oracle = Oracle(self.stream, self.bigtable, self.state, self.writers, MAPPING, ledger,
                             config.max_ack_lag_s)
        self.worker_losses = 0
        self.peak_worker_bytes = 0
        self._shared = {id(self.stream), id(self.bigtable), id(clock), id(MAPPING), id(self.writers), id(ledger),
                        id(default_metrics())}

    def _next_loss(self) -> float:
        rate = self.config.dataflow.worker_losses_per_hour
        return self.clock.now_s + self.rng.expovariate(rate / 3600) if rate > 0 else float("inf")

    def run(self, progress) -> SimReport:
        config, clock, df = self.config, self.clock, self.dataflow
        write_end = config.hours * 3600
        end = write_end + config.settle_s
        next_second, next_minute, next_loss = 0.0, 60.0, self._next_loss()
        while True:
            t = min(df.next_at(), next_second, next_minute)
            if t >= end:
                break
            if t == next_second:
                clock.advance_to(t)
                if config.writers_after_s <= t < write_end:
                    self.writers.second()
                self.heartbeats.run_due()
                next_second += 1.0
                continue
            if t == next_minute:
                clock.advance_to(t)
                self._minute(write_end, next_loss)
                if clock.now_s >= next_loss:
                    next_loss = self._next_loss()
                next_minute += 60.0
                if progress is not None:
                    progress(min(1.0, clock.now_s / end))
                if t >= write_end and not self.oracle.unacknowledged():
                    break  # everything acknowledged: drain
                continue
            df.step()
        if config.measure_memory:
            self.measure()
        df.drain()
        return self._report()

    def _minute(self, write_end: float, next_loss: float) -> None:
        self.stream.maintain()
        self.dataflow.restart_due()
        if self.clock.now_s >= next_loss and self.dataflow.lose_worker() is not None:
            self.worker_losses += 1
        if self.clock.now_s < write_end:
            self.oracle.sample()
        if self.config.measure_memory and int(self.clock.now_s) % 600 == 0:
            self.measure()

    def measure(self) -> None:
        for worker in self.dataflow.workers:
            self.peak_worker_bytes = max(self.peak_worker_bytes, worker.footprint(self._shared))

    def _report(self) -> SimReport:
        df, bt, stream, w = self.dataflow, self.bigtable, self.stream, self.writers
        verdict = self.oracle.finish(TARGET)
        faults = {"worker losses": self.worker_losses, "bundle failures (injected)": df.errors.get("InjectedFailure", 0),
                  "bundle failures (other)": df.failures - df.errors.get("InjectedFailure", 0),
                  "rebalance splits": df.rebalances, "bundle moves": df.moves,
                  "RESOURCE_EXHAUSTED": bt.exhausted, "partial MutateRows": bt.partial, "slow calls": bt.slow,
                  "partition leases released idle": self.heartbeats.released_idle,
                  "rollovers": stream.rollovers, "splits": stream.splits, "records trimmed": stream.trimmed,
                  "bursts": w.bursts}
        return SimReport(self.config, verdict, self.clock.now_s, faults, self.ledger.summary(),
                         {"changes": w.changes, "deletes": w.deletes, "shards": len(stream.shards),
                          "bundles": df.bundles, "errors": dict(df.errors),
                          "peak worker bytes": self.peak_worker_bytes})


def reader_restriction():
    from ddb2bt.pipeline.source.stream_sdf import PartitionRestrictionProvider

    return PartitionRestrictionProvider().initial_restriction(None)
