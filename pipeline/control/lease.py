"""One running holder per job: a lease in the state table.

Bigtable keeps no tombstones, so two processes writing one job's changes are a
data-loss bug: the slower one replays old images after the other applied later
removals, and the removed data comes back. Every ``run``, ``migrate`` and
``backfill`` therefore holds a lease before it writes:

* The lease is one cell, ``meta:lease`` of row ``{job}#lease#{role}`` in the
  state table (role ``tail`` for the live tail, ``backfill`` for the backfill, so
  a ``backfill`` may run next to a ``run`` of the same job, as documented). Its
  value is a small JSON record: holder id, host, pid, start time, expiry.
* Every change of the cell is a compare-and-set (``CheckAndMutateRow`` whose
  predicate is "the newest value is exactly the one I read"), so of two
  processes racing for a free lease exactly one wins.
* The holder renews it every ``renew_s`` (heartbeat thread); the expiry is the
  holder's wall clock plus ``ttl_s``. Another process may take a lease only once
  it is released, expired by the other's wall clock, or its holder is a process
  on this very machine that no longer exists.
* Fencing: before every write (each MutateRows / CheckAndMutateRow, each
  checkpoint save, and every reading round) the holder checks its OWN monotonic
  clock (CLOCK_BOOTTIME where there is one, which also runs while the host is
  suspended): the lease is valid until ``send time of the last successful renewal
  + ttl - margin`` with ``margin = ttl / 4``. A process paused by SIGSTOP or a
  frozen VM finds, when it resumes, that it may have lost the lease and stops
  before writing anything, ``margin`` seconds before a contender can have
  acquired it; and each write's RPC deadline is capped at the lease's remaining
  validity, so no write outlives it. (Assumes the hosts' wall clocks differ by
  less than the margin: NTP keeps them within milliseconds.)
* A blip is ridden through (docs/design.md, "Ownership"): when no renewal has
  succeeded for ``ttl - margin`` the holder does not give up, it stops writing
  (``check`` raises ``LeaseUnproven``, a retryable error, so every write's retry
  loop waits) and its heartbeat keeps trying. A renewal is a compare-and-set
  against the exact value this holder last wrote, so when one succeeds nobody
  else can have taken the lease meanwhile, and writing resumes without a
  restart. Only when the cell changed hands (``LeaseLost``) or ownership stayed
  unproven for ``give_up_s`` (``--bigtable-deadline``) does the holder stop for
  good.
* ``--take-over`` swaps the lease to the new process at once, which then waits
  until the old holder's expiry before writing: the old one fails its next
  renewal and stops, as above.
* On Dataflow the lease belongs to the job, not a process: the holder id is
  ``dataflow:<job name>``, the launcher takes it (with a start-up grace, since
  workers need minutes to start) and every worker renews it under that id.
* Inside a shared (Dataflow) job, each stream partition has an owner of its own
  (``PartitionOwners``): a lease per partition, held by one worker process
  (holder ``worker:<host>:<pid>:<nonce>``), taken by compare-and-set, renewed by
  that worker and checked before the reader reads and before the sink writes or
  checkpoints anything of that partition. Each acquisition writes a new value, so
  the cell works as the partition's epoch: a worker that was paused while Dataflow
  moved the partition to another worker finds, when it wakes, that its own
  monotonic clock has run past the lease (so it stops), and its renewal's
  compare-and-set fails against the new owner's value (so it never resumes).
  A worker that stops processing a partition (Dataflow moved it while the worker
  was healthy) releases the partition's lease after ``PARTITION_IDLE_RELEASE_S``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

from ddb2bt.pipeline.clients.bigtable.channel import bigtable_endpoint
from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
from ddb2bt.pipeline.clients.retry import BETWEEN_ATTEMPTS, DEFAULT_DEADLINE_S, RetryPolicy, retrying
from ddb2bt.transforms.errors import PermanentError, RetryableError

log = logging.getLogger(__name__)

TAIL, BACKFILL = "tail", "backfill"
DEFAULT_TTL_S = 20.0  # a crashed holder is replaced within ttl + renew (25 s)
DEFAULT_RENEW_S = 5.0
MIN_TTL_S = 2.0
LEASE_FAMILY = "meta"
LEASE_QUALIFIER = b"lease"
# A Dataflow launch holds the lease this long before any worker renews it.
DATAFLOW_START_GRACE_S = 900.0
# Lease RPCs are small: a renewal must not hang longer than a renewal interval.
LEASE_RPC_TIMEOUT_S = 5.0
FAIL, STANDBY, TAKE_OVER = "fail", "standby", "take_over"
MODES = (FAIL, STANDBY, TAKE_OVER)


class LeaseHeld(PermanentError):
    """Another live process (or Dataflow job) holds the job's lease."""


class LeaseLost(PermanentError):
    """This process may no longer write: its lease was taken over, or stayed
    unproven for longer than the give-up deadline."""


class LeaseUnproven(RetryableError):
    """This process cannot prove right now that it still holds its lease (no
    renewal succeeded for ``ttl - margin``): it writes nothing until one does.
    Retryable: the heartbeat keeps renewing, and a write's retry loop waits."""


def margin_s(ttl_s: float) -> float:
    return ttl_s / 4


def boottime() -> float:
    """A monotonic clock that keeps counting while the process is stopped and
    while the host is suspended (Linux CLOCK_BOOTTIME); else time.monotonic."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(clock) if clock is not None else time.monotonic()


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def node_id() -> str:
    """This boot of this machine and pid namespace: two processes with the same
    node id see each other's pids, so a dead holder here is recognisable."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""  # unknown: never treat a holder as dead


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


@dataclass(frozen=True)
class LeaseOptions:
    """What a command asks for: how long a lease lives, how often it is renewed,
    and what to do when another process holds it."""

    ttl_s: float = DEFAULT_TTL_S
    renew_s: float = DEFAULT_RENEW_S
    mode: str = FAIL

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        if not self.ttl_s >= MIN_TTL_S:
            raise ValueError(f"the lease TTL must be at least {MIN_TTL_S:g}s")
        if not 0 < self.renew_s <= (self.ttl_s - margin_s(self.ttl_s)) / 2:
            raise ValueError(f"the lease renewal interval must be positive and at most (ttl - ttl/4) / 2 = "
                             f"{(self.ttl_s - margin_s(self.ttl_s)) / 2:g}s, so two renewals fit in the lease")


@dataclass(frozen=True)
class LeaseSpec:
    """Picklable: which lease a DoFn fences its writes with. ``bigtable`` is a
    ``BigtableSpec`` (where the state table lives)."""

    bigtable: object
    table: str
    job: str
    role: str
    holder: str
    ttl_s: float = DEFAULT_TTL_S
    renew_s: float = DEFAULT_RENEW_S
    shared: bool = False  # a Dataflow job: every worker renews as the holder
    # How long ownership may stay unproven (Bigtable unreachable, the process
    # paused) before the holder gives up for good: the job's --bigtable-deadline.
    give_up_s: float = DEFAULT_DEADLINE_S

    @property
    def row_key(self) -> bytes:
        return f"{self.job}#lease#{self.role}".encode()

    @property
    def key(self) -> tuple:
        b = self.bigtable
        return (b.project, b.instance, self.table, self.job, self.role, self.holder)


@dataclass(frozen=True)
class LeaseState:
    """The lease cell's value."""

    holder: str
    host: str
    pid: int
    node: str
    started_ms: int
    expires_ms: int
    command: str = ""
    released: bool = False

    def to_bytes(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    @classmethod
    def parse(cls, raw: Optional[bytes]) -> Optional["LeaseState"]:
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except (ValueError, TypeError):
            return None  # unreadable: treated as free, and replaced by compare-and-set

    def live(self, now_ms: int) -> bool:
        return not self.released and self.expires_ms > now_ms

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started_ms / 1000))
        who = self.holder if self.holder.startswith("dataflow:") else f"{self.command or 'process'} pid {self.pid}"
        return f"{who} on host {self.host}, started {started}"


class LeaseCell:
    """The lease row through a writer with ``read_cell`` and ``swap_cell``
    (GrpcMutationWriter, or the in-memory fake in tests)."""

    def __init__(self, writer, table: str, row_key: bytes, where: str = "Bigtable") -> None:
        self._writer, self._table, self._row_key = writer, table, row_key
        self.where = where  # the service and endpoint, for messages

    def read(self) -> Optional[bytes]:
        return self._writer.read_cell(self._table, self._row_key, LEASE_FAMILY, LEASE_QUALIFIER)

    def swap(self, expected: Optional[bytes], value: bytes, ts_ms: int) -> bool:
        return self._writer.swap_cell(self._table, self._row_key, LEASE_FAMILY, LEASE_QUALIFIER, expected, value,
                                      ts_ms)

    def close(self) -> None:
        close = getattr(self._writer, "close", None)
        if close:
            close()


# A worker releases a partition's lease when it has not processed the partition
# for this long (Dataflow moved it elsewhere): the new owner then waits at most
# this, not a whole TTL. Readers come back every poll interval (~1 s).
PARTITION_IDLE_RELEASE_S = 10.0
# A reading round keeps its partition's lease from being idle (a round may wait
# minutes in throttling back-off), but not for ever: a round whose generator the
# runner dropped without closing it (it leaks the count) stops counting after
# this long, past the readers' default give-up deadline (--dynamodb-deadline,
# 300 s), so a partition Dataflow moved is still released in the end.
PARTITION_ROUND_MAX_S = 900.0


class Lease:
    """One process's (or one Dataflow worker's) hold on a job's lease. Clocks and
    the cell are injected for tests."""

    def __init__(self, spec: LeaseSpec, cell: LeaseCell, *, command: str = "", wall: Callable[[], int] = wall_ms,
                 clock: Callable[[], float] = boottime, sleep: Callable[[float], None] = time.sleep,
                 host: Optional[str] = None, pid: Optional[int] = None, node: Optional[str] = None,
                 alive: Callable[[int], bool] = pid_alive) -> None:
        self.spec = spec
        self._cell = cell
        self._command = command
        self._wall, self._clock, self._sleep = wall, clock, sleep
        self._host = host if host is not None else socket.gethostname()
        self._pid = pid if pid is not None else os.getpid()
        self._node = node if node is not None else node_id()
        self._alive = alive
        self._margin = margin_s(spec.ttl_s)
        self._raw: Optional[bytes] = None  # the cell value we last wrote (or adopted)
        self._started_ms = wall()
        self._valid_until = float("-inf")
        self._not_before_ms = 0  # take-over: the old holder's expiry
        self._lost: Optional[str] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._last_warning = float("-inf")
        self._last_error: Optional[str] = None  # of the last failed renewal, for the final message
        self.active = False  # holding, with its heartbeat running
        # Partition leases: released by the heartbeat when not used for this long
        # and no reading round of the partition is running (``rounds``).
        self.idle_release_s: Optional[float] = None
        self.last_used = clock()
        self.rounds = 0
        self.round_started = float("-inf")  # the latest round's start (own clock)

    # -- state -------------------------------------------------------------------
    def _state(self, now_ms: int, ttl_s: Optional[float] = None, released: bool = False) -> LeaseState:
        return LeaseState(self.spec.holder, self._host, self._pid, self._node, self._started_ms,
                          now_ms if released else now_ms + int((ttl_s or self.spec.ttl_s) * 1000),
                          self._command, released)

    def _free(self, cur: Optional[LeaseState], now_ms: int) -> bool:
        if cur is None or not cur.live(now_ms) or cur.holder == self.spec.holder:
            return True
        if cur.node and cur.node == self._node:
            if cur.pid == self._pid:  # this process: free unless one of our own leases holds it
                return not any(l.spec.holder == cur.holder for l in _REGISTRY.values())
            return not self._alive(cur.pid)  # a holder on this machine that died (killed, crashed)
        return False

    @property
    def holding(self) -> bool:
        return self._raw is not None and self._lost is None

    # -- acquiring ---------------------------------------------------------------
    def try_acquire(self, take_over: bool = False, ttl_s: Optional[float] = None) -> Optional[LeaseState]:
        """Take the lease if it is free (or ``take_over``). None when held now;
        otherwise the live holder's state."""
        for _ in range(3):  # a lost compare-and-set means someone changed it: look again
            raw = self._cell.read()
            cur = LeaseState.parse(raw)
            now = self._wall()
            free = self._free(cur, now)
            if not free and not take_over:
                return cur
            new = self._state(now, ttl_s)
            sent = self._clock()
            if not self._cell.swap(raw, new.to_bytes(), now):
                continue
            with self._lock:
                self._raw = new.to_bytes()
                self._valid_until = sent + (ttl_s or self.spec.ttl_s) - self._margin
                self._lost = None
            if not free:
                self._not_before_ms = cur.expires_ms
                log.warning("took over the %s lease of job %s from %s; it stops writing when it next renews, and "
                            "this process starts writing at its expiry (in %.0fs)", self.spec.role, self.spec.job,
                            cur.describe(), max(0, cur.expires_ms - now) / 1000)
            elif cur is not None and cur.live(now) and cur.holder != self.spec.holder:
                log.warning("the previous holder of the %s lease of job %s (%s) no longer exists: replaced it",
                            self.spec.role, self.spec.job, cur.describe())
            return None
        cur = LeaseState.parse(self._cell.read())
        if cur is None:
            raise LeaseHeld(f"the {self.spec.role} lease of job {self.spec.job} kept changing while acquiring it")
        return cur

    def acquire(self, mode: str = FAIL, ttl_s: Optional[float] = None, heartbeat: bool = True,
                retry=None) -> None:
        """Hold the lease or raise LeaseHeld (mode fail); standby: wait for it.
        ``retry``: a RetryPolicy for the lease calls (failures logged, bounded)."""
        def attempt():
            return self.try_acquire(take_over=mode == TAKE_OVER, ttl_s=ttl_s)

        call = (retrying(retry, f"the {self.spec.role} lease of job {self.spec.job}", where=self._cell.where,
                         sleep=self._sleep) if retry is not None else (lambda fn: fn()))
        waiting_since = None
        while True:
            other = call(attempt)
            if other is None:
                break
            if mode != STANDBY:
                raise LeaseHeld(self.held_message(other))
            now = self._clock()
            if waiting_since is None or now - self._last_warning >= 60:
                log.warning("standby: the %s lease of job %s is held by %s; applying nothing until it is free "
                            "(checking every %gs)", self.spec.role, self.spec.job, other.describe(),
                            self.spec.renew_s)
                self._last_warning = now
                waiting_since = waiting_since or now
            self._sleep(self.spec.renew_s)
        if waiting_since is not None:
            log.warning("standby over: now holding the %s lease of job %s", self.spec.role, self.spec.job)
        if heartbeat:
            self.start_heartbeat()
        while self._wall() < self._not_before_ms:  # take-over: let the old holder's lease run out
            self._sleep(min(1.0, (self._not_before_ms - self._wall()) / 1000 + 0.01))

    def held_message(self, other: LeaseState) -> str:
        until = time.strftime("%H:%M:%S UTC", time.gmtime(other.expires_ms / 1000))
        return (f"job {self.spec.job} is already running: its {self.spec.role} lease is held by {other.describe()} "
                f"(renewed every few seconds; expires {until} if not renewed). Only one process may write a "
                f"job's changes. Stop the other one, or rerun with --take-over to replace it (it stops before "
                f"its next write, within {self.spec.ttl_s:g}s), or with --standby to wait and take over when it "
                "ends.")

    def join(self) -> None:
        """A worker of a job whose launcher took the lease: adopt it (shared, or
        this very holder), or raise LeaseLost."""
        if self.spec.shared:
            other = self.try_acquire()
            if other is not None:
                raise LeaseLost(f"job {self.spec.job}: the {self.spec.role} lease is held by {other.describe()}; "
                                "this job stops writing (it was taken over)")
        else:
            raw = self._cell.read()
            cur = LeaseState.parse(raw)
            now = self._wall()
            if cur is None or cur.holder != self.spec.holder or not cur.live(now):
                raise LeaseLost(f"job {self.spec.job}: this process no longer holds the {self.spec.role} lease "
                                f"({'held by ' + cur.describe() if cur and cur.live(now) else 'released or expired'})")
            with self._lock:
                self._raw = raw
                self._valid_until = self._clock() + (cur.expires_ms - now) / 1000 - self._margin
        self.start_heartbeat()

    # -- keeping it ----------------------------------------------------------------
    def _lose(self, reason: str) -> None:
        with self._lock:
            if self._lost is None:
                self._lost = reason
                log.error("%s", reason)

    def renew(self) -> bool:
        """One renewal. False when it failed (a transient error: retried by the
        heartbeat) or the lease is lost."""
        if self._lost is not None or self._raw is None:
            return False
        sent = self._clock()
        if self._gave_up(sent):
            self._lose(self._lapsed_message(sent))
            return False
        now = self._wall()
        new = self._state(now).to_bytes()
        try:
            swapped = self._cell.swap(self._raw, new, now)
            if not swapped:
                raw = self._cell.read()
            self._last_error = None
        except PermanentError as exc:
            if self.spec.shared:
                # A Dataflow worker never gives up for good (_gave_up): an error
                # classified permanent may still pass (PERMISSION_DENIED while an
                # IAM binding is edited), and a worker that lost the lease for
                # good would fail every bundle until it is replaced. It stays
                # unproven (writes paused) and keeps renewing; a renewal's
                # compare-and-set then proves nobody took over meanwhile.
                self._last_error = f"{self._cell.where}: {exc}"
                if sent - self._last_warning >= self.spec.renew_s:
                    self._last_warning = sent
                    log.warning("renewing the %s lease of job %s at %s failed (%s); a Dataflow worker keeps "
                                "trying: writes pause once the lease is unproven, and resume when a renewal "
                                "proves nobody took over", self.spec.role, self.spec.job, self._cell.where, exc)
                return False
            # Not a blip: no retry can make it succeed (the state table deleted,
            # access revoked). Waiting out give_up_s would hold the job for
            # minutes with its writes paused and nothing to wait for.
            self._lose(f"job {self.spec.job}: renewing the {self.spec.role} lease at {self._cell.where} failed and "
                       f"no retry can succeed ({exc}); was the state table deleted or access revoked? This process "
                       "stops before its next write")
            return False
        except RetryableError as exc:
            self._last_error = f"{self._cell.where}: {exc}"
            if sent - self._last_warning >= self.spec.renew_s:
                self._last_warning = sent
                left = self._valid_until - sent
                log.warning("renewing the %s lease of job %s at %s failed (%s); retrying; %s", self.spec.role,
                            self.spec.job, self._cell.where, exc,
                            f"this process pauses its writes in {left:.0f}s unless a renewal succeeds" if left > 0
                            else f"writes paused until a renewal proves nobody took over (gives up in "
                                 f"{max(0.0, self.spec.give_up_s - self._since_renewal(sent)):.0f}s)")
            return False
        with self._lock:
            if swapped:
                if sent > self._valid_until:  # writes were paused: the compare-and-set proves nobody took over
                    log.warning("the %s lease of job %s is renewed again after %.0fs unproven: nobody took over, "
                                "writing resumes", self.spec.role, self.spec.job, sent - self._valid_until)
                self._raw = new
                self._valid_until = sent + self.spec.ttl_s - self._margin
                return True
            cur = LeaseState.parse(raw)
            if cur is not None and cur.holder == self.spec.holder and cur.live(now):
                # Our own earlier renewal landed after its client-side timeout, or
                # (shared) another worker of the job renewed it: adopt that value.
                self._raw = raw
                self._valid_until = min(sent + (cur.expires_ms - now) / 1000, sent + self.spec.ttl_s) - self._margin
                return True
        if cur is not None and cur.holder == self.spec.holder:
            # Our own renewal, sent during a blip and applied only after it (the
            # network held it), already expired: nobody else wrote the cell since
            # (its holder would differ), so renew from that value.
            sent, now = self._clock(), self._wall()
            new = self._state(now).to_bytes()
            try:
                swapped = self._cell.swap(raw, new, now)
            except (RetryableError, PermanentError) as exc:
                self._last_error = f"{self._cell.where}: {exc}"
                return False
            if swapped:
                with self._lock:
                    self._raw = new
                    self._valid_until = sent + self.spec.ttl_s - self._margin
                log.warning("the %s lease of job %s is renewed again (a renewal delayed by the network landed "
                            "late): nobody took over, writing resumes", self.spec.role, self.spec.job)
                return True
            return False  # changed again meanwhile: the next renewal looks again
        if self.spec.shared and self.try_acquire() is None:
            return True
        if cur is None:
            self._lose(f"job {self.spec.job}: the {self.spec.role} lease was not found in the state table any more "
                       "(was the table deleted or recreated?); this process stops before its next write")
        else:
            self._lose(f"job {self.spec.job}: the {self.spec.role} lease was taken over by {cur.describe()}; this "
                       "process stops before its next write")
        return False

    def _gave_up(self, now: float) -> bool:
        """A process gives up after ``give_up_s`` without a renewal (its command
        then fails, naming Bigtable). A Dataflow worker never does: a worker whose
        lease is gone for good would fail every bundle forever, while Dataflow
        retries them; it stays unproven (bundles fail and are retried) until a
        renewal proves the job still holds the lease, or another holder shows."""
        return not self.spec.shared and self._since_renewal(now) >= self.spec.give_up_s

    def _since_renewal(self, now: float) -> float:
        """Seconds since the last successful renewal was sent (own clock)."""
        return now - self._valid_until + self.spec.ttl_s - self._margin

    def _lapsed_message(self, now: float) -> str:
        ago = self._since_renewal(now)
        cause = (f"renewing it kept failing: {self._last_error}" if self._last_error else
                 "this process was paused, or could not reach Bigtable")
        return (f"job {self.spec.job}: the {self.spec.role} lease was last renewed {ago:.0f}s ago ({cause}); "
                f"no renewal succeeded for more than {self.spec.give_up_s:g}s (--bigtable-deadline): this "
                "process stops before writing anything more")

    def _unproven_message(self, now: float) -> str:
        ago = now - self._valid_until + self.spec.ttl_s - self._margin
        cause = f"renewing it fails: {self._last_error}" if self._last_error else "this process was paused"
        return (f"job {self.spec.job}: the {self.spec.role} lease was last renewed {ago:.0f}s ago ({cause}); "
                "another process may hold it: writes are paused until a renewal proves nobody took over")

    def check(self) -> float:
        """The fence: seconds this process may still write. Raises LeaseUnproven
        (retryable) while no renewal succeeded for ttl - margin by its own clock,
        LeaseLost once it was taken over or stayed unproven for ``give_up_s``."""
        if self._lost is not None:
            raise LeaseLost(self._lost)
        if self._raw is None:
            raise LeaseLost(f"job {self.spec.job}: this process does not hold the {self.spec.role} lease")
        now = self._clock()
        remaining = self._valid_until - now
        if remaining > 0:
            return remaining
        if self._gave_up(now):
            self._lose(self._lapsed_message(now))
            raise LeaseLost(self._lost or "lease lost")
        # Unproven: the heartbeat keeps renewing (no RPC here, so a write path
        # never blocks on the lease); the caller's retry loop waits for it.
        raise LeaseUnproven(self._unproven_message(now))

    # -- heartbeat, release ------------------------------------------------------
    def start_heartbeat(self) -> None:
        if self._thread is not None:
            return
        self.active = True
        self._thread = threading.Thread(target=self._beat, name=f"lease-{self.spec.role}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        delay = self.spec.renew_s
        while not self._stop.wait(delay):
            if self.idle():
                log.info("released the %s lease of job %s: not used for %gs (the work moved)", self.spec.role,
                         self.spec.job, self.idle_release_s)
                self.release()
                return
            ok = self.renew()
            if self._lost is not None:
                return
            # After a failure, try again soon: the lease must not lapse for a blip.
            delay = self.spec.renew_s if ok else min(1.0, self.spec.renew_s)

    def idle(self) -> bool:
        """A partition lease nobody uses: no reading round of it running (a round
        may wait minutes in throttling back-off without claiming anything) and
        not used for ``idle_release_s``. Unproven (a blip, a pause): not idle,
        nothing to release yet."""
        now = self._clock()
        running = self.rounds > 0 and now - self.round_started < PARTITION_ROUND_MAX_S
        return (self.idle_release_s is not None and not running and now - self.last_used > self.idle_release_s
                and self._valid_until > now)

    def release(self) -> None:
        """Give the lease up (the next process takes it at once). Best effort: an
        unreleased lease expires after its TTL."""
        self._stop.set()
        self.active = False
        with self._lock:
            raw, self._raw = self._raw, None
            lost = self._lost
            self._lost = self._lost or f"job {self.spec.job}: the {self.spec.role} lease was released"
        _REGISTRY.pop(self.spec.key, None)
        try:
            if raw is None or lost is not None:
                return
            now = self._wall()
            try:
                self._cell.swap(raw, self._state(now, released=True).to_bytes(), now)
            except Exception as exc:  # the lease then simply expires
                log.warning("could not release the %s lease of job %s (%s); it expires in %gs", self.spec.role,
                            self.spec.job, exc, self.spec.ttl_s)
        finally:
            self._cell.close()

    def detach(self) -> None:
        """Stop renewing without releasing (a Dataflow launcher: the job's workers
        renew it from now on)."""
        self._stop.set()
        self.active = False
        _REGISTRY.pop(self.spec.key, None)
        self._cell.close()


# --- per process: the leases held, found again by the DoFns ----------------------

_REGISTRY: dict = {}
_REGISTRY_LOCK = threading.Lock()


def register(lease: Lease) -> Lease:
    _REGISTRY[lease.spec.key] = lease
    return lease


def check_held() -> None:
    """Every lease this process holds must still be valid (raises LeaseLost):
    run between retry attempts, so no retry loop outlives a lost lease."""
    for lease in list(_REGISTRY.values()):
        if lease.active:
            try:
                lease.check()
            except LeaseUnproven:
                pass  # the retry loop goes on waiting; its own write re-checks


if check_held not in BETWEEN_ATTEMPTS:
    BETWEEN_ATTEMPTS.append(check_held)


def lease_cell(spec: LeaseSpec) -> LeaseCell:
    b = spec.bigtable
    # The lease is a CheckAndMutateRow cell: through the state (single-cluster) profile.
    writer = GrpcMutationWriter(b.project, b.instance, getattr(b, "state_profile", b.app_profile),
                                timeout_s=LEASE_RPC_TIMEOUT_S)
    return LeaseCell(writer, spec.table, spec.row_key, f"Bigtable ({bigtable_endpoint()})")


def join(spec: Optional[LeaseSpec]) -> Optional[Lease]:
    """The lease a DoFn fences with: the one this process holds (local runs: the
    command took it), else joined as a worker of the job (Dataflow)."""
    if spec is None:
        return None
    with _REGISTRY_LOCK:
        lease = _REGISTRY.get(spec.key)
        if lease is not None and spec.shared and lease._lost is not None:
            # A Dataflow worker's lease that was lost (taken over, or the cell
            # gone) is joined again by the next DoFn set up after the failed
            # bundles, as a new worker would: it holds again only if its job
            # still does (else LeaseLost, naming the holder).
            lease.release()  # gives nothing up (it holds nothing): leaves the registry, closes its channel
            lease = None
        if lease is None:
            lease = Lease(spec, lease_cell(spec), command="worker")
            lease.join()
            register(lease)
        return lease


def fence(writer, lease: Optional[Lease]):
    """``writer`` with every write checked against the lease first (and its RPC
    deadline capped at the lease's remaining validity where the writer can)."""
    if lease is None:
        return writer
    if hasattr(writer, "set_fence"):
        writer.set_fence(lease.check)
        return writer
    return FencedWriter(writer, lease.check)


class FencedWriter:
    """A MutationWriter whose writes call ``check()`` first."""

    def __init__(self, writer, check: Callable[[], float]) -> None:
        self._writer, self._check = writer, check

    def mutate_rows(self, table_id, entries, **kwargs):
        self._check()
        return self._writer.mutate_rows(table_id, entries, **kwargs)

    def check_and_mutate(self, table_id, row_key, unless, mutations):
        self._check()
        return self._writer.check_and_mutate(table_id, row_key, unless, mutations)

    def swap_row(self, table_id, row_key, family, qualifier, expected, mutations, **kwargs):  # the ordering guard
        self._check()
        return self._writer.swap_row(table_id, row_key, family, qualifier, expected, mutations, **kwargs)

    def write_rows(self, rows, before_retry=None):  # a writer that is also a StateBackend (the in-memory fake)
        self._check()
        return self._writer.write_rows(rows, before_retry)

    def __getattr__(self, name):  # reads and close pass through
        return getattr(self._writer, name)


def dataflow_holder(job_name: str) -> str:
    return f"dataflow:{job_name}"


def hold(state_spec, role: str, options: LeaseOptions, *, command: str,
         dataflow_job: Optional[str] = None) -> tuple:
    """Take the job's ``role`` lease for a command: (Lease, LeaseSpec for the
    DoFns). Locally the lease is renewed by this process until ``release()``; for
    a Dataflow launch (``dataflow_job``) it is taken for the job with a start-up
    grace and handed over to the workers."""
    holder = dataflow_holder(dataflow_job) if dataflow_job else f"{command}:{uuid.uuid4().hex[:12]}"
    deadline = state_spec.bigtable.deadline_s
    spec = LeaseSpec(state_spec.bigtable, state_spec.table, state_spec.job, role, holder, options.ttl_s,
                     options.renew_s, shared=dataflow_job is not None,
                     give_up_s=deadline if deadline is not None else DEFAULT_DEADLINE_S)

    lease = Lease(spec, lease_cell(spec), command=command)
    retry = RetryPolicy(initial_s=0.2, max_backoff_s=5.0, **(
        {"deadline_s": state_spec.bigtable.deadline_s} if state_spec.bigtable.deadline_s is not None else {}))
    if dataflow_job:
        lease.acquire(options.mode, ttl_s=options.ttl_s + DATAFLOW_START_GRACE_S, heartbeat=False, retry=retry)
        lease.detach()
        return lease, spec
    register(lease)
    try:
        lease.acquire(options.mode, retry=retry)
    except BaseException:
        _REGISTRY.pop(spec.key, None)
        lease.release()  # closes its channel (it holds nothing to give up)
        raise
    return lease, spec


# --- per partition: which worker process of a shared job may write it -------------

WORKER_ID = f"worker:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def partition_index(shard_id: str, count: int) -> int:
    """The partition a shard belongs to (the readers' own rule, StreamPartition.owns)."""
    import zlib

    return zlib.crc32(shard_id.encode()) % count


class PartitionOwners:
    """This process's partition leases in a shared (Dataflow) job; see the module
    docstring. ``cell_for`` builds a LeaseCell for a spec (injected in tests)."""

    def __init__(self, cell_for: Callable[[LeaseSpec], LeaseCell] = None, worker: str = None,
                 heartbeat: bool = True, **lease_kw) -> None:
        self._cell_for = cell_for or lease_cell
        self._heartbeat = heartbeat  # tests renew by hand on an injected clock
        self._worker = worker or WORKER_ID
        self._lease_kw = lease_kw
        self._leases: dict = {}  # (stream_arn, index) -> Lease
        self._counts: dict = {}  # stream_arn -> partition count
        self._lock = threading.Lock()

    def spec_for(self, job: LeaseSpec, stream_arn: str, index: int) -> LeaseSpec:
        from ddb2bt.pipeline.control.state import stream_label

        return LeaseSpec(job.bigtable, job.table, job.job, f"{job.role}#p#{stream_label(stream_arn)}#{index}",
                         self._worker, job.ttl_s, job.renew_s, shared=False, give_up_s=job.give_up_s)

    def claim(self, job: LeaseSpec, stream_arn: str, index: int, count: int) -> Optional[Lease]:
        """The partition's lease held by this process, taking it if it is free;
        None while another worker holds it (the caller reads nothing meanwhile)."""
        with self._lock:
            self._counts[stream_arn] = count
            key = (stream_arn, index)
            lease = self._leases.get(key)
            if lease is not None and lease._lost is None:
                lease.last_used = lease._clock()
                return lease
            spec = self.spec_for(job, stream_arn, index)
            lease = Lease(spec, self._cell_for(spec), command="worker", **self._lease_kw)
            try:
                other = lease.try_acquire()
            except (RetryableError, PermanentError):
                other = True  # Bigtable unreachable: not taken now, tried again next round
            if other is not None:
                lease._cell.close()
                self._leases.pop(key, None)
                return None
            lease.idle_release_s = PARTITION_IDLE_RELEASE_S
            if self._heartbeat:
                lease.start_heartbeat()
            self._leases[key] = lease
            return lease

    def check(self, positions) -> None:
        """Before writing or checkpointing changes of ``positions`` ((stream_arn,
        shard_id) pairs): this process must own each one's partition now. Raises
        LeaseUnproven (retryable: wait) or LeaseLost (the partition moved: stop)."""
        for stream_arn, shard_id in positions:
            count = self._counts.get(stream_arn)
            if count is None:
                continue  # no partition ownership for this stream in this process (not a shared job)
            lease = self._leases.get((stream_arn, partition_index(shard_id, count)))
            if lease is None:
                raise LeaseLost(f"this worker does not own the partition of shard {shard_id}: it moved to another "
                                "worker; its changes are written by that one")
            lease.last_used = lease._clock()
            lease.check()

    def touch(self, stream_arn: str, index: int) -> None:
        """The reader is still given this partition (even while it cannot read:
        a blip), so its lease is not released as idle."""
        lease = self._leases.get((stream_arn, index))
        if lease is not None:
            lease.last_used = lease._clock()

    @contextlib.contextmanager
    def round(self, stream_arn: str, index: int):
        """A reading round of the partition runs: its lease is not idle until the
        round ends, however long it waits (throttling back-off), so the sink's
        writes of what it read still find the partition owned."""
        lease = self._leases.get((stream_arn, index))
        if lease is None:
            yield
            return
        with self._lock:
            lease.rounds += 1
            lease.round_started = lease._clock()
        try:
            yield
        finally:
            with self._lock:
                lease.rounds -= 1
                lease.last_used = lease._clock()

    def check_partition(self, stream_arn: str, index: int) -> float:
        """This process owns the partition now (else LeaseUnproven / LeaseLost)."""
        lease = self._leases.get((stream_arn, index))
        if lease is None:
            raise LeaseLost(f"this worker does not own partition {index} of {stream_arn}")
        return lease.check()

    def held(self, stream_arn: str, index: int) -> Optional[Lease]:
        return self._leases.get((stream_arn, index))

    def release_all(self) -> None:
        with self._lock:
            for lease in self._leases.values():
                lease.release()
            self._leases.clear()


OWNERS = PartitionOwners()  # per process, shared by its readers and sinks
