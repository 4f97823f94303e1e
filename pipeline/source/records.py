"""boto3 stream record → ChangeRecord, and records into batches. The one place the
stream's wire shape is interpreted (a dead letter's ChangeRecord ⇄ JSON lives with
the state store that keeps it: ``pipeline/control/letters.py``)."""
from __future__ import annotations

from typing import Any, Iterator, Mapping

from ddb2bt.transforms.model import (NO_CHANGE_TIME, REMOVE, ChangeRecord, RecordBatch, build_change_record,
                                     build_stream_position, datetime_to_ms)

TTL_PRINCIPAL = "dynamodb.amazonaws.com"
# Records per runner element: a full GetRecords page.
BATCH_RECORDS = 1000
# Yielded by a producer that has nothing ready: the records so far go out now.
FLUSH = object()


def from_stream_record(raw: Mapping[str, Any], stream_arn: str, shard_id: str) -> ChangeRecord:
    """A record from GetRecords (boto3 form) → ChangeRecord. Missing fields are kept
    missing (not invented) so the mapping dead-letters them with a precise reason."""
    # Runs for every record read: each field is looked up once.
    ddb = raw.get("dynamodb") or _NO_FIELDS
    event_name = raw.get("eventName", "")
    created = ddb.get("ApproximateCreationDateTime")
    size = ddb.get("SizeBytes")
    # Only a REMOVE is a TTL expiry: the service identity on any other event is
    # not a deletion, and `ttl.deletions: ignore` must not drop it.
    is_ttl_delete = False
    if event_name == REMOVE:
        identity = raw.get("userIdentity") or _NO_FIELDS
        is_ttl_delete = identity.get("Type") == "Service" and identity.get("PrincipalId") == TTL_PRINCIPAL
    # ChangeRecord's fields in order, the slots filled directly (model.slot_builder).
    return _change_record(
        event_name,  # event_name
        ddb.get("Keys") or {},  # keys
        ddb.get("NewImage"),  # new_image
        ddb.get("OldImage"),  # old_image
        _change_ms(created) if created is not None else NO_CHANGE_TIME,  # change_ms
        _position(stream_arn, shard_id, ddb.get("SequenceNumber", "")),  # position
        raw.get("eventID", ""),  # event_id
        is_ttl_delete,  # is_ttl_delete
        size if type(size) is int else int(size or 0),  # size_bytes
        None,  # backfill_since_ms: a stream record is not a backfill's
        # Kinesis records carry the change time in µs where the destination says
        # MICROSECOND (source/kinesis.py): the ordering guard's finer clock.
        raw.get("changeMicros", -1),  # change_us
    )


_NO_FIELDS: Mapping = {}  # read only: stands in for an absent field
# The last creation time converted, as (time, ms): a stream's times are whole
# seconds (docs/design.md §2), so a page's records share a few, and a time equal
# to the one before costs a comparison instead of a conversion. One tuple,
# replaced whole: readers on other threads see a pair that belongs together.
_last_created: tuple = (None, NO_CHANGE_TIME)


def _change_ms(created: Any) -> int:
    global _last_created
    last = _last_created
    # Equal, of one type, and of one fold: two aware times of one tzinfo object
    # compare equal across a DST change's repeated hour, an hour apart in UTC.
    if created == last[0] and type(created) is type(last[0]) and \
            getattr(created, "fold", 0) == getattr(last[0], "fold", 0):
        return last[1]
    ms = datetime_to_ms(created)
    _last_created = (created, ms)
    return ms


_change_record, _position = build_change_record, build_stream_position


def batch_records(elements: Iterator, size: int = 0) -> Iterator:
    """Consecutive ChangeRecords → RecordBatch of up to ``size`` (default
    BATCH_RECORDS), in order; other elements (markers) pass alone between them;
    ``FLUSH`` sends the records so far. Returns (as the generator's value) what
    ``elements`` returned. Used by the stream reader, whose records were each
    claimed before they were batched (a round stopped by a split still emits the
    primary's), and by the backfill reader."""
    size = size or BATCH_RECORDS
    batch: list = []
    while True:
        try:
            element = next(elements)
        except StopIteration as stop:
            if batch:
                yield RecordBatch(tuple(batch))
            return stop.value
        if type(element) is ChangeRecord:
            batch.append(element)
            if len(batch) >= size:
                yield RecordBatch(tuple(batch))
                batch = []
            continue
        if batch:
            yield RecordBatch(tuple(batch))
            batch = []
        if element is not FLUSH:
            yield element
