"""DynamoDB exports to S3, as AWS writes them: the manifests, checked against the
mapping before anything is written, and the two data formats.

Layout (``export-prefix/AWSDynamoDB/<ExportId>/``)::

    _started                 empty; written first ("the export has begun")
    manifest-summary.json    one JSON object: exportType, outputFormat, tableArn, exportTime, itemCount, ...
    manifest-files.json      one JSON object per line: dataFileS3Key, itemCount, md5Checksum, etag
    data/<id>.json.gz        DYNAMODB_JSON: one {"Item": {...}} per line (B as base64)
    data/<id>.ion.gz         ION: one {Item: {...}} struct per value (amazon.ion reads it)

Empty partitions give empty data files. What a backfill can use is a FULL_EXPORT in
DYNAMODB_JSON or ION of the mapping's own source table; everything else is refused
here, with the reason, before a handoff time is recorded or a cell written.
"""
from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass
from decimal import Decimal
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional

from ddb2bt.transforms.attrs import canonical_number, check_dynamodb_number, item_from_dynamodb_json
from ddb2bt.transforms.errors import ConfigError, MappingError, PermanentError

FULL_EXPORT, INCREMENTAL_EXPORT = "FULL_EXPORT", "INCREMENTAL_EXPORT"
DYNAMODB_JSON, ION = "DYNAMODB_JSON", "ION"
OUTPUT_FORMATS = (DYNAMODB_JSON, ION)
OPTION = "--from-export"


@dataclass(frozen=True)
class ExportManifest:
    """What manifest-summary.json says, read once and validated."""

    export_type: str
    output_format: str
    table_arn: Optional[str]
    export_time: Optional[str]
    item_count: int
    export_from_time: Optional[str] = None
    export_to_time: Optional[str] = None

    @property
    def table_name(self) -> Optional[str]:
        # arn:aws:dynamodb:REGION:ACCOUNT:table/NAME
        if not self.table_arn or ":table/" not in self.table_arn:
            return None
        return self.table_arn.split(":table/", 1)[1].split("/", 1)[0]

    @property
    def region(self) -> Optional[str]:
        parts = (self.table_arn or "").split(":")
        return parts[3] if len(parts) > 5 and parts[3] else None


def parse_summary(data: Any) -> ExportManifest:
    """manifest-summary.json → ExportManifest. Exports made before AWS added
    exportType / outputFormat are full DYNAMODB_JSON exports."""
    if not isinstance(data, dict):
        raise ConfigError("manifest-summary.json is not a JSON object", OPTION)
    try:
        count = int(data.get("itemCount") or 0)
    except (TypeError, ValueError):
        raise ConfigError(f"manifest-summary.json: itemCount {data.get('itemCount')!r} is not a number",
                          OPTION) from None
    return ExportManifest(
        export_type=str(data.get("exportType") or FULL_EXPORT),
        output_format=str(data.get("outputFormat") or DYNAMODB_JSON),
        table_arn=data.get("tableArn"),
        export_time=data.get("exportTime"),
        item_count=count,
        export_from_time=data.get("exportFromTime"),
        export_to_time=data.get("exportToTime"),
    )


def check_manifest(manifest: ExportManifest, table: Optional[str] = None, region: Optional[str] = None) -> None:
    """Refuse an export a backfill cannot use (ConfigError naming --from-export):
    an incremental export, an unknown format, an export of another table."""
    if manifest.export_type == INCREMENTAL_EXPORT:
        raise ConfigError(
            f"this is an incremental export (exportType {INCREMENTAL_EXPORT}, changes from "
            f"{manifest.export_from_time} to {manifest.export_to_time}): it holds the changes of a time window, not "
            "the table's items, so it cannot seed a backfill. Back-fill from a full export (exportType "
            "FULL_EXPORT) or with a scan (no --from-export); the live tail applies the changes after it", OPTION)
    if manifest.export_type != FULL_EXPORT:
        raise ConfigError(f"unknown exportType {manifest.export_type!r} (known: {FULL_EXPORT}, "
                          f"{INCREMENTAL_EXPORT})", OPTION)
    if manifest.output_format not in OUTPUT_FORMATS:
        raise ConfigError(f"outputFormat {manifest.output_format!r} cannot be read (readable: "
                          f"{', '.join(OUTPUT_FORMATS)})", OPTION)
    if manifest.output_format == ION:
        try:
            import amazon.ion.simpleion  # noqa: F401
        except ImportError:  # a dependency, but an install may lack it: refuse before any write
            raise ConfigError("an ION export needs the amazon.ion package (pip install amazon.ion)",
                              OPTION) from None
    if not manifest.export_time:
        raise ConfigError("manifest-summary.json has no exportTime (the handoff time of the backfill)", OPTION)
    if table is not None:
        if manifest.table_name is None:
            raise ConfigError(f"manifest-summary.json has no usable tableArn ({manifest.table_arn!r}): cannot "
                              f"check that this is an export of {table}", OPTION)
        if manifest.table_name != table:
            raise ConfigError(f"this is an export of table {manifest.table_name!r} ({manifest.table_arn}), but the "
                              f"mapping's source is {table!r}", OPTION)
        if region and manifest.region and manifest.region != region:
            raise ConfigError(f"this is an export of {manifest.table_name} in {manifest.region} "
                              f"({manifest.table_arn}), but the mapping's source is in {region}", OPTION)


# --- data lines ------------------------------------------------------------------------


def dynamodb_json_items(lines: Iterator[bytes], part: str) -> Iterator[dict]:
    """DYNAMODB_JSON data: each non-blank line {"Item": {...}} → the item in boto3 form."""
    n = 0
    for raw in lines:
        if not raw.strip():
            continue
        n += 1
        try:
            # Export files are UTF-8: decoded as json.loads decodes bytes it detects
            # as UTF-8 (a byte-order mark dropped, surrogates let through), without
            # detecting it again for every line.
            yield item_from_dynamodb_json(json.loads(raw.decode("utf-8-sig", "surrogatepass") if type(raw) is bytes
                                                     else raw)["Item"])
        except (ValueError, KeyError, TypeError, MappingError) as exc:
            raise PermanentError(f"{part} line {n}: not a DynamoDB JSON export line ({exc})") from None


def ion_items(stream, part: str) -> Iterator[dict]:
    """ION data: each top-level {Item: {...}} struct → the item in boto3 form."""
    from amazon.ion import simpleion

    n = 0
    try:
        for value in simpleion.load(stream, single_value=False, parse_eagerly=False):
            n += 1
            if not isinstance(value, Mapping) or not isinstance(value.get("Item"), Mapping):
                raise PermanentError(f"{part} value {n}: not an ION export item (a struct {{Item: {{…}}}})")
            try:
                yield {str(k): ion_to_attribute(v, str(k)) for k, v in value["Item"].items()}
            except MappingError as exc:
                raise PermanentError(f"{part} value {n}: {exc.message}") from None
    except PermanentError:
        raise
    except Exception as exc:  # the Ion reader raises its own types (IonException, ValueError...)
        raise PermanentError(f"{part} after value {n}: not valid Ion ({type(exc).__name__}: {exc})") from None


_SET_ANNOTATIONS = {"$dynamodb_SS": "SS", "$dynamodb_NS": "NS", "$dynamodb_BS": "BS"}


def _annotations(value: Any) -> tuple:
    return tuple(getattr(a, "text", a) for a in getattr(value, "ion_annotations", ()) or ())


def ion_to_attribute(value: Any, where: str) -> dict:
    """One Ion value of a DynamoDB ION export → AttributeValue. DynamoDB writes S as
    strings, N as decimals (or ints), B as blobs, BOOL, NULL as null, sets as lists
    annotated $dynamodb_SS / _NS / _BS, M as structs, L as lists. Numbers keep their
    value, spelled as DynamoDB spells them (the stream's spelling: the same cells)."""
    from amazon.ion.core import IonType
    from amazon.ion.simple_types import IonPyNull

    ion_type = getattr(value, "ion_type", None)
    if value is None or ion_type == IonType.NULL:
        return {"NULL": True}
    if isinstance(value, IonPyNull):  # a typed null (null.string...): DynamoDB never writes one
        raise MappingError(f"{where}: Ion null.{ion_type.name.lower()} is not a DynamoDB value", reason="bad_attribute")
    if ion_type == IonType.BOOL or isinstance(value, bool):
        return {"BOOL": bool(value)}
    if ion_type == IonType.STRING or (ion_type is None and isinstance(value, str)):
        return {"S": str(value)}
    if ion_type in (IonType.INT, IonType.DECIMAL) or (ion_type is None and isinstance(value, (int, Decimal))):
        number = Decimal(int(value)) if ion_type == IonType.INT or isinstance(value, int) else Decimal(value)
        return {"N": canonical_number(check_dynamodb_number(number, where))}
    if ion_type == IonType.BLOB or (ion_type is None and isinstance(value, bytes)):
        return {"B": bytes(value)}
    if ion_type == IonType.STRUCT or (ion_type is None and isinstance(value, Mapping)):
        return {"M": {str(k): ion_to_attribute(v, f"{where}.{k}") for k, v in value.items()}}
    if ion_type == IonType.LIST or (ion_type is None and isinstance(value, list)):
        tag = next((_SET_ANNOTATIONS[a] for a in _annotations(value) if a in _SET_ANNOTATIONS), None)
        members = [ion_to_attribute(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if tag is None:
            return {"L": members}
        inner = tag[0]
        if any(next(iter(m)) != inner for m in members):
            raise MappingError(f"{where}: a {tag} with a member that is not {inner}", reason="bad_attribute")
        return {tag: [m[inner] for m in members]}
    kind = ion_type.name if ion_type is not None else type(value).__name__
    raise MappingError(f"{where}: Ion {kind} is not a DynamoDB type", reason="bad_attribute")


def export_time_ms(text: str) -> int:
    """exportTime (ISO-8601, ``Z``) → whole milliseconds."""
    try:
        parsed = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"manifest-summary.json: exportTime {text!r} is not an ISO-8601 time", OPTION) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=_dt.timezone.utc)
    return (parsed - _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)) // _dt.timedelta(milliseconds=1)


def manifest_data_files(raw: bytes, refuse: Callable[[str], Exception]) -> list:
    """manifest-files.json (one JSON object a line) → [(dataFileS3Key, itemCount
    or None)], in manifest order. A line without a key raises ``refuse(message)``."""
    files = []
    for n, line in enumerate(raw.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            key = entry["dataFileS3Key"]
        except (ValueError, KeyError, TypeError):
            raise refuse(f"manifest-files.json line {n} has no dataFileS3Key") from None
        count = entry.get("itemCount")
        files.append((key, int(count) if isinstance(count, int) else None))
    return files
