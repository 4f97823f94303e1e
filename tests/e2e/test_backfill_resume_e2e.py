"""Backfill resume against moto's real Scan: a segment resumed from any item's
checkpoint reads exactly the items after it — nothing twice, nothing skipped —
even when the whole segment is one page (no LastEvaluatedKey in between)."""
from __future__ import annotations

import pytest

from ddb2bt.pipeline.connect.connections import dynamodb_client
from ddb2bt.pipeline.cutover.backfill import PartReaders
from ddb2bt.pipeline.source.snapshot import ScanSource, segment_name
from ddb2bt.pipeline.local import workload
from ddb2bt.transforms.model import ChangeRecord, PartDone

pytestmark = pytest.mark.e2e
HANDOFF_MS = 1_700_000_000_000
SEGMENTS = 3


def test_a_segment_resumes_after_its_last_written_item(stack, unique):
    ddb = dynamodb_client()
    table = f"Resume_{unique}"
    workload.create_table(ddb, table)
    with_keys = [{"pk": {"S": f"p{i % 7}"}, "sk": {"S": f"s{i:04d}"}, "v": {"N": str(i)}} for i in range(240)]
    for start in range(0, len(with_keys), 25):
        ddb.batch_write_item(RequestItems={table: [{"PutRequest": {"Item": it}} for it in with_keys[start:start + 25]]})
    source = ScanSource(table, SEGMENTS, page_limit=1000)  # each segment is one page

    def read(part, resume=None, count=0):
        out = list(PartReaders(source, ("pk", "sk"), HANDOFF_MS, ddb).read(part, resume, count))
        return [e for e in out if isinstance(e, ChangeRecord)], out[-1]

    seen = []
    for seg in range(SEGMENTS):
        part = segment_name(seg, SEGMENTS)
        records, done = read(part)
        assert isinstance(done, PartDone) and done.count == len(records)
        seen += [(r.keys["pk"]["S"], r.keys["sk"]["S"]) for r in records]
        for cut in (0, len(records) // 2, len(records) - 1):
            pos = records[cut].position
            rest, done = read(part, pos.resume, pos.count)
            assert [r.keys for r in rest] == [r.keys for r in records[cut + 1:]]
            assert done.count == len(records)
    assert sorted(seen) == sorted((it["pk"]["S"], it["sk"]["S"]) for it in with_keys)
