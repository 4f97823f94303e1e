"""Durable job state in a Bigtable table: per-shard checkpoints and dead letters.

Row keys (``job`` is the mapping name unless ``--job-name`` says otherwise)::

  {job}#ckpt#{stream label}#{shard id}   ckpt:seq, ckpt:finished, ckpt:change_ms, ckpt:updated_ms
  {job}#dlq#{what it is, hashed}          dlq:reason, dlq:error_class, dlq:message, dlq:failed_at_ms,
                                          dlq:stage, dlq:record (JSON), dlq:position
  (a dead letter's id is its record's position, stage and reason: a retry or a
  replay that dead-letters the record again rewrites the same row)

A checkpoint is written only after every write it covers is acknowledged by
Bigtable, and a dead letter is written before the checkpoint that passes it, so
a crash at any moment loses nothing: a restart replays from the checkpoint and
the replay is harmless (explicit timestamps, time-bounded deletes).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Protocol, Sequence

from ddb2bt.transforms.config import FamilyConfig
from ddb2bt.transforms.model import DeadLetter, SetCell, DeleteCells, StreamPosition
from ddb2bt.pipeline.control.letters import record_to_json
from ddb2bt.pipeline.control.versions import VersionOwners
from ddb2bt.pipeline.clients.bigtable.reads import (SMALL_ATTEMPT_TIMEOUT_S, data_client, iter_table, ms_datetime,
                                                    prefix_end, read_rows, read_table)
from ddb2bt.pipeline.clients.bigtable.errors import BigtablePermanent, BigtableRetryable
from ddb2bt.pipeline.clients.bigtable.channel import bigtable_endpoint, close_bounded
from ddb2bt.pipeline.clients.retry import DEFAULT_DEADLINE_S, RetryPolicy, retry_call

DEFAULT_STATE_TABLE = "ddb2bt_state"
CKPT = "ckpt"
DLQ = "dlq"
META = "meta"
STATE_FAMILIES = (
    FamilyConfig(CKPT, max_versions=1),
    FamilyConfig(DLQ, max_versions=1),
    FamilyConfig(META, max_versions=1),
)
DLQ_QUALIFIERS = (b"reason", b"error_class", b"message", b"stage", b"failed_at_ms", b"record", b"position")


class StateBackend(Protocol):
    """Rows in and out of the state table; Bigtable in production, a dict in tests."""

    def write_rows(self, rows: Sequence, before_retry: Optional[Callable[[], None]] = None) -> None:
        """rows: (row_key, [SetCell|DeleteCells...]); durable when this returns.
        ``before_retry()`` runs before each retry of the write and may raise to stop it."""

    def read_prefix(self, prefix: bytes, limit: Optional[int] = None) -> dict:
        """{row_key: {(family, qualifier): value}} latest versions only (the
        first ``limit`` rows, in key order, when given)."""

    def read_keys(self, keys: Sequence) -> dict:
        """As read_prefix, for the given rows only (missing rows are absent)."""


# A checkpoint's sequence number after `ddb2bt recover` (recover/recover.py): the
# changes up to the shard's oldest record are applied, so it resumes at TRIM_HORIZON.
RESUME_AT_TRIM_HORIZON = "TRIM_HORIZON"


@dataclass(frozen=True, slots=True)
class ShardCheckpoint:
    stream_arn: str
    shard_id: str
    sequence_number: Optional[str]
    finished: bool = False
    change_ms: Optional[int] = None  # time of the last applied change
    updated_ms: int = 0


def stream_label(stream_arn: str) -> str:
    """The stream's label (the part after /stream/), e.g. 2024-01-01T00:00:00.000.
    A disabled-and-re-enabled stream has a new label, so its shards never reuse
    the old stream's checkpoints."""
    return stream_arn.rsplit("/stream/", 1)[-1] if "/stream/" in stream_arn else hashlib.sha1(
        stream_arn.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class BackfillCheckpoint:
    source: str  # scan | export
    part: str
    resume: Optional[str]  # token to resume after (None: from the start)
    count: int  # items of this part applied so far
    done: bool = False


def dead_letter_id(letter: DeadLetter, where: str) -> str:
    """A dead letter's id: what it is (the record's position, or its keys and
    change time where it has none; why and where it failed), not when it was
    stored, so a retried or replayed bundle that dead-letters the same record
    again overwrites its letter instead of adding one."""
    what = where or record_to_json(letter.record, include_values=False)
    return hashlib.sha1(f"{what}|{letter.stage}|{letter.reason}".encode()).hexdigest()[:20]


class StateStore:
    def __init__(self, backend: StateBackend, job: str, now_ms: Callable[[], int],
                 include_values: bool = True) -> None:
        self._backend = backend
        self._job = job
        self._now_ms = now_ms
        self._include_values = include_values

    # -- checkpoints

    @property
    def job(self) -> str:
        """The name this job's state is kept under (its mapping's name)."""
        return self._job

    def check_between_attempts(self, check: Callable[[], None]) -> "StateStore":
        """Every retried call of this store runs ``check`` before its next attempt
        (its job coordinator's lease check: a process that lost its lease does not
        sit in a retry loop for minutes). A backend without retries ignores it."""
        if hasattr(self._backend, "between_attempts"):
            self._backend.between_attempts = check
        return self

    def _ckpt_prefix(self, stream_arn: str) -> bytes:
        return f"{self._job}#ckpt#{stream_label(stream_arn)}#".encode()

    def save_checkpoints(self, checkpoints: Iterable[ShardCheckpoint],
                         still_owner: Optional[Callable[[], None]] = None) -> None:
        """``still_owner()`` raises LeaseLost once the shards' partition moved to
        another worker: run before every retry of the write, so a worker that
        lost its partition (paused, partitioned) does not checkpoint after the
        new owner (docs/design.md §6.5)."""
        now = self._now_ms()
        rows = []
        for c in checkpoints:
            cells = {b"updated_ms": str(now).encode(), b"stream_arn": c.stream_arn.encode()}
            if c.sequence_number is not None:
                cells[b"seq"] = c.sequence_number.encode()
            if c.change_ms is not None:
                cells[b"change_ms"] = str(c.change_ms).encode()
            if c.finished:
                cells[b"finished"] = b"1"
            rows.append((self._ckpt_prefix(c.stream_arn) + c.shard_id.encode(), _set_latest(CKPT, cells, now)))
        if rows:
            self._backend.write_rows(rows, still_owner)

    def known_stream_labels(self) -> set:
        """Labels of every stream this job has checkpoints for."""
        prefix = f"{self._job}#ckpt#".encode()
        return {key[len(prefix):].split(b"#", 1)[0].decode() for key in self._backend.read_prefix(prefix)}

    def load_checkpoints(self, stream_arn: str, shard_ids: Optional[Iterable[str]] = None) -> dict:
        """{shard id: ShardCheckpoint} of the stream: every shard's, or only those
        of ``shard_ids`` (a reader's discovery needs its own shards' and their
        parents': a few rows, not the thousands a long-lived stream accumulates)."""
        prefix = self._ckpt_prefix(stream_arn)
        if shard_ids is None:
            rows = self._backend.read_prefix(prefix)
        else:
            keys = [prefix + shard_id.encode() for shard_id in sorted(set(shard_ids))]
            rows = self._backend.read_keys(keys) if keys else {}
        out = {}
        for key, cells in rows.items():
            shard_id = key[len(prefix):].decode()
            seq = cells.get((CKPT, b"seq"))
            change = cells.get((CKPT, b"change_ms"))
            out[shard_id] = ShardCheckpoint(
                stream_arn=stream_arn,
                shard_id=shard_id,
                sequence_number=seq.decode() if seq else None,
                finished=cells.get((CKPT, b"finished")) == b"1",
                change_ms=int(change) if change else None,
                updated_ms=int(cells.get((CKPT, b"updated_ms"), b"0")),
            )
        return out

    def has_checkpoints(self, stream_arn: str) -> bool:
        """Whether the job ever checkpointed a shard of the stream (one row read,
        not the row of every shard the stream ever had)."""
        return bool(self._backend.read_prefix(self._ckpt_prefix(stream_arn), limit=1))

    # -- backfill progress
    def save_backfill_progress(self, parts: Iterable[BackfillCheckpoint]) -> None:
        now = self._now_ms()
        rows = []
        for p in parts:
            cells = {b"count": str(p.count).encode(), b"updated_ms": str(now).encode(),
                     b"done": b"1" if p.done else b"0"}
            cells[b"resume"] = (p.resume or "").encode()
            rows.append((f"{self._job}#bf#{p.source}#{p.part}".encode(), _set_latest(CKPT, cells, now)))
        if rows:
            self._backend.write_rows(rows)

    def load_backfill_progress(self, source: Optional[str] = None) -> dict:
        """{(source, part): BackfillCheckpoint}."""
        prefix = f"{self._job}#bf#{source + '#' if source else ''}".encode()
        out = {}
        for key, cells in self._backend.read_prefix(prefix).items():
            src, part = key.decode().split("#bf#", 1)[1].split("#", 1)
            resume = cells.get((CKPT, b"resume"), b"").decode()
            out[(src, part)] = BackfillCheckpoint(src, part, resume or None, int(cells.get((CKPT, b"count"), b"0")),
                                                  cells.get((CKPT, b"done")) == b"1")
        return out

    def clear_backfill_progress(self) -> None:
        """Forget backfill progress (a new backfill with a new handoff time)."""
        rows = self._backend.read_prefix(f"{self._job}#bf#".encode())
        now = self._now_ms()
        deletes = [(key, [DeleteCells(fam, q, 0, now + 1) for (fam, q) in cells]) for key, cells in rows.items()]
        if deletes:
            self._backend.write_rows(deletes)

    # -- the backfill's repair journal (pipeline/sink/guards.py): guarded rows are
    # recorded here before they are written, so a crash between their write and
    # their repair is repaired on resume even if the Scan no longer returns them.
    def _repair_prefix(self, source: str, part: str) -> bytes:
        return f"{self._job}#bfrepair#{source}#{part}#".encode()

    def save_repair_intent(self, source: str, part: str, intent_id: str, payload: str) -> bytes:
        """Durably record one batch's guarded rows of a part; returns its key."""
        now = self._now_ms()
        key = self._repair_prefix(source, part) + intent_id.encode()
        self._backend.write_rows([(key, _set_latest(CKPT, {b"rows": payload.encode()}, now))])
        return key

    def load_repair_intents(self, source: str, part: str) -> dict:
        """{key: payload} of the part's recorded, not yet cleared, guarded rows."""
        rows = self._backend.read_prefix(self._repair_prefix(source, part))
        return {key: cells[(CKPT, b"rows")].decode() for key, cells in rows.items() if (CKPT, b"rows") in cells}

    def clear_repair_intents(self, keys: Sequence) -> None:
        now = self._now_ms()
        rows = [(key, [DeleteCells(CKPT, b"rows", 0, now + 1)]) for key in keys]
        if rows:
            self._backend.write_rows(rows)

    def delete_dead_letters(self, ids: Sequence) -> None:
        """Remove dead letters by id (after a successful redrive)."""
        now = self._now_ms()
        rows = []
        for dl_id in ids:
            key = f"{self._job}#dlq#{dl_id}".encode()
            rows.append((key, [DeleteCells(DLQ, q, 0, now + 1) for q in DLQ_QUALIFIERS]))
        if rows:
            self._backend.write_rows(rows)

    def close(self) -> None:
        close = getattr(self._backend, "close", None)
        if close:
            close()

    def count_dead_letters(self) -> int:
        return len(self._backend.read_prefix(f"{self._job}#dlq#".encode()))

    # -- dead letters
    def save_dead_letters(self, letters: Sequence[DeadLetter]) -> None:
        now = self._now_ms()
        rows = []
        for dl in letters:
            pos = dl.record.position
            # A stream record's position, or a backfilled item's (source/part#ordinal).
            where = (f"{pos.shard_id}/{pos.sequence_number}" if isinstance(pos, StreamPosition) else
                     f"{pos.source}/{pos.part}#{pos.count}" if pos is not None else "")
            key = f"{self._job}#dlq#{dead_letter_id(dl, where)}".encode()
            cells = {
                b"reason": dl.reason.encode(),
                b"error_class": dl.error_class.encode(),
                b"message": dl.message.encode("utf-8", "replace"),
                b"stage": dl.stage.encode(),
                b"failed_at_ms": str(dl.failed_at_ms).encode(),
                b"record": record_to_json(dl.record, self._include_values).encode(),
            }
            if pos is not None:
                cells[b"position"] = where.encode()
            rows.append((key, _set_latest(DLQ, cells, now)))
        if rows:
            self._backend.write_rows(rows)

    def list_dead_letters(self, reason: Optional[str] = None, since_ms: Optional[int] = None) -> list:
        prefix = f"{self._job}#dlq#".encode()
        out = []
        for key, cells in self._backend.read_prefix(prefix).items():
            entry = {q.decode(): v.decode("utf-8", "replace") for (fam, q), v in cells.items() if fam == DLQ}
            entry["id"] = key[len(prefix):].decode()
            if reason and entry.get("reason") != reason:
                continue
            if since_ms is not None and int(entry.get("failed_at_ms", "0")) < since_ms:
                continue
            out.append(entry)
        return sorted(out, key=lambda e: (int(e.get("failed_at_ms", "0") or 0), e["id"]))

    # -- versioned-cell ownership (versions.py)
    def versions(self):
        """The version-ownership registry on this store's backend, or None when the
        backend cannot do atomic claims."""
        if not (hasattr(self._backend, "claim") and hasattr(self._backend, "read_keys")):
            return None
        return VersionOwners(self._backend, self._job, self._now_ms)

    # -- job metadata (phase etc.)
    def save_meta(self, name: str, value: str) -> None:
        now = self._now_ms()
        self._backend.write_rows([(f"{self._job}#meta#{name}".encode(), _set_latest(META, {b"value": value.encode()}, now))])

    def load_meta(self, name: str) -> Optional[str]:
        # A prefix read also returns longer names ("phase" → "phase_changed_ms"): _load_value takes the exact row.
        return self._load_value(f"{self._job}#meta#{name}".encode())


    def load_lease(self, role: str) -> Optional[bytes]:
        """The raw value of this job's ``role`` lease cell (lease.LeaseState.parse
        reads it), None when no lease was ever taken."""
        key = f"{self._job}#lease#{role}".encode()
        cells = self._backend.read_prefix(key).get(key)
        return cells.get((META, b"lease")) if cells else None

    def load_job_meta(self, job: str, name: str) -> Optional[str]:
        """Another job's meta cell ``name`` (``load_meta`` of that job)."""
        return self._load_value(f"{job}#meta#{name}".encode())

    def swap_meta(self, name: str, expected: Optional[str], value: str) -> bool:
        """Compare-and-set of a meta value (CheckAndMutateRow): write ``value`` iff
        the stored one is exactly ``expected`` (None: absent). True when written."""
        key = f"{self._job}#meta#{name}".encode()
        return self._backend.swap(key, META, b"value", None if expected is None else expected.encode(),
                                  value.encode(), self._now_ms())

    # -- what the stream readers last saw of their shards (read by `status`, which
    # then needs no GetRecords call of its own: docs/operations.md, AWS limits)
    def save_reader_report(self, stream_arn: str, partition: str, pending_since: dict, ended: bool = False,
                           heads: Optional[dict] = None) -> None:
        """``pending_since``: {shard id: creation ms of the oldest record not read
        yet, or None at the head}, as partition ``partition`` of the stream saw it now;
        ``ended``: the partition's reader stopped after this report (nobody reads on);
        ``heads``: {shard id: the latest time the reader saw it at its head} (what
        proves a trimmed checkpoint harmless: docs/design.md §8.2)."""
        report = {"at_ms": self._now_ms(), "shards": pending_since, "ended": ended}
        if heads:
            report["heads"] = heads
        body = json.dumps(report, sort_keys=True)
        self.save_meta(f"{READER_REPORT}#{stream_label(stream_arn)}#{partition}", body)

    def load_shard_heads(self, stream_arn: str) -> dict:
        """{shard id: the latest time any reader of this job recorded it at its
        head}, over every partition's report (a report of an earlier partition
        layout holds facts as true as the current one's)."""
        out: dict = {}
        for report in self.load_reader_reports(stream_arn):
            for shard_id, head_ms in (report.get("heads") or {}).items():
                out[shard_id] = max(head_ms, out.get(shard_id, head_ms))
        return out

    def load_reader_reports(self, stream_arn: str) -> list:
        """[{"at_ms": ..., "shards": {...}}] of every partition that reported."""
        prefix = f"{self._job}#meta#{READER_REPORT}#{stream_label(stream_arn)}#".encode()
        out = []
        for cells in self._backend.read_prefix(prefix).values():
            value = cells.get((META, b"value"))
            if value is not None:
                out.append(json.loads(value.decode()))
        return out

    # -- the shares of a Kinesis stream's read budget (pipeline/source/kinesis_share.py):
    # one row per stream for every job that reads it, so outside every job's rows
    def load_stream_shares(self, stream: str) -> Optional[str]:
        return self._load_value(stream_shares_key(stream))

    def swap_stream_shares(self, stream: str, expected: Optional[str], value: str) -> bool:
        """Compare-and-set of the stream's shares row: two jobs starting at once
        cannot both take the last of the budget."""
        return self._swap_value(stream_shares_key(stream), expected, value)

    # -- a call rate shared by every process (and job) of this state table
    # (pipeline/control/shared_rate.py): one row per rate, outside every job's rows
    def load_shared_rate(self, name: str) -> Optional[str]:
        return self._load_value(shared_rate_key(name))

    def swap_shared_rate(self, name: str, expected: Optional[str], value: str) -> bool:
        """Compare-and-set of the rate's row (CheckAndMutateRow)."""
        return self._swap_value(shared_rate_key(name), expected, value)

    def _load_value(self, key: bytes) -> Optional[str]:
        cells = self._backend.read_prefix(key).get(key)
        value = cells.get((META, b"value")) if cells else None
        return value.decode() if value is not None else None

    def _swap_value(self, key: bytes, expected: Optional[str], value: str) -> bool:
        return self._backend.swap(key, META, b"value", None if expected is None else expected.encode(),
                                  value.encode(), self._now_ms())

    def load_job_lease(self, job: str, role: str) -> Optional[bytes]:
        """The raw ``role`` lease cell of another job in this state table."""
        key = f"{job}#lease#{role}".encode()
        cells = self._backend.read_prefix(key).get(key)
        return cells.get((META, b"lease")) if cells else None


READER_REPORT = "reader"
# The shares row's key begins with "#": a job's rows begin with its (non-empty) name.
STREAM_SHARES_PREFIX = "#kinesis-share#"


def stream_shares_key(stream: str) -> bytes:
    return f"{STREAM_SHARES_PREFIX}{stream}".encode()


# A shared rate's row (shared_rate.SharedRate): "#" first, like the shares row.
SHARED_RATE_PREFIX = "#rate#"


def shared_rate_key(name: str) -> bytes:
    return f"{SHARED_RATE_PREFIX}{name}".encode()


def _set_latest(family: str, cells: dict, ts_ms: int) -> list:
    """SetCell at ``ts_ms`` plus removal of older versions, per column."""
    out = []
    for qualifier, value in sorted(cells.items()):
        out.append(SetCell(family, qualifier, value, ts_ms))
        out.append(DeleteCells(family, qualifier, 0, ts_ms))
    return out


class BigtableStateBackend:
    """StateBackend on a Bigtable table, through the same MutationWriter as the sink."""

    def __init__(self, writer, project: str, instance: str, table_id: str, deadline_s: Optional[float] = None,
                 app_profile: Optional[str] = None, owns_writer: bool = False) -> None:
        self._writer = writer
        self._owns_writer = owns_writer  # made for this backend: closed with it
        # State rows are read back by conditional calls (claims): written and read
        # through the transactional (single-cluster) profile, also when the
        # writer is the sink's (docs/operations.md#ha-instances-app-profiles).
        route = getattr(writer, "route_transactional", None)
        if route is not None:
            route(table_id)
        self._app_profile = app_profile
        self._project = project
        self._instance = instance
        self._table_id = table_id
        # Give up on an unreachable state table after this long (a job's
        # --bigtable-deadline; read-only commands: ~25 s).
        self._deadline_s = DEFAULT_DEADLINE_S if deadline_s is None else deadline_s
        self._client = None  # one data client for all reads (phase and checkpoint reads are frequent)
        # Run before every retry of a state call: the lease check of the job this
        # store works for (StateStore.check_between_attempts), so no retry loop
        # outlives a lost lease.
        self.between_attempts: Optional[Callable[[], None]] = None

    def write_rows(self, rows: Sequence, before_retry: Optional[Callable[[], None]] = None) -> None:
        def attempt():
            statuses = self._writer.mutate_rows(self._table_id, rows)
            bad = [s for s in statuses if not s.ok]
            if any(not s.retryable for s in bad):
                raise BigtablePermanent(f"state table write failed: {bad[0].message}")
            if bad:
                raise BigtableRetryable(f"state table write failed: {bad[0].message}")

        on_retry = None if before_retry is None else (lambda exc: before_retry())
        retry_call(attempt, what=f"MutateRows on state table {self._table_id}",
                   policy=RetryPolicy(deadline_s=self._deadline_s), on_retry=on_retry,
                   where=f"Bigtable ({bigtable_endpoint()})", between_attempts=self.between_attempts)

    def _data_client(self):
        if self._client is None:
            self._client = data_client(self._project)
        return self._client

    def read_prefix(self, prefix: bytes, limit: Optional[int] = None) -> dict:
        rows = read_table(self._project, self._instance, self._table_id, prefix=prefix, latest_only=True, limit=limit,
                          client=self._data_client(), deadline_s=self._deadline_s,
                          attempt_timeout_s=SMALL_ATTEMPT_TIMEOUT_S, app_profile=self._app_profile,
                          between_attempts=self.between_attempts)
        return {k: {col: versions[0][1] for col, versions in cells.items()} for k, cells in rows.items()}

    def keys_written_since(self, prefix: bytes, since_ms: int) -> dict:
        """{row key: newest cell's timestamp} of the rows under ``prefix`` with a
        cell stamped at or after ``since_ms`` (filtered on the server). Streamed and
        resumed after the last row (``iter_table``): the prefix may hold millions
        of rows (every version's owner)."""
        from google.cloud.bigtable.data import row_filters

        since = row_filters.RowFilterChain([row_filters.TimestampRangeFilter(start=ms_datetime(since_ms)),
                                            row_filters.CellsColumnLimitFilter(1)])
        return {key: max(versions[0][0] for versions in cells.values())
                for key, cells in iter_table(self._project, self._instance, self._table_id,
                                             client=self._data_client(), deadline_s=self._deadline_s,
                                             start_key=prefix, end_key=prefix_end(prefix), row_filter=since,
                                             app_profile=self._app_profile)}

    def read_keys(self, keys: Sequence) -> dict:
        """Like read_prefix, for exactly these rows (absent rows are absent)."""
        # read_rows classifies the data client's errors and retries them itself
        # (warnings, then the state deadline).
        rows = read_rows(self._project, self._instance, self._table_id, keys, client=self._data_client(),
                         deadline_s=self._deadline_s, attempt_timeout_s=SMALL_ATTEMPT_TIMEOUT_S,
                         app_profile=self._app_profile, between_attempts=self.between_attempts)
        return {k: {col: versions[0][1] for col, versions in cells.items()} for k, cells in rows.items()}

    def swap(self, key: bytes, family: str, qualifier: bytes, expected: Optional[bytes], value: bytes,
             ts_ms: int) -> bool:
        """Compare-and-set of one state cell (the phase). A retried swap whose first
        attempt was applied answers False: callers re-read (their values are unique)."""
        return retry_call(lambda: self._writer.swap_cell(self._table_id, key, family, qualifier, expected, value,
                                                         ts_ms),
                          what=f"CheckAndMutateRow on state table {self._table_id}",
                          policy=RetryPolicy(deadline_s=self._deadline_s), where=f"Bigtable ({bigtable_endpoint()})",
                          between_attempts=self.between_attempts)

    def claim(self, key: bytes, unless, mutations: Sequence) -> bool:
        """CheckAndMutateRow on the state table: apply unless ``unless`` holds."""
        return retry_call(lambda: self._writer.check_and_mutate(self._table_id, key, unless, mutations),
                          what=f"CheckAndMutateRow on state table {self._table_id}",
                          policy=RetryPolicy(deadline_s=self._deadline_s), where=f"Bigtable ({bigtable_endpoint()})",
                          between_attempts=self.between_attempts)

    def close(self) -> None:
        if self._client is not None:
            close_bounded(self._client.close, "Bigtable data client")
            self._client = None
        if self._owns_writer and self._writer is not None:
            self._writer.close()
            self._writer = None
