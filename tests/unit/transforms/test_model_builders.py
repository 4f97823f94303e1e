"""model.slot_builder: the live path's records, positions and mapped changes built
by filling their slots are the very objects their constructors build (fields,
equality, repr, pickling; hash where there is one), and a stream record decodes to the same
ChangeRecord as before, field by field."""
from __future__ import annotations

import datetime as dt
import pickle
from dataclasses import fields

import pytest

from ddb2bt.pipeline.source.records import from_stream_record
from ddb2bt.transforms.model import (BackfillPosition, ChangeRecord, DeadLetter, DeleteCells, Guard, MappedChange,
                                     RowChange, SetCell, StreamPosition, build_backfill_position, build_change_record,
                                     build_guard, build_mapped_change, build_row_change, build_stream_position,
                                     datetime_to_ms, mutations_size, slot_builder)
from ddb2bt.transforms.wire import encode_mutations


def same(a, b) -> None:
    assert type(a) is type(b)
    assert [getattr(a, f.name) for f in fields(a)] == [getattr(b, f.name) for f in fields(b)]
    assert a == b and repr(a) == repr(b)
    assert pickle.loads(pickle.dumps(b)) == a


def test_builders_make_what_the_constructors_make() -> None:
    pos = StreamPosition("arn:s", "shardId-1", "100")
    same(pos, build_stream_position("arn:s", "shardId-1", "100"))
    assert hash(pos) == hash(build_stream_position("arn:s", "shardId-1", "100"))  # (records hold dicts: unhashable)
    record = ChangeRecord("MODIFY", {"pk": {"S": "a"}}, {"n": {"N": "1"}}, {"n": {"N": "0"}}, 5, pos, "e1", False,
                          42, 7, 9)
    built = build_change_record("MODIFY", {"pk": {"S": "a"}}, {"n": {"N": "1"}}, {"n": {"N": "0"}}, 5,
                                build_stream_position("arn:s", "shardId-1", "100"), "e1", False, 42, 7, 9)
    assert [getattr(built, f.name) for f in fields(ChangeRecord)] == [
        "MODIFY", {"pk": {"S": "a"}}, {"n": {"N": "1"}}, {"n": {"N": "0"}}, 5, pos, "e1", False, 42, 7, 9]
    assert built == record and repr(built) == repr(record)
    assert pickle.loads(pickle.dumps(built)) == record
    row = RowChange("t", b"k", (SetCell("f", b"q", b"v", 5),))
    dead = DeadLetter("r", "E", "m", "map", record, 1)
    same(MappedChange(record, (row,), None), build_mapped_change(record, (row,), None))
    same(MappedChange(record, (), dead), build_mapped_change(record, (), dead))
    with pytest.raises(AttributeError):  # still frozen
        built.change_ms = 6
    same(BackfillPosition("export", "data/a.json.gz", "7", 7),
         build_backfill_position("export", "data/a.json.gz", "7", 7))
    same(Guard("ddb2bt_touch", b"t#k", 5000, False, 4999), build_guard("ddb2bt_touch", b"t#k", 5000, False, 4999))
    assert hash(Guard("f", b"q", 1, True, 0)) == hash(build_guard("f", b"q", 1, True, 0))


def test_a_builder_needs_slots_and_no_post_init_unless_the_caller_computes_it() -> None:
    with pytest.raises(TypeError, match="RowChange"):
        slot_builder(RowChange)  # its __post_init__ computes size_bytes
    with pytest.raises(TypeError, match="MappedChange"):
        slot_builder(MappedChange, computed_by_caller=True)  # nothing to compute: a mistake
    mutations = (SetCell("f", b"q", b"v", 5), DeleteCells("f", b"q", 0, 5))
    guard = Guard("m", b"k", 4, True, 3)
    expected = RowChange("t", b"k", mutations, guard, -1, (("f", b"q", 5, True),), b"owner")
    object.__setattr__(expected, "wire", encode_mutations(mutations))
    built = build_row_change("t", b"k", mutations, guard, mutations_size(b"k", mutations),
                             (("f", b"q", 5, True),), b"owner", encode_mutations(mutations))
    same(expected, built)
    assert built.wire == expected.wire and built.size_bytes == expected.size_bytes


@pytest.mark.parametrize("raw", [
    {"eventID": "e1", "eventName": "INSERT", "dynamodb": {
        "Keys": {"pk": {"S": "a"}}, "NewImage": {"pk": {"S": "a"}}, "SequenceNumber": "100", "SizeBytes": 30,
        "ApproximateCreationDateTime": dt.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=dt.timezone.utc)}},
    {"eventID": "e2", "eventName": "REMOVE", "userIdentity": {"Type": "Service", "PrincipalId": "dynamodb.amazonaws.com"},
     "dynamodb": {"Keys": {"pk": {"S": "a"}}, "OldImage": {"pk": {"S": "a"}}, "SequenceNumber": "101",
                  "SizeBytes": "31", "ApproximateCreationDateTime": 1_700_000_000.25}},
    {"eventName": "MODIFY", "changeMicros": 1_700_000_000_250_001, "dynamodb": {"Keys": {"pk": {"S": "a"}}}},
    {},
])
def test_a_stream_record_decodes_field_by_field_as_the_constructor_would(raw) -> None:
    ddb = raw.get("dynamodb", {})
    created = ddb.get("ApproximateCreationDateTime")
    expected = ChangeRecord(
        event_name=raw.get("eventName", ""), keys=ddb.get("Keys") or {}, new_image=ddb.get("NewImage"),
        old_image=ddb.get("OldImage"), change_ms=datetime_to_ms(created) if created is not None else -1,
        position=StreamPosition("arn:s", "shardId-1", ddb.get("SequenceNumber", "")),
        event_id=raw.get("eventID", ""), is_ttl_delete=raw.get("eventName") == "REMOVE" and "userIdentity" in raw,
        size_bytes=int(ddb.get("SizeBytes", 0)), backfill_since_ms=None, change_us=raw.get("changeMicros", -1))
    same(expected, from_stream_record(raw, "arn:s", "shardId-1"))


def test_a_record_time_is_converted_as_datetime_to_ms_converts_it_whatever_came_before() -> None:
    """records._change_ms keeps the last time converted (a page's records share a
    second): any run of times — repeated, naive and aware, numbers equal to each
    other but of other types — gives datetime_to_ms's value every time."""
    import datetime as dt
    import random

    from ddb2bt.pipeline.source.records import _change_ms

    aware = dt.datetime(2024, 5, 1, 12, 0, 0, tzinfo=dt.timezone.utc)
    times = [aware, aware.replace(), aware.replace(tzinfo=None), aware + dt.timedelta(hours=2),
             aware.astimezone(dt.timezone(dt.timedelta(hours=2))), 1_714_564_800, 1_714_564_800.0,
             1_714_564_800.5, True, 1, 1.0, aware.replace(microsecond=999),
             # equal as numbers, not once converted (the float's product is rounded)
             2**60 + 2**8, float(2**60 + 2**8)]
    # across a DST change's repeated hour: equal under one tzinfo object, an hour apart
    from zoneinfo import ZoneInfo

    new_york = ZoneInfo("America/New_York")
    times += [dt.datetime(2024, 11, 3, 1, 30, tzinfo=new_york, fold=0),
              dt.datetime(2024, 11, 3, 1, 30, tzinfo=new_york, fold=1)]
    assert _change_ms(times[-2]) != _change_ms(times[-1])
    rng = random.Random(7)
    for _ in range(2_000):
        value = rng.choice(times)
        assert _change_ms(value) == datetime_to_ms(value), value
