"""The change-stream reader's merging of ReadChangeStream messages (the rules
of ReadChangeStreamResponse in google/bigtable/v2/bigtable.proto) and the
frontier of partitions across splits and merges, on hand-built messages."""
from __future__ import annotations

import pytest
from google.cloud.bigtable_v2.types import bigtable as bt

from ddb2bt.pipeline.clients.bigtable.changestream import (ChangeMerger, ChangeStreamError, Frontier, Heartbeat,
                                                          Partition, PartitionClosed)
from ddb2bt.transforms.change_records import DeleteCells, DeleteFamily, RowChange, SetCell

Response = bt.ReadChangeStreamResponse.pb()
USER, GC, CONTINUATION = 1, 2, 3
WHOLE = Partition()


def change(type_=USER, row_key=b"", chunks=(), done=False, token="", commit_us=0):
    msg = Response()
    d = msg.data_change
    d.type_ = type_
    d.row_key = row_key
    d.commit_timestamp.seconds, us = divmod(commit_us, 1_000_000)
    d.commit_timestamp.nanos = us * 1000
    d.tiebreaker = 7 if type_ != CONTINUATION else 0
    for c in chunks:
        d.chunks.append(c)
    d.done, d.token = done, token
    return msg


def set_cell(family="cf", qualifier=b"q", ts=1000, value=b"v", info=None):
    c = Response.MutationChunk()
    c.mutation.set_cell.family_name = family
    c.mutation.set_cell.column_qualifier = qualifier
    c.mutation.set_cell.timestamp_micros = ts
    c.mutation.set_cell.value = value
    if info is not None:
        size, offset, last = info
        c.chunk_info.chunked_value_size, c.chunk_info.chunked_value_offset, c.chunk_info.last_chunk = size, offset, last
    return c


def piece(value, size, offset, last):
    c = Response.MutationChunk()
    c.mutation.set_cell.value = value
    c.chunk_info.chunked_value_size, c.chunk_info.chunked_value_offset, c.chunk_info.last_chunk = size, offset, last
    return c


def delete_column(start=0, end=0):
    c = Response.MutationChunk()
    c.mutation.delete_from_column.family_name = "cf"
    c.mutation.delete_from_column.column_qualifier = b"q"
    c.mutation.delete_from_column.time_range.start_timestamp_micros = start
    c.mutation.delete_from_column.time_range.end_timestamp_micros = end
    return c


def delete_family():
    c = Response.MutationChunk()
    c.mutation.delete_from_family.family_name = "g"
    return c


def test_a_change_over_several_messages_with_a_chunked_value_merges_into_one_record():
    merger = ChangeMerger(WHOLE)
    assert merger.feed(change(row_key=b"r", commit_us=5_000_001, chunks=[
        delete_column(2000, 0), set_cell(ts=3000, value=b"ab", info=(5, 0, False))])) is None
    assert merger.feed(change(CONTINUATION, chunks=[piece(b"cd", 5, 2, False)])) is None
    record = merger.feed(change(CONTINUATION, chunks=[piece(b"e", 5, 4, True), delete_family()], done=True,
                                token="t1"))
    assert record == RowChange(b"r", 5_000_001, 7, "USER", (
        DeleteCells("cf", b"q", 2000, None), SetCell("cf", b"q", 3000, b"abcde"), DeleteFamily("g")),
        WHOLE.id, "t1")


def test_garbage_collection_is_marked_and_unbounded_ranges_are_none():
    record = ChangeMerger(WHOLE).feed(change(GC, b"r", [delete_column()], done=True, token="t"))
    assert record.source == "GC" and record.mutations == (DeleteCells("cf", b"q", None, None),)


@pytest.mark.parametrize("messages, problem", [
    ([change(CONTINUATION, chunks=[set_cell()], done=True)], "continuation without a start"),
    ([change(row_key=b"r", chunks=[set_cell()]), change(row_key=b"s", chunks=[set_cell()], done=True)],
     "started inside another"),
    ([change(row_key=b"r", chunks=[set_cell(value=b"ab", info=(4, 0, False))]),
      change(CONTINUATION, chunks=[piece(b"d", 4, 3, True)], done=True)], "out of order"),
    ([change(row_key=b"r", chunks=[set_cell(value=b"ab", info=(4, 0, False))], done=True)],
     "ended inside a chunked value"),
    ([change(row_key=b"r", chunks=[set_cell(value=b"ab", info=(3, 0, True))], done=True)], "announced 3"),
])
def test_a_broken_message_sequence_is_refused(messages, problem):
    merger = ChangeMerger(WHOLE)
    with pytest.raises(ChangeStreamError, match=problem):
        for m in messages:
            merger.feed(m)


def test_a_heartbeat_inside_an_unfinished_change_is_refused():
    merger = ChangeMerger(WHOLE)
    merger.feed(change(row_key=b"r", chunks=[set_cell()]))
    beat = Response()
    beat.heartbeat.continuation_token.token = "t"
    with pytest.raises(ChangeStreamError, match="heartbeat arrived inside an unfinished change"):
        merger.feed(beat)


def test_a_whole_row_delete_in_the_stream_is_refused_naming_it():
    c = Response.MutationChunk()
    c.mutation.delete_from_row.SetInParent()
    with pytest.raises(ChangeStreamError, match="delete_from_row"):
        ChangeMerger(WHOLE).feed(change(row_key=b"r", chunks=[c], done=True))


def test_heartbeat_and_close_stream_become_events():
    merger = ChangeMerger(WHOLE)
    beat = Response()
    beat.heartbeat.continuation_token.token = "t"
    beat.heartbeat.estimated_low_watermark.seconds = 3
    assert merger.feed(beat) == Heartbeat(WHOLE, "t", 3_000_000)
    close = Response()
    for start, end in ((b"", b"m"), (b"m", b"")):
        t = close.close_stream.continuation_tokens.add(token=start.decode() or "first")
        t.partition.row_range.start_key_closed, t.partition.row_range.end_key_open = start, end
        p = close.close_stream.new_partitions.add()
        p.row_range.start_key_closed, p.row_range.end_key_open = start, end
    closed = merger.feed(close)
    assert closed.new_partitions == (Partition(b"", b"m"), Partition(b"m", b""))
    assert closed.tokens_for(Partition(b"m", b"")) == [(Partition(b"m", b""), "m")]


def test_a_merged_partition_is_read_only_once_tokens_cover_it():
    a, b, merged = Partition(b"", b"m"), Partition(b"m", b""), Partition()
    frontier = Frontier(None)
    frontier.cursors = {a: [(a, "ta")], b: [(b, "tb")]}
    frontier.close(PartitionClosed(a, ((a, "ta2"),), (merged,)))
    assert list(frontier.cursors) == [b]  # [m, end) not yet covered
    frontier.close(PartitionClosed(b, ((b, "tb2"),), (merged,)))
    assert frontier.cursors == {merged: [(a, "ta2"), (b, "tb2")]}


def test_a_finished_stream_keeps_its_partition_to_read_again():
    frontier = Frontier(None)
    frontier.cursors = {WHOLE: [(WHOLE, "t")]}
    frontier.close(PartitionClosed(WHOLE, (), ()))
    assert frontier.cursors == {WHOLE: [(WHOLE, "t")]}


def test_partition_ids_round_trip():
    p = Partition(b"\x00a", b"\xffz")
    assert Partition.parse(p.id) == p
    with pytest.raises(ValueError, match="not a change-stream partition id"):
        Partition.parse("nocolon")


def test_a_quiet_partition_read_to_its_end_starts_after_it_and_a_token_clears_that():
    frontier = Frontier(1_000)
    frontier.cursors = {WHOLE: []}
    assert frontier.start_of(WHOLE) == 1_000
    frontier.finished(WHOLE, 5_000)
    assert frontier.start_of(WHOLE) == 5_001  # nothing up to 5000 is left: not from 1000 again (retention)
    frontier.advance(WHOLE, "t")
    assert frontier.start_of(WHOLE) == 1_000 and frontier.cursors[WHOLE] == [(WHOLE, "t")]
    frontier.finished(WHOLE, 9_000)  # with a token the token says where
    assert frontier.cursors[WHOLE] == [(WHOLE, "t")] and WHOLE not in frontier.starts


def test_the_frontier_survives_its_checkpoint_text():
    a, b, merged = Partition(b"", b"m"), Partition(b"m", b""), Partition()
    frontier = Frontier(7)
    frontier.cursors = {a: [(a, "ta")], b: []}
    frontier.finished(b, 100)
    frontier.close(PartitionClosed(a, ((a, "ta2"),), (merged,)))  # waits for b's token
    again = Frontier.from_json(frontier.to_json())
    assert (again.start_time_us, again.cursors, again.starts) == (7, {b: []}, {b: 101})
    again.close(PartitionClosed(b, ((b, "tb2"),), (merged,)))
    assert again.cursors == {merged: [(a, "ta2"), (b, "tb2")]}


def test_the_low_watermark_is_the_least_partition_mark_and_a_merge_keeps_the_lesser_parent():
    a, b, merged = Partition(b"", b"m"), Partition(b"m", b""), Partition()
    frontier = Frontier(100)
    frontier.cursors = {a: [], b: []}
    assert frontier.low_watermark_us() == 100  # nothing read yet: the start time
    frontier.advance(a, "ta")
    frontier.mark(a, 500)
    assert frontier.low_watermark_us() == 100  # b holds it back
    frontier.finished(b, 900)
    assert frontier.low_watermark_us() == 500
    frontier.mark(a, 400)  # a mark never goes back
    assert frontier.watermarks[a] == 500
    frontier.close(PartitionClosed(b, ((b, "tb"),), (merged,)))
    frontier = Frontier.from_json(frontier.to_json())  # a checkpoint between the two closes
    frontier.close(PartitionClosed(a, ((a, "ta2"),), (merged,)))
    assert frontier.watermarks == {merged: 500} and frontier.low_watermark_us() == 500
