"""The ordering guard on Bigtable's limits that the emulator does not enforce
(docs/design.md §10.2): its compare-and-swap predicate stays a fixed size however
many cells an item owns. ``RowFilterLimit`` answers a row filter over 20,480
serialized bytes with INVALID_ARGUMENT, as the service does."""
from __future__ import annotations

import boto3
import pytest

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
from ddb2bt.pipeline.clients.bigtable.reads import read_table
from ddb2bt.pipeline.sink.guarded import apply_guarded
from ddb2bt.pipeline.testing.faults import RowFilterLimit
from ddb2bt.transforms.attrs import from_plain
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.model import INSERT, MODIFY, REMOVE, ChangeRecord
from ddb2bt.transforms.ordering import CLOCK_FAMILY, guarded_rows
from tests.conftest import write_mapping

pytestmark = pytest.mark.e2e

MAP_KEYS = 200  # with 20-byte keys, the old whole-clock predicate was ~8x the clock: far over the limit
T0_US = 1_700_000_000_000_000


def product(attrs: dict) -> dict:
    return {"pk": from_plain("hats"), "sk": from_plain("fedora"), "Description": from_plain("a hat"),
            "Attrs": from_plain(attrs)}


def record(event, new, old, us) -> ChangeRecord:
    return ChangeRecord(event, {"pk": from_plain("hats"), "sk": from_plain("fedora")}, new, old, us // 1000,
                        change_us=us)


def test_an_item_with_200_map_keys_is_swapped_within_the_row_filter_limit(stack, tmp_path, unique):
    path = write_mapping(tmp_path, source__table=f"Src_{unique}", target__table=f"t_{unique}", name=f"g_{unique}",
                         source__kinesis={"stream": f"cdc_{unique}"},
                         families={"SKU": {"max_versions": 1}, "attrs": {"max_versions": 1}},
                         rules__0__columns__Attrs={"family": "attrs", "as": "map", "encoding": "utf8"})
    boto3.client("kinesis").create_stream(StreamName=f"cdc_{unique}", ShardCount=1)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    mapping = load_mapping(path)
    limit = RowFilterLimit()
    writer = GrpcMutationWriter(mapping.target.project, mapping.target.instance, interceptors=(limit,))
    first = {f"attribute-key-{i:06d}": f"v{i}" for i in range(MAP_KEYS)}  # 20-byte keys
    second = dict(first, **{"attribute-key-000007": "changed", "attribute-key-999999": "new"})
    history = [record(INSERT, product(first), None, T0_US),
               record(MODIFY, product(second), product(first), T0_US + 1_000_000),
               record(MODIFY, product(second), product(first), T0_US + 1_000_000)]  # a duplicate: stale
    try:
        for change in history:
            stats = apply_guarded(writer, guarded_rows(mapping, change))
            assert not stats.rejected, stats.rejected
        table = read_table(mapping.target.project, mapping.target.instance, mapping.target.table)
        (row,) = table.values()
        attrs = {q: v for (f, q), v in row.items() if f == "attrs"}
        assert len(attrs) == MAP_KEYS + 1 and attrs[b"attribute-key-000007"][0][1] == b"changed"
        assert limit.rejected == 0 and 0 < limit.largest < 1024, "a fixed-size predicate, whatever the item owns"
        # The delete swaps against the big clock too, and leaves only the clock (the tombstone).
        stats = apply_guarded(writer, guarded_rows(mapping, record(REMOVE, None, product(second),
                                                                   T0_US + 2_000_000)))
        assert stats.applied == 1 and limit.rejected == 0
        table = read_table(mapping.target.project, mapping.target.instance, mapping.target.table)
        assert {f for row in table.values() for (f, _) in row} == {CLOCK_FAMILY}
    finally:
        writer.close()


def test_a_clock_written_before_the_token_is_still_swapped_or_refused_before_sending(stack, tmp_path, unique):
    """A format-1 clock (no token) is compared whole: a small one is swapped as
    before; one whose predicate would be over the limit is refused before
    sending, as the change's dead letter (reason row_filter_too_large), instead
    of an INVALID_ARGUMENT that fails the bundle for ever."""
    from ddb2bt.transforms.model import SetCell
    from ddb2bt.transforms.ordering import decode_clock, encode_clock

    path = write_mapping(tmp_path, source__table=f"Src_{unique}", target__table=f"t_{unique}", name=f"g_{unique}",
                         source__kinesis={"stream": f"cdc_{unique}"},
                         families={"SKU": {"max_versions": 1}, "attrs": {"max_versions": 1}},
                         rules__0__columns__Attrs={"family": "attrs", "as": "map", "encoding": "utf8"})
    boto3.client("kinesis").create_stream(StreamName=f"cdc_{unique}", ShardCount=1)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    mapping = load_mapping(path)
    limit = RowFilterLimit()
    writer = GrpcMutationWriter(mapping.target.project, mapping.target.instance, interceptors=(limit,))
    try:
        for start_us, keys, outcome in ((T0_US, 3, "applied"), (T0_US + 10_000_000, MAP_KEYS, "rejected")):
            attrs = {f"attribute-key-{i:06d}": "v" for i in range(keys)}
            (row,) = guarded_rows(mapping, record(INSERT, product(attrs), None, start_us))
            legacy = b"1:" + encode_clock(decode_clock(_clock_of(row))).split(b":", 2)[2]  # format 1: no token
            writer.mutate_rows(mapping.target.table, [(row.row_key, [SetCell(CLOCK_FAMILY, row.item, legacy,
                                                                             start_us // 1000)])])
            stats = apply_guarded(writer, guarded_rows(mapping, record(MODIFY, product(dict(attrs, x="y")),
                                                                       product(attrs), start_us + 1_000_000)))
            if outcome == "applied":
                assert stats.applied == 1 and not stats.rejected
            else:
                ((_, error),) = stats.rejected
                assert error.reason == "row_filter_too_large" and "20480" in error.message
            assert limit.rejected == 0, "nothing over the limit was sent"
    finally:
        writer.close()


def _clock_of(row) -> bytes:
    from ddb2bt.transforms.ordering import row_mutations

    return next(m.value for m in row_mutations(row, None) if m.family == CLOCK_FAMILY)
