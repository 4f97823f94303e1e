"""The one DynamoDB access module: everything ddb2bt reads from DynamoDB and
DynamoDB Streams goes through here, so retries, throttling, the read budget,
error classification and the retention rule are written once.

* ``classify_aws_error`` — a boto3 failure → our taxonomy (retryable vs permanent),
  once, where it enters (``ddb2bt.transforms.errors``).
* ``StreamArn`` — the parts of a stream ARN (table name, stream label).
* ``scan_pages`` / ``scan_items`` / ``parallel_scan`` — the Scan pager: retries of
  throttling and 5xx with backoff under one deadline, an optional read budget
  (``TokenBucket``, in capacity units per second), segments, resume keys.
* ``list_shards`` — DescribeStream, paginated, with retries.
* ``get_item`` — a consistent GetItem by key, with retries.
* the stream's retention constants.

Used by the live path (shard listing), the backfill (segment scans), verify
(parallel full scans), status (shard listing), lint (a sample) and the demo's
workload alike.
"""
from __future__ import annotations

import base64
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from botocore.exceptions import BotoCoreError, ClientError
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.parsers import DEFAULT_TIMESTAMP_PARSER

from ddb2bt.pipeline.clients.retry import RetryPolicy, retrying
from ddb2bt.transforms.arns import StreamArn, table_of_stream
from ddb2bt.transforms.errors import ChangesLostError, PermanentError, RetryableError, StreamGoneError
from ddb2bt.transforms.limits import STREAM_RETENTION_S

__all__ = [
    "STREAM_RETENTION_S", "STREAM_RETENTION_MS", "EXPORT_RETENTION_MARGIN_MS", "DESCRIBE_LIMIT",
    "SCAN_PAGE_LIMIT", "MAX_SCAN_THREADS", "DEFAULT_READ_RETRY", "THROTTLE_CODES",
    "StreamThrottled", "IteratorExpired", "SourceTableMissing", "classify_aws_error",
    "StreamArn", "table_of_stream", "TokenBucket", "ScanPage", "scan_pages", "scan_items",
    "parallel_scan", "Listing", "list_shards", "get_item", "describe_table", "TABLE_OPERATIONS",
    "count_api_call", "CallCounter", "count_calls_with", "GET_RECORDS_PER_SHARD_PER_S", "ShardPacer",
    "ShardDirectory", "shard_directory",
    "STREAMS_CONNECT_TIMEOUT_S", "STREAMS_READ_TIMEOUT_S",
]

STREAM_RETENTION_MS = STREAM_RETENTION_S * 1000
# A back-fill from an export must leave the tail this much stream to spare: the
# tail starts at the export time and has to reach records before they are trimmed.
EXPORT_RETENTION_MARGIN_MS = 3600 * 1000
DESCRIBE_LIMIT = 100  # the service's maximum shards per DescribeStream page
SCAN_PAGE_LIMIT = 1000  # items per Scan page unless the caller asks otherwise
MAX_SCAN_THREADS = 16  # parallel segments read by one process
# Reads ride out a throttling burst or a partition move; a service that stays
# unreachable fails the command in minutes, not hours.
DEFAULT_READ_RETRY = RetryPolicy(initial_s=0.2, max_backoff_s=20.0, deadline_s=600.0)

THROTTLE_CODES = frozenset({
    "ProvisionedThroughputExceededException", "ThrottlingException", "LimitExceededException",
    "RequestLimitExceeded", "InternalServerError", "ServiceUnavailable", "InternalFailure",
})


TABLE_OPERATIONS = ("Scan", "GetItem", "DescribeTable", "Query")


class StreamThrottled(RetryableError):
    """Throttled or a transient service/network failure: retry with backoff."""


class IteratorExpired(RetryableError):
    """A shard iterator older than 15 minutes: get a new one and go on."""


class SourceTableMissing(PermanentError):
    """The DynamoDB table (or its stream) does not exist."""


def classify_aws_error(exc: Exception, operation: str, table: Optional[str] = None) -> Exception:
    """Map a boto3 failure to our taxonomy, once, where it enters. ``table``: the
    DynamoDB table the call was about, named in the message when it is missing."""
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        message = exc.response.get("Error", {}).get("Message", "")
        if code == "ExpiredIteratorException":
            return IteratorExpired(f"{operation}: {message}")
        if code == "TrimmedDataAccessException":
            return ChangesLostError(f"{operation}: {message}")
        if code == "ResourceNotFoundException":
            if operation in TABLE_OPERATIONS:
                what = f"DynamoDB table {table!r}" if table else "the DynamoDB table"
                return SourceTableMissing(f"{operation}: {what} does not exist (in this account and region)")
            return StreamGoneError(
                f"{operation}: {message}. The table was deleted or its stream disabled; a re-enabled stream "
                "has a new ARN and starts empty, so changes made meanwhile are lost: back-fill again "
                "(ddb2bt migrate --restart)")
        if code in THROTTLE_CODES or status >= 500:
            return StreamThrottled(f"{operation}: {code or status}: {message}", code=code or str(status))
        return PermanentError(f"{operation}: {code}: {message}")
    if isinstance(exc, (BotoConnectionError, BotoCoreError)):
        return StreamThrottled(f"{operation}: {type(exc).__name__}: {exc}", code=type(exc).__name__)
    return exc


def endpoint_of(client, service: str = "DynamoDB") -> str:
    """``service (endpoint)`` of a boto3 client, for messages."""
    url = getattr(getattr(client, "meta", None), "endpoint_url", None)
    return f"{service} ({url})" if isinstance(url, str) else service


# Counts one attempt of an AWS call: (api, the table's name in the job or None).
CallCounter = Callable[[str, Optional[str]], None]


def _not_counted(api: str, metrics_table: Optional[str]) -> None:
    """Before a counter is handed in: a client a test built itself."""


# The process's call counter, as handed in where the AWS clients are made
# (connect.connections.aws_client, with observe.metrics.count_aws_call): the
# clients floor imports nothing above it. A list: set in place, not rebound.
_COUNTER: list = [_not_counted]


def count_calls_with(counter: CallCounter) -> None:
    """Count this process's AWS calls with ``counter`` from now on (idempotent:
    the connections hand the same counter in each time they make a client)."""
    _COUNTER[0] = counter


def count_api_call(api: str, metrics_table: Optional[str]) -> None:
    """One attempt of an AWS call, on the counter handed in (count_calls_with):
    ``ddb2bt_aws_api_calls_total{table, api}``, where ``table`` means what it
    means on every series: the table's name in the job (its mapping's name or
    --job-name, what status and dlq print), never the DynamoDB table's name and
    never a key (docs/operations.md, Metrics)."""
    _COUNTER[0](api, metrics_table)


def _retried(operation: str, fn: Callable, policy: RetryPolicy, what: Optional[str] = None,
             on_retry: Optional[Callable[[BaseException], None]] = None, table: Optional[str] = None,
             where: str = "DynamoDB", metrics_table: Optional[str] = None,
             between_attempts: Optional[Callable[[], None]] = None):
    """``table``: the DynamoDB table, for messages; ``metrics_table``: the
    table's name in the job, for the call counter (count_api_call);
    ``between_attempts``: run before each retry (a job's lease check)."""
    def attempt():
        count_api_call(operation, metrics_table)
        try:
            return fn()
        except (ClientError, BotoCoreError) as exc:
            raise classify_aws_error(exc, operation, table) from exc

    # The table in the label: a job of several tables logs which one is failing.
    label = what or (f"{operation} of {table}" if table else operation)
    return retrying(policy, label, on_retry, retry_on=(StreamThrottled,), where=where,
                    between_attempts=between_attempts)(attempt)


# --- ARNs: StreamArn and table_of_stream live in transforms/arns.py (pure, shared with the metrics)


# --- Scan ------------------------------------------------------------------------

class TokenBucket:
    """Read budget in capacity units per second, shared by the threads of one
    worker. Consumption is charged after each page (the service reports it), so
    the budget is met on average: a page that overdraws makes the next wait."""

    def __init__(self, rate: Optional[float], clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._rate = rate
        self._clock = clock
        self._sleep = sleep
        self._tokens = rate or 0.0
        self._last = clock()
        self._lock = threading.Lock()

    def consume(self, units: float) -> None:
        if not self._rate:
            return
        with self._lock:
            now = self._clock()
            self._tokens = min(self._rate, self._tokens + (now - self._last) * self._rate) - units
            self._last = now
            wait = -self._tokens / self._rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)


# botocore's generic response parser walks every AttributeValue of a Scan page
# through the service model: ~35 % of a Scan backfill's CPU in this process
# (bench/backfill_cpu.py). Scan pages are decoded here instead, with the C JSON
# parser and one small walk, into exactly what botocore returns.
FAST_SCAN_EVENT = "before-parse.dynamodb.Scan"
_SCAN_FAST_ID = "ddb2bt-fast-scan-items"
_REGISTER_LOCK = threading.Lock()
_SCAN_FAST_FIELDS = ("Items", "LastEvaluatedKey")
_HTTP_OK_BELOW = 300  # botocore's own test for a success response
_PLAIN_TAGS = frozenset({"S", "N", "BOOL", "NULL", "SS", "NS"})  # the same on the wire and in boto3 form


class _NotPlain(Exception):
    """A value this decoder does not know: botocore's parser takes the page."""


def _wire_value(value):
    """One AttributeValue as DynamoDB's JSON carries it → boto3 form (B as bytes)."""
    if type(value) is not dict or len(value) != 1:
        raise _NotPlain()
    for tag, inner in value.items():
        if tag in _PLAIN_TAGS:
            return value
        if tag == "M" and type(inner) is dict:
            return {"M": {k: _wire_value(v) for k, v in inner.items()}}
        if tag == "L" and type(inner) is list:
            return {"L": [_wire_value(v) for v in inner]}
        if tag == "B" and type(inner) is str:
            return {"B": base64.b64decode(inner)}
        if tag == "BS" and type(inner) is list:
            return {"BS": [base64.b64decode(b) for b in inner]}
    raise _NotPlain()


def _wire_item(item) -> dict:
    if type(item) is not dict:
        raise _NotPlain()
    return {name: _wire_value(v) for name, v in item.items()}


def decode_scan_items(response_dict: dict, customized_response_dict: dict, **_) -> None:
    """botocore ``before-parse`` hook of Scan: decode Items and LastEvaluatedKey of
    a success response here and leave only the small rest (Count, ConsumedCapacity)
    to botocore. Anything unexpected (an error, a type this does not know, a body
    that is not JSON) is left untouched, so botocore parses it as before."""
    if response_dict.get("status_code", _HTTP_OK_BELOW) >= _HTTP_OK_BELOW:
        return
    try:
        data = json.loads(response_dict["body"])
        if type(data) is not dict:
            return
        decoded = {}
        if "Items" in data:
            items = data["Items"]
            if type(items) is not list:
                return
            # In place: each wire item's dict is dropped as its decoded one is
            # made (plain values are shared), so a page's items are not held
            # twice while it is decoded (docs/benchmarks.md, Verify).
            for i, item in enumerate(items):
                items[i] = _wire_item(item)
            decoded["Items"] = items
        if "LastEvaluatedKey" in data:
            decoded["LastEvaluatedKey"] = _wire_item(data["LastEvaluatedKey"])
    except (_NotPlain, KeyError, ValueError, TypeError):  # binascii.Error is a ValueError
        return
    rest = {k: v for k, v in data.items() if k not in _SCAN_FAST_FIELDS}
    response_dict["body"] = json.dumps(rest).encode("utf-8")
    customized_response_dict.update(decoded)


def _register_before_parse(client, event: str, handler: Callable, unique_id: str) -> None:
    """Register ``handler`` on ``client``'s ``event`` once (a client without
    botocore's event system, a test fake, is left alone)."""
    events = getattr(getattr(client, "meta", None), "events", None)
    register = getattr(events, "register", None)
    if register is not None:
        # The segments' threads share a client; botocore's registration is not
        # atomic (two threads could both add the handler), so one at a time.
        with _REGISTER_LOCK:
            register(event, handler, unique_id=unique_id)


def fast_scan_decoding(client) -> None:
    """Let ``client``'s Scan pages be decoded by ``decode_scan_items``."""
    _register_before_parse(client, FAST_SCAN_EVENT, decode_scan_items, _SCAN_FAST_ID)


# The same for GetRecords pages: botocore's parser walks every image of every
# record through the model (docs/benchmarks.md, CPU per change). A record is
# decoded here only when every field is one the model knows, so the result is
# exactly botocore's (a field botocore would drop, or a value this does not know,
# leaves the page to botocore).
FAST_RECORDS_EVENT = "before-parse.dynamodb-streams.GetRecords"
_RECORDS_FAST_ID = "ddb2bt-fast-get-records"
_RECORD_STRINGS = frozenset({"eventID", "eventName", "eventVersion", "eventSource", "awsRegion"})
_STREAM_RECORD_STRINGS = frozenset({"SequenceNumber", "StreamViewType"})
_STREAM_RECORD_IMAGES = frozenset({"Keys", "NewImage", "OldImage"})
_IDENTITY_STRINGS = frozenset({"PrincipalId", "Type"})


def _wire_strings(struct, names: frozenset) -> dict:
    if type(struct) is not dict:
        raise _NotPlain()
    for name, value in struct.items():
        if name not in names or type(value) is not str:
            raise _NotPlain()
    return struct


def _wire_stream_record(ddb, timestamps: dict, parse_time: Callable) -> dict:
    if type(ddb) is not dict:
        raise _NotPlain()
    out = {}
    for name, value in ddb.items():
        if name in _STREAM_RECORD_IMAGES:
            out[name] = _wire_item(value)
        elif name in _STREAM_RECORD_STRINGS:
            if type(value) is not str:
                raise _NotPlain()
            out[name] = value
        elif name == "SizeBytes":
            if type(value) is not int:
                raise _NotPlain()
            out[name] = value
        elif name == "ApproximateCreationDateTime":
            if type(value) not in (int, float):
                raise _NotPlain()
            # A page's records mostly share a few times (whole seconds on AWS):
            # botocore's parser (time zone lookups) runs once per distinct value.
            parsed = timestamps.get(value)
            if parsed is None:
                parsed = timestamps[value] = parse_time(value)
            out[name] = parsed
        else:
            raise _NotPlain()
    return out


def _wire_record(record, timestamps: dict, parse_time: Callable) -> dict:
    if type(record) is not dict:
        raise _NotPlain()
    out = {}
    for name, value in record.items():
        if name in _RECORD_STRINGS:
            if type(value) is not str:
                raise _NotPlain()
            out[name] = value
        elif name == "dynamodb":
            out[name] = _wire_stream_record(value, timestamps, parse_time)
        elif name == "userIdentity":
            out[name] = dict(_wire_strings(value, _IDENTITY_STRINGS))
        else:
            raise _NotPlain()
    return out


def decode_stream_records(response_dict: dict, customized_response_dict: dict, **_) -> None:
    """botocore ``before-parse`` hook of GetRecords: decode Records of a success
    response here (as ``decode_scan_items`` does a Scan page) and leave the rest
    (NextShardIterator) to botocore; anything unexpected is left to botocore."""
    if response_dict.get("status_code", _HTTP_OK_BELOW) >= _HTTP_OK_BELOW:
        return
    try:
        data = json.loads(response_dict["body"])
        if type(data) is not dict or "Records" not in data:
            return
        records = data["Records"]
        if type(records) is not list:
            return
        timestamps: dict = {}
        decoded = [_wire_record(record, timestamps, DEFAULT_TIMESTAMP_PARSER) for record in records]
    except (_NotPlain, KeyError, ValueError, TypeError):  # binascii.Error is a ValueError
        return
    rest = {k: v for k, v in data.items() if k != "Records"}
    response_dict["body"] = json.dumps(rest).encode("utf-8")
    customized_response_dict["Records"] = decoded


def fast_records_decoding(client) -> None:
    """Let ``client``'s GetRecords pages be decoded by ``decode_stream_records``."""
    _register_before_parse(client, FAST_RECORDS_EVENT, decode_stream_records, _RECORDS_FAST_ID)


@dataclass(frozen=True)
class ScanPage:
    items: list  # raw AttributeValue items, as boto3 returns them
    start_key: Optional[dict]  # the ExclusiveStartKey this page was read with
    last_key: Optional[dict]  # LastEvaluatedKey: None on the segment's last page
    consumed: float  # capacity units


def scan_pages(client, table: str, *, segment: Optional[int] = None, total_segments: Optional[int] = None,
               start_key: Optional[dict] = None, consistent_read: bool = False,
               page_limit: Optional[int] = SCAN_PAGE_LIMIT, bucket: Optional[TokenBucket] = None,
               retry: RetryPolicy = DEFAULT_READ_RETRY, what: Optional[str] = None,
               metrics_table: Optional[str] = None,
               between_attempts: Optional[Callable[[], None]] = None) -> Iterator[ScanPage]:
    """Every page of a Scan (or of one segment), from ``start_key`` on.
    ``metrics_table`` (here and below): the table's name in the job, which
    labels the calls counted (count_api_call). ``between_attempts``: run before
    each retry (the backfill's lease check)."""
    fast_scan_decoding(client)
    start = start_key
    while True:
        kwargs = {"TableName": table, "ConsistentRead": consistent_read, "ReturnConsumedCapacity": "TOTAL"}
        if page_limit:
            kwargs["Limit"] = page_limit
        if total_segments is not None:
            kwargs["Segment"], kwargs["TotalSegments"] = segment, total_segments
        if start:
            kwargs["ExclusiveStartKey"] = start
        page = _retried("Scan", lambda: client.scan(**kwargs), retry, what, table=table, where=endpoint_of(client),
                        metrics_table=metrics_table, between_attempts=between_attempts)
        consumed = float((page.get("ConsumedCapacity") or {}).get("CapacityUnits", 0.0))
        if bucket is not None:
            bucket.consume(consumed)
        last = page.get("LastEvaluatedKey")
        yield ScanPage(page.get("Items", []), start, last, consumed)
        # Dropped before the next page is fetched and decoded: this frame must
        # not keep a page's items alive meanwhile (two 1 MB pages per segment
        # thread instead of one; docs/benchmarks.md, Verify).
        page = None
        if not last:
            return
        start = last


def scan_items(client, table: str, *, limit: Optional[int] = None, consistent_read: bool = True,
               retry: RetryPolicy = DEFAULT_READ_RETRY, metrics_table: Optional[str] = None) -> Iterator[dict]:
    """The table's items (raw AttributeValue maps), at most ``limit`` of them."""
    seen = 0
    for page in scan_pages(client, table, consistent_read=consistent_read, retry=retry, metrics_table=metrics_table,
                           page_limit=min(SCAN_PAGE_LIMIT, limit) if limit else SCAN_PAGE_LIMIT):
        for item in page.items:
            if limit is not None and seen >= limit:
                return
            seen += 1
            yield item


def parallel_scan(client, table: str, segments: int, *, consistent_read: bool,
                  on_page: Callable[[int], None] = lambda n: None, keep: Callable[[dict], bool] = lambda item: True,
                  retry: RetryPolicy = DEFAULT_READ_RETRY, metrics_table: Optional[str] = None) -> list:
    """Every item ``keep`` accepts, read by ``segments`` parallel segment scans."""
    items: list = []
    lock = threading.Lock()

    def segment(i: int) -> None:
        for page in scan_pages(client, table, segment=i, total_segments=segments, consistent_read=consistent_read,
                               page_limit=None, retry=retry, metrics_table=metrics_table):
            got = [it for it in page.items if keep(it)]
            with lock:
                items.extend(got)
            on_page(len(page.items))

    with ThreadPoolExecutor(max_workers=min(segments, MAX_SCAN_THREADS)) as pool:
        list(pool.map(segment, range(segments)))
    return items


def get_item(client, table: str, key: dict, retry: RetryPolicy = DEFAULT_READ_RETRY,
             metrics_table: Optional[str] = None) -> Optional[dict]:
    """The item's current state (strongly consistent), or None when it is gone."""
    response = _retried("GetItem", lambda: client.get_item(TableName=table, Key=key, ConsistentRead=True), retry,
                        table=table, where=endpoint_of(client), metrics_table=metrics_table)
    return response.get("Item")


def describe_table(client, table: str, retry: RetryPolicy = DEFAULT_READ_RETRY,
                   metrics_table: Optional[str] = None) -> dict:
    """DescribeTable's ``Table``; ``SourceTableMissing`` naming the table when it does not exist."""
    return _retried("DescribeTable", lambda: client.describe_table(TableName=table), retry, table=table,
                    metrics_table=metrics_table)["Table"]


# --- Streams ---------------------------------------------------------------------

@dataclass(frozen=True)
class Listing:
    shards: dict = field(default_factory=dict)  # shard id -> parent id or None
    closed_ids: frozenset = frozenset()
    descriptions: dict = field(default_factory=dict)  # shard id -> the service's shard description


def _describe_pages(client, stream_arn: str, call: Callable, **extra) -> Iterator[dict]:
    """Every page of DescribeStream (``extra``: a ShardFilter), one call each."""
    start: Optional[str] = None
    while True:
        kwargs = {"StreamArn": stream_arn, "Limit": DESCRIBE_LIMIT, **extra}
        if start:
            kwargs["ExclusiveStartShardId"] = start
        desc = call("DescribeStream", lambda: client.describe_stream(**kwargs))["StreamDescription"]
        yield desc
        start = desc.get("LastEvaluatedShardId")
        if not start:
            return


def list_children(client, stream_arn: str, shard_id: str, call: Callable) -> dict:
    """{child id: description} of ``shard_id``: DescribeStream with ShardFilter
    CHILD_SHARDS (one call, not a listing of every shard of the stream)."""
    return {s["ShardId"]: s for desc in _describe_pages(client, stream_arn, call, ShardFilter={
        "Type": "CHILD_SHARDS", "ShardId": shard_id}) for s in desc.get("Shards", [])}


def list_shards(client, stream_arn: str, call: Optional[Callable] = None,
                retry: RetryPolicy = DEFAULT_READ_RETRY, metrics_table: Optional[str] = None) -> Listing:
    """All shards of the stream (DescribeStream, paginated). ``call(operation, fn)``
    runs one remote call (the reader passes its own, which counts metrics); by
    default each page is retried under ``retry``."""
    if call is None:
        call = lambda operation, fn: _retried(operation, fn, retry,  # noqa: E731
                                              where=endpoint_of(client, "DynamoDB Streams"),
                                              table=table_of_stream(stream_arn), metrics_table=metrics_table)
    shards: dict = {}
    descriptions: dict = {}
    closed = set()
    for desc in _describe_pages(client, stream_arn, call):
        for s in desc.get("Shards", []):
            shards[s["ShardId"]] = s.get("ParentShardId")
            descriptions[s["ShardId"]] = s
            if s.get("SequenceNumberRange", {}).get("EndingSequenceNumber"):
                closed.add(s["ShardId"])
    return Listing(shards, frozenset(closed), descriptions)


# --- AWS's limits --------------------------------------------------------------------

# DynamoDB Streams allows 10 DescribeStream calls per second per stream (more are
# throttled): the full listings of a stream by all the job's processes keep to
# half of it, leaving the rest to the CHILD_SHARDS look-ups after a shard closes
# and to other readers of the stream (status, another job).
DESCRIBE_STREAM_BUDGET_PER_S = 5.0
# Every DescribeStream call of the job's readers, over all their processes (and
# every job of the same state table), takes a slot of one shared schedule of
# this many per second (control/shared_rate.py): the limit holds even when 16
# workers start together and each lists every page. The slots are 1/6 s apart;
# a call runs a little after its slot (later when taking the slot was slow), so
# a one-second window may see a few more than six: 7 to 8 at most in the
# simulation's runs, leaving room for `status` and other readers of the stream.
DESCRIBE_STREAM_SHARED_PER_S = 6.0

# DynamoDB Streams allows 5 GetRecords calls per second per shard (more are
# throttled, and a Lambda trigger on the table shares the budget).
GET_RECORDS_PER_SHARD_PER_S = 5
# Every Streams call answers in well under a second (GetRecords, a 100-shard
# DescribeStream page): a request without an answer after this long is lost
# (a silent network partition), not slow. Connect + read stays well under 15 s,
# so the first failure is a WARNING naming the call and the endpoint by then.
STREAMS_CONNECT_TIMEOUT_S = 3.0
STREAMS_READ_TIMEOUT_S = 5.0


class ShardPacer:
    """At most ``per_second`` calls per second per shard: a call waits until
    1/per_second after the previous call on the same shard (other shards' calls
    in between count as waiting). One per reader (a shard has one reader);
    a reader that takes over a shard learns its last call (``called_ago``) from
    the restriction it resumes (stream_source.PartitionRestriction.called)."""

    def __init__(self, per_second: float = GET_RECORDS_PER_SHARD_PER_S,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self._gap = 1.0 / per_second
        self._clock, self._sleep = clock, sleep
        self._last: dict = {}

    def wait(self, shard_id: str) -> None:
        last = self._last.get(shard_id)
        if last is not None:
            wait = last + self._gap - self._clock()
            if wait > 0:
                self._sleep(wait)
        self._last[shard_id] = self._clock()

    def ready_in(self, shard_id: str, at_least_s: float = 0.0) -> float:
        """Seconds until a call on ``shard_id`` may be made (0: now), or until
        ``at_least_s`` after its last call if that is later (an idle shard's poll)."""
        last = self._last.get(shard_id)
        return 0.0 if last is None else max(0.0, last + max(self._gap, at_least_s) - self._clock())

    def forget(self, shard_id: str) -> None:
        self._last.pop(shard_id, None)

    def called_ago(self, shard_id: str, seconds: float) -> None:
        """A call on ``shard_id`` was made ``seconds`` ago by another reader (the
        restriction's last holder): known unless this pacer saw a later one."""
        at = self._clock() - seconds
        last = self._last.get(shard_id)
        if last is None or at > last:
            self._last[shard_id] = at


def listing_spacing_s(shards: int, listers: int, budget_per_s: float = DESCRIBE_STREAM_BUDGET_PER_S) -> float:
    """Seconds between two full listings of a stream of ``shards`` by each of
    ``listers`` processes, for all of them together to make at most
    ``budget_per_s`` DescribeStream calls per second (a listing is one call per
    100 shards)."""
    pages = max(1, -(-shards // DESCRIBE_LIMIT))
    return pages * max(1, listers) / budget_per_s


class ShardDirectory:
    """One shard discovery per stream per process, shared by its partitions.

    DescribeStream is limited per stream (10 calls per second) and a large table
    has thousands of shards (ten 100-shard pages per 1,000): each partition
    listing them every discovery interval would multiply the calls by the
    partition count. ``listing(max_age_s, listers)`` returns the stream's last
    listing when it is younger than that — or than the spacing that keeps
    ``listers`` processes listing it within DESCRIBE_STREAM_BUDGET_PER_S
    together (listing_spacing_s) — else lists once; partitions asking meanwhile
    wait for that one listing. So the calls per second depend on the stream and
    the number of listing processes, never on how many partitions read it.
    After a shard closes, ``children`` asks for its children only (ShardFilter
    CHILD_SHARDS: one call) and adds them to the listing every partition of
    the process sees."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._streams: dict = {}  # stream arn -> (monotonic time listed, Listing)
        self._listing_locks: dict = {}
        self._no_filter: set = set()  # streams whose endpoint has no ShardFilter (emulators, Kinesis)

    def _stream_lock(self, stream_arn: str) -> threading.Lock:
        with self._lock:
            return self._listing_locks.setdefault(stream_arn, threading.Lock())

    def listing(self, client, stream_arn: str, call: Optional[Callable], max_age_s: float,
                listers: int = 1) -> Listing:
        with self._stream_lock(stream_arn):  # one listing of a stream at a time; the others then reuse it
            cached = self._streams.get(stream_arn)
            if cached is not None:
                age_s = max(max_age_s, listing_spacing_s(len(cached[1].shards), listers))
                if self._clock() - cached[0] < age_s:
                    return cached[1]
            listing = list_shards(client, stream_arn, call)
            self._streams[stream_arn] = (self._clock(), listing)
            return listing

    def children(self, client, stream_arn: str, closed: list, call: Callable, max_age_s: float,
                 listers: int = 1) -> Listing:
        """The listing with the children of the ``closed`` shards added (one
        CHILD_SHARDS call each); a full listing when there is none yet or the
        endpoint has no ShardFilter (then at most ``max_age_s`` old)."""
        with self._stream_lock(stream_arn):
            cached = self._streams.get(stream_arn)
            if cached is not None and stream_arn not in self._no_filter:
                listed_at, listing = cached
                shards, descriptions = dict(listing.shards), dict(listing.descriptions)
                try:
                    for parent in closed:
                        for child_id, desc in list_children(client, stream_arn, parent, call).items():
                            shards[child_id] = desc.get("ParentShardId")
                            descriptions[child_id] = desc
                except (PermanentError, TypeError):  # no ShardFilter here (an emulator, the Kinesis adapter)
                    self._no_filter.add(stream_arn)
                else:
                    listing = Listing(shards, listing.closed_ids | frozenset(closed), descriptions)
                    self._streams[stream_arn] = (listed_at, listing)
                    return listing
        return self.listing(client, stream_arn, call, max_age_s, listers=listers)

    def forget(self, stream_arn: Optional[str] = None) -> None:
        with self._lock:
            if stream_arn is None:
                self._streams.clear()
            else:
                self._streams.pop(stream_arn, None)


_DIRECTORY = ShardDirectory()


def shard_directory() -> ShardDirectory:
    """This process's shard directory."""
    return _DIRECTORY


# --- Query (the rollback reads the items of one partition) -----------------------------

def query_partition(client, table: str, attribute: str, value: dict, retry: RetryPolicy = DEFAULT_READ_RETRY,
                    metrics_table: Optional[str] = None) -> list:
    """Every item whose partition key ``attribute`` is ``value`` (strongly consistent)."""
    items: list = []
    kwargs = {"TableName": table, "ConsistentRead": True, "KeyConditionExpression": "#p = :p",
              "ExpressionAttributeNames": {"#p": attribute}, "ExpressionAttributeValues": {":p": value}}
    while True:
        page = _retried("Query", lambda: client.query(**kwargs), retry, table=table, where=endpoint_of(client),
                        metrics_table=metrics_table)
        items += page.get("Items", [])
        if not page.get("LastEvaluatedKey"):
            return items
        kwargs["ExclusiveStartKey"] = page["LastEvaluatedKey"]
