"""``ddb2bt status``: where each table's migration stands, from the state table
and (when reachable) the stream's facts. Read-only. The CLI (``pipeline/app/cli.py``)
only parses and calls this; what it prints and returns is the command's output
and exit code.
"""
from __future__ import annotations

import json
import logging

from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.cutover.status import assess, facts_json, render, render_tables, table_facts
from ddb2bt.pipeline.services.jobs import load_all, mapping_flags, state_spec
from ddb2bt.pipeline.connect.preflight import check_state_exists
from ddb2bt.pipeline.connect.reachability import check_reachable

__all__ = ["STATUS_DEADLINE_S", "cmd_status"]

log = logging.getLogger("ddb2bt")

STATUS_DEADLINE_S = 20.0  # read-only commands give up on an unreachable service within ~30 s


def cmd_status(args) -> int:
    # status is read-only and often run when something is wrong: answer fast.
    read_retry = RetryPolicy(initial_s=0.2, max_backoff_s=2.0, deadline_s=STATUS_DEADLINE_S)
    mappings = load_all(args)
    # Both services probed at once under one budget; without DynamoDB status still
    # answers (no stream lag), without Bigtable (the state) it cannot.
    reach = check_reachable(mappings, dynamodb="optional")
    for name, why in reach.problems.items():
        log.warning("%s: %s; status without stream facts", name, why)
    for m in mappings:  # a wrong instance is named, not a raw ReadRows NOT_FOUND
        check_state_exists(m, args.state_table, args.job_name or m.name)
    named = [(m.name, table_facts(m, state_spec(args, m).store(), read_retry, describe=reach.dynamodb_ok))
             for m in mappings]
    ready = all(assess(f)[0] for _, f in named)
    origins = {m.name: m.origin for m in mappings}
    flags = lambda name: mapping_flags(args, None if len(mappings) == 1 else [origins[name]])  # noqa: E731
    if args.json:
        body = facts_json(named[0][1], flags(named[0][0])) if len(named) == 1 else {
            "ready": ready, "tables": {name: facts_json(f, flags(name)) for name, f in named}}
        print(json.dumps(body, indent=2))
    else:
        for line in render(named[0][1], flags(named[0][0])) if len(named) == 1 else render_tables(named, flags):
            print(line)
    return 0 if ready else 1
