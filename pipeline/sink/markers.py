"""Touch markers on the sink's side (docs/design.md §7.3): a row whose write failed
because the marker family is missing is retried with its markers while a
backfill may run, and written without them once the backfill has finished."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ddb2bt.pipeline.clients.bigtable.channel import bigtable_endpoint
from ddb2bt.pipeline.clients.retry import retrying
from ddb2bt.pipeline.control.markers import strip_markers
from ddb2bt.pipeline.sink.batch import Row
from ddb2bt.pipeline.sink.config import SinkConfig
from ddb2bt.pipeline.sink.requests import RequestWriter, StillFailing

__all__ = ["MarkedWrites"]


class MarkedWrites:
    """Writes of rows that carry touch markers and failed for good."""

    def __init__(self, requests: RequestWriter, marking: Callable[[], bool], config: SinkConfig, metrics,
                 sleep: Callable[[float], None]) -> None:
        self._requests = requests
        # Whether a backfill may be running (then touch markers are never
        # stripped): asked of the job's coordinator, never read here.
        self._marking = marking
        self._config = config
        self._metrics = metrics
        self._sleep = sleep

    def needed(self) -> bool:
        """Whether a backfill may be running: then touch markers must never be
        stripped (control/phases.py, ``backfill_may_run``)."""
        return self._marking()

    def write(self, table: str, row: Row) -> list:
        """A row with touch markers failed for good (the marker family is missing).
        After the finish it is written again without them; while a backfill may run
        it is retried with them until the family exists (a new backfill writes the
        phase before it creates the family), up to the deadline."""
        def attempt() -> list:
            if not self.needed():
                return self._requests.write_with_retry(table, [self.without(row)])
            failed = self._requests.write_with_retry(table, [row])
            if failed:
                raise StillFailing(f"a change with touch markers to {table} failed while a backfill may be "
                                    f"running ({failed[0][1].message}); retrying until the marker family exists")
            return failed
        return retrying(self._config.retry, f"MutateRows with touch markers on {table}", None, self._sleep,
                        where=f"Bigtable ({bigtable_endpoint()})")(attempt)

    def without(self, row: Row) -> Row:
        """A row whose write raced the finish (the marker family was dropped): the
        same changes without their touch markers, which are needed only while a
        backfill runs (and then the family exists)."""
        parts = [(element, replace(change, mutations=tuple(strip_markers(change.mutations))))
                 for element, change in row.parts]
        if self._metrics:
            self._metrics.markers_stripped.inc()
        return Row(row.table, row.row_key, strip_markers(row.mutations), parts, row.size)
