"""How a job reaches the services, above the clients and the control floor:
the clients and state store of a job from its specs (``connections.py``), the
checks before a job starts (``preflight.py``: the stream, the state table, app
profiles) and the read-only commands' reachability within a bound
(``reachability.py``)."""
