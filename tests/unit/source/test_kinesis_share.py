"""A Kinesis stream's read budget (5 GetRecords calls and 2 MB per second per
shard, for every reader of the stream together) holds however its readers are
spread: the tables of one job on several workers, and several jobs
(docs/design.md §10.8). Readers are PartitionReaders over one fake Kinesis that
records every GetRecords call; each has a pacer of its own, as in a process of
its own, on one simulated clock."""
from __future__ import annotations

import argparse
import json
from fractions import Fraction

import pytest

from ddb2bt.pipeline.control.lease import TAIL, LeaseState
from ddb2bt.pipeline.source.kinesis import (GET_RECORDS_PER_SECOND, READ_BYTES_PER_SECOND, KinesisStreamsClient,
                                            ShardPacer, kinesis_stream_arn)
from ddb2bt.pipeline.source.kinesis_share import check_shares, parse_share, record_stream, table_shares, take_shares
from ddb2bt.pipeline.source.stream_source import LocalTracker, PartitionReader, ReaderOptions, StreamPartition, drain
from ddb2bt.pipeline.control.state import META, StateStore, _set_latest
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.pipeline.testing.kinesis_cdc import FakeKinesis, MeteredKinesis
from ddb2bt.transforms.errors import ConfigError
from ddb2bt.transforms.model import ShardClosed

STREAM = "arn:aws:kinesis:us-east-1:000000000000:stream/cdc"
CREATED_MS = 1_700_000_000_000
NOW_MS = CREATED_MS + 100_000
# Simulated seconds of reading: the backlog (11 MB a shard, 5.5 s at the whole
# 2 MB/s) and then polls at the head.
SIMULATED_S = 25.0
# The budget is an average: it is checked over windows of this many seconds,
# where each reader may be one page ahead (a reader's first call is not paced).
WINDOW_S = 5.0
PADDING = "x" * 900  # records of about 1 KB: 1,000-record pages of about 1 MB


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def doc(table: str, n: int) -> dict:
    return {"eventName": "INSERT", "tableName": table, "eventID": f"{table}{n}",
            "dynamodb": {"ApproximateCreationDateTime": CREATED_MS + n, "Keys": {"pk": {"S": f"k{n}"}},
                         "NewImage": {"pk": {"S": f"k{n}"}, "pad": {"S": PADDING}}, "SizeBytes": 1000}}


def shared_stream(tables: list, per_table: int, shards=("s0", "s1")) -> FakeKinesis:
    """Every table's changes, interleaved, in every shard of one stream."""
    fake = FakeKinesis()
    for shard in shards:
        fake.add(shard, [doc(tables[i % len(tables)], i) for i in range(per_table * len(tables))])
    return fake


def read_as_workers(metered: MeteredKinesis, clock: Clock, tables: list, shares: list) -> dict:
    """Each table read by its own reader with a pacer of its own (its own worker),
    in turns on one clock, for SIMULATED_S: {table: records read}."""
    readers = []
    for table, share in zip(tables, shares):
        client = KinesisStreamsClient(metered, "cdc", table, pacer=ShardPacer(clock=clock, sleep=clock.sleep),
                                      now_ms=lambda: NOW_MS, share=float(share))
        reader = PartitionReader(client, StreamPartition(kinesis_stream_arn(table, "cdc"), 0, 1), ReaderOptions(),
                                 lambda *_: {}, sleep=lambda s: None)
        readers.append((table, reader, LocalTracker()))
    read = dict.fromkeys(tables, 0)
    while clock.now < SIMULATED_S:
        for table, reader, tracker in readers:
            out, _ = drain(reader.read_round(tracker))
            read[table] += sum(1 for r in out if not isinstance(r, ShardClosed))
    return read


def assert_within_budget(metered: MeteredKinesis, shards, readers: int) -> None:
    page_bytes = max(n for _, _, n in metered.calls)
    for shard in shards:
        calls, nbytes = metered.busiest(shard, WINDOW_S)
        assert calls <= GET_RECORDS_PER_SECOND * WINDOW_S + readers, (shard, calls)
        assert nbytes <= READ_BYTES_PER_SECOND * WINDOW_S + readers * page_bytes, (shard, nbytes)


def test_the_tables_of_one_job_on_two_workers_keep_each_shard_within_its_read_budget():
    """One job of two tables on one stream, each table's partition on its own
    worker: together at most 5 calls and 2 MB per second per shard, and each
    table still reads every record of its own."""
    clock = Clock()
    tables = ["Catalog", "Orders"]
    metered = MeteredKinesis(shared_stream(tables, per_table=5000), clock)
    shares = table_shares([STREAM, STREAM], Fraction(1))  # the job's default: the whole budget
    read = read_as_workers(metered, clock, tables, shares)
    assert read == {"Catalog": 10_000, "Orders": 10_000}  # 5,000 per shard each, the other table's skipped
    assert_within_budget(metered, ("s0", "s1"), readers=2)
    # And the budget is used: not paced far below it.
    calls, _ = metered.busiest("s0", WINDOW_S)
    assert calls >= GET_RECORDS_PER_SECOND * WINDOW_S * 0.8


def test_two_jobs_on_one_stream_with_half_a_share_each_stay_within_the_budget():
    clock = Clock()
    metered = MeteredKinesis(shared_stream(["Catalog", "Orders"], per_table=5000, shards=("s0",)), clock)
    # Two jobs, one table each, started with --kinesis-share 1/2.
    shares = table_shares([STREAM], Fraction(1, 2)) + table_shares([STREAM], Fraction(1, 2))
    read = read_as_workers(metered, clock, ["Catalog", "Orders"], shares)
    assert read == {"Catalog": 5000, "Orders": 5000}
    assert_within_budget(metered, ("s0",), readers=2)


def test_a_job_splits_its_share_between_its_tables_on_each_stream():
    other = "arn:aws:kinesis:us-east-1:000000000000:stream/other"
    assert table_shares([STREAM, STREAM, None, other, STREAM], Fraction(1)) == \
        [Fraction(1, 3), Fraction(1, 3), None, Fraction(1), Fraction(1, 3)]
    assert table_shares([STREAM, other], Fraction(1, 2)) == [Fraction(1, 2), Fraction(1, 2)]


def test_the_reader_paces_its_rounds_at_its_share():
    client = KinesisStreamsClient(FakeKinesis(), "cdc", "Catalog", share=0.25)
    assert client.calls_per_s == GET_RECORDS_PER_SECOND / 4
    with pytest.raises(ValueError, match="share"):
        KinesisStreamsClient(FakeKinesis(), "cdc", "Catalog", share=1.5)


@pytest.mark.parametrize("text, share", [("1/2", Fraction(1, 2)), ("0.25", Fraction(1, 4)), ("1", Fraction(1)),
                                         (" 2/3 ", Fraction(2, 3))])
def test_a_share_is_k_of_n_or_a_decimal(text, share):
    assert parse_share(text) == share


@pytest.mark.parametrize("text, why", [("0", "between"), ("3/2", "between"), ("1/0", "not a share"),
                                       ("half", "not a share"), ("-1/2", "between")])
def test_a_share_out_of_range_is_refused_naming_the_value(text, why):
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        parse_share(text)


class StateWithLeases:
    """The state table in memory, with the tail leases of jobs running or not."""

    def __init__(self) -> None:
        self.backend = InMemoryBigtable()
        self.now_ms = NOW_MS

    def store(self, job: str) -> StateStore:
        return StateStore(self.backend, job, lambda: self.now_ms)

    def lease(self, job: str, live: bool) -> None:
        state = LeaseState(holder=f"run:{job}", host="h", pid=1, node="n", started_ms=self.now_ms - 1000,
                           expires_ms=self.now_ms + (30_000 if live else -1), command="run")
        self.backend.write_rows([(f"{job}#lease#{TAIL}".encode(),
                                  _set_latest(META, {b"lease": state.to_bytes()}, self.now_ms))])

    def take(self, job: str, share, tables=None):
        self.lease(job, live=True)
        consumers = {t: Fraction(share) for t in (tables or [job])}
        return take_shares(self.store(job), STREAM, consumers, lambda: self.now_ms)


def test_a_second_job_beyond_the_budget_is_refused_naming_the_job_holding_it():
    state = StateWithLeases()
    state.take("catalog", 1)
    with pytest.raises(ConfigError) as refused:
        state.take("orders", Fraction(1, 2))
    message = str(refused.value)
    assert message.startswith("--kinesis-share: Kinesis stream " + STREAM)
    assert "catalog 1" in message and "orders 1/2" in message and "together 3/2" in message
    # Nothing of the refused job was recorded.
    assert json.loads(state.store("x").load_stream_shares(STREAM)) == {"catalog": "1"}


def test_shares_that_add_up_to_one_start_and_a_stopped_job_frees_its_share():
    state = StateWithLeases()
    state.take("catalog", Fraction(1, 2))
    state.take("orders", Fraction(1, 2))
    with pytest.raises(ConfigError, match="together 4/3"):
        state.take("audit", Fraction(1, 3))
    state.lease("catalog", live=False)  # catalog stopped: its lease released or expired
    assert state.take("audit", Fraction(1, 3)) == {"orders": Fraction(1, 2), "audit": Fraction(1, 3)}
    # A restart of a job replaces its own share (it does not count twice).
    assert state.take("orders", Fraction(2, 3)) == {"orders": Fraction(2, 3), "audit": Fraction(1, 3)}


def test_a_job_of_several_tables_records_each_table_and_two_jobs_starting_at_once_cannot_both_win():
    state = StateWithLeases()
    for job in ("catalog", "orders"):
        state.lease(job, live=True)
    store = state.store("catalog")
    real_swap = store.swap_stream_shares

    def swap_after_a_rival(stream, expected, value):
        # Another job records its whole share between this job's read and its swap.
        state.lease("rival", live=True)
        real_swap(stream, expected, json.dumps({"rival": "1"}))
        store.swap_stream_shares = real_swap
        return real_swap(stream, expected, value)

    store.swap_stream_shares = swap_after_a_rival
    with pytest.raises(ConfigError, match="rival 1"):
        take_shares(store, STREAM, {"catalog": Fraction(1, 2), "orders": Fraction(1, 2)}, lambda: NOW_MS)
    assert json.loads(store.load_stream_shares(STREAM)) == {"rival": "1"}


def test_a_job_moved_to_another_stream_no_longer_holds_a_share_of_the_old_one():
    """A running job counts only on the stream it reads now: after a restart on
    a new stream (--new-stream) or back on its DynamoDB stream, its entry in the
    old stream's row no longer refuses the jobs reading that stream."""
    new_stream = "arn:aws:kinesis:us-east-1:000000000000:stream/cdc-2"
    state = StateWithLeases()
    for job in ("catalog", "audit"):
        state.lease(job, live=True)
        record_stream(state.store(job), STREAM)
        take_shares(state.store(job), STREAM, {job: Fraction(1, 2)}, lambda: state.now_ms)
    # catalog restarted on another Kinesis stream, audit on its DynamoDB stream:
    # both still running (their leases live), neither reads STREAM any more.
    record_stream(state.store("catalog"), new_stream)
    take_shares(state.store("catalog"), new_stream, {"catalog": Fraction(1)}, lambda: state.now_ms)
    record_stream(state.store("audit"), None)
    state.lease("orders", live=True)
    record_stream(state.store("orders"), STREAM)
    assert take_shares(state.store("orders"), STREAM, {"orders": Fraction(1)}, lambda: state.now_ms) == \
        {"orders": Fraction(1)}
    assert json.loads(state.store("x").load_stream_shares(STREAM)) == {"orders": "1"}
    # While the new stream's row still counts catalog, which reads it.
    with pytest.raises(ConfigError, match=r"\(catalog 1\)"):
        check_shares(state.store("orders"), new_stream, {"orders": Fraction(1, 2)}, lambda: state.now_ms)


def test_the_check_before_the_leases_refuses_as_the_compare_and_set_does_and_writes_nothing():
    state = StateWithLeases()
    state.take("catalog", Fraction(1, 2))
    state.take("orders", Fraction(1, 2))
    row = state.store("x").load_stream_shares(STREAM)
    # catalog restarted with the default share beside orders: refused, naming orders.
    with pytest.raises(ConfigError, match=r"\(orders 1/2\) while this job asks catalog 1: together 3/2"):
        check_shares(state.store("catalog"), STREAM, {"catalog": Fraction(1)}, lambda: state.now_ms)
    check_shares(state.store("catalog"), STREAM, {"catalog": Fraction(1, 2)}, lambda: state.now_ms)
    assert state.store("x").load_stream_shares(STREAM) == row
