"""The sink's settings (``SinkConfig``): batch limits, the retry policy, overlap,
the lease that fences every write, and whether writes go through the ordering guard."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ddb2bt.transforms.limits import MAX_MUTATIONS_PER_REQUEST, MAX_REQUEST_BYTES
from ddb2bt.pipeline.clients.retry import DEFAULT_POLICY, RetryPolicy

__all__ = ["SinkConfig"]

MIB = 1024 * 1024


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
