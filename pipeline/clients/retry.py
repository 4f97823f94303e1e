"""One retry policy for every remote call: exponential backoff with full jitter,
bounded by a total deadline, retrying only what was classified retryable.

Built on tenacity (the library the project card chose): ``wait_random_exponential``
is the full-jitter backoff, ``stop_after_delay`` the deadline,
``retry_if_exception`` the classification, ``before_sleep`` the warnings and the
between-attempts check, ``retry_error_callback`` the final error. Time is
injected: the call's start and each failure are stamped from the caller's clock,
and tenacity sleeps through the caller's sleep (simulated time in tests).

Failures speak: the first failure of a call is logged at WARNING at once, then
again with backoff (after 1, 2, 4, 8 ... seconds of failing, at least every
``MAX_LOG_GAP_S``), each time saying what fails (the operation), where (the
service and endpoint), the error code, for how long, and when it will give up.
When the deadline passes, the error raised says the same: a job never waits
silently for minutes.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

import tenacity

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


class _Call:
    """What one call of a ``Retrying`` keeps between its attempts (tenacity hands
    it back to the callbacks as the attempt's argument): the policy object is
    shared by threads, a call's state is not."""
    __slots__ = ("fn", "start", "elapsed", "left", "next_log", "logged", "failures", "first_failure")

    def __init__(self, fn: Callable[[], object], start: float) -> None:
        self.fn = fn
        self.start = start
        self.elapsed = self.left = self.next_log = 0.0
        self.logged = False
        self.failures = 0
        self.first_failure: Optional[BaseException] = None


def _attempt(call: _Call) -> object:
    first, call.first_failure = call.first_failure, None
    if first is not None:  # the first attempt, made before the retrying began: its failure
        raise first
    return call.fn()


class Retrying:
    """Calls ``fn`` until it succeeds, raises something not retryable, or the
    deadline passes. Clock and sleep are injected for tests. ``between_attempts``
    runs before each retry; raising stops the retrying: a caller that works for a
    job passes its coordinator's lease check (a process that lost its lease must
    not sit in a retry loop for minutes, ddb2bt.pipeline.control.coordinator)."""

    def __init__(self, policy: RetryPolicy, what: str, on_retry: Optional[Callable[[BaseException], None]],
                 sleep: Callable[[float], None], retry_on: tuple, where: str,
                 clock: Callable[[], float] = time.monotonic,
                 between_attempts: Callable[[], None] = no_check) -> None:
        self._policy, self._what, self._on_retry = policy, what, on_retry
        self._between_attempts = between_attempts
        self._retry_on, self._where, self._clock, self._sleep = retry_on, where, clock, sleep
        self._controller: Optional[tenacity.Retrying] = None  # made when a first attempt fails

    def _retrying(self) -> tenacity.Retrying:
        if self._controller is None:
            policy = self._policy
            self._backoff = tenacity.wait_random_exponential(multiplier=policy.initial_s, max=policy.max_backoff_s)
            self._controller = tenacity.Retrying(
                sleep=self._sleep,
                retry=tenacity.retry_if_exception(self._retryable),
                stop=tenacity.stop_after_delay(policy.deadline_s),
                wait=self._wait,
                before=self._before_attempt,
                after=self._failed,
                before_sleep=self._before_sleep,
                retry_error_callback=self._give_up)
        return self._controller

    def _label(self) -> str:
        return f"{self._what} at {self._where}" if self._where else self._what

    def _retryable(self, exc: BaseException) -> bool:
        return isinstance(exc, self._retry_on)

    def _before_attempt(self, state: tenacity.RetryCallState) -> None:
        if state.attempt_number == 1:
            state.start_time = state.args[0].start

    def _failed(self, state: tenacity.RetryCallState) -> None:
        """A retryable failure: stamped on the caller's clock (stop_after_delay
        reads it), then handed to ``on_retry``."""
        call: _Call = state.args[0]
        state.outcome_timestamp = self._clock()
        call.elapsed = state.outcome_timestamp - call.start
        call.left = self._policy.deadline_s - call.elapsed
        call.failures = state.attempt_number
        if self._on_retry is not None:
            self._on_retry(state.outcome.exception())

    def _wait(self, state: tenacity.RetryCallState) -> float:
        return min(self._backoff(state), max(state.args[0].left, 0.0))

    def _before_sleep(self, state: tenacity.RetryCallState) -> None:
        call: _Call = state.args[0]
        if call.elapsed >= call.next_log:
            exc = state.outcome.exception()
            attempt = state.attempt_number
            log.warning("%s failing for %.1fs (%d attempt%s): %s: %s; retrying with backoff, giving up in %.0fs",
                        self._label(), call.elapsed, attempt, "" if attempt == 1 else "s", _code(exc), exc, call.left)
            call.logged = True
            call.next_log = min(max(1.0, 2 * call.elapsed), call.elapsed + MAX_LOG_GAP_S)
        self._between_attempts()

    def _give_up(self, state: tenacity.RetryCallState) -> None:
        call: _Call = state.args[0]
        exc = state.outcome.exception()
        raise gave_up(exc, f"gave up on {self._label()} after {call.elapsed:.0f}s of retries "
                           f"({state.attempt_number} attempts; deadline {self._policy.deadline_s:g}s): "
                           f"{exc}") from exc

    def __call__(self, fn: Callable[[], T]) -> T:
        call = _Call(fn, self._clock())
        # The first attempt runs outside tenacity: most calls succeed at once, and
        # making the controller and its bookkeeping would cost more than a fast
        # call. A failure is handed to the controller as its first attempt's outcome.
        try:
            return fn()
        except BaseException as exc:  # noqa: B902 (as tenacity: what is not retryable is raised)
            if not self._retryable(exc):
                raise
            call.first_failure = exc
        result = self._retrying()(_attempt, call)
        if call.logged:
            log.warning("%s recovered after %.1fs (%d attempts)", self._label(), self._clock() - call.start,
                        call.failures + 1)
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
