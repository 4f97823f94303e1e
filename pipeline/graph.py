"""Building the Beam job graphs from the CLI's typed job options. The live graph
is ``ReplicateToBigtable`` (``ddb2bt.pipeline.io``):

  StreamPartitions (Create) → ReadStream (SDF) → MapChanges → WriteToBigtable

with no Reshuffle/GroupByKey after ReadStream: per-row order must survive from
the shard to the MutateRows call (docs/design.md §4.3).
"""
from __future__ import annotations

import atexit
import logging
import shutil
from typing import Sequence, Union

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from ddb2bt.pipeline.io import LiveJob, ReplicateToBigtable  # noqa: F401  (LiveJob: its old home)
from ddb2bt.pipeline.options import LOCAL_RUNNER_NAMES, joined_beam_args, runner_of, without_runner
from ddb2bt.pipeline.dataflow import validate_options

log = logging.getLogger(__name__)

LOCAL_RUNNERS = LOCAL_RUNNER_NAMES + (None,)  # no --runner: local


def add_live_replication(p: beam.Pipeline, jobs: Union[LiveJob, Sequence[LiveJob]]) -> beam.PCollection:
    """Add the live path of one table or several (one job) to ``p``
    (``ReplicateToBigtable``); returns the dead letters."""
    return p | "ReplicateToBigtable" >> ReplicateToBigtable.from_jobs([jobs] if isinstance(jobs, LiveJob) else jobs)


def local_runner():
    """The pure-Python FnApiRunner, chosen explicitly: the DirectRunner would first
    try to download the Prism binary (fails offline), and the old bundle-based
    runner cannot run unbounded splittable DoFns."""
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    return FnApiRunner()


def is_local(beam_args: list) -> bool:
    return runner_of(beam_args) in LOCAL_RUNNERS


def make_pipeline(beam_args: list, streaming: bool = True) -> beam.Pipeline:
    beam_args = joined_beam_args(beam_args)  # "--runner X" as "--runner=X": no value left behind below
    if is_local(beam_args):
        args = without_runner(beam_args)
        # One worker: the FnApiRunner corrupts keyed state with more, and the
        # stream's parallelism is the partitions, not the runner's threads.
        options = PipelineOptions(args + ["--direct_num_workers=1"], save_main_session=False)
        return _removing_tempdir(beam.Pipeline(runner=local_runner(), options=options))

    validate_options(beam_args)
    options = PipelineOptions(beam_args, streaming=streaming, save_main_session=False)
    return _removing_tempdir(beam.Pipeline(options=options))


def _removing_tempdir(p: beam.Pipeline) -> beam.Pipeline:
    """``p``, its temporary directory removed when this process exits at the
    latest: Beam makes one per pipeline and removes it only in ``run()``, so a
    command that fails while building its graph (a mapping refused there, say)
    would otherwise leave one in /tmp each time."""
    atexit.register(shutil.rmtree, p.local_tempdir, ignore_errors=True)
    return p


from ddb2bt.pipeline.dataflow import is_dry_run  # noqa: E402,F401  (its home: importable without Beam)
