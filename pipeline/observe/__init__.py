"""Observability: the process's metrics, its log format and the redaction of
what must never reach a log (issue 32, the ``observe/`` floor)."""
