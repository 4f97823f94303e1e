"""Production on Dataflow: option checks before launch, mappings from GCS, and
the job-graph checks (streaming type, stable step names, no shuffle on the
ordered path) used by the tests and by `--dry_run=True` launches.

On Dataflow the mapping is read once, by the launcher, and travels inside the
pickled DoFns (it is never read from a local path on a worker); hooks
(`module:function`) must be importable there, i.e. installed in the image.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional

from ddb2bt.transforms.errors import ConfigError

_PROJECT = re.compile(r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$")
_REGION = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")
_GCS = re.compile(r"^gs://[a-z0-9][-_.a-z0-9]{1,221}[a-z0-9](/.*)?$")
SHUFFLE_URNS = ("beam:transform:group_by_key:v1", "beam:transform:reshuffle:v1",
                "beam:transform:combine_per_key:v1", "beam:transform:redistribute_arbitrarily:v1",
                "beam:transform:redistribute_by_key:v1")


def is_dry_run(beam_args: list) -> bool:
    return any(a in ("--dry_run", "--dry_run=True", "--dry_run=true") for a in beam_args)


def option_value(args: list, name: str) -> Optional[str]:
    for i, arg in enumerate(args):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(args):
            return args[i + 1]
    return None


def validate_options(beam_args: list) -> None:
    """Fail before launch, naming the option, instead of minutes later in the service."""
    project = option_value(beam_args, "project")
    region = option_value(beam_args, "region")
    temp = option_value(beam_args, "temp_location")
    staging = option_value(beam_args, "staging_location")
    if not project:
        raise ConfigError("is required on Dataflow (the GCP project that runs the job)", "--project")
    if not _PROJECT.match(project):
        raise ConfigError(f"{project!r} is not a GCP project id (6-30 lowercase letters, digits, hyphens)",
                          "--project")
    if not region:
        raise ConfigError("is required on Dataflow, e.g. --region=us-central1 (put it near the Bigtable cluster)",
                          "--region")
    if not _REGION.match(region):
        raise ConfigError(f"{region!r} is not a region like us-central1", "--region")
    if not temp:
        raise ConfigError("is required on Dataflow: a gs:// path for temporary files", "--temp_location")
    for name, value in (("--temp_location", temp), ("--staging_location", staging)):
        if value is not None and not _GCS.match(value):
            raise ConfigError(f"{value!r} must be a gs://bucket/path", name)


def read_text(path: str) -> str:
    """A local file or a gs:// object (through Beam's filesystems)."""
    if path.startswith("gs://"):
        from apache_beam.io.filesystems import FileSystems

        try:
            with FileSystems.open(path) as fh:
                return fh.read().decode("utf-8")
        except Exception as exc:  # the message names the path and the cause
            raise ConfigError(f"cannot read {path}: {exc}", "--mapping") from None
    with open(path, encoding="utf-8") as fh:
        return fh.read()


# --- job-graph checks -----------------------------------------------------------


@dataclass(frozen=True)
class GraphFacts:
    streaming: bool
    transforms: tuple  # unique names of every transform
    ordered_path_shuffles: tuple  # shuffle transforms between the read and the write
    steps: frozenset = frozenset()  # every label on any transform's path (composites nest theirs)
    # unique names of splittable DoFns (a ParDo with a restriction coder): what a
    # runner can checkpoint, split, drain and update mid-element
    splittable: tuple = ()


def _leaf_graph(pipeline_proto) -> tuple:
    transforms = pipeline_proto.components.transforms
    leaves = {tid: t for tid, t in transforms.items() if not t.subtransforms}
    consumers: dict = {}
    for tid, t in leaves.items():
        for pc in t.inputs.values():
            consumers.setdefault(pc, []).append(tid)
    return leaves, consumers


def _is_step(unique_name: str, step: str) -> bool:
    """Whether a transform is ``step`` or inside it: composites nest their steps
    (``ReplicateToBigtable/ReadDynamoDBStream/ReadStream/...``)."""
    return any(part.startswith(step) for part in unique_name.split("/"))


def shuffles_between(pipeline_proto, read_prefix: str, write_prefix: str) -> list:
    """Unique names of shuffle transforms on any path from the read's outputs to
    the write (the ordered path must have none)."""
    leaves, consumers = _leaf_graph(pipeline_proto)
    start = [tid for tid, t in leaves.items() if _is_step(t.unique_name, read_prefix)]
    seen, stack, found = set(), list(start), []
    while stack:
        tid = stack.pop()
        if tid in seen:
            continue
        seen.add(tid)
        t = leaves[tid]
        if _is_step(t.unique_name, write_prefix):
            continue
        if t.spec.urn in SHUFFLE_URNS and not _is_step(t.unique_name, read_prefix):
            found.append(t.unique_name)
        for pc in t.outputs.values():
            stack.extend(consumers.get(pc, []))
    reached = any(_is_step(leaves[t].unique_name, write_prefix) for t in seen)
    if not reached:
        raise AssertionError(f"no path from {read_prefix} to {write_prefix} in the job graph")
    return found


def graph_facts(job, paths: Iterable = ()) -> GraphFacts:
    """``job``: the Job returned by a DataflowRunner (``result.job``), dry run or not."""
    proto = job.proto_pipeline
    names = tuple(sorted(t.unique_name for t in proto.components.transforms.values()))
    shuffles = []
    for read, write in paths:
        shuffles += shuffles_between(proto, read, write)
    steps = frozenset(part for name in names for part in name.split("/"))
    return GraphFacts(streaming=job.proto.type == 2, transforms=names, ordered_path_shuffles=tuple(shuffles),
                      steps=steps, splittable=splittable_dofns(proto))


PARDO_URN = "beam:transform:pardo:v1"


def splittable_dofns(pipeline_proto) -> tuple:
    """Unique names of the ParDos that are splittable DoFns (their payload names
    a restriction coder)."""
    from apache_beam.portability.api import beam_runner_api_pb2

    found = []
    for t in pipeline_proto.components.transforms.values():
        if t.spec.urn != PARDO_URN:
            continue
        payload = beam_runner_api_pb2.ParDoPayload.FromString(t.spec.payload)
        if payload.restriction_coder_id:
            found.append(t.unique_name)
    return tuple(sorted(found))
