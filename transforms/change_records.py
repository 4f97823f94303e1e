"""Typed records read from a Bigtable change stream.

One ``RowChange`` is one committed Bigtable mutation batch on one row, as the
change stream reports it: its commit time and tiebreaker order changes to the
same row, ``source`` says whether a user (``"USER"``) or garbage collection
(``"GC"``) made it, and ``mutations`` hold the cell operations in commit order.
``partition`` and ``token`` name the change-stream partition the record came
from and the continuation token that resumes the stream right after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

SOURCE_USER = "USER"
SOURCE_GC = "GC"


@dataclass(frozen=True)
class SetCell:
    """A cell written: ``family:qualifier`` at ``timestamp_us`` holds ``value``."""

    family: str
    qualifier: bytes
    timestamp_us: int
    value: bytes


@dataclass(frozen=True)
class DeleteCells:
    """Cells of one column deleted in ``[start_us, end_us)``; ``None`` is unbounded."""

    family: str
    qualifier: bytes
    start_us: int | None
    end_us: int | None


@dataclass(frozen=True)
class DeleteFamily:
    """Every cell of ``family`` in the row deleted."""

    family: str


Mutation = Union[SetCell, DeleteCells, DeleteFamily]


@dataclass(frozen=True)
class RowChange:
    """One committed change to one Bigtable row, read from its change stream."""

    row_key: bytes
    commit_time_us: int
    tiebreaker: int
    source: str
    mutations: tuple[Mutation, ...]
    partition: str
    token: str
