"""Dataflow's workers as the simulation plays them: each worker is a process
(its own coordinators, shard directory: the product's per-process state), with
several DoFn instances (threads); an instance runs the product's fused stage —
the reading splittable DoFn, the mapping, the sink — one bundle at a time.

What a worker's process holds is swapped in while one of its bundles runs
(``ProcessGlobals``): the simulation runs every worker in one Python process,
one bundle at a time, and each must see only its own process's state.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Callable, Optional

from prometheus_client import CollectorRegistry

from ddb2bt.pipeline.clients.dynamodb import ShardDirectory
from ddb2bt.pipeline.control.coordinator import coordinator_for
from ddb2bt.pipeline.observe.metrics import PipelineMetrics
from ddb2bt.pipeline.sink.batching import BatchingWriter
from ddb2bt.pipeline.sink.config import SinkConfig
from ddb2bt.pipeline.source.stream_sdf import PartitionTracker, read_stream_partitions
from ddb2bt.pipeline.testing.sim.clock import SimClock
from ddb2bt.transforms.dofns import map_record
from ddb2bt.transforms.model import MappedBatch, RecordBatch

__all__ = ["ProcessGlobals", "SimTracker", "SimSink", "SimInstance", "SimWorker", "deep_size"]


@dataclass(frozen=True)
class ProcessGlobal:
    """One per-process object of the product: module, attribute, and how a new
    process makes it."""

    module: str
    attribute: str
    make: Callable[[SimClock, str], object]  # (clock, the process's name) -> its value


# The product's per-process state and identity (each simulated worker process
# gets its own: the simulation runs them all in one real process).
PROCESS_GLOBALS = (
    ProcessGlobal("ddb2bt.pipeline.control.coordinator", "_COORDINATORS", lambda clock, name: {}),
    ProcessGlobal("ddb2bt.pipeline.clients.dynamodb", "_DIRECTORY",
                  lambda clock, name: ShardDirectory(clock.monotonic)),
    ProcessGlobal("ddb2bt.pipeline.control.partitions", "WORKER_ID", lambda clock, name: f"worker:sim-{name}"),
    ProcessGlobal("ddb2bt.pipeline.control.lease", "node_id", lambda clock, name: lambda: f"sim-node-{name}"),
)


class ProcessGlobals:
    """One worker process's copy of PROCESS_GLOBALS, swapped in by ``active()``."""

    def __init__(self, clock: SimClock, name: str) -> None:
        self._values = {}
        for g in PROCESS_GLOBALS:
            module = importlib.import_module(g.module)
            if hasattr(module, g.attribute):  # a global the product no longer has is skipped
                self._values[(module, g.attribute)] = g.make(clock, name)

    @contextlib.contextmanager
    def active(self):
        saved = {key: getattr(key[0], key[1]) for key in self._values}
        for (module, attribute), value in self._values.items():
            setattr(module, attribute, value)
        try:
            yield
        finally:
            for (module, attribute), value in saved.items():
                setattr(module, attribute, value)


class SimTracker:
    """The product's PartitionTracker as Beam's SDK drives it: ``defer_remainder``
    asks for a checkpoint at the end of the call, ``split_now`` is the runner's
    checkpoint split (work rebalancing) in the middle of it."""

    def __init__(self, restriction) -> None:
        self.tracker = PartitionTracker(restriction)
        self.deferred_s: Optional[float] = None
        self.residual = None
        self.moved = False

    def current_restriction(self):
        return self.tracker.current_restriction()

    def try_claim(self, claim) -> bool:
        return self.tracker.try_claim(claim)

    def defer_remainder(self, delay=None) -> None:
        if self.residual is None:
            self.deferred_s = 0.0 if delay is None else delay.micros / 1e6

    def split_now(self) -> bool:
        split = self.tracker.try_split(0)
        if split is None:
            return False
        self.residual, self.moved = split[1], True
        return True

    def end_of_call(self):
        """(residual restriction or None when done, delay s): what the SDK does
        after process returns."""
        if self.residual is not None:
            return self.residual, 0.0
        if self.deferred_s is not None:
            split = self.tracker.try_split(0)
            if split is not None:
                return split[1], self.deferred_s
        self.tracker.check_done()
        return None, 0.0


class SimSink:
    """The sink DoFn's work on one instance, as ``sink/sink.py`` sets it up: the
    product's BatchingWriter over the job's state store, in stream order."""

    def __init__(self, bigtable, state_spec, mapping, config: SinkConfig, clock: SimClock, families: dict) -> None:
        self.mapping, self.clock = mapping, clock
        lease = config.lease
        fence = None
        writer = bigtable
        if lease is not None:  # as the sink DoFn's setup: every write fenced, partitions owned
            coordinator = coordinator_for(lease, state_spec)
            writer = coordinator.fence(bigtable, lease)
            fence = coordinator.partition_fence(lease)
        state = state_spec.store(writer)
        self.batcher = BatchingWriter(writer, state, config, PipelineMetrics(CollectorRegistry()),
                                      lambda table: families.get(table), now_ms=clock.wall_ms, sleep=clock.sleep,
                                      overlap=False, versions=state.versions(), partition_fence=fence)

    def add(self, element) -> list:
        if type(element) is RecordBatch:
            element = MappedBatch(tuple(map_record(self.mapping, r, self.clock.wall_ms) for r in element.records))
        return list(self.batcher.add(element))

    def finish(self) -> list:
        return list(self.batcher.flush())

    def close(self) -> None:
        self.batcher.close()


class SimInstance:
    """One DoFn instance (thread) of a worker: the reading DoFn and its sink."""

    def __init__(self, sources, make_sink: Callable[[], SimSink]) -> None:
        self.reader = read_stream_partitions(sources).fn
        self.reader.setup()
        self.sink = make_sink()

    def teardown(self) -> None:
        self.reader.teardown()
        self.sink.close()


class SimWorker:
    """A worker VM: its process (globals) and DoFn instances, made on first use."""

    def __init__(self, number: int, instances: int, clock: SimClock, make_instance: Callable[[], SimInstance],
                 heartbeats=None) -> None:
        self.number, self.clock = number, clock
        self.make_instance = make_instance
        self.heartbeats = heartbeats  # the leases' heartbeats (SimHeartbeats), told which worker runs
        self.instances: list = [None] * instances
        self.incarnation = 0
        self.process = ProcessGlobals(clock, f"{number}.0")
        self.alive = True
        self.down_until = 0.0
        self.losses = 0

    def instance(self, i: int) -> SimInstance:
        if self.instances[i] is None:
            with self.active():
                self.instances[i] = self.make_instance()
        return self.instances[i]

    def discard(self, i: int) -> None:
        """After a failed bundle the SDK drops the instance (torn down)."""
        inst, self.instances[i] = self.instances[i], None
        if inst is not None:
            with self.active():
                inst.teardown()

    def lose(self, restart_s: float) -> None:
        """The VM is gone: no teardown, nothing flushed; a new one later."""
        self.alive, self.down_until = False, self.clock.now_s + restart_s
        self.instances = [None] * len(self.instances)
        self.losses += 1
        if self.heartbeats is not None:
            self.heartbeats.forget(self)

    def restart(self) -> None:
        self.alive = True
        self.incarnation += 1
        self.process = ProcessGlobals(self.clock, f"{self.number}.{self.incarnation}")

    @contextlib.contextmanager
    def active(self):
        """This worker's process is the one running (its globals, its heartbeats)."""
        previous = self.heartbeats.current if self.heartbeats is not None else None
        if self.heartbeats is not None:
            self.heartbeats.current = self
        try:
            with self.process.active():
                yield
        finally:
            if self.heartbeats is not None:
                self.heartbeats.current = previous

    def footprint(self, shared_ids: set) -> int:
        """Bytes this worker's process holds: its DoFn instances and process state."""
        return deep_size([self.instances, self.process], shared_ids)


def deep_size(root, shared_ids: set) -> int:
    """Bytes of the objects reachable from ``root``, without modules, classes,
    functions and the objects in ``shared_ids`` (the simulated services: what a
    worker reaches but does not hold)."""
    import gc
    import sys
    import types

    skip = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
    seen, stack, total = set(shared_ids), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj, 0)
        stack.extend(gc.get_referents(obj))
    return total
