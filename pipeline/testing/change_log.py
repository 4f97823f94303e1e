"""The change log behind the test change-stream server: every mutation the
front forwarded to the emulator, with the commit time and sequence number it
assigned, the partition splits asked for, and the retention that trims old
records. Pure bookkeeping (no gRPC): ``change_stream_server`` serves it.

Positions are sequence numbers: records and splits of one table share one
counter, so "everything up to position q" is exact. A continuation token holds
a partition (a row range) and a position; reading a range from a position
delivers the records in that range after it, until the first split inside the
range after it, where the stream closes with the two halves as new partitions.
"""
from __future__ import annotations

import base64
import json
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

US_PER_S = 1_000_000


class TokenError(ValueError):
    """A continuation token this server did not issue, or one for another partition."""


class Expired(ValueError):
    """A start time or token older than the change stream's retention."""


@dataclass(frozen=True, order=True)
class Range:
    """A row range [start, end); an empty ``end`` is the end of the table."""

    start: bytes = b""
    end: bytes = b""

    def contains(self, key: bytes) -> bool:
        return key >= self.start and (not self.end or key < self.end)

    def strictly_inside(self, key: bytes) -> bool:
        return key > self.start and (not self.end or key < self.end)


@dataclass(frozen=True)
class LoggedChange:
    """One committed change: ``mutations`` are data.Mutation protobuf messages."""

    seq: int
    commit_us: int
    row_key: bytes
    mutations: tuple
    gc: bool = False


@dataclass(frozen=True)
class Split:
    seq: int
    key: bytes
    commit_us: int


@dataclass
class TableLog:
    """One table's change stream: its retention, records, splits and counter."""

    retention_s: float
    enabled_us: int
    changes: list = field(default_factory=list)
    splits: list = field(default_factory=list)
    seq: int = 0
    trimmed_through: int = 0  # the highest position retention has dropped


def encode_token(server_id: str, rng: Range, seq: int) -> str:
    raw = json.dumps({"i": server_id, "s": rng.start.hex(), "e": rng.end.hex(), "q": seq}).encode()
    return base64.urlsafe_b64encode(raw).decode()


def decode_token(server_id: str, token: str) -> tuple:
    """(Range, position) of a token; TokenError when it is not this server's."""
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        rng, seq, issuer = Range(bytes.fromhex(data["s"]), bytes.fromhex(data["e"])), int(data["q"]), data["i"]
    except (ValueError, KeyError, TypeError):
        raise TokenError(f"not a continuation token of this server: {token[:40]!r}") from None
    if issuer != server_id:
        raise TokenError("the continuation token was issued by another run of the change-stream server "
                         "(its log is gone); start from a time instead")
    return rng, seq


class ChangeLog:
    """Every table's change stream, thread-safe; ``cond`` wakes waiting readers."""

    def __init__(self, clock: Callable[[], float], server_id: str) -> None:
        self._clock = clock
        self.server_id = server_id
        self.cond = threading.Condition()
        self._tables: dict = {}
        self._last_us = 0
        # The commit time of a write on its way to the emulator (set under ``cond``).
        self.pending_us: Optional[int] = None

    # --- configuration -----------------------------------------------------------
    def enable(self, table: str, retention_s: float) -> None:
        with self.cond:
            log = self._tables.get(table)
            if log is None:
                self._tables[table] = TableLog(retention_s, self.now_us())
            else:
                log.retention_s = retention_s

    def disable(self, table: str) -> None:
        with self.cond:
            self._tables.pop(table, None)
            self.cond.notify_all()

    def retention_s(self, table: str) -> Optional[float]:
        with self.cond:
            log = self._tables.get(table)
            return None if log is None else log.retention_s

    def enabled(self, table: str) -> bool:
        with self.cond:
            return table in self._tables

    # --- time ----------------------------------------------------------------------
    def now_us(self) -> int:
        return int(self._clock() * US_PER_S)

    def next_commit_us(self) -> int:
        """A commit time strictly after every earlier one (call under ``cond``)."""
        self._last_us = max(self.now_us(), self._last_us + 1)
        return self._last_us

    def low_watermark_us(self) -> int:
        """No change logged from now on is older than this (commit times only grow;
        a write on its way holds the mark just below its commit time)."""
        with self.cond:
            if self.pending_us is not None:
                return self.pending_us - 1
            return max(self.now_us(), self._last_us)

    # --- writing -------------------------------------------------------------------
    def append(self, table: str, commit_us: int, row_key: bytes, mutations: tuple, gc: bool = False) -> None:
        """Record a committed change (call under ``cond``, with the commit time
        taken under the same hold)."""
        log = self._tables.get(table)
        if log is None or not mutations:
            return
        log.seq += 1
        log.changes.append(LoggedChange(log.seq, commit_us, row_key, tuple(mutations), gc))
        self._trim(log)
        self.cond.notify_all()

    def split(self, table: str, key: bytes) -> None:
        """Split the partition holding ``key`` at ``key`` (readers of it get CloseStream)."""
        with self.cond:
            log = self._require(table)
            if not key or key in {s.key for s in log.splits}:
                raise ValueError(f"{table} is already split at {key!r} (or the key is empty)")
            log.seq += 1
            log.splits.append(Split(log.seq, key, self.next_commit_us()))
            self.cond.notify_all()

    def _trim(self, log: TableLog) -> None:
        oldest = self.now_us() - int(log.retention_s * US_PER_S)
        drop = 0
        while drop < len(log.changes) and log.changes[drop].commit_us < oldest:
            drop += 1
        if drop:
            log.trimmed_through = log.changes[drop - 1].seq
            del log.changes[:drop]

    def trim(self, table: str) -> None:
        with self.cond:
            self._trim(self._require(table))

    # --- reading -------------------------------------------------------------------
    def _require(self, table: str) -> TableLog:
        log = self._tables.get(table)
        if log is None:
            raise KeyError(table)
        return log

    def head(self, table: str) -> int:
        """The table's last position (records and splits)."""
        with self.cond:
            return self._require(table).seq

    def partitions(self, table: str) -> list:
        """The table's partitions now: the key space cut at every split key."""
        with self.cond:
            keys = sorted(s.key for s in self._require(table).splits)
        bounds = [b""] + keys + [b""]
        return [Range(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]

    def position_at(self, table: str, start_us: int) -> int:
        """The position just before the first change at or after ``start_us``."""
        with self.cond:
            log = self._require(table)
            self._trim(log)
            now = self.now_us()
            if start_us > now:
                raise ValueError("the start time is in the future")
            if start_us < now - int(log.retention_s * US_PER_S) or start_us < log.enabled_us:
                raise Expired("the start time is before the change stream's retention period "
                              "or before the change stream was enabled")
            position = log.trimmed_through
            for event in [*log.changes, *log.splits]:
                if event.commit_us < start_us:
                    position = max(position, event.seq)
            return position

    def check_position(self, table: str, seq: int) -> None:
        with self.cond:
            log = self._require(table)
            self._trim(log)
            if seq < log.trimmed_through:
                raise Expired("the continuation token is older than the change stream's retention period: "
                              "changes after it are gone")
            if seq > log.seq:
                raise TokenError("the continuation token is ahead of this server's log")

    def next_split(self, table: str, rng: Range, after: int) -> Optional[Split]:
        """The first split inside ``rng`` after position ``after``."""
        with self.cond:
            inside = [s for s in self._require(table).splits if s.seq > after and rng.strictly_inside(s.key)]
        return min(inside, key=lambda s: s.seq) if inside else None

    def read(self, table: str, rng: Range, after: int, through: int) -> tuple:
        """(changes in ``rng`` with position in (after, through], the position read up to)."""
        with self.cond:
            log = self._require(table)
            self._trim(log)
            if after < log.trimmed_through:
                raise Expired("the stream fell behind the change stream's retention period")
            upto = min(through, log.seq)
            return [c for c in log.changes if after < c.seq <= upto and rng.contains(c.row_key)], upto
