"""What must not outlive this process even when it ends at once — a stop past
its grace, a second Ctrl-C, a Ctrl-C before a command began
(``pipeline/signals.py``), each of which ends in ``os._exit`` and skips every
other cleanup: the servers the process started (``local_stack.py``). A
module of its own, importing nothing, so the local stack registers here without
importing the job machinery ``signals`` needs (and without a package cycle)."""
from __future__ import annotations

import logging
from typing import Callable

__all__ = ["on_hard_exit", "run_hard_exit_hooks"]

log = logging.getLogger(__name__)

_HOOKS: list = []  # quick and never writing: they run right before os._exit


def on_hard_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` also when the process ends at once."""
    _HOOKS.append(fn)


def run_hard_exit_hooks() -> None:
    for fn in list(_HOOKS):
        try:
            fn()
        except Exception as exc:  # the process is ending: one hook failing must not keep the others from running
            log.debug("hard-exit hook %r failed: %s", fn, exc)
