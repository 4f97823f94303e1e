"""The ordering guard's tombstones have a retention (docs/design.md §10.7): a
deleted item's clock is removed only once it is older than the source's
retention plus a margin, never a live clock, and never one whose item came back
after the sweep read it. Time is injected (``now_us``)."""
from __future__ import annotations

from ddb2bt.pipeline.sink.guarded import apply_guarded
from ddb2bt.pipeline.sink.tombstones import DEFAULT_MARGIN_HOURS, US_PER_HOUR, keep_us, sweep_tombstones
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.attrs import from_plain
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.model import INSERT, REMOVE, ChangeRecord
from ddb2bt.transforms.ordering import CLOCK_FAMILY, guarded_rows

CATALOG = load_mapping("examples/product_catalog.yaml")
TABLE = CATALOG.target.table
T0_US = 1_700_000_000_000_000
RETENTION_HOURS = 24  # a Kinesis stream's default
KEEP = keep_us(RETENTION_HOURS)


def keys(sk: str) -> dict:
    return {"pk": from_plain("hats"), "sk": from_plain(sk)}


def image(sk: str, price: int) -> dict:
    return {**keys(sk), "Price": from_plain(price), "Description": from_plain("a hat")}


def change(event, sk, us, new=None, old=None) -> ChangeRecord:
    return ChangeRecord(event, keys(sk), new, old, us // 1000, change_us=us)


def clocks(bt: InMemoryBigtable) -> list:
    """What the sweep's scanner yields: (table, row, qualifier, newest value) of each clock cell."""
    return [(TABLE, row, q, versions[max(versions)]) for row, cols in sorted(bt.versions(TABLE).items())
            for (f, q), versions in sorted(cols.items()) if f == CLOCK_FAMILY]


def deleted_at(bt: InMemoryBigtable, sk: str, us: int) -> None:
    apply_guarded(bt, guarded_rows(CATALOG, change(INSERT, sk, us - 1_000_000, new=image(sk, 1))))
    apply_guarded(bt, guarded_rows(CATALOG, change(REMOVE, sk, us, old=image(sk, 1))))


def test_the_default_retention_is_the_streams_plus_a_margin():
    assert KEEP == (RETENTION_HOURS + DEFAULT_MARGIN_HOURS) * US_PER_HOUR


def test_a_tombstone_is_kept_until_the_retention_and_margin_have_passed_and_a_live_clock_always():
    bt = InMemoryBigtable()
    deleted_at(bt, "gone", T0_US)
    apply_guarded(bt, guarded_rows(CATALOG, change(INSERT, "live", T0_US, new=image("live", 2))))  # never changes again
    stats = sweep_tombstones(bt, clocks(bt), T0_US + KEEP, KEEP)
    assert (stats.expired, stats.removed) == (0, 0) and b"hats#gone" in bt.versions(TABLE)
    # Within the retention the tombstone still keeps a late older change out.
    late = apply_guarded(bt, guarded_rows(CATALOG, change(INSERT, "gone", T0_US - 1_000_000, new=image("gone", 1))))
    assert (late.applied, late.stale) == (0, 1)
    stats = sweep_tombstones(bt, clocks(bt), T0_US + KEEP + 1, KEEP)
    assert (stats.expired, stats.removed, stats.moved) == (1, 1, 0)
    assert b"hats#gone" not in bt.versions(TABLE), "the row held only the tombstone: it is gone"
    live = bt.versions(TABLE)[b"hats#live"]
    assert any(f == CLOCK_FAMILY for f, _ in live) and any(f != CLOCK_FAMILY for f, _ in live)
    # Years later the live clock is still there.
    sweep_tombstones(bt, clocks(bt), T0_US + 1000 * KEEP, KEEP)
    assert any(f == CLOCK_FAMILY for f, _ in bt.versions(TABLE)[b"hats#live"])


def test_a_dry_run_counts_and_removes_nothing():
    bt = InMemoryBigtable()
    deleted_at(bt, "gone", T0_US)
    before = bt.versions(TABLE)
    stats = sweep_tombstones(bt, clocks(bt), T0_US + KEEP + 1, KEEP, dry_run=True)
    assert (stats.expired, stats.removed) == (1, 0) and bt.versions(TABLE) == before


def test_a_tombstone_whose_item_came_back_after_the_read_is_kept():
    """The delete is a compare-and-swap on the clock read: an item written again
    between the sweep's read and its delete keeps its (now live) clock."""
    bt = InMemoryBigtable()
    deleted_at(bt, "back", T0_US)
    read = clocks(bt)
    now = T0_US + KEEP + 1
    apply_guarded(bt, guarded_rows(CATALOG, change(INSERT, "back", now, new=image("back", 3))))
    stats = sweep_tombstones(bt, read, now, KEEP)
    assert (stats.expired, stats.removed, stats.moved) == (1, 0, 1)
    row = bt.latest(TABLE)[b"hats#back"]
    assert row[("SKU", b"Price")] == (3).to_bytes(8, "big") and any(f == CLOCK_FAMILY for f, _ in row)


def test_an_unreadable_clock_is_kept_and_counted():
    bt = InMemoryBigtable()
    stats = sweep_tombstones(bt, [(TABLE, b"r", b"q", b"9:future format")], T0_US + KEEP + 1, KEEP)
    assert (stats.unreadable, stats.removed) == (1, 0)
