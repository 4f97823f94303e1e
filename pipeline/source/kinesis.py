"""Kinesis Data Streams for DynamoDB as a source (docs/kinesis.md).

DynamoDB can write an item's changes into a Kinesis data stream instead of (or
next to) a DynamoDB stream. The reading machinery is the DynamoDB Streams
reader's (``stream_source.PartitionReader``: partitions of shards, parents before
children, per-shard checkpoints in the state table, resume, lag, trimmed data
stopping loudly): ``KinesisStreamsClient`` gives it a Kinesis stream through the
three calls it makes (DescribeStream, GetShardIterator, GetRecords), with
Kinesis's own limits kept (``ShardPacer``) and every record decoded from the
published JSON shape into the DynamoDB Streams record shape
(``decode_kinesis_record``).

What differs, and where it is handled:
* records of one item can arrive out of order and twice: the writes go through
  the ordering guard (``ddb2bt.transforms.ordering``, docs/design.md §10);
* ``ApproximateCreationDateTime`` is epoch milliseconds or microseconds (the
  destination's ``ApproximateCreationDateTimePrecision``): both are decoded, and
  the microseconds kept for the guard;
* several tables can share one stream: each table's job reads it as a stream of
  its own, ``kinesis_stream_arn(...)`` — a DynamoDB-stream-shaped name carrying
  the table, so routing, checkpoints, metrics and leases stay per table — and
  keeps only the records whose ``tableName`` is its table. Every reader of a
  shard spends the shard's one read budget, so each table is paced to its
  *share* of it, wherever it runs (``kinesis_share.py``, docs/design.md §10.8);
* Kinesis does not say "trimmed" when a checkpoint's record has expired (it
  silently starts later): on resume the reader asks for the checkpointed record
  itself (AT_SEQUENCE_NUMBER) and, if another record comes back, reports
  ``TrimmedDataAccessException`` so the job stops loudly (docs/design.md §8).
"""
from __future__ import annotations

import base64
import datetime as _dt
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from botocore.exceptions import ClientError

from ddb2bt.transforms.attrs import item_from_dynamodb_json
from ddb2bt.pipeline.clients.dynamodb import StreamThrottled
from ddb2bt.pipeline.connect.connections import aws_client
from ddb2bt.pipeline.observe.metrics import default_metrics
from ddb2bt.pipeline.source.stream_source import OTHER_TABLES_RECORDS
from ddb2bt.transforms.errors import ConfigError, PermanentError

log = logging.getLogger(__name__)

__all__ = ["KinesisClientFactory", "KinesisSource", "KinesisStreamsClient", "ShardPacer", "decode_kinesis_record",
           "kinesis_stream_arn", "parse_kinesis_stream_arn", "resolve_kinesis"]

# Kinesis's per-shard read limits for shared-throughput consumers (AWS: "Quotas
# and limits", GetRecords): 5 calls per second per shard and 2 MB per second per
# shard, shared by every consumer of the stream. The pacer keeps each consumer
# of a shard under its share of both (docs/design.md §10.8).
GET_RECORDS_PER_SECOND = 5
READ_BYTES_PER_SECOND = 2 * 1024 * 1024
# GetRecords returns up to 10,000 records / 10 MB per call; the reader asks for
# what the DynamoDB Streams reader asks (1,000), a page the sink batches whole.
KINESIS_MAX_RECORDS = 10_000

# Kinesis may answer GetRecords with empty pages before the records at an
# iterator's position ("GetRecords" API: follow NextShardIterator; a
# MillisBehindLatest above 0 says records lie ahead). The trimmed check follows
# this many empty pages before it gives up for this round (retried, never
# taken as trimmed): at 5 calls/s, 10 s of following.
MAX_EMPTY_PAGES_AT_CHECKPOINT = 50
# A millisecond epoch stays below 1e14 until the year 5138; a microsecond epoch
# is above it since 1973: the magnitude tells the precision apart.
MICROSECOND_THRESHOLD = 10 ** 14
PRECISIONS = ("auto", "millisecond", "microsecond")
# A record time outside [floor, now + skew] cannot be a change of this table: a
# precision read wrongly (seconds taken for milliseconds: January 1970), or a
# corrupt record. Written, its cells would carry that time, and the ordering
# guard would drop every later change as older than it, or keep it above them.
# So the reader stops before anything is written (docs/kinesis.md).
# The floor: Kinesis Data Streams for DynamoDB launched on 2020-11-23, and no
# record is older than the stream's retention (plus a margin: Kinesis trims
# lazily, and its clock is not ours).
KINESIS_FOR_DYNAMODB_SINCE_MS = 1_606_089_600_000  # 2020-11-23T00:00:00Z
RECORD_AGE_MARGIN_S = 3600.0
# How far ahead of this host's clock a record may be: AWS's clock and ours
# (NTP keeps them within a second; docs/design.md §6.6 allows 2 s elsewhere).
MAX_RECORD_AHEAD_S = 300.0
MAX_RETENTION_S = 8760 * 3600  # Kinesis's longest retention (365 days): the floor before the stream is described

# The stream name a table's job reads, in the DynamoDB-stream ARN shape the
# reader, router and checkpoints key on: the label says it is Kinesis.
KINESIS_LABEL = "kinesis-"
TTL_PRINCIPAL = "dynamodb.amazonaws.com"


def kinesis_stream_arn(table: str, stream: str, region: str = "local", account: str = "000000000000") -> str:
    """The per-table name of a Kinesis stream: ``arn:aws:dynamodb:R:A:table/T/stream/kinesis-NAME``."""
    name = stream.rsplit("/", 1)[-1] if stream.startswith("arn:") else stream
    return f"arn:aws:dynamodb:{region}:{account}:table/{table}/stream/{KINESIS_LABEL}{name}"


def parse_kinesis_stream_arn(arn: str) -> Optional[tuple]:
    """(table, stream name) of a ``kinesis_stream_arn``; None for a DynamoDB stream."""
    marker = f"/stream/{KINESIS_LABEL}"
    if marker not in arn or ":table/" not in arn:
        return None
    head, name = arn.split(marker, 1)
    return head.split(":table/", 1)[1], name


def _image(value) -> Optional[dict]:
    return item_from_dynamodb_json(value) if value is not None else None


def decode_kinesis_record(record: dict, table: Optional[str], precision: str = "auto") -> Optional[dict]:
    """A Kinesis record (boto3 ``get_records`` form: ``Data`` bytes) → a record in
    the DynamoDB Streams shape ``records.from_stream_record`` reads, or None when it
    belongs to another table. Malformed data is passed on with what could be read
    (no Keys, no time), so the mapping dead-letters it with the reason rather than
    the reader failing."""
    data = record.get("Data")
    try:
        doc = json.loads(data if isinstance(data, (bytes, str)) else base64.b64decode(data))
    except (ValueError, TypeError):
        doc = {}
    if table is not None and doc.get("tableName") not in (None, table):
        return None
    ddb = doc.get("dynamodb") or {}
    out_ddb: dict = {"SequenceNumber": record["SequenceNumber"]}
    try:
        if "Keys" in ddb:
            out_ddb["Keys"] = item_from_dynamodb_json(ddb["Keys"])
        for name in ("NewImage", "OldImage"):
            if ddb.get(name) is not None:
                out_ddb[name] = _image(ddb[name])
    except Exception:  # an image that does not decode: the mapping dead-letters the record
        out_ddb.pop("Keys", None)
    created = ddb.get("ApproximateCreationDateTime")
    change_us = None
    if isinstance(created, (int, float)) and not isinstance(created, bool):
        change_us = _to_micros(int(created), precision)
        out_ddb["ApproximateCreationDateTime"] = _dt.datetime.fromtimestamp(
            change_us // 1_000_000, _dt.timezone.utc).replace(microsecond=change_us % 1_000_000)
    size = ddb.get("SizeBytes")
    out_ddb["SizeBytes"] = size if isinstance(size, int) else len(data or b"")
    identity = doc.get("userIdentity") or {}
    out: dict = {
        "eventID": doc.get("eventID", ""),
        "eventName": doc.get("eventName", ""),
        "dynamodb": out_ddb,
        "tableName": doc.get("tableName"),
    }
    if identity:
        # Kinesis writes {"type", "principalId"}; DynamoDB Streams {"Type", "PrincipalId"}.
        out["userIdentity"] = {"Type": identity.get("type", identity.get("Type")),
                               "PrincipalId": identity.get("principalId", identity.get("PrincipalId"))}
    if change_us is not None:
        out["changeMicros"] = change_us
        out["rawCreated"] = created  # as published, for a message about an impossible time
    return out


def _to_micros(value: int, precision: str) -> int:
    if precision == "microsecond" or (precision == "auto" and value >= MICROSECOND_THRESHOLD):
        return value
    return value * 1000


class ShardPacer:
    """Keeps GetRecords on each shard within a consumer's share of Kinesis's
    per-shard limits: at most ``share`` × GET_RECORDS_PER_SECOND calls per second,
    and on average ``share`` × READ_BYTES_PER_SECOND (a page of B bytes makes the
    consumer's next call on that shard wait B / its byte rate). Paced per
    (consumer, shard): a consumer is one table of one job, and the shares of all
    the consumers of a stream add up to at most 1, so the stream's budget holds
    however the consumers are spread over processes and workers (docs/design.md
    §10.8). One pacer per process (``PROCESS_PACER``)."""

    def __init__(self, calls_per_s: float = GET_RECORDS_PER_SECOND, bytes_per_s: float = READ_BYTES_PER_SECOND,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self._calls_per_s = calls_per_s
        self._bytes_per_s = bytes_per_s
        self._clock = clock
        self._sleep = sleep
        self._next: dict = {}  # (consumer, shard) -> earliest time of the next call
        self._lock = threading.Lock()
        self.waited_s = 0.0

    def before_call(self, consumer: str, shard: str, share: float = 1.0) -> None:
        with self._lock:
            now = self._clock()
            at = max(now, self._next.get((consumer, shard), now))
            self._next[(consumer, shard)] = at + 1.0 / (self._calls_per_s * share)
        if at > now:
            self.waited_s += at - now
            self._sleep(at - now)

    def after_call(self, consumer: str, shard: str, nbytes: int, share: float = 1.0) -> None:
        with self._lock:
            key = (consumer, shard)
            self._next[key] = max(self._next.get(key, 0.0), self._clock() + nbytes / (self._bytes_per_s * share))


PROCESS_PACER = ShardPacer()


class KinesisStreamsClient:
    """A Kinesis stream behind the DynamoDB Streams calls the reader makes, for one
    table (``table``; None: every record). ``kinesis`` is a boto3 ``kinesis``
    client; ``stream`` its stream name or ARN."""

    def __init__(self, kinesis, stream: str, table: Optional[str], precision: str = "auto",
                 pacer: Optional[ShardPacer] = None, start_timestamp: Optional[_dt.datetime] = None,
                 now_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000, share: float = 1.0) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"a share of a Kinesis stream's read budget is in (0, 1], got {share}")
        self._k = kinesis
        self._now_ms = now_ms
        self._stream = {"StreamARN": stream} if stream.startswith("arn:") else {"StreamName": stream}
        self._name = stream
        self._table = table
        self._precision = precision
        self._pacer = pacer or PROCESS_PACER
        # This table's share of every shard's read budget (docs/design.md §10.8),
        # paced per (stream and table, shard): the tables of one process no
        # longer pool a budget another process's readers of the stream also spend.
        self._share = share
        self._consumer = f"{stream}#{table}"
        # AT_TIMESTAMP: shards started fresh start at this time instead of the
        # start mode (migrate: the tail from the handoff time).
        self._start_timestamp = start_timestamp
        self._iterators: dict = {}  # iterator -> shard id (pacing is per shard)
        self.meta = getattr(kinesis, "meta", None)
        self._retention_s: Optional[float] = None
        self._ending: dict = {}  # closed shard -> (starting, ending sequence number)
        self._last_seen: dict = {}  # shard -> last sequence number read or resumed after

    @property
    def calls_per_s(self) -> float:
        """GetRecords per second per shard this client may make (its share of
        Kinesis's 5): the reader paces its rounds to it (stream_source.PartitionReader)."""
        return GET_RECORDS_PER_SECOND * self._share

    @property
    def retention_s(self) -> Optional[float]:
        """The stream's retention once described (24 h to 365 days), for the
        reader's proof that a trimmed checkpoint lost nothing (docs/design.md §8.2)."""
        return self._retention_s

    # DynamoDB Streams: DescribeStream(StreamArn, Limit, ExclusiveStartShardId)
    def describe_stream(self, StreamArn: str, Limit: int = 100, ExclusiveStartShardId: Optional[str] = None) -> dict:
        shards: list = []
        kwargs: dict = dict(self._stream)
        while True:
            page = self._k.list_shards(**kwargs)
            for s in page.get("Shards", []):
                # A merge's child has two parents; the reader waits for ParentShardId.
                # Not waiting for the adjacent parent only lets more changes arrive
                # out of order, which the ordering guard absorbs (docs/kinesis.md).
                shards.append({"ShardId": s["ShardId"], "ParentShardId": s.get("ParentShardId"),
                               "SequenceNumberRange": s.get("SequenceNumberRange", {})})
                ending = s.get("SequenceNumberRange", {}).get("EndingSequenceNumber")
                if ending is not None:
                    self._ending[s["ShardId"]] = (int(s["SequenceNumberRange"].get("StartingSequenceNumber", 0)),
                                                  int(ending))
            token = page.get("NextToken")
            if not token:
                break
            kwargs = {"NextToken": token}
        if self._retention_s is None:
            hours = self._k.describe_stream_summary(**self._stream)["StreamDescriptionSummary"].get(
                "RetentionPeriodHours", 24)
            self._retention_s = hours * 3600

            default_metrics().lag.set_retention(StreamArn, self._retention_s)  # the headroom gauge's window
        return {"StreamDescription": {"StreamArn": StreamArn, "Shards": shards, "StreamStatus": "ENABLED",
                                      "StreamViewType": "NEW_AND_OLD_IMAGES"}}

    # The reader may ask for AT_TIMESTAMP (Kinesis has it, DynamoDB Streams not): a
    # LATEST position re-read from its first iterator's time, not from TRIM_HORIZON.
    reads_at_timestamp = True

    def get_shard_iterator(self, StreamArn: str, ShardId: str, ShardIteratorType: str,
                           SequenceNumber: Optional[str] = None, Timestamp=None) -> dict:
        kwargs: dict = dict(self._stream, ShardId=ShardId)
        if ShardIteratorType == "AFTER_SEQUENCE_NUMBER":
            self._check_not_trimmed(ShardId, SequenceNumber)
            self._last_seen[ShardId] = int(SequenceNumber)
            kwargs.update(ShardIteratorType="AFTER_SEQUENCE_NUMBER", StartingSequenceNumber=SequenceNumber)
        elif ShardIteratorType == "AT_TIMESTAMP":
            kwargs.update(ShardIteratorType="AT_TIMESTAMP", Timestamp=Timestamp)
        elif self._start_timestamp is not None:
            kwargs.update(ShardIteratorType="AT_TIMESTAMP", Timestamp=self._start_timestamp)
        else:
            kwargs.update(ShardIteratorType=ShardIteratorType)
        iterator = self._k.get_shard_iterator(**kwargs)["ShardIterator"]
        self._iterators[iterator] = ShardId
        return {"ShardIterator": iterator}

    def _check_not_trimmed(self, shard_id: str, sequence_number: str) -> None:
        """The checkpointed record must still be in the shard: Kinesis would start
        at the oldest record instead, silently skipping what expired. An empty
        page proves nothing while the shard has records ahead (MillisBehindLatest
        above 0, or a missing one) and hands out a next iterator: it is followed.
        Only a record other than the checkpoint's, or nothing up to the tip or the
        end of a closed shard, is "trimmed"."""
        records: list = []
        try:
            it = self._k.get_shard_iterator(**self._stream, ShardId=shard_id, ShardIteratorType="AT_SEQUENCE_NUMBER",
                                            StartingSequenceNumber=sequence_number)["ShardIterator"]
            for _ in range(MAX_EMPTY_PAGES_AT_CHECKPOINT):
                self._pacer.before_call(self._consumer, shard_id, self._share)
                page = self._k.get_records(ShardIterator=it, Limit=1)
                records = page.get("Records") or []
                it = page.get("NextShardIterator")
                if records or it is None or page.get("MillisBehindLatest", 1) == 0:
                    break
            else:
                raise StreamThrottled(f"GetRecords on {shard_id}: {MAX_EMPTY_PAGES_AT_CHECKPOINT} empty pages at "
                                      f"the checkpoint (sequence number {sequence_number}) with records still "
                                      "ahead; looked again next round, not taken as trimmed")
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "InvalidArgumentException":
                raise
            records = []
        if records and records[0]["SequenceNumber"] == sequence_number:
            return
        raise ClientError({"Error": {"Code": "TrimmedDataAccessException", "Message": (
            f"the record at sequence number {sequence_number} of shard {shard_id} is no longer in the "
            "Kinesis stream (older than its retention period)")}}, "GetShardIterator")

    def get_records(self, ShardIterator: str, Limit: int = 1000) -> dict:
        shard = self._iterators.pop(ShardIterator, "?")
        self._pacer.before_call(self._consumer, shard, self._share)
        page = self._k.get_records(ShardIterator=ShardIterator, Limit=min(Limit, KINESIS_MAX_RECORDS))
        raw = page.get("Records") or []
        self._pacer.after_call(self._consumer, shard, sum(len(r.get("Data") or b"") for r in raw), self._share)
        records = [d for d in (decode_kinesis_record(r, self._table, self._precision) for r in raw) if d is not None]
        self._check_times(shard, records)
        if raw:
            self._last_seen[shard] = int(raw[-1]["SequenceNumber"])
        nxt = page.get("NextShardIterator")
        if nxt is not None and not raw and self._read_to_end(shard):
            # AWS ends a closed shard's iteration with a null NextShardIterator;
            # an endpoint that keeps handing out iterators (moto) is ended here
            # once nothing is left up to the shard's ending sequence number.
            nxt = None
        if nxt is not None:
            self._iterators[nxt] = shard
        # Other tables' records are dropped: the reader moves on with NextShardIterator
        # (its checkpoint stays at its own table's last record). It is told how many,
        # so a page of only theirs is not taken for an empty one (OTHER_TABLES_RECORDS).
        out = {"Records": records, "NextShardIterator": nxt}
        if len(raw) > len(records):
            out[OTHER_TABLES_RECORDS] = len(raw) - len(records)
        if "MillisBehindLatest" in page:  # the service's own lag: the reader's catch-up rule takes it (§7.8)
            out["MillisBehindLatest"] = page["MillisBehindLatest"]
        return out

    def _check_times(self, shard: str, records: list) -> None:
        """Every record's time must be one a change of this table can have
        (KINESIS_FOR_DYNAMODB_SINCE_MS, the retention, MAX_RECORD_AHEAD_S), else
        ConfigError naming the record and ``precision``: nothing of the page is
        written, and the checkpoint stays before it."""
        if not records:
            return
        now = self._now_ms()
        retention_s = self._retention_s if self._retention_s is not None else MAX_RETENTION_S
        floor = max(KINESIS_FOR_DYNAMODB_SINCE_MS, now - int((retention_s + RECORD_AGE_MARGIN_S) * 1000))
        ceiling = now + int(MAX_RECORD_AHEAD_S * 1000)
        for record in records:
            us = record.get("changeMicros")
            if us is None or floor <= us // 1000 <= ceiling:
                continue

            at = _dt.datetime.fromtimestamp(us / 1_000_000, _dt.timezone.utc).isoformat(timespec="milliseconds")
            why = (f"more than {MAX_RECORD_AHEAD_S:g}s ahead of this host's clock" if us // 1000 > ceiling else
                   "before Kinesis Data Streams for DynamoDB existed" if us // 1000 < KINESIS_FOR_DYNAMODB_SINCE_MS
                   else "older than the stream's retention")
            raise ConfigError(
                f"record {record['dynamodb']['SequenceNumber']} of shard {shard} in Kinesis stream {self._name} "
                f"(eventID {record.get('eventID') or '?'}) has ApproximateCreationDateTime "
                f"{record.get('rawCreated')}, read with precision {self._precision!r} as {at}: {why}. Its cells "
                "would be written at that time; nothing was written. Set source.kinesis.precision to the "
                "destination's ApproximateCreationDateTimePrecision (millisecond or microsecond), or check this "
                "host's clock", "source.kinesis.precision")

    def _read_to_end(self, shard: str) -> bool:
        bounds = self._ending.get(shard)
        if bounds is None:
            return False
        starting, ending = bounds
        last = self._last_seen.get(shard)
        return ending <= starting or (last is not None and last >= ending)

    def close(self) -> None:
        close = getattr(self._k, "close", None)
        if close:
            close()


@dataclass(frozen=True)
class KinesisClientFactory:
    """Builds the reader's client on the worker: a boto3 ``kinesis`` client (its
    endpoint from AWS_ENDPOINT_URL_KINESIS when set: the local stack) behind
    ``KinesisStreamsClient`` for one table."""

    stream: str
    table: Optional[str]
    region: Optional[str] = None
    precision: str = "auto"
    start_timestamp_ms: Optional[int] = None
    # The table's share of each shard's read budget (kinesis_share.table_shares).
    share: float = 1.0

    def __call__(self) -> KinesisStreamsClient:
        from botocore.config import Config

        config = Config(retries={"mode": "standard", "total_max_attempts": 1}, connect_timeout=10, read_timeout=30)
        client = aws_client("kinesis", region_name=self.region, config=config)
        start = (_dt.datetime.fromtimestamp(self.start_timestamp_ms / 1000, _dt.timezone.utc)
                 if self.start_timestamp_ms is not None else None)
        return KinesisStreamsClient(client, self.stream, self.table, self.precision, start_timestamp=start,
                                    share=self.share)


@dataclass(frozen=True)
class KinesisSource:
    """What ``resolve_kinesis`` found: the per-table stream name the job reads
    (``kinesis_stream_arn``), the table, the Kinesis stream, its retention."""

    stream_arn: str
    table: str
    stream: str
    retention_hours: int
    # The Kinesis stream's own ARN: what the tables and jobs sharing its read
    # budget are registered under (kinesis_share.py).
    kinesis_arn: str = ""


def resolve_kinesis(mapping, kinesis=None) -> KinesisSource:
    """The mapping's Kinesis stream, checked to exist and be readable; fails with
    a ConfigError naming ``source.kinesis.stream`` otherwise."""
    from botocore.exceptions import BotoCoreError

    config = mapping.source.kinesis
    if kinesis is None:
        kinesis = aws_client("kinesis", region_name=mapping.source.region)
    target = {"StreamARN": config.stream} if config.stream.startswith("arn:") else {"StreamName": config.stream}
    try:
        summary = kinesis.describe_stream_summary(**target)["StreamDescriptionSummary"]
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code == "ResourceNotFoundException":
            raise ConfigError(f"Kinesis stream {config.stream!r} does not exist (in this account and region)",
                              "source.kinesis.stream") from None
        raise PermanentError(f"DescribeStreamSummary {config.stream}: {code}: "
                             f"{exc.response['Error'].get('Message', '')}") from None
    except BotoCoreError as exc:
        raise PermanentError(f"cannot reach Kinesis: {exc}") from None
    arn = summary.get("StreamARN", "")
    parts = arn.split(":")
    region = parts[3] if len(parts) > 4 else (mapping.source.region or "local")
    account = parts[4] if len(parts) > 4 else "000000000000"
    return KinesisSource(kinesis_stream_arn(mapping.source.table, summary["StreamName"], region, account),
                         mapping.source.table, config.stream, int(summary.get("RetentionPeriodHours", 24)),
                         arn or config.stream)
