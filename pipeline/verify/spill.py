"""Hash buckets on disk: group rows by (table, row key) in bounded memory.

`verify` cannot hold a table: DynamoDB's Scan returns items in no useful order,
an item may map to several rows (index rows, other tables) and several items to
one row (versioned and list columns). So both sides — the rows the source items
map to and the rows the target holds — are written to N bucket files chosen by a
hash of (table, row key), and compared one bucket at a time: a row and every
contribution to it always land in the same bucket. Memory is then one bucket,
not one table. A bucket that turned out larger than ``MAX_GROUP_BYTES`` on disk
(the item count the bucket number was chosen from is an estimate) is split
again, with another hash, before it is loaded — so no estimate can make a
comparison load more than about one group's worth, at any table size.

Records are pickles concatenated in one file per bucket and side; files live in
a private temporary directory removed when done. Only this process reads them.
"""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import threading
from typing import Iterator, Optional

__all__ = ["Spill", "SpillDir", "bucket_count", "paired_groups"]

# Records held in memory before a flush appends them to the bucket files: large
# enough that every flush writes big chunks, small next to the groups loaded.
SPILL_BUFFER_BYTES = 4 << 20
# The most one compared group may weigh on disk (both sides). Loaded, a pickled
# row takes ~3-5x its size in Python objects, so this keeps a group near 100 MiB
# at worst; the bucket count aims well below it (ITEMS_PER_BUCKET).
MAX_GROUP_BYTES = 24 << 20
# An oversized bucket is split into this many, with a hash seeded by its depth.
SPLIT_FANOUT = 16
MAX_SPLIT_DEPTH = 4  # 16^4 more buckets: beyond that one row itself is huge
# Buckets are sized for this many source items: a loaded group (both sides, a
# few KiB of Python objects per item) stays a few MiB, about what a 10,000-item
# table's groups weigh, so peak memory does not follow the table (measured:
# the comparison adds 0-3 MiB to what the Scan left, at 10,000 and 100,000
# items; the peak is the Scan's, docs/benchmarks.md, Verify). Fewer items
# still get MIN_BUCKETS.
ITEMS_PER_BUCKET = 1_000
MIN_BUCKETS = 16
MAX_BUCKETS = 4096  # files per side; the flush opens each non-empty one


def bucket_count(estimated_items: int) -> int:
    """Buckets for a table of about ``estimated_items`` (DescribeTable's count,
    refreshed by DynamoDB only every ~6 hours: a too-small estimate is caught by
    splitting oversized buckets, not trusted)."""
    return max(MIN_BUCKETS, min(MAX_BUCKETS, -(-max(estimated_items, 0) // ITEMS_PER_BUCKET)))


class SpillDir:
    """A private temporary directory, removed on close (also on errors)."""

    def __init__(self, parent: Optional[str] = None, purpose: str = "verify") -> None:
        self.path = tempfile.mkdtemp(prefix=f"ddb2bt-{purpose}-", dir=parent)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> "SpillDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Spill:
    """``(table, row_key, payload)`` records appended to ``buckets`` files by a
    hash of (table, row_key). Thread-safe ``add`` (the Scan runs in threads)."""

    def __init__(self, directory: str, name: str, buckets: int, depth: int = 0) -> None:
        self.directory, self.name, self.buckets, self.depth = directory, name, buckets, depth
        self._buffers: list = [[] for _ in range(buckets)]
        self._buffered = 0
        self._lock = threading.Lock()
        self.records = 0

    def path(self, bucket: int) -> str:
        return os.path.join(self.directory, f"{self.name}.{self.depth}.{bucket}")

    def bucket_of(self, table: str, row_key: bytes) -> int:
        # Python's hash of a tuple of str/bytes: fast, and stable within this
        # process, which is the only reader. The depth makes a split's hash
        # independent of the one that filled the bucket.
        return hash((self.depth, table, row_key)) % self.buckets

    def add(self, table: str, row_key: bytes, payload) -> None:
        data = pickle.dumps((table, row_key, payload), protocol=pickle.HIGHEST_PROTOCOL)
        bucket = self.bucket_of(table, row_key)
        with self._lock:
            self._buffers[bucket].append(data)
            self._buffered += len(data)
            self.records += 1
            if self._buffered >= SPILL_BUFFER_BYTES:
                self._flush_locked()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        for bucket, chunks in enumerate(self._buffers):
            if chunks:
                with open(self.path(bucket), "ab") as f:
                    f.write(b"".join(chunks))
                chunks.clear()
        self._buffered = 0

    def size(self, bucket: int) -> int:
        try:
            return os.path.getsize(self.path(bucket))
        except FileNotFoundError:
            return 0

    def read(self, bucket: int) -> Iterator[tuple]:
        try:
            f = open(self.path(bucket), "rb")
        except FileNotFoundError:
            return
        with f:
            while True:
                try:
                    yield pickle.load(f)
                except EOFError:
                    return

    def remove(self, bucket: int) -> None:
        try:
            os.remove(self.path(bucket))
        except FileNotFoundError:
            pass


def paired_groups(left: Spill, right: Optional[Spill], max_group_bytes: Optional[int] = None) -> Iterator[tuple]:
    """``(left records, right records)`` lists, one pair per bucket (the same
    bucket of both spills, which must share bucket count and depth), each pair
    at most ``max_group_bytes`` on disk: a bigger bucket is split first. Files
    are removed once their group was handed over. ``right`` may be None (one
    side only, e.g. sampled verify reads the target per group)."""
    max_group_bytes = MAX_GROUP_BYTES if max_group_bytes is None else max_group_bytes
    for bucket in range(left.buckets):
        size = left.size(bucket) + (right.size(bucket) if right is not None else 0)
        if size > max_group_bytes and left.depth < MAX_SPLIT_DEPTH:
            subs = [Spill(left.directory, f"{left.name}.{bucket}", SPLIT_FANOUT, left.depth + 1)]
            subs.append(Spill(right.directory, f"{right.name}.{bucket}", SPLIT_FANOUT, right.depth + 1)
                        if right is not None else None)
            for spill, sub in zip((left, right), subs):
                if spill is None:
                    continue
                for table, row_key, payload in spill.read(bucket):
                    sub.add(table, row_key, payload)
                sub.flush()
                spill.remove(bucket)
            yield from paired_groups(subs[0], subs[1], max_group_bytes)
            continue
        pair = (list(left.read(bucket)), list(right.read(bucket)) if right is not None else [])
        left.remove(bucket)
        if right is not None:
            right.remove(bucket)
        yield pair
