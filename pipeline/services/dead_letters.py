"""The ``ddb2bt dlq`` commands (list, show, redrive), ``repair`` (a redrive of the
continuous check's divergent rows) and ``release-target``. The CLI
(``pipeline/app/cli.py``) only parses and calls these; what they print and return
is the command's output and exit code.
"""
from __future__ import annotations

import json
import sys
import time

from ddb2bt.pipeline.services.jobs import load_all, mapping_flags, state_spec, write_summary
from ddb2bt.pipeline.connect.reachability import check_reachable
from ddb2bt.pipeline.control.letters import REDACTED, key_text
from ddb2bt.pipeline.control.ownership import release_targets
from ddb2bt.pipeline.control.phases import Migration, refuse_forward_after_cutover


def cmd_dlq_list(args) -> int:
    mappings = load_all(args)
    check_reachable(mappings, dynamodb="skip")
    since = int(args.since * 1000) if args.since is not None else None
    for mapping in mappings:
        letters = state_spec(args, mapping).store().list_dead_letters(reason=args.reason, since_ms=since)
        if args.json:
            for entry in letters[: args.limit]:
                print(json.dumps({"table": mapping.name, **entry} if len(mappings) > 1 else entry,
                                 ensure_ascii=False))
            continue
        by_reason: dict = {}
        for entry in letters:
            by_reason[entry.get("reason", "?")] = by_reason.get(entry.get("reason", "?"), 0) + 1
        print((f"{mapping.name}: " if len(mappings) > 1 else "") + f"{len(letters)} dead letter(s)"
              + (": " + ", ".join(f"{r} {n}" for r, n in sorted(by_reason.items())) if letters else ""))
        for line in dead_letter_lines(letters[: args.limit], mapping_flags(
                args, None if len(mappings) == 1 else [mapping.origin]), show_keys=args.show_keys):
            print(line)
    return 0


def dead_letter_lines(letters: list, flags: str, show_keys: bool = False) -> list:
    """``dlq list``: per letter its time, reason, message, the item's key (redacted
    unless --show-keys, like verify's: ddb2bt.pipeline.observe.redaction; ``<redacted>``
    where the letter was stored without values) and id; then how to act on them."""
    out = []
    for entry in letters:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(entry.get("failed_at_ms", "0")) / 1000))
        out.append(f"  {when}  {entry.get('reason')}  [{entry.get('stage')}] {entry.get('message')}  "
                   f"(at {entry.get('position', 'n/a')})")
        out.append(f"      key {key_text(entry.get('record', '{}'), show_keys)}  id {entry.get('id')}")
    if letters:
        out.append(f"inspect one: ddb2bt dlq show {flags} ID    re-apply once the cause is fixed: "
                   f"ddb2bt dlq redrive {flags} [--reason R] [--dry-run]")
        if any(REDACTED in key_text(e.get("record", "{}")) for e in letters):
            out.append("(keys shown <redacted> were stored redacted by an earlier version: dlq redrive finds the item "
                       "through its stream position while the stream holds it; else re-copy with migrate --restart)")
    return out


def cmd_dlq_show(args) -> int:
    check_reachable(load_all(args), dynamodb="skip")
    letters = [e for mapping in load_all(args) for e in state_spec(args, mapping).store().list_dead_letters()
               if e["id"] == args.id]
    if not letters:
        print(f"no dead letter {args.id}", file=sys.stderr)
        return 1
    entry = dict(letters[0])
    entry["record"] = json.loads(entry["record"])
    print(json.dumps(entry, indent=2, ensure_ascii=False))
    return 0


def cmd_dlq_redrive(args) -> int:
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.recover.redrive import RedriveOptions, redrive_job

    mappings = load_all(args)
    options = RedriveOptions(reason=args.reason, since_ms=int(args.since * 1000) if args.since is not None else None,
                             dry_run=args.dry_run)
    kept = 0
    states = [state_spec(args, mapping) for mapping in mappings]
    if not args.dry_run:  # after the cutover a redrive would overwrite the application's writes to Bigtable
        for mapping, state in zip(mappings, states):
            refuse_forward_after_cutover(Migration(state.store()), mapping.source.table)
    counts = {}
    for mapping, state in zip(mappings, states):
        result = redrive_job(mapping, state, options)
        kept += result.kept
        # The writing commands' summary: items written, dead letters still kept.
        counts[state.job] = {"applied": 0 if args.dry_run else result.resolved, "dead_lettered": result.kept,
                             "skipped": 0}
        verb = "would resolve" if args.dry_run else "resolved"
        print((f"{mapping.name}: " if len(mappings) > 1 else "")
              + f"{verb} {result.resolved} dead letter(s) of {result.items} item(s): each item re-read from DynamoDB "
              f"and written in its current state, its rows read back"
              + (f" ({result.cleaned} cell(s) the mapping does not produce removed)" if result.cleaned else "")
              + f"; kept {result.still_failing} still failing, {result.unstable} whose item kept changing (rerun), "
              f"{result.unproven} not proven (rows shared with other items, a family the mapping does not own, or "
              f"no image left in the stream: see ddb2bt verify; re-copy with ddb2bt migrate --restart), "
              f"{result.redacted} with no key to find the item by (re-copy with ddb2bt migrate --restart)")
    print(("dry run, nothing written; " if args.dry_run else "") + write_summary(args, counts, mappings, states))
    return 0 if kept == 0 else 1


def cmd_release_target(args) -> int:
    mappings = load_all(args)
    states = [state_spec(args, mapping) for mapping in mappings]
    for (table, released), job in zip(release_targets(mappings, states),
                                      [s.job for m, s in zip(mappings, states) for _ in m.tables]):
        print(f"{table}: " + (f"released by job {job}" if released else f"not owned by job {job}; nothing to do"))
    return 0


def cmd_repair(args) -> int:
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.verify.continuous import DIVERGENT

    args.reason, args.since = DIVERGENT, None
    return cmd_dlq_redrive(args)
