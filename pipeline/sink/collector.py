"""The cyclic garbage collector's thresholds in a process that replicates.

A page of changes (up to 1,000 records) is read, mapped and buffered as a whole,
and its objects — records, images, cells, mutations, rows: tens of thousands of
containers — live until the page's batch is written. CPython collects its young
generation every 700 container allocations (its default), so a page's objects are
scanned again and again while they are still alive, promoted, and scanned once
more by the older generations' collections. Measured on the live path
(``bench/profile_live.py``, docs/benchmarks.md): 5–6 µs of CPU per change, ~8 % of
the process, of which the collector found almost nothing to free — the
pipeline's objects are freed by reference counting, not by the cycle collector.

So the sink raises the thresholds once per process (``tune_collector``, called
from its DoFn's ``setup``: every job that writes has a sink, locally and on
Dataflow workers alike). Garbage in reference cycles is still collected, only
later: at most ``YOUNG_THRESHOLD`` more objects wait for it.
"""
from __future__ import annotations

import gc

__all__ = ["YOUNG_THRESHOLD", "OLDER_THRESHOLD", "tune_collector"]

# Container allocations (net of frees) between two young-generation collections:
# about one page's worth, so a page in flight is scanned about once, not ~60 times.
# Measured at 50,000 against CPython's 700: 59–60 against 63–68 µs of CPU per
# change; a collector off altogether gave the same 60–61.
YOUNG_THRESHOLD = 50_000
# Young collections between two collections of the middle generation, and those
# between two of the oldest (CPython: 10 and 10): twice as rare, since each young
# collection now sees a whole page.
OLDER_THRESHOLD = 20


def tune_collector() -> None:
    """Raise the collector's thresholds to the ones above. Never lowers one that
    is already higher, and leaves a disabled collector (threshold 0) alone: whoever
    set them knew why."""
    young, middle, oldest = gc.get_threshold()
    if young == 0:
        return
    gc.set_threshold(max(young, YOUNG_THRESHOLD), max(middle, OLDER_THRESHOLD), max(oldest, OLDER_THRESHOLD))
