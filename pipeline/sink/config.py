"""The sink's settings (``SinkConfig``): batch limits, the retry policy, overlap,
the lease that fences every write, and whether writes go through the ordering guard."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ddb2bt.transforms.limits import MAX_MUTATIONS_PER_REQUEST, MAX_REQUEST_BYTES
from ddb2bt.pipeline.clients.retry import DEFAULT_POLICY, RetryPolicy

__all__ = ["SinkConfig"]

MIB = 1024 * 1024
# A cap on one sink DoFn's concurrent MutateRows (each DoFn instance has its own
# pool, so a worker's total is this times its sink DoFns): each is a thread and
# a stream on the channel; more would only queue on the GIL and the connection.
MAX_PARALLEL_REQUESTS = 16


@dataclass(frozen=True)
class SinkConfig:
    # 1,000 entries ≈ 1 MB of 1 KB rows: large enough to amortise the RPC, small
    # enough that a retry resends little.
    max_batch_rows: int = 1000
    max_batch_bytes: int = 16 * MIB
    max_batch_mutations: int = MAX_MUTATIONS_PER_REQUEST
    retry: RetryPolicy = DEFAULT_POLICY
    # Write a full batch on a background thread while the next one is mapped and
    # buffered (the wait for MutateRows was ~20 % of a worker's time).
    overlap_writes: bool = True
    # MutateRows requests of one batch in flight at once: a batch of more than
    # ``min_request_rows`` rows is shared among up to this many requests (none
    # smaller than that but the last), sent together (a row is never split, and rows are distinct within a batch,
    # so per-row order holds: the next batch still waits for this one). Bigtable
    # applies a request's entries on the tablets that hold them, so concurrent
    # requests are what Google's own bulk writers send; locally it lets the
    # emulator use the second core while the client maps (docs/design.md §4.4).
    parallel_requests: int = 4
    # Below this many rows a request is not split further: each request pays a
    # round trip and the client's per-call work (~0.3 ms here), which 250 rows of
    # writing (~20 ms on the emulator) hide.
    min_request_rows: int = 250
    # The job's lease (ddb2bt.pipeline.control.lease.LeaseSpec): when set, every write and
    # checkpoint is fenced by it (a process that lost it writes nothing more).
    lease: Optional[object] = None
    # Writes go through the per-item ordering guard (a source that may deliver out
    # of order: Kinesis; docs/design.md §10): sink/guarded.GuardedBatchingWriter.
    ordering_guard: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.max_batch_mutations <= MAX_MUTATIONS_PER_REQUEST:
            raise ValueError(f"max_batch_mutations must be in 1..{MAX_MUTATIONS_PER_REQUEST}")
        if not 0 < self.max_batch_bytes <= MAX_REQUEST_BYTES:
            raise ValueError(f"max_batch_bytes must be in 1..{MAX_REQUEST_BYTES}")
        if self.max_batch_rows <= 0:
            raise ValueError("max_batch_rows must be positive")
        if not 0 < self.parallel_requests <= MAX_PARALLEL_REQUESTS:
            raise ValueError(f"parallel_requests must be in 1..{MAX_PARALLEL_REQUESTS}")
        if self.min_request_rows <= 0:
            raise ValueError("min_request_rows must be positive")
