"""Public composite transforms: DynamoDB Streams → Bigtable as Beam building blocks.

The one-liner::

    dead_letters = p | ReplicateToBigtable("mapping.yaml")

or the same stages composed with steps of your own::

    state = StateSpec(BigtableSpec(project, instance), job="orders")
    dead_letters = (
        p
        | ReadDynamoDBStream(stream_arn, state)             # RecordBatch | ShardClosed, per shard in order
        | TransformChanges(add_computed_attributes)         # your function of one ChangeRecord
        | MapToBigtable(mapping)                            # MappedBatch | ShardClosed
        | FilterChanges(lambda change: keep(change.keys))   # unkept changes write nothing
        | WriteToBigtableOrdered(state))                    # → DeadLetter

What passes between the stages is ``ddb2bt.transforms.model.StreamElement``
values: pages of changes in stream order and shard markers. Steps you add must
keep them as they are — one output per input, in order, on the same worker:
a Reshuffle, GroupByKey, window or a step that drops or reorders elements
between reading and writing breaks per-row order and the checkpoints
(docs/design.md §4.3, §6.1). ``TransformChanges`` and ``FilterChanges`` are the safe way
to change or drop changes: they keep every element's place and stream position.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import apache_beam as beam

import ddb2bt.pipeline.source.coders  # noqa: F401  (registers the StreamElement coder)
from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec, StreamsClientFactory, dynamodb_client
from ddb2bt.pipeline.clients.dynamodb import StreamArn
from ddb2bt.pipeline.sink.sink import SinkConfig, write_to_bigtable, write_to_bigtable_per_stream
from ddb2bt.pipeline.source.stream_sdf import StreamSource, read_stream_partitions
from ddb2bt.pipeline.source.stream_source import ReaderOptions, StreamPartition
from ddb2bt.transforms.config import MappingConfig, check_distinct_tables, load_mapping
from ddb2bt.transforms.dofns import map_changes, map_changes_per_stream
from ddb2bt.transforms.model import ChangeRecord, MappedBatch, MappedChange, RecordBatch, StreamElement
from ddb2bt.pipeline.clients.bigtable.admin import ensure_mapping_table
from ddb2bt.pipeline.connect.preflight import ensure_state_table, resolve_stream
from ddb2bt.pipeline.local.examples import resolve_mapping_path

__all__ = [
    "ReadDynamoDBStream", "TransformChanges", "MapToBigtable", "FilterChanges", "WriteToBigtableOrdered",
    "ReplicateToBigtable", "LiveJob", "load_mapping_arg", "prepare_target",
]

# Step labels inside the composites; the ordered-path checks look for them.
STEP_PARTITIONS = "StreamPartitions"
STEP_READ = "ReadStream"
STEP_MAP = "MapChanges"
STEP_WRITE = "WriteToBigtable"
MappingArg = Union[MappingConfig, str, Path]


@dataclass(frozen=True)
class LiveJob:
    """One table's live replication, fully resolved (what the CLI builds per
    mapping): the mapping, its stream, how to read it, where its state lives,
    how to write. A multi-table job is a tuple of these (``ReplicateToBigtable.from_jobs``)."""

    mapping: MappingConfig
    stream_arn: str
    reader: ReaderOptions
    state: StateSpec
    partitions: int = 1
    sink: SinkConfig = SinkConfig()
    client_factory: Callable = field(default_factory=StreamsClientFactory)
    marking: Optional[object] = None  # PhaseMarking during a migration: tail changes set touch markers
    pushgateway: Optional[str] = None  # workers push metrics here (Dataflow)

    @property
    def name(self) -> str:
        return self.state.job


def _check_distinct(jobs: Sequence[LiveJob]) -> None:
    """A multi-table job refuses two tables sharing a stream, a state key or a
    target table (a ConfigError naming both)."""
    streams = [j.stream_arn for j in jobs]
    for i, arn in enumerate(streams):
        if arn and arn in streams[:i]:
            raise ValueError(f"mappings {jobs[streams.index(arn)].mapping.name!r} and {jobs[i].mapping.name!r} "
                             f"both read stream {arn}: one job reads each stream once")
    # Labels unique per job (a label equal to another's is taken for the same mapping).
    check_distinct_tables([j.mapping for j in jobs], [f"mapping {j.mapping.name!r} (#{i + 1})" for i, j in enumerate(jobs)],
                          [j.state.job for j in jobs])


def load_mapping_arg(mapping: MappingArg) -> MappingConfig:
    """A MappingConfig as given, or loaded from a file path or ``example:NAME``."""
    if isinstance(mapping, MappingConfig):
        return mapping
    if isinstance(mapping, (str, Path)):
        return load_mapping(resolve_mapping_path(str(mapping)))
    raise TypeError(f"mapping must be a MappingConfig or a path to a mapping file, got {type(mapping).__name__}")


def prepare_target(mapping: MappingArg, state: Optional[StateSpec] = None) -> MappingConfig:
    """Create (or complete) the mapping's Bigtable tables and the state table,
    as ``ddb2bt create-table`` does; run it once before building the graph.
    Returns the loaded mapping."""
    config = load_mapping_arg(mapping)
    ensure_mapping_table(config)
    spec = state or _default_state(config)
    ensure_state_table(spec.bigtable.project, spec.bigtable.instance, spec.table)
    return config


def _default_state(mapping: MappingConfig) -> StateSpec:
    target = mapping.target
    return StateSpec(BigtableSpec(target.project, target.instance, target.app_profile), job=mapping.name)


def _check_partitions(partitions) -> None:
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ValueError(f"partitions must be a whole number >= 1, got {partitions!r}")


def _check_state(state) -> StateSpec:
    if not isinstance(state, StateSpec):
        raise TypeError(f"state must be a StateSpec (where checkpoints and dead letters live), "
                        f"got {type(state).__name__}")
    return state


class ReadDynamoDBStream(beam.PTransform):
    """PBegin → unbounded PCollection of ``RecordBatch | ShardClosed``.

    Reads every shard of ``stream_arn`` (NEW_AND_OLD_IMAGES), parents before
    children, each shard sequentially by exactly one reader, resuming after the
    checkpoints in ``state`` (which ``WriteToBigtableOrdered`` advances once the
    writes they cover are acknowledged). ``partitions`` spreads the shards over
    that many elements (workers).
    """

    def __init__(self, stream_arn: str, state: StateSpec, *, reader: ReaderOptions = ReaderOptions(),
                 partitions: int = 1, client_factory: Optional[Callable] = None) -> None:
        super().__init__()
        StreamArn.parse(stream_arn)  # raises ValueError naming the value
        _check_partitions(partitions)
        if not isinstance(reader, ReaderOptions):
            raise TypeError(f"reader must be a ReaderOptions, got {type(reader).__name__}")
        self._sources = (StreamSource(stream_arn, reader, client_factory or StreamsClientFactory(),
                                      _check_state(state), partitions),)

    @classmethod
    def _of_jobs(cls, jobs: Sequence[LiveJob]) -> "ReadDynamoDBStream":
        """Every job's stream in one reading stage (a multi-table job)."""
        read = cls(jobs[0].stream_arn, jobs[0].state, reader=jobs[0].reader, partitions=jobs[0].partitions,
                   client_factory=jobs[0].client_factory)
        read._sources = tuple(StreamSource(j.stream_arn, j.reader, j.client_factory, j.state, j.partitions)
                              for j in jobs)
        return read

    def expand(self, pbegin):
        partitions = [StreamPartition(s.stream_arn, i, s.partitions) for s in self._sources
                      for i in range(s.partitions)]
        return (
            pbegin
            | STEP_PARTITIONS >> beam.Create(partitions)
            | STEP_READ >> read_stream_partitions(self._sources)
        )


class _TransformChangesFn(beam.DoFn):
    def __init__(self, fn: Callable[[ChangeRecord], ChangeRecord]) -> None:
        self._fn = fn

    def _one(self, record: ChangeRecord) -> ChangeRecord:
        out = self._fn(record)
        if not isinstance(out, ChangeRecord):
            raise TypeError(f"TransformChanges: the function must return a ChangeRecord, got {type(out).__name__}")
        # A changed key would move the change to another row (and another shard's
        # order): refuse it rather than write somewhere unexpected.
        if out.keys != record.keys or out.position != record.position or out.change_ms != record.change_ms:
            raise ValueError("TransformChanges: the function may change the images, not the keys, the stream "
                             "position or the change time")
        return out

    def process(self, element):
        if type(element) is RecordBatch:
            yield replace(element, records=tuple(self._one(r) for r in element.records))
        elif isinstance(element, ChangeRecord):
            yield self._one(element)
        else:
            yield element  # shard markers pass in order


class TransformChanges(beam.PTransform):
    """Change each record before mapping, e.g. add a computed attribute.

    ``fn(ChangeRecord) -> ChangeRecord`` must be a pure function that treats the
    old and the new image alike (so a delete removes what the insert wrote) and
    keeps the keys, the stream position and the change time; use
    ``dataclasses.replace(record, new_image=..., old_image=...)``. Goes between
    ``ReadDynamoDBStream`` and ``MapToBigtable``.
    """

    def __init__(self, fn: Callable[[ChangeRecord], ChangeRecord]) -> None:
        super().__init__()
        if not callable(fn):
            raise TypeError(f"TransformChanges needs a function, got {type(fn).__name__}")
        self._fn = fn

    def expand(self, pcoll):
        return pcoll | beam.ParDo(_TransformChangesFn(self._fn)).with_output_types(StreamElement)


class MapToBigtable(beam.PTransform):
    """``RecordBatch | ShardClosed`` → ``MappedBatch | ShardClosed``: the pure
    mapping engine (``ddb2bt.transforms``) applied to every change, in order.
    Unmappable changes become dead letters, written by ``WriteToBigtableOrdered``."""

    def __init__(self, mapping: MappingArg, *, marking=None) -> None:
        super().__init__()
        self._mapping = load_mapping_arg(mapping)
        self._marking = marking
        self._per_stream: Optional[dict] = None

    @classmethod
    def _of_jobs(cls, jobs: Sequence[LiveJob]) -> "MapToBigtable":
        """Each job's mapping for its own stream's changes, in one stage."""
        mapped = cls(jobs[0].mapping, marking=jobs[0].marking)
        mapped._per_stream = {j.stream_arn: (j.mapping, j.marking) for j in jobs}
        return mapped

    @property
    def mapping(self) -> MappingConfig:
        return self._mapping

    def expand(self, pcoll):
        if self._per_stream is None:
            return pcoll | STEP_MAP >> map_changes(self._mapping, marking=self._marking)
        return pcoll | STEP_MAP >> map_changes_per_stream(self._per_stream)


class _FilterChangesFn(beam.DoFn):
    def __init__(self, keep: Callable[[ChangeRecord], bool]) -> None:
        self._keep = keep

    def _one(self, change: MappedChange) -> MappedChange:
        # An unkept change stays in place with nothing to write, so the sink still
        # advances the shard's checkpoint past it.
        return change if self._keep(change.record) else MappedChange(record=change.record)

    def process(self, element):
        if type(element) is MappedBatch:
            yield MappedBatch(tuple(self._one(c) for c in element.changes))
        elif isinstance(element, MappedChange):
            yield self._one(element)
        elif isinstance(element, (RecordBatch, ChangeRecord)):
            raise TypeError("FilterChanges goes after MapToBigtable (it received unmapped changes)")
        else:
            yield element


class FilterChanges(beam.PTransform):
    """Keep only the changes ``keep(ChangeRecord)`` accepts; the others write
    nothing (and dead-letter nothing). Their stream positions still count, so
    checkpoints advance past them. Decide on what is the same for every version
    of an item (its keys, an entity-type prefix): a predicate on changing values
    would leave rows behind when an item stops matching. Goes between
    ``MapToBigtable`` and ``WriteToBigtableOrdered``."""

    def __init__(self, keep: Callable[[ChangeRecord], bool]) -> None:
        super().__init__()
        if not callable(keep):
            raise TypeError(f"FilterChanges needs a predicate, got {type(keep).__name__}")
        self._keep = keep

    def expand(self, pcoll):
        return pcoll | beam.ParDo(_FilterChangesFn(self._keep)).with_output_types(StreamElement)


class WriteToBigtableOrdered(beam.PTransform):
    """``MappedBatch | ShardClosed`` → PCollection of ``DeadLetter``.

    Writes batched MutateRows in stream order per row (one batch in flight,
    every change to a row coalesced into one entry), retries per entry, records
    permanent failures as dead letters in ``state`` and then advances the
    checkpoints there. ``state.bigtable`` is the target's connection.
    """

    def __init__(self, state: StateSpec, *, sink: SinkConfig = SinkConfig(), pushgateway: Optional[str] = None,
                 bigtable: Optional[BigtableSpec] = None) -> None:
        super().__init__()
        self._state = _check_state(state)
        if not isinstance(sink, SinkConfig):
            raise TypeError(f"sink must be a SinkConfig, got {type(sink).__name__}")
        self._sink = sink
        self._pushgateway = pushgateway
        self._bigtable = bigtable or state.bigtable
        self._per_stream: Optional[dict] = None

    @classmethod
    def _of_jobs(cls, jobs: Sequence[LiveJob]) -> "WriteToBigtableOrdered":
        """Each job's changes to its own target with its own checkpoints, dead
        letters and lease, in one stage. One metrics pusher per process: every
        table's series carry the table label."""
        write = cls(jobs[0].state, sink=jobs[0].sink, pushgateway=jobs[0].pushgateway)
        write._per_stream = {j.stream_arn: (j.state, j.sink, j.pushgateway if i == 0 else None)
                             for i, j in enumerate(jobs)}
        return write

    def expand(self, pcoll):
        if self._per_stream is None:
            return pcoll | STEP_WRITE >> write_to_bigtable(self._bigtable, self._state, self._sink,
                                                           pushgateway=self._pushgateway)
        return pcoll | STEP_WRITE >> write_to_bigtable_per_stream(self._per_stream)


class ReplicateToBigtable(beam.PTransform):
    """PBegin → PCollection of ``DeadLetter``: read the mapping's source stream,
    map, write, checkpoint. ``mapping`` is a MappingConfig, a file path or
    ``example:NAME`` — or a list of them: one job replicating every table, its
    streams read by one stage, each change mapped and written by its own table's
    mapping and sink, with checkpoints, dead letters, phases and lease per table
    (under each mapping's name). Without ``stream_arn`` each table's current stream is looked
    up when the graph is built (it must be NEW_AND_OLD_IMAGES); without ``state``
    checkpoints live in the target instance's state table under the mapping's
    name."""

    def __init__(self, mapping: Union[MappingArg, Sequence[MappingArg]], *, stream_arn: Optional[str] = None,
                 state: Optional[StateSpec] = None, reader: ReaderOptions = ReaderOptions(), partitions: int = 1,
                 sink: SinkConfig = SinkConfig(), marking=None, client_factory: Optional[Callable] = None,
                 pushgateway: Optional[str] = None) -> None:
        super().__init__()
        many = isinstance(mapping, (list, tuple))
        mappings = [load_mapping_arg(m) for m in (mapping if many else [mapping])]
        if not mappings:
            raise ValueError("ReplicateToBigtable needs at least one mapping")
        if many and len(mappings) > 1 and any(x is not None for x in (stream_arn, state, client_factory, marking)):
            raise ValueError("stream_arn, state, client_factory and marking are one table's: with several mappings "
                             "build LiveJobs and use ReplicateToBigtable.from_jobs")
        if stream_arn is not None:
            StreamArn.parse(stream_arn)
        _check_partitions(partitions)
        self._jobs = tuple(LiveJob(
            mapping=m, stream_arn=stream_arn or "", reader=reader,
            state=_check_state(state) if state is not None else _default_state(m), partitions=partitions, sink=sink,
            client_factory=client_factory or StreamsClientFactory(m.source.region), marking=marking,
            pushgateway=pushgateway) for m in mappings)

    @classmethod
    def from_job(cls, job: LiveJob) -> "ReplicateToBigtable":
        """From one ``LiveJob`` (what the CLI builds per mapping)."""
        return cls.from_jobs([job])

    @classmethod
    def from_jobs(cls, jobs: Sequence[LiveJob]) -> "ReplicateToBigtable":
        """From one ``LiveJob`` per table: one job for all of them."""
        jobs = tuple(jobs)
        if not jobs:
            raise ValueError("ReplicateToBigtable.from_jobs needs at least one job")
        for job in jobs:
            StreamArn.parse(job.stream_arn)
            _check_partitions(job.partitions)
            _check_state(job.state)
        _check_distinct(jobs)
        replicate = cls(jobs[0].mapping)
        replicate._jobs = jobs
        return replicate

    @property
    def jobs(self) -> tuple:
        return self._jobs

    @staticmethod
    def _resolve_stream(mapping: MappingConfig) -> str:
        return resolve_stream(mapping, dynamodb_client(mapping.source.region)).stream_arn

    def expand(self, pbegin):
        jobs = tuple(j if j.stream_arn else replace(j, stream_arn=self._resolve_stream(j.mapping)) for j in self._jobs)
        if len(jobs) == 1:
            (job,) = jobs
            read = ReadDynamoDBStream(job.stream_arn, job.state, reader=job.reader, partitions=job.partitions,
                                      client_factory=job.client_factory)
            mapped = MapToBigtable(job.mapping, marking=job.marking)
            write = WriteToBigtableOrdered(job.state, sink=job.sink, pushgateway=job.pushgateway)
        else:
            _check_distinct(jobs)
            read, mapped, write = (ReadDynamoDBStream._of_jobs(jobs), MapToBigtable._of_jobs(jobs),
                                   WriteToBigtableOrdered._of_jobs(jobs))
        return (
            pbegin
            | "ReadDynamoDBStream" >> read
            | "MapToBigtable" >> mapped
            | "WriteToBigtableOrdered" >> write
        )
