"""A partition reader's pacing facts per shard, in one place: AWS's 5
GetRecords per second per shard (the ``ShardPacer``), which shards are busy
(their last page had changes: read again at AWS's pace, like a backlog; an empty
page makes a shard idle again, polled every poll interval — docs/operations.md
"Within AWS's limits"), and which calls this reader made itself. The time of
every call also travels in the reader's restriction
(``stream_source.PartitionRestriction.called``): a reader that resumes a
restriction another DoFn instance or worker read a moment ago waits from that
call, not from nothing (``resume``)."""
from __future__ import annotations

from typing import Optional


class ShardPace:
    def __init__(self, pacer, poll_interval_s: float) -> None:
        self.pacer = pacer
        self._poll_interval_s = poll_interval_s
        self._busy: set = set()
        self._own: dict = {}  # shard id -> wall ms of this reader's latest call on it

    def idle(self, shard_id: str, pending: Optional[int]) -> bool:
        """At its head when last read (its last page empty, nothing pending)."""
        return shard_id not in self._busy and pending is None

    def ready_in(self, shard_id: str, pending: Optional[int]) -> float:
        """Seconds until ``shard_id`` may be read: AWS's pace, or the idle poll for
        an idle shard, whoever else is read."""
        return self.pacer.ready_in(shard_id, self._poll_interval_s if self.idle(shard_id, pending) else 0.0)

    def calling(self, shard_id: str, now_ms: int) -> int:
        """This reader calls ``shard_id`` now: the time, for the restriction."""
        self._own[shard_id] = now_ms
        return now_ms

    def page(self, shard_id: str, empty: bool) -> None:
        (self._busy.discard if empty else self._busy.add)(shard_id)

    def closed(self, shard_id: str) -> None:
        self._busy.discard(shard_id)
        self.pacer.forget(shard_id)
        self._own.pop(shard_id, None)

    def resume(self, called: tuple, now_ms: int) -> None:
        """``called`` ((shard id, wall ms), ...) from the restriction: a call this
        reader did not make itself (the restriction's previous holder's) paces
        the shard's next call from its time."""
        for shard_id, at_ms in called:
            if self._own.get(shard_id) != at_ms:
                self.pacer.called_ago(shard_id, max(0.0, (now_ms - at_ms) / 1000))
