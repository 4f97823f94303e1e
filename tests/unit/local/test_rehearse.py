"""The pure rules of the local recovery rehearsal (docs/recover.md, "Rehearse it
locally"): what the trimming proxy answers, what an incremental export made from
a stream's records holds, and that a rehearsal never reaches a real endpoint."""
from __future__ import annotations

import datetime as dt

import pytest

from ddb2bt.pipeline.local.rehearse import export_lines, local_endpoint, parse_incremental_spec
from ddb2bt.pipeline.local.trim_proxy import trimmed_answer
from ddb2bt.transforms.errors import ConfigError

ARN = "arn:aws:dynamodb:us-east-1:123456789012:table/T/stream/2026"
TRIMS = {ARN: {"s1": "100"}}


def ask(kind, seq=None, shard="s1"):
    return trimmed_answer({"StreamArn": ARN, "ShardId": shard, "ShardIteratorType": kind,
                           **({"SequenceNumber": seq} if seq else {})}, TRIMS)


def test_the_proxy_refuses_positions_at_or_before_the_trim_point_and_starts_trim_horizon_after_it():
    assert ask("AFTER_SEQUENCE_NUMBER", "99")[1] and "beyond the trim horizon" in ask("AFTER_SEQUENCE_NUMBER", "99")[1]
    assert ask("AFTER_SEQUENCE_NUMBER", "100") == (None, None)  # after the last gone record: the oldest held
    assert ask("AT_SEQUENCE_NUMBER", "100")[1] and ask("AT_SEQUENCE_NUMBER", "101") == (None, None)
    rewritten, error = ask("TRIM_HORIZON")
    assert error is None and rewritten["ShardIteratorType"] == "AFTER_SEQUENCE_NUMBER"
    assert rewritten["SequenceNumber"] == "100"
    assert ask("AFTER_SEQUENCE_NUMBER", "5", shard="s2") == (None, None)  # another shard: untrimmed
    assert ask("LATEST") == (None, None)


def record(second, name, keys, new=None, old=None):
    ddb = {"Keys": keys, "ApproximateCreationDateTime": dt.datetime.fromtimestamp(second, dt.timezone.utc)}
    if new is not None:
        ddb["NewImage"] = new
    if old is not None:
        ddb["OldImage"] = old
    return {"eventName": name, "dynamodb": ddb}


def test_an_export_made_from_stream_records_holds_each_item_s_images_at_the_window_s_ends():
    from ddb2bt.transforms.attrs import from_plain

    def it(**kw):  # an item as boto3's low-level client gives it
        return {k: from_plain(v) for k, v in kw.items()}

    a, b, c = it(pk="a"), it(pk="b"), it(pk="c")
    records = [
        record(99, "INSERT", a, new=it(pk="a", v=0)),  # before the window
        record(100, "MODIFY", a, new=it(pk="a", v=1), old=it(pk="a", v=0)),
        record(150, "MODIFY", a, new=it(pk="a", v=2), old=it(pk="a", v=1)),
        record(120, "INSERT", b, new=it(pk="b")),  # created and deleted in the window: left out
        record(130, "REMOVE", b, old=it(pk="b")),
        record(140, "REMOVE", c, old=it(pk="c", w="x")),  # deleted: no new image
        record(200, "MODIFY", a, new=it(pk="a", v=3), old=it(pk="a", v=2)),  # ExportToTime is exclusive
    ]
    lines = {line["Keys"]["pk"]["S"]: line for line in export_lines(records, 100, 200, "NEW_AND_OLD_IMAGES")}
    assert set(lines) == {"a", "c"}
    assert lines["a"]["OldImage"]["v"] == {"N": "0"} and lines["a"]["NewImage"]["v"] == {"N": "2"}
    assert lines["a"]["Metadata"]["WriteTimestampMicros"] == {"N": str(150 * 1_000_000)}
    assert "NewImage" not in lines["c"] and lines["c"]["OldImage"]["w"] == {"S": "x"}


def test_the_aws_cli_shorthand_is_read_and_checked():
    assert parse_incremental_spec("ExportFromTime=10,ExportToTime=20,ExportViewType=NEW_AND_OLD_IMAGES") == (
        10, 20, "NEW_AND_OLD_IMAGES")
    with pytest.raises(ConfigError, match="ExportToTime is missing"):
        parse_incremental_spec("ExportFromTime=10")
    with pytest.raises(ConfigError, match="not after"):
        parse_incremental_spec("ExportFromTime=20,ExportToTime=10")


def test_a_rehearsal_never_reaches_a_real_endpoint(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_DYNAMODB", "https://dynamodb.us-east-1.amazonaws.com")
    with pytest.raises(ConfigError, match="not the local stack"):
        local_endpoint()
    monkeypatch.delenv("AWS_ENDPOINT_URL_DYNAMODB")
    with pytest.raises(Exception, match="local up --detach"):
        local_endpoint()
