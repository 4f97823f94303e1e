"""Scrape /metrics during a real run on the emulators."""
from __future__ import annotations

import re
import threading
import time
import urllib.request

import pytest

from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.connect.connections import StreamsClientFactory, dynamodb_client
from tests.conftest import write_mapping
from ddb2bt.transforms.config import load_mapping

pytestmark = pytest.mark.e2e
SAMPLE = re.compile(r'^(ddb2bt_[a-z_]+)(\{[^}]*\})? (\S+)$', re.M)


def scrape(port: int) -> list:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return SAMPLE.findall(resp.read().decode())


def total(samples, name, **labels) -> float:
    out = 0.0
    for n, lab, value in samples:
        if n == name and all(f'{k}="{v}"' in lab for k, v in labels.items()):
            out += float(value)
    return out


def stream_records(arn: str) -> int:
    client = StreamsClientFactory()()
    count = 0
    for shard in client.describe_stream(StreamArn=arn)["StreamDescription"]["Shards"]:
        it = client.get_shard_iterator(StreamArn=arn, ShardId=shard["ShardId"],
                                       ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
        while it:
            page = client.get_records(ShardIterator=it, Limit=1000)
            count += len(page["Records"])
            if not page["Records"]:
                break
            it = page.get("NextShardIterator")
    return count


def test_scraped_metrics_tell_the_truth(stack, tmp_path, unique):
    from ddb2bt.pipeline.local.local_stack import free_port

    path = write_mapping(tmp_path, source__table=f"Metrics_{unique}", target__table=f"metrics_{unique}",
                         name=f"metrics_{unique}")
    mapping = load_mapping(path)
    ddb = dynamodb_client()
    arn = workload.create_table(ddb, mapping.source.table)
    assert ddb2bt(["create-table", "--mapping", str(path)]) == 0
    table = mapping.source.table
    # a backlog written before the pipeline starts: it begins behind
    for op in workload.operations(21, 400, 80):
        workload.apply_quietly(ddb, table, op)
    ddb.put_item(TableName=table, Item={"pk": {"S": "#" * 2000}, "sk": {"S": "x" * 200},
                                        "Price": {"N": "1"}})  # a dead letter: key > 4 KiB once escaped
    time.sleep(3.0)
    port = free_port()
    before = {}
    done = threading.Event()
    result = []

    def run():
        result.append(ddb2bt(["run", "--mapping", str(path), "--until-idle", "3", "--poll-interval", "0.2",
                              "--metrics-port", str(port)]))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    max_lag = 0.0
    while not done.is_set():
        try:
            samples = scrape(port)
        except OSError:
            time.sleep(0.05)
            continue
        if not before:
            before = {"applied": total(samples, "ddb2bt_changes_applied_total"),
                      "read": total(samples, "ddb2bt_changes_read_total"),
                      "skipped": total(samples, "ddb2bt_changes_skipped_total"),
                      "dead": total(samples, "ddb2bt_dead_letters_total")}
        lag = total(samples, "ddb2bt_replication_lag_seconds")
        max_lag = max(max_lag, lag)
        time.sleep(0.1)
    assert result == [0]
    # the metrics server outlives the run in this process: scrape the final state
    final = scrape(port)
    records = stream_records(arn)
    read = total(final, "ddb2bt_changes_read_total") - before["read"]
    applied = total(final, "ddb2bt_changes_applied_total") - before["applied"]
    skipped = total(final, "ddb2bt_changes_skipped_total") - before["skipped"]
    dead = total(final, "ddb2bt_dead_letters_total") - before["dead"]
    assert read == records  # every stream record counted once
    assert applied + skipped + dead == read  # and accounted for
    assert total(final, "ddb2bt_dead_letters_total", reason="row_key_too_long", stage="map") >= 1
    assert max_lag >= 2.5, "the backlog was written ≥3 s before the start: lag must show it"
    stream_label = arn.split(":table/", 1)[1]
    assert total(final, "ddb2bt_replication_lag_seconds", stream=stream_label) == 0.0  # caught up
    headroom = total(final, "ddb2bt_retention_headroom_seconds", stream=stream_label)
    assert 0 < headroom <= 24 * 3600
    assert total(final, "ddb2bt_end_to_end_lag_seconds_count") >= applied
    assert any(n == "ddb2bt_build_info" for n, _, _ in final)
