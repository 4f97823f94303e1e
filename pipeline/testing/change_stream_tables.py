"""The table-admin side of the test change-stream server: a table's change
stream is what CreateTable or UpdateTable set in ``change_stream_config`` (the
emulator ignores the field), recorded in the change log and shown by GetTable;
DeleteTable ends it. Every other admin call is forwarded unchanged."""
from __future__ import annotations

from typing import Callable, Optional

from google.cloud.bigtable_admin_v2.types import bigtable_table_admin as ta
from google.cloud.bigtable_admin_v2.types import table as tt

from ddb2bt.pipeline.testing.change_log import ChangeLog

TABLE_ADMIN = "/google.bigtable.admin.v2.BigtableTableAdmin/"
# The service's default when a change stream is enabled without a retention.
DEFAULT_RETENTION_S = 24 * 3600.0
FAMILIES_TIMEOUT_S = 10.0

Table = tt.Table.pb()
CreateTable = ta.CreateTableRequest.pb()
UpdateTable = ta.UpdateTableRequest.pb()
GetTable = ta.GetTableRequest.pb()
DeleteTable = ta.DeleteTableRequest.pb()


def _retention_s(config) -> float:
    if not config.HasField("retention_period"):
        return DEFAULT_RETENTION_S
    return config.retention_period.seconds + config.retention_period.nanos / 1e9


class TableAdminFront:
    """Admin calls that concern change streams; ``forward(method, bytes, ctx)`` sends one on."""

    def __init__(self, channel, log: ChangeLog, forward: Callable) -> None:
        self._channel = channel
        self._log = log
        self._forward = forward
        self._handlers = {"CreateTable": self._create, "UpdateTable": self._update, "GetTable": self._get,
                          "DeleteTable": self._delete}

    def handler(self, method: str) -> Optional[Callable]:
        if not method.startswith(TABLE_ADMIN):
            return None
        fn = self._handlers.get(method[len(TABLE_ADMIN):])
        return None if fn is None else (lambda request, ctx: fn(method, request, ctx))

    def _shown(self, raw: bytes) -> bytes:
        table = Table.FromString(raw)
        retention = self._log.retention_s(table.name)
        if retention is None:
            table.ClearField("change_stream_config")
        else:
            period = table.change_stream_config.retention_period
            period.seconds = int(retention)
            period.nanos = int(round((retention - int(retention)) * 1e9))
        return table.SerializeToString()

    def _create(self, method: str, request: bytes, ctx) -> bytes:
        req = CreateTable.FromString(request)
        raw = self._forward(method, request, ctx)
        name = f"{req.parent}/tables/{req.table_id}"
        if req.table.HasField("change_stream_config"):
            self._log.enable(name, _retention_s(req.table.change_stream_config))
        return self._shown(raw)

    def _update(self, method: str, request: bytes, ctx) -> bytes:
        req = UpdateTable.FromString(request)
        raw = self._forward(method, request, ctx)
        if "change_stream_config" in req.update_mask.paths:
            config = req.table.change_stream_config
            if req.table.HasField("change_stream_config") and _retention_s(config) > 0:
                self._log.enable(req.table.name, _retention_s(config))
            else:
                self._log.disable(req.table.name)
        return raw

    def _get(self, method: str, request: bytes, ctx) -> bytes:
        return self._shown(self._forward(method, request, ctx))

    def _delete(self, method: str, request: bytes, ctx) -> bytes:
        raw = self._forward(method, request, ctx)
        self._log.disable(DeleteTable.FromString(request).name)
        return raw

    def families(self, table_name: str) -> set:
        """The table's column families, asked of the emulator."""
        req = GetTable(name=table_name)
        raw = self._channel.unary_unary(TABLE_ADMIN + "GetTable")(req.SerializeToString(),
                                                                 timeout=FAMILIES_TIMEOUT_S)
        return set(Table.FromString(raw).column_families)
