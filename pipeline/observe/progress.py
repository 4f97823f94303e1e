"""Long steps of a command in a worker thread, with their progress: a bar on a
terminal, a plain log line every ``PLAIN_PROGRESS_EVERY_S`` elsewhere. Shared by
the ``migrate`` controller (its backfill, the tail, the re-copy sweep) and the
bounded verify: it sits on the observability floor, below both (the controller
imports verify through the re-copy and the continuous check)."""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

# Progress without a terminal: one log line this often (a log, not an animation).
PLAIN_PROGRESS_EVERY_S = 30.0
WATCH_POLL_S = 0.5  # how often the progress is looked at


class Worker(threading.Thread):
    """Runs a pipeline function in a thread and keeps its exception."""

    def __init__(self, name: str, fn: Callable[[], None]) -> None:
        super().__init__(name=name, daemon=True)
        self._fn = fn
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self._fn()
        except BaseException as exc:  # re-raised by the controller
            self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise self.error


def watch(worker: Worker, total: Optional[int], desc: str, value: Callable[[], float],
          tty: Optional[bool] = None, clock: Callable[[], float] = time.monotonic) -> None:
    """Show a progress bar (items/s and ETA) while ``worker`` runs; when stderr is
    not a terminal (a log file, CI, a container), a plain log line every
    ``PLAIN_PROGRESS_EVERY_S`` instead: a bar's carriage returns would flood the
    log. Re-raises the worker's failure."""
    from tqdm import tqdm

    tty = sys.stderr.isatty() if tty is None else tty
    if not tty:
        _watch_plain(worker, total, desc, value, clock)
        return
    with tqdm(total=total or None, unit="item", desc=desc, dynamic_ncols=True, file=sys.stderr,
              mininterval=WATCH_POLL_S) as bar:
        while worker.is_alive():
            worker.join(WATCH_POLL_S)
            bar.n = int(value())
            bar.update(0)
        bar.n = int(value())
        if worker.error is None:
            # The expected total is an estimate (DescribeTable's ItemCount, items
            # deleted meanwhile): a finished run is 100 % of what it really read.
            bar.total = bar.n
        bar.refresh()
    worker.check()


def _watch_plain(worker: Worker, total: Optional[int], desc: str, value: Callable[[], float],
                 clock: Callable[[], float]) -> None:
    start = last = clock()
    while worker.is_alive():
        worker.join(WATCH_POLL_S)
        now = clock()
        if now - last >= PLAIN_PROGRESS_EVERY_S and worker.is_alive():
            last = now
            log.info("%s", progress_line(desc, int(value()), total, now - start))
    if worker.error is None:
        log.info("%s", progress_line(desc, int(value()), None, clock() - start) + " (done)")
    worker.check()


def progress_line(desc: str, done: int, total: Optional[int], elapsed_s: float) -> str:
    """``verify: 1200/5000 items (24%), 400 items/s, about 10s left`` (total
    and ETA when known: the total is an estimate, DescribeTable's ItemCount)."""
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    line = f"{desc}: {done}" + (f"/{total} items ({min(100, 100 * done // total)}%)" if total else " items")
    line += f", {rate:.0f} items/s"
    if total and rate > 0 and done < total:
        line += f", about {(total - done) / rate:.0f}s left"
    return line


def run_in_thread(name: str, fn: Callable[[], object], total: Optional[int] = None,
                  progress: Optional[Callable[[], float]] = None) -> object:
    """``fn()`` in a worker thread, with a progress bar when ``progress`` is given."""
    result: list = []
    worker = Worker(name, lambda: result.append(fn()))
    worker.start()
    if progress is not None:
        watch(worker, total, name, progress)
    else:
        worker.join()
        worker.check()
    return result[0] if result else None
