"""Calls per second, counted the way a service's limit counts them: per key
(a shard, a stream), over any one-second window."""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

__all__ = ["RateLimit", "CallLedger", "CallCount"]

# Floating-point slack: calls paced exactly 1/rate apart must not count as one too many.
EPSILON_S = 1e-6


@dataclass
class RateLimit:
    """At most ``per_second`` calls of one key in any one-second window. Every
    attempt counts (a refused call is still a call); ``over`` counts the ones
    past the limit, ``peak`` the most seen in one window."""

    per_second: int
    calls: dict = field(default_factory=lambda: defaultdict(deque))
    total: int = 0
    over: int = 0
    peak: int = 0
    over_keys: set = field(default_factory=set)

    def attempt(self, key: str, now_s: float) -> bool:
        """Counts a call at ``now_s``; False when it is past the limit."""
        window = self.calls[key]
        while window and window[0] <= now_s - 1.0 + EPSILON_S:
            window.popleft()
        window.append(now_s)
        self.total += 1
        self.peak = max(self.peak, len(window))
        if len(window) > self.per_second:
            self.over += 1
            self.over_keys.add(key)
            return False
        return True

    def forget(self, key: str) -> None:
        self.calls.pop(key, None)


class CallLedger:
    """Every limited call of the simulated services, and how many went past."""

    def __init__(self) -> None:
        self.limits: dict = {}

    def limit(self, name: str, per_second: int) -> RateLimit:
        if name not in self.limits:
            self.limits[name] = RateLimit(per_second)
        return self.limits[name]

    def summary(self) -> dict:
        return {name: {"calls": lim.total, "over": lim.over, "peak_per_s": lim.peak, "limit": lim.per_second}
                for name, lim in sorted(self.limits.items())}


class CallCount:
    """Stands in for a fake's list of calls (the in-memory Bigtable's, the fake
    stream's): their number only (a day of simulated calls, listed, would take
    gigabytes)."""

    def __init__(self) -> None:
        self.n = 0

    def append(self, _call) -> None:
        self.n += 1

    def __len__(self) -> int:
        return self.n
