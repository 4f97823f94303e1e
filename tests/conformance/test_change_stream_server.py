"""The test change-stream server (pipeline/testing/change_stream_server.py)
against the documented behaviour of GenerateInitialChangeStreamPartitions and
ReadChangeStream (google/bigtable/v2/bigtable.proto), in front of a real
cbtemulator, read through the reader of pipeline/clients/bigtable/changestream.py
and through the raw generated client."""
from __future__ import annotations

import time
import uuid

import grpc
import pytest

from ddb2bt.pipeline.clients.bigtable.changestream import (ChangeStreamClient, ChangeStreamError, Heartbeat,
                                                          Partition, PartitionClosed, data_api_client,
                                                          read_changes, table_name)
from ddb2bt.pipeline.clients.bigtable.errors import BigtablePermanent
from ddb2bt.pipeline.testing.change_stream_server import (ChangeStreamServer, request_garbage_collection,
                                                           request_split)
from ddb2bt.transforms.change_records import DeleteCells, DeleteFamily, RowChange, SetCell

PROJECT, INSTANCE = "p", "i"


class Clock:
    """Wall time plus an offset a test moves forward (retention)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@pytest.fixture(scope="module")
def clock():
    return Clock()


@pytest.fixture(scope="module")
def front(stack, clock):
    with ChangeStreamServer(f"127.0.0.1:{stack.bigtable_port}", clock=clock, chunk_bytes=16) as server:
        yield server


@pytest.fixture
def env(front, monkeypatch):
    monkeypatch.setenv("BIGTABLE_EMULATOR_HOST", front.address)
    from google.cloud.bigtable import Client

    client = Client(project=PROJECT, admin=True)
    api = data_api_client()
    yield client, api
    api.transport.close()


def make_table(client, retention_s=3600, families=("cf", "g"), change_stream=True) -> tuple:
    table_id = f"t{uuid.uuid4().hex[:8]}"
    spec = {"column_families": {f: {} for f in families}}
    if change_stream:
        spec["change_stream_config"] = {"retention_period": {"seconds": retention_s}}
    client.table_admin_client.create_table(request={"parent": f"projects/{PROJECT}/instances/{INSTANCE}",
                                                    "table_id": table_id, "table": spec})
    return client.instance(INSTANCE).table(table_id), table_name(PROJECT, INSTANCE, table_id)


def now_us(clock) -> int:
    return int(clock() * 1_000_000)


def changes_of(api, name, start_us, idle_s=0.6) -> list:
    return list(read_changes(api, name, start_us, idle_s, poll_s=0.05))


def test_data_calls_are_forwarded_to_the_emulator(env):
    client, _ = env
    table, _ = make_table(client, change_stream=False)
    row = table.direct_row(b"a")
    row.set_cell("cf", b"q", b"1", timestamp=None)
    row.commit()
    rows = table.mutate_rows([_set(table, b"b", b"2"), _set(table, b"c", b"3")])
    assert [s.code for s in rows] == [0, 0]
    cond = table.conditional_row(b"a", filter_=None)
    cond.set_cell("cf", b"q2", b"x", state=True)
    cond.commit()
    append = table.append_row(b"a")
    append.append_cell_value("cf", b"q3", b"z")
    append.commit()
    read = {r.row_key: {q: c[0].value for q, c in r.cells["cf"].items()} for r in table.read_rows()}
    assert read == {b"a": {b"q": b"1", b"q2": b"x", b"q3": b"z"}, b"b": {b"q": b"2"}, b"c": {b"q": b"3"}}
    assert list(table.sample_row_keys())  # SampleRowKeys answers through the front


def _set(table, key, value, family="cf", qualifier=b"q"):
    row = table.direct_row(key)
    row.set_cell(family, qualifier, value)
    return row


def test_every_applied_write_is_one_change_in_commit_order(env, clock):
    client, api = env
    table, name = make_table(client)
    start = now_us(clock)
    _set(table, b"a", b"1").commit()
    statuses = table.mutate_rows([_set(table, b"b", b"2"), _set(table, b"c", b"3", family="nope")])
    assert [s.code for s in statuses][0] == 0 and statuses[1].code != 0
    cond = table.conditional_row(b"a", filter_=None)
    cond.set_cell("cf", b"yes", b"t", state=True)
    cond.set_cell("cf", b"no", b"f", state=False)
    cond.commit()  # the row exists: only the true branch applies
    delete = table.direct_row(b"b")
    delete.delete_cells("cf", [b"q"])
    delete.commit()
    whole = table.direct_row(b"a")
    whole.delete()
    whole.commit()
    changes = changes_of(api, name, start)
    assert [(c.row_key, c.mutations) for c in changes][1:] == [
        (b"b", (SetCell("cf", b"q", changes[1].mutations[0].timestamp_us, b"2"),)),
        (b"a", (SetCell("cf", b"yes", changes[2].mutations[0].timestamp_us, b"t"),)),
        (b"b", (DeleteCells("cf", b"q", None, None),)),
        (b"a", (DeleteFamily("cf"), DeleteFamily("g"))),  # DeleteFromRow: one DeleteFromFamily per family
    ]
    first = changes[0]
    assert first.row_key == b"a" and first.source == "USER" and first.partition == Partition().id
    # a server-assigned cell timestamp (-1) is the commit time's millisecond
    assert first.mutations[0].timestamp_us == first.commit_time_us // 1000 * 1000
    commits = [c.commit_time_us for c in changes]
    assert commits == sorted(set(commits)) and commits[0] >= start


def test_read_modify_write_shows_the_cell_it_wrote(env, clock):
    client, api = env
    table, name = make_table(client)
    start = now_us(clock)
    row = table.append_row(b"k")
    row.increment_cell_value("cf", b"n", 5)
    row.commit()
    [change] = changes_of(api, name, start)
    [cell] = change.mutations
    assert (cell.family, cell.qualifier, int.from_bytes(cell.value, "big")) == ("cf", b"n", 5)


def test_a_table_without_a_change_stream_has_none_and_update_table_enables_it(env, front):
    client, api = env
    table, name = make_table(client, change_stream=False)
    assert not client.table_admin_client.get_table(request={"name": name}).change_stream_config
    with pytest.raises(ChangeStreamError, match="not enabled.*create-table --change-stream") as disabled:
        ChangeStreamClient(api, name).partitions()
    assert disabled.value.reason == "change_stream_disabled"
    client.table_admin_client.update_table(request={
        "table": {"name": name, "change_stream_config": {"retention_period": {"seconds": 7200}}},
        "update_mask": {"paths": ["change_stream_config"]}}).result(timeout=10)
    shown = client.table_admin_client.get_table(request={"name": name}).change_stream_config
    assert shown.retention_period.total_seconds() == 7200
    assert ChangeStreamClient(api, name).partitions() == [Partition()]


def test_large_values_arrive_in_chunks_and_merge_exactly(env, clock):
    client, api = env
    table, name = make_table(client)
    start = now_us(clock)
    big = bytes(range(256)) * 3  # 768 bytes, chunks of 16
    row = table.direct_row(b"big")
    for i in range(150):  # more mutations than one message carries
        row.set_cell("g", f"q{i:03}".encode(), b"v")
    row.set_cell("cf", b"big", big)
    row.commit()
    raw = list(api.read_change_stream(request={"table_name": name, "partition": {"row_range": {}},
                                               "start_time": _ts(start), "end_time": _ts(now_us(clock) + 300_000)}))
    data = [type(r).pb(r).data_change for r in raw if type(r).pb(r).WhichOneof("stream_record") == "data_change"]
    assert len(data) > 2 and data[0].type_ == 1 and all(d.type_ == 3 for d in data[1:])
    assert [d.done for d in data] == [False] * (len(data) - 1) + [True] and data[-1].token
    assert any(c.chunk_info.chunked_value_offset > 0 for d in data for c in d.chunks)
    [change] = changes_of(api, name, start)
    assert change.mutations[-1] == SetCell("cf", b"big", change.mutations[-1].timestamp_us, big)
    assert len(change.mutations) == 151


def _ts(us: int) -> dict:
    return {"seconds": us // 1_000_000, "nanos": us % 1_000_000 * 1000}


def test_a_token_resumes_after_its_change_and_a_foreign_token_is_refused(env, clock):
    client, api = env
    table, name = make_table(client)
    start = now_us(clock)
    for key in (b"a", b"b", b"c"):
        _set(table, key, b"1").commit()
    stream = ChangeStreamClient(api, name)
    first = [e for e in stream.read(Partition(), start, end_time_us=now_us(clock) + 200_000)
             if isinstance(e, RowChange)]
    assert [c.row_key for c in first] == [b"a", b"b", b"c"]
    after = [e for e in stream.read(Partition(), tokens=[(Partition(), first[0].token)],
                                    end_time_us=now_us(clock) + 200_000) if isinstance(e, RowChange)]
    assert [c.row_key for c in after] == [b"b", b"c"]
    with pytest.raises(BigtablePermanent, match="INVALID_ARGUMENT: the continuation tokens' partitions"):
        list(stream.read(Partition(b"", b"m"), tokens=[(Partition(), first[0].token)]))
    with pytest.raises(BigtablePermanent, match="INVALID_ARGUMENT: not a continuation token"):
        list(stream.read(Partition(), tokens=[(Partition(), "garbage")]))


def test_heartbeats_carry_a_token_and_a_watermark_below_every_later_change(env, clock):
    client, api = env
    table, name = make_table(client)
    start = now_us(clock)
    stream = ChangeStreamClient(api, name)
    beats = [e for e in stream.read(Partition(), start, end_time_us=now_us(clock) + 700_000, heartbeat_s=0.1)
             if isinstance(e, Heartbeat)]
    assert len(beats) >= 3 and all(b.partition == Partition() for b in beats)
    assert [b.watermark_us for b in beats] == sorted(b.watermark_us for b in beats)
    _set(table, b"later", b"1").commit()
    [change] = [e for e in stream.read(Partition(), tokens=[(Partition(), beats[-1].token)],
                                       end_time_us=now_us(clock) + 200_000) if isinstance(e, RowChange)]
    assert change.row_key == b"later" and change.commit_time_us > beats[-1].watermark_us


def test_garbage_collection_deletes_the_cells_and_shows_as_a_gc_change(env, front, clock):
    client, api = env
    table, name = make_table(client)
    start = now_us(clock)
    for ts_ms in (1_000, 2_000):
        row = table.direct_row(b"r")
        row.set_cell("cf", b"q", b"v%d" % ts_ms, timestamp=_dt(ts_ms))
        row.commit()
    request_garbage_collection(front.address, name, b"r", "cf", b"q", 1_500_000)
    changes = changes_of(api, name, start)
    assert [c.source for c in changes] == ["USER", "USER", "GC"]
    assert changes[-1].mutations == (DeleteCells("cf", b"q", None, 1_500_000),)
    [row] = list(table.read_rows())
    assert [c.value for c in row.cells["cf"][b"q"]] == [b"v2000"]  # the older cell is gone from the table too


def _dt(ms: int):
    import datetime as dt

    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc)


def test_end_time_closes_the_stream_ok_without_partitions(env, clock):
    client, api = env
    _, name = make_table(client)
    events = list(ChangeStreamClient(api, name).read(Partition(), now_us(clock), end_time_us=now_us(clock)))
    assert events[-1] == PartitionClosed(Partition(), (), ())


def test_a_split_closes_the_stream_with_both_halves_and_their_tokens(env, front, clock):
    client, api = env
    table, name = make_table(client)
    start = now_us(clock)
    _set(table, b"a", b"before").commit()
    _set(table, b"x", b"before").commit()
    request_split(front.address, name, b"m")  # through the control RPC, as a separate process would
    _set(table, b"a", b"after").commit()
    _set(table, b"x", b"after").commit()
    stream = ChangeStreamClient(api, name)
    events = list(stream.read(Partition(), start))  # no end time: the split ends the stream
    assert [(e.row_key, e.mutations[0].value) for e in events if isinstance(e, RowChange)] == [
        (b"a", b"before"), (b"x", b"before")]
    closed = events[-1]
    halves = (Partition(b"", b"m"), Partition(b"m", b""))
    assert isinstance(closed, PartitionClosed) and closed.new_partitions == halves
    assert [p for p, _ in closed.tokens] == list(halves)
    assert stream.partitions() == list(halves)
    for half, key in zip(halves, (b"a", b"x")):
        after = [e for e in stream.read(half, tokens=closed.tokens_for(half), end_time_us=now_us(clock) + 200_000)
                 if isinstance(e, RowChange)]
        assert [(c.row_key, c.mutations[0].value, c.partition) for c in after] == [(key, b"after", half.id)]
    with pytest.raises(grpc.RpcError) as refused:
        request_split(front.address, name, b"m")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_tokens_that_together_cover_a_partition_resume_each_part_from_its_own(env, front, clock):
    """The request form of a merge: several tokens whose partitions exactly cover
    the request's; each part resumes after its own token."""
    client, api = env
    table, name = make_table(client)
    start = now_us(clock)
    front.split(name, b"m")
    halves = (Partition(b"", b"m"), Partition(b"m", b""))
    stream = ChangeStreamClient(api, name)
    _set(table, b"a", b"1").commit()
    _set(table, b"x", b"1").commit()
    [a1] = [e for e in stream.read(halves[0], start, end_time_us=now_us(clock) + 100_000) if isinstance(e, RowChange)]
    _set(table, b"a", b"2").commit()
    _set(table, b"x", b"2").commit()
    x_beat = [e for e in stream.read(halves[1], start, end_time_us=now_us(clock) + 300_000, heartbeat_s=0.1)
              if isinstance(e, Heartbeat)][-1]  # x's part read past both of its changes
    _set(table, b"x", b"3").commit()
    merged = [(e.row_key, e.mutations[0].value) for e in
              stream.read(Partition(), tokens=[(halves[0], a1.token), (halves[1], x_beat.token)],
                          end_time_us=now_us(clock) + 100_000) if isinstance(e, RowChange)]
    assert merged == [(b"a", b"2"), (b"x", b"3")]
    with pytest.raises(BigtablePermanent, match="do not exactly cover"):
        list(stream.read(Partition(), tokens=[(halves[0], a1.token)]))


def test_read_changes_follows_a_split_and_yields_each_change_once(env, front, clock):
    client, api = env
    table, name = make_table(client)
    start = now_us(clock)
    keys = [f"k{i:02}".encode() for i in range(20)]
    for key in keys[:10]:
        _set(table, key, b"1").commit()
    front.split(name, b"k05")
    for key in keys:
        _set(table, key, b"2").commit()
    seen = [(c.row_key, c.mutations[0].value) for c in changes_of(api, name, start)]
    assert sorted(seen) == sorted([(k, b"1") for k in keys[:10]] + [(k, b"2") for k in keys])
    assert all(seen.index((k, b"1")) < seen.index((k, b"2")) for k in keys[:10])  # per row, in commit order


def test_retention_drops_old_changes_and_refuses_older_starts_and_tokens(env, clock):
    client, api = env
    table, name = make_table(client, retention_s=60)
    start = now_us(clock)
    _set(table, b"old", b"1").commit()
    _set(table, b"old", b"2").commit()
    stream = ChangeStreamClient(api, name)
    [old, _] = [e for e in stream.read(Partition(), start, end_time_us=now_us(clock) + 100_000)
             if isinstance(e, RowChange)]
    clock.offset += 90  # past the retention
    try:
        _set(table, b"new", b"1").commit()
        with pytest.raises(ChangeStreamError, match="retention") as expired:
            list(stream.read(Partition(), start))
        assert expired.value.reason == "out_of_retention"
        # the token of the first change: the change after it is gone, so resuming there would lose it
        _set(table, b"newer", b"1").commit()
        with pytest.raises(ChangeStreamError, match="retention"):
            list(stream.read(Partition(), tokens=[(Partition(), old.token)]))
        recent = [e.row_key for e in stream.read(Partition(), now_us(clock) - 30_000_000,
                                                  end_time_us=now_us(clock) + 100_000) if isinstance(e, RowChange)]
        assert recent == [b"new", b"newer"]
    finally:
        clock.offset -= 90


def test_the_front_listens_on_loopback_only(front):
    assert front.address.startswith("127.0.0.1:")
