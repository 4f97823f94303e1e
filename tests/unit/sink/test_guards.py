"""The guarded backfill writes (docs/design.md §7.4): conditional rows are written
concurrently across rows, in order within a row, and a tail write that lands
while a batch is being written still wins."""
from __future__ import annotations

import threading
import time

import pytest

from ddb2bt.pipeline.sink import guards
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.clients.bigtable.errors import BigtablePermanent
from ddb2bt.pipeline.sink.sink import BatchingWriter
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.dofns import map_record
from ddb2bt.transforms.mapping import MARKER_FAMILY, backfill_record, marker_qualifier
from ddb2bt.transforms.model import SetCell

from tests.unit.cutover.cutover_common import FAST, T, VIDEOS, item

RETRY = RetryPolicy(0.001, 0.001, 1.0)
HANDOFF = T + 5_000
CALL_S = 0.01  # a round trip of the slow fake: long enough for calls to overlap


def comment(video: str, n: int, created: str = "2023-09-10T10:00:00") -> dict:
    return item(pk=video, sk=f"VideoComment#{n}", Content=f"c{n}", CreatedAt=created)


def backfilled(it: dict):
    keys = {"pk": it["pk"], "sk": it["sk"]}
    return map_record(VIDEOS, backfill_record(keys, it, HANDOFF), lambda: T)


def conditional_rows(mapped: list) -> list:
    rows = [(m, r) for m in mapped for r in m.rows if r.guard is not None and r.guard.conditional]
    assert len(rows) == len(mapped)  # every comment row is a conditional (versioned) row
    return rows


class SlowWriter:
    """InMemoryBigtable's CheckAndMutateRow, each taking CALL_S; records the order
    of calls per row and how many were in flight at once. ``before(row_key)`` runs
    inside a call, before the check: a tail write landing right then."""

    def __init__(self, bt: InMemoryBigtable, before=None) -> None:
        self.bt = bt
        self.before = before
        self.lock = threading.Lock()
        self.in_flight = self.most = 0
        self.order: list = []

    def check_and_mutate(self, table_id, row_key, unless, mutations):
        with self.lock:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            self.order.append((row_key, [m.timestamp_ms for m in mutations if isinstance(m, SetCell)]))
        try:
            time.sleep(CALL_S)
            if self.before:
                self.before(row_key)
            return self.bt.check_and_mutate(table_id, row_key, unless, mutations)
        finally:
            with self.lock:
                self.in_flight -= 1


def test_distinct_rows_are_written_concurrently_and_one_rows_changes_in_order():
    bt = InMemoryBigtable()
    writer = SlowWriter(bt)
    # 12 videos, 3 comments each: 12 rows, each with 3 conditional changes in order
    mapped = [backfilled(comment(f"v{v:02d}", n, f"2023-09-10T10:00:0{n}")) for v in range(12) for n in range(3)]
    dead = guards.write_conditional(writer, conditional_rows(mapped), RETRY, lambda s: None, None)
    assert dead == []
    assert 1 < writer.most <= guards.CONDITIONAL_CONCURRENCY
    for v in range(12):
        key = f"v{v:02d}".encode()
        per_row = [ts for k, ts in writer.order if k == key]
        assert per_row == sorted(per_row) and len(per_row) == 3  # comment 0, 1, 2: stream order kept
        assert len(bt.versions("videos")[key][("comments", b"UserComments")]) == 3


def test_a_tail_write_landing_while_the_batch_is_written_still_wins():
    """The tail touches two items after the batch was handed to the writer (one
    before its row's call, one during it, right before the check): neither is
    written by the backfill; every other item is."""
    bt = InMemoryBigtable()
    items = [comment(f"v{v:02d}", 1) for v in range(8)]
    touched = {b"v02", b"v05"}

    def tail_writes(row_key: bytes) -> None:
        if row_key in touched:  # the tail's change and its marker, at a time after the handoff
            it = items[int(row_key[1:])]
            bt.mutate_rows("videos", [(row_key, [
                SetCell(MARKER_FAMILY, marker_qualifier({"pk": it["pk"], "sk": it["sk"]}), b"", HANDOFF + 1)])])

    writer = SlowWriter(bt, before=tail_writes)
    superseded = []

    class Metrics:
        class backfill_superseded:  # noqa: N801 (the metric's name)
            @staticmethod
            def inc(n=1):
                superseded.append(n)

    dead = guards.write_conditional(writer, conditional_rows([backfilled(i) for i in items]), RETRY,
                                    lambda s: None, None, Metrics)
    assert dead == [] and sum(superseded) == 2
    written = {k for k, cols in bt.versions("videos").items() if ("comments", b"UserComments") in cols}
    assert written == {f"v{v:02d}".encode() for v in range(8)} - touched


def test_dead_letters_keep_the_batch_order_and_a_fatal_failure_waits_for_the_other_calls():
    bt = InMemoryBigtable()
    finished = []

    class Failing(SlowWriter):
        def check_and_mutate(self, table_id, row_key, unless, mutations):
            if row_key in (b"v01", b"v04"):
                raise BigtablePermanent(f"bad {row_key.decode()}")
            if row_key == b"v06":
                raise BigtablePermanent("table gone", code="NOT_FOUND")
            applied = super().check_and_mutate(table_id, row_key, unless, mutations)
            finished.append(row_key)
            return applied

    rows = conditional_rows([backfilled(comment(f"v{v:02d}", 1)) for v in range(8)])
    letters = lambda element, reason, message, cls: (element.record.keys["pk"]["S"], message)  # noqa: E731
    dead = guards.write_conditional(Failing(bt), [r for r in rows if r[1].row_key != b"v06"], RETRY,
                                    lambda s: None, letters)
    assert dead == [("v01", "bad v01"), ("v04", "bad v04")]
    finished.clear()
    with pytest.raises(BigtablePermanent, match="table gone"):
        guards.write_conditional(Failing(bt), rows, RETRY, lambda s: None, letters)
    assert sorted(finished) == [f"v{v:02d}".encode() for v in (0, 2, 3, 5, 7)]  # none left in flight


def test_the_sink_checkpoints_a_part_only_after_its_conditional_rows(monkeypatch):
    """Through the real sink: the backfill position is saved after every
    conditional row of the batch has been written."""
    bt = InMemoryBigtable()
    writer = SlowWriter(bt)
    store = StateStore(bt, "job", lambda: T)
    saved = []
    real_save = store.save_backfill_progress

    def save(progress):
        saved.append((len(writer.order), writer.in_flight, [p.count for p in progress]))
        real_save(progress)

    monkeypatch.setattr(store, "save_backfill_progress", save)

    class Both:  # MutateRows etc. from the fake, CheckAndMutateRow through the slow writer
        def __getattr__(self, name):
            return getattr(bt, name)

        check_and_mutate = staticmethod(writer.check_and_mutate)

    from ddb2bt.transforms.model import BackfillPosition

    batcher = BatchingWriter(Both(), store, FAST, sleep=lambda s: None, versions=store.versions())
    for v in range(10):
        it = comment(f"v{v:02d}", 1)
        record = backfill_record({"pk": it["pk"], "sk": it["sk"]}, it, HANDOFF,
                                 BackfillPosition("export", "data/a.json.gz", str(v + 1), v + 1))
        batcher.add(map_record(VIDEOS, record, lambda: T))
    assert batcher.flush() == []
    assert saved == [(10, 0, [10])]


def test_a_repair_intent_of_compiled_changes_names_their_columns_without_decoding_them():
    """The intent a backfill batch records (encode_intent) is the same for the
    compiled mapping's changes, which hold only their wire bytes, as for the same
    changes built from their tuples, and recording it decodes none of them."""
    from dataclasses import replace

    from ddb2bt.transforms.model import EncodedMutations, RowChange

    from tests.unit.cutover.cutover_common import CATALOG

    it = item(pk="hats", sk="fedora#1", Description="d", Price=12, Thumbnail="x", Rating=4.5)
    mapped = map_record(CATALOG, backfill_record({"pk": it["pk"], "sk": it["sk"]}, it, HANDOFF), lambda: T)
    compiled = [r for r in mapped.rows if r.guard is not None]
    assert compiled and all(type(RowChange.mutations.slot.__get__(r)) is EncodedMutations for r in compiled)
    intent = guards.encode_intent(compiled)
    assert all(type(RowChange.mutations.slot.__get__(r)) is EncodedMutations for r in compiled)  # not decoded
    from_tuples = [replace(r, mutations=tuple(r.mutations)) for r in compiled]  # replace: tuples, no bytes
    assert all(r.wire is None for r in from_tuples)
    assert guards.encode_intent(from_tuples) == intent
    columns = [sorted((m.family, m.qualifier) for m in c.mutations) for c in guards.decode_intent(intent)]
    assert columns == [sorted({(m.family, m.qualifier) for m in r.mutations if isinstance(m, SetCell)})
                       for r in compiled] and columns[0]


def _reference_intent(guarded: list) -> str:
    """encode_intent as it was first written: json.dumps of the whole structure."""
    import base64
    import json

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode("ascii")

    return json.dumps([{
        "t": c.table, "k": b64(c.row_key), "f": c.guard.family, "q": b64(c.guard.qualifier),
        "s": c.guard.since_ms, "b": c.guard.backfill_ms,
        "c": sorted((f, b64(q)) for f, q in c.set_columns),
    } for c in guarded], separators=(",", ":"))


def test_a_repair_intent_is_the_json_of_its_rows_whatever_pieces_it_reuses():
    """encode_intent assembles its text from pieces kept per table, family and
    column set; the text is still exactly json.dumps of the rows, for rows of
    several shapes and tables (names that JSON must escape among them), the same
    shapes again (pieces reused) and changes built from tuples (no wire bytes)."""
    from dataclasses import replace

    from ddb2bt.transforms.model import Guard, RowChange

    from tests.unit.cutover.cutover_common import CATALOG

    shapes = [dict(Description="d", Price=12, Thumbnail="x"), dict(Description="é\"q", Rating=4.5),
              dict(Price=1), {}]
    rows = []
    for n in range(12):
        it = item(pk=f"hats{n % 3}", sk=f"fedora#{n}", **shapes[n % len(shapes)])
        rows += [r for r in map_record(CATALOG, backfill_record({"pk": it["pk"], "sk": it["sk"]}, it, HANDOFF),
                                       lambda: T).rows if r.guard is not None]
    rows += [replace(r, mutations=tuple(r.mutations)) for r in rows[:3]]
    odd = Guard('fam"\\ly', b"\x00marker\xff", HANDOFF, False, HANDOFF - 1)
    rows.append(RowChange('tab"le\u2603', b"\xffrow", (SetCell('fam"\\ly', b"q\x00", b"v", 5),), odd))
    rows.append(RowChange("other", b"row", (), odd))  # no SetCell at all
    # base64 sorts these the other way round from their bytes ("cHJpY2U=" < "c2l6ZQ=="): sorted as encoded
    rows.append(RowChange("other", b"row2", (SetCell("f", b"size", b"1", 5), SetCell("f", b"price", b"2", 5)), odd))
    assert len({r.set_column_order for r in rows}) >= 4
    for _ in range(2):  # the second time every piece comes from the kept ones
        assert guards.encode_intent(rows) == _reference_intent(rows)
    assert guards.encode_intent([]) == _reference_intent([]) == "[]"


def test_the_compiled_mapping_hands_its_plain_rows_columns_to_the_intent_without_the_bytes():
    """A backfill row of the common shape carries its columns (EncodedMutations.columns),
    the same as read back from its bytes; a live row with a touch marker does not
    (the marker's column joins them), and reads them from its bytes."""
    from ddb2bt.transforms.model import EncodedMutations, RowChange
    from ddb2bt.transforms.mapping import map_change
    from ddb2bt.transforms.model import INSERT, ChangeRecord
    from ddb2bt.transforms.wire import set_cell_columns

    from tests.unit.cutover.cutover_common import CATALOG

    it = item(pk="hats", sk="fedora#1", Description="d", Price=12, Thumbnail="x")
    keys = {"pk": it["pk"], "sk": it["sk"]}
    (row,) = [r for r in map_record(CATALOG, backfill_record(keys, it, HANDOFF), lambda: T).rows]
    held = RowChange.mutations.slot.__get__(row)
    assert type(held) is EncodedMutations and held.columns is not None
    assert held.columns == tuple(sorted(set_cell_columns(row.wire)))
    (live,) = map_change(CATALOG, ChangeRecord(INSERT, keys, it, None, HANDOFF + 1), mark_touched=True)
    assert RowChange.mutations.slot.__get__(live).columns is None
    assert MARKER_FAMILY in {f for f, _ in live.set_column_order}
    assert live.set_column_order == tuple(sorted(set_cell_columns(live.wire)))
