"""Checks made before a job starts, each failing fast with what to do."""
from __future__ import annotations

import os
from shlex import quote
from dataclasses import dataclass
from typing import Optional

from botocore.exceptions import BotoCoreError, ClientError

from ddb2bt.transforms.config import MappingConfig
from ddb2bt.transforms.errors import ConfigError, PermanentError
from ddb2bt.pipeline.clients.bigtable.admin import (AppProfileUnknown, BigtableAdmin, MULTI_CLUSTER,
                                                    forget_process_families, process_admin)
from ddb2bt.pipeline.control.state import STATE_FAMILIES, stream_label

REQUIRED_VIEW = "NEW_AND_OLD_IMAGES"


@dataclass(frozen=True)
class SourceStream:
    table: str
    stream_arn: str
    view_type: str
    item_count: int


def resolve_stream(mapping: MappingConfig, dynamodb) -> SourceStream:
    """The source table's current stream; fails unless it is enabled with
    NEW_AND_OLD_IMAGES (deletes and removed attributes need the old image)."""
    table = mapping.source.table
    try:
        desc = dynamodb.describe_table(TableName=table)["Table"]
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code == "ResourceNotFoundException":
            raise ConfigError(f"DynamoDB table {table!r} does not exist (in this account and region)",
                              "source.table") from None
        raise PermanentError(f"DescribeTable {table}: {code}: {exc.response['Error'].get('Message', '')}") from None
    except BotoCoreError as exc:
        raise PermanentError(f"cannot reach DynamoDB: {exc}") from None
    spec = desc.get("StreamSpecification") or {}
    arn = desc.get("LatestStreamArn")
    if not spec.get("StreamEnabled") or not arn:
        raise ConfigError(
            f"table {table!r} has no stream enabled. Enable one with NEW_AND_OLD_IMAGES: aws dynamodb "
            f"update-table --table-name {table} --stream-specification "
            f"StreamEnabled=true,StreamViewType={REQUIRED_VIEW}", "source.table")
    view = spec.get("StreamViewType", "")
    if view != REQUIRED_VIEW:
        raise ConfigError(
            f"the stream of {table!r} is {view}; ddb2bt needs {REQUIRED_VIEW} to apply deletes and "
            f"removed attributes exactly. A stream's view type cannot be changed in place: disable the stream, "
            f"then enable one with {REQUIRED_VIEW}: aws dynamodb update-table --table-name {table} "
            f"--stream-specification StreamEnabled=false, then aws dynamodb update-table --table-name {table} "
            f"--stream-specification StreamEnabled=true,StreamViewType={REQUIRED_VIEW} (a new stream: a job "
            "that already read the old one copies the table again, ddb2bt migrate --restart)", "source.table")
    key_names = {k["AttributeName"]: k["KeyType"] for k in desc.get("KeySchema", [])}
    expected = {mapping.source.partition_key: "HASH"}
    if mapping.source.sort_key:
        expected[mapping.source.sort_key] = "RANGE"
    if key_names and key_names != expected:
        raise ConfigError(f"the table's key schema is {key_names}, the mapping says {expected}", "source.key")
    return SourceStream(table, arn, view, int(desc.get("ItemCount", 0)))


def ensure_state_table(project: str, instance: str, table_id: str) -> list:
    return BigtableAdmin(project, instance).ensure_table(table_id, STATE_FAMILIES)


def check_target(mapping: MappingConfig) -> Optional[str]:
    """A warning when the target misses families (their cells will dead-letter),
    or ConfigError when the table does not exist."""
    forget_process_families()  # the job's sinks list the families as they are now
    admin = BigtableAdmin(mapping.target.project, mapping.target.instance)
    if not admin.exists(mapping.target.table):
        raise ConfigError(missing_target_message(mapping), "target.table")
    missing = sorted(mapping.family_names - admin.families(mapping.target.table))
    if missing:
        return (f"table {mapping.target.table} lacks families {', '.join(missing)}: their cells go to the "
                f"dead-letter output; run {create_table_command(mapping)} to add them")
    return None


def create_table_command(mapping: MappingConfig) -> str:
    """The create-table command for this very target: the mapping and the target
    options this command was given (--bigtable-project/--bigtable-instance/
    --bigtable-table), so it creates the table where the job looks for it."""
    return f"ddb2bt create-table --mapping {quote(str(mapping.origin))}{mapping.target_flags()}"


def missing_target_message(mapping: MappingConfig) -> str:
    """What a command says when the target table is not there: where it looked,
    and the two ways out (a wrong instance, or a table not created yet)."""
    t = mapping.target
    return (f"Bigtable table {t.table!r} does not exist in project {t.project!r}, instance {t.instance!r}. "
            f"If that is the wrong project or instance, pass --bigtable-project/--bigtable-instance (or fix "
            f"target in {mapping.origin}); if the table is not created yet, create it with: "
            f"{create_table_command(mapping)}")


def check_target_exists(mapping: MappingConfig) -> None:
    """ConfigError naming the project, instance and fix when the target table
    is missing: before a read-only command reads rows it cannot find."""
    if not BigtableAdmin(mapping.target.project, mapping.target.instance).exists(mapping.target.table):
        raise ConfigError(missing_target_message(mapping), "target.table")


def check_state_exists(mapping: MappingConfig, state_table: str, job: str) -> None:
    """ConfigError naming where it looked when the state table is missing: no
    job ever ran against this project and instance (often a wrong
    --bigtable-instance), so there is no state to report on."""
    t = mapping.target
    if not BigtableAdmin(t.project, t.instance).exists(state_table):
        raise ConfigError(
            f"no state of job {job!r} in project {t.project!r}, instance {t.instance!r}: the state table "
            f"{state_table!r} does not exist there, so no job ran against this instance. If that is the wrong "
            "project or instance, pass --bigtable-project/--bigtable-instance (or fix target in "
            f"{mapping.origin}); to start the job: ddb2bt migrate --mapping {quote(str(mapping.origin))}"
            f"{mapping.target_flags()}", "target.instance")


# Meta cell: the stream label a job was told to follow after its stream was replaced.
FOLLOWED_STREAM_META = "followed_stream"


def check_stream_continuity(store, stream_arn: str, accept_new_stream: bool) -> None:
    """A disabled-and-re-enabled stream has a new ARN and starts empty: changes made
    while it was off are lost. Refuse to carry on silently."""
    known = store.known_stream_labels()
    current = stream_label(stream_arn)
    followed = store.load_meta(FOLLOWED_STREAM_META)
    if followed:
        known = known | {followed}
    if known and current not in known and accept_new_stream:
        # Accepted once (--new-stream, or the re-copy of `migrate --restart`): the
        # job follows this stream from now on, even before its first record is
        # checkpointed (a quiet table's new stream may hold none for a while).
        store.save_meta(FOLLOWED_STREAM_META, current)
    elif known and current not in known:
        raise PermanentError(
            f"the table's stream was replaced: checkpoints are for stream {', '.join(sorted(known))}, the table "
            f"now has {current}. Changes made while the stream was disabled are LOST. Copy the table again "
            "(ddb2bt migrate --restart: a new backfill, rows of items deleted meanwhile removed, then the new "
            "stream tailed), or pass --new-stream to tail the new stream anyway (the lost changes stay lost).")


# Where a restarted job's shards without a checkpoint start, once it has any
# state (docs/design.md §6.3). A Kinesis job first started at the head re-reads
# from a little before that start: records AWS stamped just before our clock's
# start time were not yet read by the first LATEST iterators, and reading earlier
# is harmless through the ordering guard (a duplicate writes nothing).
START_MARGIN_MS = 300_000
START_META = "start"  # meta row: the job's recorded start per stream, {"mode", "at_ms"}


@dataclass(frozen=True)
class TailStart:
    """Where a job's tail starts shards without a checkpoint. ``fresh``: no
    checkpoint and no recorded start for the stream: ``mode`` (--start) applies to
    the shards of its first discovery. Otherwise every such shard starts at
    TRIM_HORIZON, or, for a Kinesis job first started at the head, at
    ``kinesis_from_ms`` (AT_TIMESTAMP)."""

    mode: str
    fresh: bool
    kinesis_from_ms: Optional[int] = None


def settle_start(store, stream_arn: str, mode: str, now_ms: int, kinesis: bool = False) -> TailStart:
    """Decide (and on a fresh job record) where shards without a checkpoint start.
    ``--start latest`` on a job with checkpoints or a recorded start is refused:
    a shard the job never checkpointed (a quiet one, one holding only other
    tables' Kinesis records, one born while the job was down whose parent aged
    out) would skip every change written while the job was down."""
    import json

    name = f"{START_META}#{stream_label(stream_arn)}"
    recorded = store.load_meta(name)
    has_checkpoints = store.has_checkpoints(stream_arn)
    if recorded is None and not has_checkpoints:
        value = json.dumps({"mode": mode, "at_ms": now_ms}, sort_keys=True)
        if store.swap_meta(name, None, value):
            return TailStart(mode, fresh=True)
        recorded = store.load_meta(name)  # another launch recorded it first: a restart after all
    if mode == "latest":
        raise ConfigError(
            "this job has already run (it has checkpoints or a recorded start in the state table), so it resumes "
            "from its checkpoints, and every shard without one starts at the oldest record kept (TRIM_HORIZON; "
            "a Kinesis job first started at the head: just before that start), so nothing written while it was "
            "down is skipped. --start latest would skip those changes on every shard it never checkpointed. "
            "Leave --start out to resume; to start over at the head, use a new --job-name (and back-fill)",
            "--start")
    start = json.loads(recorded) if recorded else {}
    from_ms = start.get("at_ms") - START_MARGIN_MS if kinesis and start.get("mode") == "latest" else None
    return TailStart(mode, fresh=False, kinesis_from_ms=from_ms)


DEFAULT_APP_PROFILE = "default"  # what requests without an app profile use


def check_app_profiles(project: str, instance: str, app_profile: Optional[str], state_app_profile: Optional[str],
                       admin=None) -> Optional[str]:
    """Refuse a job whose state app profile cannot run single-row transactions.

    The job lease, version claims, checkpoints and the backfill's conditional rows
    use CheckAndMutateRow, which Bigtable accepts only through an app profile with
    single-cluster routing and single-row transactions allowed; a replicated
    (HA) instance's multi-cluster profile rejects it — the emulator does not.
    ``admin``: anything with ``app_profile(id) -> AppProfileFacts`` (a fake in
    tests; by default the process's BigtableAdmin). Returns a note when the
    check could not run (the emulator has no app profiles), None when it passed;
    raises ConfigError naming the profile and what to change."""
    state = state_app_profile or app_profile or DEFAULT_APP_PROFILE
    option = "--state-app-profile"  # the fix, whichever profile was used
    if admin is None and os.environ.get("BIGTABLE_EMULATOR_HOST"):
        return "app profiles not checked: the Bigtable emulator has none (and no replication)"
    create = (f"gcloud bigtable app-profiles create ddb2bt-state --instance={instance} --route-to=CLUSTER_ID "
              f"--transactional-writes")
    admin = admin if admin is not None else process_admin(project, instance)
    try:
        facts = admin.app_profile(state)
        data = admin.app_profile(app_profile) if app_profile and app_profile != state else None
    except AppProfileUnknown as exc:
        return f"app profiles not checked: {exc}"
    where = f"app profile {state!r} of Bigtable instance {instance}"
    if not facts.exists:
        raise ConfigError(f"{where} does not exist; create one with single-cluster routing and single-row "
                          f"transactions ({create}) and pass it with --state-app-profile", option)
    if facts.routing == MULTI_CLUSTER:
        raise ConfigError(
            f"{where} uses multi-cluster routing, which refuses the CheckAndMutateRow calls of the job lease, "
            "version claims and checkpoints. Keep it for the data (target.app_profile) and give the state its "
            f"own single-cluster profile with single-row transactions: {create}, then pass "
            "--state-app-profile ddb2bt-state (docs/operations.md, HA instances)", option)
    if not facts.transactional:
        raise ConfigError(
            f"{where} routes to cluster {facts.cluster_id} but does not allow single-row transactions, which "
            "the job lease, version claims and checkpoints need (CheckAndMutateRow). Allow them: gcloud bigtable "
            f"app-profiles update {state} --instance={instance} --route-to={facts.cluster_id} "
            "--transactional-writes, or pass another profile with --state-app-profile", option)
    if data is not None and not data.exists:
        raise ConfigError(f"app profile {app_profile!r} of Bigtable instance {instance} does not exist",
                          "target.app_profile")
    if data is not None and (data.routing == MULTI_CLUSTER or data.cluster_id != facts.cluster_id):
        # docs/design.md §10.4: every write of a row through one cluster.
        routed = "to any cluster" if data.routing == MULTI_CLUSTER else f"to cluster {data.cluster_id}"
        raise ConfigError(
            f"app profile {app_profile!r} of Bigtable instance {instance} routes the data writes {routed}, and the "
            f"state profile {state!r} (which writes a row's changes while a backfill runs) to cluster "
            f"{facts.cluster_id}: two changes of one row could be written on two clusters, and Bigtable's "
            "replication does not keep their order (each cell's last write by server time wins), so a later "
            "delete could be undone by an earlier write replicated from the other cluster. Write through the "
            f"state profile's cluster: drop target.app_profile, or set it to a single-cluster profile routed to "
            f"{facts.cluster_id} (gcloud bigtable app-profiles create ddb2bt-data --instance={instance} "
            f"--route-to={facts.cluster_id}) (docs/operations.md, HA instances)", "target.app_profile")
    return None


def check_change_stream(mapping: MappingConfig, admin: Optional[BigtableAdmin] = None) -> float:
    """The retention (seconds) of the target table's change stream, which the way
    back to DynamoDB reads; ConfigError naming the fix when the table has none."""
    admin = admin or BigtableAdmin(mapping.target.project, mapping.target.instance)
    retention = admin.change_stream_retention_s(mapping.target.table)
    if retention is None:
        raise ConfigError(f"Bigtable table {mapping.target.table!r} has no change stream, which the way back to "
                          f"DynamoDB reads; turn it on with: ddb2bt create-table --mapping {mapping.origin} "
                          "--change-stream", "target.change_stream_retention_hours")
    return retention
