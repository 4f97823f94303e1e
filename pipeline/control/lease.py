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
* Inside a shared (Dataflow) job, each stream partition has an owner of its own,
  a lease per partition held by one worker process (``partitions.py``).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ddb2bt.pipeline.clients.bigtable.channel import bigtable_endpoint
from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
from ddb2bt.pipeline.clients.retry import DEFAULT_DEADLINE_S, retrying
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


def is_free(cur: Optional[LeaseState], now_ms: int, holder: str, node: str, pid: int,
            alive: Callable[[int], bool], own_holders: Callable[[], set]) -> bool:
    """Whether ``holder`` (of process ``pid`` on ``node``) may take a lease whose
    cell says ``cur``: nobody live holds it, it is ours, or its holder is a
    process of this machine that no longer exists (or this very process, when
    none of its own leases, ``own_holders()``, holds it)."""
    if cur is None or not cur.live(now_ms) or cur.holder == holder:
        return True
    if cur.node and cur.node == node:
        if cur.pid == pid:  # this process: free unless one of our own leases holds it
            return cur.holder not in own_holders()
        return not alive(cur.pid)  # a holder on this machine that died (killed, crashed)
    return False


def lapsed_message(spec: LeaseSpec, ago: float, last_error: Optional[str]) -> str:
    """Why a holder gave up: no renewal for ``ago`` seconds, past ``give_up_s``."""
    cause = (f"renewing it kept failing: {last_error}" if last_error else
             "this process was paused, or could not reach Bigtable")
    return (f"job {spec.job}: the {spec.role} lease was last renewed {ago:.0f}s ago ({cause}); "
            f"no renewal succeeded for more than {spec.give_up_s:g}s (--bigtable-deadline): this "
            "process stops before writing anything more")


def unproven_message(spec: LeaseSpec, ago: float, last_error: Optional[str]) -> str:
    """Why a holder's writes are paused: no renewal for ``ago`` seconds."""
    cause = f"renewing it fails: {last_error}" if last_error else "this process was paused"
    return (f"job {spec.job}: the {spec.role} lease was last renewed {ago:.0f}s ago ({cause}); "
            "another process may hold it: writes are paused until a renewal proves nobody took over")


def log_taken(spec: LeaseSpec, cur: Optional[LeaseState], free: bool, now_ms: int) -> None:
    """Says whom a lease just taken was taken from, if anyone live held it."""
    if not free:
        log.warning("took over the %s lease of job %s from %s; it stops writing when it next renews, and "
                    "this process starts writing at its expiry (in %.0fs)", spec.role, spec.job,
                    cur.describe(), max(0, cur.expires_ms - now_ms) / 1000)
    elif cur is not None and cur.live(now_ms) and cur.holder != spec.holder:
        log.warning("the previous holder of the %s lease of job %s (%s) no longer exists: replaced it",
                    spec.role, spec.job, cur.describe())


def held_message(spec: LeaseSpec, other: LeaseState) -> str:
    until = time.strftime("%H:%M:%S UTC", time.gmtime(other.expires_ms / 1000))
    return (f"job {spec.job} is already running: its {spec.role} lease is held by {other.describe()} "
            f"(renewed every few seconds; expires {until} if not renewed). Only one process may write a "
            f"job's changes. Stop the other one, or rerun with --take-over to replace it (it stops before "
            f"its next write, within {spec.ttl_s:g}s), or with --standby to wait and take over when it "
            "ends.")


class Lease:
    """One process's (or one Dataflow worker's) hold on a job's lease. Clocks and
    the cell are injected for tests. ``own_holders`` names the holders of the
    leases this very process holds (a holder of this pid is free otherwise)."""

    idle_release_s: Optional[float] = None  # never released as idle (partition leases are: partitions.py)

    def __init__(self, spec: LeaseSpec, cell: LeaseCell, *, command: str = "", wall: Callable[[], int] = wall_ms,
                 clock: Callable[[], float] = boottime, sleep: Callable[[float], None] = time.sleep,
                 host: Optional[str] = None, pid: Optional[int] = None, node: Optional[str] = None,
                 alive: Callable[[int], bool] = pid_alive, own_holders: Optional[Callable[[], set]] = None) -> None:
        self.spec = spec
        self._own_holders = own_holders or set
        self.on_release: Callable[["Lease"], None] = lambda lease: None  # its coordinator forgets it
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
        self._heartbeat = Heartbeat(self, self._stop)
        self._last_warning = float("-inf")
        self._last_error: Optional[str] = None  # of the last failed renewal, for the final message
        self.active = False  # holding, with its heartbeat running

    # -- state -------------------------------------------------------------------
    def _state(self, now_ms: int, ttl_s: Optional[float] = None, released: bool = False) -> LeaseState:
        return LeaseState(self.spec.holder, self._host, self._pid, self._node, self._started_ms,
                          now_ms if released else now_ms + int((ttl_s or self.spec.ttl_s) * 1000),
                          self._command, released)

    def _free(self, cur: Optional[LeaseState], now_ms: int) -> bool:
        return is_free(cur, now_ms, self.spec.holder, self._node, self._pid, self._alive, self._own_holders)

    @property
    def lost(self) -> bool:
        return self._lost is not None

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
            log_taken(self.spec, cur, free, now)
            return None
        cur = LeaseState.parse(self._cell.read())
        if cur is None:
            raise LeaseHeld(f"the {self.spec.role} lease of job {self.spec.job} kept changing while acquiring it")
        return cur

    def acquire(self, mode: str = FAIL, ttl_s: Optional[float] = None, heartbeat: bool = True,
                retry=None, between_attempts: Optional[Callable[[], None]] = None) -> None:
        """Hold the lease or raise LeaseHeld (mode fail); standby: wait for it.
        ``retry``: a RetryPolicy for the lease calls (failures logged, bounded)."""
        def attempt():
            return self.try_acquire(take_over=mode == TAKE_OVER, ttl_s=ttl_s)

        call = (retrying(retry, f"the {self.spec.role} lease of job {self.spec.job}", where=self._cell.where,
                         sleep=self._sleep, between_attempts=between_attempts) if retry is not None
                else (lambda fn: fn()))
        waiting_since = None
        while True:
            other = call(attempt)
            if other is None:
                break
            if mode != STANDBY:
                raise LeaseHeld(held_message(self.spec, other))
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
            self._lose(lapsed_message(self.spec, self._since_renewal(sent), self._last_error))
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
            self._lose(lapsed_message(self.spec, self._since_renewal(now), self._last_error))
            raise LeaseLost(self._lost or "lease lost")
        # Unproven: the heartbeat keeps renewing (no RPC here, so a write path
        # never blocks on the lease); the caller's retry loop waits for it.
        raise LeaseUnproven(unproven_message(self.spec, self._since_renewal(now), self._last_error))

    # -- heartbeat, release ------------------------------------------------------
    def start_heartbeat(self) -> None:
        if self._heartbeat.start():
            self.active = True

    def idle(self) -> bool:
        """Whether the heartbeat gives the lease up as unused: never a job's lease."""
        return False

    def release(self) -> None:
        """Give the lease up (the next process takes it at once). Best effort: an
        unreleased lease expires after its TTL."""
        self._stop.set()
        self.active = False
        with self._lock:
            raw, self._raw = self._raw, None
            lost = self._lost
            self._lost = self._lost or f"job {self.spec.job}: the {self.spec.role} lease was released"
        self.on_release(self)
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
        self.on_release(self)
        self._cell.close()


class Heartbeat:
    """The thread that renews a lease every ``renew_s`` (sooner after a failed
    renewal: the lease must not lapse for a blip) until ``stop`` is set, the
    lease is lost, or it is not used any more (``Lease.idle``: released)."""

    def __init__(self, lease: "Lease", stop: threading.Event) -> None:
        self._lease, self._stop = lease, stop
        self._thread: Optional[threading.Thread] = None

    def start(self) -> bool:
        """Starts the thread; False when it was started before."""
        if self._thread is not None:
            return False
        self._thread = threading.Thread(target=self._beat, name=f"lease-{self._lease.spec.role}", daemon=True)
        self._thread.start()
        return True

    def _beat(self) -> None:
        lease = self._lease
        delay = lease.spec.renew_s
        while not self._stop.wait(delay):
            if lease.idle():
                log.info("released the %s lease of job %s: not used for %gs (the work moved)", lease.spec.role,
                         lease.spec.job, lease.idle_release_s)
                lease.release()
                return
            ok = lease.renew()
            if lease.lost:
                return
            delay = lease.spec.renew_s if ok else min(1.0, lease.spec.renew_s)


def lease_cell(spec: LeaseSpec) -> LeaseCell:
    b = spec.bigtable
    # The lease is a CheckAndMutateRow cell: through the state (single-cluster) profile.
    writer = GrpcMutationWriter(b.project, b.instance, getattr(b, "state_profile", b.app_profile),
                                timeout_s=LEASE_RPC_TIMEOUT_S)
    return LeaseCell(writer, spec.table, spec.row_key, f"Bigtable ({bigtable_endpoint()})")


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
