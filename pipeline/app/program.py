"""The ``ddb2bt`` program's entry point.

Ctrl-C and SIGTERM handling goes in before anything heavy is imported: the CLI
and what it imports take ~0.5 s of CPU to load (Beam, ~1.5 s more, only once a
command builds a pipeline; tests/unit/app/test_cli_face.py), longer on a loaded
machine, and an
interrupt in that time would otherwise end in a KeyboardInterrupt traceback or
a bare death by signal instead of the usual line and exit code 130.
"""
from __future__ import annotations

import sys


def main() -> int:
    from ddb2bt.pipeline.signals import exit_quietly_on_interrupt

    exit_quietly_on_interrupt()
    from ddb2bt.pipeline.app.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
