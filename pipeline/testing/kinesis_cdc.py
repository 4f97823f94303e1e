"""Kinesis Data Streams for DynamoDB, for the tests: the producer that writes a
table's changes into a Kinesis stream as DynamoDB would lives with the local
stack (``ddb2bt.pipeline.local.kinesis_cdc``, also used by ``ddb2bt demo
--kinesis``) and is re-exported here; ``FakeKinesis`` is Kinesis's read API over
in-memory shards, for what moto cannot show (trimming)."""
from __future__ import annotations

import json

from ddb2bt.pipeline.local.kinesis_cdc import (Disorder, change_document, publish_changes,  # noqa: F401 (re-export)
                                               read_table_changes, split_first_open_shard)

__all__ = ["Disorder", "FakeKinesis", "MeteredKinesis", "change_document", "publish_changes", "read_table_changes"]


class FakeKinesis:
    """Kinesis's read API over in-memory shards: {shard: [records]}, parents,
    closed shards, and a trim point per shard (records before it are gone)."""

    def __init__(self) -> None:
        self.shards: dict = {}
        self.parents: dict = {}
        self.closed: set = set()
        self.trimmed: dict = {}  # shard -> index of the oldest record still kept
        # shard -> how many empty pages a new iterator gets before its records,
        # with MillisBehindLatest > 0, as Kinesis may answer (GetRecords API)
        self.empty_pages: dict = {}
        self.calls: list = []
        # MillisBehindLatest of a page with records left after it (the figure is
        # nominal: a minute, well beyond the reader's tip slack); 0 at the tip.
        self.behind_ms = 60_000

    def add(self, shard, docs, parent=None, closed=False, first_seq=1):
        """A shard holding ``docs`` (change documents) from sequence number ``first_seq``."""
        self.shards[shard] = [{"SequenceNumber": str(first_seq + i), "Data": json.dumps(d).encode()}
                              for i, d in enumerate(docs)]
        self.parents[shard] = parent
        if closed:
            self.closed.add(shard)

    def describe_stream_summary(self, **kw):
        return {"StreamDescriptionSummary": {"StreamName": "cdc", "RetentionPeriodHours": 48}}

    def list_shards(self, **kw):
        out = []
        for sid, records in self.shards.items():
            rng = {"StartingSequenceNumber": records[0]["SequenceNumber"] if records else "0"}
            if sid in self.closed:
                rng["EndingSequenceNumber"] = records[-1]["SequenceNumber"] if records else "0"
            out.append({"ShardId": sid, "ParentShardId": self.parents[sid], "SequenceNumberRange": rng})
        return {"Shards": out}

    def _kept(self, shard):
        return self.shards[shard][self.trimmed.get(shard, 0):]

    def get_shard_iterator(self, ShardId, ShardIteratorType, StartingSequenceNumber=None, Timestamp=None, **kw):
        kept = self._kept(ShardId)
        if ShardIteratorType in ("TRIM_HORIZON", "AT_TIMESTAMP"):
            index = 0
        elif ShardIteratorType == "LATEST":
            index = len(kept)
        else:
            seq = int(StartingSequenceNumber)
            index = next((i for i, r in enumerate(kept) if int(r["SequenceNumber"]) >= seq
                          + (ShardIteratorType == "AFTER_SEQUENCE_NUMBER")), len(kept))
        return {"ShardIterator": f"{ShardId}|{index}|{self.empty_pages.get(ShardId, 0)}"}

    def get_records(self, ShardIterator, Limit):
        shard, index, empties = ShardIterator.split("|")
        self.calls.append(shard)
        kept = self._kept(shard)
        if int(empties) > 0:
            behind = self.behind_ms if int(index) < len(kept) else 0
            return {"Records": [], "NextShardIterator": f"{shard}|{index}|{int(empties) - 1}",
                    "MillisBehindLatest": behind}
        page = kept[int(index):int(index) + Limit]
        end = int(index) + len(page)
        nxt = None if shard in self.closed and end >= len(kept) else f"{shard}|{end}|0"
        behind = self.behind_ms if end < len(kept) else 0
        return {"Records": page, "NextShardIterator": nxt, "MillisBehindLatest": behind}


class MeteredKinesis:
    """A Kinesis client (``FakeKinesis`` or boto3's) that records every
    GetRecords call — (time by ``clock``, shard, bytes returned) — to check
    Kinesis's per-shard read budget across readers: wrap the one client every
    reader's calls reach (several readers, with pacers of their own as in
    several processes, share one ``MeteredKinesis``)."""

    def __init__(self, inner, clock) -> None:
        self._inner = inner
        self._clock = clock
        self._shard_of: dict = {}  # iterator -> shard id (kept: two readers may be handed equal iterators)
        self.calls: list = []  # (time, shard, bytes)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def get_shard_iterator(self, **kw):
        out = self._inner.get_shard_iterator(**kw)
        self._shard_of[out["ShardIterator"]] = kw["ShardId"]
        return out

    def get_records(self, ShardIterator, Limit):
        shard = self._shard_of.get(ShardIterator, "?")
        page = self._inner.get_records(ShardIterator=ShardIterator, Limit=Limit)
        self.calls.append((self._clock(), shard, sum(len(r.get("Data") or b"") for r in page.get("Records") or [])))
        if page.get("NextShardIterator"):
            self._shard_of[page["NextShardIterator"]] = shard
        return page

    def busiest(self, shard: str, window_s: float) -> tuple:
        """(calls, bytes): the most GetRecords calls and the most bytes on
        ``shard`` in any window of ``window_s`` seconds (half-open, starting at
        a call)."""
        times = sorted((t, n) for t, s, n in self.calls if s == shard)
        most_calls = most_bytes = 0
        for i, (start, _) in enumerate(times):
            inside = [n for t, n in times[i:] if t < start + window_s]
            most_calls, most_bytes = max(most_calls, len(inside)), max(most_bytes, sum(inside))
        return most_calls, most_bytes
