"""Recovery: a trimmed tail recovered from incremental exports (``recover.py``,
with the sweep of the items that straddle an export's boundary, ``straddle.py``)
and the redrive of dead letters (``redrive.py``). It stands above ``verify/``
(and may use ``cutover/``); nothing below imports it (docs/how-it-works.md)."""
