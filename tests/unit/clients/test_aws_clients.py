"""Worker-side AWS clients (docs/design.md §4.1's readers, the backfill's Scan and
export reads) are made in DoFn ``setup()``, which Dataflow runs for several DoFns
of one process at once: each client comes from a boto3 Session of its own, never
from boto3's module-level default session, which is not thread-safe
(boto/boto3#1592, #2750)."""
from __future__ import annotations

import threading

import boto3
import pytest

from ddb2bt.pipeline.connect.connections import DynamoDBClientFactory, StreamsClientFactory, dynamodb_client
from ddb2bt.pipeline.source.snapshot import ExportSource
from ddb2bt.pipeline.source.kinesis import KinesisClientFactory

REGION = "us-east-1"
FACTORIES = {
    "dynamodbstreams": lambda: StreamsClientFactory(REGION)(),
    "dynamodb (backfill Scan)": lambda: DynamoDBClientFactory(REGION)(),
    "dynamodb (commands)": lambda: dynamodb_client(REGION),
    "kinesis": lambda: KinesisClientFactory("cdc", "T", REGION)()._k,
    "s3 (export)": lambda: ExportSource("s3://bucket/export", REGION)._s3(),
}


@pytest.fixture
def no_default_session(monkeypatch):
    def shared(*args, **kwargs):
        raise AssertionError("boto3's shared default session was used")

    for name in ("client", "resource", "setup_default_session", "_get_default_session"):
        monkeypatch.setattr(boto3, name, shared)


@pytest.mark.parametrize("service", sorted(FACTORIES))
def test_each_client_comes_from_a_session_of_its_own(no_default_session, service):
    client = FACTORIES[service]()
    assert client.meta.region_name == REGION


def test_clients_made_at_once_on_many_threads_all_succeed(no_default_session):
    made, failed = [], []

    def make(factory):
        try:
            made.append(factory())
        except Exception as exc:  # collected: the assertion below names it
            failed.append(exc)

    threads = [threading.Thread(target=make, args=(f,)) for f in list(FACTORIES.values()) * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failed and len(made) == len(threads)


def test_a_client_made_after_another_parses_no_data_file_again(no_default_session, monkeypatch):
    """Each Session parsing botocore's data files afresh cost ~80 ms of CPU per
    client (thousands of clients in the test suite; one per DoFn setup on a
    worker): the parsed files are shared by every Session of the process."""
    import botocore.loaders

    for factory in FACTORIES.values():
        factory()

    def parse(*args, **kwargs):
        raise AssertionError("a data file was parsed again")

    monkeypatch.setattr(botocore.loaders.JSONFileLoader, "load_file", parse)
    for name, factory in FACTORIES.items():
        assert factory().meta.region_name == REGION, name
