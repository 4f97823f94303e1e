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

from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional, Union

import apache_beam as beam

import ddb2bt.pipeline.source.coders  # noqa: F401  (registers the StreamElement coder)
from ddb2bt.pipeline.connections import BigtableSpec, StateSpec, StreamsClientFactory
from ddb2bt.pipeline.dynamodb import StreamArn
from ddb2bt.pipeline.sink.sink import SinkConfig, _WriteToBigtableFn
from ddb2bt.pipeline.source.stream_sdf import _ReadStreamPartitionsFn
from ddb2bt.pipeline.source.stream_source import ReaderOptions, StreamPartition
from ddb2bt.transforms.config import MappingConfig
from ddb2bt.transforms.dofns import _MapChangesFn
from ddb2bt.transforms.model import ChangeRecord, MappedBatch, MappedChange, RecordBatch, StreamElement

__all__ = [
    "ReadDynamoDBStream", "TransformChanges", "MapToBigtable", "FilterChanges", "WriteToBigtableOrdered",
    "ReplicateToBigtable", "load_mapping_arg", "prepare_target",
]

# Step labels inside the composites; the ordered-path checks look for them.
STEP_PARTITIONS = "StreamPartitions"
STEP_READ = "ReadStream"
STEP_MAP = "MapChanges"
STEP_WRITE = "WriteToBigtable"
MappingArg = Union[MappingConfig, str, Path]


def load_mapping_arg(mapping: MappingArg) -> MappingConfig:
    """A MappingConfig as given, or loaded from a file path or ``example:NAME``."""
    if isinstance(mapping, MappingConfig):
        return mapping
    if isinstance(mapping, (str, Path)):
        from ddb2bt.pipeline.local.examples import resolve_mapping_path
        from ddb2bt.transforms.config import load_mapping

        return load_mapping(resolve_mapping_path(str(mapping)))
    raise TypeError(f"mapping must be a MappingConfig or a path to a mapping file, got {type(mapping).__name__}")


def prepare_target(mapping: MappingArg, state: Optional[StateSpec] = None) -> MappingConfig:
    """Create (or complete) the mapping's Bigtable tables and the state table,
    as ``ddb2bt create-table`` does; run it once before building the graph.
    Returns the loaded mapping."""
    from ddb2bt.pipeline.preflight import ensure_state_table
    from ddb2bt.pipeline.sink.bigtable_io import ensure_mapping_table

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
        self._stream_arn = stream_arn
        self._state = _check_state(state)
        self._reader = reader
        self._partitions = partitions
        self._client_factory = client_factory or StreamsClientFactory()

    def expand(self, pbegin):
        partitions = [StreamPartition(self._stream_arn, i, self._partitions) for i in range(self._partitions)]
        return (
            pbegin
            | STEP_PARTITIONS >> beam.Create(partitions)
            | STEP_READ >> beam.ParDo(_ReadStreamPartitionsFn(self._reader, self._client_factory, self._state))
            .with_output_types(StreamElement)
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

    @property
    def mapping(self) -> MappingConfig:
        return self._mapping

    def expand(self, pcoll):
        return pcoll | STEP_MAP >> beam.ParDo(_MapChangesFn(self._mapping, marking=self._marking)).with_output_types(
            StreamElement)


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

    def expand(self, pcoll):
        return pcoll | STEP_WRITE >> beam.ParDo(
            _WriteToBigtableFn(self._bigtable, self._state, self._sink, pushgateway=self._pushgateway))


class ReplicateToBigtable(beam.PTransform):
    """PBegin → PCollection of ``DeadLetter``: read the mapping's source stream,
    map, write, checkpoint. ``mapping`` is a MappingConfig, a file path or
    ``example:NAME``. Without ``stream_arn`` the table's current stream is looked
    up when the graph is built (it must be NEW_AND_OLD_IMAGES); without ``state``
    checkpoints live in the target instance's state table under the mapping's
    name."""

    def __init__(self, mapping: MappingArg, *, stream_arn: Optional[str] = None, state: Optional[StateSpec] = None,
                 reader: ReaderOptions = ReaderOptions(), partitions: int = 1, sink: SinkConfig = SinkConfig(),
                 marking=None, client_factory: Optional[Callable] = None, pushgateway: Optional[str] = None) -> None:
        super().__init__()
        self._mapping = load_mapping_arg(mapping)
        self._state = _check_state(state) if state is not None else _default_state(self._mapping)
        if stream_arn is not None:
            StreamArn.parse(stream_arn)
        _check_partitions(partitions)
        self._stream_arn = stream_arn
        self._reader, self._partitions, self._sink = reader, partitions, sink
        self._marking, self._pushgateway = marking, pushgateway
        self._client_factory = client_factory or StreamsClientFactory(self._mapping.source.region)

    @classmethod
    def from_job(cls, job) -> "ReplicateToBigtable":
        """From a ``ddb2bt.pipeline.graph.LiveJob`` (what the CLI builds)."""
        return cls(job.mapping, stream_arn=job.stream_arn, state=job.state, reader=job.reader,
                   partitions=job.partitions, sink=job.sink, marking=job.marking,
                   client_factory=job.client_factory, pushgateway=job.pushgateway)

    def _resolve_stream(self) -> str:
        from ddb2bt.pipeline.connections import dynamodb_client
        from ddb2bt.pipeline.preflight import resolve_stream

        return resolve_stream(self._mapping, dynamodb_client(self._mapping.source.region)).stream_arn

    def expand(self, pbegin):
        stream_arn = self._stream_arn or self._resolve_stream()
        return (
            pbegin
            | "ReadDynamoDBStream" >> ReadDynamoDBStream(stream_arn, self._state, reader=self._reader,
                                                         partitions=self._partitions,
                                                         client_factory=self._client_factory)
            | "MapToBigtable" >> MapToBigtable(self._mapping, marking=self._marking)
            | "WriteToBigtableOrdered" >> WriteToBigtableOrdered(self._state, sink=self._sink,
                                                                 pushgateway=self._pushgateway)
        )
