"""Picklable descriptions of the services a worker connects to. DoFns receive
these and create the clients in ``setup()`` (on the worker, once per DoFn
instance), never at pipeline construction; credentials never travel in them —
workers use their own environment (ADC for Google, the default AWS chain)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
from ddb2bt.pipeline.control.state import DEFAULT_STATE_TABLE, BigtableStateBackend, StateStore
from ddb2bt.pipeline.clients.dynamodb import STREAMS_CONNECT_TIMEOUT_S, STREAMS_READ_TIMEOUT_S, count_calls_with
from ddb2bt.pipeline.observe.metrics import count_aws_call


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
    # The app profile of the state table, the job lease, version claims and the
    # backfill's conditional rows (--state-app-profile): CheckAndMutateRow needs
    # single-cluster routing with single-row transactions, which a replicated
    # instance's HA (multi-cluster) profile refuses. None: ``app_profile``.
    state_app_profile: Optional[str] = None

    @property
    def state_profile(self) -> Optional[str]:
        return self.state_app_profile or self.app_profile

    def writer(self) -> GrpcMutationWriter:
        """The data path's writer: plain writes through ``app_profile``,
        conditional work through ``state_profile``."""
        return GrpcMutationWriter(self.project, self.instance, self.app_profile, interceptors=self.interceptors,
                                  transactional_app_profile=self.state_app_profile)

    def state_writer(self, timeout_s: Optional[float] = None) -> GrpcMutationWriter:
        """A writer for the state table and the lease: everything through ``state_profile``."""
        extra = {} if timeout_s is None else {"timeout_s": timeout_s}
        return GrpcMutationWriter(self.project, self.instance, self.state_profile, interceptors=self.interceptors,
                                  **extra)


@dataclass(frozen=True)
class StateSpec:
    bigtable: BigtableSpec
    job: str
    table: str = DEFAULT_STATE_TABLE
    include_values: bool = True

    def store(self, writer=None) -> StateStore:
        backend = BigtableStateBackend(writer or self.bigtable.state_writer(), self.bigtable.project,
                                       self.bigtable.instance, self.table, self.bigtable.deadline_s,
                                       app_profile=self.bigtable.state_profile, owns_writer=writer is None)
        return StateStore(backend, self.job, wall_ms, self.include_values)

    __call__ = store  # a StateSpec is its own factory


# botocore's parsed data files (the endpoints, each service's API model), shared
# by every Session of this process: parsed afresh for each Session they cost ~80 ms
# of CPU per client (a client per DoFn setup, per command, per probe). They are
# read-only once parsed (botocore itself shares them between one Session's
# clients); two threads loading one at once parse it twice, harmlessly.
_PARSED_DATA: dict = {}


def aws_client(service: str, **kwargs):
    """A boto3 client from a Session of its own. boto3's module-level default
    session is not thread-safe (boto/boto3#1592, #2750: "'NoneType' has no
    attribute ..." or a KeyError while it loads its data), and Dataflow runs
    several DoFn ``setup()``s of one worker process at once; a session per call
    shares nothing mutable between them, only the parsed data files
    (_PARSED_DATA). Credentials still come from the default AWS chain (each
    session resolves it). The DynamoDB client module is handed the process's
    call counter here, where every AWS client is made: the clients floor
    imports no metrics (``ddb2bt_aws_api_calls_total``)."""
    count_calls_with(count_aws_call)
    import boto3
    import botocore.loaders
    import botocore.session

    core = botocore.session.get_session()
    loader = botocore.loaders.create_loader(core.get_config_variable("data_path"))  # as botocore makes it
    loader._cache = _PARSED_DATA  # the dict botocore's loader memoises its parsed files in (instance_cache)
    core.register_component("data_loader", loader)
    return boto3.session.Session(botocore_session=core).client(service, **kwargs)


@dataclass(frozen=True)
class StreamsClientFactory:
    """boto3 ``dynamodbstreams`` client; the endpoint comes from
    AWS_ENDPOINT_URL_DYNAMODBSTREAMS when set (the local stack sets it)."""

    region: Optional[str] = None

    def __call__(self):
        from botocore.config import Config

        # Retries are ours (one policy, counted in metrics): botocore's are off.
        # Timeouts sized to the calls (each answers in well under a second): a
        # request lost in a silent network partition fails, and is logged as a
        # WARNING naming the call and endpoint, within seconds, not after 30 s.
        config = Config(retries={"mode": "standard", "total_max_attempts": 1},
                        connect_timeout=STREAMS_CONNECT_TIMEOUT_S, read_timeout=STREAMS_READ_TIMEOUT_S)
        return aws_client("dynamodbstreams", region_name=self.region, config=config)


def honour_aws_region() -> None:
    """AWS_REGION as well as AWS_DEFAULT_REGION: boto3 reads only the latter,
    the other AWS SDKs and the CLI's users set the former. Taken when
    AWS_DEFAULT_REGION is not set, for every client this process makes."""
    if not os.environ.get("AWS_DEFAULT_REGION") and os.environ.get("AWS_REGION"):
        os.environ["AWS_DEFAULT_REGION"] = os.environ["AWS_REGION"]


def dynamodb_client(region: Optional[str] = None):
    from botocore.config import Config

    # Bounded: an unreachable endpoint fails a command in seconds (botocore's
    # defaults wait 60 s per connection attempt, five times).
    config = Config(retries={"mode": "standard", "max_attempts": 3}, connect_timeout=5, read_timeout=60)
    return aws_client("dynamodb", region_name=region, config=config)


@dataclass(frozen=True)
class DynamoDBClientFactory:
    """boto3 ``dynamodb`` client for the backfill's Scan (created on the worker)."""

    region: Optional[str] = None

    def __call__(self):
        from botocore.config import Config

        config = Config(retries={"mode": "standard", "total_max_attempts": 1}, connect_timeout=10, read_timeout=60)
        return aws_client("dynamodb", region_name=self.region, config=config)
