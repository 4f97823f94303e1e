"""The sink's family check (``pipeline/sink/families.py``) remembers, for one
batch, the tables and families it found known, so it asks once per batch and
not once per row: whatever the changes, the family lists and when they change
between batches, what it writes and dead-letters is what asking for every row
gives. Rows of the compiled mapping (families as a tuple) are remembered; the
general engine's rows are asked about every time. Also the other per-change
saving of the same round: a committed batch's lags, counted by change time
(report.py), are still one sample per applied change."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st
from prometheus_client import CollectorRegistry

from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.observe.metrics import PipelineMetrics
from ddb2bt.pipeline.sink.families import FamilyCheck
from ddb2bt.pipeline.sink.sink import BatchingWriter, SinkConfig
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.model import (ChangeRecord, DeadLetter, DeleteCells, EncodedMutations, MappedChange,
                                     RowChange, SetCell, StreamPosition, build_row_change)
from ddb2bt.transforms.wire import encode_mutations

ARN = "arn:aws:dynamodb:us-east-1:1:table/T/stream/2024"
TABLES = ("t", "u")
FAMS = ("f", "g", "h", "_m")  # _m: the touch markers' family, never a reason to dead-letter


def row(table: str, families: tuple, encoded: bool) -> RowChange:
    mutations = tuple(m for f in families for m in (SetCell(f, b"q", b"v", 5), DeleteCells(f, b"q", 0, 5)))
    if not encoded:
        return RowChange(table, b"r", mutations)
    plain = RowChange(table, b"r", mutations)
    return build_row_change(table, b"r", EncodedMutations(len(mutations), families), None, plain.size_bytes, (),
                            b"", encode_mutations(mutations))


def change(n: int, rows: tuple, dead: bool = False) -> MappedChange:
    record = ChangeRecord("MODIFY", {"k": {"S": str(n)}}, {}, {}, 1000, StreamPosition(ARN, "s", str(n)))
    if dead:
        return MappedChange(record, dead_letter=DeadLetter("bad", "X", "unmappable", "map", record, 5))
    return MappedChange(record, rows)


def dead_letter(element, reason, message, error_class):
    return (element.record.position.sequence_number, reason, message)


class Known:
    """The families of each table, counting the questions; ``refresh`` may know more."""

    def __init__(self, lists: dict, fresh: dict = None) -> None:
        self.lists, self.fresh = lists, fresh
        self.asked = 0

    def __call__(self, table):
        self.asked += 1
        return self.lists.get(table)

    def refresh(self, table):
        """A new listing, kept as the cached one (as the sink's family cache does)."""
        if self.fresh is not None:
            self.lists = dict(self.lists, **{table: self.fresh.get(table)})
        return self.lists.get(table)


def outcome(known: Known, batches: list, lists_per_batch: list, forget_each: bool) -> list:
    out = []
    check = FamilyCheck(known, dead_letter)
    for batch, lists in zip(batches, lists_per_batch):
        known.lists = lists
        check.new_batch()
        for element in batch:
            if forget_each:
                check = FamilyCheck(known, dead_letter)  # nothing remembered: asked for every row
            dead: list = []
            rows = check.rows(element, dead)
            out.append((tuple(rows), [d if isinstance(d, tuple) else d.reason for d in dead]))
    return out


FAMILY_LISTS = st.one_of(st.none(), st.frozensets(st.sampled_from(FAMS[:3])))
ROWS = st.tuples(st.sampled_from(TABLES), st.lists(st.sampled_from(FAMS), min_size=1, max_size=3, unique=True)
                 .map(tuple), st.booleans())
CHANGES = st.tuples(st.lists(ROWS, max_size=3), st.booleans())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(CHANGES, min_size=1, max_size=8), min_size=2, max_size=4),
       st.lists(st.fixed_dictionaries({t: FAMILY_LISTS for t in TABLES}), min_size=4, max_size=4),
       st.one_of(st.none(), st.fixed_dictionaries({t: FAMILY_LISTS for t in TABLES})))
def test_remembering_per_batch_decides_as_asking_for_every_row(specs, lists_per_batch, fresh):
    """``fresh``: what a new listing says (a family created meanwhile); None: the same as the cached one."""
    n = iter(range(10**6))
    batches = [[change(next(n), tuple(row(t, f, e) for t, f, e in rows), dead=dead) for rows, dead in batch]
               for batch in specs]
    remembering, asking = Known({}, fresh), Known({}, fresh)
    got = outcome(remembering, batches, lists_per_batch, False)
    expected = outcome(asking, batches, lists_per_batch, True)
    assert got == expected
    assert remembering.asked <= asking.asked


def test_a_batch_asks_once_per_table_and_families_and_the_next_batch_asks_again():
    known = Known({"t": frozenset({"f", "g"})})
    check = FamilyCheck(known, dead_letter)
    same = [change(i, (row("t", ("f",), True),)) for i in range(50)]
    for element in same:
        assert check.rows(element, []) == element.rows
    assert known.asked == 1
    check.new_batch()
    known.lists = {"t": frozenset({"g"})}  # f dropped between batches: the next batch must see it
    dead: list = []
    assert check.rows(same[0], dead) == ()
    assert dead == [("0", "unknown_family", "table t has no column family f (run ddb2bt create-table)")]
    assert known.asked == 2


def test_a_missing_family_is_never_remembered_and_each_change_naming_it_is_dead_lettered():
    known = Known({"t": frozenset({"f"})})
    check = FamilyCheck(known, dead_letter)
    good, bad1, bad2 = (change(1, (row("t", ("f",), True),)), change(2, (row("t", ("f", "g"), True),)),
                        change(3, (row("t", ("f", "g"), True),)))
    dead: list = []
    assert check.rows(good, dead) == good.rows
    assert check.rows(bad1, dead) == () and check.rows(bad2, dead) == ()
    assert [d[0] for d in dead] == ["2", "3"]


def test_rows_of_the_general_engine_are_asked_about_every_time():
    known = Known({"t": frozenset({"f"})})
    check = FamilyCheck(known, dead_letter)
    for i in range(3):
        check.rows(change(i, (row("t", ("f",), False),)), [])
    assert known.asked == 3


def test_a_dead_letter_from_the_mapping_is_passed_on_and_has_no_rows():
    check = FamilyCheck(Known({}), dead_letter)
    element = change(1, (), dead=True)
    dead: list = []
    assert check.rows(element, dead) == ()
    assert dead == [element.dead_letter]


def test_a_committed_batch_observes_one_lag_per_applied_change():
    """report.py counts the batch's lags by change time: the histogram still has
    one sample per applied change (not per distinct time), none for a dead
    letter or a change without rows."""
    bt = InMemoryBigtable(families={"t": {"f"}})
    metrics = PipelineMetrics(CollectorRegistry())
    writer = BatchingWriter(bt, StateStore(bt, "job", lambda: 5), SinkConfig(), metrics,
                            lambda table: frozenset({"f"}), now_ms=lambda: 10_000, sleep=lambda s: None)
    times = [7_000, 7_000, 7_000, 8_000, 9_500, 9_500]
    for n, at in enumerate(times):
        record = ChangeRecord("MODIFY", {"k": {"S": str(n)}}, {}, {}, at, StreamPosition(ARN, "s", str(n + 1)))
        writer.add(MappedChange(record, (row("t", ("f",), True),)))
    writer.add(change(90, (), dead=True))
    writer.add(MappedChange(ChangeRecord("MODIFY", {"k": {"S": "x"}}, {}, {}, 1_000,
                                         StreamPosition(ARN, "s", "99"))))  # no rows: skipped
    writer.flush()
    labels = {"table": "job"}
    count = metrics.registry.get_sample_value("ddb2bt_end_to_end_lag_seconds_count", labels)
    total = metrics.registry.get_sample_value("ddb2bt_end_to_end_lag_seconds_sum", labels)
    assert count == len(times)
    assert abs(total - sum(10_000 - at for at in times) / 1000) < 1e-9


def test_a_refresh_in_the_middle_of_a_batch_is_seen_by_the_rows_after_it():
    """A row naming a family the cached list lacks makes the check list the
    table again; what that says (here: f dropped, g created) holds for the rest
    of the batch, remembered rows included."""
    known = Known({"t": frozenset({"f"})}, fresh={"t": frozenset({"g"})})
    check = FamilyCheck(known, dead_letter)
    first, needs_g, f_again = (change(1, (row("t", ("f",), True),)), change(2, (row("t", ("g",), True),)),
                               change(3, (row("t", ("f",), True),)))
    dead: list = []
    assert check.rows(first, dead) == first.rows  # f known, remembered
    assert check.rows(needs_g, dead) == needs_g.rows  # g missing from the cache: listed again, found
    assert check.rows(f_again, dead) == ()  # the new listing has no f
    assert [d[0] for d in dead] == ["3"]
