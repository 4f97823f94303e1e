"""How the ordering guard sends its swaps (docs/design.md §10.5): a batch's
swaps go out together, a bounded number on the wire at once, and the slots
whose swap lost a race (another writer moved the clock) have their clocks read
again together, in one ReadRows per table, before they are decided again."""
from __future__ import annotations

import grpc
import pytest

from ddb2bt.pipeline.clients.bigtable.errors import BigtableRetryable, RowFilterTooLarge
from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
from ddb2bt.pipeline.sink.guarded import apply_guarded
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.model import INSERT, MODIFY, ChangeRecord, SetCell
from ddb2bt.transforms.ordering import CLOCK_FAMILY, guarded_rows
from tests.unit.cutover.cutover_common import catalog_item, item

CATALOG = load_mapping("examples/product_catalog.yaml")
START_US = 1_700_000_000_000_000
ITEMS = 6


class racing:
    """A ClockWriter over ``bt`` where another process applies ``other_rows``
    (through its own guard) to each slot between this guard's clock read and
    its first swap there: every first swap loses its race. Counts the reads."""

    def __init__(self, bt: InMemoryBigtable, other_rows) -> None:
        self.bt = bt
        self.other = {(r.table, r.row_key, r.item): r for r in other_rows}
        self.reads = []

    def read_family(self, table_id, row_keys, family):
        self.reads.append(sorted(row_keys))
        return self.bt.read_family(table_id, row_keys, family)

    def swap_row(self, table_id, row_key, family, qualifier, expected, mutations, prefix=False):
        other = self.other.pop((table_id, row_key, qualifier), None)
        if other is not None:
            assert apply_guarded(self.bt, [other]).applied == 1
        return self.bt.swap_row(table_id, row_key, family, qualifier, expected, mutations, prefix)


def changes(n: int, us: int) -> list:
    """Version ``n`` of every item, as changes at ``us`` (an INSERT for n = 0)."""
    out = []
    for i in range(ITEMS):
        keys = item(pk="hats", sk=f"s{i}")
        new = catalog_item("hats", f"s{i}", n)
        old = catalog_item("hats", f"s{i}", n - 1) if n else None
        out += guarded_rows(CATALOG, ChangeRecord(MODIFY if n else INSERT, keys, new, old, us // 1000, change_us=us))
    return out


@pytest.mark.parametrize("concurrency", [1, 16])
def test_slots_that_lost_a_race_are_read_again_in_one_read_and_decided_again(concurrency):
    bt = InMemoryBigtable()
    mine = changes(2, START_US + 2_000_000)
    writer = racing(bt, changes(1, START_US + 1_000_000))  # older: this guard's changes still win
    stats = apply_guarded(writer, mine, concurrency=concurrency)
    assert (stats.applied, stats.stale, stats.lost_races) == (ITEMS, 0, ITEMS)
    # The batch's read, then one read of every slot that lost: not one per slot.
    assert writer.reads == [sorted({r.row_key for r in mine})] * 2
    rows = bt.latest(CATALOG.target.table)
    assert sorted(rows[r.row_key][("SKU", b"Price")] for r in mine) == sorted(
        c.value for r in mine for c in r.new_cells if c.qualifier == b"Price")


def test_a_newer_change_that_won_the_race_makes_the_batch_stale():
    bt = InMemoryBigtable()
    writer = racing(bt, changes(3, START_US + 3_000_000))  # newer: this guard's changes are stale once read again
    stats = apply_guarded(writer, changes(2, START_US + 2_000_000), concurrency=4)
    assert (stats.applied, stats.stale, stats.lost_races) == (0, ITEMS, ITEMS)
    assert len(writer.reads) == 2


# --- GrpcMutationWriter.swap_rows: the swaps on the wire ------------------------------


class _Future:
    def __init__(self, channel, outcome) -> None:
        self._channel, self._outcome = channel, outcome
        channel.open += 1
        channel.most_open = max(channel.most_open, channel.open)

    def result(self):
        self._channel.open -= 1
        if isinstance(self._outcome, grpc.StatusCode):
            raise _Failed(self._outcome)
        return self._channel.response_cls(predicate_matched=self._outcome)


class _Failed(grpc.RpcError):
    def __init__(self, code) -> None:
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "injected"


class _Channel:
    """A gRPC channel whose CheckAndMutateRow calls answer only when their
    result is asked for: shows how many are on the wire at once. ``answers``:
    row key -> predicate_matched, or a StatusCode the call fails with."""

    def __init__(self, answers: dict) -> None:
        from google.cloud.bigtable_v2.types import bigtable as bigtable_types

        self.response_cls = bigtable_types.CheckAndMutateRowResponse.pb()
        self.answers = answers
        self.sent: list = []
        self.open = self.most_open = 0
        self.open_at_failure = None

    def unary_stream(self, *args, **kwargs):
        return None

    def unary_unary(self, method, request_serializer=None, **kwargs):
        from google.cloud.bigtable_v2.types import bigtable as bigtable_types

        channel = self

        class _Call:
            def future(self, request, timeout=None, metadata=None):
                if request_serializer is None:  # sent serialized, as the guard's swaps are
                    request = bigtable_types.CheckAndMutateRowRequest.pb().FromString(request)
                channel.sent.append(request.row_key)
                return _Future(channel, channel.answers[request.row_key])

        return _Call()

    def close(self) -> None:
        pass


def swap(key: bytes, expected=None, prefix=False) -> tuple:
    return (key, CLOCK_FAMILY, b"item", expected, [SetCell(CLOCK_FAMILY, b"item", b"3:t:v", 1)], prefix)


def test_swap_rows_keeps_a_bounded_number_of_swaps_on_the_wire_and_answers_each_in_order():
    keys = [b"r%02d" % i for i in range(10)]
    # predicate_matched: for an absent clock (expected None) "matched" means the cell exists, so not swapped
    channel = _Channel({k: i % 3 == 0 for i, k in enumerate(keys)})
    writer = GrpcMutationWriter("p", "i", channel=channel)
    outcomes = writer.swap_rows("t", [swap(k) if i % 2 else swap(k, b"3:token:", True) for i, k in enumerate(keys)],
                                in_flight=4)
    assert channel.sent == keys
    assert channel.most_open == 4 and channel.open == 0
    assert outcomes == [(i % 3 == 0) == (i % 2 == 0) for i in range(10)]


def test_swap_rows_gives_a_refused_predicate_as_that_swaps_outcome_and_sends_the_others():
    channel = _Channel({b"a": False, b"c": False})
    writer = GrpcMutationWriter("p", "i", channel=channel)
    too_large = b"1:" + b"x" * 30_000  # a clock compared whole, over Bigtable's row-filter limit
    outcomes = writer.swap_rows("t", [swap(b"a"), swap(b"b", too_large), swap(b"c")], in_flight=8)
    assert outcomes[0] is True and outcomes[2] is True and isinstance(outcomes[1], RowFilterTooLarge)
    assert channel.sent == [b"a", b"c"]


def test_a_failed_swap_is_raised_classified_once_every_swap_sent_has_answered():
    keys = [b"r%02d" % i for i in range(8)]
    answers = {k: False for k in keys}
    answers[b"r02"] = grpc.StatusCode.UNAVAILABLE
    channel = _Channel(answers)
    writer = GrpcMutationWriter("p", "i", channel=channel)
    with pytest.raises(BigtableRetryable):
        writer.swap_rows("t", [swap(k) for k in keys], in_flight=3)
    # r02 failed when r05 was to be sent (the window full): nothing after it was sent,
    # and every call that was sent had answered before the failure was raised.
    assert channel.sent == keys[:5] and channel.open == 0


# --- the guarded sink: one batch written while the next is mapped ----------------------


def test_the_guarded_sink_buffers_the_next_batch_while_one_is_written_and_sends_it_only_after_the_ack():
    """With overlap (the sink's default, SinkConfig.overlap_writes) a full batch's
    clock read and swaps run on the sink thread while the next batch is
    buffered; the next batch's clocks are read only once the first batch is
    acknowledged, so an item's next change is decided from the clock its
    previous one left. Checkpoints still follow the acknowledged writes."""
    import threading

    from prometheus_client import CollectorRegistry

    from ddb2bt.pipeline.clients.retry import RetryPolicy
    from ddb2bt.pipeline.observe.metrics import PipelineMetrics
    from ddb2bt.pipeline.sink.guarded import GuardedBatchingWriter
    from ddb2bt.pipeline.sink.sink import SinkConfig
    from ddb2bt.pipeline.source.kinesis import kinesis_stream_arn
    from ddb2bt.pipeline.control.state import StateStore
    from ddb2bt.transforms.dofns import map_record_guarded
    from ddb2bt.transforms.model import StreamPosition

    arn = kinesis_stream_arn("ProductCatalog", "cdc")
    entered, release = threading.Event(), threading.Event()
    swapped: list = []

    def hold_first_swap(table, entries, n):
        if table == CATALOG.target.table:
            swapped.append(entries[0][0])
            if not release.is_set():
                entered.set()
                assert release.wait(10)

    def change(seq: int, sk: str, n: int):
        keys = item(pk="hats", sk=sk)
        us = START_US + n * 1_000_000
        new, old = catalog_item("hats", sk, n), catalog_item("hats", sk, n - 1) if n else None
        record = ChangeRecord(MODIFY if n else INSERT, keys, new, old, us // 1000,
                              StreamPosition(arn, "s", str(seq)), change_us=us)
        return map_record_guarded(CATALOG, record, lambda: 0)

    bt = InMemoryBigtable(fault=hold_first_swap)
    store = StateStore(bt, "job", lambda: 5000)
    metrics = PipelineMetrics(CollectorRegistry()).for_table("job")
    config = SinkConfig(ordering_guard=True, max_batch_rows=1, retry=RetryPolicy(0.001, 0.001, 5.0))
    writer = GuardedBatchingWriter(bt, store, config, metrics, sleep=lambda s: None, overlap=True)
    writer.add(change(1, "a", 0))
    assert writer.add(change(2, "a", 1)) == []  # {a v0} is full: written on the sink thread
    assert entered.wait(10)
    assert swapped == [b"hats#a"]  # {a v1} buffered, not sent while {a v0} is in flight
    release.set()
    writer.add(change(3, "b", 0))  # {a v1} is full: sent once {a v0} is acknowledged
    assert writer.flush() == []  # waits for {a v0}, then {a v1} (from the clock {a v0} left), then {b v0}
    assert swapped == [b"hats#a", b"hats#a", b"hats#b"]
    assert (writer.stats.applied, writer.stats.stale, writer.stats.lost_races) == (3, 0, 0)
    assert bt.latest(CATALOG.target.table)[b"hats#a"][("SKU", b"Price")] == (1).to_bytes(8, "big")
    assert store.load_checkpoints(arn)["s"].sequence_number == "3"
    writer.close()


def test_the_swap_predicate_escapes_every_byte_of_the_clock_it_compares():
    from ddb2bt.pipeline.clients.bigtable.swaps import _exact_regex

    value = bytes(range(256))
    assert _exact_regex(value) == b"".join(b"\\x%02x" % b for b in value)
    channel = _Channel({b"a": True})
    writer = GrpcMutationWriter("p", "i", channel=channel)
    sent = writer._cam_request("projects/p/instances/i/tables/t", "t", b"a", CLOCK_FAMILY, b"item", b"3:ab:",
                               [SetCell(CLOCK_FAMILY, b"item", b"v", 1)], True)
    request = writer._cam_cls.FromString(sent)
    assert request.predicate_filter.chain.filters[-1].value_regex_filter == b"\\x33\\x3a\\x61\\x62\\x3a(?s).*"
    assert [m.set_cell.value for m in request.true_mutations] == [b"v"] and not request.false_mutations


def test_a_lost_lease_stops_the_swaps_and_leaves_none_of_those_sent_running():
    """The fence is checked before each swap: once it says the lease is lost,
    nothing more is sent, and the swaps already on the wire are waited for
    before the failure goes up (none outlives the batch that sent it)."""

    class LeaseLost(Exception):
        pass

    checks = []

    def fence() -> float:
        checks.append(1)
        if len(checks) > 3:
            raise LeaseLost("the job's lease moved to another holder")
        return 60.0

    keys = [b"r%02d" % i for i in range(8)]
    channel = _Channel({k: False for k in keys})
    writer = GrpcMutationWriter("p", "i", channel=channel)
    writer.set_fence(fence)
    with pytest.raises(LeaseLost):
        writer.swap_rows("t", [swap(k) for k in keys], in_flight=8)
    assert channel.sent == keys[:3] and channel.open == 0
