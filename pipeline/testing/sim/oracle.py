"""What a simulated run must show, checked from the simulated services' own
records, never from what the product says of itself:

* the target equals the mapping of the final source table: 0 divergent cells
  (``pipeline/verify/compare.py``, verify's own comparison);
* no change stays unacknowledged (checkpointed) longer than a bound while the
  job runs, and every change is acknowledged once the writers stop (no wedge);
* AWS's limits (5 GetRecords/s per shard, 10 DescribeStream/s per stream) and
  Bigtable's (100,000 mutations, 256 MB per request) never exceeded;
* every change the mapping refuses is one dead letter: none missing, none twice.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from ddb2bt.pipeline.control.state import RESUME_AT_TRIM_HORIZON
from ddb2bt.pipeline.verify.compare import diff_layout, expected_layout

__all__ = ["Verdict", "Oracle"]


@dataclass
class Verdict:
    problems: list = field(default_factory=list)  # one line each; empty: the run is clean
    divergent_cells: int = 0
    max_ack_lag_s: float = 0.0
    unacknowledged_at_end: int = 0
    dead_letters: int = 0

    @property
    def clean(self) -> bool:
        return not self.problems


class Oracle:
    def __init__(self, stream, bigtable, state, writers, mapping, ledger, max_ack_lag_s: float) -> None:
        self.stream, self.bigtable, self.state, self.writers = stream, bigtable, state, writers
        self.mapping, self.ledger = mapping, ledger
        self.max_ack_lag_s = max_ack_lag_s
        self.verdict = Verdict()
        self._wedged: set = set()

    def unacknowledged(self) -> dict:
        """{shard id: creation ms of its oldest change not checkpointed}."""
        checkpoints = self.state.load_checkpoints(self.stream.stream_arn)
        out = {}
        for shard_id, shard in self.stream.shards.items():
            if not shard.listed:
                continue
            ckpt = checkpoints.get(shard_id)
            if ckpt is not None and ckpt.finished:
                continue
            seq = ckpt.sequence_number if ckpt is not None and ckpt.sequence_number != RESUME_AT_TRIM_HORIZON \
                else None
            oldest: Optional[int] = self.stream.unread_since(shard_id, seq)
            if oldest is not None:
                out[shard_id] = oldest
        return out

    def sample(self) -> None:
        """While the job runs: the oldest unacknowledged change is younger than the bound."""
        now_ms = self.stream.clock.wall_ms()
        for shard_id, oldest in self.unacknowledged().items():
            lag = (now_ms - oldest) / 1000
            self.verdict.max_ack_lag_s = max(self.verdict.max_ack_lag_s, lag)
            if lag > self.max_ack_lag_s and shard_id not in self._wedged:
                self._wedged.add(shard_id)
                self.verdict.problems.append(
                    f"wedge: shard {shard_id} has a change unacknowledged for {lag:.0f}s "
                    f"(bound {self.max_ack_lag_s:.0f}s) at t={self.stream.clock.now_s:.0f}s")

    def finish(self, target: str) -> Verdict:
        v = self.verdict
        left = self.unacknowledged()
        v.unacknowledged_at_end = len(left)
        if left:
            v.problems.append(f"wedge: {len(left)} shard(s) with unacknowledged changes after the writers stopped: "
                              f"{sorted(left)[:3]}")
        for name, lim in self.ledger.limits.items():
            if lim.over:
                v.problems.append(f"limit: {name} exceeded {lim.over} time(s) (peak {lim.peak}/s, "
                                  f"limit {lim.per_second}/s, on {len(lim.over_keys)} key(s))")
        for table_id, mutations, size in self.bigtable.over_limit[:3]:
            v.problems.append(f"limit: a request to {table_id} of {mutations} mutations, {size} bytes")
        self._dead_letters()
        items = [item for key, item in self.writers.table.items() if key not in self.writers.unmappable]
        expected = expected_layout(self.mapping, items).get(target, {})
        diff = diff_layout(expected, self.bigtable.read_table(target))
        v.divergent_cells = (len(diff.missing_rows) + len(diff.extra_rows) + len(diff.missing_cells)
                             + len(diff.extra_cells) + len(diff.different_cells))
        if v.divergent_cells:
            v.problems.append(f"divergence: {diff.summary()}; e.g. rows "
                              f"{sorted(diff.rows())[:3]}")
        return v

    def _dead_letters(self) -> None:
        letters = self.state.list_dead_letters()
        self.verdict.dead_letters = len(letters)
        twice = {pos: n for pos, n in Counter(d.get("position", "") for d in letters).items() if n > 1}
        if twice:
            self.verdict.problems.append(f"dead letters: {len(twice)} change(s) stored more than once, "
                                         f"e.g. {sorted(twice)[:2]}")
        unmappable = len(self.writers.unmappable)
        stored = len({d.get("position", "") for d in letters})
        if stored != unmappable:
            self.verdict.problems.append(f"dead letters: {unmappable} unmappable change(s) written, "
                                         f"{stored} dead-lettered")
