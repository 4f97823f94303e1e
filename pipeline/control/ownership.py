"""One job per target table: an ownership record in the state table.

The job lease (ddb2bt.pipeline.control.lease) keeps two processes of ONE job from
writing at once. It cannot see a second job — another ``--job-name``, or
another mapping name — writing the same target table: each has its own
checkpoints and lease, and the two replay the same items' changes in no common
order. Bigtable keeps no tombstones, so the slower one brings back what the
other deleted: the two-writers problem under another name.

So every command that writes (run, migrate, backfill) claims each table its
mapping writes (the target and any index tables) before it writes anything:

* the record is one cell, ``meta:owner`` of row ``_owner#{project}/{instance}/{table}``
  in the state table, holding the owning job's name, since when and by which
  command (JSON);
* a claim is a compare-and-set (CheckAndMutateRow on the newest value), so of
  two jobs starting at once exactly one becomes the owner;
* a table owned by the same job is simply used; one owned by another job is
  refused, naming the owner, unless the command says ``--adopt-target`` (the
  other job is retired or renamed: this job becomes the owner). The record
  stays when a job stops — a stopped job is still the table's writer until it
  is retired; ``ddb2bt release-target`` (or adopting) ends that.

Claims of a multi-table job are all or none: a refused table releases the
claims this call made. The record lives in the state table the command uses:
jobs given different ``--state-table`` values cannot see each other's records.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ddb2bt.transforms.errors import ConfigError
from ddb2bt.pipeline.clients.retry import READ_ONLY_DEADLINE_S
from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter

__all__ = ["OWNER_FAMILY", "OWNER_QUALIFIER", "OwnerRecord", "TargetOwned", "TargetOwnership", "owner_row_key"]

log = logging.getLogger(__name__)

OWNER_FAMILY = "meta"  # a family every state table has (ddb2bt.pipeline.control.state)
OWNER_QUALIFIER = b"owner"
ROW_PREFIX = "_owner#"
# A lost compare-and-set means another job changed the record meanwhile: read it
# again; more rounds than this means it keeps changing (two jobs adopting at once).
CLAIM_ROUNDS = 3


class TargetOwned(ConfigError):
    """The target table belongs to another job (exit code 2: change the command)."""


def owner_row_key(project: str, instance: str, table: str) -> bytes:
    return f"{ROW_PREFIX}{project}/{instance}/{table}".encode()


@dataclass(frozen=True)
class OwnerRecord:
    job: str
    since_ms: int
    command: str = ""

    def to_bytes(self) -> bytes:
        return json.dumps({"job": self.job, "since_ms": self.since_ms, "command": self.command},
                          sort_keys=True).encode()

    @classmethod
    def parse(cls, raw: Optional[bytes]) -> Optional["OwnerRecord"]:
        if not raw:
            return None
        try:
            data = json.loads(raw)
            return cls(str(data["job"]), int(data.get("since_ms", 0)), str(data.get("command", "")))
        except (ValueError, KeyError, TypeError):
            return None  # unreadable: treated as free, and overwritten by the claim's compare-and-set

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since_ms / 1000))
        return f"job {self.job!r} (owner since {since}{', ' + self.command if self.command else ''})"


class TargetOwnership:
    """Claims and releases through a writer with ``read_cell`` and ``swap_cell``
    (GrpcMutationWriter on the state table's instance, or the in-memory fake)."""

    def __init__(self, writer, state_table: str, project: str, instance: str,
                 now_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000) -> None:
        self._writer, self._state_table = writer, state_table
        self._project, self._instance = project, instance
        self._now_ms = now_ms

    def owner(self, table: str) -> Optional[OwnerRecord]:
        return OwnerRecord.parse(self._read(table))

    def _read(self, table: str) -> Optional[bytes]:
        return self._writer.read_cell(self._state_table, owner_row_key(self._project, self._instance, table),
                                      OWNER_FAMILY, OWNER_QUALIFIER)

    def _swap(self, table: str, expected: Optional[bytes], value: bytes) -> bool:
        return self._writer.swap_cell(self._state_table, owner_row_key(self._project, self._instance, table),
                                      OWNER_FAMILY, OWNER_QUALIFIER, expected, value, self._now_ms())

    def claim(self, table: str, job: str, command: str = "", adopt: bool = False) -> Optional[bytes]:
        """Make ``job`` the owner of ``table``, or raise TargetOwned naming the
        owner. Returns the record replaced (b"" when the table was free; None
        when ``job`` owned it already), for ``undo``."""
        for _ in range(CLAIM_ROUNDS):
            raw = self._read(table)
            current = OwnerRecord.parse(raw)
            if current is not None and current.job == job:
                return None
            if current is not None and not adopt:
                raise TargetOwned(self.refusal(table, job, current), "--job-name")
            mine = OwnerRecord(job, self._now_ms(), command)
            if self._swap(table, raw, mine.to_bytes()):
                if current is not None:
                    log.warning("target table %s: adopted from %s by job %r (--adopt-target); that job must not "
                                "write it any more", table, current.describe(), job)
                return raw or b""
        raise TargetOwned(f"the owner of target table {table} kept changing while job {job!r} claimed it; "
                          "is another job adopting it right now?", "--adopt-target")

    def undo(self, table: str, job: str, replaced: Optional[bytes]) -> None:
        """Give back a claim this process just made (``replaced`` from ``claim``)."""
        if replaced is None:
            return
        raw = self._read(table)
        current = OwnerRecord.parse(raw)
        if current is not None and current.job == job:
            self._swap(table, raw, replaced) if replaced else self._clear(table, raw)

    def release(self, table: str, job: str) -> bool:
        """End ``job``'s ownership of ``table`` (it is retired). False when it
        did not own it."""
        raw = self._read(table)
        current = OwnerRecord.parse(raw)
        if current is None or current.job != job:
            return False
        return self._clear(table, raw)

    def _clear(self, table: str, raw: bytes) -> bool:
        # An empty value reads as "free" (OwnerRecord.parse), and the swap keeps
        # the compare-and-set: no delete that could race a new claim.
        return self._swap(table, raw, b"")

    def refusal(self, table: str, job: str, owner: OwnerRecord) -> str:
        return (f"target table {self._project}/{self._instance}/{table} is owned by {owner.describe()}; job "
                f"{job!r} would be a second writer of it — two jobs replaying the same items' changes in no "
                "common order bring deleted data back (Bigtable keeps no tombstones). To continue that job, "
                f"use --job-name {owner.job}; if it is retired (stopped for good) or renamed, rerun with "
                "--adopt-target to make this job the owner (or free the table with ddb2bt release-target).")


def claim_targets(mappings: list, states: list, *, command: str, adopt: bool = False,
                  make_writer: Optional[Callable] = None) -> None:
    """Claim every table each mapping writes for its job (``states``: the
    StateSpecs), all or none. ``make_writer(state)`` → a writer with
    read_cell/swap_cell (default: gRPC to the state table's instance)."""
    made: list = []  # (ownership, table, job, replaced)
    writers: list = []
    try:
        for mapping, state in zip(mappings, states):
            writer = make_writer(state) if make_writer else _grpc_writer(state)
            writers.append(writer)
            ownership = TargetOwnership(writer, state.table, mapping.target.project, mapping.target.instance)
            for table in mapping.tables:
                made.append((ownership, table, state.job, ownership.claim(table, state.job, command, adopt)))
    except BaseException:
        for ownership, table, job, replaced in reversed(made):
            try:
                ownership.undo(table, job, replaced)
            except Exception:  # the refusal matters more; a leftover claim is ours and named
                log.warning("could not give back the claim of %s by job %r", table, job, exc_info=True)
        raise
    finally:
        for writer in writers:
            close = getattr(writer, "close", None)
            if close is not None:
                close()


def release_targets(mappings: list, states: list, make_writer: Optional[Callable] = None) -> list:
    """``ddb2bt release-target``: each job gives up its tables. [(table, released)]."""
    out = []
    for mapping, state in zip(mappings, states):
        writer = make_writer(state) if make_writer else _grpc_writer(state)
        try:
            ownership = TargetOwnership(writer, state.table, mapping.target.project, mapping.target.instance)
            out += [(table, ownership.release(table, state.job)) for table in mapping.tables]
        finally:
            close = getattr(writer, "close", None)
            if close is not None:
                close()
    return out


def _grpc_writer(state):
    b = state.bigtable
    return GrpcMutationWriter(b.project, b.instance, b.app_profile, timeout_s=READ_ONLY_DEADLINE_S)
