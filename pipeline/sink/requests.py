"""The sink's MutateRows requests: a batch's rows split into requests within
Bigtable's limits (a large batch into several sent at once, docs/design.md §4.4),
each written with retries of only the entries that failed retryably (jittered
backoff, a total deadline), and a coalesced entry that failed for good isolated
change by change so only the bad change is dead-lettered."""
from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Optional

from ddb2bt.transforms.model import mutations_size
from ddb2bt.pipeline.clients.bigtable.wire import WireEntry
from ddb2bt.pipeline.clients.bigtable.writer import MutationWriter
from ddb2bt.pipeline.clients.bigtable.channel import bigtable_endpoint
from ddb2bt.pipeline.clients.bigtable.errors import (FATAL_CODES, INVALID_ARGUMENT, BigtablePermanent,
                                                     BigtableRetryable, EntryStatus, code_name)
from ddb2bt.pipeline.clients.retry import retrying
from ddb2bt.pipeline.sink.batch import Row
from ddb2bt.pipeline.sink.config import SinkConfig

log = logging.getLogger(__name__)

__all__ = ["RequestAbandoned", "RequestWriter", "StillFailing"]


class StillFailing(BigtableRetryable):
    """Entries of a request still failed retryably: the attempt is retried."""


class RequestAbandoned(Exception):
    """A request of a batch whose outcome was already decided: not retried."""


class RequestWriter:
    """Writes rows of one table as MutateRows requests; returns those that failed
    for good. Holds no batch state, so it may run on the sink thread."""

    def __init__(self, writer: MutationWriter, config: SinkConfig, metrics, sleep: Callable[[float], None],
                 dead_letter: Callable) -> None:
        self._writer = writer
        self.routes_transactional = bool(getattr(writer, "routes_transactional", False))
        self._config = config
        self._metrics = metrics
        self._sleep = sleep
        self._dead_letter = dead_letter
        # Called before every retry of a write (not the first attempt, which the
        # caller fenced): raises once this process no longer owns what it writes.
        # Requests in flight together each call it (the checks are thread-safe).
        self.still_owner: Optional[Callable[[], None]] = None
        # The requests of one batch sent at once (created on the first batch that
        # splits; a batch of few rows never does); none once closed.
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pool_lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        # Never waits: a request still running belongs to a batch that is not
        # acknowledged, so it is not checkpointed either (see BatchingWriter.close).
        with self._pool_lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _request_pool(self) -> Optional[ThreadPoolExecutor]:
        """The pool for a split batch; None once closed (a commit still running
        at teardown then sends its requests one by one, as with one request)."""
        with self._pool_lock:
            if self._pool is None and not self._closed:
                self._pool = ThreadPoolExecutor(self._config.parallel_requests, thread_name_prefix="ddb2bt-mutate")
            return self._pool

    def request_rows(self, rows: int) -> int:
        """The most rows one request of a batch of ``rows`` carries: the batch
        shared among ``parallel_requests`` requests, none under
        ``min_request_rows`` (docs/design.md §4.4)."""
        config = self._config
        if config.parallel_requests == 1:
            return config.max_batch_rows
        share = math.ceil(rows / config.parallel_requests)
        return min(config.max_batch_rows, max(config.min_request_rows, share))

    def requests(self, rows: list, max_rows: Optional[int] = None) -> Iterable:
        """Split rows into requests within the entry/byte/mutation limits (and
        ``max_rows`` rows, default the batch limit); a row is never split across
        requests."""
        max_rows = max_rows or self._config.max_batch_rows
        batch: list = []
        size = mutations = 0
        for row in rows:
            row_size = row.size or mutations_size(row.row_key, row.mutations)
            if batch and (len(batch) >= max_rows
                          or size + row_size > self._config.max_batch_bytes
                          or mutations + row.count > self._config.max_batch_mutations):
                yield batch
                batch, size, mutations = [], 0, 0
            batch.append(row)
            size += row_size
            mutations += row.count
        if batch:
            yield batch

    def write_split(self, table: str, rows: list) -> list:
        """Like _write_all; with a separate state app profile (a replicated
        instance), the rows a conditional check must see — the tail's touch
        markers, the backfill's guarded rows — go through that profile's single
        cluster, the rest through the data profile (docs/operations.md#ha-instances-app-profiles)."""
        if not self.routes_transactional:
            return self.write_all(table, rows)
        pinned: list = []
        plain: list = []
        for r in rows:
            must_see = r.has_markers() or any(c.guard is not None for _, c in r.parts)
            (pinned if must_see else plain).append(r)
        return self.write_all(table, plain) + self.write_all(table, pinned, transactional=True)

    def write_all(self, table: str, rows: list, transactional: bool = False) -> list:
        """[(row, permanent EntryStatus)] for rows that failed for good. Returns
        once every request is acknowledged or failed for good; the requests of
        more than ``min_request_rows`` rows are in flight together
        (``parallel_requests``), each with its own retries. A request that cannot
        succeed re-raises here once the others ended (``_outcome``); an interrupt
        of the waiting thread re-raises at once and stops the others' retries."""
        requests = list(self.requests(rows, self.request_rows(len(rows))))
        pool = None
        if len(requests) > 1 and len(rows) > self._config.min_request_rows and self._config.parallel_requests > 1:
            pool = self._request_pool()
        if pool is None:
            failed: list = []
            for batch in requests:
                failed.extend(self.write_with_retry(table, batch, transactional))
            return failed
        abandon = threading.Event()
        futures = [pool.submit(self.write_with_retry, table, batch, transactional, abandon) for batch in requests]
        try:
            return self._outcome(futures)
        except BaseException:
            abandon.set()  # an interrupt (or a failure): the others stop at their next retry
            for future in futures:
                future.cancel()
            raise

    @staticmethod
    def _outcome(futures: list) -> list:
        """Waits for every request; the failed rows, or the most telling error:
        one that cannot be retried (a fatal code, a lost lease) before one that
        gave up retrying, the first in request order; the others are logged."""
        failed: list = []
        errors: list = []
        for future in futures:
            try:
                failed.extend(future.result())
            except Exception as exc:  # noqa: BLE001 - each request ends before the batch's outcome is told
                errors.append(exc)
        if not errors:
            return failed
        errors.sort(key=lambda e: isinstance(e, BigtableRetryable))  # stable: request order within each kind
        for other in errors[1:]:
            log.warning("another request of the same batch failed too: %s: %s", type(other).__name__, other)
        raise errors[0]

    def write_with_retry(self, table: str, rows: list, transactional: bool = False,
                         abandon: Optional[threading.Event] = None) -> list:
        """``abandon``: set when the batch's outcome is already decided (the
        waiting thread was interrupted): no further attempt is made."""
        pending = list(rows)
        permanent: list = []
        attempts = 0

        def attempt() -> None:
            nonlocal pending, attempts
            attempts += 1
            if abandon is not None and abandon.is_set():
                raise RequestAbandoned(f"MutateRows on {table}: the batch was abandoned")
            if attempts > 1 and self.still_owner is not None:
                self.still_owner()
            started = time.perf_counter()
            sent = len(pending)
            try:
                entries = [(r.row_key, r.mutations) if r.wire is None
                           else WireEntry(r.row_key, r.lazy_mutations(), b"".join(r.wire)) for r in pending]
                statuses = self._writer.mutate_rows(table, entries, transactional=True) if transactional \
                    else self._writer.mutate_rows(table, entries)
            except BigtablePermanent as exc:
                if getattr(exc, "code", "") in FATAL_CODES:
                    raise  # table missing or no permission: nothing can succeed, stop loudly
                rejected, pending = pending, []
                if len(rejected) == 1:
                    permanent.append((rejected[0], EntryStatus(INVALID_ARGUMENT, exc.message)))
                    return
                # The request as a whole was rejected: find the culprit row by row.
                for row in rejected:
                    if self.still_owner is not None:  # each re-send is a first attempt: fenced here
                        self.still_owner()
                    permanent.extend(self.write_with_retry(table, [row], transactional))
                return
            finally:
                if self._metrics:
                    self._metrics.mutate_latency.observe(time.perf_counter() - started)
                    self._metrics.batch_rows.observe(sent)
            retry = []
            first: Optional[EntryStatus] = None
            for row, status in zip(pending, statuses):
                if status.ok:
                    continue
                if status.retryable:
                    retry.append(row)
                    first = first or status
                    if self._metrics:
                        self._metrics.bigtable_retries.labels(code_name(status.code)).inc()
                else:
                    permanent.append((row, status))
            pending = retry
            if pending:
                raise StillFailing(f"{len(pending)} of {sent} entries failed: {code_name(first.code)}: "
                                    f"{first.message}", code=code_name(first.code))

        def count_rpc_retry(exc: BaseException) -> None:
            if self._metrics and not isinstance(exc, StillFailing):
                self._metrics.bigtable_retries.labels(getattr(exc, "code", "RPC")).inc(len(pending))

        where = f"Bigtable ({bigtable_endpoint()})"
        try:
            retrying(self._config.retry, f"MutateRows on {table}", count_rpc_retry, self._sleep,
                     where=where)(attempt)
        except BigtableRetryable as exc:
            cause = exc.__cause__ or exc
            raise BigtableRetryable(
                f"gave up writing to {table} after {self._config.retry.deadline_s:.0f}s (--bigtable-deadline): "
                f"{where} kept failing: {cause}", code=getattr(cause, "code", "")) from exc
        return permanent

    def isolate(self, row: Row, status: EntryStatus) -> list:
        """A coalesced entry failed for good: apply its changes one by one, in
        order, and dead-letter only those that fail."""
        reason = status.permanent_reason or "write_failed"
        if len(row.parts) == 1:
            element, _ = row.parts[0]
            return [self._dead_letter(element, reason, status.message or reason, "BigtableWriteError")]
        dead = []
        for element, change in row.parts:
            single = Row(row.table, row.row_key, list(change.mutations), [(element, change)],
                         wire=None if change.wire is None else [change.wire])
            for failed_row, failed_status in self.write_split(row.table, [single]):
                dead.append(self._dead_letter(element, failed_status.permanent_reason or "write_failed",
                                              failed_status.message, "BigtableWriteError"))
        return dead
