"""The commands' services: what each ``ddb2bt`` command does once its options are
parsed (orchestration, threads, state writes, what it prints and its exit code).
``pipeline/app/cli.py`` is the face: it parses and calls one service per command.
The ``local``, ``demo`` and ``examples`` commands live beside the local stack, in
``pipeline/app/local_commands.py``.
"""
