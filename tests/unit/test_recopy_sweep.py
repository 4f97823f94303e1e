"""The re-copy sweep's rule (docs/design.md §7.7) and its guarded delete, on an
in-memory Bigtable: what no scanned item owns and is older than the backfill
goes; the mapping's cells, the tail's newer cells and our own families stay."""
from __future__ import annotations

from ddb2bt.pipeline.cutover.compare import SINGLE, Expect
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
    from ddb2bt.pipeline.cutover.compare import VERSIONS
    from ddb2bt.pipeline.state import StateStore

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
    from ddb2bt.pipeline.state import StateStore
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

    from ddb2bt.pipeline.jobs import recopy_tail

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

    root = Path(__file__).resolve().parents[2]
    files = [*root.glob("docs/*.md"), root / "README.md", *root.glob("deploy/prometheus/*.yml"),
             *root.glob("pipeline/**/*.py")]
    prescriptions = [f for f in files if re.search(r"migrate[^`\n]{0,40}--restart", f.read_text())]
    assert {p.name for p in prescriptions} >= {"alerts.yml", "cutover.md", "recover.md", "preflight.py",
                                               "stream_source.py"}
    for f in files:
        assert not re.search(r"backfill \(ddb2bt migrate\)", f.read_text()), f
    # On Dataflow a re-copy is refused (refuse_remote_recopy): the alert a
    # Dataflow job raises names the command that re-copies there too.
    alerts = (root / "deploy/prometheus/alerts.yml").read_text()
    assert "ddb2bt backfill --restart" in alerts


def test_a_backfill_over_an_earlier_migration_owes_the_sweep_until_it_ran():
    from tests.unit.test_cutover_phases import world

    clock, store, admin, bk, m = world()
    m.begin_backfill({"kind": "scan", "parts": 1}, bk, ("t",))
    assert not m.recopy_pending, "a first backfill: nothing of an earlier copy to remove"
    store.save_meta("phase", "LIVE@x")
    m.begin_backfill({"kind": "scan", "parts": 1}, bk, ("t",))  # --restart on a LIVE job
    assert m.phase == "BACKFILLING" and m.recopy_pending
    m.recopy_done()
    assert not m.recopy_pending
