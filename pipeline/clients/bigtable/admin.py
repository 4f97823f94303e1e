"""Bigtable administration: tables and column families (created, reconciled,
listed), app profiles as the preflight needs them, and the per-process admin
client and family listing every sink DoFn of a process shares."""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from ddb2bt.pipeline.clients.bigtable.channel import probe_bigtable
from ddb2bt.transforms.config import FamilyConfig, MappingConfig
from ddb2bt.transforms.errors import PermanentError
from ddb2bt.transforms.ordering import CLOCK_FAMILY

log = logging.getLogger(__name__)


def _gc_rule(family: FamilyConfig):
    from google.cloud.bigtable import column_family as cf
    import datetime as dt

    rules = []
    if family.max_versions:
        rules.append(cf.MaxVersionsGCRule(family.max_versions))
    if family.max_age_seconds:
        rules.append(cf.MaxAgeGCRule(dt.timedelta(seconds=family.max_age_seconds)))
    if not rules:
        return None
    if len(rules) == 1:
        return rules[0]
    return cf.GCRuleIntersection(rules=rules) if family.gc == "intersection" else cf.GCRuleUnion(rules=rules)


# A column-family listing answers in milliseconds; this bounds it when Bigtable
# does not answer at all.
FAMILY_LIST_TIMEOUT_S = 10.0
# Enabling a change stream is a long-running operation; it ends in seconds.
CHANGE_STREAM_UPDATE_TIMEOUT_S = 120.0
SECONDS_PER_HOUR = 3600


class BigtableAdmin:
    """Table administration through the classic admin client (works on the emulator)."""

    def __init__(self, project: str, instance: str, deadline_s: Optional[float] = None) -> None:
        from google.cloud.bigtable import Client

        probe_bigtable(deadline_s)  # the admin client retries unreachable endpoints silently for minutes
        self._client = Client(project=project, admin=True)
        self._instance = self._client.instance(instance)

    def table(self, table_id: str):
        return self._instance.table(table_id)

    def exists(self, table_id: str) -> bool:
        return self.table(table_id).exists()

    def families(self, table_id: str) -> set:
        # Bounded, without the classic client's own retries: they keep trying an
        # unreachable endpoint for minutes, and a sink (or a job that must stop
        # once its lease is gone) waits on this call.
        response = self._client.table_admin_client.get_table(
            request={"name": self.table(table_id).name}, timeout=FAMILY_LIST_TIMEOUT_S, retry=None)
        return set(response.column_families)

    def ensure_table(self, table_id: str, families: Iterable[FamilyConfig], splits: Sequence[bytes] = ()) -> list:
        """Create the table or add/update its families; idempotent. Returns a list
        of what changed, for the CLI to print. ``splits``: initial split points of
        a table created now (a table that exists keeps its tablets)."""
        from google.api_core import exceptions as gexc

        families = list(families)
        table = self.table(table_id)
        changes = []
        if not table.exists():
            try:
                table.create(column_families={f.name: _gc_rule(f) for f in families},
                             initial_split_keys=list(splits))
                return [f"created table {table_id} with families {', '.join(f.name for f in families)}"
                        + (f", pre-split at {len(splits)} point(s)" if splits else "")]
            except gexc.AlreadyExists:
                pass  # created concurrently: fall through to reconcile families
        if splits:
            changes.append(f"table {table_id} exists: split points apply only when a table is created "
                           "(Bigtable splits it by load from here)")
        existing = table.list_column_families()
        for f in families:
            rule = _gc_rule(f)
            if f.name not in existing:
                table.column_family(f.name, rule).create()
                changes.append(f"added family {f.name}")
            elif rule is not None and existing[f.name].gc_rule != rule:
                table.column_family(f.name, rule).update()
                changes.append(f"updated GC policy of family {f.name}")
        return changes

    def change_stream_retention_s(self, table_id: str) -> Optional[float]:
        """The retention of the table's change stream, or None when it has none (GetTable)."""
        table = self._client.table_admin_client.get_table(
            request={"name": self.table(table_id).name}, timeout=FAMILY_LIST_TIMEOUT_S, retry=None)
        config = type(table).pb(table).change_stream_config
        if not config.HasField("retention_period"):
            return None
        return config.retention_period.seconds + config.retention_period.nanos / 1e9

    def enable_change_stream(self, table_id: str, retention_s: float) -> Optional[str]:
        """Turn the table's change stream on with ``retention_s`` (UpdateTable),
        then read it back; returns what changed, None when it already was so.
        PermanentError when the table does not show it after (an emulator
        without change streams accepts the call and keeps nothing)."""
        before = self.change_stream_retention_s(table_id)
        if before == retention_s:
            return None
        operation = self._client.table_admin_client.update_table(request={
            "table": {"name": self.table(table_id).name,
                      "change_stream_config": {"retention_period": {"seconds": int(retention_s)}}},
            "update_mask": {"paths": ["change_stream_config"]}})
        operation.result(timeout=CHANGE_STREAM_UPDATE_TIMEOUT_S)
        after = self.change_stream_retention_s(table_id)
        if after != retention_s:
            raise PermanentError(
                f"Bigtable accepted the change stream on {table_id} but the table shows "
                f"{'none' if after is None else f'a retention of {after:g}s'}: this Bigtable has no change "
                "streams (cbtemulator has none; start the local stack with `ddb2bt local up --change-streams`)")
        hours = retention_s / 3600
        return (f"enabled the change stream of {table_id} (retention {hours:g} h)" if before is None else
                f"changed the change stream retention of {table_id} from {before / 3600:g} h to {hours:g} h")

    def add_family(self, table_id: str, family: FamilyConfig) -> None:
        from google.api_core import exceptions as gexc

        try:
            self.table(table_id).column_family(family.name, _gc_rule(family)).create()
        except gexc.AlreadyExists:
            pass  # added concurrently

    def drop_family(self, table_id: str, name: str) -> None:
        """Drop a column family and every cell in it (one ModifyColumnFamilies call)."""
        from google.api_core import exceptions as gexc

        try:
            self.table(table_id).column_family(name).delete()
        except gexc.NotFound:
            pass  # dropped concurrently

    def delete_table(self, table_id: str) -> None:
        table = self.table(table_id)
        if table.exists():
            table.delete()

    def app_profile(self, profile_id: str) -> "AppProfileFacts":
        """The app profile's routing and transactional setting (GetAppProfile).
        ``AppProfileUnknown`` where the service has no app profiles (the emulator)."""
        from google.api_core import exceptions as gexc
        from google.cloud.bigtable.enums import RoutingPolicyType

        profile = self._instance.app_profile(profile_id)
        try:
            profile.reload()
        except gexc.MethodNotImplemented as exc:
            raise AppProfileUnknown(f"{profile_id}: the service has no app profiles ({exc.message})") from None
        except gexc.NotFound:
            return AppProfileFacts(profile_id, exists=False)
        single = profile.routing_policy_type == RoutingPolicyType.SINGLE
        return AppProfileFacts(profile_id, routing=SINGLE_CLUSTER if single else MULTI_CLUSTER,
                               cluster_id=profile.cluster_id if single else None,
                               transactional=bool(profile.allow_transactional_writes) if single else False)


SINGLE_CLUSTER = "single-cluster"
MULTI_CLUSTER = "multi-cluster"


@dataclass(frozen=True)
class AppProfileFacts:
    """What the preflight needs of an app profile (``BigtableAdmin.app_profile``)."""

    profile_id: str
    exists: bool = True
    routing: str = SINGLE_CLUSTER
    cluster_id: Optional[str] = None
    transactional: bool = False  # single-row transactions (CheckAndMutateRow) allowed


class AppProfileUnknown(Exception):
    """The admin API cannot describe app profiles here (the emulator has none)."""


# --- one admin client per process ---------------------------------------------
# The admin API has a low per-project quota. A Dataflow job runs processes x
# threads x DoFns x tables: every sink DoFn building its own admin client and
# listing families every minute would multiply the calls by all of them. So one
# BigtableAdmin per (project, instance) per process, and one family listing per
# table per FAMILY_LIST_MAX_AGE_S per process, shared by every DoFn.

FAMILY_LIST_MAX_AGE_S = 60.0  # a family added by `create-table` while a job runs is seen within a minute
# Built by this (tests count the admin clients a pipeline makes through it).
ADMIN_FACTORY: Callable[[str, str], "BigtableAdmin"] = BigtableAdmin
_PROCESS_ADMINS: dict = {}
_PROCESS_FAMILIES: dict = {}  # (project, instance, table) -> (monotonic time, frozenset | None)
_PROCESS_LOCK = threading.Lock()


def _endpoint_key() -> str:
    """Which Bigtable the clients of this process reach now: the emulator's
    address when one is set (a test or an embedder may switch emulators within
    one process; a client built for the old one would talk to a dead port)."""
    return os.environ.get("BIGTABLE_EMULATOR_HOST", "")


def process_admin(project: str, instance: str):
    """This process's admin object for the instance (built on first use)."""
    key = (project, instance, _endpoint_key())
    with _PROCESS_LOCK:
        admin = _PROCESS_ADMINS.get(key)
        if admin is None:
            admin = _PROCESS_ADMINS[key] = ADMIN_FACTORY(project, instance)
        return admin


def process_families(project: str, instance: str, table: str, max_age_s: float = FAMILY_LIST_MAX_AGE_S,
                     now: Callable[[], float] = time.monotonic) -> Optional[frozenset]:
    """The table's column families, listed at most once per ``max_age_s`` per
    process; None when they cannot be listed (no admin permission: the writes'
    own errors tell then)."""
    key = (project, instance, table, _endpoint_key())
    with _PROCESS_LOCK:  # one listing at a time: DoFns asking together share it
        cached = _PROCESS_FAMILIES.get(key)
        if cached is not None and now() - cached[0] < max_age_s:
            return cached[1]
    admin = process_admin(project, instance)
    with _PROCESS_LOCK:
        cached = _PROCESS_FAMILIES.get(key)
        if cached is not None and now() - cached[0] < max_age_s:
            return cached[1]
        try:
            families: Optional[frozenset] = frozenset(admin.families(table))
        except Exception as exc:  # no admin permission: fall back to the write's own answer
            log.warning("cannot list column families of %s (%s); relying on write errors", table,
                        type(exc).__name__)
            families = None
        _PROCESS_FAMILIES[key] = (now(), families)
        return families


def forget_process_families() -> None:
    """Forget the process's family lists: a job starting in this process (local
    runs, tests, embedders) lists them afresh, never from a run before a create-table."""
    with _PROCESS_LOCK:
        _PROCESS_FAMILIES.clear()


def forget_process_admins() -> None:
    """Drop the process's admin objects and family lists (tests)."""
    with _PROCESS_LOCK:
        _PROCESS_ADMINS.clear()
        _PROCESS_FAMILIES.clear()


def change_stream_hours(mapping: MappingConfig, flag_hours: Optional[int] = None) -> Optional[int]:
    """The target's change-stream retention asked for: the flag's, else the mapping's, else None."""
    return flag_hours if flag_hours is not None else mapping.target.change_stream_retention_hours


def ensure_mapping_table(mapping: MappingConfig, splits: Sequence[bytes] = (),
                         change_stream_hours: Optional[int] = None) -> list:
    """Create or update every table the mapping writes (target and index tables).
    ``splits``: initial split points of the target table, if it is created now.
    ``change_stream_hours``: turn the target table's change stream on with this
    retention (index tables never have one: nothing derived is read back)."""
    admin = BigtableAdmin(mapping.target.project, mapping.target.instance)
    changes = []
    for table, families in mapping.table_families().items():
        if mapping.source.kinesis is not None:  # the ordering guard's clock cells (docs/design.md §10)

            families = list(families) + [FamilyConfig(CLOCK_FAMILY, max_versions=1)]
        changes += admin.ensure_table(table, families, splits if table == mapping.target.table else ())
    if change_stream_hours is not None:
        changed = admin.enable_change_stream(mapping.target.table, change_stream_hours * SECONDS_PER_HOUR)
        changes += [changed] if changed else []
    return changes
