"""The mapping's optional C module, ``rowwriter_c``, and the one switch for it.

Built by ``pip install`` where a C compiler is (pyproject.toml, optional): the
compiled mapping's plain row writer (``rowwriter_c.c``, transforms/rowwriter.py
says what it writes), the ordering guard's encoders (``encoders_c.c``: its
image hashes' and clock qualifiers' canonical typed JSON, and its swaps'
mutations on the wire) and the reading of MutateRows' entry statuses from the
response's bytes (``decoders_c.c``). Each has a Python reference that
writes the same bytes, which runs where the module was not built, or when
``DDB2BT_ROW_WRITER=python`` asks for it (to rule the C out when in doubt;
docs/troubleshooting.md). Tests hold each C path to its reference.
"""
from __future__ import annotations

import os
from functools import partial
from typing import Callable, Optional

from ddb2bt.transforms.attrs import dump_str

try:
    # inside: a try, not a function: the C module is optional (built with the package where a C compiler was)
    from ddb2bt.transforms import rowwriter_c
except ImportError:  # no compiler when it was installed: the Python references write every byte
    rowwriter_c = None

__all__ = ["NATIVE", "NATIVE_BUILT", "ROW_WRITER_ENV", "native_encode_mutations", "native_map_json",
           "native_mutate_rows_statuses", "rowwriter_c"]

# Whether the C module runs: "c" (the default, where built) or "python" (its references).
ROW_WRITER_ENV = "DDB2BT_ROW_WRITER"
NATIVE_BUILT = rowwriter_c is not None
NATIVE = NATIVE_BUILT and os.environ.get(ROW_WRITER_ENV, "c").strip().lower() != "python"


def native_map_json() -> Optional[Callable[[dict], Optional[bytes]]]:
    """``image -> canonical_typed_json({"M": image})`` in UTF-8, or None where the
    image is not of the shapes the C writes (the caller's reference decides), in
    C; None when the C does not run (``NATIVE``)."""
    return partial(rowwriter_c.typed_map_json, dump_str) if NATIVE else None


def native_encode_mutations(set_cell_type: type, delete_cells_type: type) -> Optional[Callable]:
    """``(mutations, field) -> transforms.wire.encode_mutations' bytes``, or None
    where a mutation is not of the shapes the C writes (the caller's reference
    decides), in C; None when the C does not run."""
    return partial(rowwriter_c.encode_mutations, set_cell_type, delete_cells_type) if NATIVE else None


def native_mutate_rows_statuses() -> Optional[Callable]:
    """``(data, statuses, ok, failed) -> int | None``: every entry of the
    serialized MutateRowsResponse ``data`` set in ``statuses`` as the sink's
    reference loop sets it, or None where the protobuf library must read the
    bytes (transforms/decoders_c.c); None when the C does not run."""
    return rowwriter_c.mutate_rows_statuses if NATIVE else None
