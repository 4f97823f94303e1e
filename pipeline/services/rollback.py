"""The ``ddb2bt rollback`` commands (docs/rollback.md): ``run`` writes Bigtable's
changes since the cutover back to DynamoDB, ``status`` says whether the
application can switch back now, ``verify`` compares DynamoDB with the inverse of
Bigtable. The CLI (``pipeline/app/cli.py``) only parses and calls these; what they
print and return is the command's output and exit code.
"""
from __future__ import annotations

import sys
import time

from ddb2bt.pipeline.services.jobs import acquire_lease, load, start_metrics_server, state_spec
from ddb2bt.transforms.errors import ConfigError
from ddb2bt.transforms.inverse import NO, describe, mapping_inversion

US_PER_MS = 1000
UNEXPLAINED_META = "rollback_unexplained"  # cells not written back since the cutover (a count)
DEFAULT_MAX_LAG_S = 60.0
# How far this host's clock may run ahead of Bigtable's commit times.
FULL_PASS_CLOCK_MARGIN_US = 5_000_000


def _now_us() -> int:
    return time.time_ns() // 1000


def versions_table(args, mapping) -> str:
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.sink.dynamodb_writer import versions_table_name

    return getattr(args, "versions_table", None) or versions_table_name(mapping.source.table)


def key_types(ddb, table: str) -> dict:
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.clients.dynamodb import describe_table

    return {a["AttributeName"]: a["AttributeType"] for a in describe_table(ddb, table).get("AttributeDefinitions", [])}


def _rows_back(args, mapping, ddb, spec, writer, bigtable=None):
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.clients.bigtable.reads import read_rows
    from ddb2bt.pipeline.clients.dynamodb import query_partition
    from ddb2bt.pipeline.recover.rollback import RowsBack

    target = mapping.target
    return RowsBack(
        mapping, mapping.source.table,
        read_rows=lambda keys: read_rows(target.project, target.instance, target.table, keys, client=bigtable,
                                         app_profile=target.app_profile),
        query_partition=lambda attribute, value: query_partition(ddb, mapping.source.table, attribute, value,
                                                                  metrics_table=spec.job),
        writer=writer, key_types=key_types(ddb, mapping.source.table))


def cmd_rollback_prepare(args) -> int:
    """Turn on the target table's change stream before the cutover: the way back
    reads every change made after it, so its retention must cover the time in
    which a switch back may be decided (docs/rollback.md, Cost)."""
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.clients.bigtable.admin import BigtableAdmin

    mapping = load(args)
    target = mapping.target
    admin = BigtableAdmin(target.project, target.instance)
    changed = admin.enable_change_stream(target.table, int(args.retention_hours * 3600))
    if changed:
        print(changed)
    retention = admin.change_stream_retention_s(target.table)
    if retention is None:
        print(f"the change stream of {target.table} is still off after enabling it", file=sys.stderr)
        return 1
    print(f"change stream of {target.project}/{target.instance}/{target.table} on: changes kept "
          f"{retention / 3600:g} hour(s)")
    for line in describe(mapping_inversion(mapping)):
        print(line)
    return 0


def cmd_rollback_run(args) -> int:
    """Cut over (LIVE → CUT_OVER, holding the forward tail's lease), then write every
    Bigtable change since the cutover back to DynamoDB (docs/rollback.md)."""
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.clients.bigtable.changestream import (
        ChangeStreamClient, Frontier, initial_frontier, open_client, read_pass, table_name,
    )
    from ddb2bt.pipeline.clients.bigtable.channel import close_bounded
    from ddb2bt.pipeline.clients.bigtable.reads import data_client, read_table
    from ddb2bt.pipeline.clients.dynamodb import scan_items
    from ddb2bt.pipeline.connect.connections import dynamodb_client
    from ddb2bt.pipeline.control.coordinator import join
    from ddb2bt.pipeline.control.lease import TAIL
    from ddb2bt.pipeline.control.phases import Migration
    from ddb2bt.pipeline.observe.metrics import rollback_metrics
    from ddb2bt.pipeline.recover.rollback import APPLIED_META, RollbackJob, RollbackOutcome, reconcile
    from ddb2bt.pipeline.sink.dynamodb_writer import DynamoDBWriter, ensure_versions_table

    mapping = load(args)
    if not any(i.status != NO for i in mapping_inversion(mapping)):
        raise ConfigError("no rule of this mapping inverts, so nothing can be written back (ddb2bt explain "
                          "--reverse says why for each rule)", "--mapping")
    spec = state_spec(args, mapping)
    store = spec.store()
    start_metrics_server(args.metrics_port, args.metrics_host)
    # The forward tail holds this lease while it writes: taking it proves it stopped,
    # and holding it keeps a forward `run` from starting while the way back writes.
    held = join(acquire_lease(args, spec, TAIL))
    fence = held.check if held is not None else (lambda: None)
    close = bigtable = None
    try:
        cutover_us = Migration(store).cut_over() * US_PER_MS
        ddb = dynamodb_client(mapping.source.region)
        ensure_versions_table(ddb, versions_table(args, mapping))
        writer = DynamoDBWriter(ddb, versions_table(args, mapping), max_wcu=args.max_wcu, metrics_table=spec.job)
        target = mapping.target
        bigtable = data_client(target.project)  # one for every batch of the run, closed at its end
        rows_back = _rows_back(args, mapping, ddb, spec, writer, bigtable)
        total = RollbackOutcome()
        if args.full:
            # The version of every write of this pass: this host's clock, less a margin,
            # so a delete Bigtable commits after the read below (its commit time on
            # Bigtable's clock) is never refused as older than this pass's writes.
            began = _now_us() - FULL_PASS_CLOCK_MARGIN_US
            rows = read_table(target.project, target.instance, target.table, client=bigtable,
                              app_profile=target.app_profile)
            total = reconcile(rows_back, mapping, rows, scan_items(ddb, mapping.source.table, metrics_table=spec.job),
                              began)
            fence()
            store.save_meta(APPLIED_META, str(began))
            rollback_metrics().applied_until_s(spec.job, began / 1e6)
        else:
            api, close = open_client()
            stream = ChangeStreamClient(api, table_name(target.project, target.instance, target.table),
                                        target.app_profile)
            job = RollbackJob(rows_back, read=lambda frontier, end_us: read_pass(stream, frontier, end_us),
                              start=lambda start_us: initial_frontier(stream, start_us), load=Frontier.from_json,
                              store=store, now_us=_now_us, metrics=rollback_metrics(), metrics_table=spec.job,
                              fence=fence)
            total = job.run(cutover_us, args.until_idle, follow=args.follow)
        seen = int(store.load_meta(UNEXPLAINED_META) or 0) + total.unexplained
        store.save_meta(UNEXPLAINED_META, str(seen))
    finally:
        if close is not None:
            close()
        if bigtable is not None:
            close_bounded(bigtable.close, "Bigtable data client")
        if held is not None:
            held.release()
    print(f"rollback of {mapping.source.table}: {total.line()}")
    for row, family, qualifier, why in total.samples if args.show_keys else ():
        print(f"  not written back: row {row!r} {family}:{qualifier.decode('utf-8', 'replace')}: {why}")
    if total.unexplained:
        print("some cells were not written back: see `ddb2bt explain --reverse` and docs/rollback.md, What does not "
              "invert", file=sys.stderr)
        return 1
    return 0


def cmd_rollback_status(args) -> int:
    """READY to switch back, or NOT READY and why, each from evidence."""
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.clients.bigtable.admin import BigtableAdmin
    from ddb2bt.pipeline.clients.bigtable.changestream import ChangeStreamClient, open_client, table_name
    from ddb2bt.pipeline.control.phases import CUT_OVER, Migration
    from ddb2bt.pipeline.recover.rollback import APPLIED_META

    mapping = load(args)
    store = state_spec(args, mapping).store()
    migration = Migration(store)
    problems, facts = [], []
    phase = migration.phase
    if phase == CUT_OVER:
        facts.append(f"forward replication stopped at the cutover ({migration.cutover_ms} ms): phase CUT_OVER")
    else:
        problems.append(f"the migration is {phase or 'not started'}, not CUT_OVER: the forward tail has not been "
                        "stopped by `ddb2bt rollback run`")
    target = mapping.target
    api, close = open_client()
    try:
        retention = BigtableAdmin(target.project, target.instance).change_stream_retention_s(target.table)
        if retention is None:
            raise ConfigError("no change stream is configured on the table", "--mapping")
        partitions = ChangeStreamClient(api, table_name(target.project, target.instance, target.table),
                                        target.app_profile).partitions()
        facts.append(f"the change stream of {target.table} is on (kept {retention / 3600:g} h) and answers "
                     f"({len(partitions)} partition(s))")
    except Exception as exc:  # the stream is off, or Bigtable unreachable: either way not READY
        problems.append(f"the change stream of {target.table} cannot be read ({type(exc).__name__}: {exc}); turn "
                        "it on before the cutover: ddb2bt rollback prepare (docs/rollback.md)")
    finally:
        close()
    applied = store.load_meta(APPLIED_META)
    if applied is None:
        problems.append("nothing has been written back yet: run `ddb2bt rollback run`")
    else:
        lag_s = (_now_us() - int(applied)) / 1e6
        line = f"every change committed before {lag_s:.1f} s ago is written back"
        (facts if lag_s <= args.max_lag else problems).append(
            line if lag_s <= args.max_lag else f"{line}: more than --max-lag {args.max_lag:g} s")
    unexplained = int(store.load_meta(UNEXPLAINED_META) or 0)
    if unexplained:
        problems.append(f"{unexplained} cell(s) changed since the cutover were not written back (rules or cells "
                        "that do not invert: ddb2bt explain --reverse)")
    not_inverting = [i.rule for i in mapping_inversion(mapping) if i.status == NO]
    if not_inverting:
        problems.append(f"rule(s) {', '.join(not_inverting)} do not invert: their changes since the cutover are not "
                        "written back")
    for fact in facts:
        print(f"ok: {fact}")
    for problem in problems:
        print(f"not ready: {problem}")
    print("READY to switch back to DynamoDB" if not problems else "NOT READY to switch back")
    return 0 if not problems else 1


def cmd_rollback_verify(args) -> int:
    """DynamoDB compared with the inverse of Bigtable: every item mapped forward
    must give exactly the rows Bigtable holds (index rows left out: derived)."""
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.clients.bigtable.reads import read_table
    from ddb2bt.pipeline.clients.dynamodb import scan_items
    from ddb2bt.pipeline.connect.connections import dynamodb_client
    from ddb2bt.pipeline.verify.compare import diff_layout, expected_layout, without_clocks
    from ddb2bt.transforms.inverse_rows import derived_families

    mapping = load(args)
    target = mapping.target
    items = list(scan_items(dynamodb_client(mapping.source.region), mapping.source.table))
    derived = derived_families(mapping)
    refused: list = []  # items the mapping cannot map: Bigtable cannot hold them, so never IDENTICAL
    expected = expected_layout(mapping, items, on_unmappable=lambda it, exc: refused.append(exc.reason)).get(
        target.table, {})
    expected = {row: cols for row, cols in ((r, {c: v for c, v in cols.items() if c[0] not in derived})
                                            for r, cols in expected.items()) if cols}
    actual = without_clocks(read_table(target.project, target.instance, target.table, app_profile=target.app_profile))
    actual = {row: cols for row, cols in ((r, {c: v for c, v in cols.items() if c[0] not in derived})
                                          for r, cols in actual.items()) if cols}
    diff = diff_layout(expected, actual)
    print(f"{len(items)} DynamoDB item(s) mapped forward against {len(actual)} Bigtable row(s) of {target.table} "
          f"(index rows left out): {diff.summary()}")
    for line in describe(mapping_inversion(mapping)) if args.verbose else ():
        print(line)
    if args.show_keys:
        for row in sorted(diff.rows())[:20]:
            print(f"  differs: row {row!r}")
    if refused:
        print(f"{len(refused)} DynamoDB item(s) the mapping refuses ({', '.join(sorted(set(refused)))}): Bigtable "
              "cannot hold them")
    if diff.identical and not refused:
        print(f"IDENTICAL: DynamoDB table {mapping.source.table} holds exactly the items Bigtable table "
              f"{target.table} reads back to")
        return 0
    print(f"DIFFERENT: {len(diff.rows())} row(s) differ (--show-keys lists them), {len(refused)} item(s) refused")
    return 1
