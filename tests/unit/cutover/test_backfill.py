import gzip
import json

import pytest

from ddb2bt.pipeline.clients.dynamodb import TokenBucket
from ddb2bt.pipeline.cutover.backfill import EXPORT, SCAN, PartReaders, plan_tasks
from ddb2bt.pipeline.source.snapshot import ExportSource, ScanSource, parse_segment, segment_name
from ddb2bt.pipeline.testing.fakes import client_error
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.cutover.status import Facts, ShardStatus, assess
from ddb2bt.transforms.errors import ConfigError, PermanentError
from ddb2bt.transforms.model import BackfillPosition, ChangeRecord, PartDone

HANDOFF = 1_700_000_123_456
# Long enough for three reader threads to start on a loaded machine.
BARRIER_TIMEOUT_S = 30
# How long an export's first part waits for a second one read beside it.
SECOND_PART_WAIT_S = 1.0


class FakeScan:
    """boto3 Scan over sorted keys, pages of ``page`` items; ``faults`` raise first."""

    def __init__(self, n, page):
        self.items = [{"pk": {"S": f"k{i:03d}"}, "v": {"N": str(i)}} for i in range(n)]
        self.page = page
        self.faults = []
        self.calls = []

    def scan(self, **kw):
        self.calls.append(kw)
        if self.faults:
            raise self.faults.pop(0)
        start = 0
        if "ExclusiveStartKey" in kw:
            start = [i["pk"] for i in self.items].index(kw["ExclusiveStartKey"]["pk"]) + 1
        chunk = self.items[start:start + self.page]
        out = {"Items": chunk, "ConsumedCapacity": {"CapacityUnits": 2.0}}
        if start + self.page < len(self.items):
            out["LastEvaluatedKey"] = {"pk": chunk[-1]["pk"]}
        return out


def readers(client, **kw):
    return PartReaders(ScanSource("T", 1, page_limit=client.page, **kw), ("pk",), HANDOFF, client,
                       retry=RetryPolicy(0.001, 0.001, 2.0))


def test_scan_records_are_backfill_inserts_just_before_the_handoff_second():
    out = list(readers(FakeScan(5, 2)).read(segment_name(0, 1), None, 0))
    records = [e for e in out if isinstance(e, ChangeRecord)]
    assert len(records) == 5 and isinstance(out[-1], PartDone) and out[-1].count == 5
    assert {r.change_ms for r in records} == {1_700_000_122_999}
    assert {r.backfill_since_ms for r in records} == {1_700_000_123_000}
    assert all(r.event_name == "INSERT" and r.old_image is None for r in records)


@pytest.mark.parametrize("page", [2, 100])  # 100: the whole segment in one page
def test_every_item_resumes_right_after_itself(page):
    """A restart after any written item re-reads nothing written and skips
    nothing, even inside a page: the item's key is the ExclusiveStartKey."""
    out = [e for e in readers(FakeScan(5, page)).read(segment_name(0, 1), None, 0) if isinstance(e, ChangeRecord)]
    positions = [r.position for r in out]
    assert [json.loads(p.resume) for p in positions] == [{"pk": {"S": f"k{i:03d}"}} for i in range(5)]
    assert [p.count for p in positions] == [1, 2, 3, 4, 5]
    for written in range(5):
        resumed = [e for e in readers(FakeScan(5, page)).read(segment_name(0, 1), positions[written].resume,
                                                              positions[written].count)]
        assert [r.keys["pk"]["S"] for r in resumed if isinstance(r, ChangeRecord)] == \
            [f"k{i:03d}" for i in range(written + 1, 5)]
        assert resumed[-1].count == 5  # PartDone counts every item once


def test_scan_backs_off_on_throughput_exceeded():
    client = FakeScan(3, 10)
    client.faults = [client_error("ProvisionedThroughputExceededException", operation="Scan")] * 2
    out = list(readers(client).read(segment_name(0, 1), None, 0))
    assert len(out) == 4 and len(client.calls) == 3


def test_token_bucket_holds_the_average_rate():
    clock = [0.0]
    slept = []

    def sleep(s):
        slept.append(s)
        clock[0] += s

    bucket = TokenBucket(10.0, clock=lambda: clock[0], sleep=sleep)
    for _ in range(20):
        bucket.consume(5.0)  # 100 units at 10/s: about 9 s of waiting after the first burst
    assert 8.5 <= sum(slept) <= 10.5
    TokenBucket(None).consume(1e9)  # no budget: never waits


def test_segments_and_tasks():
    assert parse_segment(segment_name(3, 16)) == (3, 16)
    tasks = plan_tasks([segment_name(i, 8) for i in range(8)], 3)
    assert sorted(p for t in tasks for p in t.parts) == sorted(segment_name(i, 8) for i in range(8))
    assert len(tasks) == 3


def write_export(root, lines, summary=None):
    (root / "data").mkdir(parents=True)
    with gzip.open(root / "data" / "a.json.gz", "wt") as fh:
        fh.write("\n".join(lines) + "\n")
    (root / "manifest-files.json").write_text(json.dumps({"dataFileS3Key": "AWSDynamoDB/x/data/a.json.gz"}) + "\n")
    (root / "manifest-summary.json").write_text(json.dumps(summary or {"exportTime": "2023-09-10T15:21:48.123Z",
                                                                       "itemCount": len(lines)}))


def test_export_reading_resume_and_handoff(tmp_path):
    lines = [json.dumps({"Item": {"pk": {"S": f"k{i}"}, "b": {"B": "AAE="}}}) for i in range(4)]
    write_export(tmp_path, lines)
    src = ExportSource(str(tmp_path))
    assert src.parts() == ["data/a.json.gz"] and src.item_count() == 4
    assert src.export_time_ms() == 1694359308123
    r = PartReaders(src, ("pk",), src.export_time_ms())
    out = list(r.read("data/a.json.gz", "2", 2))
    assert [e.keys["pk"]["S"] for e in out if isinstance(e, ChangeRecord)] == ["k2", "k3"]
    assert out[0].new_image["b"] == {"B": b"\x00\x01"}  # base64 in the file, raw bytes in the record
    assert out[0].position == BackfillPosition("export", "data/a.json.gz", "3", 3)


def test_bad_export_line_and_missing_manifest_are_clear_errors(tmp_path):
    write_export(tmp_path / "bad", ['{"NotItem": 1}'])
    with pytest.raises(PermanentError, match="line 1: not a DynamoDB JSON export line"):
        list(PartReaders(ExportSource(str(tmp_path / "bad")), ("pk",), 0).read("data/a.json.gz", None, 0))
    with pytest.raises(ConfigError, match="no manifest-summary.json"):
        ExportSource(str(tmp_path / "nowhere")).summary()


def test_export_lines_decode_as_json_loads_decodes_their_bytes():
    """Export lines are decoded as UTF-8 without detecting the encoding per line:
    the same items json.loads gives for the bytes (non-ASCII text, a lone
    surrogate written with surrogatepass, escapes), and the same refusals."""
    import json

    from ddb2bt.pipeline.source.exports import dynamodb_json_items
    from ddb2bt.transforms.attrs import item_from_dynamodb_json

    lines = [json.dumps({"Item": {"pk": {"S": "é☃"}, "n": {"N": "1"}}}, ensure_ascii=False).encode("utf-8"),
             b'{"Item": {"pk": {"S": "\\u00e9\\ud83d\\ude00"}}}',
             b'{"Item": {"pk": {"S": "\\ud800"}}}',
             '{"Item": {"pk": {"S": "x\ud800y"}}}'.encode("utf-8", "surrogatepass"),
             b"\xef\xbb\xbf" + b'{"Item": {"pk": {"S": "bom"}}}',  # a byte-order mark, dropped
             b"", b"   \n"]
    got = list(dynamodb_json_items(iter(lines), "data/a.json.gz"))
    assert got == [item_from_dynamodb_json(json.loads(raw)["Item"]) for raw in lines if raw.strip()]
    assert got[0]["pk"] == {"S": "é☃"} and got[3]["pk"] == {"S": "x\ud800y"}
    for bad in (b"\xff{}", b'{"Item": ', b"[]"):
        with pytest.raises(PermanentError, match="line 1: not a DynamoDB JSON export line"):
            list(dynamodb_json_items(iter([bad]), "data/a.json.gz"))


def facts(**kw):
    base = dict(now_ms=10**13, phase="LIVE", handoff_ms=1, backfill_parts=4, backfill_done_parts=4,
                backfill_items=100, backfill_expected=100, backfill_done_ms=5, tail_held=True,
                last_verify={"identical": True, "sampled": False, "checked_at_ms": 10},
                shards=[ShardStatus("s", "1", False, None, 10**13 - 1_000, False, 1_000)])
    base.update(kw)
    return Facts(**base)


def test_ready_only_when_everything_holds():
    assert assess(facts()) == (True, [])
    cases = {
        "backfill running": facts(phase="BACKFILLING", backfill_done_parts=1),
        "catching up": facts(phase="CATCHING_UP"),
        "shard(s) behind": facts(shards=[ShardStatus("s", "1", False, 10**13 - 120_000, None)]),
        "retention headroom": facts(shards=[ShardStatus("s", "1", False, 10**13 - 20 * 3600_000, None)]),
        "dead letter": facts(dead_letters=2),
        "could be listed now (no stream described)": facts(shards=[]),
        "never verified": facts(last_verify=None),
        "found differences": facts(last_verify={"identical": False}),
        "was sampled": facts(last_verify={"identical": True, "sampled": True, "checked_at_ms": 10}),
        "older than the end of the backfill": facts(backfill_done_ms=20),
        "the tail is not running": facts(tail_held=False),
        "without a report from a running reader": facts(shards=[ShardStatus("s", "1", False, None, None,
                                                                          reported_ago_ms=80_000)]),
    }
    for fragment, f in cases.items():
        ready, reasons = assess(f)
        assert not ready and any(fragment in r for r in reasons), (fragment, reasons)


def test_the_backfill_reader_emits_batches_and_a_part_done_after_its_records(tmp_path, monkeypatch):
    import ddb2bt.pipeline.cutover.backfill as backfill
    from ddb2bt.pipeline.cutover.backfill import BackfillJob, BackfillTask, _ReadBackfillFn
    from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
    from ddb2bt.pipeline.observe.metrics import PipelineMetrics
    from ddb2bt.pipeline.control.state import StateStore
    from prometheus_client import CollectorRegistry
    from ddb2bt.transforms.model import RecordBatch

    monkeypatch.setattr("ddb2bt.pipeline.source.records.BATCH_RECORDS", 3)
    monkeypatch.setattr(backfill, "default_metrics", lambda: PipelineMetrics(CollectorRegistry()))
    lines = [json.dumps({"Item": {"pk": {"S": f"k{i}"}}}) for i in range(7)]
    write_export(tmp_path, lines)
    state = StateStore(InMemoryBigtable(), "job", lambda: 1)
    fn = _ReadBackfillFn(BackfillJob(ExportSource(str(tmp_path)), ("pk",), HANDOFF), lambda: state)
    fn.setup()
    out = list(fn.process(BackfillTask(("data/a.json.gz",))))
    assert isinstance(out[-1], PartDone) and out[-1].count == 7
    batches = out[:-1]
    assert all(isinstance(b, RecordBatch) and 1 <= len(b.records) <= 3 for b in batches)
    assert [r.keys["pk"]["S"] for b in batches for r in b.records] == [f"k{i}" for i in range(7)]


def test_readers_hand_over_chunks_and_a_pages_last_chunk_before_the_next_page(monkeypatch):
    """A reader thread passes records in chunks (one queue operation each); a
    page's records are all handed over before the next page is requested, so the
    writer never waits on a Scan call for records already read."""
    import ddb2bt.pipeline.cutover.backfill as backfill

    monkeypatch.setattr(backfill, "CHUNK_ITEMS", 3)
    client = FakeScan(11, 5)
    chunks = []
    for chunk in readers(client).read_chunks(segment_name(0, 1), None, 0):
        chunks.append(([e.keys["pk"]["S"] if isinstance(e, ChangeRecord) else e for e in chunk], len(client.calls)))
    assert [(len(c), calls) for c, calls in chunks] == [(3, 1), (2, 1), (3, 2), (2, 2), (1, 3), (1, 3)]
    assert [k for c, _ in chunks[:-1] for k in c] == [f"k{i:03d}" for i in range(11)]
    assert chunks[-1][0] == [PartDone("scan", segment_name(0, 1), 11)]


def test_export_chunks_keep_file_order_and_resume(tmp_path, monkeypatch):
    import ddb2bt.pipeline.cutover.backfill as backfill

    monkeypatch.setattr(backfill, "CHUNK_ITEMS", 4)
    write_export(tmp_path, [json.dumps({"Item": {"pk": {"S": f"k{i}"}}}) for i in range(10)])
    reader = PartReaders(ExportSource(str(tmp_path)), ("pk",), HANDOFF)
    chunks = list(reader.read_chunks("data/a.json.gz", "3", 3))
    assert [len(c) for c in chunks] == [4, 3, 1]
    assert [r.position.resume for c in chunks[:-1] for r in c] == [str(i) for i in range(4, 11)]
    assert chunks[-1] == [PartDone("export", "data/a.json.gz", 10)]


@pytest.mark.parametrize("key", [
    {"pk": {"S": "a\"é"}, "sk": {"N": "-1.5E+3"}},
    {"sk": {"S": "x"}, "pk": {"S": "y"}},
    {"pk": {"B": b"\x00\xff"}, "sk": {"S": "x"}},  # B: base64 in the token, as DynamoDB JSON has it
])
def test_resume_tokens_are_dynamodb_json_and_round_trip(key):
    from ddb2bt.pipeline.cutover.backfill import _token, _untoken
    from ddb2bt.transforms.attrs import item_to_dynamodb_json

    assert _token(key) == json.dumps(item_to_dynamodb_json(key), sort_keys=True)
    assert _untoken(_token(key)) == key


def test_items_before_a_damaged_export_line_are_still_handed_over(tmp_path, monkeypatch):
    import ddb2bt.pipeline.cutover.backfill as backfill

    monkeypatch.setattr(backfill, "CHUNK_ITEMS", 4)
    write_export(tmp_path, [json.dumps({"Item": {"pk": {"S": f"k{i}"}}}) for i in range(6)] + ["{not json"])
    chunks = []
    with pytest.raises(PermanentError, match="line 7"):
        for chunk in PartReaders(ExportSource(str(tmp_path)), ("pk",), HANDOFF).read_chunks("data/a.json.gz", None, 0):
            chunks.append(chunk)
    assert [r.keys["pk"]["S"] for c in chunks for r in c] == [f"k{i}" for i in range(6)]


def test_the_handoff_scan_is_strongly_consistent_by_default():
    """An eventually consistent Scan may miss a delete completed just before the
    handoff and write the item back at T - 1 ms (docs/design.md §6.6): the
    backfill's Scan, the controller's options and the CLI default to a
    strongly consistent one; --no-consistent-read is the explicit opt-out."""
    from ddb2bt.pipeline.app.cli import build_parser
    from ddb2bt.pipeline.cutover.controller import BackfillOptions

    client = FakeScan(3, 10)
    list(PartReaders(ScanSource("T", 1), ("pk",), HANDOFF, client, retry=RetryPolicy(0.001, 0.001, 2.0))
         .read(segment_name(0, 1), None, 0))
    assert client.calls and all(call["ConsistentRead"] is True for call in client.calls)
    assert BackfillOptions().consistent_read is True
    parser = build_parser()
    for command in ("backfill", "migrate"):
        assert parser.parse_args([command, "-m", "m.yaml"]).consistent_read is True
        assert parser.parse_args([command, "-m", "m.yaml", "--no-consistent-read"]).consistent_read is False


def test_a_throttled_scan_stops_retrying_once_the_lease_is_lost():
    """The backfill's Scan retries run its job coordinator's lease check between
    attempts: a backfill whose lease was taken over is not left throttled in a
    retry loop until its deadline."""
    from ddb2bt.pipeline.control.lease import LeaseLost

    client = FakeScan(5, 2)
    client.faults = [client_error("ProvisionedThroughputExceededException", operation="Scan")] * 50

    def lost():
        raise LeaseLost("job j: the backfill lease was taken over")

    reader = PartReaders(ScanSource("T", 1, page_limit=2), ("pk",), HANDOFF, client,
                         retry=RetryPolicy(0.001, 0.001, 60.0), between_attempts=lost)
    with pytest.raises(LeaseLost):
        list(reader.read(segment_name(0, 1), None, 0))
    assert len(client.calls) == 1


def _reading_fn(monkeypatch, source, read_chunks):
    """A _ReadBackfillFn over ``source`` whose parts are read by ``read_chunks``."""
    import ddb2bt.pipeline.cutover.backfill as backfill
    from ddb2bt.pipeline.cutover.backfill import BackfillJob, _ReadBackfillFn
    from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
    from ddb2bt.pipeline.observe.metrics import PipelineMetrics
    from ddb2bt.pipeline.control.state import StateStore
    from prometheus_client import CollectorRegistry

    monkeypatch.setattr(backfill, "default_metrics", lambda: PipelineMetrics(CollectorRegistry()))
    monkeypatch.setattr(PartReaders, "read_chunks", read_chunks)
    state = StateStore(InMemoryBigtable(), "job", lambda: 1)
    fn = _ReadBackfillFn(BackfillJob(source, ("pk",), HANDOFF), lambda: state)
    fn.setup()
    return fn


EXPORT_PARTS = ("data/a.json.gz", "data/b.json.gz", "data/c.json.gz")


def test_a_local_exports_parts_are_read_one_after_another(tmp_path, monkeypatch):
    """Reading a local export is only decoding, which holds the GIL: a second part
    decoded at once only slows the writer (LOCAL_EXPORT_THREADS)."""
    import threading

    from ddb2bt.pipeline.cutover.backfill import BackfillTask

    reading: list = []
    most = []
    second_started = threading.Event()

    def one_at_a_time(self, part, resume, count):
        reading.append(part)
        most.append(len(reading))
        if part == EXPORT_PARTS[0]:
            # The first part waits a while for another to start beside it
            # (with threads to spare, one does at once): none may.
            second_started.wait(timeout=SECOND_PART_WAIT_S)
        else:
            second_started.set()
        most.append(len(reading))
        yield [PartDone(EXPORT, part, 1)]
        reading.remove(part)

    fn = _reading_fn(monkeypatch, ExportSource(str(tmp_path)), one_at_a_time)
    out = list(fn.process(BackfillTask(EXPORT_PARTS)))
    assert [e.part for e in out if isinstance(e, PartDone)] == list(EXPORT_PARTS)
    assert max(most) == 1


@pytest.mark.parametrize("source,kind,parts", [
    (ScanSource("T", 3), SCAN, tuple(segment_name(i, 3) for i in range(3))),
    (ExportSource("s3://bucket/AWSDynamoDB/01700000000000-abcd"), EXPORT, EXPORT_PARTS),
], ids=["scan segments", "s3 export parts"])
def test_parts_read_over_the_network_are_read_at_once(source, kind, parts, monkeypatch):
    """A Scan segment's pages and an S3 object's first byte are network round trips:
    a task's parts are read at once (a barrier all of them must reach, or it breaks)."""
    import threading

    from ddb2bt.pipeline.cutover.backfill import BackfillTask

    met = threading.Barrier(len(parts), timeout=BARRIER_TIMEOUT_S)

    def all_at_once(self, part, resume, count):
        met.wait()  # BrokenBarrierError (raised by the reader) unless every part is being read
        yield [PartDone(kind, part, 0)]

    fn = _reading_fn(monkeypatch, source, all_at_once)
    out = list(fn.process(BackfillTask(parts)))
    assert sorted(e.part for e in out if isinstance(e, PartDone)) == sorted(parts)
