"""Ctrl-C and SIGTERM for the commands that run a job (run, migrate, backfill).

* The first Ctrl-C (or SIGTERM, which Dataflow, Kubernetes and systemd send)
  asks the job to stop: the stream readers end at their next round, and what was
  read is written and checkpointed. If that has not finished within
  ``GRACE_S`` seconds (Bigtable unreachable, a long backfill page), the process
  exits anyway: checkpoints only ever cover acknowledged writes, so the next run
  replays what was in flight and loses nothing.
* A second Ctrl-C exits at once.
* Either way the last line says the job stopped, that what Bigtable
  acknowledged is checkpointed (true whether or not Bigtable is reachable now),
  and how to resume,
  the exit code is 130, and there is no traceback: no KeyboardInterrupt is ever
  raised into the job (one raised inside a checkpoint save or a gRPC call was
  what left processes hanging in ``Channel.close``).

Signals are taken from a wakeup pipe by a watcher thread, not by Python code in
the main thread, so they are handled even while the main thread is blocked in C
(a gRPC call, a runner's wait).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Callable, Optional
from ddb2bt.pipeline.local.exits import on_hard_exit, run_hard_exit_hooks
from ddb2bt.pipeline.observe.metrics import stop_pushers
from ddb2bt.pipeline.source.stream_source import clear_stop, request_stop, STOP_ALL

log = logging.getLogger(__name__)

GRACE_S = 3.0  # after the first Ctrl-C / SIGTERM: how long the job may take to stop cleanly
CLEANUP_WAIT_S = 1.0  # cleanups (releasing the lease) at exit never take longer than this
EXIT_INTERRUPTED = 130
INTERRUPTED = ("ddb2bt: interrupted, stopped; what was acknowledged is checkpointed (changes in flight "
               "are read again): run the same command to resume")
# A command that runs no job (status, verify, create-table, ...), or a job's
# command before its job began: nothing was read, so nothing is claimed.
INTERRUPTED_NO_JOB = "ddb2bt: interrupted"


def interrupted_line(resume: str = "") -> str:
    """The last line of an interrupted command: ``resume``, the one command that
    resumes it (the CLI's, built from the command line), or the generic advice."""
    if not resume:
        return INTERRUPTED
    return ("ddb2bt: interrupted, stopped; what was acknowledged is checkpointed (changes in flight are read "
            f"again); resume with: {resume}")
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
on_hard_exit(stop_pushers)  # a stop past its grace skips atexit: the metrics group goes all the same

_scopes = threading.local()


class CommandScope:
    """One command's run: what to do at its end (``on_exit``), and whether it was
    interrupted."""

    def __init__(self, stop: Callable[[], None], grace_s: float, last_line: str = INTERRUPTED) -> None:
        self._stop = stop
        self.last_line = last_line
        self._grace_s = grace_s
        self._cleanups: list = []
        self._done = threading.Event()
        self._exit_lock = threading.Lock()
        self.interrupted: Optional[str] = None

    def on_exit(self, fn: Callable[[], None]) -> None:
        self._cleanups.append(fn)

    def run_cleanups(self, wait_s: Optional[float] = None) -> None:
        """Run the cleanups, newest first; with ``wait_s``, give up waiting after
        that long (they run on a daemon thread)."""
        cleanups, self._cleanups = self._cleanups[::-1], []

        def run() -> None:
            for fn in cleanups:
                try:
                    fn()
                except Exception as exc:  # one failed cleanup must not stop the others
                    log.warning("cleanup at exit failed: %s", exc)

        if wait_s is None:
            run()
            return
        t = threading.Thread(target=run, name="ddb2bt-exit-cleanup", daemon=True)
        t.start()
        t.join(wait_s)

    # -- signals (called on the watcher thread) -----------------------------------
    def on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self._done.is_set():
            return
        if self.interrupted is None:
            self.interrupted = name
            _say(f"ddb2bt: {name}: stopping; what was read is being written and checkpointed "
                 f"(Ctrl-C again exits at once)")
            try:
                self._stop()
            except Exception as exc:
                log.debug("stop request failed: %s", exc)
            threading.Thread(target=self._watchdog, name="ddb2bt-stop-watchdog", daemon=True).start()
        else:
            self.hard_exit()

    def _watchdog(self) -> None:
        if not self._done.wait(self._grace_s):
            self.hard_exit()

    def hard_exit(self) -> None:
        """End the process now. Cleanups that may write (releasing the lease)
        are skipped on purpose: a write of ours could still be in flight; the
        lease expires, and a holder on this machine that is gone is replaced at
        once anyway."""
        with self._exit_lock:
            if self._done.is_set():
                return
            run_hard_exit_hooks()
            _say(self.last_line)
            os._exit(EXIT_INTERRUPTED)

    def finish(self) -> None:
        with self._exit_lock:  # a hard exit in progress wins; otherwise it can no longer happen
            self._done.set()


def _say(line: str) -> None:
    try:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def current() -> Optional[CommandScope]:
    return getattr(_scopes, "scope", None)


def on_exit(fn: Callable[[], None]) -> bool:
    """Run ``fn`` when the current command ends (normally, by an error, or after
    a graceful interruption). False when no command scope is active (library
    use: the caller cleans up)."""
    scope = current()
    if scope is None:
        return False
    scope.on_exit(fn)
    return True


class _Watcher:
    """Installs the handlers and the wakeup pipe (main thread only) and hands
    every SIGINT/SIGTERM to the scope on its own thread."""

    def __init__(self, scope: CommandScope) -> None:
        self._scope = scope
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._previous = {s: signal.signal(s, _noop) for s in _SIGNALS}
        self._previous_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, name="ddb2bt-signals", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self._r, 64)
            except OSError:
                return
            for signum in data:
                if signum == 0 or not data:
                    return
                if signum in _SIGNALS:
                    self._scope.on_signal(signum)
            if not data:
                return

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        try:
            os.write(self._w, b"\0")  # ends the watcher
        except OSError:
            pass
        self._thread.join(1.0)
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


def _noop(signum, frame) -> None:  # the watcher thread does the work
    pass


def exit_quietly_on_interrupt() -> None:
    """For the ddb2bt program, first thing: until a command installs its own
    handling (a command that runs no job never does), Ctrl-C / SIGTERM end the
    process with one line, "ddb2bt: interrupted", instead of a KeyboardInterrupt
    traceback from whatever module was being imported; the line claims nothing
    about checkpoints (no job of this command ran)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame) -> None:
        run_hard_exit_hooks()
        _say(INTERRUPTED_NO_JOB)
        os._exit(EXIT_INTERRUPTED)

    for s in _SIGNALS:
        signal.signal(s, handler)


def _stop_readers() -> None:
    request_stop(STOP_ALL)


def run_command(fn: Callable[[], int], *, enabled: bool = True, stop: Callable[[], None] = _stop_readers,
                grace_s: float = GRACE_S, exit_when_interrupted: bool = False, resume: str = "",
                checkpoints: bool = True) -> int:
    """Run a command with the behaviour above (``enabled``: a command that runs
    a job). Returns its exit code, 130 when interrupted. ``resume``: the command
    that resumes it, named in the last line (``interrupted_line``); ``checkpoints``:
    False for a job that checkpoints nothing (verify), whose last line claims none.

    ``exit_when_interrupted`` (the ``ddb2bt`` program itself, not an embedding
    caller): after a clean stop, end the process at once instead of returning:
    the interpreter's shutdown then waits seconds for gRPC's native threads."""
    if not enabled:
        return fn()

    clear_stop(STOP_ALL)  # a previous command in this process may have been interrupted
    # A job that reads nothing it checkpoints (verify) claims nothing of checkpoints.
    scope = CommandScope(stop, grace_s, interrupted_line(resume) if checkpoints else INTERRUPTED_NO_JOB)
    previous, _scopes.scope = current(), scope
    watcher = _Watcher(scope) if threading.current_thread() is threading.main_thread() else None
    try:
        code = fn()
    except BaseException as exc:
        if scope.interrupted is None:
            raise
        log.debug("after %s: %s", scope.interrupted, exc, exc_info=True)
        code = EXIT_INTERRUPTED
    finally:
        scope.finish()
        if watcher is not None:
            watcher.close()
        _scopes.scope = previous
        scope.run_cleanups(CLEANUP_WAIT_S)
        clear_stop(STOP_ALL)
    if scope.interrupted is not None:
        _say(scope.last_line)
        if exit_when_interrupted:
            logging.shutdown()
            os._exit(EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    return code
