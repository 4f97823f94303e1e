"""The re-copy sweep's rule (docs/design.md §7.7) and its guarded delete, on an
in-memory Bigtable: what no scanned item owns and is older than the backfill
goes; the mapping's cells, the tail's newer cells and our own families stay."""
from __future__ import annotations

from ddb2bt.pipeline.verify.compare import SINGLE, Expect
from ddb2bt.pipeline.cutover.recopy import StaleColumn, deleter, stale_columns
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.model import SetCell

BACKFILL_MS = 1_700_000_000_999  # floor_to_second(T) - 1 ms


def test_only_unowned_columns_older_than_the_backfill_are_stale():
    want = {b"r1": {("f", b"a"): Expect(SINGLE, b"x")}}
    have = {
        b"r1": {("f", b"a"): [(100, b"old")],                      # owned: kept whatever its age
                ("f", b"gone"): [(BACKFILL_MS - 5, b"v"), (50, b"w")],  # unowned, all older: stale
                ("f", b"new"): [(BACKFILL_MS + 1, b"tail")],         # unowned but the tail's, after T: kept
                ("ddb2bt_touch", b"k"): [(10, b"")]},                # ours: never judged
        b"r2": {("f", b"a"): [(10, b"v")],                           # a row no item owns: stale
                ("f", b"list"): [(BACKFILL_MS + 1000, b"e2"), (BACKFILL_MS - 3, b"e0")]},  # newest after T: kept
        b"r3": {("f", b"at"): [(BACKFILL_MS, b"backfill")]},         # the backfill's own stamp: not older
    }
    assert stale_columns("t", want, have, BACKFILL_MS) == [
        StaleColumn("t", b"r1", "f", b"gone", BACKFILL_MS - 5, (50, BACKFILL_MS - 5)),
        StaleColumn("t", b"r2", "f", b"a", 10, (10,)),
    ]


def test_versions_no_scanned_item_holds_are_judged_by_their_owner_records():
    from ddb2bt.pipeline.verify.compare import VERSIONS
    from ddb2bt.pipeline.control.state import StateStore

    bt = InMemoryBigtable()
    store = StateStore(bt, "job", lambda: BACKFILL_MS + 10_000)
    owners = store.versions()
    col = ("c", b"comments")
    # Versions 100 (kept by an item), 200 (its owner deleted while changes were
    # lost: claimed before T), 300 (a comment created after the Scan: claimed
    # after T), 400 (no owner record, older than the backfill).
    for v in (100, 200, 300, 400):
        bt.mutate_rows("t", [(b"video", [SetCell(*col, b"x", v)])])
    owners.claim(owners.key("t", b"video", *col, 200), b"gone", change_ms=BACKFILL_MS - 60_000)
    owners.claim(owners.key("t", b"video", *col, 300), b"new", change_ms=BACKFILL_MS + 5_000)
    want = {b"video": {col: Expect(VERSIONS, {100: b"x"})}}
    have = {b"video": {col: [(v, b"x") for v in (400, 300, 200, 100)]}}
    [stale] = stale_columns("t", want, have, BACKFILL_MS)
    assert stale.owned and stale.versions == (200, 300, 400)
    assert deleter(bt, owners, BACKFILL_MS)(stale) is True
    assert set(bt.versions("t")[b"video"][col]) == {100, 300}
    assert owners.owners([owners.key("t", b"video", *col, 200)]) in ({}, {owners.key("t", b"video", *col, 200): None})
    assert owners.owners([owners.key("t", b"video", *col, 300)])  # the tail's claim stays


def test_the_delete_takes_what_was_read_and_yields_to_a_newer_write():
    bt = InMemoryBigtable()
    bt.mutate_rows("t", [(b"r", [SetCell("f", b"q", b"old", 100), SetCell("f", b"q", b"older", 40)])])
    delete = deleter(bt)
    assert delete(StaleColumn("t", b"r", "f", b"q", 100, (40, 100))) is True
    assert not bt.versions("t").get(b"r", {}).get(("f", b"q"))
    # A tail write lands between the read (newest 100) and the delete: it wins.
    bt.mutate_rows("t", [(b"s", [SetCell("f", b"q", b"stale", 100)])])
    bt.mutate_rows("t", [(b"s", [SetCell("f", b"q", b"tail", 5_000)])])
    assert delete(StaleColumn("t", b"s", "f", b"q", 100, (100,))) is False
    assert set(bt.versions("t")[b"s"][("f", b"q")]) == {100, 5_000}


def test_a_dataflow_recopy_of_a_migrated_table_is_refused_naming_the_command_that_does_it():
    import pytest
    from types import SimpleNamespace

    from ddb2bt.pipeline.cutover.controller import BackfillOptions, refuse_remote_recopy
    from ddb2bt.pipeline.control.state import StateStore
    from ddb2bt.transforms.errors import ConfigError

    store = StateStore(InMemoryBigtable(), "job", lambda: 1)
    job = SimpleNamespace(mapping=SimpleNamespace(name="job", origin="m.yaml"),
                          state=SimpleNamespace(store=lambda: store))
    refuse_remote_recopy([job], [BackfillOptions(restart=True)])  # never migrated: a first backfill, fine
    store.save_meta("phase", "LIVE@n")
    refuse_remote_recopy([job], [BackfillOptions(restart=False)])  # not a re-copy
    with pytest.raises(ConfigError, match="ddb2bt backfill -m m.yaml --restart"):
        refuse_remote_recopy([job], [BackfillOptions(restart=True)])


def test_a_local_recopy_tail_follows_a_replaced_stream_and_passes_a_trimmed_checkpoint():
    from types import SimpleNamespace

    from ddb2bt.pipeline.services.jobs import recopy_tail

    def args(**kw):
        base = dict(new_stream=False, on_trimmed="fail", beam_args=[])
        return SimpleNamespace(**{**base, **kw})

    assert recopy_tail(args()) == (False, "fail")  # `run`: stops loudly, refuses a new stream
    assert recopy_tail(args(new_stream=True)) == (True, "fail")
    assert recopy_tail(args(restart=False)) == (False, "fail")  # `migrate` resuming
    assert recopy_tail(args(restart=True)) == (True, "restart")  # the re-copy restores what was lost
    # On Dataflow the re-copy is refused (refuse_remote_recopy): its tail is a plain one.
    assert recopy_tail(args(restart=True, beam_args=["--runner=DataflowRunner"])) == (False, "fail")


def test_every_prescription_of_migrate_restart_names_a_command_that_recopies():
    """Docs, alerts and messages prescribe `migrate --restart` after lost changes;
    it re-copies from any phase (tests/e2e/test_recopy.py). None may prescribe a
    plain `ddb2bt migrate` as "a fresh backfill": on a LIVE job it copies nothing."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    files = [*root.glob("docs/*.md"), root / "README.md", *root.glob("deploy/prometheus/*.yml"),
             *root.glob("pipeline/**/*.py")]
    prescriptions = [f for f in files if re.search(r"migrate[^`\n]{0,40}--restart", f.read_text())]
    assert {p.name for p in prescriptions} >= {"alerts.yml", "cutover.md", "recover.md", "preflight.py",
                                               "heads.py"}
    for f in files:
        assert not re.search(r"backfill \(ddb2bt migrate\)", f.read_text()), f
    # On Dataflow a re-copy is refused (refuse_remote_recopy): the alert a
    # Dataflow job raises names the command that re-copies there too.
    alerts = (root / "deploy/prometheus/alerts.yml").read_text()
    assert "ddb2bt backfill --restart" in alerts


def test_a_backfill_over_an_earlier_migration_owes_the_sweep_until_it_ran():
    from tests.unit.control.test_cutover_phases import world

    clock, store, admin, bk, m = world()
    m.begin_backfill({"kind": "scan", "parts": 1}, bk, ("t",))
    assert not m.recopy_pending, "a first backfill: nothing of an earlier copy to remove"
    store.save_meta("phase", "LIVE@x")
    m.begin_backfill({"kind": "scan", "parts": 1}, bk, ("t",))  # --restart on a LIVE job
    assert m.phase == "BACKFILLING" and m.recopy_pending
    m.recopy_done()
    assert not m.recopy_pending


def test_a_column_a_clock_records_is_written_again_by_the_tail_after_the_sweep_deletes_it():
    """Through the ordering guard (docs/design.md §10.2) a tail change skips a
    cell whose value the item's clock records. Before T the item has A=1; after
    T it drops A (c1) and gets A=1 back (c2), one swap in one tail batch; the
    sweep's scan saw the item between them and deletes A. The delete clears
    the clock's digest of A first, so the tail's swap writes A again."""
    from ddb2bt.pipeline.sink.guarded import apply_guarded
    from ddb2bt.pipeline.verify.compare import SINGLE
    from ddb2bt.transforms.attrs import from_plain
    from ddb2bt.transforms.config import load_mapping
    from ddb2bt.transforms.mapping import owned_cells
    from ddb2bt.transforms.model import INSERT, MODIFY, ChangeRecord
    from ddb2bt.transforms.ordering import CLOCK_FAMILY, guarded_rows

    mapping = load_mapping("examples/product_catalog.yaml")
    keys = {"pk": from_plain("hats"), "sk": from_plain("b")}
    s0 = {**keys, "Attr001": from_plain("x"), "A": from_plain("1")}
    s1 = {**keys, "Attr001": from_plain("x")}
    s2 = {**keys, "Attr001": from_plain("y"), "A": from_plain("1")}
    handoff_ms = BACKFILL_MS + 1

    def record(event, new, old, ms):
        return ChangeRecord(event, keys, new, old, ms, change_us=ms * 1000)

    bt = InMemoryBigtable()
    table = mapping.target.table
    apply_guarded(bt, guarded_rows(mapping, record(INSERT, s0, None, handoff_ms - 50_000)))
    have = {row: {col: sorted(v.items()) for col, v in cols.items()} for row, cols in bt.versions(table).items()}
    (row_key,) = have
    want = {row_key: {(c.family, c.qualifier): Expect(SINGLE, c.value)
                      for c in owned_cells(mapping, keys, s1).values()}}
    stale = stale_columns(table, want, have, BACKFILL_MS)
    assert [(c.family, c.qualifier) for c in stale] == [("SKU", b"A")]
    assert deleter(bt, None, BACKFILL_MS)(stale[0]) is True
    assert ("SKU", b"A") not in bt.latest(table)[row_key]
    apply_guarded(bt, [r for change in (record(MODIFY, s1, s0, handoff_ms + 1000),
                                        record(MODIFY, s2, s1, handoff_ms + 2000))
                       for r in guarded_rows(mapping, change)])
    row = bt.latest(table)[row_key]
    assert row[("SKU", b"A")] == b"1" and row[("SKU", b"Attr001")] == b"y"
    assert any(f == CLOCK_FAMILY for f, _ in row)


def test_a_column_whose_clock_moved_since_the_read_is_kept():
    """The clock's digest is cleared by a swap on the token read: a clock that
    moved meanwhile (the item changed after the scan) keeps the column."""
    from ddb2bt.transforms.ordering import CLOCK_FAMILY, Clock, cell_digest, encode_clock

    class _V:  # what cell_digest reads of a cell
        values = None
        value = b"1"

    bt = InMemoryBigtable()
    read = encode_clock(Clock(10_000, b"\0" * 8, (("f", b"q", None),), (cell_digest(_V()),)))
    bt.mutate_rows("t", [(b"r", [SetCell("f", b"q", b"1", 10), SetCell(CLOCK_FAMILY, b"item", read, 10)])])
    moved = encode_clock(Clock(20_000, b"\1" * 8, (("f", b"q", None),), (cell_digest(_V()),)))
    bt.mutate_rows("t", [(b"r", [SetCell(CLOCK_FAMILY, b"item", moved, 20)])])
    have = {b"r": {("f", b"q"): [(10, b"1")], (CLOCK_FAMILY, b"item"): [(10, read)]}}
    (stale,) = stale_columns("t", {}, have, BACKFILL_MS)
    assert stale.clocks == ((b"item", 10, read),)
    assert deleter(bt, None, BACKFILL_MS)(stale) is False
    assert bt.latest("t")[b"r"][("f", b"q")] == b"1"


class LimitedBigtable(InMemoryBigtable):
    """Refuses a request over Bigtable's 100,000 mutations, as the service does."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def _limit(self, mutations):
        from ddb2bt.pipeline.clients.bigtable.errors import BigtablePermanent
        from ddb2bt.transforms.limits import MAX_MUTATIONS_PER_REQUEST
        self.largest = max(self.largest, len(mutations))
        if len(mutations) > MAX_MUTATIONS_PER_REQUEST:
            raise BigtablePermanent(f"INVALID_ARGUMENT: too many mutations: {len(mutations)}")

    def mutate_rows(self, table_id, entries):
        self._limit([m for _, ms in entries for m in ms])
        return super().mutate_rows(table_id, entries)

    def check_and_mutate(self, table_id, row_key, unless, mutations):
        self._limit(mutations)
        return super().check_and_mutate(table_id, row_key, unless, mutations)


def _folded_column(bt, versions):
    for start in range(0, len(versions), 50_000):
        bt.mutate_rows("t", [(b"video", [SetCell("c", b"comments", b"x", v) for v in versions[start:start + 50_000]])])


def test_a_stale_column_of_more_than_100000_versions_is_deleted_within_the_request_limit():
    from ddb2bt.transforms.limits import MAX_MUTATIONS_PER_REQUEST
    bt = LimitedBigtable()
    versions = tuple(range(1, MAX_MUTATIONS_PER_REQUEST + 2))
    _folded_column(bt, versions)
    assert deleter(bt)(StaleColumn("t", b"video", "c", b"comments", versions[-1], versions)) is True
    assert not bt.versions("t").get(b"video", {}).get(("c", b"comments"))
    assert 0 < bt.largest <= MAX_MUTATIONS_PER_REQUEST


def test_stale_versions_of_an_owned_column_beyond_100000_are_deleted_within_the_request_limit():
    from ddb2bt.transforms.limits import MAX_MUTATIONS_PER_REQUEST
    bt = LimitedBigtable()
    versions = tuple(range(1, MAX_MUTATIONS_PER_REQUEST + 3))
    _folded_column(bt, versions)
    stale = versions[1:]  # the oldest is still owned by a scanned item
    assert deleter(bt, None, BACKFILL_MS)(StaleColumn("t", b"video", "c", b"comments", versions[-1], stale,
                                                      owned=True)) is True
    assert set(bt.versions("t")[b"video"][("c", b"comments")]) == {1}
    assert 0 < bt.largest <= MAX_MUTATIONS_PER_REQUEST


def test_a_tail_write_between_two_delete_requests_keeps_the_rest():
    from ddb2bt.pipeline.cutover.recopy import DELETES_PER_REQUEST
    bt = LimitedBigtable()
    versions = tuple(range(1, DELETES_PER_REQUEST + 11))
    _folded_column(bt, versions)
    calls = []
    real = bt.check_and_mutate

    def tail_lands_after_the_first(*args):
        applied = real(*args)
        if not calls:
            bt.mutate_rows("t", [(b"video", [SetCell("c", b"comments", b"tail", BACKFILL_MS + 5_000)])])
        calls.append(applied)
        return applied
    bt.check_and_mutate = tail_lands_after_the_first
    assert deleter(bt)(StaleColumn("t", b"video", "c", b"comments", versions[-1], versions)) is False
    assert calls == [True, False]
    assert set(bt.versions("t")[b"video"][("c", b"comments")]) == set(versions[DELETES_PER_REQUEST:]) | {
        BACKFILL_MS + 5_000}
