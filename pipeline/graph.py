"""Building the Beam job graphs. Planning is plain functions; the graph is:

  StreamPartitions (Create) → ReadStream (SDF) → MapChanges → WriteToBigtable

with no Reshuffle/GroupByKey after ReadStream: per-row order must survive from
the shard to the MutateRows call (design notes §1).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from ddb2bt.transforms.config import MappingConfig
from ddb2bt.transforms.dofns import _MapChangesFn
from ddb2bt.transforms.model import StreamElement
import ddb2bt.pipeline.source.coders  # noqa: F401  (registers the StreamElement coder)
from ddb2bt.pipeline.connections import BigtableSpec, StateSpec, StreamsClientFactory
from ddb2bt.pipeline.sink.sink import SinkConfig, _WriteToBigtableFn
from ddb2bt.pipeline.source.stream_sdf import _ReadStreamPartitionsFn
from ddb2bt.pipeline.source.stream_source import ReaderOptions, StreamPartition

log = logging.getLogger(__name__)

LOCAL_RUNNERS = ("DirectRunner", "FnApiRunner", None)
STEP_PARTITIONS = "StreamPartitions"
STEP_READ = "ReadStream"
STEP_MAP = "MapChanges"
STEP_WRITE = "WriteToBigtable"


@dataclass(frozen=True)
class LiveJob:
    mapping: MappingConfig
    stream_arn: str
    reader: ReaderOptions
    state: StateSpec
    partitions: int = 1
    sink: SinkConfig = SinkConfig()
    client_factory: Callable = field(default_factory=StreamsClientFactory)
    marking: Optional[object] = None  # PhaseMarking during a migration: tail changes set touch markers
    pushgateway: Optional[str] = None  # workers push metrics here (Dataflow)


def add_live_replication(p: beam.Pipeline, job: LiveJob) -> beam.PCollection:
    """Add the live path to ``p``; returns the dead-letter PCollection."""
    bigtable = job.state.bigtable  # the state table's connection settings are the target's
    partitions = [StreamPartition(job.stream_arn, i, job.partitions) for i in range(job.partitions)]
    return (
        p
        | STEP_PARTITIONS >> beam.Create(partitions)
        | STEP_READ >> beam.ParDo(_ReadStreamPartitionsFn(job.reader, job.client_factory, job.state))
        .with_output_types(StreamElement)
        | STEP_MAP >> beam.ParDo(_MapChangesFn(job.mapping, marking=job.marking)).with_output_types(StreamElement)
        | STEP_WRITE >> beam.ParDo(_WriteToBigtableFn(bigtable, job.state, job.sink, pushgateway=job.pushgateway))
    )


def local_runner():
    """The pure-Python FnApiRunner, chosen explicitly: the DirectRunner would first
    try to download the Prism binary (fails offline), and the old bundle-based
    runner cannot run unbounded splittable DoFns."""
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    return FnApiRunner()


def is_local(beam_args: list) -> bool:
    runner = None
    for i, arg in enumerate(beam_args):
        if arg.startswith("--runner="):
            runner = arg.split("=", 1)[1]
        elif arg == "--runner" and i + 1 < len(beam_args):
            runner = beam_args[i + 1]
    return runner in LOCAL_RUNNERS


def make_pipeline(beam_args: list, streaming: bool = True) -> beam.Pipeline:
    if is_local(beam_args):
        args = [a for a in beam_args if not a.startswith("--runner")]
        # One worker: the FnApiRunner corrupts keyed state with more, and the
        # stream's parallelism is the partitions, not the runner's threads.
        options = PipelineOptions(args + ["--direct_num_workers=1"], save_main_session=False)
        return beam.Pipeline(runner=local_runner(), options=options)
    from ddb2bt.pipeline.dataflow import validate_options

    validate_options(beam_args)
    options = PipelineOptions(beam_args, streaming=streaming, save_main_session=False)
    return beam.Pipeline(options=options)


def is_dry_run(beam_args: list) -> bool:
    return any(a in ("--dry_run", "--dry_run=True", "--dry_run=true") for a in beam_args)
