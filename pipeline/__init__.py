"""Where data moves: DynamoDB Streams → mapping → Bigtable.

The public API is the composite transforms of :mod:`ddb2bt.pipeline.io`, exported
here: ``ReplicateToBigtable`` (the whole live path in one step) or its stages
``ReadDynamoDBStream``, ``MapToBigtable`` and ``WriteToBigtableOrdered``, with
``TransformChanges`` and ``FilterChanges`` for steps of your own.

Stages of the live pipeline (``ReplicateToBigtable``) and what passes between them (all frozen dataclasses from ``ddb2bt.transforms.model``)::

  Impulse ─▶ StreamPartitions ─▶ ReadStream (SDF) ──RecordBatch│ShardClosed──▶
     MapChanges ──MappedBatch│ShardClosed──▶ WriteToBigtable ──DeadLetter──▶ (output)

(a RecordBatch is a page of ChangeRecords in stream order; ``ddb2bt.pipeline.source.coders``
gives these elements a coder that estimates their size without encoding them)

* ``ReadStream`` (``ddb2bt.pipeline.source.stream_source``): an unbounded splittable DoFn; one
  element per partition of the stream's shards (shard id hash mod N), so every
  shard has exactly one reader. It discovers shards continuously, reads a child
  only after the sink recorded its parent as finished, and claims each record's
  sequence number, so a checkpoint resumes with AFTER_SEQUENCE_NUMBER.
* ``MapChanges`` (``ddb2bt.transforms.dofns``): the pure mapping engine.
* ``WriteToBigtable`` (``ddb2bt.pipeline.sink.sink``): coalesces per row in stream order,
  writes MutateRows with per-entry retry, dead-letters permanent failures
  durably, then advances each shard's checkpoint in the state table. A full
  batch is written on the sink's thread while the next is buffered; one batch
  in flight, the next sent only after its acknowledgement.

There is deliberately no Reshuffle or GroupByKey between reading and writing:
it would break per-row order (docs/design.md §4.3); ``tests`` assert its absence.
"""

__all__ = [
    "ReadDynamoDBStream", "TransformChanges", "MapToBigtable", "FilterChanges", "WriteToBigtableOrdered",
    "ReplicateToBigtable", "BigtableSpec", "StateSpec", "ReaderOptions", "SinkConfig",
]

_HOMES = {
    "BigtableSpec": "ddb2bt.pipeline.connect.connections", "StateSpec": "ddb2bt.pipeline.connect.connections",
    "ReaderOptions": "ddb2bt.pipeline.source.stream_source", "SinkConfig": "ddb2bt.pipeline.sink.sink",
}


def __getattr__(name: str):
    # Lazy: `import ddb2bt.pipeline.app.cli` (and every submodule) must not pay for
    # importing Beam and the clients before they are needed.
    if name in __all__:
        import importlib

        return getattr(importlib.import_module(_HOMES.get(name, "ddb2bt.pipeline.io")), name)
    raise AttributeError(f"module 'ddb2bt.pipeline' has no attribute {name!r}")
