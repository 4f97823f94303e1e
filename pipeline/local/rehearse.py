"""Rehearsing a recovery on the local stack (docs/recover.md, "Rehearse it
locally"): `ddb2bt local changes` writes changes to a mapping's source table,
`ddb2bt local trim` makes its stream forget what it holds (as 24 hours of
retention would), `ddb2bt local export-table-to-point-in-time` writes the
incremental exports `ddb2bt recover` asks for, in AWS's layout, to the stack's S3.

Only ever against the local stack: each refuses an endpoint that is not on the
loopback interface, so a rehearsal can never write to, trim or export from AWS.
"""
from __future__ import annotations

import datetime as _dt
import gzip
import hashlib
import io
import json
import os
import random
import secrets
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ddb2bt.pipeline.local import local_stack
from ddb2bt.pipeline.local.trim_proxy import TRIMS_FILE
from ddb2bt.transforms.errors import ConfigError

__all__ = ["ExportWritten", "Trimmed", "ensure_trim_proxy", "export_incremental", "export_lines", "local_endpoint",
           "parse_incremental_spec", "trim_stream", "write_changes"]

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
NEW_AND_OLD_IMAGES = "NEW_AND_OLD_IMAGES"
PAGE = 1000  # GetRecords' page limit (AWS's maximum)
TRIM_PROXY = "trim-proxy"  # its name among the stack's processes
STREAM_ENDPOINTS = ("AWS_ENDPOINT_URL_DYNAMODBSTREAMS", "AWS_ENDPOINT_URL_DYNAMODB_STREAMS")
# An export id as AWS spells it: 14 digits of the export's time in ms, a dash, 8 hex.
EXPORT_ID_HEX = 4  # bytes: 8 hex digits
DATA_FILE_HEX = 13  # bytes: the 26 hex digits of an export's data file name


def local_endpoint(variable: str = "AWS_ENDPOINT_URL_DYNAMODB") -> str:
    """The local stack's endpoint from the environment, refused unless on loopback."""
    url = os.environ.get(variable)
    if not url:
        raise local_stack.StackError(
            f"{variable} is not set: these rehearsal commands work only on the local stack. Start it and point "
            "the shell at it:  ddb2bt local up --detach && eval \"$(ddb2bt local env)\"")
    host = urllib.parse.urlparse(url).hostname
    if host not in LOCAL_HOSTS:
        raise ConfigError(f"{variable}={url} is not the local stack (not 127.0.0.1): a rehearsal never writes to, "
                          "trims or exports from a real service", variable)
    return url


def _clients():
    import boto3

    url = local_endpoint()
    return boto3.client("dynamodb", endpoint_url=url), boto3.client("dynamodbstreams", endpoint_url=url)


# --- changes ----------------------------------------------------------------------------


def write_changes(mapping, count: int, seed: Optional[int], items: int) -> tuple:
    """Create the mapping's source table if missing (a NEW_AND_OLD_IMAGES stream and
    point-in-time recovery on, as docs/recover.md asks) and write ``count`` changes of
    the demo's workload. Returns (changes written, whether the table was created)."""
    from ddb2bt.pipeline.local import workload

    key = mapping.source.key_attributes
    if tuple(key) != ("pk", "sk"):
        raise ConfigError(f"the rehearsal's changes are ProductCatalog-shaped (key pk, sk); this mapping's source "
                          f"key is {', '.join(key)}: use example:product_catalog or a copy of it", "source.key")
    ddb, _ = _clients()
    table = mapping.source.table
    created = False
    try:
        ddb.describe_table(TableName=table)
    except ddb.exceptions.ResourceNotFoundException:
        workload.create_table(ddb, table)
        created = True
    backups = ddb.update_continuous_backups(TableName=table, PointInTimeRecoverySpecification={
        "PointInTimeRecoveryEnabled": True})
    _after_earliest_restorable(backups)
    written = 0
    for op in workload.operations(seed if seed is not None else random.randrange(2 ** 31), count, items):
        written += workload.apply_quietly(ddb, table, op)
    return written, created


def _after_earliest_restorable(backups: dict) -> None:
    """Return once the clock is past the second of PITR's earliest restorable
    time: an export window begins on a whole second, and AWS refuses one that
    begins before that time, so changes written in the very second PITR was
    turned on could never be recovered (recover says so and refuses)."""
    earliest = (backups.get("ContinuousBackupsDescription", {}).get("PointInTimeRecoveryDescription", {})
                .get("EarliestRestorableDateTime"))
    if earliest is None:
        return
    at = earliest.timestamp() if isinstance(earliest, _dt.datetime) else float(earliest)
    next_second = int(at) + 1
    while time.time() < next_second:  # at most a second, once, when PITR was just turned on
        time.sleep(next_second - time.time())


# --- trimming ---------------------------------------------------------------------------


def _stream_arn(ddb, table: str) -> str:
    arn = ddb.describe_table(TableName=table)["Table"].get("LatestStreamArn")
    if not arn:
        raise ConfigError(f"table {table} has no stream", "source.table")
    return arn


def _shards(streams, arn: str) -> list:
    shards, start = [], None
    while True:
        desc = streams.describe_stream(StreamArn=arn, **({"ExclusiveStartShardId": start} if start else {}))
        shards += desc["StreamDescription"]["Shards"]
        start = desc["StreamDescription"].get("LastEvaluatedShardId")
        if not start:
            return shards


def _records(streams, arn: str, shard: str) -> list:
    """Every record of a shard the emulator holds (it never trims)."""
    out = []
    it = streams.get_shard_iterator(StreamArn=arn, ShardId=shard, ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
    while it:
        page = streams.get_records(ShardIterator=it, Limit=PAGE)
        records = page.get("Records") or []
        if not records:
            return out
        out += records
        it = page.get("NextShardIterator")
    return out


@dataclass(frozen=True)
class Trimmed:
    shard: str
    through: str  # sequence number of the last record gone
    lost: int  # records after the job's checkpoint that are gone


def trim_stream(mapping, checkpoints_of, state_path: Path) -> tuple:
    """Every record the source table's stream holds now is gone, as after 24 hours:
    the trim points are written to ``state_path``/trims.json for the trimming proxy.
    ``checkpoints_of(stream_arn)`` gives the job's checkpoints, to say what it lost.
    Returns (stream ARN, [Trimmed])."""
    ddb, streams = _clients()
    arn = _stream_arn(ddb, mapping.source.table)
    checkpoints = checkpoints_of(arn)
    out = []
    for shard in _shards(streams, arn):
        records = _records(streams, arn, shard["ShardId"])
        if not records:
            continue
        through = records[-1]["dynamodb"]["SequenceNumber"]
        ckpt = checkpoints.get(shard["ShardId"])
        after = int(ckpt.sequence_number) if ckpt is not None and (ckpt.sequence_number or "").isdigit() else -1
        lost = sum(1 for r in records if int(r["dynamodb"]["SequenceNumber"]) > after)
        out.append(Trimmed(shard["ShardId"], through, lost))
    path = state_path / TRIMS_FILE
    from ddb2bt.pipeline.local.trim_proxy import load_trims

    trims = load_trims(path)
    trims.setdefault(arn, {}).update({t.shard: t.through for t in out})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trims, indent=2))
    return arn, out


def ensure_trim_proxy(state_path: Path) -> bool:
    """Put the trimming proxy in front of the detached stack's DynamoDB Streams
    endpoint (once; `ddb2bt local down` stops it with the stack). True when the
    stack's variables changed (the shell must read them again)."""
    record = local_stack.load_state()
    if record is None:
        raise local_stack.StackError(
            "no detached local stack is running: `ddb2bt local trim` works on one. Start it with:  "
            "ddb2bt local up --detach && eval \"$(ddb2bt local env)\"")
    env = dict(record["env"])
    upstream = env["AWS_ENDPOINT_URL_DYNAMODB"]
    if TRIM_PROXY in record.get("pids", {}):
        return False
    (state_path / TRIMS_FILE).unlink(missing_ok=True)  # an earlier stack's, now stopped
    port = local_stack.free_port()
    log_dir = state_path / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{TRIM_PROXY}.log", "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ddb2bt.pipeline.local.trim_proxy", "--upstream", upstream,
                                 "--trims", str(state_path / TRIMS_FILE), "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    local_stack._wait_tcp(port, proc, "the trimming proxy", time.monotonic() + local_stack.READY_TIMEOUT_S)
    url = f"http://{local_stack.LOOPBACK}:{port}"
    local_stack.replace_state(record, {**record, "pids": {**record["pids"], TRIM_PROXY: proc.pid},
                                       "env": {**env, **{k: url for k in STREAM_ENDPOINTS}}})
    return True


# --- incremental exports ----------------------------------------------------------------


def parse_incremental_spec(text: str) -> tuple:
    """``ExportFromTime=S,ExportToTime=S,ExportViewType=V`` (the AWS CLI's shorthand)
    → (from_s, to_s, view)."""
    fields = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"{part!r} is not NAME=VALUE (ExportFromTime=S,ExportToTime=S,"
                              "ExportViewType=NEW_AND_OLD_IMAGES)", "--incremental-export-specification")
        fields[name.strip()] = value.strip()
    try:
        frm, to = int(fields["ExportFromTime"]), int(fields["ExportToTime"])
    except KeyError as missing:
        raise ConfigError(f"{missing.args[0]} is missing", "--incremental-export-specification") from None
    except ValueError:
        raise ConfigError("ExportFromTime and ExportToTime are epoch seconds", "--incremental-export-specification") \
            from None
    if to <= frm:
        raise ConfigError(f"ExportToTime {to} is not after ExportFromTime {frm}", "--incremental-export-specification")
    return frm, to, fields.get("ExportViewType", NEW_AND_OLD_IMAGES)


def _ms(record: dict) -> int:
    created = record["dynamodb"]["ApproximateCreationDateTime"]
    if isinstance(created, _dt.datetime):
        return int(created.timestamp() * 1000)
    return int(float(created) * 1000)


def export_lines(records: list, from_s: int, to_s: int, view: str) -> list:
    """The lines of an incremental export of [from_s, to_s) from a stream's records
    (in order): per item changed in the window, its image at the start
    (``OldImage``, the first change's old image), at the end (``NewImage``, the last
    change's new image) and its last write; an item absent at both ends is left
    out, as AWS does (docs/recover.md, "The incremental export format")."""
    from ddb2bt.transforms.attrs import item_to_dynamodb_json

    first: dict = {}
    last: dict = {}
    for r in records:
        if not from_s * 1000 <= _ms(r) < to_s * 1000:
            continue
        key = json.dumps(item_to_dynamodb_json(r["dynamodb"]["Keys"]), sort_keys=True)
        first.setdefault(key, r)
        last[key] = r
    lines = []
    for key, r in last.items():
        old, new = first[key]["dynamodb"].get("OldImage"), r["dynamodb"].get("NewImage")
        if old is None and new is None:
            continue
        line: dict = {"Metadata": {"WriteTimestampMicros": {"N": str(_ms(r) * 1000)}},
                      "Keys": item_to_dynamodb_json(r["dynamodb"]["Keys"])}
        if new is not None:
            line["NewImage"] = item_to_dynamodb_json(new)
        if old is not None and view == NEW_AND_OLD_IMAGES:
            line["OldImage"] = item_to_dynamodb_json(old)
        lines.append(line)
    return lines


@dataclass(frozen=True)
class ExportWritten:
    arn: str
    location: str  # s3://bucket/[prefix/]AWSDynamoDB/<ExportId>: what `recover --from-export` takes
    items: int


def _iso(s: int) -> str:
    return _dt.datetime.fromtimestamp(s, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def export_incremental(table_arn: str, bucket: str, prefix: str, from_s: int, to_s: int,
                       view: str = NEW_AND_OLD_IMAGES, export_format: str = "DYNAMODB_JSON") -> ExportWritten:
    """Write the incremental export of the table's changes in [from_s, to_s) to the
    local stack's S3, as AWS lays it out: ``_started``, ``manifest-summary.json``,
    ``manifest-files.json`` under ``AWSDynamoDB/<ExportId>/`` and the gzip'd data
    file in the shared ``AWSDynamoDB/data/``. The changes come from the table's
    stream as the emulator holds it (it never trims)."""
    import boto3

    if ":table/" not in table_arn:
        raise ConfigError(f"{table_arn!r} is not a table ARN (arn:aws:dynamodb:REGION:ACCOUNT:table/NAME)",
                          "--table-arn")
    table = table_arn.split(":table/", 1)[1].split("/", 1)[0]
    ddb, streams = _clients()
    try:
        desc = ddb.describe_table(TableName=table)["Table"]
    except ddb.exceptions.ResourceNotFoundException:
        raise ConfigError(f"table {table} does not exist on the local stack", "--table-arn") from None
    arn = desc.get("LatestStreamArn")
    if not arn or desc.get("StreamSpecification", {}).get("StreamViewType") != NEW_AND_OLD_IMAGES:
        raise ConfigError(f"the local export reads the changes from {table}'s stream, which must be "
                          f"{NEW_AND_OLD_IMAGES}", "--table-arn")
    records = [r for shard in _shards(streams, arn) for r in _records(streams, arn, shard["ShardId"])]
    lines = export_lines(records, from_s, to_s, view)
    s3 = boto3.client("s3", endpoint_url=local_endpoint("AWS_ENDPOINT_URL_S3"))
    try:
        s3.head_bucket(Bucket=bucket)
    except s3.exceptions.ClientError:
        s3.create_bucket(Bucket=bucket)
    base = (prefix.strip("/") + "/" if prefix.strip("/") else "") + "AWSDynamoDB/"
    now_ms = int(time.time() * 1000)
    export_id = f"{now_ms:014d}-{secrets.token_hex(EXPORT_ID_HEX)}"
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as f:
        for line in lines:
            f.write((json.dumps(line, separators=(",", ":")) + "\n").encode())
    data = buf.getvalue()
    data_key = f"{base}data/{secrets.token_hex(DATA_FILE_HEX)}.json.gz"
    md5 = hashlib.md5(data).hexdigest()  # noqa: S324 - the checksum AWS's manifest carries, not security
    s3.put_object(Bucket=bucket, Key=f"{base}{export_id}/_started", Body=b"")
    s3.put_object(Bucket=bucket, Key=data_key, Body=data)
    s3.put_object(Bucket=bucket, Key=f"{base}{export_id}/manifest-files.json", Body=json.dumps(
        {"itemCount": len(lines), "md5Checksum": md5, "etag": md5, "dataFileS3Key": data_key}).encode() + b"\n")
    export_arn = f"{table_arn}/export/{export_id}"
    summary = {"version": "2023-08-01", "exportArn": export_arn, "startTime": _iso(now_ms // 1000),
               "endTime": _iso(now_ms // 1000), "tableArn": table_arn, "s3Bucket": bucket,
               "s3Prefix": prefix or None, "manifestFilesS3Key": f"{base}{export_id}/manifest-files.json",
               "billedSizeBytes": len(data), "itemCount": len(lines), "outputFormat": export_format,
               "exportType": "INCREMENTAL_EXPORT", "exportFromTime": _iso(from_s), "exportToTime": _iso(to_s),
               "outputView": view}
    body = json.dumps(summary, indent=2).encode()
    s3.put_object(Bucket=bucket, Key=f"{base}{export_id}/manifest-summary.json", Body=body)
    s3.put_object(Bucket=bucket, Key=f"{base}{export_id}/manifest-summary.checksum",
                  Body=hashlib.md5(body).hexdigest().encode())  # noqa: S324
    return ExportWritten(export_arn, f"s3://{bucket}/{base}{export_id}", len(lines))
