"""ReadChangeStream as the test change-stream server serves it: one partition
from a start time or continuation tokens, its changes in commit order, a
heartbeat every ``heartbeat_duration`` (default 5 s), CloseStream with the new
partitions at a split inside it, CloseStream OK once the stream passed
``end_time``."""
from __future__ import annotations

import time
from typing import Callable, Iterator

from ddb2bt.pipeline.testing import change_stream_wire as wire
from ddb2bt.pipeline.testing.change_log import ChangeLog, Range, TokenError, decode_token, encode_token

DEFAULT_HEARTBEAT_S = 5.0
# How often a waiting stream looks whether its caller is gone.
WAIT_STEP_S = 0.25
NO_SPLIT = 1 << 62


def _start(log: ChangeLog, req, rng: Range) -> tuple:
    """(the position to read after, [(Range, position)] floors of merged tokens)."""
    table = req.table_name
    if req.WhichOneof("start_from") == "continuation_tokens":
        tokens = [decode_token(log.server_id, t.token) for t in req.continuation_tokens.tokens]
        if not tokens:
            raise TokenError("continuation_tokens is empty")
        ranges = sorted(r for r, _ in tokens)
        covered = ranges[0].start == rng.start and ranges[-1].end == rng.end and all(
            a.end == b.start for a, b in zip(ranges, ranges[1:]))
        if not covered:
            raise TokenError("the continuation tokens' partitions do not exactly cover the request's partition")
        for _, seq in tokens:
            log.check_position(table, seq)
        return min(seq for _, seq in tokens), (tokens if len(tokens) > 1 else [])
    start_us = wire.us_of(req.start_time) if req.HasField("start_time") else log.now_us()
    return log.position_at(table, start_us), []


def _seen(floors: list, change) -> bool:
    return any(r.contains(change.row_key) and change.seq <= seq for r, seq in floors)


def serve_partition(log: ChangeLog, req, chunk_bytes: int, active: Callable[[], bool],
                    clock: Callable[[], float] = time.monotonic) -> Iterator:
    table = req.table_name
    rng = wire.range_of(req.partition)
    position, floors = _start(log, req, rng)
    end_us = wire.us_of(req.end_time) if req.HasField("end_time") else None
    beat_s = (req.heartbeat_duration.seconds + req.heartbeat_duration.nanos / 1e9) or DEFAULT_HEARTBEAT_S
    next_beat = clock() + beat_s
    while active():
        watermark = log.low_watermark_us()
        split = log.next_split(table, rng, position)
        changes, upto = log.read(table, rng, position, split.seq - 1 if split else NO_SPLIT)
        for change in changes:
            if end_us is not None and change.commit_us > end_us:
                yield wire.close_stream()
                return
            if not _seen(floors, change):
                yield from wire.data_change_messages(change, encode_token(log.server_id, rng, change.seq),
                                                     watermark, chunk_bytes)
        position = upto
        if split is not None and position >= split.seq - 1:
            halves = (Range(rng.start, split.key), Range(split.key, rng.end))
            yield wire.close_stream([(h, encode_token(log.server_id, h, split.seq)) for h in halves])
            return
        if end_us is not None and watermark > end_us:
            yield wire.close_stream()
            return
        if clock() >= next_beat:
            yield wire.heartbeat(rng, encode_token(log.server_id, rng, position), watermark)
            next_beat = clock() + beat_s
        with log.cond:
            if log.head(table) == position:
                log.cond.wait(min(WAIT_STEP_S, max(0.0, next_beat - clock())))
