"""Thread-CPU per change of the live path's read and sink stages alone, without
Beam or an emulator (fast, and steadier than whole-pipeline runs on a busy
machine). The same 20,000 changes as bench/run.py's throughput contestants.

    .venv/bin/python bench/micro_hotpath.py sink     # pre-mapped batches through BatchingWriter
    .venv/bin/python bench/micro_hotpath.py read     # fake stream pages through PartitionReader
    .venv/bin/python bench/micro_hotpath.py encode   # MutateRows request bytes only
    .venv/bin/python bench/micro_hotpath.py map+sink # the mapping of each page, then the sink, as above
    .venv/bin/python bench/micro_hotpath.py statuses # MutateRows answers' entry statuses read (C, as the writer)
    .venv/bin/python bench/micro_hotpath.py statuses-library  # the same through the protobuf library

sink: MappedBatches (mapped once, beforehand) through ``BatchingWriter`` with a
writer that encodes every request as the gRPC writer does but sends nothing,
metrics on, no state store. read: ``batch_records(read_round(...))`` over a fake
stream client with Beam's thread-safe tracker wrapper, as the SDF runs it.
Compare code versions by running this with another checkout first on the path
(PYTHONPATH=<dir holding ddb2bt/{pipeline,transforms,examples}>), interleaved.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import MAPPING, mapped, stream_records  # noqa: E402

ARN = "arn:aws:dynamodb:us-east-1:000000000000:table/B/stream/2024-01-01T00:00:00.000"
TABLE_NAME = "projects/p/instances/i/tables/t"


def encode_request(table_name: str, entries: list) -> bytes:
    from ddb2bt.pipeline.clients.bigtable import wire as bio

    if hasattr(bio, "encode_mutate_rows"):
        return bio.encode_mutate_rows(table_name, None, entries)
    return bio.build_request(bio.mutate_rows_types()[0], table_name, None, entries).SerializeToString()  # older versions


def sink_case(n: int, map_too: bool = False):
    from prometheus_client import CollectorRegistry

    from ddb2bt.pipeline.observe.metrics import PipelineMetrics
    from ddb2bt.pipeline.clients.bigtable.errors import ENTRY_OK
    from ddb2bt.pipeline.sink.sink import BatchingWriter, SinkConfig
    from ddb2bt.transforms.dofns import map_record
    from ddb2bt.transforms.model import ChangeRecord, MappedBatch, StreamPosition

    class EncodingWriter:
        def mutate_rows(self, table, entries):
            encode_request(TABLE_NAME, entries)
            return [ENTRY_OK] * len(entries)

    class NullState:
        def save_checkpoints(self, checkpoints, **kwargs): pass
        def save_dead_letters(self, dead): pass
        def save_backfill_progress(self, progress): pass

    records = [ChangeRecord(ev, k, new, old, ts, position=StreamPosition(ARN, "shardId-0000", str(10**20 + i)))
               for i, (ev, k, new, old, ts) in enumerate(stream_records(n))]
    pages = [records[i:i + 1000] for i in range(0, n, 1000)]
    batches = [MappedBatch(tuple(map_record(MAPPING, r, lambda: 0) for r in page)) for page in pages]
    metrics = PipelineMetrics(CollectorRegistry())

    def run():
        writer = BatchingWriter(EncodingWriter(), NullState(), SinkConfig(), metrics, lambda t: frozenset({"SKU"}))
        if map_too:  # each page mapped here, as the mapping stage does, then buffered and written
            for page in pages:
                writer.add(MappedBatch(tuple(map_record(MAPPING, r, lambda: 0) for r in page)))
        else:
            for batch in batches:
                writer.add(batch)
        writer.flush()
    return run


def read_case(n: int):
    from apache_beam.runners.sdf_utils import ThreadsafeRestrictionTracker
    from prometheus_client import CollectorRegistry

    from ddb2bt.pipeline.clients.dynamodb import ShardPacer
    from ddb2bt.pipeline.observe.metrics import PipelineMetrics
    from ddb2bt.pipeline.source.records import batch_records
    from ddb2bt.pipeline.source.stream_sdf import PartitionTracker
    from ddb2bt.pipeline.source.stream_source import (PartitionReader, PartitionRestriction, ReaderOptions,
                                                      StreamPartition, drain)
    from ddb2bt.pipeline.testing.fakes import FakeStreamsClient

    client = FakeStreamsClient(table="B")
    client.add_shard("shardId-0000")
    for ev, k, new, old, ts in stream_records(n):
        client.put("shardId-0000", ev, k, new, old, created_ms=ts)
    metrics = PipelineMetrics(CollectorRegistry())
    partition = StreamPartition(client.stream_arn, 0, 1)

    def run():
        # No pacing sleeps: this measures the reader's CPU, not the 5 calls/s per shard limit.
        reader = PartitionReader(client, partition, ReaderOptions(), lambda *_: {}, metrics,
                                 pacer=ShardPacer(sleep=lambda s: None))
        tracker = ThreadsafeRestrictionTracker(PartitionTracker(PartitionRestriction()))
        total = 0
        while total < n:
            _, result = drain(batch_records(reader.read_round(tracker)))
            total += result.records
    return run


def encode_case(n: int):
    entries = mapped(stream_records(n), "t")
    chunks = [entries[i:i + 1000] for i in range(0, len(entries), 1000)]

    def run():
        for chunk in chunks:
            encode_request(TABLE_NAME, chunk)
    return run


def statuses_case(n: int, library: bool = False):
    """The writer's reading of MutateRows answers: one entry per change, 1,000
    to an answer, every status OK (cbtemulator's bytes: a status present, empty)."""
    from ddb2bt.pipeline.clients.bigtable import writer as bigtable_writer
    from ddb2bt.pipeline.clients.bigtable.errors import ENTRY_OK, EntryStatus
    from ddb2bt.pipeline.clients.bigtable.wire import mutate_rows_types

    response_cls = mutate_rows_types()[1]
    answers = []
    for start in range(0, n, 1000):
        msg = response_cls()
        for i in range(min(1000, n - start)):
            msg.entries.add(index=i).status.code = 0
        answers.append(msg.SerializeToString())
    read_c = None if library else bigtable_writer.native_mutate_rows_statuses()
    if not library and read_c is None:
        raise SystemExit("the C module does not run here (not built, or DDB2BT_ROW_WRITER=python)")

    def run():
        for data in answers:
            statuses = [None] * 1000
            if read_c is None or read_c(data, statuses, ENTRY_OK, EntryStatus) is None:
                bigtable_writer.note_statuses(response_cls.FromString(data), statuses)
    return run


CASES = {"sink": sink_case, "map+sink": lambda n: sink_case(n, map_too=True), "read": read_case,
         "encode": encode_case, "statuses": statuses_case,
         "statuses-library": lambda n: statuses_case(n, library=True)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--changes", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    import ddb2bt.pipeline as package

    print(f"code under test: {Path(package.__file__).resolve().parent}")
    run = CASES[args.case](args.changes)
    # The pre-generated data is frozen out of the garbage collector, as bench/run.py
    # does: a real stream never holds 20,000 changes in memory for it to re-scan.
    gc.collect()
    gc.freeze()
    run()  # warm-up
    per_change = []
    for _ in range(args.repeat):
        t0 = time.thread_time()
        run()
        per_change.append((time.thread_time() - t0) / args.changes * 1e6)
    per_change.sort()
    print(f"{args.case}: min {per_change[0]:.1f} / median {per_change[len(per_change) // 2]:.1f} us CPU per change")
    return 0


if __name__ == "__main__":
    sys.exit(main())
