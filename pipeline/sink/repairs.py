"""Guarded backfill writes on the sink's side (ddb2bt.pipeline.sink.guards,
docs/design.md §7.4): repair intents recorded before a batch is written,
backfill rows the tail touched repaired after it, and conditional
(CheckAndMutateRow) writes."""
from __future__ import annotations

import logging
import uuid
from typing import Callable, Optional

from ddb2bt.pipeline.clients.bigtable.writer import MutationWriter
from ddb2bt.pipeline.sink.guards import encode_intent, repair_intents, repair_touched, write_conditional
from ddb2bt.pipeline.sink.batch import Batch, Row
from ddb2bt.pipeline.sink.config import SinkConfig
from ddb2bt.pipeline.sink.requests import RequestWriter
from ddb2bt.pipeline.control.state import StateStore

__all__ = ["GuardedWrites"]

log = logging.getLogger(__name__)


class GuardedWrites:
    """The conditional writes and repair intents of one sink's batches."""

    def __init__(self, writer: MutationWriter, requests: RequestWriter, state: Optional[StateStore],
                 config: SinkConfig, metrics, sleep: Callable[[float], None], dead_letter: Callable) -> None:
        self._writer = writer
        self._requests = requests
        self._state = state
        self._config = config
        self._metrics = metrics
        self._sleep = sleep
        self._dead_letter = dead_letter

    def record_intents(self, batch: Batch) -> list:
        """Durably record the batch's guarded rows, per part, before they are
        written; returns the records' keys (cleared after the checkpoint)."""
        if self._state is None or not batch.guard_parts:
            return []
        batch_id = uuid.uuid4().hex
        return [self._state.save_repair_intent(source, part, batch_id, encode_intent(rows))
                for (source, part), rows in batch.guard_parts.items()]

    def repair_left_over(self, batch: Batch, own: list) -> list:
        """Before a part is marked done: repair what an earlier attempt recorded
        and may have written without repairing (it crashed in between); returns
        the records' keys, cleared with the batch's own."""
        if self._state is None:
            return []
        keys: list = []
        payloads: list = []
        mine = set(own)
        for (source, part), ckpt in batch.backfill.items():
            if not ckpt.done:
                continue
            for key, payload in self._state.load_repair_intents(source, part).items():
                if key not in mine:
                    keys.append(key)
                    payloads.append(payload)
        if payloads:
            log.warning("repairing %d backfill batch(es) whose write was interrupted before its repair", len(payloads))
            repair_intents(self._writer, payloads, self._config.retry, self._sleep,
                           lambda table, rows: self._requests.write_all(table, [Row(table, k, m) for k, m in rows]),
                           self._metrics)
        return keys

    def repair_touched(self, guarded: list) -> None:
        if guarded:
            repair_touched(self._writer, guarded, self._config.retry, self._sleep,
                           lambda table, rows: self._requests.write_all(table, [Row(table, k, m) for k, m in rows],
                                                               self._requests.routes_transactional),
                           self._metrics)

    def write_conditional(self, conditional: list) -> list:
        return write_conditional(self._writer, conditional, self._config.retry, self._sleep, self._dead_letter,
                                 self._metrics)
