"""The face: the ``ddb2bt`` program and its entry points. ``cli.py`` parses and
calls one service per command (``pipeline/services/``); ``program.py`` is the
console script; ``flex_main.py`` the Dataflow Flex Template's entry; the
``local``, ``demo`` and ``examples`` commands (``local_commands.py``,
``demo.py``) drive the emulator stack of ``pipeline/local/``. Nothing below
imports this package."""
