"""`recover`'s progress bars and its log share stderr: a log line is written
above the bars, on a line of its own, never glued to a bar's half-drawn line."""
from __future__ import annotations

import io
import logging
import sys

from ddb2bt.pipeline.services.recover import RecoverBars


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_line_during_the_recover_gets_its_own_line_above_the_bars(monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [handler])
    with RecoverBars(term) as bars:
        bars.progress(1, 4)
        logging.getLogger("ddb2bt.recover").warning("applying data file 2 of 4")
        bars.progress(2, 4)
    assert root.handlers == [handler]  # the log's own handler back after the block
    out = term.getvalue()
    before, _, _ = out.partition("WARNING applying data file 2 of 4")
    assert "recover:" in before  # the bar was drawn first...
    assert before.endswith("\r") or before.endswith("\n")  # ...and cleared before the line, not written into


def test_no_bars_without_a_terminal():
    log = io.StringIO()
    with RecoverBars(log) as bars:
        bars.progress(1, 4)
        bars.sweep_progress(100)
    assert log.getvalue() == ""
