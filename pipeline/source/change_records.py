"""The records the Bigtable change-stream reader outputs (``ReadBigtableChanges``,
``read_changes``). They are defined in the pure engine
(``ddb2bt.transforms.change_records``), so the inverse of a mapping can use them
without the pipeline; this module names them for the readers' callers."""
from __future__ import annotations

from ddb2bt.transforms.change_records import (  # noqa: F401 (the readers' output types)
    SOURCE_GC,
    SOURCE_USER,
    DeleteCells,
    DeleteFamily,
    Mutation,
    RowChange,
    SetCell,
)

__all__ = ["SOURCE_GC", "SOURCE_USER", "DeleteCells", "DeleteFamily", "Mutation", "RowChange", "SetCell"]
