"""The ordering guard writes the difference (docs/design.md §10.2): an applied
change sends only the cells whose value the row's clock does not record, the
deletes of cells no longer owned, and the clock. The rows it leaves must be the
rows the whole-state rewrite (the guard before this change, kept below as the
reference) leaves, after every batch of any delivery: shuffled, duplicated,
replayed, with deletes, TTL deletions, list and versioned columns and index
rows an item moves between. Only the timestamps of cells a change left
unchanged differ: they keep the time they were written at."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from typing import Optional
from unittest import mock

from hypothesis import given, settings, strategies as st

from ddb2bt.pipeline.sink import guarded
from ddb2bt.pipeline.sink.guarded import apply_guarded
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.attrs import from_plain
from ddb2bt.transforms.config import TtlConfig, load_mapping
from ddb2bt.transforms.mapping import delete_cell, write_cell
from ddb2bt.transforms.model import INSERT, MODIFY, REMOVE, ChangeRecord, SetCell
from ddb2bt.transforms.ordering import (CLOCK_FAMILY, Clock, GuardedRow, clock_mutations, decode_clock,
                                        converge_rows, guarded_rows, is_newer, row_mutations)
from tests.unit.recover.test_recover_model import CASES
from tests.unit.sink.test_ordering_guard_model import shuffled_deliveries

START_US = 1_700_000_000_000_000


def full_rewrite_mutations(row: GuardedRow, stored: Optional[Clock]) -> Optional[tuple]:
    """The guard's row_mutations before it wrote the difference: every owned cell
    written whole on every applied change (the reference)."""
    if not is_newer(row.order, stored):
        return None
    muts: list = []
    keep = set()
    for cell in row.new_cells:
        keep.add((cell.family, cell.qualifier, cell.version_ms))
        muts.extend(write_cell(cell, row.ts_ms, True))
    for family, qualifier, version in (stored.cells if stored is not None else row.old_cells):
        if (family, qualifier, version) not in keep:
            muts.append(delete_cell(_Id(family, qualifier, version), row.ts_ms))
    muts.extend(clock_mutations(row, tuple(sorted(keep, key=lambda c: (c[0], c[1], -1 if c[2] is None else c[2])))))
    return tuple(muts)


@dataclasses.dataclass(frozen=True)
class _Id:
    family: str
    qualifier: bytes
    version_ms: Optional[int]


def history(rng: random.Random, make, key_names, pks, sks, precision_us: int, ttl: bool) -> list:
    """A random history of change records: puts (new versions of an item),
    deletes, some of them TTL deletions; consecutive changes of an item may
    share a timestamp at MILLISECOND precision (ordered by images, §10.3)."""
    items: dict = {}
    records = []
    now = START_US
    for _ in range(rng.randint(1, 30)):
        pk, sk = rng.choice(pks), rng.choice(sks)
        keys = {key_names[0]: from_plain(pk), key_names[1]: from_plain(sk)}
        old = items.get((pk, sk))
        if rng.random() < 0.3:
            if old is None:
                continue
            new = None
        else:
            new = make(pk, sk, rng.randint(0, 59))
            if new == old:
                continue
        # A whole precision unit at least between changes of the history: the
        # image rule of §10.3 is exact for that (two changes in one unit is its
        # documented limit, tested in test_ordering_guard_model).
        now += precision_us * rng.choice([1, 2, 1000])
        event = REMOVE if new is None else (MODIFY if old is not None else INSERT)
        records.append(ChangeRecord(event, keys, new, old, now // 1000, change_us=now,
                                    is_ttl_delete=ttl and event == REMOVE and rng.random() < 0.5))
        if new is None:
            items.pop((pk, sk))
        else:
            items[(pk, sk)] = new
    return records


def deliveries(rng: random.Random, records: list) -> list:
    return shuffled_deliveries(rng, records, rng.randint(1, 8))


def rows_as_read(bt: InMemoryBigtable, tables) -> dict:
    """Every cell but the clocks: {(table, row): {column: [values, oldest version first]}},
    and the versions of versioned columns, which are the item's own times."""
    out = {}
    for table in tables:
        for row, cols in bt.versions(table).items():
            kept = {c: [v for _, v in sorted(versions.items())] for c, versions in cols.items()
                    if c[0] != CLOCK_FAMILY}
            if kept:
                out[(table, row)] = kept
    return out


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(CASES)), st.sampled_from([1, 1000]), st.sampled_from([None, "apply", "ignore"]),
       st.integers(0, 2**32 - 1), st.integers(1, 7))
def test_the_difference_leaves_the_rows_the_whole_state_rewrite_leaves(case, precision_us, ttl, seed, batch):
    mapping, pks, sks, make, key_names = CASES[case]
    if ttl is not None:
        mapping = dataclasses.replace(mapping, ttl=TtlConfig("Expires", ttl))
    rng = random.Random(seed)
    order = deliveries(rng, history(rng, make, key_names, pks, sks, precision_us, ttl is not None))
    diff, whole = InMemoryBigtable(), InMemoryBigtable()
    sent = {"diff": 0, "whole": 0}
    for start in range(0, len(order), batch):
        rows = [row for record in order[start:start + batch] for row in guarded_rows(mapping, record)]
        assert not apply_guarded(counting(diff, sent, "diff"), rows).rejected
        with mock.patch.object(guarded, "row_mutations", full_rewrite_mutations):
            for row in rows:  # one swap per change, as the guard did before it sent a slot's changes together
                assert not apply_guarded(counting(whole, sent, "whole"), [row]).rejected
        assert rows_as_read(diff, mapping.tables) == rows_as_read(whole, mapping.tables)
    assert sent["diff"] <= sent["whole"]


class counting:
    """A ClockWriter that counts the mutations of the swaps it passes on, and the swaps."""

    def __init__(self, bt, sent: dict, name: str) -> None:
        self.bt, self.sent, self.name = bt, sent, name
        self.swaps = 0

    def read_family(self, *args):
        return self.bt.read_family(*args)

    def swap_row(self, table_id, row_key, family, qualifier, expected, mutations, prefix=False):
        swapped = self.bt.swap_row(table_id, row_key, family, qualifier, expected, mutations, prefix)
        self.swaps += 1
        if swapped:
            self.sent[self.name] += len(mutations)
        return swapped


CATALOG = load_mapping("examples/product_catalog.yaml")
ATTRIBUTES = 200  # an item with many cells: the whole state would be ~2 mutations each


def wide_item(changed: int) -> dict:
    attrs = {f"Attr{i:03d}": from_plain(f"v{i}") for i in range(ATTRIBUTES)}
    attrs["Attr007"] = from_plain(f"changed {changed}")
    return {"pk": from_plain("hats"), "sk": from_plain("b"), **attrs}


def test_a_change_of_one_attribute_sends_mutations_for_that_cell_only():
    keys = {"pk": from_plain("hats"), "sk": from_plain("b")}
    bt = InMemoryBigtable()
    sent = {"w": 0}
    apply_guarded(counting(bt, sent, "w"), guarded_rows(CATALOG, ChangeRecord(
        INSERT, keys, wide_item(0), None, START_US // 1000, change_us=START_US)))
    assert sent["w"] > ATTRIBUTES  # the first write of a row writes every cell
    per_change = []
    for n in range(1, 4):
        sent["w"] = 0
        us = START_US + n * 1_000_000
        apply_guarded(counting(bt, sent, "w"), guarded_rows(CATALOG, ChangeRecord(
            MODIFY, keys, wide_item(n), wide_item(n - 1), us // 1000, change_us=us)))
        per_change.append(sent["w"])
    # The changed cell (its write and the prune of its older version) and the
    # clock (its write and the prune of its older version): O(changed cells).
    assert per_change == [4, 4, 4]
    (row,) = bt.latest(CATALOG.target.table).values()
    assert sum(1 for (f, _) in row if f != CLOCK_FAMILY) == ATTRIBUTES


def format2_clock(row: GuardedRow) -> bytes:
    """The clock as the guard wrote it before value digests (format 2)."""
    cells = sorted(([c.family, c.qualifier.hex(), c.version_ms] for c in row.new_cells), key=lambda c: (c[0], c[1]))
    body = f"{row.order.us}:{row.order.new_hash.hex()}:{json.dumps(cells, separators=(',', ':'))}"
    return f"2:{hashlib.blake2b(body.encode('ascii'), digest_size=16).hexdigest()}:{body}".encode("ascii")


def test_a_clock_without_digests_gets_the_whole_state_once():
    """A row whose clock an older version wrote (format 2: no value digests) is
    written whole by its next change, and by the difference from then on."""
    keys = {"pk": from_plain("hats"), "sk": from_plain("b")}
    bt = InMemoryBigtable()
    first = guarded_rows(CATALOG, ChangeRecord(INSERT, keys, wide_item(0), None, START_US // 1000,
                                               change_us=START_US))[0]
    bt.mutate_rows(CATALOG.target.table, [(first.row_key, [m for m in row_mutations(first, None)
                                                           if m.family != CLOCK_FAMILY]
                                           + [SetCell(CLOCK_FAMILY, first.item, format2_clock(first), first.ts_ms)])])
    sent = {"w": 0}
    per_change = []
    for n in range(1, 3):
        sent["w"] = 0
        us = START_US + n * 1_000_000
        apply_guarded(counting(bt, sent, "w"), guarded_rows(CATALOG, ChangeRecord(
            MODIFY, keys, wide_item(n), wide_item(n - 1), us // 1000, change_us=us)))
        per_change.append(sent["w"])
    assert per_change[0] > ATTRIBUTES and per_change[1] == 4
    (row,) = bt.latest(CATALOG.target.table).values()
    assert row[("SKU", b"Attr007")] == b"changed 2"


def test_cells_of_a_family_with_a_max_age_are_rewritten_on_every_change():
    """A max-age GC rule ages a cell by its timestamp: an unchanged cell of a live
    item is rewritten with each change, as an ordered source does, so it does
    not expire while the item keeps changing."""
    aging = dataclasses.replace(CATALOG, families=tuple(
        dataclasses.replace(f, max_age_seconds=86_400) for f in CATALOG.families))
    keys = {"pk": from_plain("hats"), "sk": from_plain("b")}
    first = guarded_rows(aging, ChangeRecord(INSERT, keys, wide_item(0), None, START_US // 1000,
                                             change_us=START_US))[0]
    stored = next(m.value for m in row_mutations(first, None) if m.family == CLOCK_FAMILY and hasattr(m, "value"))
    us = START_US + 1_000_000
    change = guarded_rows(aging, ChangeRecord(MODIFY, keys, wide_item(1), wide_item(0), us // 1000,
                                              change_us=us))[0]
    assert len(row_mutations(change, decode_clock(stored))) > ATTRIBUTES


def test_several_changes_of_one_item_to_one_row_in_a_batch_are_one_swap():
    """One round trip for the slot, not one per change: shuffled, with a
    duplicate, the newest state wins and the counts are those of one swap per
    change (4 applied in order would be 4 applied; here the shuffle makes some stale)."""
    keys = {"pk": from_plain("hats"), "sk": from_plain("b")}
    history = [ChangeRecord(INSERT, keys, wide_item(0), None, START_US // 1000, change_us=START_US)]
    for n in range(1, 5):
        us = START_US + n * 1_000_000
        history.append(ChangeRecord(MODIFY, keys, wide_item(n), wide_item(n - 1), us // 1000, change_us=us))
    delivered = [history[0], history[1], history[3], history[2], history[3], history[4]]
    bt = InMemoryBigtable()
    writer = counting(bt, {"w": 0}, "w")
    stats = apply_guarded(writer, [row for record in delivered for row in guarded_rows(CATALOG, record)])
    assert writer.swaps == 1
    # Decided as one swap after another would: 0, 1, 3 applied; 2 older than 3, the
    # second 3 a duplicate: stale; 4 applied.
    assert (stats.applied, stats.stale) == (4, 2)
    (row,) = bt.latest(CATALOG.target.table).values()
    assert row[("SKU", b"Attr007")] == b"changed 4"
    assert sum(1 for (f, _) in row if f != CLOCK_FAMILY) == ATTRIBUTES


class refusing(counting):
    """A writer that refuses (as over a Bigtable limit) any swap writing ``bad``."""

    bad = b"changed 2"

    def swap_row(self, table_id, row_key, family, qualifier, expected, mutations, prefix=False):
        if any(getattr(m, "value", None) == self.bad for m in mutations):
            from ddb2bt.transforms.errors import MappingError

            raise MappingError("cell over the limit", reason="cell_too_large")
        return super().swap_row(table_id, row_key, family, qualifier, expected, mutations, prefix)


def test_a_slot_over_a_limit_together_is_applied_one_change_at_a_time():
    """When the slot's combined swap breaks a limit, its changes are swapped one by
    one, so only the change at fault is rejected (a dead letter) and the others land."""
    keys = {"pk": from_plain("hats"), "sk": from_plain("b")}
    history = [ChangeRecord(INSERT, keys, wide_item(1), None, START_US // 1000, change_us=START_US),
               ChangeRecord(MODIFY, keys, wide_item(2), wide_item(1), START_US // 1000 + 1000,
                            change_us=START_US + 1_000_000)]
    bt = InMemoryBigtable()
    writer = refusing(bt, {"w": 0}, "w")
    stats = apply_guarded(writer, [row for record in history for row in guarded_rows(CATALOG, record)])
    assert stats.applied == 1 and [r.order.us for r, _ in stats.rejected] == [START_US + 1_000_000]
    (row,) = bt.latest(CATALOG.target.table).values()
    assert row[("SKU", b"Attr007")] == b"changed 1"


VIDEOS = load_mapping("examples/videos.yaml")


def test_a_repair_writes_the_whole_state_where_the_row_misses_what_the_clock_records():
    """videos.yaml's rules `views` and `views_legacy` share cell stats:Views of
    row {pk}. VideoStatsViews' REMOVE deletes it around VideoStats' clock, which
    still records the value 5 there (a shared cell: not promised for the live
    path, docs/design.md §1.5). A repair (converge_rows) must not trust the
    clock's digests: it writes the item's whole state, so the cell is back."""
    legacy_keys = {"pk": from_plain("v1"), "sk": from_plain("VideoStats")}
    views_keys = {"pk": from_plain("v1"), "sk": from_plain("VideoStatsViews")}
    legacy = {**legacy_keys, "ViewCount": from_plain(5)}
    views = {**views_keys, "Count": from_plain(10)}
    bt = InMemoryBigtable()
    for n, (event, keys, new, old) in enumerate([(INSERT, legacy_keys, legacy, None),
                                                 (INSERT, views_keys, views, None),
                                                 (REMOVE, views_keys, None, views)]):
        us = START_US + n * 1_000_000
        apply_guarded(bt, guarded_rows(VIDEOS, ChangeRecord(event, keys, new, old, us // 1000, change_us=us)))
    assert ("stats", b"Views") not in bt.latest("videos").get(b"v1", {})
    repair_ms = (START_US + 10_000_000) // 1000
    assert apply_guarded(bt, converge_rows(VIDEOS, legacy_keys, legacy, (legacy,), repair_ms)).applied == 1
    assert bt.latest("videos")[b"v1"][("stats", b"Views")] == (5).to_bytes(8, "big", signed=True)
