"""When each shard of a partition was last seen at its head: the proof that a
checkpoint which aged out of the stream lost nothing (docs/design.md §8.2). A
part of the partition reader (stream_source.py), kept apart so the reader holds
the reading and this the head proofs.

A shard is at its head after a run of ``HEAD_EMPTY_PAGES`` empty pages over
``HEAD_EMPTY_S`` with nothing read and not yet applied (docs/design.md §7.8):
every record created before the run's first page was read then.

A checkpoint that aged out of the stream lost nothing only when the stream shows
it: the oldest record the shard still holds was created before the job's last
head sighting (``nothing_lost_since_head``). A shard loses only a prefix of its
records, so that record, still there, proves every later one is still there too,
and every earlier one was read and applied by the sighting. Anything else (a
shard trimmed past the sighting, one that holds no record, a sighting too old) is
LOST, whatever the stream's retention would let one assume.
"""
from __future__ import annotations

import datetime as _dt
from collections import deque
from typing import Callable, Optional

from ddb2bt.pipeline.control.catchup import HEAD_EMPTY_PAGES, HEAD_EMPTY_S

# A sighting older than the stream's retention less this proves nothing, whatever
# the stream holds (its records' times are the service's, not this host's).
HEAD_PROOF_MARGIN_S = 3600.0
# The oldest record held must be this much older than the sighting: DynamoDB
# Streams rounds ApproximateCreationDateTime down to the second, and the
# sighting is this host's clock, which may run ahead of the service's.
HEAD_PROOF_SLACK_MS = 5000
# Pages read at TRIM_HORIZON to find the shard's oldest record (a DynamoDB
# Streams page may come back empty with records behind it).
OLDEST_RECORD_PAGES = 3


def nothing_lost_since_head(head_ms: Optional[int], now_ms: int, retention_s: float,
                            oldest_ms: Optional[int]) -> bool:
    """Pure: a checkpoint found trimmed lost no change when its shard was seen at
    its head at ``head_ms`` (docs/design.md §7.8: every record created before then
    read, applied and checkpointed) less than ``retention_s`` − HEAD_PROOF_MARGIN_S
    ago, and the oldest record the shard holds now (created at ``oldest_ms``;
    None: it holds none) is older than that sighting by HEAD_PROOF_SLACK_MS: the
    stream still holds a record from before the sighting, so it trimmed nothing
    after it."""
    if head_ms is None or oldest_ms is None:
        return False
    return now_ms - head_ms < (retention_s - HEAD_PROOF_MARGIN_S) * 1000 and oldest_ms <= head_ms - HEAD_PROOF_SLACK_MS


def trimmed_message(shard_id: str, stream_arn: str, where: str) -> str:
    """What a reader says when a shard no longer holds the changes ``where``
    (after a sequence number, or the start mode) of its checkpoint."""
    return (f"shard {shard_id} of {stream_arn} no longer holds the changes {where}: they were trimmed (older than "
            "the stream's 24 h retention) before being applied, so changes were LOST. Recover them from "
            "incremental exports (ddb2bt recover -m <mapping>: it prints the export commands, then applies them), "
            "or by copying the table again with a new backfill (ddb2bt migrate --restart); or rerun with "
            "--on-trimmed=restart to continue from the oldest available record (the lost changes stay lost).")


def unproven_note(head_ms: Optional[int], now_ms: int, retention_s: float, oldest_ms: Optional[int]) -> str:
    """Why a shard's last head sighting does not prove its trimmed checkpoint
    lost nothing, for the LOST message ("" when it was never seen at its head)."""
    if head_ms is None:
        return ""
    held = ("the shard holds no record now" if oldest_ms is None else
            f"the oldest record the shard still holds is {(oldest_ms - head_ms) / 1000:+.0f} s from it")
    return (f" (The job last saw this shard at its head {(now_ms - head_ms) / 3_600_000:.1f} h ago and "
            f"{held}: that does not prove that nothing after it was trimmed, which takes a record "
            f"from before the sighting still held, and a sighting within the stream's "
            f"{retention_s / 3600:.0f} h retention less {HEAD_PROOF_MARGIN_S / 3600:.0f} h.)")


def record_created_ms(record: dict) -> Optional[int]:
    """A GetRecords record's ApproximateCreationDateTime in ms (None: none)."""
    created = (record.get("dynamodb") or {}).get("ApproximateCreationDateTime")
    if created is None:
        return None
    if isinstance(created, _dt.datetime):
        return int(created.timestamp() * 1000)
    return int(float(created) * 1000)


def oldest_record_ms(client, stream_arn: str, shard_id: str, call: Callable = lambda name, fn: fn(),
                     wait: Callable[[], None] = lambda: None) -> Optional[int]:
    """When the oldest record ``shard_id`` still holds was created (None: none
    found in OLDEST_RECORD_PAGES pages from TRIM_HORIZON). ``call(name, fn)``
    retries as the caller's reads do, ``wait()`` paces each GetRecords."""
    it = call("GetShardIterator", lambda: client.get_shard_iterator(
        StreamArn=stream_arn, ShardId=shard_id, ShardIteratorType="TRIM_HORIZON"))["ShardIterator"]
    for _ in range(OLDEST_RECORD_PAGES):
        if not it:
            return None
        wait()
        page = call("GetRecords", lambda: client.get_records(ShardIterator=it, Limit=1))
        records = page.get("Records") or []
        if records:
            return record_created_ms(records[0])
        it = page.get("NextShardIterator")
    return None


class ShardHeads:
    """The head proofs of one partition's shards. ``metrics``: the table's view
    of the metrics (its lag tracker knows what was read and not yet applied), or
    None; ``load_heads(stream_arn)``: {shard id: ms} every reader of the job
    recorded in the state table (StateStore.load_shard_heads), or None."""

    def __init__(self, stream_arn: str, now_ms: Callable[[], int], metrics=None,
                 load_heads: Optional[Callable[[str], dict]] = None) -> None:
        self._stream_arn = stream_arn
        self._now_ms = now_ms
        self._metrics = metrics
        self._load_heads = load_heads
        # shard id -> this host's times of the current run of empty pages (the
        # oldest dropped once the newer ones alone still make a head), and
        # shard id -> the latest time it was proven at its head.
        self._empty_run: dict = {}
        self._heads: dict = {}

    def last_head_ms(self, shard_id: str) -> Optional[int]:
        """The latest time this job is known to have seen the shard at its head:
        this reader's own, or any reader's recorded in the state table."""
        times = [self._heads.get(shard_id)]
        if self._load_heads is not None:
            times.append(self._load_heads(self._stream_arn).get(shard_id))
        times = [t for t in times if t is not None]
        return max(times) if times else None

    def on_page(self, shard_id: str, page: dict, empty: bool) -> None:
        """A GetRecords ``page`` of an open shard: tell the lag tracker (the
        catch-up rule's view, control/catchup.py), follow the shard's run of
        empty pages, and at the head remember when. Of a long run, the latest
        such window counts. ``empty``: stream_source.page_state's; one a little
        behind the tip (Kinesis's ``MillisBehindLatest``) is dated that much
        earlier, so a proof claims no more than was read."""
        behind = page.get("MillisBehindLatest") or 0
        if self._metrics is not None:
            lag = self._metrics.lag
            if "MillisBehindLatest" in page:  # the service's own lag, where it gives one
                lag.on_behind(self._stream_arn, shard_id, page["MillisBehindLatest"])
            if empty:  # an empty page, not yet the head
                lag.on_at_head(self._stream_arn, shard_id, behind)
            elif not page.get("Records"):  # nothing of this table, and yet records ahead: the run ends
                lag.on_records_ahead(self._stream_arn, shard_id)
        if not empty:
            self._empty_run.pop(shard_id, None)
            return
        run = self._empty_run.setdefault(shard_id, deque())
        now = self._now_ms() - behind
        run.append(now)
        window_ms = HEAD_EMPTY_S * 1000
        while len(run) > HEAD_EMPTY_PAGES and now - run[1] >= window_ms:
            run.popleft()
        if len(run) < HEAD_EMPTY_PAGES or now - run[0] < window_ms:
            return
        if self._metrics is not None and self._metrics.lag.view(
                self._stream_arn, shard_id).pending_oldest_ms is not None:
            return  # records read and not yet applied: not proven
        self._heads[shard_id] = max(run[0], self._heads.get(shard_id, run[0]))

    def heads(self, shard_ids) -> dict:
        """{shard id: the latest time (ms, this host's clock) it was seen at its
        head} of the given shards (those the partition reads)."""
        return {shard_id: ms for shard_id, ms in self._heads.items() if shard_id in shard_ids}
