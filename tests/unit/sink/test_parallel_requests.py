"""A large batch goes out as several MutateRows requests at once
(``SinkConfig.parallel_requests``, docs/design.md §4.4): distinct rows in each,
every request acknowledged before the batch is checkpointed, a failed request
retried alone, and a request that cannot succeed failing the batch."""
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Optional

import pytest
from prometheus_client import CollectorRegistry

from ddb2bt.pipeline.clients.bigtable.errors import BigtablePermanent, BigtableRetryable, EntryStatus
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.control.lease import LeaseLost
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.observe.metrics import PipelineMetrics
from ddb2bt.pipeline.sink.batch import Row
from ddb2bt.pipeline.sink.config import MAX_PARALLEL_REQUESTS
from ddb2bt.pipeline.sink.requests import RequestAbandoned, RequestWriter
from ddb2bt.pipeline.sink.sink import BatchingWriter, SinkConfig
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.model import (ChangeRecord, DeleteCells, Guard, MappedChange, RowChange, SetCell,
                                     StreamPosition)

ARN = "arn:aws:dynamodb:us-east-1:1:table/T/stream/2024"
UNAVAILABLE = 14
FAST = RetryPolicy(initial_s=0.001, max_backoff_s=0.002, deadline_s=5.0)
# Long enough for any machine to bring every request of a batch to the barrier;
# only reached when the requests were sent one after another (the failure).
MEET_S = 20.0


def change(seq: int, row: bytes, value: bytes = b"v", ts: int = 1000) -> MappedChange:
    rec = ChangeRecord("MODIFY", {"k": {"S": "x"}}, {}, {}, ts, StreamPosition(ARN, "s1", str(seq)))
    return MappedChange(rec, (RowChange("t", row, (SetCell("f", b"q", value, ts), DeleteCells("f", b"q", 0, ts))),))


class MeetingWriter:
    """The in-memory Bigtable behind a barrier: each data request waits there
    until ``parties`` requests are in flight together, so a batch whose requests
    were sent one by one breaks the barrier instead of passing."""

    def __init__(self, bt: InMemoryBigtable, parties: int) -> None:
        self.bt = bt
        self.barrier = threading.Barrier(parties, timeout=MEET_S) if parties > 1 else None
        self.in_flight = self.most_in_flight = 0
        self._lock = threading.Lock()

    def mutate_rows(self, table_id, entries):
        if table_id != "t" or self.barrier is None:
            return self.bt.mutate_rows(table_id, entries)
        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            self.barrier.wait()
            return self.bt.mutate_rows(table_id, entries)
        finally:
            with self._lock:
                self.in_flight -= 1

    def __getattr__(self, name):
        return getattr(self.bt, name)


def make(config: SinkConfig, parties: int = 1, fault=None):
    bt = InMemoryBigtable(families={"t": {"f"}}, fault=fault)
    writer = MeetingWriter(bt, parties)
    state = StateStore(bt, "job", lambda: 5)
    metrics = PipelineMetrics(CollectorRegistry())
    sink = BatchingWriter(writer, state, config, metrics, lambda table: frozenset(bt.families[table]),
                          now_ms=lambda: 5, sleep=lambda s: None)
    return bt, writer, state, sink


def request_rows(n: int, guard: Optional[Guard] = None) -> list:
    """Rows as a batch's commit hands them to RequestWriter (one change each)."""
    rows = []
    for i in range(n):
        c = change(i, b"%s%d" % (b"g" if guard else b"r", i))
        rc = replace(c.rows[0], guard=guard)
        rows.append(Row("t", rc.row_key, list(rc.mutations), [(c, rc)]))
    return rows


def data_calls(bt) -> list:
    return [keys for table, keys in bt.calls if table == "t"]


def test_a_large_batch_goes_out_as_concurrent_requests_of_distinct_rows_then_is_checkpointed():
    bt, writer, state, sink = make(SinkConfig(retry=FAST, max_batch_rows=8, parallel_requests=4,
                                              min_request_rows=2), parties=4)
    rows = [b"r%d" % i for i in range(8)]
    for i, row in enumerate(rows):
        sink.add(change(i, row))
    assert sink.flush() == []
    calls = data_calls(bt)
    assert writer.most_in_flight == 4
    assert sorted(len(c) for c in calls) == [2, 2, 2, 2]
    assert sorted(k for c in calls for k in c) == sorted(rows)  # every row once, none split
    assert set(bt.latest("t")) == set(rows)
    assert state.load_checkpoints(ARN)["s1"].sequence_number == "7"
    sink.close()


def test_a_row_changed_twice_in_a_batch_is_one_entry_of_one_request():
    bt, writer, state, sink = make(SinkConfig(retry=FAST, max_batch_rows=8, parallel_requests=2,
                                              min_request_rows=1), parties=2)
    sink.add(change(1, b"a", value=b"old"))
    sink.add(change(2, b"b"))
    sink.add(change(3, b"a", value=b"new"))
    sink.flush()
    calls = data_calls(bt)
    assert sorted(calls) == [[b"a"], [b"b"]]
    assert bt.latest("t")[b"a"][("f", b"q")] == b"new"
    sink.close()


@pytest.mark.parametrize("parallel, rows, expected", [
    (1, 8, [8]),  # one request per batch, as before the split
    (4, 3, [3]),  # up to min_request_rows: not split
    (4, 5, [3, 2]),  # each request carries at least min_request_rows, the last the rest
    (2, 8, [4, 4]),
])
def test_how_a_batch_is_shared_among_requests(parallel, rows, expected):
    bt, writer, state, sink = make(SinkConfig(retry=FAST, max_batch_rows=8, parallel_requests=parallel,
                                              min_request_rows=3))
    for i in range(rows):
        sink.add(change(i, b"r%d" % i))
    sink.flush()
    assert sorted(len(c) for c in data_calls(bt)) == sorted(expected)  # sent at once: in any order
    assert len(bt.latest("t")) == rows
    sink.close()


def test_a_failed_request_is_retried_alone_and_the_others_are_not_resent():
    failed: list = []

    def fault(table, entries, n):
        # The request holding r0 fails retryably once, as a whole.
        if table == "t" and not failed and any(k == b"r0" for k, _ in entries):
            failed.append([k for k, _ in entries])
            return [EntryStatus(UNAVAILABLE, "try later")] * len(entries)
        return None

    bt, writer, state, sink = make(SinkConfig(retry=FAST, max_batch_rows=6, parallel_requests=3,
                                              min_request_rows=2), fault=fault)
    for i in range(6):
        sink.add(change(i, b"r%d" % i))
    assert sink.flush() == []
    sent = [k for c in data_calls(bt) for k in c]
    assert sorted(sent) == sorted([b"r%d" % i for i in range(6)] + failed[0])  # only those rows twice
    assert len(bt.latest("t")) == 6
    assert state.load_checkpoints(ARN)["s1"].sequence_number == "5"
    sink.close()


def test_a_request_that_cannot_succeed_fails_the_batch_after_the_others_and_nothing_is_checkpointed():
    def fault(table, entries, n):
        if table == "t" and any(k == b"r0" for k, _ in entries):
            raise BigtablePermanent("NOT_FOUND: table", code="NOT_FOUND")
        return None

    class SlowOthers(InMemoryBigtable):
        def mutate_rows(self, table_id, entries):
            if table_id == "t" and all(k != b"r0" for k, _ in entries):
                # The failure surfaces first; the batch must still wait for these.
                threading.Event().wait(0.2)
            return super().mutate_rows(table_id, entries)

    bt = SlowOthers(families={"t": {"f"}}, fault=fault)
    state = StateStore(bt, "job", lambda: 5)
    sink = BatchingWriter(bt, state, SinkConfig(retry=FAST, max_batch_rows=6, parallel_requests=3, min_request_rows=2),
                          PipelineMetrics(CollectorRegistry()), sleep=lambda s: None)
    for i in range(6):
        sink.add(change(i, b"r%d" % i))
    with pytest.raises(BigtablePermanent, match="NOT_FOUND"):
        sink.flush()
    assert state.load_checkpoints(ARN) == {}
    # The other requests were not abandoned half-way: each ended (written) before the error surfaced.
    assert len(bt.latest("t")) == 4
    sink.close()


def test_each_retrying_request_proves_ownership_and_a_lost_lease_fails_the_batch():
    proofs: list = []

    def fault(table, entries, n):
        if table == "t":
            return [EntryStatus(UNAVAILABLE, "try later")] * len(entries)  # every request keeps failing
        return None

    def still_owner():
        proofs.append(threading.get_ident())
        if len(proofs) >= 3:
            raise LeaseLost("the partition moved")

    bt = InMemoryBigtable(families={"t": {"f"}}, fault=fault)
    requests = RequestWriter(bt, SinkConfig(retry=FAST, parallel_requests=3, min_request_rows=2), None,
                             lambda s: None, dead_letter=None)
    requests.still_owner = still_owner  # as BatchingWriter's commit sets it for a batch
    rows = request_rows(6)
    with pytest.raises(LeaseLost, match="moved"):
        requests.write_all("t", rows)
    assert len(proofs) >= 3  # retries of the requests in flight each proved it (the third lost it)
    requests.close()


def test_the_batch_is_checkpointed_only_once_its_last_request_is_acknowledged():
    held, release = threading.Event(), threading.Event()

    class HoldOne(InMemoryBigtable):
        def mutate_rows(self, table_id, entries):
            if table_id == "t" and any(k == b"r5" for k, _ in entries):
                held.set()
                assert release.wait(MEET_S)
            return super().mutate_rows(table_id, entries)

    bt = HoldOne(families={"t": {"f"}})
    state = StateStore(bt, "job", lambda: 5)
    sink = BatchingWriter(bt, state, SinkConfig(retry=FAST, max_batch_rows=6, parallel_requests=3, min_request_rows=2),
                          PipelineMetrics(CollectorRegistry()), sleep=lambda s: None, overlap=True)
    for i in range(6):
        sink.add(change(i, b"r%d" % i))
    flushed = threading.Thread(target=sink.flush)
    flushed.start()
    assert held.wait(MEET_S)
    others = sorted(k for c in data_calls(bt) for k in c)
    assert state.load_checkpoints(ARN) == {} and flushed.is_alive()
    release.set()
    flushed.join(MEET_S)
    assert not flushed.is_alive()
    assert others == [b"r0", b"r1", b"r2", b"r3"]  # the other requests were written meanwhile
    assert state.load_checkpoints(ARN)["s1"].sequence_number == "5"
    sink.close()


def test_a_closed_writer_sends_a_late_batch_one_request_at_a_time():
    bt = InMemoryBigtable(families={"t": {"f"}})
    requests = RequestWriter(bt, SinkConfig(retry=FAST, parallel_requests=3, min_request_rows=2), None,
                             lambda s: None, dead_letter=None)
    requests.close()
    rows = request_rows(6)
    assert requests.write_all("t", rows) == []
    assert [keys for _, keys in bt.calls] == [[b"r0", b"r1"], [b"r2", b"r3"], [b"r4", b"r5"]]  # in order: no pool


def test_a_fatal_error_outranks_a_request_that_gave_up_retrying():
    def fault(table, entries, n):
        keys = [k for k, _ in entries]
        if b"r0" in keys:  # the first request: retryable until its deadline
            return [EntryStatus(UNAVAILABLE, "try later")] * len(entries)
        if b"r4" in keys:  # the last: the table is gone
            raise BigtablePermanent("NOT_FOUND: table", code="NOT_FOUND")
        return None

    bt = InMemoryBigtable(families={"t": {"f"}}, fault=fault)
    short = RetryPolicy(initial_s=0.001, max_backoff_s=0.002, deadline_s=0.05)
    requests = RequestWriter(bt, SinkConfig(retry=short, parallel_requests=3, min_request_rows=2), None,
                             lambda s: None, dead_letter=None)
    with pytest.raises(BigtablePermanent, match="NOT_FOUND") as raised:
        requests.write_all("t", request_rows(6))
    assert not isinstance(raised.value, BigtableRetryable)
    requests.close()


def test_split_requests_keep_their_app_profile_routing():
    class Routing(InMemoryBigtable):
        routes_transactional = True

        def __init__(self, **kw) -> None:
            super().__init__(**kw)
            self.routed: list = []

        def mutate_rows(self, table_id, entries, transactional=False):
            self.routed.append(({k[:1] for k, _ in entries}, transactional))
            return super().mutate_rows(table_id, entries)

    bt = Routing(families={"t": {"f", "m"}})
    requests = RequestWriter(bt, SinkConfig(retry=FAST, parallel_requests=3, min_request_rows=2), None,
                             lambda s: None, dead_letter=None)
    guard = Guard("m", b"t#x", since_ms=2000, conditional=False, backfill_ms=999)
    assert requests.write_split("t", request_rows(6) + request_rows(6, guard)) == []
    # Each group split in three; a guarded row (the backfill's, "g") only ever through the transactional profile.
    assert sorted(bt.routed, key=repr) == sorted([({b"r"}, False)] * 3 + [({b"g"}, True)] * 3, key=repr)
    requests.close()


@pytest.mark.parametrize("field, value", [("parallel_requests", 0), ("parallel_requests", MAX_PARALLEL_REQUESTS + 1),
                                          ("min_request_rows", 0)])
def test_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SinkConfig(**{field: value})


class ThreadPoolSpy:
    """A pool that remembers each request's future and the row keys it carries."""

    def __init__(self, futures: list) -> None:
        self._pool = ThreadPoolExecutor(4)
        self._futures = futures

    def submit(self, fn, table, batch, *args):
        future = self._pool.submit(fn, table, batch, *args)
        future.keys = [r.row_key for r in batch]
        self._futures.append(future)
        return future

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def test_an_interrupt_while_waiting_ends_the_wait_at_once_and_stops_the_other_requests_retrying(monkeypatch):
    """Ctrl-C reaches the thread waiting for a batch's requests: it re-raises at
    once (not when the slowest request ends), and a request still in its first
    attempt then makes no second one (RequestAbandoned): nothing more is sent
    for a batch that will not be checkpointed."""
    release = threading.Event()
    calls: list = []

    class SlowFailing:
        """The request holding r0 blocks until released, then fails retryably
        (it would retry); the others succeed at once."""

        def mutate_rows(self, table, entries):
            calls.append([k for k, _ in entries])
            if any(k == b"r0" for k, _ in entries):
                release.wait(MEET_S)
                return [EntryStatus(UNAVAILABLE, "try later")] * len(entries)
            return [EntryStatus(0)] * len(entries)

    config = SinkConfig(retry=FAST, parallel_requests=2, min_request_rows=1)
    requests = RequestWriter(SlowFailing(), config, None, lambda s: None, None)
    futures: list = []
    submit = ThreadPoolSpy(futures)
    monkeypatch.setattr(requests, "_request_pool", lambda: submit)

    def interrupted(found):
        wait([f for f in found if not any(k == b"r0" for k in f.keys)])  # the quick request has ended
        raise KeyboardInterrupt

    monkeypatch.setattr(RequestWriter, "_outcome", staticmethod(interrupted))
    try:
        with pytest.raises(KeyboardInterrupt):
            requests.write_all("t", request_rows(4))
        slow = next(f for f in futures if any(k == b"r0" for k in f.keys))
        assert not slow.done()  # re-raised while the slow request was still in flight
        release.set()
        with pytest.raises(RequestAbandoned):
            slow.result(MEET_S)
        assert sum(1 for c in calls if b"r0" in c) == 1  # no second attempt
    finally:
        release.set()
        submit.shutdown()
