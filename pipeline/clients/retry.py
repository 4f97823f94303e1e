"""One retry policy for every remote call: exponential backoff with full jitter,
bounded by a total deadline, retrying only what was classified retryable.

Failures speak: the first failure of a call is logged at WARNING at once, then
again with backoff (after 1, 2, 4, 8 ... seconds of failing, at least every
``MAX_LOG_GAP_S``), each time saying what fails (the operation), where (the
service and endpoint), the error code, for how long, and when it will give up.
When the deadline passes, the error raised says the same: a job never waits
silently for minutes.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

from ddb2bt.transforms.errors import Ddb2btError, RetryableError

log = logging.getLogger(__name__)
T = TypeVar("T")

# Long enough to ride out a node restart or a throttling burst; short enough
# that a dead backend fails the job in minutes (--bigtable-deadline,
# --dynamodb-deadline).
DEFAULT_DEADLINE_S = 300.0
# Read-only commands (status, dlq, verify's set-up, create-table) give up sooner:
# someone is waiting at a terminal.
READ_ONLY_DEADLINE_S = 25.0
MAX_LOG_GAP_S = 30.0


def no_check() -> None:
    """The between-attempts check of a call that no lease fences."""


@dataclass(frozen=True)
class RetryPolicy:
    initial_s: float = 0.1
    max_backoff_s: float = 10.0
    deadline_s: float = DEFAULT_DEADLINE_S


DEFAULT_POLICY = RetryPolicy()


def _code(exc: BaseException) -> str:
    return str(getattr(exc, "code", "") or type(exc).__name__)


class Retrying:
    """Calls ``fn`` until it succeeds, raises something not retryable, or the
    deadline passes. Clock and sleep are injected for tests. ``between_attempts``
    runs before each retry; raising stops the retrying: a caller that works for a
    job passes its coordinator's lease check (a process that lost its lease must
    not sit in a retry loop for minutes, ddb2bt.pipeline.control.coordinator)."""

    def __init__(self, policy: RetryPolicy, what: str, on_retry: Optional[Callable[[BaseException], None]],
                 sleep: Callable[[float], None], retry_on: tuple, where: str,
                 clock: Callable[[], float] = time.monotonic, rng: Optional[random.Random] = None,
                 between_attempts: Callable[[], None] = no_check) -> None:
        self._policy, self._what, self._on_retry = policy, what, on_retry
        self._between_attempts = between_attempts
        self._sleep, self._retry_on, self._where = sleep, retry_on, where
        self._clock = clock
        self._rng = rng or random

    def _label(self) -> str:
        return f"{self._what} at {self._where}" if self._where else self._what

    def __call__(self, fn: Callable[[], T]) -> T:
        policy = self._policy
        start = self._clock()
        attempt = 0
        next_log = 0.0
        logged = False
        while True:
            attempt += 1
            try:
                result = fn()
            except self._retry_on as exc:
                elapsed = self._clock() - start
                if self._on_retry is not None:
                    self._on_retry(exc)
                left = policy.deadline_s - elapsed
                if left <= 0:
                    raise gave_up(exc, f"gave up on {self._label()} after {elapsed:.0f}s of retries "
                                       f"({attempt} attempts; deadline {policy.deadline_s:g}s): {exc}") from exc
                if elapsed >= next_log:
                    log.warning("%s failing for %.1fs (%d attempt%s): %s: %s; retrying with backoff, giving up in "
                                "%.0fs", self._label(), elapsed, attempt, "" if attempt == 1 else "s", _code(exc),
                                exc, left)
                    logged = True
                    next_log = min(max(1.0, 2 * elapsed), elapsed + MAX_LOG_GAP_S)
                self._between_attempts()
                ceiling = min(policy.max_backoff_s, policy.initial_s * 2.0 ** min(attempt - 1, 60))
                self._sleep(min(self._rng.uniform(0, ceiling), max(left, 0.0)))
                continue
            if logged:
                log.warning("%s recovered after %.1fs (%d attempts)", self._label(), self._clock() - start, attempt)
            return result


def gave_up(exc: BaseException, message: str) -> BaseException:
    """The final error: of the same class as the last failure (callers and
    tests classify it the same way), its message saying what gave up, where,
    after how long and why."""
    if isinstance(exc, Ddb2btError):
        try:
            return type(exc)(message, **{**exc._attrs, "gave_up": True})
        except TypeError:  # a subclass with its own constructor
            pass
    return RetryableError(message, gave_up=True)


def retrying(policy: RetryPolicy = DEFAULT_POLICY, what: str = "call",
             on_retry: Optional[Callable[[BaseException], None]] = None,
             sleep: Callable[[float], None] = time.sleep,
             retry_on: tuple = (RetryableError,), where: str = "",
             clock: Callable[[], float] = time.monotonic,
             between_attempts: Optional[Callable[[], None]] = None) -> Retrying:
    return Retrying(policy, what, on_retry, sleep, retry_on, where, clock,
                    between_attempts=between_attempts or no_check)


def retry_call(fn: Callable[[], T], what: str = "call", policy: RetryPolicy = DEFAULT_POLICY,
               on_retry: Optional[Callable[[BaseException], None]] = None,
               sleep: Callable[[float], None] = time.sleep, where: str = "",
               between_attempts: Optional[Callable[[], None]] = None) -> T:
    return retrying(policy, what, on_retry, sleep, where=where, between_attempts=between_attempts)(fn)
