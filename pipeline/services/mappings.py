"""The commands about a mapping and its tables: ``validate``, ``explain``, ``lint``,
``create-table`` and ``draft``. The CLI (``pipeline/app/cli.py``) only parses and calls
these; what they print and return is the command's output and exit code.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ddb2bt.pipeline.services.jobs import load, load_all, load_sources
from ddb2bt.pipeline.connect.reachability import check_reachable
from ddb2bt.transforms.config import CHANGE_STREAM_MAX_HOURS, CHANGE_STREAM_MIN_HOURS
from ddb2bt.transforms.errors import ConfigError, ConfigProblems, MappingError
from ddb2bt.pipeline.clients.bigtable.admin import change_stream_hours, ensure_mapping_table
from ddb2bt.transforms.inverse import describe, mapping_inversion
from ddb2bt.pipeline.connect.connections import dynamodb_client
from ddb2bt.pipeline.connect.preflight import ensure_state_table
from ddb2bt.pipeline.source.records import from_stream_record
from ddb2bt.transforms.mapping import map_change
from ddb2bt.transforms.model import INSERT, REMOVE, ChangeRecord, SetCell

# `draft`: the target written into a draft when none is given (the header says to decide it).
DRAFT_PROJECT, DRAFT_INSTANCE = "my-project", "my-instance"
# `explain`: the item (or a record) would be a dead letter. Not 1 (a failure of the
# command) nor 2 (a configuration error): scripts can tell "the mapping refuses it".
EXIT_DEAD_LETTER = 3
EXIT_CONFIG_ERROR = 2  # a bad mapping or option, as main() returns for a ConfigError


def cmd_validate(args) -> int:
    """Every mapping file named, each read to its end: all of a file's problems
    are printed in one run, and every file is checked even after a bad one."""
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.recover.straddle import inexact_features
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.transforms.lint import WARN, placeholder_findings

    loaded, bad = load_sources(args)
    failed = 0
    for source, problem in bad:  # each names its file once (a ConfigProblems names it in its first line)
        where = "" if isinstance(problem, ConfigProblems) or str(problem).startswith(source) else f"{source}: "
        print(f"ddb2bt: configuration error: {where}{problem}", file=sys.stderr)
    for mapping in loaded:
        findings = placeholder_findings(mapping)
        for finding in findings:
            print(finding)
        warnings = [f for f in findings if f.level == WARN]  # notes (INFO) never fail --strict
        if warnings and args.strict:
            print(f"{mapping.origin}: {len(warnings)} warning(s); --strict makes them errors", file=sys.stderr)
            failed += 1
            continue
        rules = ", ".join(r.name for r in mapping.rules)
        print(f"OK: {mapping.origin}: {mapping.source.table} → {mapping.target.project}/{mapping.target.instance}/"
              f"{mapping.target.table}; families {', '.join(sorted(mapping.family_names))}; rules {rules}")
        for why in inexact_features(mapping):  # said before a recovery writes anything (docs/recover.md)
            print(f"note: ddb2bt recover (incremental exports) cannot restore this exactly: {why}")
        for line in describe(mapping_inversion(mapping)):  # what `rollback` can write back (docs/rollback.md)
            print(f"rollback: {line}")
    if bad:
        return EXIT_CONFIG_ERROR
    return 1 if failed else 0


def cmd_explain(args) -> int:
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.transforms.inputs import ITEM, parse_user_input
    mapping = load(args)
    if getattr(args, "reverse", False):
        return explain_reverse(mapping, args)
    if args.item is None:
        raise ConfigError("explain needs --item (a file or '-'), or --reverse", "--item")
    # Parsed exactly (numbers keep their digits) and strictly: what DynamoDB would
    # refuse is an error here, with the reason (transforms/inputs.py).
    given = parse_user_input(Path(args.item).read_text() if args.item != "-" else sys.stdin.read())
    print(f"# {given.shape}")
    if given.kind == ITEM:
        item = given.item
        keys = {k: item[k] for k in mapping.source.key_attributes if k in item}
        ts = args.timestamp_ms
        changes = [(f"{INSERT} at {ts} ms", ChangeRecord(INSERT, keys, item, None, ts)),
                   (f"{REMOVE} at {ts} ms", ChangeRecord(REMOVE, keys, None, item, ts))]
    else:
        changes = []
        for i, raw in enumerate(given.records):
            record = from_stream_record(raw, "explain", "-")
            when = f"{record.change_ms} ms" if record.change_ms >= 0 else "no time"
            changes.append((f"record {i + 1}: {record.event_name or '?'} at {when}"
                            + (" (TTL deletion)" if record.is_ttl_delete else ""), record))
    dead = 0
    for title, record in changes:
        print(f"== {title}")
        try:
            mapped = map_change(mapping, record)
        except MappingError as exc:
            print(f"  dead letter [{exc.reason}]: {exc.message}")
            dead += 1
            continue
        if not mapped:
            print("  (skipped by the mapping)")
        for ch in mapped:
            print(f"  table {ch.table} row {ch.row_key!r}")
            for m in ch.mutations:
                if isinstance(m, SetCell):
                    print(f"    set    {m.family}:{m.qualifier.decode('utf-8', 'replace')} = {m.value[:80]!r} @{m.timestamp_ms}")
                else:
                    print(f"    delete {m.family}:{m.qualifier.decode('utf-8', 'replace')} in [{m.start_ms}, {m.end_ms}) ms")
    return EXIT_DEAD_LETTER if dead else 0


def explain_reverse(mapping, args) -> int:
    """`explain --reverse`: rule by rule what a rollback writes back, and with --item
    the item mapped forward and read back from its row, as a new item would be."""
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.transforms.attrs import canonical_typed_json
    from ddb2bt.transforms.inputs import ITEM, parse_user_input
    from ddb2bt.transforms.inverse_rows import invert_row, owned_row_cells
    from ddb2bt.transforms.mapping import expected_row

    for line in describe(mapping_inversion(mapping)):
        print(line)
    if args.item is None:
        return 0
    given = parse_user_input(Path(args.item).read_text() if args.item != "-" else sys.stdin.read())
    if given.kind != ITEM:
        raise ConfigError("explain --reverse reads one item, not stream records", "--item")
    item = given.item
    try:
        row = expected_row(mapping, item)
        cells = owned_row_cells(mapping, item)
    except MappingError as exc:
        print(f"== the item is a dead letter on the way in [{exc.reason}]: {exc.message}")
        return EXIT_DEAD_LETTER
    if row is None:
        print("== the item is skipped on the way in: nothing to read back")
        return 0
    versions = {col: ([(ts, v) for ts, v in sorted(want.items(), reverse=True)] if kind == "versions" else
                      [(i, v) for i, v in reversed(list(enumerate(want)))] if kind == "list" else [(0, want)])
                for col, (kind, want) in cells.items()}
    types = {k: next(iter(item[k])) for k in mapping.source.key_attributes if k in item}
    back = invert_row(mapping, row[0], versions, types, ())
    print(f"== row {row[0]!r} read back as a new item")
    for got in back.items:
        same = "the same item" if canonical_typed_json({"M": got.item}) == canonical_typed_json({"M": item}) else \
            "differs from the item given"
        print(f"  rule {got.rule}: {canonical_typed_json({'M': got.item})} ({same})")
    for family, qualifier, why in back.unexplained:
        print(f"  not written back: {family}:{qualifier.decode('utf-8', 'replace')}: {why}")
    return 0


def cmd_lint(args) -> int:
    """Every mapping named (a file, a directory, --mapping repeated), each
    reviewed on its own and, with several, under a heading naming its file."""
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.transforms.lint import WARN, lint

    mappings = load_all(args)
    warnings = 0
    for mapping in mappings:
        items = None
        if args.sample:  # the spread sample draft takes: every segment, every entity type read, the largest item
            # inside: loaded when the command runs, not by --help (the CLI imports every service)
            from ddb2bt.pipeline.services.draft import SampleBounds, sample_table

            items, _ = sample_table(dynamodb_client(mapping.source.region), mapping.source.table,
                                    SampleBounds(items=args.sample), keys=mapping.source.key_attributes,
                                    metrics_table=mapping.name)
        findings = lint(mapping, items)
        if len(mappings) > 1:
            print(f"== {mapping.origin} ({mapping.name})")
        for f in findings:
            print(f)
        found = sum(1 for f in findings if f.level == WARN)
        warnings += found
        print(f"{found} warning(s), {len(findings) - found} note(s)")
    return 1 if warnings and args.strict else 0


def cmd_create_table(args) -> int:
    hours = getattr(args, "change_stream", None)
    if hours is not None and not CHANGE_STREAM_MIN_HOURS <= hours <= CHANGE_STREAM_MAX_HOURS:
        raise ConfigError(f"a change stream keeps its changes {CHANGE_STREAM_MIN_HOURS} to {CHANGE_STREAM_MAX_HOURS} "
                          f"hours (1 to 7 days), got {hours}", "--change-stream")
    mappings = load_all(args)
    check_reachable(mappings, dynamodb="skip")  # within ~30 s, naming the endpoint, like the read-only commands
    for mapping in mappings:
        splits: tuple = ()
        if args.split_from_sample:
            # inside: loaded when the command runs, not by --help (the CLI imports every service)
            from ddb2bt.pipeline.services.draft import SampleBounds, sampled_split_points

            splits, sample = sampled_split_points(dynamodb_client(mapping.source.region), mapping,
                                                  SampleBounds(items=args.sample, max_rcu=args.max_rcu))
            print(f"{mapping.name}: {len(splits)} split point(s) from {sample.items} sampled item(s) of "
                  f"{mapping.source.table}")
        changes = ensure_mapping_table(mapping, splits, change_stream_hours(mapping, hours))
        changes += [f"state: {c}" for c in ensure_state_table(mapping.target.project, mapping.target.instance,
                                                                args.state_table)]
        prefix = f"{mapping.name}: " if len(mappings) > 1 else ""
        for line in changes or ["nothing to do: tables and families already match the mapping"]:
            print(prefix + line)
    return 0


def cmd_draft(args) -> int:
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.services.draft import SampleBounds, draft_table

    result = draft_table(dynamodb_client(args.region), args.source_table,
                         SampleBounds(items=args.sample, max_rcu=args.max_rcu),
                         project=args.project or os.environ.get("GOOGLE_CLOUD_PROJECT") or DRAFT_PROJECT,
                         instance=args.instance or DRAFT_INSTANCE, target_table=args.table, region=args.region)
    report = result.assessment.render()
    if args.out:
        Path(args.out).write_text(result.draft.text, encoding="utf-8")
        print(f"wrote {args.out}: {len(result.draft.data['rules'])} rule(s); next: ddb2bt validate -m {args.out} "
              f"&& ddb2bt lint -m {args.out} --sample {args.sample}")
        print(report, end="")
    else:  # the mapping on stdout (ddb2bt draft … > m.yaml), the report beside it
        print(result.draft.text, end="")
        print(report, end="", file=sys.stderr)
    if args.report:
        Path(args.report).write_text(report, encoding="utf-8")
    if result.facts.stream_view_type != "NEW_AND_OLD_IMAGES":
        print(f"ddb2bt: error: {args.source_table} has {'a ' + result.facts.stream_view_type if result.facts.stream_view_type else 'no'} "
              "stream: run and migrate need a NEW_AND_OLD_IMAGES stream (aws dynamodb update-table --table-name "
              f"{args.source_table} --stream-specification StreamEnabled=true,StreamViewType=NEW_AND_OLD_IMAGES); "
              "the draft is written", file=sys.stderr)
        return 1
    return 0
