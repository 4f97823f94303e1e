"""Partition ownership inside a shared (Dataflow) job: which worker process may
read, write and checkpoint each stream partition.

Each stream partition has an owner of its own (``PartitionOwners``): a lease per
partition, held by one worker process (holder ``worker:<host>:<pid>:<nonce>``),
taken by compare-and-set, renewed by that worker and checked before the reader
reads and before the sink writes or checkpoints anything of that partition. Each
acquisition writes a new value, so the cell works as the partition's epoch: a
worker that was paused while Dataflow moved the partition to another worker
finds, when it wakes, that its own monotonic clock has run past the lease (so it
stops), and its renewal's compare-and-set fails against the new owner's value
(so it never resumes). A worker that stops processing a partition (Dataflow
moved it while the worker was healthy) releases the partition's lease after
``PARTITION_IDLE_RELEASE_S`` (``PartitionLease.idle``). The leases themselves
are ``lease.Lease``; see lease.py for the fence.
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
import zlib
from typing import Callable, Optional

from ddb2bt.pipeline.control.lease import Lease, LeaseCell, LeaseLost, LeaseSpec, lease_cell
from ddb2bt.pipeline.control.state import stream_label
from ddb2bt.transforms.errors import PermanentError, RetryableError

# A worker releases a partition's lease when it has not processed the partition
# for this long (Dataflow moved it elsewhere): the new owner then waits at most
# this, not a whole TTL. Readers come back every poll interval (~1 s).
PARTITION_IDLE_RELEASE_S = 10.0
# A reading round keeps its partition's lease from being idle (a round may wait
# minutes in throttling back-off), but not for ever: a round whose generator the
# runner dropped without closing it (it leaks the count) stops counting after
# this long, past the readers' default give-up deadline (--dynamodb-deadline,
# 300 s), so a partition Dataflow moved is still released in the end.
PARTITION_ROUND_MAX_S = 900.0

WORKER_ID = f"worker:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def partition_index(shard_id: str, count: int) -> int:
    """The partition a shard belongs to (the readers' own rule, StreamPartition.owns)."""
    return zlib.crc32(shard_id.encode()) % count


class PartitionLease(Lease):
    """A partition's lease: released by the heartbeat when not used for
    ``idle_release_s`` and no reading round of the partition is running
    (``rounds``)."""

    idle_release_s = PARTITION_IDLE_RELEASE_S

    def __init__(self, spec: LeaseSpec, cell: LeaseCell, **kw) -> None:
        super().__init__(spec, cell, **kw)
        self.last_used = self._clock()
        self.rounds = 0
        self.round_started = float("-inf")  # the latest round's start (own clock)

    def use(self) -> None:
        """Its partition is still given to this process (read, written, checkpointed)."""
        self.last_used = self._clock()

    def round_begins(self) -> None:
        self.rounds += 1
        self.round_started = self._clock()

    def round_ends(self) -> None:
        self.rounds -= 1
        self.last_used = self._clock()

    def idle(self) -> bool:
        """Nobody uses it: no reading round of it running (a round may wait minutes
        in throttling back-off without claiming anything) and not used for
        ``idle_release_s``. Unproven (a blip, a pause): not idle, nothing to
        release yet."""
        now = self._clock()
        running = self.rounds > 0 and now - self.round_started < PARTITION_ROUND_MAX_S
        return (not running and now - self.last_used > self.idle_release_s and self._valid_until > now)


class PartitionOwners:
    """This process's partition leases in a shared (Dataflow) job; see the module
    docstring. ``cell_for`` builds a LeaseCell for a spec (injected in tests)."""

    def __init__(self, cell_for: Callable[[LeaseSpec], LeaseCell] = None, worker: str = None,
                 heartbeat: bool = True, **lease_kw) -> None:
        self._cell_for = cell_for or lease_cell
        self._heartbeat = heartbeat  # tests renew by hand on an injected clock
        self._worker = worker or WORKER_ID
        self._lease_kw = lease_kw
        self._leases: dict = {}  # (stream_arn, index) -> Lease
        self._counts: dict = {}  # stream_arn -> partition count
        self._lock = threading.Lock()

    def spec_for(self, job: LeaseSpec, stream_arn: str, index: int) -> LeaseSpec:
        return LeaseSpec(job.bigtable, job.table, job.job, f"{job.role}#p#{stream_label(stream_arn)}#{index}",
                         self._worker, job.ttl_s, job.renew_s, shared=False, give_up_s=job.give_up_s)

    def claim(self, job: LeaseSpec, stream_arn: str, index: int, count: int) -> Optional[Lease]:
        """The partition's lease held by this process, taking it if it is free;
        None while another worker holds it (the caller reads nothing meanwhile)."""
        with self._lock:
            self._counts[stream_arn] = count
            key = (stream_arn, index)
            lease = self._leases.get(key)
            if lease is not None and not lease.lost:
                lease.use()
                return lease
            spec = self.spec_for(job, stream_arn, index)
            lease = PartitionLease(spec, self._cell_for(spec), command="worker", **self._lease_kw)
            try:
                other = lease.try_acquire()
            except (RetryableError, PermanentError):
                other = True  # Bigtable unreachable: not taken now, tried again next round
            if other is not None:
                lease._cell.close()
                self._leases.pop(key, None)
                return None
            if self._heartbeat:
                lease.start_heartbeat()
            self._leases[key] = lease
            return lease

    def check(self, positions) -> None:
        """Before writing or checkpointing changes of ``positions`` ((stream_arn,
        shard_id) pairs): this process must own each one's partition now. Raises
        LeaseUnproven (retryable: wait) or LeaseLost (the partition moved: stop)."""
        for stream_arn, shard_id in positions:
            count = self._counts.get(stream_arn)
            if count is None:
                continue  # no partition ownership for this stream in this process (not a shared job)
            lease = self._leases.get((stream_arn, partition_index(shard_id, count)))
            if lease is None:
                raise LeaseLost(f"this worker does not own the partition of shard {shard_id}: it moved to another "
                                "worker; its changes are written by that one")
            lease.use()
            lease.check()

    def touch(self, stream_arn: str, index: int) -> None:
        """The reader is still given this partition (even while it cannot read:
        a blip), so its lease is not released as idle."""
        lease = self._leases.get((stream_arn, index))
        if lease is not None:
            lease.use()

    @contextlib.contextmanager
    def round(self, stream_arn: str, index: int):
        """A reading round of the partition runs: its lease is not idle until the
        round ends, however long it waits (throttling back-off), so the sink's
        writes of what it read still find the partition owned."""
        lease = self._leases.get((stream_arn, index))
        if lease is None:
            yield
            return
        with self._lock:
            lease.round_begins()
        try:
            yield
        finally:
            with self._lock:
                lease.round_ends()

    @contextlib.contextmanager
    def in_use(self, positions):
        """A commit of changes of ``positions`` ((stream_arn, shard_id) pairs) runs
        (the sink's last batch in finish_bundle, after its reading round ended):
        their partitions' leases are not idle until it ends, however long the
        writes take (MutateRows throttled, many CheckAndMutateRow), so the
        commit's own checkpoint still finds them owned."""
        leases = []
        with self._lock:
            for stream_arn, shard_id in positions:
                count = self._counts.get(stream_arn)
                lease = None if count is None else self._leases.get((stream_arn, partition_index(shard_id, count)))
                if lease is not None and all(lease is not held for held in leases):
                    lease.round_begins()
                    leases.append(lease)
        try:
            yield
        finally:
            with self._lock:
                for lease in leases:
                    lease.round_ends()

    def check_partition(self, stream_arn: str, index: int) -> float:
        """This process owns the partition now (else LeaseUnproven / LeaseLost)."""
        lease = self._leases.get((stream_arn, index))
        if lease is None:
            raise LeaseLost(f"this worker does not own partition {index} of {stream_arn}")
        return lease.check()

    def held(self, stream_arn: str, index: int) -> Optional[Lease]:
        return self._leases.get((stream_arn, index))

    def release_all(self) -> None:
        with self._lock:
            for lease in self._leases.values():
                lease.release()
            self._leases.clear()


