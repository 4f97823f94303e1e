"""Runs ministack (the second local AWS emulator) in this process, for the local
stack (``local_stack.LocalStack(dynamodb="ministack")``).

Why a launcher rather than ``python -m ministack``: ministack keeps its streams'
retention (24 h, as AWS does) in a module variable, not in an option. Setting it
here, before the server starts, lets a stack of its own trim within seconds, so
``TrimmedDataAccessException`` and the product's loud stop (docs/design.md §8) can
be tested and rehearsed locally. Everything else (bind address, port, services) is
ministack's own environment, set by the local stack.
"""
from __future__ import annotations

import os
import sys

from ddb2bt.pipeline.local.local_stack import MINISTACK_RETENTION_ENV


def main() -> None:
    retention = os.environ.get(MINISTACK_RETENTION_ENV)
    if retention:
        from ministack.services import dynamodb

        dynamodb._STREAM_RETENTION_SECONDS = float(retention)
    from ministack.app import main as serve

    sys.argv = [sys.argv[0]]  # ministack parses its own (foreground) arguments
    serve()


if __name__ == "__main__":
    main()
