"""When a migration's tail has caught up: in time, not "the last round found
nothing new" (docs/design.md §7.8).

A production table never goes quiet, so a reader of a busy table always finds
something new; and an empty GetRecords page does not mean the head either (both
DynamoDB Streams and Kinesis document empty pages in the middle of a shard). So
a shard's lag is measured in time: now − the creation time of the oldest change
read and not yet applied, else now − the newest applied change's (or the
service's own "behind latest" figure where a page carries one). A shard counts
as at the head (lag 0) only after several empty pages in a row over a few
seconds: a quiet shard, whose newest change may be hours old. A table goes LIVE
when every shard's applied position has passed the handoff and its lag has
stayed under ``LIVE_LAG_BOUND_S`` for ``LIVE_SETTLE_S``, whatever the write rate.

Pure: views of the shards in, decisions out; the clock is the caller's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from ddb2bt.pipeline.observe.metrics import ShardView  # the lag tracker's view of a shard, which the rule reads

# LIVE gates the advice to verify and cut over, nothing else (no data is at
# stake: docs/design.md §6.6). The bound is half of status's READY bound (60 s a
# shard), so a table that goes LIVE is READY on lag too; it is far above what a
# caught-up tail shows under any write rate (AWS stamps records to the whole
# second, the reader polls about once a second, a batch is written in well
# under a second: a few seconds in all).
LIVE_LAG_BOUND_S = 30.0
# ... and must stay under it this long: one keeper step (control/keeper.py), so
# a table that is still draining a backlog between two looks is not taken for
# caught up on one good look.
LIVE_SETTLE_S = 10.0
# An empty page is not the head: this many empty pages in a row, spanning at
# least this long, are. An empty page mid-shard is followed by records on the
# next call or the one after (the iterator moves on with every call); a shard
# that stays empty over several polls has nothing new.
HEAD_EMPTY_PAGES = 3
HEAD_EMPTY_S = 3.0


@dataclass(frozen=True)
class CatchUpReport:
    """One partition's (or table's) summary: the largest shard lag and the least
    advanced applied position, each None when some shard's is not known yet."""

    lag_ms: Optional[int]
    position_ms: Optional[int]


def at_head(view: ShardView, now_ms: int) -> bool:
    return (view.empty_since_ms is not None and view.empty_pages >= HEAD_EMPTY_PAGES
            and now_ms - view.empty_since_ms >= HEAD_EMPTY_S * 1000 and view.pending_oldest_ms is None)


def shard_lag_ms(view: ShardView, now_ms: int) -> Optional[int]:
    """The shard's lag in ms, None while unknown (nothing read or applied yet)."""
    if view.pending_oldest_ms is not None or view.behind_ms is not None:
        pending = 0 if view.pending_oldest_ms is None else now_ms - view.pending_oldest_ms
        return max(0, pending, view.behind_ms or 0)
    if at_head(view, now_ms):
        return 0
    if view.last_applied_ms is not None:
        return max(0, now_ms - view.last_applied_ms)
    return None


def shard_position_ms(view: ShardView, now_ms: int) -> Optional[int]:
    """How far the shard's applied position provably reaches, in time: its
    newest applied change, or — at the head, nothing pending — the first empty
    page of the run (every change created before it was read and applied)."""
    position = view.last_applied_ms
    if at_head(view, now_ms):
        position = view.empty_since_ms if position is None else max(position, view.empty_since_ms)
    return position


def summarize(views: Iterable[ShardView], now_ms: int) -> CatchUpReport:
    views = list(views)
    if not views:
        return CatchUpReport(None, None)
    lags = [shard_lag_ms(v, now_ms) for v in views]
    positions = [shard_position_ms(v, now_ms) for v in views]
    return CatchUpReport(None if None in lags else max(lags), None if None in positions else min(positions))


def worst(a: Optional[CatchUpReport], b: CatchUpReport) -> CatchUpReport:
    """The worse of two reports (the keeper keeps the worst since its last step)."""
    if a is None:
        return b
    lag = None if a.lag_ms is None or b.lag_ms is None else max(a.lag_ms, b.lag_ms)
    position = None if a.position_ms is None or b.position_ms is None else min(a.position_ms, b.position_ms)
    return CatchUpReport(lag, position)


def caught_up(report: CatchUpReport, handoff_ms: Optional[int]) -> bool:
    """Every shard has applied past the handoff second and lags less than the bound."""
    if report.lag_ms is None or report.position_ms is None:
        return False
    if handoff_ms is not None and report.position_ms < handoff_ms - handoff_ms % 1000:
        return False
    return report.lag_ms <= LIVE_LAG_BOUND_S * 1000


class Settling:
    """``observe(ok, now)`` is True once ``ok`` has held without a break for
    ``settle_s``."""

    def __init__(self, settle_s: float = LIVE_SETTLE_S) -> None:
        self._settle_ms = settle_s * 1000
        self.since_ms: Optional[int] = None

    def observe(self, ok: bool, now_ms: int) -> bool:
        if not ok:
            self.since_ms = None
            return False
        if self.since_ms is None:
            self.since_ms = now_ms
        return now_ms - self.since_ms >= self._settle_ms
