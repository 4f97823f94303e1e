"""BatchingWriter: coalescing, limits, retries, isolation, dead letters and
checkpoints, against the in-memory Bigtable with injected faults."""
import threading

import pytest

from ddb2bt.pipeline.clients.bigtable.errors import BigtablePermanent, BigtableRetryable, EntryStatus
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.pipeline.observe.metrics import PipelineMetrics
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.sink.sink import BatchingWriter, SinkConfig
from ddb2bt.pipeline.control.state import StateStore
from prometheus_client import CollectorRegistry
from ddb2bt.transforms.model import (DeadLetter, DeleteCells, MappedChange, RowChange, SetCell, ShardClosed,
                              StreamPosition, ChangeRecord)

ARN = "arn:aws:dynamodb:us-east-1:1:table/T/stream/2024"
UNAVAILABLE, INTERNAL, INVALID_ARGUMENT = 14, 13, 3
FAST = RetryPolicy(initial_s=0.001, max_backoff_s=0.002, deadline_s=5.0)


def change(seq, row=b"r", value=b"v", ts=1000, shard="s1", family="f", table="t"):
    rec = ChangeRecord("MODIFY", {"k": {"S": "x"}}, {}, {}, ts, StreamPosition(ARN, shard, str(seq)))
    rows = (RowChange(table, row, (SetCell(family, b"q", value, ts), DeleteCells(family, b"q", 0, ts))),)
    return MappedChange(rec, rows)


def make(fault=None, config=SinkConfig(retry=FAST), families=None, overlap=False):
    bt = InMemoryBigtable(families={"t": {"f"}} if families is None else families, fault=fault)
    state = StateStore(bt, "job", lambda: 5)
    metrics = PipelineMetrics(CollectorRegistry())
    known = (lambda table: frozenset(bt.families[table])) if families is None else (lambda t: None)
    writer = BatchingWriter(bt, state, config, metrics, known, now_ms=lambda: 5, sleep=lambda s: None,
                            overlap=overlap)
    return bt, state, writer, metrics


def sample(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, labels) or 0


def test_changes_to_one_row_coalesce_into_one_entry_in_stream_order():
    bt, state, w, metrics = make()
    w.add(change(1, value=b"a", ts=1000))
    w.add(change(2, value=b"b", ts=1000))  # same second: the later must win
    w.add(change(3, row=b"other"))
    assert w.pending_rows == 2
    w.flush()
    data_calls = [keys for table, keys in bt.calls if table == "t"]
    assert len(data_calls) == 1 and sorted(data_calls[0]) == [b"other", b"r"]
    assert bt.latest("t")[b"r"][("f", b"q")] == b"b"
    assert sample(metrics, "ddb2bt_changes_coalesced_total", table="job") == 1
    assert sample(metrics, "ddb2bt_changes_applied_total", table="job", event="MODIFY") == 3


def test_checkpoint_is_written_only_after_the_writes_are_acknowledged():
    order = []
    bt, state, w, _ = make(fault=lambda table, entries, n: order.append(table) or None)
    w.add(change(7))
    assert state.load_checkpoints(ARN) == {}
    w.flush()
    assert order == ["t", "__state__"]
    assert state.load_checkpoints(ARN)["s1"].sequence_number == "7"


def test_batches_are_bounded_by_rows_and_flushed_by_size():
    bt, state, w, _ = make(config=SinkConfig(max_batch_rows=3, retry=FAST))
    for i in range(7):
        w.add(change(i, row=b"r%d" % i))
    w.flush()
    sizes = [len(keys) for table, keys in bt.calls if table == "t"]
    assert sizes == [3, 3, 1]
    assert state.load_checkpoints(ARN)["s1"].sequence_number == "6"


def test_mutation_limit_flushes_before_exceeding_and_never_splits_a_row():
    bt, state, w, _ = make(config=SinkConfig(max_batch_mutations=5, retry=FAST))
    for i in range(5):  # 2 mutations each
        w.add(change(i, row=b"r%d" % (i % 2)))
    w.flush()
    calls = [keys for table, keys in bt.calls if table == "t"]
    # 2 changes = 4 mutations per request: a third would exceed 5
    assert [len(c) for c in calls] == [2, 2, 1]
    assert len(bt.latest("t")) == 2


def test_only_failed_entries_are_retried_and_then_succeed():
    def fault(table, entries, n):
        if table == "t" and n == 0:  # first call: second entry unavailable
            return [None, EntryStatus(UNAVAILABLE, "try later")]
        return None
    bt, state, w, metrics = make(fault=fault)
    w.add(change(1, row=b"a"))
    w.add(change(2, row=b"b"))
    assert w.flush() == []
    assert bt.calls[1] == ("t", [b"b"])
    assert set(bt.latest("t")) == {b"a", b"b"}
    assert sample(metrics, "ddb2bt_bigtable_retries_total", table="job", code="UNAVAILABLE") == 1


def test_whole_call_failures_are_retried():
    calls = []

    def fault(table, entries, n):
        calls.append(n)
        if table == "t" and len(calls) <= 2:
            raise BigtableRetryable("UNAVAILABLE", code="UNAVAILABLE")
    bt, state, w, _ = make(fault=fault)
    w.add(change(1))
    w.flush()
    assert b"r" in bt.latest("t")


def test_deadline_exceeded_raises_and_does_not_checkpoint():
    bt, state, w, _ = make(fault=lambda t, e, n: [EntryStatus(UNAVAILABLE, "down")] * len(e) if t == "t" else None,
                           config=SinkConfig(retry=RetryPolicy(initial_s=0.001, max_backoff_s=0.001, deadline_s=0.05)))
    w.add(change(1))
    with pytest.raises(BigtableRetryable, match="gave up writing to t"):
        w.flush()
    assert state.load_checkpoints(ARN) == {}


def test_permanent_failure_is_isolated_to_the_bad_change_and_dead_lettered_durably():
    def fault(table, entries, n):
        if table != "t":
            return None
        # the emulator's answer when any mutation names an unknown family
        return [EntryStatus(INTERNAL, 'unknown family "zz"') if any(m.family == "zz" for m in muts) else None
                for _, muts in entries]
    bt, state, w, metrics = make(fault=fault, families={"t": {"f", "zz"}})
    w.add(change(1, value=b"good1"))
    w.add(change(2, family="zz"))  # coalesced into the same entry as 1 and 3
    w.add(change(3, value=b"good3"))
    dead = w.flush()
    assert [d.record.position.sequence_number for d in dead] == ["2"]
    assert dead[0].reason == "unknown_family" and dead[0].stage == "write"
    assert bt.latest("t")[b"r"][("f", b"q")] == b"good3"
    stored = state.list_dead_letters()
    assert [e["reason"] for e in stored] == ["unknown_family"]
    assert state.load_checkpoints(ARN)["s1"].sequence_number == "3"
    assert sample(metrics, "ddb2bt_dead_letters_total", table="job", stage="write", reason="unknown_family") == 1


def test_unknown_family_is_caught_before_writing_when_the_schema_is_known():
    bt, state, w, _ = make()
    w.add(change(1, family="nope"))
    dead = w.flush()
    assert [d.reason for d in dead] == ["unknown_family"]
    assert [t for t, _ in bt.calls if t == "t"] == []


def test_request_rejected_as_a_whole_is_split_to_find_the_culprit():
    def fault(table, entries, n):
        if table == "t" and any(k == b"bad" for k, _ in entries):
            raise BigtablePermanent("INVALID_ARGUMENT: bad", code="INVALID_ARGUMENT")
    bt, state, w, _ = make(fault=fault)
    w.add(change(1, row=b"ok"))
    w.add(change(2, row=b"bad"))
    dead = w.flush()
    assert [d.record.position.sequence_number for d in dead] == ["2"]
    assert b"ok" in bt.latest("t")


def test_missing_table_stops_the_job():
    def fault(table, entries, n):
        if table == "t":
            raise BigtablePermanent("NOT_FOUND: table", code="NOT_FOUND")
    bt, state, w, _ = make(fault=fault)
    w.add(change(1))
    with pytest.raises(BigtablePermanent):
        w.flush()
    assert state.load_checkpoints(ARN) == {}


def test_map_stage_dead_letters_are_stored_and_passed_by_the_checkpoint():
    bt, state, w, _ = make()
    rec = ChangeRecord("INSERT", {"k": {"S": "x"}}, {}, None, 1000, StreamPosition(ARN, "s1", "9"))
    dl = DeadLetter("row_key_too_long", "MappingError", "too long", "map", rec, 5)
    w.add(MappedChange(rec, dead_letter=dl))
    assert w.flush() == [dl]
    assert state.list_dead_letters()[0]["reason"] == "row_key_too_long"
    assert state.load_checkpoints(ARN)["s1"].sequence_number == "9"


def test_shard_closed_marks_the_shard_finished_after_its_writes():
    bt, state, w, _ = make()
    w.add(change(1))
    w.add(ShardClosed(ARN, "s1", "1"))
    w.flush()
    ck = state.load_checkpoints(ARN)["s1"]
    assert ck.finished and ck.sequence_number == "1"


def test_a_finished_shard_leaves_the_lag_gauges():
    """A shard read to its end (a split's parent) has no lag any more: kept, its
    lag (now − its last change) and the table's checkpoint age would grow for
    ever after every split and page DDB2BTReplicationLagHigh / CheckpointStale."""
    bt, state, w, metrics = make()
    w.add(change(1))
    w.flush()
    assert (ARN, "s1") in metrics.lag.lag_seconds()
    w.add(ShardClosed(ARN, "s1", "1"))
    w.flush()
    assert (ARN, "s1") not in metrics.lag.lag_seconds()
    assert metrics.lag.checkpoint_age_seconds() == {}


def test_config_limits_are_validated():
    with pytest.raises(ValueError):
        SinkConfig(max_batch_mutations=100_001)
    with pytest.raises(ValueError):
        SinkConfig(max_batch_rows=0)


def test_batches_are_bounded_by_bytes_and_a_row_is_never_split():
    bt, state, w, _ = make(config=SinkConfig(max_batch_bytes=2500, retry=FAST))
    for i in range(5):  # ~1 KB each: two fit under 2,500 bytes, a third does not
        w.add(change(i, row=b"r%d" % i, value=b"x" * 1000))
    w.flush()
    calls = [keys for table, keys in bt.calls if table == "t"]
    assert [len(c) for c in calls] == [2, 2, 1]
    assert all(len(v) == 1000 for row in bt.latest("t").values() for v in row.values())


def test_overlap_buffers_the_next_batch_while_one_is_in_flight_and_sends_it_only_after_the_ack():
    entered, release = threading.Event(), threading.Event()

    def hold_first_write(table, entries, n):
        if table == "t" and not release.is_set():
            entered.set()
            assert release.wait(10)

    bt, state, w, metrics = make(fault=hold_first_write, config=SinkConfig(retry=FAST, max_batch_rows=2),
                                 overlap=True)
    w.add(change(1, row=b"a", value=b"old"))
    w.add(change(2, row=b"b"))
    assert w.add(change(3, row=b"c")) == []  # {a, b} is full: written on the sink thread
    assert entered.wait(10)
    w.add(change(4, row=b"a", value=b"new"))  # buffered meanwhile, not sent: a is in flight
    assert w.pending_rows == 2
    assert [sorted(keys) for table, keys in bt.calls if table == "t"] == [[b"a", b"b"]]
    release.set()
    w.flush()  # waits for {a, b}, then writes {c, a}
    assert [sorted(keys) for table, keys in bt.calls if table == "t"] == [[b"a", b"b"], [b"a", b"c"]]
    assert bt.latest("t")[b"a"][("f", b"q")] == b"new"
    assert state.load_checkpoints(ARN)["s1"].sequence_number == "4"
    assert sample(metrics, "ddb2bt_changes_applied_total", table="job", event="MODIFY") == 4
    w.close()


def test_overlap_a_batch_failing_on_the_sink_thread_fails_the_next_flush_without_checkpointing():
    def table_gone(table, entries, n):
        if table == "t":
            raise BigtablePermanent("NOT_FOUND: table", code="NOT_FOUND")

    bt, state, w, _ = make(fault=table_gone, config=SinkConfig(retry=FAST, max_batch_rows=1), overlap=True)
    w.add(change(1, row=b"a"))
    w.add(change(2, row=b"b"))  # {a} goes to the sink thread and fails there
    with pytest.raises(BigtablePermanent, match="NOT_FOUND"):
        w.flush()
    assert state.load_checkpoints(ARN) == {}
    w.close()


def test_page_batches_round_trip_through_their_coder_and_are_sized_without_encoding():
    from ddb2bt.pipeline.source.coders import StreamElementCoder
    from ddb2bt.transforms.model import MappedBatch, RecordBatch

    records = tuple(change(i, row=b"r%d" % i).record for i in range(3))
    batch = RecordBatch(tuple(ChangeRecord(r.event_name, r.keys, r.new_image, r.old_image, r.change_ms,
                                           r.position, size_bytes=500) for r in records))
    coder = StreamElementCoder()
    assert coder.decode(coder.encode(batch)) == batch
    closed = ShardClosed(ARN, "s1", "9")
    assert coder.decode(coder.encode(closed)) == closed
    coder.encode = None  # estimate_size must not encode
    assert coder.estimate_size(batch) == 3 * (500 + 100)
    mapped = MappedBatch(tuple(change(i) for i in range(2)))
    assert coder.estimate_size(mapped) == 2 * 100


def test_the_sink_takes_a_mapped_batch_as_its_changes_in_order():
    from ddb2bt.transforms.model import MappedBatch

    bt, state, w, _ = make()
    w.add(MappedBatch((change(1, value=b"a"), change(2, value=b"b"))))
    w.flush()
    assert bt.latest("t")[b"r"][("f", b"q")] == b"b"
    assert state.load_checkpoints(ARN)["s1"].sequence_number == "2"
