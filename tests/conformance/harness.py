"""How the conformance fixtures are read and compared.

Every fixture is a file written in a shape AWS publishes, plus what it must give:
the exact cells (every SetCell and DeleteCells, in order) or the exact refusal
(dead-letter reason and message, or the error a command prints). Values are shown
as text when they are printable UTF-8, else as ``hex:…``.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import botocore.session
from botocore.parsers import create_parser

from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.dofns import map_record
from ddb2bt.transforms.model import DeleteCells, SetCell

HERE = Path(__file__).parent
FAILED_AT_MS = 1  # dead letters' failure time: not under test


def mapping(name: str):
    return load_mapping(HERE / "mappings" / name)


@functools.lru_cache(maxsize=1)
def _get_records_parser():
    model = botocore.session.get_session().get_service_model("dynamodbstreams")
    return create_parser(model.metadata["protocol"]), model.operation_model("GetRecords").output_shape


def parse_get_records(body: dict) -> dict:
    """A raw GetRecords response body, parsed by botocore's own parser for the
    dynamodbstreams JSON protocol: B arrives as bytes, ApproximateCreationDateTime
    as a datetime, exactly as the stream reader receives them from boto3."""
    parser, shape = _get_records_parser()
    raw = {"body": json.dumps(body).encode("utf-8"), "headers": {}, "status_code": 200}
    return parser.parse(raw, shape)


def show(data: bytes) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "hex:" + data.hex()
    return text if text.isprintable() and not text.startswith("hex:") else "hex:" + data.hex()


def render_mutation(m) -> list:
    if isinstance(m, SetCell):
        return ["set", f"{m.family}:{show(m.qualifier)}", show(m.value), m.timestamp_ms]
    assert isinstance(m, DeleteCells)
    return ["delete", f"{m.family}:{show(m.qualifier)}", m.start_ms, m.end_ms]


def render_rows(rows) -> list:
    return [{"table": r.table, "row": show(r.row_key), "mutations": [render_mutation(m) for m in r.mutations]}
            for r in rows]


def outcome(mapping_config, record) -> dict:
    """What the pipeline's mapping stage makes of one record: its rows, or its dead letter."""
    mapped = map_record(mapping_config, record, lambda: FAILED_AT_MS)
    if mapped.dead_letter is not None:
        return {"dead_letter": {"reason": mapped.dead_letter.reason, "message": mapped.dead_letter.message}}
    return {"rows": render_rows(mapped.rows)}


def fixtures(folder: str, pattern: str = "*.json") -> list:
    return sorted((HERE / folder).glob(pattern))
