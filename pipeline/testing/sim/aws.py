"""The AWS side of the simulation: a DynamoDB stream of many shards as the
service runs it, behind boto3's ``dynamodbstreams`` interface (the fake of
``pipeline/testing/fakes.py``, on the simulated clock):

* every shard closes after about four hours and hands its key range to one
  child (a rollover) or two (a split, the table's partition splitting);
* records older than 24 hours are trimmed, and closed shards leave the listing
  24 hours after they closed;
* 5 GetRecords per second per shard and 10 DescribeStream per second per
  stream, past which the call fails with LimitExceededException (the attempt
  still counts: the ledger says how many went past);
* iterators expire 15 minutes after they were handed out;
* pages stop at 1,000 records or 1 MB; record times are whole seconds;
* DescribeStream's ``ShardFilter`` (``CHILD_SHARDS``) lists a shard's children.
"""
from __future__ import annotations

import bisect
import random
import zlib
from dataclasses import dataclass
from typing import Optional

from ddb2bt.pipeline.testing.fakes import FakeStreamsClient, client_error
from ddb2bt.pipeline.testing.sim.clock import SimClock
from ddb2bt.pipeline.testing.sim.ledger import CallCount, CallLedger

__all__ = ["StreamLimits", "SimStream"]

HASH_SPACE = 1 << 32


@dataclass(frozen=True)
class StreamLimits:
    get_records_per_shard_s: int = 5
    describe_per_stream_s: int = 10
    iterator_ttl_s: float = 15 * 60
    retention_s: float = 24 * 3600
    shard_life_s: float = 4 * 3600  # a shard closes after this, give or take a quarter
    split_share: float = 0.1  # of the shards that close, the share that split in two


@dataclass
class Lane:
    """A key range [lo, hi) of the table and the shard its changes go to now."""

    lo: int
    hi: int
    shard_id: str
    closes_at_s: float


class SimStream(FakeStreamsClient):
    """The stream (see the module docstring). ``lanes``: its open shards at the start."""

    def __init__(self, clock: SimClock, rng: random.Random, ledger: CallLedger, lanes: int,
                 limits: StreamLimits = StreamLimits(), table: str = "SimTable") -> None:
        super().__init__(table=table)
        self.clock, self.rng, self.ledger, self.limits = clock, rng, ledger, limits
        self.retention_s = limits.retention_s
        self.calls = CallCount()
        self._get_records = ledger.limit("GetRecords per shard", limits.get_records_per_shard_s)
        self._describe = ledger.limit("DescribeStream per stream", limits.describe_per_stream_s)
        self._created_ms: dict = {}  # shard id -> [record creation ms], for trimming
        self._seqs: dict = {}  # shard id -> [record sequence numbers], ints
        self._closed_at: dict = {}  # shard id -> simulated s it closed
        self._start_seq: dict = {}
        self._shard_no = 0
        self.lanes: list = []
        self.rollovers = self.splits = self.trimmed = 0
        step = HASH_SPACE // lanes
        for i in range(lanes):
            hi = HASH_SPACE if i == lanes - 1 else (i + 1) * step
            self.lanes.append(Lane(i * step, hi, self._new_shard(None), self._life()))
        self._los = [lane.lo for lane in self.lanes]

    # -- the service's own life
    def _life(self) -> float:
        life = self.limits.shard_life_s
        return self.clock.now_s + self.rng.uniform(0.75 * life, 1.25 * life)

    def _new_shard(self, parent: Optional[str]) -> str:
        self._shard_no += 1
        shard_id = f"shardId-{self.clock.wall_ms():020d}-{self._shard_no:08x}"
        self.add_shard(shard_id, parent)
        self._created_ms[shard_id] = []
        self._seqs[shard_id] = []
        self._start_seq[shard_id] = str(self._seq + 1)
        return shard_id

    def lane_of(self, key_text: str) -> Lane:
        h = zlib.crc32(key_text.encode())
        return self.lanes[bisect.bisect_right(self._los, h) - 1]

    def write(self, key_text: str, event: str, keys: dict, new: Optional[dict], old: Optional[dict]) -> str:
        """One change to the item ``key_text``, stamped with this whole second."""
        shard_id = self.lane_of(key_text).shard_id
        created = self.clock.wall_ms() // 1000 * 1000
        self._created_ms[shard_id].append(created)
        seq = self.put(shard_id, event, keys, new, old, created_ms=created)
        self._seqs[shard_id].append(int(seq))
        return seq

    def maintain(self) -> None:
        """Roll over or split the shards whose time came; trim what aged out."""
        now = self.clock.now_s
        lanes: list = []
        for lane in self.lanes:
            if lane.closes_at_s > now:
                lanes.append(lane)
                continue
            self.close_shard(lane.shard_id)
            self._closed_at[lane.shard_id] = now
            if self.rng.random() < self.limits.split_share and lane.hi - lane.lo > 1:
                mid = (lane.lo + lane.hi) // 2
                lanes += [Lane(lane.lo, mid, self._new_shard(lane.shard_id), self._life()),
                          Lane(mid, lane.hi, self._new_shard(lane.shard_id), self._life())]
                self.splits += 1
            else:
                lanes.append(Lane(lane.lo, lane.hi, self._new_shard(lane.shard_id), self._life()))
                self.rollovers += 1
        self.lanes, self._los = lanes, [lane.lo for lane in lanes]
        self._trim(now)

    def _trim(self, now: float) -> None:
        horizon_ms = self.clock.wall_ms() - int(self.retention_s * 1000)
        for shard_id, shard in self.shards.items():
            if not shard.listed:
                continue
            created = self._created_ms[shard_id]
            cut = bisect.bisect_left(created, horizon_ms, lo=shard.trimmed_before)
            if cut > shard.trimmed_before:
                self.trimmed += cut - shard.trimmed_before
                shard.trimmed_before = cut
            closed_at = self._closed_at.get(shard_id)
            if closed_at is not None and now - closed_at >= self.retention_s:
                shard.listed = False
                self._get_records.forget(shard_id)

    def last_sequence(self, shard_id: str) -> Optional[str]:
        records = self.shards[shard_id].records
        return records[-1]["dynamodb"]["SequenceNumber"] if records else None

    # -- boto3's interface, with AWS's limits
    def describe_stream(self, StreamArn: str, Limit: int = 100, ExclusiveStartShardId: Optional[str] = None,
                        ShardFilter: Optional[dict] = None) -> dict:
        if not self._describe.attempt(StreamArn, self.clock.now_s):
            self.calls.append("DescribeStream")
            raise client_error("LimitExceededException", "Rate exceeded for stream", "DescribeStream")
        if ShardFilter is not None:
            if ShardFilter.get("Type") != "CHILD_SHARDS":
                raise client_error("ValidationException", f"bad ShardFilter {ShardFilter}", "DescribeStream")
            parent = ShardFilter.get("ShardId")
            self.calls.append("DescribeStream")
            children = [self._entry(s) for s in self.shards.values() if s.listed and s.parent_id == parent]
            return {"StreamDescription": {"StreamArn": self.stream_arn, "StreamStatus": self.stream_status,
                                          "StreamViewType": self.view_type, "TableName": self.table,
                                          "Shards": children}}
        out = super().describe_stream(StreamArn, Limit, ExclusiveStartShardId)
        out["StreamDescription"]["Shards"] = [self._entry(self.shards[s["ShardId"]])
                                              for s in out["StreamDescription"]["Shards"]]
        return out

    def _entry(self, shard) -> dict:
        seq_range = {"StartingSequenceNumber": self._start_seq[shard.shard_id]}
        if shard.closed:
            seq_range["EndingSequenceNumber"] = self.last_sequence(shard.shard_id) or self._start_seq[shard.shard_id]
        entry = {"ShardId": shard.shard_id, "SequenceNumberRange": seq_range}
        if shard.parent_id:
            entry["ParentShardId"] = shard.parent_id
        return entry

    def get_shard_iterator(self, StreamArn: str, ShardId: str, ShardIteratorType: str,
                           SequenceNumber: Optional[str] = None) -> dict:
        it = super().get_shard_iterator(StreamArn, ShardId, ShardIteratorType, SequenceNumber)["ShardIterator"]
        return {"ShardIterator": f"{it}|{self.clock.now_s!r}"}

    def get_records(self, ShardIterator: str, Limit: int = 1000) -> dict:
        try:
            inner, issued = ShardIterator.rsplit("|", 1)
            shard_id = inner.split("|", 1)[0]
            issued_s = float(issued)
        except ValueError:
            raise client_error("ValidationException", "invalid iterator") from None
        if not self._get_records.attempt(shard_id, self.clock.now_s):
            self.calls.append("GetRecords")
            raise client_error("LimitExceededException", "Rate exceeded for shard", "GetRecords")
        if self.clock.now_s - issued_s > self.limits.iterator_ttl_s:
            self.calls.append("GetRecords")
            raise client_error("ExpiredIteratorException", "Iterator expired")
        out = super().get_records(inner, Limit)
        if "NextShardIterator" in out:
            out["NextShardIterator"] = f"{out['NextShardIterator']}|{self.clock.now_s!r}"
        return out

    # -- what the oracle asks
    def unread_since(self, shard_id: str, checkpoint: Optional[str]) -> Optional[int]:
        """Creation ms of the shard's oldest record after ``checkpoint`` (None: none)."""
        shard = self.shards[shard_id]
        records = shard.records
        if not records:
            return None
        if checkpoint is None:
            i = shard.trimmed_before
        else:
            i = bisect.bisect_right(self._seqs[shard_id], int(checkpoint))
        return self._created_ms[shard_id][i] if i < len(records) else None

    def open_shards(self) -> int:
        return len(self.lanes)
