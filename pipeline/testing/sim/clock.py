"""The simulation's one clock, and the product's time routed through it.

The product takes its time from ``time.monotonic`` / ``time.time`` /
``time.time_ns`` / ``time.sleep``: as module globals (``time.sleep(s)``) and as
default arguments bound when a module was imported (``sleep=time.sleep``).
``simulated_time(clock)`` swaps both, in every loaded ``ddb2bt`` module, for the
simulated clock's, and puts them back after: inside it a sleep of an hour
returns at once with the clock an hour later, and every reading is the
simulated one. Nothing in the product knows.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import time as _real_time
import types
from typing import Iterator

__all__ = ["SimClock", "SimTimeModule", "simulated_time"]

# The simulated wall clock starts here (2024-01-01 UTC): whole seconds, far from 0.
EPOCH_S = 1_704_067_200.0


class SimClock:
    """Seconds since the simulation began, advanced only by ``sleep`` and
    ``advance_to`` (the scheduler moving on to the next event)."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s
        self.slept_s = 0.0  # time passed inside product sleeps (retries, pacing)
        # Run after each sleep: what other threads do meanwhile (the leases'
        # heartbeats run while a bundle waits on a slow call).
        self.while_asleep: list = []

    def monotonic(self) -> float:
        return self.now_s

    def time(self) -> float:
        return EPOCH_S + self.now_s

    def time_ns(self) -> int:
        return int(round((EPOCH_S + self.now_s) * 1e9))

    def wall_ms(self) -> int:
        return int((EPOCH_S + self.now_s) * 1000)

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self.now_s += seconds
            self.slept_s += seconds
            for run in self.while_asleep:
                run()

    def advance_to(self, t_s: float) -> None:
        if t_s > self.now_s:
            self.now_s = t_s


class SimTimeModule(types.ModuleType):
    """Stands in for the ``time`` module inside the product's modules: the clock
    readings and sleep are the simulation's, everything else (strftime, gmtime)
    is the real module's."""

    def __init__(self, clock: SimClock) -> None:
        super().__init__("time")
        self._clock = clock
        self.monotonic = self.perf_counter = clock.monotonic
        self.time, self.time_ns, self.sleep = clock.time, clock.time_ns, clock.sleep

    def clock_gettime(self, _which) -> float:
        return self._clock.monotonic()

    def monotonic_ns(self) -> int:
        return int(self._clock.monotonic() * 1e9)

    def __getattr__(self, name):
        return getattr(_real_time, name)


def _replacements(clock: SimClock) -> dict:
    return {id(_real_time.sleep): clock.sleep, id(_real_time.monotonic): clock.monotonic,
            id(_real_time.time): clock.time, id(_real_time.time_ns): clock.time_ns,
            id(_real_time.perf_counter): clock.monotonic}


def _functions(module) -> Iterator:
    """The module's own functions and its classes' methods (defaults live there)."""
    for value in list(vars(module).values()):
        if inspect.isfunction(value) and value.__module__ == module.__name__:
            yield value
        elif inspect.isclass(value) and value.__module__ == module.__name__:
            for member in vars(value).values():
                member = getattr(member, "__func__", member)
                if inspect.isfunction(member):
                    yield member


@contextlib.contextmanager
def simulated_time(clock: SimClock, prefix: str = "ddb2bt.") -> Iterator[SimClock]:
    """Inside: every loaded module under ``prefix`` reads ``clock`` (see the
    module docstring). Modules of the simulation itself are left alone."""
    fake = SimTimeModule(clock)
    swap = _replacements(clock)
    undo: list = []
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefix) or name.startswith("ddb2bt.pipeline.testing.sim") or module is None:
            continue
        if vars(module).get("time") is _real_time:
            undo.append((module, "time", _real_time))
            module.time = fake
        for fn in _functions(module):
            if fn.__defaults__ and any(id(d) in swap for d in fn.__defaults__):
                undo.append((fn, "__defaults__", fn.__defaults__))
                fn.__defaults__ = tuple(swap.get(id(d), d) for d in fn.__defaults__)
            if fn.__kwdefaults__ and any(id(d) in swap for d in fn.__kwdefaults__.values()):
                undo.append((fn, "__kwdefaults__", fn.__kwdefaults__))
                fn.__kwdefaults__ = {k: swap.get(id(d), d) for k, d in fn.__kwdefaults__.items()}
    try:
        yield clock
    finally:
        for target, attr, value in reversed(undo):
            setattr(target, attr, value)
