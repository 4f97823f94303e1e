"""Bigtable errors, classified once, where they enter: ``EntryStatus.retryable``
for per-entry MutateRows failures, ``BigtableRetryable`` / ``BigtablePermanent``
for whole calls (gRPC codes and the data client's google.api_core errors), and
the row-filter size Bigtable refuses (``check_filter_size``)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import grpc

from ddb2bt.transforms.errors import MappingError, PermanentError, RetryableError


OK = grpc.StatusCode.OK.value[0]
# Codes a retry can fix. INTERNAL and UNKNOWN are transient on the service
# except for the messages in _PERMANENT_MESSAGES (the emulator reports unknown
# families and bad timestamps that way; the service says NOT_FOUND/INVALID_ARGUMENT).
RETRYABLE_CODES = frozenset(
    c.value[0] for c in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED,
                         grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
)
_PERMANENT_MESSAGES = (
    (re.compile(r"unknown family|family .* (not found|does not exist)", re.I), "unknown_family"),
    (re.compile(r"invalid timestamp", re.I), "invalid_timestamp"),
)
_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}
# Whole-call failures no retry or isolation can fix.
FATAL_CODES = ("NOT_FOUND", "PERMISSION_DENIED", "UNAUTHENTICATED")
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]


def code_name(code: int) -> str:
    return _CODE_NAMES.get(code, str(code))


@dataclass(frozen=True, slots=True)
class EntryStatus:
    """Outcome of one MutateRows entry."""

    code: int
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.code == OK

    @property
    def permanent_reason(self) -> Optional[str]:
        for pattern, reason in _PERMANENT_MESSAGES:
            if pattern.search(self.message):
                return reason
        if self.code in RETRYABLE_CODES:
            return None
        if self.code == grpc.StatusCode.NOT_FOUND.value[0]:
            return "unknown_family"  # the service's answer for a missing family
        return code_name(self.code).lower()

    @property
    def retryable(self) -> bool:
        return not self.ok and self.permanent_reason is None


ENTRY_OK = EntryStatus(OK)


class BigtableRetryable(RetryableError):
    """A whole MutateRows call failed in a way a retry may fix."""


class BigtablePermanent(PermanentError):
    """A whole call failed for good (table missing, permission denied...)."""


# Bigtable rejects a row filter (a CheckAndMutateRow predicate, a ReadRows filter)
# whose serialized size is over 20,480 bytes with INVALID_ARGUMENT
# (googleapis/java-bigtable-hbase#2192); the emulator accepts any size.
MAX_ROW_FILTER_BYTES = 20_480


class RowFilterTooLarge(MappingError):
    """A predicate over Bigtable's row-filter size limit: sent, it would fail for
    good (INVALID_ARGUMENT), so it is refused before sending, naming the row."""


def check_filter_size(row_filter, what: str, table_id: str, row_key: bytes) -> None:
    """Refuse a row filter Bigtable would reject (the row key is not named: it
    may be personal data; the dead letter carrying this error names the change).
    ``row_filter``: a RowFilter message, or its serialized size (int)."""
    size = row_filter if type(row_filter) is int else row_filter.ByteSize()
    if size > MAX_ROW_FILTER_BYTES:
        raise RowFilterTooLarge(f"{what} on a row of {table_id} ({len(row_key)}-byte key): its predicate is {size} "
                                f"bytes, over Bigtable's row-filter limit of {MAX_ROW_FILTER_BYTES}",
                                reason="row_filter_too_large")


class BigtableUnreachable(PermanentError):
    """No connection to Bigtable (or the emulator) within the deadline."""


def classify_api_error(exc: Exception, method: str) -> Exception:
    """A google.api_core error from the data client, classified once, here."""
    from google.api_core import exceptions as gexc

    code = getattr(getattr(exc, "grpc_status_code", None), "name", None) or type(exc).__name__
    message = f"{method} failed: {code}: {getattr(exc, 'message', None) or exc}"
    retryable = (gexc.ServiceUnavailable, gexc.DeadlineExceeded, gexc.TooManyRequests, gexc.Aborted,
                 gexc.InternalServerError, gexc.Unknown, gexc.ResourceExhausted)
    if isinstance(exc, retryable):
        return BigtableRetryable(message, code=code)
    return BigtablePermanent(message, code=code)


def classify_rpc_error(exc: grpc.RpcError, method: str = "MutateRows") -> Exception:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    status = EntryStatus(code.value[0], details or "")
    message = f"{method} failed: {code.name}: {details}"
    if status.retryable:
        return BigtableRetryable(message, code=code.name)
    return BigtablePermanent(message, code=code.name)
