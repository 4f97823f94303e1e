"""Recovery of a job whose stream checkpoint was trimmed, from DynamoDB incremental
exports (docs/design.md §8.1, docs/recover.md).

The stream keeps 24 hours. A job down for longer finds its checkpoint trimmed:
the changes between its last applied change and the oldest record the stream
still holds are gone from the stream. Point-in-time recovery still has them, and
``ExportTableToPointInTime`` with ``ExportType=INCREMENTAL_EXPORT`` writes them to
S3, one window at a time (15 minutes to 24 hours; ``ExportFromTime`` inclusive,
``ExportToTime`` exclusive): each item changed in a window appears once, with its
keys, the time of its last write (``Metadata.WriteTimestampMicros``), its image
at the window's end (``NewImage``; none when it was deleted) and, with the
``NEW_AND_OLD_IMAGES`` view, its image at the window's start (``OldImage``).

The three steps, each its own function so the CLI only parses and prints:

1. ``find_gap``: which shards are trimmed, the last change the job applied, the
   oldest record the stream holds — the missing window — and whether PITR
   reaches back that far (``plan_windows``, ``export_commands``).
2. ``open_export`` + ``check_coverage``: the exports given, refused with the
   reason when they leave a hole, belong to another table, are full exports,
   are still running or lack old images.
3. ``Recovery.run``: phase RECOVERING, every window applied in time order as one
   change per item (old image → new image at the last write's second), progress
   saved per data file (a crash resumes after the last finished file), then the
   trimmed shards are set to resume right after the oldest record the stream
   holds (inside the last window) and the phase goes back to LIVE.

Why the end state is the one a never-stopped job reaches (docs/design.md §8.1):
consecutive windows abut and one ends at the second after the last applied
change, so from there on a window's old image is exactly what the target holds
for the item (the earlier window's new image, or the state the job had
applied); a change is written with the mapping's own diff, time-bounded (§5), at
the second of its last write, which is at or after every cell the job wrote for
the item; and the stream replay from the oldest record re-applies, in order,
every change after it, ending with each item's final change, so its older
intermediate cells are written below or deleted again, never left on top.
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

from ddb2bt.pipeline.source.exports import (INCREMENTAL_EXPORT, DYNAMODB_JSON, OPTION, ExportManifest, export_time_ms,
                                             manifest_data_files)
from ddb2bt.pipeline.recover.straddle import SweepResult, BoundarySweep, inexact_features, swept_windows
from ddb2bt.pipeline.control.state import RESUME_AT_TRIM_HORIZON, ShardCheckpoint
from ddb2bt.transforms.errors import ConfigError, PermanentError, MappingError
from ddb2bt.pipeline.clients.dynamodb import STREAM_RETENTION_S
from ddb2bt.pipeline.connect.connections import dynamodb_client, StreamsClientFactory
from ddb2bt.pipeline.connect.preflight import resolve_stream
from ddb2bt.pipeline.control.phases import LIVE, Migration, RECOVERING
from ddb2bt.pipeline.source.snapshot import ExportSource
from ddb2bt.pipeline.source.exports import parse_summary
from ddb2bt.pipeline.sink.sink import BatchingWriter, SinkConfig
from ddb2bt.pipeline.source.heads import nothing_lost_since_head
from ddb2bt.transforms.attrs import item_from_dynamodb_json
from ddb2bt.transforms.dofns import map_record
from ddb2bt.transforms.mapping import backfill_cell_ms, handoff_second_ms
from ddb2bt.transforms.model import ChangeRecord, MODIFY, REMOVE

__all__ = ["Gap", "Window", "ExportChange", "IncrementalExport", "Recovery", "RecoveryRefused", "RecoveryResult",
           "RecoverOptions", "RecoverOutcome", "find_gap", "plan_windows", "check_pitr", "export_commands",
           "open_export", "read_changes", "check_coverage", "inexact_features", "change_record", "recover_job"]

log = logging.getLogger(__name__)

# Published limits of an incremental export window (AWS: "from 15 minutes up to 24
# hours"; docs/recover.md cites the sources).
MIN_WINDOW_S = 15 * 60
MAX_WINDOW_S = 24 * 3600
# The last window reaches this far past the oldest record the stream holds, so
# the exports and the stream replay overlap (the replay makes the overlap exact).
END_OVERLAP_S = 5 * 60
# A stream record's time (ApproximateCreationDateTime: "approximate", rounded
# down to the second) and PITR's write time of the same change (the exports'
# WriteTimestampMicros) are two clocks: the write time may be later. The exports
# must reach this much past the oldest held record's second (the tail resumes
# right after that record, so its change must be in them) and past the last
# change the job applied, by PITR's clock (docs/design.md §8.1). One second more
# than the rounding: exports are whole seconds, and a longer one costs nothing.
RECORD_CLOCK_MARGIN_S = 1
# How far a cell the job wrote can be stamped before PITR's write time of its
# change: the record's second (rounded down) plus the margin, as pitr_after_s
# counts it. A change inside the first swept window can carry a time this far
# before the window's start, so the boundary sweep reads from there, and judges
# what it finds there against the window before it: the exports must begin at
# least this far before the first swept window (docs/design.md §8.1.1).
SWEEP_LOOKBACK_MS = (1 + RECORD_CLOCK_MARGIN_S) * 1000
# PITR's LatestRestorableDateTime is "typically 5 minutes before the current
# time": an export window cannot end later than that.
LATEST_RESTORABLE_LAG_S = 5 * 60
NEW_AND_OLD_IMAGES = "NEW_AND_OLD_IMAGES"
# Data file progress lives in the state table under this meta name.
PROGRESS_META = "recover_done"
SWEEP_META = "recover_swept"  # "done" once the boundary sweep ran (straddle.py)
RELEASED_META = "recover_released"  # "done" once its versions were released, before any window
GAP_META = "recover_gap"


def pitr_after_s(record_ms: int) -> int:
    """The first whole second, by PITR's clock, after the change of a stream
    record stamped ``record_ms`` (rounded down to its second, and up to
    RECORD_CLOCK_MARGIN_S behind PITR's write time)."""
    return record_ms // 1000 + 1 + RECORD_CLOCK_MARGIN_S


class RecoveryRefused(ConfigError):
    """The recovery cannot be done as asked; the message names why and what to do."""


# --- the missing window --------------------------------------------------------------


@dataclass(frozen=True)
class Gap:
    """The changes the stream no longer holds. ``first_ms`` / ``last_ms``: the
    earliest and the latest last-applied change of the trimmed shards (each shard
    lost what came after its own); ``end_ms``: the oldest record the stream holds
    (or PITR's latest restorable time when it holds none)."""

    first_ms: int
    last_ms: int
    end_ms: int
    trimmed_shards: tuple  # shard ids whose checkpoints point at trimmed data
    stream_arn: str = ""
    # ((shard id, sequence number of its oldest held record), ...): where the tail
    # resumes. That record's change is inside the last export window (it ends past
    # it), so resuming *after* it loses nothing; and if the record is trimmed too
    # before the tail runs, the tail stops loudly again instead of skipping changes.
    resume_after: tuple = ()
    # The latest change the job applied on any shard, trimmed or intact (0:
    # unknown). The exports must reach past it: the boundary sweep takes an
    # item's last image in them as its state after every change the job wrote
    # (straddle.py, docs/design.md §8.1.1).
    applied_ms: int = 0

    @property
    def start_s(self) -> int:
        """Where the exports must begin: the second of the earliest lost change."""
        return self.first_ms // 1000

    @property
    def boundary_s(self) -> int:
        """A window must end (and the next begin) here, the second after the last
        applied change: every later window's old images are then exactly what the
        target holds (docs/design.md §8.1). By the stream's clock: an applied
        change PITR stamps later falls after it, but every cell the job wrote
        carries its record's time, before it, which is what the boundary sweep
        judges (straddle.py)."""
        return self.last_ms // 1000 + 1

    @property
    def hours(self) -> float:
        return (self.end_ms - self.first_ms) / 3_600_000


@dataclass(frozen=True)
class Window:
    from_s: int  # inclusive, epoch seconds
    to_s: int  # exclusive

    def __str__(self) -> str:
        return f"{iso(self.from_s * 1000)} → {iso(self.to_s * 1000)}"


def iso(ms: int) -> str:
    return _dt.datetime.fromtimestamp(ms / 1000, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _record_ms(record: dict) -> int:
    created = record["dynamodb"].get("ApproximateCreationDateTime")
    if isinstance(created, _dt.datetime):
        return int(created.timestamp() * 1000)
    return int(float(created) * 1000)


def find_gap(streams_client, stream_arn: str, checkpoints: dict, now_ms: int,
             heads: Optional[dict] = None) -> Optional[Gap]:
    """None when no checkpoint of the stream is trimmed. A shard is trimmed when its
    checkpoint's position is refused with TrimmedDataAccessException, or when it
    aged out of the stream before the job finished it — unless the job saw it at
    its head recently enough that nothing after its checkpoint can have been
    trimmed (``heads``: StateStore.load_shard_heads; docs/design.md §8.2): its
    tail goes on from the oldest record, and its last change, perhaps hours
    older, must not pull the exports back."""
    from botocore.exceptions import ClientError

    listed: dict = {}
    start = None
    while True:
        kw = {"StreamArn": stream_arn, **({"ExclusiveStartShardId": start} if start else {})}
        desc = streams_client.describe_stream(**kw)["StreamDescription"]
        for s in desc["Shards"]:
            listed[s["ShardId"]] = s
        start = desc.get("LastEvaluatedShardId")
        if not start:
            break
    trimmed, last_applied, oldest_held, resume = [], [], [], []
    # A checkpoint saved before change times were recorded: its save time is later
    # than its change, so the exports still reach past it.
    applied = max((c.change_ms if c.change_ms is not None else (c.updated_ms or 0) for c in checkpoints.values()),
                  default=0)
    for shard_id, ckpt in sorted(checkpoints.items()):
        if ckpt.finished or not ckpt.sequence_number or ckpt.sequence_number == RESUME_AT_TRIM_HORIZON:
            continue
        if shard_id in listed:
            try:
                streams_client.get_shard_iterator(StreamArn=stream_arn, ShardId=shard_id,
                                                  ShardIteratorType="AFTER_SEQUENCE_NUMBER",
                                                  SequenceNumber=ckpt.sequence_number)
                continue  # intact: the tail resumes it from its checkpoint
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "TrimmedDataAccessException":
                    raise
            retention_s = getattr(streams_client, "retention_s", None) or STREAM_RETENTION_S
            it = streams_client.get_shard_iterator(StreamArn=stream_arn, ShardId=shard_id,
                                                   ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
            records = streams_client.get_records(ShardIterator=it, Limit=1).get("Records") or []
            if nothing_lost_since_head((heads or {}).get(shard_id), now_ms, retention_s,
                                       _record_ms(records[0]) if records else None):
                continue  # trimmed, nothing lost: the oldest record held predates the head sighting
            if records:
                oldest_held.append(_record_ms(records[0]))
                resume.append((shard_id, records[0]["dynamodb"]["SequenceNumber"]))
        # else: aged out of the stream with changes after the checkpoint unread
        trimmed.append(shard_id)
        last_applied.append(ckpt.change_ms if ckpt.change_ms is not None else ckpt.updated_ms)
    if not trimmed:
        return None
    end = max(oldest_held) if oldest_held else now_ms - LATEST_RESTORABLE_LAG_S * 1000
    return Gap(first_ms=min(last_applied), last_ms=max(last_applied), end_ms=max(end, max(last_applied)),
               trimmed_shards=tuple(trimmed), stream_arn=stream_arn, resume_after=tuple(resume),
               applied_ms=max(applied, max(last_applied)))


def _split(start: int, end: int) -> list:
    """Abutting windows covering [start, end), each 15 min to 24 h (a short span is
    widened backwards: an earlier start only re-applies what the target holds)."""
    if end - start < MIN_WINDOW_S:
        start = end - MIN_WINDOW_S
    count = max(1, math.ceil((end - start) / MAX_WINDOW_S))
    size = math.ceil((end - start) / count)
    return [Window(start + i * size, min(start + (i + 1) * size, end)) for i in range(count)]


def plan_windows(gap: Gap, now_ms: int) -> list:
    """The export windows: abutting, one boundary at ``gap.boundary_s``, from the
    second of the earliest lost change to END_OVERLAP_S past the oldest record
    the stream holds (not after PITR's latest restorable time), and one shortest
    window before them: the boundary sweep judges the cells stamped just before
    the first swept window against it (SWEEP_LOOKBACK_MS, check_coverage)."""
    latest = now_ms // 1000 - LATEST_RESTORABLE_LAG_S
    end = min(math.ceil(gap.end_ms / 1000) + END_OVERLAP_S, latest)
    end = max(end, gap.boundary_s + MIN_WINDOW_S)  # a just-trimmed gap: wait until PITR reaches it
    end = max(end, pitr_after_s(gap.applied_ms))  # past every change the job applied (check_coverage)
    end = max(end, pitr_after_s(gap.end_ms))  # past the oldest held record's change, by PITR's clock too
    swept = _split(min(gap.start_s, gap.boundary_s - MIN_WINDOW_S), gap.boundary_s)
    lookback = Window(swept[0].from_s - MIN_WINDOW_S, swept[0].from_s)
    return [lookback] + swept + _split(gap.boundary_s, end)


def check_pitr(describe_continuous_backups: Callable[[], dict], table: str, gap: Gap) -> None:
    """Refuse when point-in-time recovery is off or does not reach back to the gap's
    start: then no export can hold the lost changes and only a full backfill restores
    the target."""
    desc = describe_continuous_backups().get("ContinuousBackupsDescription", {})
    pitr = desc.get("PointInTimeRecoveryDescription", {})
    status = pitr.get("PointInTimeRecoveryStatus")
    if status != "ENABLED":
        raise RecoveryRefused(
            f"point-in-time recovery of {table} is {status or 'not enabled'}: no export can hold the changes "
            f"lost between {iso(gap.first_ms)} and {iso(gap.end_ms)}. The only way back is a full backfill "
            f"(ddb2bt migrate -m ... --restart). Enable PITR now so the next gap can be recovered", "recover")
    earliest = pitr.get("EarliestRestorableDateTime")
    if earliest is not None:
        earliest_ms = int(earliest.timestamp() * 1000) if isinstance(earliest, _dt.datetime) else int(
            float(earliest) * 1000)
        if earliest_ms > gap.start_s * 1000:
            raise RecoveryRefused(
                f"point-in-time recovery of {table} reaches back only to {iso(earliest_ms)}, but the lost changes "
                f"begin at {iso(gap.first_ms)}: the changes in between are in no stream and no backup. The only "
                "way back is a full backfill (ddb2bt migrate -m ... --restart)", "recover")


def export_commands(windows: Sequence[Window], table_arn: str, bucket: str, prefix: str = "") -> list:
    """One ``aws dynamodb export-table-to-point-in-time`` command per window."""
    out = []
    for w in windows:
        spec = (f"ExportFromTime={w.from_s},ExportToTime={w.to_s},ExportViewType={NEW_AND_OLD_IMAGES}")
        cmd = (f"aws dynamodb export-table-to-point-in-time --table-arn {table_arn} --s3-bucket {bucket}"
               + (f" --s3-prefix {prefix}" if prefix else "")
               + f" --export-format DYNAMODB_JSON --export-type INCREMENTAL_EXPORT "
               f"--incremental-export-specification {spec}")
        out.append(cmd)
    return out


# --- the exports ------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportChange:
    """One line of an incremental export's data file."""

    keys: dict
    new_image: Optional[dict]
    old_image: Optional[dict]
    write_us: int


@dataclass(frozen=True)
class IncrementalExport:
    location: str
    manifest: ExportManifest
    from_ms: int
    to_ms: int
    view: str
    files: tuple  # ((name relative to the AWSDynamoDB folder, itemCount or None), ...)
    source: object = field(default=None, compare=False)

    def window(self) -> str:
        return f"{iso(self.from_ms)} → {iso(self.to_ms)}"


def _write_us(meta) -> int:
    value = (meta or {}).get("WriteTimestampMicros")
    if isinstance(value, dict):  # as AWS writes it: {"N": "..."}
        value = value.get("N")
    return int(value)


def parse_line(raw: bytes, part: str, n: int) -> ExportChange:
    try:
        data = json.loads(raw)
        keys = item_from_dynamodb_json(data["Keys"])
        new = item_from_dynamodb_json(data["NewImage"]) if data.get("NewImage") is not None else None
        old = item_from_dynamodb_json(data["OldImage"]) if data.get("OldImage") is not None else None
        return ExportChange(keys, new, old, _write_us(data.get("Metadata")))
    except (ValueError, KeyError, TypeError, MappingError) as exc:
        raise PermanentError(f"{part} line {n}: not an incremental export line ({type(exc).__name__}: {exc})") from None


def open_export(location: str, table: str, region: Optional[str] = None) -> IncrementalExport:
    """An incremental export's manifests, checked: refused (RecoveryRefused, naming
    --from-export) when it is still running, a full export, of another table, in
    another format, or without old images."""
    source = ExportSource(location.rstrip("/"), region)
    summary = source.summary()  # refuses a running export (_started, no summary)
    manifest = parse_summary(summary)
    where = f"{location}: "
    if manifest.export_type != INCREMENTAL_EXPORT:
        raise RecoveryRefused(
            where + f"this is a {manifest.export_type.lower().replace('_', ' ')} (exportType {manifest.export_type}), "
            f"the table's items at one time, not the changes of a window. Recovery needs incremental exports "
            f"(--export-type INCREMENTAL_EXPORT): `ddb2bt recover -m ...` prints the commands", OPTION)
    if manifest.table_name != table:
        raise RecoveryRefused(where + f"this is an export of table {manifest.table_name!r} ({manifest.table_arn}), "
                              f"but the mapping's source is {table!r}", OPTION)
    if region and manifest.region and manifest.region != region:
        raise RecoveryRefused(where + f"this is an export of {table} in {manifest.region}, but the mapping's "
                              f"source is in {region}", OPTION)
    if manifest.output_format != DYNAMODB_JSON:
        raise RecoveryRefused(where + f"outputFormat {manifest.output_format}: recovery reads DYNAMODB_JSON "
                              "incremental exports (--export-format DYNAMODB_JSON)", OPTION)
    view = str(summary.get("outputView") or summary.get("exportViewType") or NEW_AND_OLD_IMAGES)
    if view != NEW_AND_OLD_IMAGES:
        raise RecoveryRefused(
            where + f"the export's view is {view}: a deleted item then has only its keys, and what it owned in "
            f"Bigtable (index rows, sets) cannot be known. Export with ExportViewType={NEW_AND_OLD_IMAGES}", OPTION)
    if not manifest.export_from_time or not manifest.export_to_time:
        raise RecoveryRefused(where + "manifest-summary.json has no exportFromTime/exportToTime", OPTION)
    listed = manifest_data_files(source.read_bytes("manifest-files.json"),
                                 lambda message: RecoveryRefused(where + message, OPTION))
    # Keys are relative to the bucket: ``[prefix/]AWSDynamoDB/<id>/data/...`` for full
    # exports, ``[prefix/]AWSDynamoDB/data/...`` (a shared folder) for incremental ones.
    files = [(key.split("AWSDynamoDB/", 1)[1] if "AWSDynamoDB/" in key else key, count) for key, count in listed]
    return IncrementalExport(location, manifest, export_time_ms(manifest.export_from_time),
                             export_time_ms(manifest.export_to_time), view, tuple(files), source)


def _parent(location: str) -> str:
    loc = location.rstrip("/")
    return loc.rsplit("/", 1)[0] if "/" in loc else "."


def read_changes(export: IncrementalExport, rel: str) -> Iterator[ExportChange]:
    """A data file's lines (resolved against the export's AWSDynamoDB folder)."""
    folder = ExportSource(_parent(export.location), export.source.region if export.source else None)
    n = 0
    for raw in folder.open_lines(rel):
        if not raw.strip():
            continue
        n += 1
        yield parse_line(raw, rel, n)


def check_coverage(exports: Sequence[IncrementalExport], gap: Gap) -> list:
    """The exports in time order, if together they cover the gap without a hole
    and have a window boundary at ``gap.boundary_s``; else RecoveryRefused naming
    what is missing and the export that fills it."""
    if not exports:
        raise RecoveryRefused("no export given", OPTION)
    ordered = sorted(exports, key=lambda e: (e.from_ms, e.to_ms))
    first_needed = gap.start_s * 1000
    if ordered[0].from_ms > first_needed:
        raise RecoveryRefused(
            f"the exports begin at {iso(ordered[0].from_ms)}, but the lost changes begin at {iso(first_needed)} "
            f"(the second of the earliest last-applied change): export ExportFromTime={first_needed // 1000}, "
            f"ExportToTime={ordered[0].from_ms // 1000} too", OPTION)
    reach = ordered[0].to_ms
    for e in ordered[1:]:
        if e.from_ms < reach:
            # An item created in the overlap and deleted after it is in neither image
            # of the later export (it did not exist at its start nor at its end), so
            # AWS leaves it out, and the earlier export's image of it would stay.
            raise RecoveryRefused(
                f"the windows {iso(e.from_ms)} → {iso(e.to_ms)} and one ending at {iso(reach)} overlap: an item "
                "created in the overlap and deleted after it is in no line of the later export, so it would stay "
                "in Bigtable. Use abutting windows (each ExportFromTime the ExportToTime of the one before), "
                "as `ddb2bt recover` prints them", OPTION)
        if e.from_ms > reach:
            raise RecoveryRefused(
                f"the exports leave a hole from {iso(reach)} to {iso(e.from_ms)}: the changes in it are in no "
                f"export. Export that window too (ExportFromTime={reach // 1000}, ExportToTime={e.from_ms // 1000})",
                OPTION)
        reach = max(reach, e.to_ms)
    if reach < pitr_after_s(gap.end_ms) * 1000:
        raise RecoveryRefused(
            f"the exports end at {iso(reach)}, but the stream's oldest record is at {iso(gap.end_ms)}: the changes "
            f"in between are in neither (the exports must reach {RECORD_CLOCK_MARGIN_S} s past that second: a "
            f"record's time may be behind PITR's). Export {iso(reach)} → "
            f"{iso(pitr_after_s(gap.end_ms) * 1000)} or later too", OPTION)
    if reach < pitr_after_s(gap.applied_ms) * 1000:
        raise RecoveryRefused(
            f"the exports end at {iso(reach)}, but the job applied changes until {iso(gap.applied_ms)} (on a shard "
            "whose checkpoint is intact): the recovery takes an item's last image in the exports as its state "
            f"after every change the job wrote. Export {iso(reach)} → {iso(pitr_after_s(gap.applied_ms) * 1000)} "
            "or later too "
            "(`ddb2bt recover` prints that window)", OPTION)
    boundary = gap.boundary_s * 1000
    if not any(e.to_ms == boundary for e in ordered) or not any(e.from_ms == boundary for e in ordered):
        raise RecoveryRefused(
            f"no window ends at {iso(boundary)} (ExportToTime={gap.boundary_s}) with the next one beginning there: "
            "the second after the job's last applied change. A window reaching across it would compact changes "
            "the job applied with changes it lost, and its old images would not be what Bigtable holds. Use "
            "the windows `ddb2bt recover` prints", OPTION)
    first_swept = swept_windows(ordered, gap.first_ms, boundary)[0]
    if ordered[0].from_ms > first_swept.from_ms - SWEEP_LOOKBACK_MS:
        raise RecoveryRefused(
            f"the exports begin at {iso(ordered[0].from_ms)}, where the window holding the earliest trimmed shard's "
            f"last applied change begins: a change inside it may carry a stream record time up to "
            f"{SWEEP_LOOKBACK_MS // 1000} s before that, and the boundary sweep can tell such a cell from one of an "
            "unchanged item only with the window before it (docs/design.md §8.1.1). Export "
            f"ExportFromTime={first_swept.from_ms // 1000 - MIN_WINDOW_S}, ExportToTime={first_swept.from_ms // 1000} "
            "too (`ddb2bt recover` prints that window)", OPTION)
    return ordered


def _backfill_inside_the_sweep(handoff_ms: Optional[int], gap: Gap, windows: Sequence[Window]) -> list:
    """The one case the boundary sweep cannot tell apart (docs/design.md §8.1.1):
    a backfill's cells, all at one timestamp, inside a window it reads."""
    if not handoff_ms:
        return []
    boundary = gap.boundary_s * 1000
    starts = [w.from_s * 1000 for w in windows if gap.first_ms < w.to_s * 1000 <= boundary]
    if not starts or not min(starts) - SWEEP_LOOKBACK_MS <= backfill_cell_ms(handoff_ms) < boundary:
        return []
    return [f"the last backfill's handoff ({iso(handoff_ms)}) is inside the span the boundary sweep reads: an item "
            "the backfill copied, created before the handoff and deleted after it by a change the stream lost, "
            "keeps its backfilled cells (they carry the backfill's time, not a change's; docs/design.md §8.1.1). "
            "Run `ddb2bt verify` after recovering"]


# --- applying --------------------------------------------------------------------------


def change_record(change: ExportChange):
    """An export line → the ChangeRecord the mapping diffs: the item's image at the
    window's start (what the target holds: the windows abut) → its image at the end,
    written at the second of its last write (stream changes are whole seconds too:
    docs/design.md §3.1)."""
    old = change.old_image
    ts = handoff_second_ms(change.write_us // 1000)
    if change.new_image is None:
        return ChangeRecord(REMOVE, change.keys, None, old, ts) if old is not None else None
    # Never INSERT: an INSERT skips deleting older versions of what it writes (§5.1),
    # and the target may hold cells of the item's earlier life. An item that did not
    # exist at the window's start is a MODIFY from its bare keys (which own no cell).
    return ChangeRecord(MODIFY, change.keys, change.new_image, old if old is not None else dict(change.keys), ts)


@dataclass
class RecoveryResult:
    files: int = 0
    files_skipped: int = 0  # finished before a crash
    items: int = 0
    dead_letters: int = 0
    sweep: Optional[SweepResult] = None  # None: swept before a restart


class Recovery:
    """Applies checked exports in time order; resumable per data file.

    ``store`` is the job's StateStore, ``batcher`` a BatchingWriter over the target
    (no checkpoints), ``migration`` a phases.Migration, ``fence`` a callable checked
    before every write (the lease), ``progress`` called with (files done, files)."""

    def __init__(self, mapping, store, batcher, migration, fence: Callable[[], object] = lambda: None,
                 progress: Callable[[int, int], None] = lambda done, total: None, metrics=None,
                 read: Callable[[IncrementalExport, str], Iterator[ExportChange]] = None, target=None,
                 sweep_progress: Callable[[int], None] = lambda rows: None) -> None:
        self.mapping, self.store, self.batcher, self.migration = mapping, store, batcher, migration
        self.fence, self.progress, self.metrics = fence, progress, metrics
        self.read = read or read_changes
        # What the boundary sweep reads the target with (cells_between): the
        # writer the batcher writes through, unless given.
        self.target = target if target is not None else getattr(batcher, "_writer", None)
        self.swept: Optional[SweepResult] = None
        self.sweep_progress = sweep_progress  # rows the boundary sweep read so far
        self.released: Optional[int] = None  # versions the sweep released (None: before a restart)

    def _done(self) -> int:
        raw = self.store.load_meta(PROGRESS_META)
        return int(raw) if raw else 0

    def begin(self, gap: Gap, files: Sequence[str]) -> None:
        """Phase RECOVERING, or resume: the same gap and the same data files (in
        order) continue after the last finished one; anything else starts over
        (re-applying from the first window is safe: the same cells again, bounded
        deletes, and the windows run to the end in order)."""
        import hashlib

        spec = json.dumps({"first_ms": gap.first_ms, "last_ms": gap.last_ms, "end_ms": gap.end_ms,
                           "applied_ms": gap.applied_ms,
                           "stream": gap.stream_arn, "shards": list(gap.trimmed_shards),
                           "files": hashlib.sha256("\n".join(files).encode()).hexdigest()}, sort_keys=True)
        if self.migration.phase == RECOVERING and self.store.load_meta(GAP_META) == spec:
            log.info("resuming the recovery after %d finished data file(s)", self._done())
            return
        self.migration.transition(RECOVERING)
        self.store.save_meta(GAP_META, spec)
        self.store.save_meta(PROGRESS_META, "0")
        self.store.save_meta(SWEEP_META, "")
        self.store.save_meta(RELEASED_META, "")

    def run(self, gap: Gap, exports: Sequence[IncrementalExport]) -> RecoveryResult:
        ordered = check_coverage(exports, gap)
        files = [(export, rel) for export in ordered for rel, _ in export.files]
        self.begin(gap, [f"{export.location}|{rel}" for export, rel in files])
        done = self._done()
        result = RecoveryResult(files_skipped=min(done, len(files)))
        self.progress(result.files_skipped, len(files))
        before = len([1 for export, _ in files if export.to_ms <= gap.boundary_s * 1000])
        self._release_versions(gap, ordered, files)
        for index, (export, rel) in enumerate(files):
            if index == before:
                self._sweep(gap, ordered, files)
            if index < done:
                continue  # finished before a restart
            if export.files[0][0] == rel:
                log.info("applying the incremental export %s (%s)", export.location, export.window())
            for change in self.read(export, rel):
                record = change_record(change)
                if record is None:
                    continue
                mapped = map_record(self.mapping, record, lambda: int(time.time() * 1000))
                self.fence()
                result.dead_letters += self._dead(self.batcher.add(mapped))
                result.items += 1
                if self.metrics is not None:
                    self.metrics.recovered_items.inc()
            self.fence()
            result.dead_letters += self._dead(self.batcher.flush())
            self.store.save_meta(PROGRESS_META, str(index + 1))  # after the file's writes are acknowledged
            result.files += 1
            self.progress(index + 1, len(files))
        if before == len(files):
            self._sweep(gap, ordered, files)
        result.sweep = self.swept
        return result

    def _boundary_sweep(self, gap: Gap):
        handoff = self.migration.handoff_ms
        return BoundarySweep(self.mapping, self.target, self.batcher, self.store.versions(), self.read, self.fence,
                             backfill_ms=backfill_cell_ms(handoff) if handoff else None)

    def _release_versions(self, gap: Gap, ordered: Sequence[IncrementalExport], files: Sequence) -> None:
        """Before any window is applied, once per recovery: the versions whose
        removal was lost (straddle.py, docs/design.md §8.1.1)."""
        if self.store.load_meta(RELEASED_META) == "done":
            return
        windows = swept_windows(ordered, gap.first_ms, gap.boundary_s * 1000)
        # From SWEEP_LOOKBACK_MS before the first swept window: a claim is stamped
        # with its change's record time, which may be that much earlier.
        self.released = self._boundary_sweep(gap).release_versions(
            windows[0].from_ms - SWEEP_LOOKBACK_MS, files) if windows else 0
        self.store.save_meta(RELEASED_META, "done")

    def _sweep(self, gap: Gap, ordered: Sequence[IncrementalExport], files: Sequence) -> None:
        """Once the windows before the boundary are applied, and once per recovery:
        the cells an item's lost change would have deleted (straddle.py,
        docs/design.md §8.1.1). The last backfill's cells are not a change's: their
        one timestamp is not swept."""
        if self.store.load_meta(SWEEP_META) == "done":
            return

        windows = swept_windows(ordered, gap.first_ms, gap.boundary_s * 1000)
        sweep = self._boundary_sweep(gap)
        base = [0]  # rows of the windows swept before this one: the bar counts on
        sweep.progress = lambda rows: self.sweep_progress(base[0] + rows)
        total = SweepResult(versions_released=self.released or 0)  # None: released before a restart
        for i, w in enumerate(windows):
            log.info("recover: sweeping the target for cells written in %s that a lost change would have deleted",
                     w.window())
            mine = [(export, rel) for export, rel in files if export is w]
            if i == 0:
                # A change inside the first swept window may carry a record time up to
                # SWEEP_LOOKBACK_MS before its start: read from there, and judge what is
                # there with the windows before it too (the item's state at the start).
                read_from = w.from_ms - SWEEP_LOOKBACK_MS
                before = [(export, rel) for export, rel in files if read_from < export.to_ms <= w.from_ms]
                done = sweep.run(mine, w.from_ms, w.to_ms, lookback_files=before, read_from_ms=read_from)
            else:  # what is stamped before its start is the window before's, swept with it
                done = sweep.run(mine, w.from_ms, w.to_ms)
            base[0] += done.rows_read
            total = SweepResult(total.windows + 1, total.rows_read + done.rows_read,
                                total.cells_deleted + done.cells_deleted, total.versions_released)
        self.swept = total
        self.store.save_meta(SWEEP_META, "done")
        log.info("recover: the boundary sweep read %d row(s) of %d window(s); deleted %d stale column(s) and %d "
                 "version(s)", total.rows_read, total.windows, total.cells_deleted, total.versions_released)

    def _dead(self, letters) -> int:
        letters = list(letters or ())
        if letters:
            self.store.save_dead_letters(letters)
        return len(letters)

    def resume_tail(self, gap: Gap) -> None:
        """The trimmed shards resume after their oldest held record (inside the last
        window), or at TRIM_HORIZON when they held none; then the phase goes back
        to LIVE (the tail, started next, replays from there)."""
        self.fence()
        after = dict(gap.resume_after)
        self.store.save_checkpoints([ShardCheckpoint(gap.stream_arn, s, after.get(s, RESUME_AT_TRIM_HORIZON))
                                     for s in gap.trimmed_shards])
        self.migration.transition(LIVE)
        self.store.save_meta(GAP_META, "")
        self.store.save_meta(PROGRESS_META, "")
        self.store.save_meta(SWEEP_META, "")
        self.store.save_meta(RELEASED_META, "")


# --- the command's service -------------------------------------------------------------


@dataclass(frozen=True)
class RecoverOptions:
    exports: tuple = ()  # --from-export locations; empty: only say what is missing
    s3_bucket: str = "<bucket>"  # for the printed export commands
    s3_prefix: str = ""
    accept_inexact: bool = False


@dataclass
class RecoverOutcome:
    gap: Optional[Gap]
    windows: list = field(default_factory=list)
    commands: list = field(default_factory=list)
    inexact: list = field(default_factory=list)
    result: Optional[RecoveryResult] = None
    table_arn: str = ""

    def lines(self) -> list:
        """What the CLI prints."""
        if self.gap is None:
            return ["no checkpoint of this job is trimmed: nothing to recover (ddb2bt run resumes it)"]
        g = self.gap
        out = [f"trimmed: {len(g.trimmed_shards)} shard(s) lost changes the stream no longer holds, from the "
               f"last applied change at {iso(g.last_ms)}"
               + (f" (earliest shard: {iso(g.first_ms)})" if g.first_ms != g.last_ms else "")
               + f" to the stream's oldest record at {iso(g.end_ms)} ({g.hours:.1f} h)"]
        for why in self.inexact:
            out.append(f"not exact from final images: {why}")
        if self.result is None:
            out.append(f"export these {len(self.windows)} window(s) (abutting, each 15 min to 24 h; incremental "
                       "exports are billed by the size of the changed data, at least 10 MB each):")
            out += [f"  {cmd}" for cmd in self.commands]
            out.append("then, once every export is COMPLETED (aws dynamodb describe-export --export-arn ...):")
            out.append("  ddb2bt recover -m <mapping> --from-export s3://BUCKET/PREFIX/AWSDynamoDB/<ExportId> ... "
                       "(one --from-export per export)")
        else:
            r = self.result
            out.append(f"recovered: {r.items} change(s) from {r.files + r.files_skipped} data file(s) "
                       f"({r.files_skipped} done before a restart), {r.dead_letters} dead letter(s); the trimmed "
                       "shards resume at the oldest record the stream holds: start the tail within 24 h (ddb2bt run -m "
                       "<mapping>)")
            if r.sweep is not None:
                w = r.sweep
                out.append(f"boundary sweep (docs/recover.md): {w.windows} window(s), {w.rows_read} row(s) with "
                           f"cells in them read, {w.cells_deleted} stale column(s) deleted, {w.versions_released} "
                           "version(s) released")
        return out


def refuse_kinesis(mapping) -> None:
    """``recover`` is for a DynamoDB stream's trimmed checkpoints: it writes the
    exports' lines with the ordered path's diffs, around the ordering guard's
    clocks, which a Kinesis job's later REMOVEs rely on (docs/design.md §10). So a
    Kinesis mapping is refused, before anything is read or written."""
    if mapping.source.kinesis is not None:
        raise ConfigError(
            "recover applies DynamoDB incremental exports for a job whose DynamoDB stream was trimmed; this mapping "
            "reads a Kinesis stream, whose writes go through the ordering guard, which recover does not. A "
            "Kinesis stream keeps up to a year: raise its retention, and for changes already lost back-fill "
            "again (ddb2bt migrate -m <mapping> --restart)", "source.kinesis")


def recover_job(mapping, state_spec, options: RecoverOptions, *, streams_client=None, dynamodb=None,
                fence: Callable[[], object] = lambda: None, progress=None, now_ms: Optional[int] = None,
                metrics=None, sweep_progress=None) -> RecoverOutcome:
    """`ddb2bt recover` against the real services (clients injectable for tests)."""
    refuse_kinesis(mapping)

    dynamodb = dynamodb or dynamodb_client(mapping.source.region)
    streams_client = streams_client or StreamsClientFactory(mapping.source.region)()
    now = now_ms if now_ms is not None else int(time.time() * 1000)
    stream = resolve_stream(mapping, dynamodb)
    table_arn = stream.stream_arn.split("/stream/", 1)[0]
    writer = state_spec.bigtable.writer()
    try:
        store = state_spec.store(writer)
        gap = find_gap(streams_client, stream.stream_arn, store.load_checkpoints(stream.stream_arn), now,
                       heads=store.load_shard_heads(stream.stream_arn))
        outcome = RecoverOutcome(gap, table_arn=table_arn)
        if gap is None:
            return outcome
        check_pitr(lambda: dynamodb.describe_continuous_backups(TableName=mapping.source.table),
                   mapping.source.table, gap)
        outcome.inexact = inexact_features(mapping)
        outcome.windows = plan_windows(gap, now)
        outcome.inexact += _backfill_inside_the_sweep(Migration(store).handoff_ms, gap, outcome.windows)
        outcome.commands = export_commands(outcome.windows, table_arn, options.s3_bucket, options.s3_prefix)
        if not options.exports:
            return outcome
        exports = [open_export(loc, mapping.source.table, mapping.source.region) for loc in options.exports]
        ordered = check_coverage(exports, gap)
        # The exports given may start earlier than the plan (any abutting windows
        # that cover the gap are accepted): the sweep reads what they span.
        given = [Window(e.from_ms // 1000, e.to_ms // 1000) for e in ordered]
        outcome.inexact += [why for why in _backfill_inside_the_sweep(Migration(store).handoff_ms, gap, given)
                            if why not in outcome.inexact]
        if outcome.inexact and not options.accept_inexact:
            raise RecoveryRefused("the recovery cannot be exact: " + "; ".join(outcome.inexact)
                                  + ". Nothing was written. Back-fill instead (ddb2bt migrate --restart), or pass "
                                  "--accept-inexact (then run ddb2bt verify)", "recover")
        batcher = BatchingWriter(writer, None, SinkConfig(overlap_writes=False), versions=store.versions(),
                                 metrics=metrics)
        try:
            recovery = Recovery(mapping, store, batcher, Migration(store), fence=fence,
                                progress=progress or (lambda done, total: None), metrics=metrics,
                                sweep_progress=sweep_progress or (lambda rows: None))
            outcome.result = recovery.run(gap, exports)
            recovery.resume_tail(gap)
        finally:
            batcher.close()
        return outcome
    finally:
        writer.close()
