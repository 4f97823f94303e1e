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
    "consistent_read": ("--consistent-read", "bool"),
    "from_export": ("--from-export", "value"),
    "restart": ("--restart", "flag"),
    "new_stream": ("--new-stream", "flag"),
    "kinesis_share": ("--kinesis-share", "value"),
    # one running job per job name, and the give-up deadlines (docs/operations.md)
    "take_over": ("--take-over", "flag"),
    "show_values": ("--show-values", "flag"),
    "show_keys": ("--show-keys", "flag"),
    "eventually_consistent": ("--eventually-consistent", "flag"),
    "state_app_profile": ("--state-app-profile", "value"),
    "adopt_target": ("--adopt-target", "flag"),
    "standby": ("--standby", "flag"),
    "lease_ttl": ("--lease-ttl", "value"),
    "lease_renew": ("--lease-renew", "value"),
    "bigtable_deadline": ("--bigtable-deadline", "value"),
    "dynamodb_deadline": ("--dynamodb-deadline", "value"),
    # run, migrate: the continuous check, a branch of the streaming job (docs/operations.md)
    "continuous_check": ("--continuous-check", "value"),
    "continuous_check_segments": ("--continuous-check-segments", "value"),
    # options of `ddb2bt` itself, given before the command
    "log_level": ("--log-level", "value"),
    "log_format": ("--log-format", "value"),
    # verify (command=verify): where its report goes (a file or gs://)
    "report": ("--report", "value"),
    "recheck_wait": ("--recheck-wait", "value"),
}
GLOBAL = {"log_level", "log_format"}
# CLI options of run/backfill/migrate the template deliberately does not offer,
# with why (tests/unit/project/test_deploy.py compares the template with the CLI).
NOT_ON_DATAFLOW = {
    "until_idle": "a Dataflow streaming job is stopped by drain, not by an idle stream (tests and local catch-up runs)",
    "metrics_port": "Dataflow workers cannot be scraped: use metrics_pushgateway",
    "metrics_host": "Dataflow workers cannot be scraped: use metrics_pushgateway",
    "sample_rate": "the Beam verify checks every item (a sampled verify is the local one)",
    "spill_dir": "the local verify's disk spill; a Beam verify joins on the runner, not on local disk",
}
TRUE = ("true", "1", "yes")
BACKFILL_ONLY = {"segments", "tasks", "max_rcu", "page_size", "consistent_read", "from_export", "restart"}
TAIL_ONLY = {"partitions", "start", "on_trimmed", "poll_interval", "discovery_interval", "new_stream",
             "kinesis_share"}
VERIFY_ONLY = {"report", "show_keys", "show_values", "eventually_consistent", "recheck_wait"}
CHECK = {"continuous_check", "continuous_check_segments"}  # run and migrate
# verify reads (Scan segments or an export, within --max-rcu) and writes a report:
# no tail, no lease, no dead letters
NOT_VERIFY = TAIL_ONLY | {"tasks", "page_size", "consistent_read", "restart", "dlq_include_values",
                          "metrics_pushgateway", "take_over", "adopt_target", "standby", "lease_ttl", "lease_renew",
                          "bigtable_deadline", "dynamodb_deadline"}
NOT_FOR = {"run": BACKFILL_ONLY | VERIFY_ONLY, "backfill": TAIL_ONLY | VERIFY_ONLY | CHECK,
           "migrate": VERIFY_ONLY, "verify": NOT_VERIFY | CHECK}


def translate(argv: list) -> list:
    """Launcher argv → ``[global options..., command, cli options..., beam options...]``."""
    command: Optional[str] = next((a.split("=", 1)[1] for a in argv if a.startswith("--command=")), None)
    if command not in COMMANDS:
        raise SystemExit(f"ddb2bt flex template: --command must be one of {', '.join(COMMANDS)}, got {command!r}")
    first, ours, beam = [], [], []
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
                (first if name in GLOBAL else ours).append(f"{option}={value}")
        else:
            beam.append(arg)
    return first + [command] + ours + beam


def main(argv: Optional[list] = None) -> int:
    from ddb2bt.pipeline.app.cli import main as cli_main

    return cli_main(translate(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
