"""The Bigtable sink stage: ``write_to_bigtable`` (and its multi-table form), the
ParDo of ``_WriteToBigtableFn``, the thin DoFn around a ``BatchingWriter``
(``batching.py``: batching and commit order) or, for a source that may deliver
out of order, a ``GuardedBatchingWriter`` (``guarded.py``). ``SinkConfig``
(``config.py``) and ``BatchingWriter`` are importable from here too.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import apache_beam as beam
from apache_beam.transforms.window import GlobalWindows

from ddb2bt.transforms.dofns import PerStreamFn
from ddb2bt.pipeline.clients.bigtable.admin import process_families
from ddb2bt.pipeline.sink.collector import tune_collector
from ddb2bt.pipeline.control.coordinator import coordinator_for
from ddb2bt.pipeline.sink.batching import BatchingWriter
from ddb2bt.pipeline.sink.config import SinkConfig
from ddb2bt.pipeline.observe.metrics import default_metrics, start_pusher

__all__ = ["SinkConfig", "BatchingWriter", "write_to_bigtable", "write_to_bigtable_per_stream"]

# Column families are listed again at most this often per table and process.
FAMILY_CACHE_S = 60.0
# A change naming a family the cached list lacks makes the process list again,
# at most this often: a family added by create-table is used at once, and a
# stream of changes to a truly missing family costs one listing per 5 s.
FAMILY_RECHECK_S = 5.0


class _FamilyCache:
    """Column families per table, refreshed at most once a minute, so a family
    added by `create-table` while the job runs is picked up. Looked up per row
    without a lock; on expiry it asks the process's shared listing
    (``process_families``): one admin client and one listing per table per
    minute per process, however many sink DoFns it runs."""

    def __init__(self, spec, now: Callable[[], float] = time.monotonic) -> None:
        self._project, self._instance = spec.project, spec.instance
        self._now = now
        self._cache: dict = {}

    def __call__(self, table: str) -> Optional[frozenset]:
        cached = self._cache.get(table)
        if cached is not None and self._now() - cached[0] < FAMILY_CACHE_S:
            return cached[1]
        families = process_families(self._project, self._instance, table, FAMILY_CACHE_S, self._now)
        self._cache[table] = (self._now(), families)
        return families

    def refresh(self, table: str) -> Optional[frozenset]:
        """The families again, from a listing at most FAMILY_RECHECK_S old: asked
        when a change names a family the cached list lacks (one added since)."""
        families = process_families(self._project, self._instance, table, FAMILY_RECHECK_S, self._now)
        self._cache[table] = (self._now(), families)
        return families


class _WriteToBigtableFn(beam.DoFn):
    """MappedChange | ShardClosed → (writes, checkpoints) → DeadLetter output."""

    def __init__(self, bigtable, state_spec, config: SinkConfig = SinkConfig(),
                 check_families: bool = True, pushgateway: Optional[str] = None) -> None:
        self._bigtable = bigtable
        self._state_spec = state_spec
        self._config = config
        self._check_families = check_families
        self._pushgateway = pushgateway

    def setup(self) -> None:
        tune_collector()  # pages of changes in flight: collector.py says why
        if self._pushgateway:  # Dataflow workers cannot be scraped: they push
            start_pusher(self._pushgateway, job=f"ddb2bt-{self._state_spec.job if self._state_spec else 'job'}")

        # The job's coordinator (control/coordinator.py) decides what this sink may
        # write: the fence goes on the writer, so data writes, dead letters and
        # checkpoints are all checked right before their RPC.
        lease = self._config.lease
        owner = lease or self._state_spec
        self._coordinator = coordinator_for(owner, self._state_spec) if owner is not None else None
        writer = self._bigtable.writer()
        self._writer = self._coordinator.fence(writer, lease) if self._coordinator is not None else writer
        self._state = self._state_spec.store(self._writer) if self._state_spec else None
        if self._coordinator is not None and self._state is not None:
            self._coordinator.guard(self._state)  # no retry of a state call outlives the lease
        self._families = _FamilyCache(self._bigtable) if self._check_families else None
        coordinator = self._coordinator
        marking = coordinator.marking if coordinator and self._state else None
        if self._config.ordering_guard:
            # No partition fence needed: every guarded write is a compare-and-set on
            # the item's clock, so a zombie's older change loses (docs/design.md §10).
            # inside: guarded.py builds on this module at its top (a module cycle)
            from ddb2bt.pipeline.sink.guarded import GuardedBatchingWriter

            self._batcher = GuardedBatchingWriter(self._writer, self._state, self._config, default_metrics(),
                                                  self._families, overlap=self._config.overlap_writes,
                                                  marking=marking)
            return
        self._batcher = BatchingWriter(self._writer, self._state, self._config, default_metrics(), self._families,
                                       overlap=self._config.overlap_writes,
                                       versions=self._state.versions() if self._state is not None else None,
                                       partition_fence=coordinator.partition_fence(lease) if coordinator else None,
                                       marking=marking)

    def process(self, element):
        yield from self._batcher.add(element)

    def finish_bundle(self):
        for dead in self._batcher.flush():
            yield GlobalWindows.windowed_value(dead)

    def teardown(self) -> None:
        batcher = getattr(self, "_batcher", None)
        if batcher is not None:
            batcher.close()
        state = getattr(self, "_state", None)
        if state is not None:
            state.close()
        writer = getattr(self, "_writer", None)
        if writer is not None:
            writer.close()


# A ParDo, not a composite around it: the step names stay as they are (Dataflow
# updates a running job in place by step name).
def write_to_bigtable(bigtable, state, sink: SinkConfig, *, pushgateway: Optional[str] = None) -> beam.ParDo:
    """The sink stage: ``MappedBatch | ShardClosed`` → ``DeadLetter``, written to
    ``bigtable`` with checkpoints and dead letters in ``state``."""
    return beam.ParDo(_WriteToBigtableFn(bigtable, state, sink, pushgateway=pushgateway))


def write_to_bigtable_per_stream(per_stream: dict) -> beam.ParDo:
    """The sink stage of a multi-table job: ``{stream ARN: (state, sink,
    pushgateway)}``, each stream's changes written to its own target
    (``state.bigtable``) with its own checkpoints, dead letters and lease."""
    return beam.ParDo(PerStreamFn({arn: _WriteToBigtableFn(state.bigtable, state, sink, pushgateway=push)
                                   for arn, (state, sink, push) in per_stream.items()}))
