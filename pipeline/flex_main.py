"""Flex Template entrypoint: the launcher runs this file with the template's
parameters as ``--name=value`` (names with underscores, see
deploy/dataflow/metadata.json). ``--command`` picks run, backfill, migrate or verify;
our parameters are translated to the CLI's options, everything else (the
launcher's --runner, --project, --region, --temp_location, --sdk_container_image,
--update, ...) goes to Beam untouched.
"""
from __future__ import annotations

import sys
from typing import Optional

COMMANDS = ("run", "backfill", "migrate", "verify")
# template parameter → (CLI option, kind); kind "flag" for booleans
PARAMETERS = {
    "mapping": ("--mapping", "value"),
    "bigtable_project": ("--bigtable-project", "value"),
    "bigtable_instance": ("--bigtable-instance", "value"),
    "bigtable_table": ("--bigtable-table", "value"),
    "state_table": ("--state-table", "value"),
    "job_name": ("--job-name", "value"),
    "partitions": ("--partitions", "value"),
    "start": ("--start", "value"),
    "on_trimmed": ("--on-trimmed", "value"),
    "poll_interval": ("--poll-interval", "value"),
    "discovery_interval": ("--discovery-interval", "value"),
    "dlq_include_values": ("--dlq-include-values", "bool"),
    "metrics_pushgateway": ("--metrics-pushgateway", "value"),
    "segments": ("--segments", "value"),
    "tasks": ("--tasks", "value"),
    "max_rcu": ("--max-rcu", "value"),
    "page_size": ("--page-size", "value"),
    "consistent_read": ("--consistent-read", "flag"),
    "from_export": ("--from-export", "value"),
    "restart": ("--restart", "flag"),
    "report": ("--report", "value"),
}
TRUE = ("true", "1", "yes")
BACKFILL_ONLY = {"segments", "tasks", "max_rcu", "page_size", "consistent_read", "from_export", "restart"}
TAIL_ONLY = {"partitions", "start", "on_trimmed", "poll_interval", "discovery_interval"}
VERIFY_ONLY = {"report"}
# verify reads (Scan segments or an export) and writes a report: no tail, no read budget, no dead letters
NOT_VERIFY = TAIL_ONLY | {"tasks", "max_rcu", "page_size", "consistent_read", "restart", "dlq_include_values",
                          "metrics_pushgateway"}
NOT_FOR = {"run": BACKFILL_ONLY | VERIFY_ONLY, "backfill": TAIL_ONLY | VERIFY_ONLY, "migrate": VERIFY_ONLY,
           "verify": NOT_VERIFY}


def translate(argv: list) -> list:
    """Launcher argv → ``[command, cli options..., beam options...]``."""
    command: Optional[str] = next((a.split("=", 1)[1] for a in argv if a.startswith("--command=")), None)
    if command not in COMMANDS:
        raise SystemExit(f"ddb2bt flex template: --command must be one of {', '.join(COMMANDS)}, got {command!r}")
    ours, beam = [], []
    for arg in argv:
        name, sep, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name == "command":
            continue
        if name in NOT_FOR[command]:
            continue  # a parameter of another command (one template serves all four)
        if name in PARAMETERS and sep:
            option, kind = PARAMETERS[name]
            if kind == "flag":
                if value.lower() in TRUE:
                    ours.append(option)
            elif kind == "bool":
                ours.append(option if value.lower() in TRUE else "--no-" + option[2:])
            else:
                ours.append(f"{option}={value}")
        else:
            beam.append(arg)
    return [command] + ours + beam


def main(argv: Optional[list] = None) -> int:
    from ddb2bt.pipeline.cli import main as cli_main

    return cli_main(translate(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
