"""The cutover's one wall-clock assumption, checked before a backfill begins.

The handoff time T is read from this process's wall clock, and the tail's
changes carry AWS's timestamps (``ApproximateCreationDateTime``, whole seconds).
If this clock runs ahead of AWS's, T is later than AWS's "now": a delete made
just before T by AWS's clock — after the backfill's Scan read the item — carries
a touch marker older than T's second, the backfill's guard does not see it, and
the deleted item comes back (docs/design.md, "Clock assumptions"). A clock
behind AWS's is harmless (T is earlier: more changes count as after T).

So T is set back by ``CLOCK_SKEW_MARGIN_S`` (the tails are already marking by
then: the phase wait covers it), and a cutover refuses to begin when this clock
is more than that margin ahead of (or behind) AWS's, measured against the
``Date`` header of an AWS response. That header has one-second resolution, so
the measurement is an interval; only a skew certainly beyond the margin refuses.
"""
from __future__ import annotations

import email.utils
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ddb2bt.transforms.errors import ConfigError

log = logging.getLogger(__name__)

# How far this clock may be from AWS's. NTP keeps hosts within milliseconds;
# 2 s leaves room for the Date header's one-second resolution and a slow
# round trip, and it is what T is set back by (docs/design.md, "Clock assumptions").
CLOCK_SKEW_MARGIN_S = 2.0
# Behind AWS is harmless for the handoff; the job lease compares wall clocks of
# different hosts against a margin of ttl/4 (5 s by default): refuse beyond it.
CLOCK_BEHIND_LIMIT_S = 5.0


class ClockSkewError(ConfigError):
    """This host's clock is too far from AWS's for a safe handoff."""


@dataclass(frozen=True)
class ClockReading:
    """This clock minus AWS's, as an interval (the Date header is whole seconds,
    and the response was received some time after it was stamped)."""

    low_s: float  # the skew is at least this (negative: behind)
    high_s: float  # and at most this

    @property
    def ahead_s(self) -> float:
        """Certainly ahead by at least this much (0 when it may not be)."""
        return max(0.0, self.low_s)

    @property
    def behind_s(self) -> float:
        return max(0.0, -self.high_s)


def read_skew(call: Callable[[], dict], now: Callable[[], float] = time.time) -> Optional[ClockReading]:
    """Make one AWS call (``call`` returns a boto3 response) and compare this
    clock with its ``Date`` header. None when the response has no Date."""
    sent = now()
    response = call()
    received = now()
    headers = (response or {}).get("ResponseMetadata", {}).get("HTTPHeaders", {})
    date = headers.get("date") or headers.get("Date")
    if not date:
        return None
    aws = email.utils.parsedate_to_datetime(date).timestamp()
    # AWS stamped the header at some instant in [sent, received] by our clock,
    # when its own clock read somewhere in [aws, aws + 1).
    return ClockReading(low_s=sent - (aws + 1.0), high_s=received - aws)


def check_clock(call: Callable[[], dict], where: str, now: Callable[[], float] = time.time,
                margin_s: float = CLOCK_SKEW_MARGIN_S, behind_s: float = CLOCK_BEHIND_LIMIT_S) -> Optional[ClockReading]:
    """Refuse (ClockSkewError) a cutover on a clock certainly more than
    ``margin_s`` ahead of AWS's or ``behind_s`` behind it; returns the reading."""
    reading = read_skew(call, now)
    if reading is None:
        log.warning("cannot check this host's clock against %s (no Date header in its response)", where)
        return None
    if reading.ahead_s > margin_s:
        raise ClockSkewError(
            f"this host's clock is {reading.ahead_s:.1f}s or more ahead of {where}'s (its Date header): the handoff "
            f"time would be later than AWS's, and a delete made just before it could come back after the backfill. "
            f"The cutover allows {margin_s:g}s; fix the clock (NTP: chronyc tracking / timedatectl) and rerun",
            "clock")
    if reading.behind_s > behind_s:
        raise ClockSkewError(
            f"this host's clock is {reading.behind_s:.1f}s or more behind {where}'s (its Date header): the job "
            f"lease assumes hosts' clocks agree within {behind_s:g}s. Fix the clock (NTP: chronyc tracking / "
            "timedatectl) and rerun", "clock")
    log.info("clock check: this host is within [%.1f, %.1f]s of %s", reading.low_s, reading.high_s, where)
    return reading
