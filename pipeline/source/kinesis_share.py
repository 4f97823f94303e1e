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
  job holds its tail lease and still reads that stream (each job records the
  stream it reads, ``record_stream``: a job moved to another stream, or back to
  its DynamoDB stream, no longer holds a share of the old one). A start that
  would take more than the whole budget is refused, naming the jobs that hold
  the rest; it is checked once before the job takes its leases
  (``check_shares``, so a refused ``--take-over`` leaves the running job be)
  and again by the compare-and-set.

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
from ddb2bt.pipeline.control.lease import LeaseState, TAIL

log = logging.getLogger(__name__)

__all__ = ["check_shares", "held_shares", "parse_share", "record_stream", "share_text", "table_shares", "take_shares"]

OPTION = "--kinesis-share"
# A share finer than this would pace a table to one call in 200 s per shard: a
# typing error (1/1000 for 1/10), not a plan.
SMALLEST_SHARE = Fraction(1, 1000)
# Two jobs writing the shares row at once: the loser reads it again and decides
# again; each round one of them wins, so a few rounds settle any real start.
SWAP_ATTEMPTS = 10
# Meta cell of each job (a table's state key): the Kinesis stream (ARN) it read
# at its last start, "" for its DynamoDB stream. A share in another stream's row
# counts only while this names that stream: the rows of the streams a job left
# are never rewritten by it, and a job that crashed mid-start leaves nothing to
# clean up (docs/design.md §10.8).
READS_META = "kinesis_stream"


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


def record_stream(store, stream: Optional[str]) -> None:
    """Record in ``store`` (one job's) the Kinesis stream the job reads from now
    on (None: its DynamoDB stream); call it while holding the job's tail lease,
    before ``take_shares``."""
    value = stream or ""
    if store.load_meta(READS_META) != value:
        store.save_meta(READS_META, value)


def _holds(store, job: str, stream: str, now_ms: int) -> bool:
    """Whether ``job``'s recorded share of ``stream`` still counts: its tail
    lease is live and it still reads ``stream`` (a job that never recorded its
    stream, started before READS_META, counts while its lease is live)."""
    state = LeaseState.parse(store.load_job_lease(job, TAIL))
    if state is None or not state.live(now_ms):
        return False
    reads = store.load_job_meta(job, READS_META)
    return reads is None or reads == stream


def _read_row(store, stream: str) -> tuple:
    """(the shares row of ``stream`` as stored, {job: share} recorded in it)."""
    raw = store.load_stream_shares(stream)
    try:
        return raw, ({job: Fraction(v) for job, v in json.loads(raw).items()} if raw else {})
    except (ValueError, TypeError, ZeroDivisionError, AttributeError):
        log.warning("the shares row of Kinesis stream %s is unreadable; taken as empty", stream)
        return raw, {}


def held_shares(store, stream: str, now_ms: int) -> dict:
    """{job: share} of the jobs whose share of ``stream`` counts now (for
    ``status``): recorded, lease live, still reading the stream."""
    return {job: share for job, share in _read_row(store, stream)[1].items() if _holds(store, job, stream, now_ms)}


def _decide(store, stream: str, consumers: dict, now_ms: Callable[[], int]):
    """(the shares row as read, {job: share} of the other jobs holding one), or
    ConfigError if ``consumers`` would take the total above 1."""
    raw, recorded = _read_row(store, stream)
    now = now_ms()
    others = {job: share for job, share in recorded.items()
              if job not in consumers and _holds(store, job, stream, now)}
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
    return raw, others


def check_shares(store, stream: str, consumers: dict, now_ms: Callable[[], int]) -> None:
    """``take_shares``' refusal without writing anything: called before the job
    takes its leases, so a start refused for its share (with ``--take-over``)
    does not first displace the running job it would replace."""
    _decide(store, stream, consumers, now_ms)


def take_shares(store, stream: str, consumers: dict, now_ms: Callable[[], int]) -> dict:
    """Record ``consumers`` ({job (a table's state key): share}) as readers of
    Kinesis stream ``stream`` (its ARN), in ``store``'s state table; call it
    while holding those jobs' tail leases, after ``record_stream``. Consumers of
    other jobs whose tail lease is no longer held, or that now read another
    stream, are dropped. Raises ConfigError naming ``--kinesis-share`` when the
    shares would add up to more than 1, and says who holds the rest. Returns
    the shares recorded ({job: share})."""
    for _ in range(SWAP_ATTEMPTS):
        raw, others = _decide(store, stream, consumers, now_ms)
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
