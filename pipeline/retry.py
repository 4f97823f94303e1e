"""One retry policy for every remote call: exponential backoff with full jitter,
bounded by a total deadline, retrying only what was classified retryable."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_random_exponential,
)

from ddb2bt.transforms.errors import RetryableError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    initial_s: float = 0.1
    max_backoff_s: float = 10.0
    # Long enough to ride out a node restart or a throttling burst; short enough
    # that a dead backend fails the bundle (and the job, locally) in minutes.
    deadline_s: float = 300.0


DEFAULT_POLICY = RetryPolicy()


def retrying(policy: RetryPolicy = DEFAULT_POLICY, what: str = "call",
             on_retry: Optional[Callable[[BaseException], None]] = None,
             sleep: Callable[[float], None] = time.sleep,
             retry_on: tuple = (RetryableError,)) -> Retrying:
    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        if on_retry and exc is not None:
            on_retry(exc)
        log.warning("%s failed (attempt %d), retrying: %s", what, state.attempt_number, exc)

    return Retrying(
        retry=retry_if_exception_type(retry_on),
        wait=wait_random_exponential(multiplier=policy.initial_s, max=policy.max_backoff_s),
        stop=stop_after_delay(policy.deadline_s),
        before_sleep=before_sleep,
        sleep=sleep,
        reraise=True,
    )


def retry_call(fn: Callable[[], T], what: str = "call", policy: RetryPolicy = DEFAULT_POLICY,
               on_retry: Optional[Callable[[BaseException], None]] = None,
               sleep: Callable[[float], None] = time.sleep) -> T:
    return retrying(policy, what, on_retry, sleep)(fn)
