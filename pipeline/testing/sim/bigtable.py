"""The Bigtable side of the simulation: the in-memory Bigtable
(``pipeline/testing/fakes.py``) on the simulated clock, under pressure:

* every MutateRows and CheckAndMutateRow takes simulated time (a latency drawn
  per call, sometimes slow);
* a stretch of overload (``stall_*``): for a while every MutateRows is held
  before it is answered (a slow call: counted as one);
* RESOURCE_EXHAUSTED (the whole request refused, the server overloaded) and
  requests partly failed (some entries UNAVAILABLE, the rest applied);
* Bigtable's request limits enforced: 100,000 mutations and 256 MB per
  request, past which the request fails INVALID_ARGUMENT — and the ledger
  counts it (a limit exceeded is a finding, whatever the writer does next).

Its own bookkeeping stays small over a day of simulated time: calls are
counted, not listed, and each row's newest cells are kept between reads (the
state rows are read far more often than written: checkpoints, reports, leases).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence

from ddb2bt.pipeline.clients.bigtable.errors import BigtablePermanent, BigtableRetryable, EntryStatus
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.pipeline.testing.sim.clock import SimClock
from ddb2bt.pipeline.testing.sim.ledger import CallCount
from ddb2bt.transforms.limits import MAX_MUTATIONS_PER_REQUEST, MAX_REQUEST_BYTES

__all__ = ["BigtablePressure", "SimBigtable"]

RESOURCE_EXHAUSTED = 8
UNAVAILABLE = 14


@dataclass(frozen=True)
class BigtablePressure:
    latency_s: float = 0.01  # a call's usual time
    slow_share: float = 0.01  # calls that take ``slow_s`` instead
    slow_s: float = 2.0
    exhausted_share: float = 0.01  # requests refused whole: RESOURCE_EXHAUSTED
    partial_share: float = 0.01  # requests with some entries UNAVAILABLE
    check_and_mutate_s: float = 0.02  # a CheckAndMutateRow's time
    # A stretch of overload: from ``stall_from_s`` (simulated) for ``stall_for_s``
    # every MutateRows on ``stall_tables`` (empty: on every table) is held
    # ``stall_call_s`` (well within its 60 s deadline) before it is answered.
    # CheckAndMutateRow (the leases' renewals among them) is not held.
    stall_from_s: float = 0.0
    stall_for_s: float = 0.0
    stall_call_s: float = 0.0
    stall_tables: tuple = ()


class SimBigtable(InMemoryBigtable):
    """The target and the state table (see the module docstring)."""

    def __init__(self, clock: SimClock, rng: random.Random, pressure: BigtablePressure,
                 families: Optional[dict] = None) -> None:
        super().__init__(families=families, fault=self._fault)
        self.clock, self.rng, self.pressure = clock, rng, pressure
        self.requests = 0
        self.exhausted = self.partial = self.slow = 0
        self.over_limit: list = []  # (what, mutations, bytes) of requests past Bigtable's limits
        self.peak_mutations = 0
        self.calls = CallCount()
        self._latest: dict = {}  # table -> {row key: {(family, qualifier): newest value}}, dropped on a write

    def _takes_time(self) -> None:
        """A call's simulated time, spent before the store is touched (outside its
        lock: other threads' calls, a heartbeat's renewal, run meanwhile)."""
        p, rng = self.pressure, self.rng
        self.requests += 1
        slow = rng.random() < p.slow_share
        self.slow += slow
        self.clock.sleep(p.slow_s if slow else p.latency_s * rng.uniform(0.5, 1.5))

    def mutate_rows(self, table_id: str, entries: Sequence) -> list:
        self._takes_time()
        self._held(table_id)
        return super().mutate_rows(table_id, entries)

    def _held(self, table_id: str) -> None:
        """Within the overload stretch, the call is held ``stall_call_s``: in
        one-second steps, so the heartbeats run meanwhile as their threads would."""
        p = self.pressure
        if not (p.stall_call_s > 0 and p.stall_from_s <= self.clock.now_s < p.stall_from_s + p.stall_for_s
                and (not p.stall_tables or table_id in p.stall_tables)):
            return
        self.slow += 1
        left = p.stall_call_s
        while left > 0:
            self.clock.sleep(min(1.0, left))
            left -= 1.0

    def swap_cell(self, table_id: str, row_key: bytes, *args, **kwargs) -> bool:
        self._takes_time()
        self._latest.get(table_id, {}).pop(row_key, None)
        return super().swap_cell(table_id, row_key, *args, **kwargs)

    def _apply(self, table_id: str, row_key: bytes, mutations: Sequence):
        self._latest.get(table_id, {}).pop(row_key, None)
        return super()._apply(table_id, row_key, mutations)

    def latest(self, table_id: str) -> dict:
        """As the in-memory Bigtable's, each row's newest cells computed once per write."""
        return self._newest(table_id, b"")

    def read_prefix(self, prefix: bytes, limit: Optional[int] = None) -> dict:
        rows = self._newest("__state__", prefix)
        return rows if limit is None else dict(sorted(rows.items())[:limit])

    def read_keys(self, keys: Sequence) -> dict:
        with self._lock:
            rows, cache = self.tables.get("__state__", {}), self._latest.setdefault("__state__", {})
            out = {}
            for key in keys:
                row = rows.get(key)
                if row:
                    out[key] = _newest_cells(cache, key, row)
            return out

    def _newest(self, table_id: str, prefix: bytes) -> dict:
        """{row key: {(family, qualifier): newest value}} of the rows starting with ``prefix``."""
        with self._lock:
            cache = self._latest.setdefault(table_id, {})
            out = {}
            for key, row in self.tables.get(table_id, {}).items():
                if key.startswith(prefix):
                    out[key] = _newest_cells(cache, key, row)
            return out

    def _fault(self, table_id: str, entries: Sequence, call_no: int) -> Optional[list]:
        p, rng = self.pressure, self.rng
        mutations = sum(len(m) for _, m in entries)
        size = sum(len(k) + sum(len(getattr(m, "value", b"")) + len(m.qualifier) + len(m.family) for m in ms)
                   for k, ms in entries)
        self.peak_mutations = max(self.peak_mutations, mutations)
        if mutations > MAX_MUTATIONS_PER_REQUEST or size > MAX_REQUEST_BYTES:
            self.over_limit.append((table_id, mutations, size))
            raise BigtablePermanent(f"INVALID_ARGUMENT: request of {mutations} mutations, {size} bytes "
                                    "is over Bigtable's limits")
        if rng.random() < p.exhausted_share:
            self.exhausted += 1
            raise BigtableRetryable("RESOURCE_EXHAUSTED: server overloaded (simulated)")
        if len(entries) > 1 and rng.random() < p.partial_share:
            self.partial += 1
            return [EntryStatus(UNAVAILABLE, "UNAVAILABLE (simulated)") if rng.random() < 0.3 else None
                    for _ in entries]
        return None

    def check_and_mutate(self, table_id: str, row_key: bytes, unless, mutations: Sequence) -> bool:
        self._takes_time()
        self.clock.sleep(self.pressure.check_and_mutate_s)
        return super().check_and_mutate(table_id, row_key, unless, mutations)

    def read_table(self, table_id: str) -> dict:
        """{row: {(family, qualifier): [(ts, value)] newest first}}: what verify reads."""
        return {k: {c: sorted(v.items(), reverse=True) for c, v in cols.items()}
                for k, cols in self.versions(table_id).items()}


def _newest_cells(cache: dict, key: bytes, row: dict) -> dict:
    """A copy of the row's newest cells, computed once per write (``cache``)."""
    cells = cache.get(key)
    if cells is None:
        cells = cache[key] = {col: versions[max(versions)] for col, versions in row.items()}
    return dict(cells)
