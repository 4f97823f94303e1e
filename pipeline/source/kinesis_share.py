"""The read budget of a Kinesis stream, shared by every table and job reading it
(docs/design.md §10.8, docs/kinesis.md "Several tables on one stream").

Kinesis allows 5 GetRecords calls and 2 MB per second per shard, for all the
shared-throughput consumers of the stream together. Each table of a ddb2bt job
reads the whole stream (keeping its own table's records), so every table is a
consumer of every shard. A per-process pacer cannot keep the sum: the tables of
one job run on several Dataflow workers, and several jobs may read one stream.
So each consumer takes a fixed *share* of every shard's budget and paces itself
to it wherever it runs (``kinesis.ShardPacer``):

* a job takes ``--kinesis-share`` of the stream (default 1: all of it), split
  evenly between its tables that read the stream (``table_shares``);
* before it reads, the job records its tables' shares in the state table, in one
  row per stream, by compare-and-set (``take_shares``); a share counts while its
  job holds its tail lease. A start that would take more than the whole budget
  is refused, naming the jobs that hold the rest.

The shares of a stream then add up to at most 1, so its readers together make at
most 5 calls and read at most 2 MB per second per shard on average, however the
tables are spread over processes, workers and jobs.
"""
from __future__ import annotations

import json
import logging
from fractions import Fraction
from typing import Callable, Optional, Sequence

from ddb2bt.transforms.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["parse_share", "share_text", "table_shares", "take_shares"]

OPTION = "--kinesis-share"
# A share finer than this would pace a table to one call in 200 s per shard: a
# typing error (1/1000 for 1/10), not a plan.
SMALLEST_SHARE = Fraction(1, 1000)
# Two jobs writing the shares row at once: the loser reads it again and decides
# again; each round one of them wins, so a few rounds settle any real start.
SWAP_ATTEMPTS = 10


def parse_share(text: str) -> Fraction:
    """``K/N`` (K of N equal shares) or a decimal, in (0, 1]: the argparse type
    of ``--kinesis-share``."""
    import argparse

    try:
        value = Fraction(str(text).strip())
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a share: write K/N (e.g. 1/2) or a decimal "
                                         "(e.g. 0.5)") from None
    if not SMALLEST_SHARE <= value <= 1:
        raise argparse.ArgumentTypeError(f"a share of the stream's read budget is between {SMALLEST_SHARE} "
                                         f"and 1, got {text}")
    return value


def share_text(share: Fraction) -> str:
    return str(share)  # "1", "1/2": exact, so shares add up without rounding


def table_shares(kinesis_arns: Sequence[Optional[str]], job_share: Fraction) -> list:
    """The share of each table of one job: ``job_share`` split evenly between
    its tables that read the same Kinesis stream (``kinesis_arns``: each
    table's stream, None for a DynamoDB stream, whose share is None)."""
    count: dict = {}
    for arn in kinesis_arns:
        if arn is not None:
            count[arn] = count.get(arn, 0) + 1
    return [None if arn is None else job_share / count[arn] for arn in kinesis_arns]


def _live(store, job: str, now_ms: int) -> bool:
    from ddb2bt.pipeline.lease import TAIL, LeaseState

    state = LeaseState.parse(store.load_job_lease(job, TAIL))
    return state is not None and state.live(now_ms)


def take_shares(store, stream: str, consumers: dict, now_ms: Callable[[], int]) -> dict:
    """Record ``consumers`` ({job (a table's state key): share}) as readers of
    Kinesis stream ``stream`` (its ARN), in ``store``'s state table; call it
    while holding those jobs' tail leases. Consumers of other jobs whose tail
    lease is no longer held are dropped. Raises ConfigError naming
    ``--kinesis-share`` when the shares would add up to more than 1, and says
    who holds the rest. Returns the shares recorded ({job: share})."""
    for _ in range(SWAP_ATTEMPTS):
        raw = store.load_stream_shares(stream)
        try:
            recorded = {job: Fraction(v) for job, v in json.loads(raw).items()} if raw else {}
        except (ValueError, TypeError, ZeroDivisionError, AttributeError):
            log.warning("the shares row of Kinesis stream %s is unreadable; taken as empty", stream)
            recorded = {}
        now = now_ms()
        others = {job: share for job, share in recorded.items()
                  if job not in consumers and _live(store, job, now)}
        total = sum(others.values(), Fraction(0)) + sum(consumers.values(), Fraction(0))
        if total > 1:
            held = ", ".join(f"{job} {share_text(share)}" for job, share in sorted(others.items()))
            asked = ", ".join(f"{job} {share_text(share)}" for job, share in sorted(consumers.items()))
            raise ConfigError(
                f"Kinesis stream {stream}: every reader of a shard spends the shard's one read budget (5 GetRecords "
                f"calls and 2 MB per second), and running jobs hold {share_text(sum(others.values(), Fraction(0)))} "
                f"of it ({held}) while this job asks {asked}: together {share_text(total)}, more than the whole. "
                "Give each job reading the stream a share so that they add up to at most 1 (e.g. --kinesis-share 1/2 "
                "on each of two jobs; a running job keeps the share it started with until restarted), or read the "
                "tables in one job (docs/kinesis.md, \"Several tables on one stream\")", OPTION)
        value = json.dumps({job: share_text(share) for job, share in sorted({**others, **consumers}.items())},
                           sort_keys=True)
        if store.swap_stream_shares(stream, raw, value):
            log.info("Kinesis stream %s: this job reads with %s of each shard's budget (%s); other jobs hold %s",
                     stream, share_text(sum(consumers.values(), Fraction(0))),
                     ", ".join(f"{job} {share_text(s)}" for job, s in sorted(consumers.items())),
                     share_text(sum(others.values(), Fraction(0))))
            return {**others, **consumers}
    raise ConfigError(f"Kinesis stream {stream}: the shares row kept changing under {SWAP_ATTEMPTS} attempts "
                      "(other jobs starting at the same time); start again", OPTION)
