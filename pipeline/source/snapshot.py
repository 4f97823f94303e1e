"""A table read whole, as the backfill and the verify read it: a parallel Scan
of the live table (``ScanSource``, one part per segment) or a DynamoDB
point-in-time export (``ExportSource``, one part per data file; its format is
read by ``exports.py``). Both lie below the cutover and the verify that read
them (docs/how-it-works.md)."""
from __future__ import annotations

import gzip
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from botocore.exceptions import ClientError

from ddb2bt.transforms.config import memo
from ddb2bt.transforms.errors import ConfigError
from ddb2bt.pipeline.clients.dynamodb import SCAN_PAGE_LIMIT
from ddb2bt.pipeline.connect.connections import aws_client
from ddb2bt.pipeline.source.exports import (ION, ExportManifest, check_manifest, dynamodb_json_items, export_time_ms,
                                            ion_items, manifest_data_files, parse_summary)


def segment_name(segment: int, total: int) -> str:
    return f"segment-{segment:04d}-of-{total:04d}"


def parse_segment(name: str) -> tuple:
    _, seg, _, total = name.split("-")
    return int(seg), int(total)


@dataclass(frozen=True)
class ScanSource:
    table: str
    segments: int
    region: Optional[str] = None
    # Strongly consistent by default: an eventually consistent Scan may miss a
    # write completed just before the handoff (DynamoDB gives no bound), e.g.
    # read back an item deleted just before T and write it at T - 1 ms, above
    # nothing the tail will delete again: the item comes back (docs/design.md §6.6).
    consistent_read: bool = True
    max_rcu: Optional[float] = None  # per second, for the whole job (split over tasks)
    page_limit: int = SCAN_PAGE_LIMIT

    def parts(self) -> list:
        return [segment_name(i, self.segments) for i in range(self.segments)]


@dataclass(frozen=True)
class ExportSource:
    """A DynamoDB point-in-time export: a local directory or s3://bucket/prefix that
    holds manifest-summary.json, manifest-files.json and data/*.json.gz (DYNAMODB_JSON)
    or data/*.ion.gz (ION); see ``exports.py``. ``check`` it
    against the mapping's source before starting: it refuses an incremental export,
    an unknown format and an export of another table."""

    location: str
    region: Optional[str] = None

    @property
    def is_s3(self) -> bool:
        return self.location.startswith("s3://")

    def _s3(self):
        return aws_client("s3", region_name=self.region)  # a session of its own: read on the workers

    def _split(self, key: str) -> tuple:
        bucket, _, prefix = self.location[len("s3://"):].partition("/")
        return bucket, f"{prefix.rstrip('/')}/{key}" if prefix else key

    def read_bytes(self, name: str) -> bytes:
        if self.is_s3:
            bucket, key = self._split(name)
            return self._s3().get_object(Bucket=bucket, Key=key)["Body"].read()
        return (Path(self.location) / name).read_bytes()

    def _exists(self, name: str) -> bool:
        try:
            self.read_bytes(name)
            return True
        except (OSError, ClientError):
            return False

    def summary(self) -> dict:
        try:
            return json.loads(self.read_bytes("manifest-summary.json"))
        except (OSError, ClientError) as exc:
            if self._exists("_started"):
                raise ConfigError(f"the export in {self.location} has begun but not finished (there is _started but "
                                  "no manifest-summary.json yet): wait until it is COMPLETED (aws dynamodb "
                                  "describe-export)", "--from-export") from None
            raise ConfigError(f"no manifest-summary.json in {self.location} ({exc}); give the export's directory "
                              "(the one holding manifest-summary.json)", "--from-export") from None
        except ValueError as exc:
            raise ConfigError(f"manifest-summary.json in {self.location} is not JSON ({exc})",
                              "--from-export") from None

    def manifest(self) -> ExportManifest:
        # Kept on the (frozen) source: read once per worker, not once per data file.
        return memo(self, "_manifest", lambda: parse_summary(self.summary()))

    def check(self, table: Optional[str] = None, region: Optional[str] = None) -> ExportManifest:
        """The manifest, if a backfill of ``table`` can use this export; else ConfigError."""
        manifest = self.manifest()
        check_manifest(manifest, table, region)
        return manifest

    def export_time_ms(self) -> int:
        manifest = self.check()
        return export_time_ms(manifest.export_time)

    def _files(self) -> dict:
        """{data file name (relative to the export directory): itemCount or None}, in manifest order."""
        def build() -> dict:
            listed = manifest_data_files(self.read_bytes("manifest-files.json"),
                                         lambda message: ConfigError(message, "--from-export"))
            return {("data/" + key.rsplit("/data/", 1)[-1] if "/data/" in key else key): count
                    for key, count in listed}
        return memo(self, "_data_files", build)

    def parts(self) -> list:
        """Data files (names relative to the export directory), from manifest-files.json."""
        self.check()
        files = list(self._files())
        if not files:
            raise ConfigError("manifest-files.json lists no data files", "--from-export")
        return files

    def expected_items(self, part: str) -> Optional[int]:
        return self._files().get(part)

    def item_count(self) -> int:
        return self.manifest().item_count

    def _open(self, part: str):
        if self.is_s3:
            bucket, key = self._split(part)
            body = self._s3().get_object(Bucket=bucket, Key=key)["Body"]
            return gzip.GzipFile(fileobj=body) if part.endswith(".gz") else body
        path = Path(self.location) / part
        return gzip.open(path, "rb") if part.endswith(".gz") else open(path, "rb")

    def open_lines(self, part: str) -> Iterator[bytes]:
        with self._open(part) as stream:
            yield from io.BufferedReader(stream) if not hasattr(stream, "readline") else stream

    def items(self, part: str) -> Iterator[dict]:
        """The part's items in boto3 form, in file order (DYNAMODB_JSON or ION)."""
        if self.manifest().output_format == ION:
            with self._open(part) as stream:
                yield from ion_items(stream, part)
        else:
            yield from dynamodb_json_items(self.open_lines(part), part)
