"""The metrics of a committed sink batch."""
from __future__ import annotations

from ddb2bt.transforms.model import BackfillPosition
from ddb2bt.pipeline.observe.metrics import BACKFILL_EVENT
from ddb2bt.pipeline.sink.batch import Batch

__all__ = ["report_batch"]


def report_batch(m, batch: Batch, dead: list, ack_ms: int) -> list:
    """Metrics of a committed batch, on the caller's thread (Beam's metric
    mirrors count only there). Returns the dead letters."""
    if m is None:
        return dead
    dead_ids = {id(d.record) for d in dead}
    table = m.table
    applied: dict = {}  # event -> count: one counter update per label set
    skipped = 0
    # change time -> changes: a stream's times are whole seconds (docs/design.md
    # §2), so a batch has a few, and the lags are observed once per distinct one
    at_ms: dict = {}
    for element in batch.elements:
        record = element.record
        if dead_ids and id(record) in dead_ids:
            continue
        if not element.rows:
            skipped += 1
            continue
        # a backfilled item is a copy, not a change: counted apart from the stream's INSERTs
        event = BACKFILL_EVENT if isinstance(record.position, BackfillPosition) else record.event_name
        applied[event] = applied.get(event, 0) + 1
        change_ms = record.change_ms
        at_ms[change_ms] = at_ms.get(change_ms, 0) + 1
    if at_ms:
        m.observe_lag_counts({ack_ms - change_ms: n for change_ms, n in at_ms.items()})
    for event, count in applied.items():
        m.applied(table, event, count)
    if skipped:
        m.changes_skipped.labels(table).inc(skipped)
    for d in dead:
        m.dead_lettered(table, d.stage, d.reason)
    for (stream, shard), (count, change_ms) in batch.applied.items():
        m.lag.on_applied(stream, shard, change_ms, count)
    for c in batch.closed:  # read to its end and recorded finished: no lag of its own any more
        m.lag.forget(c.stream_arn, c.shard_id)
    m.checkpoint_time.set(ack_ms / 1000)
    m.lag.on_checkpoint(table, ack_ms / 1000)
    m.publish_lag()
    return dead
