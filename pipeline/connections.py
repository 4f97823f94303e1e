"""Picklable descriptions of the services a worker connects to. DoFns receive
these and create the clients in ``setup()`` (on the worker, once per DoFn
instance), never at pipeline construction; credentials never travel in them —
workers use their own environment (ADC for Google, the default AWS chain)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from ddb2bt.pipeline.sink.bigtable_io import GrpcMutationWriter
from ddb2bt.pipeline.state import DEFAULT_STATE_TABLE, BigtableStateBackend, StateStore


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class BigtableSpec:
    project: str
    instance: str
    app_profile: Optional[str] = None
    # gRPC client interceptors for the write channel (picklable: they travel to the
    # workers inside the DoFns). Tests pass the fault injector here.
    interceptors: tuple = ()
    # Give up on Bigtable calls that keep failing after this long (None: the
    # default, 300 s; read-only commands pass ~25 s).
    deadline_s: Optional[float] = None

    def writer(self) -> GrpcMutationWriter:
        return GrpcMutationWriter(self.project, self.instance, self.app_profile, interceptors=self.interceptors)


@dataclass(frozen=True)
class StateSpec:
    bigtable: BigtableSpec
    job: str
    table: str = DEFAULT_STATE_TABLE
    include_values: bool = True

    def store(self, writer=None) -> StateStore:
        backend = BigtableStateBackend(writer or self.bigtable.writer(), self.bigtable.project,
                                       self.bigtable.instance, self.table, self.bigtable.deadline_s)
        return StateStore(backend, self.job, wall_ms, self.include_values)

    __call__ = store  # a StateSpec is its own factory


@dataclass(frozen=True)
class StreamsClientFactory:
    """boto3 ``dynamodbstreams`` client; the endpoint comes from
    AWS_ENDPOINT_URL_DYNAMODBSTREAMS when set (the local stack sets it)."""

    region: Optional[str] = None

    def __call__(self):
        import boto3
        from botocore.config import Config

        # Retries are ours (one policy, counted in metrics): botocore's are off.
        config = Config(retries={"mode": "standard", "total_max_attempts": 1}, connect_timeout=10, read_timeout=30)
        return boto3.client("dynamodbstreams", region_name=self.region, config=config)


def dynamodb_client(region: Optional[str] = None):
    import boto3
    from botocore.config import Config

    # Bounded: an unreachable endpoint fails a command in seconds (botocore's
    # defaults wait 60 s per connection attempt, five times).
    config = Config(retries={"mode": "standard", "max_attempts": 3}, connect_timeout=5, read_timeout=60)
    return boto3.client("dynamodb", region_name=region, config=config)


@dataclass(frozen=True)
class DynamoDBClientFactory:
    """boto3 ``dynamodb`` client for the backfill's Scan (created on the worker)."""

    region: Optional[str] = None

    def __call__(self):
        import boto3
        from botocore.config import Config

        config = Config(retries={"mode": "standard", "total_max_attempts": 1}, connect_timeout=10, read_timeout=60)
        return boto3.client("dynamodb", region_name=self.region, config=config)
