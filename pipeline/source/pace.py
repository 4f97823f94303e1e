"""A partition reader's pacing facts per shard, in one place: AWS's 5
GetRecords per second per shard (the ``ShardPacer``), which shards are busy
(their last page had changes: read again at AWS's pace, like a backlog; an empty
page makes a shard idle again, polled every poll interval — docs/operations.md
"Within AWS's limits"), and which calls this reader made itself. The time of
the partition's latest call also travels in the reader's restriction
(``stream_source.PartitionRestriction.last_call_ms``): a reader that resumes a
restriction another DoFn instance or worker read a moment ago waits from that
call, not from nothing (``resume``)."""
from __future__ import annotations

from typing import Optional


class ShardPace:
    def __init__(self, pacer, poll_interval_s: float) -> None:
        self.pacer = pacer
        self._poll_interval_s = poll_interval_s
        self._busy: set = set()
        self._own_last: Optional[int] = None  # wall ms of this reader's latest call

    def idle(self, shard_id: str, pending: Optional[int]) -> bool:
        """At its head when last read (its last page empty, nothing pending)."""
        return shard_id not in self._busy and pending is None

    def ready_in(self, shard_id: str, pending: Optional[int]) -> float:
        """Seconds until ``shard_id`` may be read: AWS's pace, or the idle poll for
        an idle shard, whoever else is read."""
        return self.pacer.ready_in(shard_id, self._poll_interval_s if self.idle(shard_id, pending) else 0.0)

    def calling(self, now_ms: int) -> int:
        """This reader makes a call now: the time, for the restriction."""
        self._own_last = now_ms
        return now_ms

    def page(self, shard_id: str, empty: bool) -> None:
        (self._busy.discard if empty else self._busy.add)(shard_id)

    def closed(self, shard_id: str) -> None:
        self._busy.discard(shard_id)
        self.pacer.forget(shard_id)

    def resume(self, last_call_ms: Optional[int], positions, now_ms: int) -> None:
        """``last_call_ms`` from the restriction: a call this reader did not make
        itself (the restriction's previous holder's) paces the next call of each
        shard of ``positions`` ((shard id, position), ...) from its time."""
        if last_call_ms is None or last_call_ms == self._own_last:
            return
        ago = max(0.0, (now_ms - last_call_ms) / 1000)
        for shard_id, _ in positions:
            self.pacer.called_ago(shard_id, ago)
