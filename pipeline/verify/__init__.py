"""Verification: is the target exactly the mapping of the source? The bounded
``ddb2bt verify`` (``verify.py``, spilling to disk with ``spill.py``), the same
comparison as a Beam job (``beam_verify.py``), the comparison of rows itself
(``compare.py``), the re-check of a difference after the tail has passed it
(``recheck.py``) and the continuous check of a running job (``continuous.py``,
its Dataflow branch ``continuous_beam.py``). It imports the floors below and
nothing of ``cutover/`` or ``recover/``, which import it (docs/how-it-works.md)."""
