"""The fake DynamoDB Streams client keeps AWS's page limits (GetRecords: 1,000
records or 1 MB, whichever comes first), which the emulators do not all keep:
the readers and the paced benchmarks meet the same pages as on AWS."""
from __future__ import annotations

from ddb2bt.pipeline.testing.fakes import GET_RECORDS_MAX_BYTES, FakeStreamsClient
from ddb2bt.transforms.draft import item_size

KEYS = {"pk": {"S": "p"}, "sk": {"S": "s"}}


def _drain(client: FakeStreamsClient) -> list:
    it = client.get_shard_iterator(StreamArn=client.stream_arn, ShardId="s0",
                                   ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
    pages = []
    while it is not None:
        out = client.get_records(ShardIterator=it)
        if not out["Records"]:
            break
        pages.append(out["Records"])
        it = out.get("NextShardIterator")
    return pages


def _stream(values: list) -> FakeStreamsClient:
    client = FakeStreamsClient()
    client.add_shard("s0")
    for n, text in enumerate(values):
        image = dict(KEYS, Body={"S": text}, N={"N": str(n)})
        client.put("s0", "MODIFY", KEYS, image, image)
    client.close_shard("s0")
    return client


def test_a_page_ends_at_one_megabyte_of_records():
    record_text = "x" * 100_000  # two images of ~100 KB: ~200 KB a record, five to a megabyte
    pages = _drain(_stream([record_text] * 12))
    sizes = [[r["dynamodb"]["SizeBytes"] for r in page] for page in pages]
    assert [len(page) for page in pages] == [5, 5, 2]
    assert all(sum(page) <= GET_RECORDS_MAX_BYTES for page in sizes)
    assert all(sum(page) + nxt[0] > GET_RECORDS_MAX_BYTES for page, nxt in zip(sizes, sizes[1:]))
    first = pages[0][0]["dynamodb"]
    assert first["SizeBytes"] == item_size(first["Keys"]) + item_size(first["NewImage"]) + item_size(
        first["OldImage"])


def test_small_records_end_a_page_at_a_thousand_and_a_record_over_a_megabyte_has_a_page_of_its_own():
    assert [len(page) for page in _drain(_stream(["a"] * 2500))] == [1000, 1000, 500]
    huge = "y" * (GET_RECORDS_MAX_BYTES // 2 + 1)  # both images: over a megabyte
    assert [len(page) for page in _drain(_stream(["a", huge, "a"]))] == [1, 1, 1]
