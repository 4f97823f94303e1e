"""The ``ddb2bt verify`` command: the local verify, or the same check as a Beam job
(``verify/beam_verify.py``). The CLI (``pipeline/app/cli.py``) only parses and calls
these; what they print and return is the command's output and exit code.
"""
from __future__ import annotations

import json
from pathlib import Path

from ddb2bt.pipeline.services.jobs import load_all, state_spec, submitted
from ddb2bt.pipeline.connect.reachability import check_reachable
from ddb2bt.transforms.errors import ConfigError
from ddb2bt.pipeline.connect.preflight import ensure_state_table
from ddb2bt.pipeline.options import runner_of


def cmd_verify(args) -> int:
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.verify.recheck import RecheckOptions
    from ddb2bt.pipeline.verify.verify import print_report, verify_target
    mappings = load_all(args)
    if runner_of(args.beam_args) or args.from_export:
        return cmd_verify_beam(args, mappings)
    check_reachable(mappings)  # the preflight answers within ~30 s, naming what is unreachable
    reports = {}
    for mapping in mappings:
        ensure_state_table(mapping.target.project, mapping.target.instance, args.state_table)
        if len(mappings) > 1:
            print(f"== {mapping.name} ({mapping.source.table} → {mapping.target.table})")
        reports[mapping.name] = report = verify_target(
            mapping, state_spec(args, mapping).store(), segments=args.segments, sample_rate=args.sample_rate,
            consistent=not args.eventually_consistent, show_values=args.show_values, show_keys=args.show_keys,
            recheck_options=RecheckOptions(wait_s=args.recheck_wait), workdir=args.spill_dir,
            max_rcu=args.max_rcu)
        print_report(report)
    identical = all(r.identical for r in reports.values())
    if len(mappings) > 1:
        print(f"{sum(r.identical for r in reports.values())} of {len(reports)} table(s) IDENTICAL"
              + ("" if identical else ": " + ", ".join(n for n, r in reports.items() if not r.identical) + " differ"))
    if args.report:
        body = report.to_json() if len(mappings) == 1 else {"identical": identical, "tables": {
            name: r.to_json() for name, r in reports.items()}}
        Path(args.report).write_text(json.dumps(body, indent=2, ensure_ascii=False))
    return 0 if identical else 1


def cmd_verify_beam(args, mappings: list) -> int:
    """verify as a Beam job (beam_verify.py): the same report, to --report."""
    import tempfile

    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.source.snapshot import ExportSource, ScanSource
    from ddb2bt.pipeline.verify.beam_verify import VerifyTable, run_verify_job
    from ddb2bt.pipeline.verify.recheck import RecheckOptions
    from ddb2bt.pipeline.verify.verify import VerifyReport, print_report
    from ddb2bt.pipeline.graph import is_local

    if args.sample_rate < 1:
        raise ConfigError("the Beam verify checks every item; drop it or run the local verify", "--sample-rate")

    if args.from_export and len(mappings) > 1:
        raise ConfigError("an export holds one table: verify one mapping with it", "--from-export")
    local = is_local(args.beam_args)
    if not args.report and not local:
        raise ConfigError("a Beam verify on a remote runner writes its report there (a gs:// path)", "--report")
    tables = []
    for m in mappings:
        source = (ExportSource(args.from_export, m.source.region) if args.from_export else
                  ScanSource(m.source.table, args.segments, m.source.region,
                             consistent_read=not args.eventually_consistent, max_rcu=args.max_rcu))
        if args.from_export:
            source.check(m.source.table, m.source.region)
        tables.append(VerifyTable(m, source, args.show_values, args.show_keys, state=state_spec(args, m),
                                  recheck=RecheckOptions(wait_s=args.recheck_wait)))
    path = args.report or str(Path(tempfile.mkdtemp(prefix="ddb2bt-verify-")) / "verify.json")
    result, body = run_verify_job(tables, args.beam_args, path)
    if body is None:
        print(f"verify job: its report will be written to {path}")
        return submitted(result, args)
    reports = {m.name: body for m in mappings} if len(mappings) == 1 else body["tables"]
    for name, r in reports.items():
        if len(mappings) > 1:
            print(f"== {name}")
        print_report(VerifyReport(identical=r["identical"], sampled=r["sampled"], items=r["items"],
                                  rows_expected=r["rows_expected"], tables=r["tables"],
                                  unmappable_items=r["unmappable_items"], recheck=r.get("recheck")))
    identical = all(r["identical"] for r in reports.values())
    return 0 if identical else 1
