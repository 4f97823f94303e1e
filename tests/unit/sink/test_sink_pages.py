"""BatchingWriter takes a page of changes (a MappedBatch, the live path's
element) as it takes the same elements one by one: whatever a page holds —
plain changes, coalescing ones, dead letters, changes of several rows or none,
a family the table lacks, no stream position, shard markers — and wherever the
batch limits cut it, the batches committed, the writes and their order, the
checkpoints, the dead letters and the metrics are the same. (A page path of its
own for the common change was tried against this test — it caught a batch
limit the page path had read differently — and measured at ~0.5 µs a change
less, ~12 % of adding: not kept, docs/benchmarks.md.)"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st
from prometheus_client import CollectorRegistry

from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.observe.metrics import PipelineMetrics
from ddb2bt.pipeline.sink.sink import BatchingWriter, SinkConfig
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.model import (ChangeRecord, DeadLetter, DeleteCells, MappedBatch, MappedChange, RowChange,
                                     SetCell, ShardClosed, StreamPosition)

ARN = "arn:aws:dynamodb:us-east-1:1:table/T/stream/2024"
FAST = RetryPolicy(initial_s=0.001, max_backoff_s=0.002, deadline_s=5.0)
KINDS = ("plain", "plain", "plain", "dead", "two_rows", "no_rows", "unknown_family", "no_position", "closed")


def _row(key: bytes, value: bytes, ts: int, family: str = "f") -> RowChange:
    return RowChange("t", key, (SetCell(family, b"q", value, ts), DeleteCells(family, b"q", 0, ts)))


def _elements(ops: list) -> list:
    """The changes (and markers) the ops describe, in stream order, per shard."""
    out, seq = [], {"s1": 0, "s2": 0}
    for n, (kind, key, shard) in enumerate(ops):
        seq[shard] += 1
        ts = 1000 + n
        if kind == "closed":
            out.append(ShardClosed(ARN, shard))
            continue
        position = None if kind == "no_position" else StreamPosition(ARN, shard, str(seq[shard]))
        record = ChangeRecord("MODIFY", {"k": {"S": f"k{key}"}}, {}, {}, ts, position)
        row_key, value = f"r{key}".encode(), f"v{n}".encode()
        if kind == "dead":
            out.append(MappedChange(record, dead_letter=DeadLetter("bad", "X", "unmappable", "map", record, 5)))
        elif kind == "two_rows":
            out.append(MappedChange(record, (_row(row_key, value, ts), _row(row_key + b"-index", value, ts))))
        elif kind == "no_rows":
            out.append(MappedChange(record))
        elif kind == "unknown_family":
            out.append(MappedChange(record, (_row(row_key, value, ts, family="nope"),)))
        else:
            out.append(MappedChange(record, (_row(row_key, value, ts),)))
    return out


def _run(elements: list, pages, max_rows: int, max_mutations: int) -> tuple:
    bt = InMemoryBigtable(families={"t": {"f"}})
    state = StateStore(bt, "job", lambda: 5)
    metrics = PipelineMetrics(CollectorRegistry())
    config = SinkConfig(retry=FAST, max_batch_rows=max_rows, max_batch_mutations=max_mutations)
    writer = BatchingWriter(bt, state, config, metrics, lambda table: frozenset(bt.families[table]),
                            now_ms=lambda: 5, sleep=lambda s: None)
    batches = []  # what each committed batch held, beside what it wrote
    commit = writer._commit

    def seen(batch):
        batches.append((sorted(batch.rows), batch.bytes, batch.mutations, batch.positions, batch.applied,
                        [id(e) for e in batch.elements], len(batch.dead), len(batch.closed)))
        return commit(batch)

    writer._commit = seen
    dead = []
    if pages is None:
        for element in elements:
            dead += writer.add(element)
    else:
        start = 0
        for size in pages:
            dead += writer.add(MappedBatch(tuple(elements[start:start + size])))
            start += size
        dead += writer.add(MappedBatch(tuple(elements[start:])))
    dead += writer.flush()
    samples = sorted((s.name, tuple(sorted(s.labels.items())), s.value) for family in metrics.registry.collect()
                     for s in family.samples
                     if (s.name.startswith("ddb2bt_changes") or "dead" in s.name) and not s.name.endswith("_created"))
    return (batches, bt.calls, bt.latest("t"), state.load_checkpoints(ARN), [(d.reason, d.record.event_id) for d in dead],
            sorted(d["reason"] for d in state.list_dead_letters()), samples)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 6), st.sampled_from(["s1", "s2"])),
                    min_size=1, max_size=40),
       pages=st.lists(st.integers(0, 12), max_size=6),
       max_rows=st.integers(1, 8), max_mutations=st.sampled_from([4, 6, 20, 100_000]))
def test_a_page_is_added_as_its_changes_one_by_one(ops, pages, max_rows, max_mutations):
    elements = _elements(ops)
    one_by_one = _run(elements, None, max_rows, max_mutations)
    assert _run(elements, pages, max_rows, max_mutations) == one_by_one
    assert one_by_one[1] or not any(kind in ("plain", "two_rows", "no_position") for kind, _, _ in ops)


def test_a_page_of_plain_changes_coalesces_and_checkpoints_as_one_by_one():
    """The common page: repeated rows (coalesced), two shards, a batch limit cut."""
    ops = [("plain", n % 3, "s1" if n % 2 else "s2") for n in range(10)]
    elements = _elements(ops)
    paged = _run(elements, [10], 4, 100_000)
    assert paged == _run(elements, None, 4, 100_000)
    _, calls, latest, checkpoints, _, _, samples = paged
    assert calls[0] == ("t", [b"r0", b"r1", b"r2"]) and set(latest) == {b"r0", b"r1", b"r2"}
    assert {shard: c.sequence_number for shard, c in checkpoints.items()} == {"s1": "5", "s2": "5"}
    assert ("ddb2bt_changes_coalesced_total", (("table", "job"),), 7.0) in samples  # 10 changes to 3 rows
