"""A restriction tracker that splits only at checkpoints, shared by the stream
partitions (source/stream_sdf.py) and the backfill parts (cutover/backfill_sdf.py).

Both read something that must not be read by two workers at once: a shard
(per-row order, and DynamoDB Streams' two readers per shard), or a backfill part
whose progress is one resume position in the state table. So a runner may only
checkpoint them (``try_split(0)``: the primary ends at the last claim, the rest
is the residual), never split at a fraction of what remains.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from apache_beam.io.iobase import RestrictionProgress, RestrictionTracker

__all__ = ["CheckpointOnlyTracker"]


class CheckpointOnlyTracker(RestrictionTracker):
    """Tracks a frozen restriction with a ``done`` field; ``apply(restriction,
    claim)`` returns the restriction after a claim. Subclasses say whether the
    work is bounded and how much of it is done."""

    bounded = True
    what = "restriction"

    def __init__(self, restriction, apply: Callable) -> None:
        self._r = restriction
        self._apply = apply
        self._split = False

    def current_restriction(self):
        return self._r

    def try_claim(self, claim) -> bool:
        if self._split or self._r.done:
            return False
        self._r = self._apply(self._r, claim)
        return True

    def try_split(self, fraction_of_remainder):
        if self._split or self._r.done or fraction_of_remainder != 0:
            return None
        self._split = True
        residual = self._r
        self._r = replace(self._r, done=True)
        return self._r, residual

    def check_done(self) -> None:
        if not self._r.done:
            raise ValueError(f"{self.what} not finished: {self._r}")

    def is_bounded(self) -> bool:
        return self.bounded

    def completed(self) -> float:
        return 0

    def current_progress(self) -> RestrictionProgress:
        return RestrictionProgress(completed=self.completed(), remaining=0 if self._r.done else 1)
