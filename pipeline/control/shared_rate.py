"""A call rate shared by every process that reads one stream, through one cell
of the state table (docs/design.md §9.1, "Scale limits").

AWS limits DescribeStream to 10 calls per second per *stream*, whatever reads
it. A per-process pacer cannot keep that sum: a job on 16 Dataflow workers
starts 16 processes at once, and each lists every page of the stream before it
can read (a 2,000-shard stream is 20 pages: 320 calls in the first second).

So every call first takes a slot from the stream's shared schedule, the
generic cell rate algorithm on one state cell: the cell holds the time the next
slot is free; a caller takes ``max(now, that time)`` and moves the cell on by
``1 / per_s`` with a compare-and-set (CheckAndMutateRow), then waits for its
slot. However many processes and jobs (sharing the state table) ask, the slots
are at least ``1 / per_s`` apart: the burst of a start becomes a queue, each
listing finishing a few seconds later than it would alone. A process that
dies after taking a slot wastes it, nothing more; the cell needs no cleanup.

A job of one process (a local run) needs no cell: ``store=None`` spaces the
process's own calls by ``1 / per_s``, the state table untouched.

When the state table cannot be reached the caller falls back to spacing its
own calls by ``1 / per_s`` (and AWS's throttling, retried, stays the last
guard): discovery never waits on the state table for longer than its own
retry deadline.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Callable, Optional

from ddb2bt.pipeline.clients.bigtable.errors import BigtablePermanent, BigtableRetryable, BigtableUnreachable

__all__ = ["SharedRate", "describe_rate_name"]

log = logging.getLogger(__name__)

# Processes racing for the cell: each round of compare-and-set one of them wins;
# past this many losses in a row a caller spaces its call itself.
SWAP_ATTEMPTS = 32
# A next-free time this far ahead is not a queue (at 6 per second, 300 s is a
# queue of 1,800 calls): a clock far ahead wrote it. It is taken as free now.
MAX_AHEAD_S = 300.0
STATE_TABLE_ERRORS = (BigtableRetryable, BigtablePermanent, BigtableUnreachable)
_TOKENS = itertools.count()


def describe_rate_name(stream_label: str) -> str:
    """The shared rate of a stream's DescribeStream calls."""
    return f"DescribeStream#{stream_label}"


class SharedRate:
    """``take()``: wait for this caller's slot of the shared rate ``name``
    (``per_s`` slots per second over every process; see the module docstring).
    ``store``: the job's StateStore (``load_shared_rate``/``swap_shared_rate``)."""

    def __init__(self, store, name: str, per_s: float, now_ms: Callable[[], int] = lambda: time.time_ns() // 10**6,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if per_s <= 0:
            raise ValueError(f"a shared rate needs a positive rate, got {per_s}")
        self._store, self._name = store, name
        self._gap_ms = 1000.0 / per_s
        self._now_ms, self._sleep = now_ms, sleep
        self._who = f"{os.getpid()}-{id(self):x}"
        self._warned_ms: Optional[int] = None
        self._own_free_ms = 0.0  # store None: this process's own next free time
        self.fallbacks = 0  # calls spaced locally (state table unreachable, or contention)

    def take(self) -> float:
        """Waits for a slot; the seconds waited."""
        if self._store is None:  # one process: its own schedule
            slot = max(float(self._now_ms()), self._own_free_ms)
            self._own_free_ms = slot + self._gap_ms
            return self._wait_for(slot)
        written: Optional[str] = None
        for _ in range(SWAP_ATTEMPTS):
            try:
                raw = self._store.load_shared_rate(self._name)
                if written is not None and raw == written:  # a retried swap that had been applied
                    return self._wait_for(_slot_of(written) - self._gap_ms)
                now = self._now_ms()
                free = _slot_of(raw)
                slot = now if free is None or free < now or free - now > MAX_AHEAD_S * 1000 else free
                written = f"{slot + self._gap_ms:.3f} {self._who}-{next(_TOKENS)}"
                if self._store.swap_shared_rate(self._name, raw, written):
                    return self._wait_for(slot)
            except STATE_TABLE_ERRORS as exc:
                self._warn(exc)
                break
        self.fallbacks += 1
        return self._wait_s(self._gap_ms / 1000)

    def _wait_for(self, slot_ms: float) -> float:
        return self._wait_s(max(0.0, (slot_ms - self._now_ms()) / 1000))

    def _wait_s(self, seconds: float) -> float:
        if seconds > 0:
            self._sleep(seconds)
        return seconds

    def _warn(self, exc: BaseException) -> None:
        now = self._now_ms()
        if self._warned_ms is None or now - self._warned_ms >= 60_000:
            self._warned_ms = now
            log.warning("the shared %s schedule is unreachable in the state table (%s: %s): each process spaces "
                        "its own calls until it is back", self._name.split("#", 1)[0], type(exc).__name__, exc)


def _slot_of(raw: Optional[str]) -> Optional[float]:
    """The next free time (ms) a cell holds, None for none or an unreadable one."""
    if not raw:
        return None
    try:
        return float(raw.split(" ", 1)[0])
    except ValueError:
        return None
