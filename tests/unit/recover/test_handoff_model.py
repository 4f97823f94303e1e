"""Model-based test of the backfill/tail handoff (docs/design.md §7), the finish
and the redrive.

A random history of DynamoDB operations runs while a backfill scans items at
random moments after the handoff time T and writes them in random batches, and
the live tail applies the stream in order — with duplicates and replays from old
checkpoints — interleaved at random. Some stream records fail to map (a broken
mapping: the tail dead-letters them and goes on with the later ones). Once the
backfill is done, the finish drops the marker family at a random moment, while
the tail may still mark (a stale phase cache: those writes race the drop). Then
the mapping is "fixed" and ``dlq redrive`` runs, with further changes racing its
reads. Through the real sink (BatchingWriter) into the in-memory Bigtable. At the
end the target must equal the mapping of the final table exactly, for plain and
versioned columns, with no cell or row of ours left, whatever the interleaving.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from ddb2bt.pipeline.recover.redrive import RedriveOptions, redrive
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.sink.sink import BatchingWriter, SinkConfig
from ddb2bt.transforms.compiled import compile_mapping
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.dofns import map_record
from ddb2bt.transforms.mapping import MARKER_FAMILY, backfill_record, handoff_second_ms, map_change
from ddb2bt.transforms.model import INSERT, MODIFY, REMOVE, ChangeRecord, DeadLetter, MappedChange
from tests.unit.cutover.cutover_common import assert_target_is_the_mapping_of, catalog_item, item, video_item

VIDEOS = load_mapping("examples/videos.yaml")
CATALOG = load_mapping("examples/product_catalog.yaml")
START_MS = 1_700_000_000_000
FAST = SinkConfig(retry=RetryPolicy(0.001, 0.001, 1.0))


CASES = {
    "videos": (VIDEOS, ["0123", "0124"], ["Video", "VideoStatsLikes", "VideoComment#1", "VideoComment#2"],
               video_item),
    "catalog": (CATALOG, ["hats", "shoes"], ["a#1", "b"], catalog_item),
}


class World:
    def __init__(self, mapping, make):
        self.mapping, self.make = mapping, make
        # The target's families as the admin sees them: the marker family exists
        # from the start of the backfill until the finish drops it.
        self.bt = InMemoryBigtable(families={mapping.target.table: set(mapping.family_names) | {MARKER_FAMILY}})
        self.items: dict = {}
        self.records: list = []
        self.states: list = [{}]  # table state after each op
        self.now_ms = START_MS

    def op(self, pk, sk, kind, n, advance_ms):
        self.now_ms += advance_ms
        ts = handoff_second_ms(self.now_ms)  # AWS rounds stream timestamps down to the second
        k = (pk, sk)
        key = item(pk=pk, sk=sk)
        old = self.items.get(k)
        if kind == "delete":
            if old is not None:
                del self.items[k]
                self.records.append(ChangeRecord(REMOVE, key, None, old, ts))
        else:
            new = self.make(pk, sk, n)
            self.items[k] = new
            self.records.append(ChangeRecord(MODIFY if old else INSERT, key, new, old, ts))
        self.states.append(dict(self.items))


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(CASES)), st.data())
def test_backfill_and_tail_converge_under_any_interleaving(case, data):
    mapping, pks, sks, make = CASES[case]
    world = World(mapping, make)
    ops = data.draw(st.lists(st.tuples(st.sampled_from(pks), st.sampled_from(sks), st.sampled_from(["put", "delete"]),
                                       st.integers(0, 59), st.sampled_from([0, 1, 400, 1000])),
                             min_size=1, max_size=25), label="ops")
    handoff_after = data.draw(st.integers(0, len(ops)), label="handoff after op")
    for o in ops[:handoff_after]:
        world.op(*o)
    handoff_ms = world.now_ms + data.draw(st.integers(1, 999), label="handoff offset")
    world.now_ms = handoff_ms
    tail = BatchingWriter(world.bt, None, FAST, sleep=lambda s: None)
    backfill = BatchingWriter(world.bt, None, FAST, sleep=lambda s: None)
    applied = 0  # tail position
    remaining_ops = list(ops[handoff_after:])
    to_scan = None  # keys not yet scanned (known once the scan starts)
    scanned: list = []  # snapshots read, not yet written
    backfilling = True

    failing = set(data.draw(st.lists(st.integers(0, 40), max_size=4), label="records the broken mapping fails"))
    dead_letters: dict = {}  # record index -> record (stored once, as the sink does)
    finished = False

    def tail_apply(i, marking):
        if i in failing:  # dead-lettered; the tail goes on with the next record
            dead_letters[i] = world.records[i]
            return
        for ch in map_change(mapping, world.records[i], mark_touched=marking):
            tail.add(MappedChange(world.records[i], (ch,)))
        assert tail.flush() == [], "a marker write racing the finish must never be a dead letter"

    def finish():
        """The finish: drop the marker family (its cells, and rows holding only them, go)."""
        world.bt.families[mapping.target.table].discard(MARKER_FAMILY)
        rows = world.bt.tables.get(mapping.target.table, {})
        for key in list(rows):
            for col in [c for c in rows[key] if c[0] == MARKER_FAMILY]:
                del rows[key][col]
            if not rows[key]:
                del rows[key]

    def marking():
        # While backfilling the tail marks; afterwards a stale phase cache may still
        # mark for a while, before or after the finish.
        return backfilling or data.draw(st.booleans(), label="stale marking")

    while True:
        choices = []
        if remaining_ops:
            choices.append("op")
        if applied < len(world.records):
            choices.append("tail")
        if applied and data.draw(st.booleans(), label="allow replay"):
            choices.append("replay")
        if backfilling:
            choices.append("scan")
        elif not finished:
            choices.append("finish")
        if not choices:
            break
        action = data.draw(st.sampled_from(choices), label="action")
        if action == "op":
            world.op(*remaining_ops.pop(0))
        elif action == "tail":
            copies = data.draw(st.integers(1, 2), label="duplicates")
            for _ in range(copies):  # at-least-once delivery
                tail_apply(applied, marking())
            applied += 1
        elif action == "finish":
            finish()
            finished = True
        elif action == "replay":  # a restart from an older checkpoint
            applied = data.draw(st.integers(0, applied - 1), label="checkpoint")
        else:
            if to_scan is None:  # the scan visits every key once, in a random order
                to_scan = data.draw(st.permutations(sorted((pk, sk) for pk in pks for sk in sks)), label="scan order")
            step = data.draw(st.sampled_from(["read", "flush"]), label="backfill step")
            if step == "read" and to_scan:
                k = to_scan.pop(0)
                snapshot = world.items.get(k)  # the item as the scan sees it now (≥ T)
                if snapshot is not None:
                    keys = {a: snapshot[a] for a in mapping.source.key_attributes}
                    scanned.append(backfill_record(keys, snapshot, handoff_ms))
            else:
                for rec in scanned:
                    backfill.add(map_record(mapping, rec, lambda: 0))
                if data.draw(st.booleans(), label="backfill replays its batch"):
                    for rec in scanned:
                        backfill.add(map_record(mapping, rec, lambda: 0))
                backfill.flush()
                scanned = []
                if not to_scan:
                    backfilling = False  # phase → CATCHING_UP: the tail stops marking
    assert not backfilling or to_scan is None or not to_scan
    # catch up: whatever the tail has not applied yet
    for i in range(applied, len(world.records)):
        tail_apply(i, marking())
    applied = len(world.records)
    if not finished:
        finish()

    # The mapping is fixed; dlq redrive, while more changes race its reads (the
    # tail applying them at once or only after the redrive).
    failing.clear()
    store = StateStore(world.bt, "job", lambda: world.now_ms)
    store.save_dead_letters([DeadLetter("bad", "MappingError", "m", "map", r, 0) for _, r in sorted(dead_letters.items())])
    racing = list(data.draw(st.lists(st.tuples(st.sampled_from(pks), st.sampled_from(sks),
                                               st.sampled_from(["put", "delete"]), st.integers(0, 59),
                                               st.sampled_from([0, 1, 400, 1000])), max_size=3), label="racing ops"))

    class Reader:
        def get(self, keys):
            if racing and data.draw(st.booleans(), label="a change races this read"):
                world.op(*racing.pop(0))
                if data.draw(st.booleans(), label="the tail applies it before the redrive writes"):
                    for i in range(len(world.records)):
                        if i >= applied_box[0]:
                            tail_apply(i, False)
                    applied_box[0] = len(world.records)
            return world.items.get((keys["pk"]["S"], keys["sk"]["S"]))

    applied_box = [applied]
    batcher = BatchingWriter(world.bt, None, FAST, sleep=lambda s: None)
    def sleep(seconds):
        world.now_ms += int(seconds * 1000)

    result = redrive(mapping, store, batcher, Reader(), RedriveOptions(max_rounds=10), now_ms=lambda: world.now_ms,
                     sleep=sleep)
    assert result.still_failing == result.redacted == 0
    assert result.resolved + result.unstable == len(dead_letters)
    for o in racing:
        world.op(*o)
    for i in range(applied_box[0], len(world.records)):
        tail_apply(i, False)

    # Every change above was mapped by the compiled mapping itself (map_change's
    # form, none handed to the general engine), so this model checks that path.
    assert compile_mapping(mapping).fallbacks == 0
    have = world.bt.versions(mapping.target.table)
    assert not any(col[0] == MARKER_FAMILY for cols in have.values() for col in cols), "markers left after finish"
    assert_target_is_the_mapping_of(world.bt, mapping, world.items.values())
