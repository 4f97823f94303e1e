"""DynamoDB stream ARNs, parsed (pure: no I/O). Shared by the DynamoDB client
(``pipeline/clients/dynamodb.py``) and the metrics, whose table label is the
table's name in a stream ARN (``pipeline/observe/metrics.py``)."""
from __future__ import annotations

from dataclasses import dataclass

_TABLE_MARK = ":table/"
_STREAM_MARK = "/stream/"


@dataclass(frozen=True)
class StreamArn:
    """``arn:aws:dynamodb:REGION:ACCOUNT:table/TABLE/stream/LABEL``."""

    arn: str
    region: str
    account: str
    table: str
    label: str

    @classmethod
    def parse(cls, arn: str) -> "StreamArn":
        head, sep, rest = arn.partition(_TABLE_MARK)
        parts = head.split(":")
        table, sep2, label = rest.partition(_STREAM_MARK)
        if not sep or not sep2 or len(parts) != 5 or parts[0] != "arn" or parts[2] != "dynamodb" \
                or not table or not label:
            raise ValueError(f"{arn!r} is not a DynamoDB stream ARN "
                             "(arn:aws:dynamodb:REGION:ACCOUNT:table/TABLE/stream/LABEL)")
        return cls(arn, parts[3], parts[4], table, label)


def table_of_stream(stream_arn: str) -> str:
    """The table name in a stream ARN, for metric labels and logs (never a key or
    a value); the ARN itself when it is not one."""
    if _TABLE_MARK not in stream_arn:
        return stream_arn
    return stream_arn.split(_TABLE_MARK, 1)[1].split("/", 1)[0]
