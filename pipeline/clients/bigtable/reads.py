"""ReadRows through the data client, for the state table, verification, status,
recovery and tests: whole tables, key sets and key ranges, streamed or
collected, each query retried by our policy (the client's own silent retries
are off), and the table's split points (SampleRowKeys)."""
from __future__ import annotations

import logging
from typing import Callable, Iterable, Iterator, Optional, Sequence

from ddb2bt.pipeline.clients.bigtable.channel import bigtable_endpoint, close_bounded
from ddb2bt.pipeline.clients.bigtable.errors import classify_api_error
from ddb2bt.pipeline.clients.bigtable.wire import US_PER_MS
from ddb2bt.pipeline.clients.retry import DEFAULT_DEADLINE_S, RetryPolicy, gave_up, retrying
from ddb2bt.transforms.errors import RetryableError


def data_client(project: str):
    from google.cloud.bigtable.data import BigtableDataClient

    return BigtableDataClient(project=project)


def _row_cells(row) -> dict:
    """{(family, qualifier): [(timestamp_ms, value), ...] newest first} of one row."""
    cells: dict = {}
    for cell in row.cells:
        cells.setdefault((cell.family, cell.qualifier), []).append((cell.timestamp_micros // US_PER_MS, cell.value))
    return cells


# One ReadRows attempt may take this long: a whole table read by verify is one
# attempt. Small reads (the state table) pass a shorter one.
BULK_ATTEMPT_TIMEOUT_S = 600.0
SMALL_ATTEMPT_TIMEOUT_S = 20.0


def _read(project: str, instance: str, table_id: str, queries: Iterable, client=None,
          deadline_s: Optional[float] = None, attempt_timeout_s: float = BULK_ATTEMPT_TIMEOUT_S,
          app_profile: Optional[str] = None, between_attempts: Optional[Callable[[], None]] = None) -> dict:
    """Run ReadRows queries; with ``client`` given it is reused and left open (callers
    reading often keep one), otherwise a client lives for this call only.

    The data client's own retries are off (they are silent, up to 600 s): each
    query is retried by our policy, which logs every failure and gives up after
    ``deadline_s`` with an error naming Bigtable and the endpoint."""
    own = client is None
    client = client or data_client(project)
    out: dict = {}
    policy = RetryPolicy(initial_s=0.2, max_backoff_s=5.0,
                         deadline_s=DEFAULT_DEADLINE_S if deadline_s is None else deadline_s)
    timeout = min(attempt_timeout_s, policy.deadline_s) if policy.deadline_s > 0 else attempt_timeout_s
    try:
        with client.get_table(instance, table_id, **({"app_profile_id": app_profile} if app_profile else {})) as table:
            for query in queries:
                def attempt(query=query) -> list:
                    try:
                        return list(table.read_rows(query, operation_timeout=timeout, attempt_timeout=timeout,
                                                    retryable_errors=()))
                    except Exception as exc:
                        if type(exc).__module__.startswith("google.api_core"):
                            raise classify_api_error(exc, "ReadRows") from exc
                        raise

                for row in retrying(policy, f"ReadRows on {table_id}", where=f"Bigtable ({bigtable_endpoint()})",
                                    between_attempts=between_attempts)(attempt):
                    out[row.row_key] = _row_cells(row)
    finally:
        if own:
            close_bounded(client.close, "Bigtable data client")
    return out


def ms_datetime(ms: int):
    """Epoch milliseconds as an aware datetime, exactly (no float rounding: a
    filter bound one microsecond off would take in or leave out a cell)."""
    import datetime as _dt

    return _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc) + _dt.timedelta(milliseconds=ms)


def read_table(project: str, instance: str, table_id: str, prefix: Optional[bytes] = None,
               latest_only: bool = False, client=None, deadline_s: Optional[float] = None,
               attempt_timeout_s: float = BULK_ATTEMPT_TIMEOUT_S, app_profile: Optional[str] = None,
               between_attempts: Optional[Callable[[], None]] = None, limit: Optional[int] = None) -> dict:
    """{row_key: {(family, qualifier): [(timestamp_ms, value), ...] newest first}}.
    ``between_attempts`` runs before each retry (a job's lease check); ``limit``:
    the first rows only."""
    from google.cloud.bigtable.data import ReadRowsQuery, RowRange
    from google.cloud.bigtable.data import row_filters

    query = ReadRowsQuery()
    if prefix is not None:
        query = ReadRowsQuery(row_ranges=RowRange(start_key=prefix, end_key=prefix_end(prefix)), limit=limit)
    elif limit is not None:
        query = ReadRowsQuery(limit=limit)
    if latest_only:
        query.filter = row_filters.CellsColumnLimitFilter(1)
    return _read(project, instance, table_id, [query], client, deadline_s, attempt_timeout_s, app_profile,
                 between_attempts)


def read_rows(project: str, instance: str, table_id: str, row_keys: Sequence, client=None,
              deadline_s: Optional[float] = None, attempt_timeout_s: float = BULK_ATTEMPT_TIMEOUT_S,
              app_profile: Optional[str] = None, between_attempts: Optional[Callable[[], None]] = None) -> dict:
    """Like read_table, for the given rows only (missing rows are absent)."""
    from google.cloud.bigtable.data import ReadRowsQuery

    keys = list(row_keys)
    queries = [ReadRowsQuery(row_keys=keys[i:i + READ_BATCH_ROWS]) for i in range(0, len(keys), READ_BATCH_ROWS)]
    return _read(project, instance, table_id, queries, client, deadline_s, attempt_timeout_s,
                 app_profile, between_attempts) if queries else {}


READ_BATCH_ROWS = 1000  # rows per ReadRows call when reading a key set


def iter_table(project: str, instance: str, table_id: str, client=None, deadline_s: Optional[float] = None,
               attempt_timeout_s: float = BULK_ATTEMPT_TIMEOUT_S, start_key: Optional[bytes] = None,
               end_key: Optional[bytes] = None, sleep=None, row_filter=None,
               app_profile: Optional[str] = None) -> Iterator:
    """(row_key, cells) of every row, in key order, as they stream in: nothing of
    the table is held (``verify`` reads tables of any size with it). One
    ReadRows stream is read to its end (a stream given up half-way would keep
    its flow-control buffers until the call is torn down). A failed stream
    resumes after the last row received; failures are logged and retried with
    backoff, and after ``deadline_s`` without progress given up, naming
    Bigtable and the endpoint. ``start_key`` (inclusive) and ``end_key``
    (exclusive) bound the read to one key range; ``row_filter`` (a
    python-bigtable row filter) is applied by Bigtable; ``app_profile`` routes
    the read (None: the instance's default profile)."""
    import time as _time

    from google.cloud.bigtable.data import ReadRowsQuery, RowRange

    sleep = sleep or _time.sleep
    own = client is None
    client = client or data_client(project)
    policy = RetryPolicy(initial_s=0.2, max_backoff_s=5.0,
                         deadline_s=DEFAULT_DEADLINE_S if deadline_s is None else deadline_s)
    timeout = min(attempt_timeout_s, policy.deadline_s) if policy.deadline_s > 0 else attempt_timeout_s
    last = None
    failing_since, backoff = None, policy.initial_s
    where = f"Bigtable ({bigtable_endpoint()})"
    try:
        with client.get_table(instance, table_id, **({"app_profile_id": app_profile} if app_profile else {})) as table:
            while True:
                if last is None:
                    query = ReadRowsQuery(row_filter=row_filter) if start_key is None and end_key is None else \
                        ReadRowsQuery(row_ranges=RowRange(start_key=start_key, end_key=end_key), row_filter=row_filter)
                else:
                    query = ReadRowsQuery(row_ranges=RowRange(start_key=last, end_key=end_key,
                                                              start_is_inclusive=False), row_filter=row_filter)
                try:
                    for row in table.read_rows_stream(query, operation_timeout=timeout, attempt_timeout=timeout,
                                                      retryable_errors=()):
                        last, failing_since, backoff = row.row_key, None, policy.initial_s
                        yield row.row_key, _row_cells(row)
                    return
                except Exception as exc:
                    err = classify_api_error(exc, "ReadRows") if type(exc).__module__.startswith(
                        "google.api_core") else exc
                    if not isinstance(err, RetryableError):
                        raise err from exc
                    now = _time.monotonic()
                    failing_since = failing_since or now
                    if policy.deadline_s > 0 and now - failing_since > policy.deadline_s:
                        raise gave_up(err, f"ReadRows on {table_id} at {where}: gave up after "
                                           f"{now - failing_since:.0f}s: {err}") from exc
                    logging.getLogger(__name__).warning("ReadRows on %s at %s failed (%s); resuming in %.1fs",
                                                        table_id, where, err, backoff)
                    sleep(backoff)
                    backoff = min(backoff * 2, policy.max_backoff_s)
    finally:
        if own:
            close_bounded(client.close, "Bigtable data client")


def table_ranges(project: str, instance: str, table_id: str, client=None) -> list:
    """[(start_key, end_key)] covering the table (None: unbounded), split where
    Bigtable's SampleRowKeys says the data splits: read in parallel, each range
    a similar share of the bytes."""
    own = client is None
    client = client or data_client(project)
    try:
        with client.get_table(instance, table_id) as table:
            keys = sorted({k for k, _ in table.sample_row_keys() if k})
    finally:
        if own:
            close_bounded(client.close, "Bigtable data client")
    bounds = [None] + keys + [None]
    return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def prefix_end(prefix: bytes) -> Optional[bytes]:
    """The smallest key greater than every key starting with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])
