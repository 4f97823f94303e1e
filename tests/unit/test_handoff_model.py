"""Model-based test of the backfill/tail handoff (docs/design.md §7).

A random history of DynamoDB operations runs while a backfill scans items at
random moments after the handoff time T and writes them in random batches, and
the live tail applies the stream in order — with duplicates and replays from old
checkpoints — interleaved at random. Through the real sink (BatchingWriter) into
the in-memory Bigtable. At the end the target must equal the mapping of the final
table exactly, for plain and versioned columns, whatever the interleaving.
"""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from ddb2bt.pipeline.cutover.compare import expected_layout
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.pipeline.retry import RetryPolicy
from ddb2bt.pipeline.sink.sink import BatchingWriter, SinkConfig
from ddb2bt.transforms.attrs import from_plain
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.dofns import map_record
from ddb2bt.transforms.mapping import MARKER_FAMILY, backfill_record, handoff_second_ms, map_change
from ddb2bt.transforms.model import INSERT, MODIFY, REMOVE, ChangeRecord, MappedChange

VIDEOS = load_mapping("examples/videos.yaml")
CATALOG = load_mapping("examples/product_catalog.yaml")
START_MS = 1_700_000_000_000
FAST = SinkConfig(retry=RetryPolicy(0.001, 0.001, 1.0))


def item(**kw):
    return {k: from_plain(v) for k, v in kw.items()}


def video_item(pk, sk, n):
    if sk == "Video":
        return item(pk=pk, sk=sk, UploadDate=f"2023-09-10T15:21:{n:02d}", Formats={"480": f"u{n}"})
    if sk == "VideoStatsLikes":
        return item(pk=pk, sk=sk, Count=n)
    return item(pk=pk, sk=sk, Content=f"c{n}", CreatedAt=f"2023-09-1{sk[-1]}T00:00:{n:02d}")


def catalog_item(pk, sk, n):
    attrs = {"pk": pk, "sk": sk, "Price": n}
    if n % 2:
        attrs["Description"] = f"d{n}"  # present or removed from one version to the next
    if n % 3 == 0:
        attrs["Color"] = ["red"] if n % 2 else ["blue", "red"]
    return item(**attrs)


CASES = {
    "videos": (VIDEOS, ["0123", "0124"], ["Video", "VideoStatsLikes", "VideoComment#1", "VideoComment#2"],
               video_item),
    "catalog": (CATALOG, ["hats", "shoes"], ["a#1", "b"], catalog_item),
}


class World:
    def __init__(self, mapping, make):
        self.mapping, self.make = mapping, make
        self.bt = InMemoryBigtable()
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

    def tail_apply(i, marking):
        for ch in map_change(mapping, world.records[i], mark_touched=marking):
            tail.add(MappedChange(world.records[i], (ch,)))
        tail.flush()

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
        if not choices:
            break
        action = data.draw(st.sampled_from(choices), label="action")
        if action == "op":
            world.op(*remaining_ops.pop(0))
        elif action == "tail":
            copies = data.draw(st.integers(1, 2), label="duplicates")
            for _ in range(copies):  # at-least-once delivery
                tail_apply(applied, backfilling)
            applied += 1
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
        tail_apply(i, backfilling)

    expected = expected_layout(mapping, world.items.values())[mapping.target.table]
    have = {row: {col: v for col, v in cols.items() if col[0] != MARKER_FAMILY}
            for row, cols in world.bt.versions(mapping.target.table).items()}
    have = {row: cols for row, cols in have.items() if cols}
    assert set(have) == set(expected)
    for row, cols in expected.items():
        assert set(have[row]) == set(cols), row
        for col, want in cols.items():
            versions = have[row][col]
            if want.kind == "single":
                # The newest version is the value. A pre-handoff tail write that lands
                # after the backfill may leave an *older* version below it (reads
                # never see it; the family's max_versions GC removes it).
                assert versions[max(versions)] == want.value, (row, col, versions)
            else:
                assert versions == want.value, (row, col, versions)
