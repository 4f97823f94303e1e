"""``ddb2bt``: replicate a live DynamoDB table into Bigtable.

Run ``ddb2bt <command> --help`` for each command's options and examples.
"""
from __future__ import annotations

if __name__ == "__main__":  # `python -m ddb2bt.pipeline.app.cli`: interrupts handled before the imports below
    from ddb2bt.pipeline.signals import exit_quietly_on_interrupt

    exit_quietly_on_interrupt()

import argparse
import difflib
import logging
import os
import re
import sys
from typing import Optional, Sequence

from ddb2bt.transforms.config import CHANGE_STREAM_MAX_HOURS, CHANGE_STREAM_MIN_HOURS
from ddb2bt.transforms.errors import ConfigError, PermanentError
from ddb2bt.transforms.limits import DEFAULT_POLL_INTERVAL_S
from ddb2bt.pipeline.services.jobs import (  # noqa: F401  (also the CLI's public surface for tests and embedders)
    sink_config, acquire_lease, backfill_options, build_live_jobs, dlq_values, dynamodb_retry, check_profiles,
    load, load_all, mapping_flags, replace_deadline, report_outcome, start_metrics_server, state_spec, submitted, with_backfill_leases,
)
from ddb2bt.pipeline.connect.reachability import check_reachable
from ddb2bt.pipeline.local.local_stack import (DEFAULT_DYNAMODB as LOCAL_DYNAMODB_DEFAULT,
                                               DYNAMODB_EMULATORS as LOCAL_DYNAMODB_EMULATORS,
                                               DYNAMODB_ENV as LOCAL_DYNAMODB_ENV)
from ddb2bt.pipeline.signals import INTERRUPTED, INTERRUPTED_NO_JOB
# The commands' services: the CLI parses and calls one per command (names kept here for embedders and tests).
from ddb2bt.pipeline.app.local_commands import (  # noqa: F401
    REHEARSAL_COMMANDS, cmd_demo, cmd_examples, cmd_local, cmd_local_rehearsal, env_hint, self_command,
)
from ddb2bt.pipeline.services.dead_letters import (  # noqa: F401
    cmd_dlq_list, cmd_dlq_redrive, cmd_dlq_show, cmd_release_target, cmd_repair, dead_letter_lines,
)
from ddb2bt.pipeline.services.verify import cmd_verify
from ddb2bt.pipeline.services.status import STATUS_DEADLINE_S, cmd_status  # noqa: F401
from ddb2bt.pipeline.services.tombstones import cmd_sweep_tombstones
from ddb2bt.pipeline.services.recover import cmd_recover
from ddb2bt.pipeline.services.rollback import (
    DEFAULT_MAX_LAG_S, cmd_rollback_prepare, cmd_rollback_run, cmd_rollback_status, cmd_rollback_verify,
)
from ddb2bt.pipeline.services.replicate import cmd_backfill, cmd_migrate, cmd_run
from ddb2bt.pipeline.services.mappings import (
    EXIT_DEAD_LETTER, cmd_create_table, cmd_draft, cmd_explain, cmd_lint, cmd_validate,
)
from ddb2bt.pipeline.observe.logs import JsonFormatter, setup_logging  # noqa: F401
from ddb2bt.pipeline.options import (METRICS_OFF, MAX_AUTO_PARTITIONS, SHARDS_PER_PARTITION, option_strings, check_beam_args, misspelt_options,
                                     describe_failure, joined_beam_args, number, options_by_command, partitions_arg)

# Scan option bounds: DynamoDB takes at most 1,000,000 segments; the service caps
# a page at 1 MB anyway, so a larger item limit would only cost memory.
MAX_TOTAL_SEGMENTS = 1_000_000
MAX_SCAN_PAGE = 10_000
DID_YOU_MEAN_CUTOFF = 0.6  # difflib's default ratio: "verfy" ~ "verify", "lst" ~ "list"

log = logging.getLogger("ddb2bt")

EPILOG = """\
examples:
  ddb2bt demo                                    # everything local: emulators, writes, replication
  ddb2bt local up --detach && eval "$(ddb2bt local env)"
  ddb2bt create-table --mapping example:product_catalog
  ddb2bt run --mapping example:product_catalog --until-idle 5
  ddb2bt dlq list --mapping example:product_catalog
  ddb2bt run --mapping m.yaml --runner=DataflowRunner --project=P --region=R --temp_location=gs://b/tmp
"""


# --- shared options --------------------------------------------------------------


def add_mapping_args(p: argparse.ArgumentParser, required: bool = True, several: bool = True) -> None:
    p.add_argument("--mapping", "-m", required=required, metavar="FILE", action="append",
                   help="mapping file (YAML): source table, target table, and how items become rows; "
                        "example:NAME takes a packaged example (see 'ddb2bt examples'). " + (
                            "Repeat it, or give a directory of mapping files, for one job of several tables"
                            if several else "One mapping"))
    # Not --project: that is Beam's (the Dataflow job's project), passed through.
    p.add_argument("--bigtable-project", dest="project", metavar="PROJECT",
                   help="override the mapping's target.project")
    p.add_argument("--bigtable-instance", "--instance", dest="instance", metavar="INSTANCE",
                   help="override the mapping's target.instance")
    p.add_argument("--bigtable-table", "--table", dest="table", metavar="TABLE",
                   help="override the mapping's target.table (one mapping only)")


def add_state_args(p: argparse.ArgumentParser) -> None:
    from ddb2bt.pipeline.control.state import DEFAULT_STATE_TABLE

    p.add_argument("--state-table", default=DEFAULT_STATE_TABLE,
                   help="Bigtable table for checkpoints and dead letters, created on first use (default %(default)s)")
    p.add_argument("--state-app-profile", metavar="PROFILE",
                   help="app profile for the state table, the job lease, version claims and the backfill's "
                        "conditional rows: single-cluster routing with single-row transactions allowed. Needed on a "
                        "replicated (HA) instance whose data profile (target.app_profile) routes to any cluster, "
                        "which refuses CheckAndMutateRow (default: target.app_profile)")
    p.add_argument("--job-name", help="name under which state is kept (default: the mapping's name; one mapping "
                                      "only: with several, each table's state is kept under its mapping's name)")


def add_dlq_values_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dlq-include-values", action=argparse.BooleanOptionalAction, default=None,
                   help="store item images in dead letters (default: on for local runs, off on Dataflow, where "
                        "dead letters keep the keys and the stream position only; a redrive reads the images back "
                        "from the stream)")


def add_tail_args(p: argparse.ArgumentParser) -> None:
    """Options of the live tail (run and migrate)."""
    p.add_argument("--start", choices=("trim_horizon", "latest"), default="trim_horizon",
                   help="where shards without a checkpoint start on a fresh job (default %(default)s: the oldest "
                        "record kept); a job that has run starts them at the oldest record, and refuses latest")
    p.add_argument("--on-trimmed", choices=("fail", "restart"), default="fail",
                   help="if a checkpoint points at trimmed data (changes lost): stop (default) or restart "
                        "from the oldest record with a loud warning; a shard whose oldest record still held "
                        "predates the job's last sighting of its head lost nothing and goes on either way")
    p.add_argument("--until-idle", type=number(float, above=0), metavar="SECONDS",
                   help="stop once every shard has been at the stream head this long (tests, catch-up runs; "
                        "migrate: after the backfill, then phase LIVE)")
    p.add_argument("--poll-interval", type=number(float, above=0), default=DEFAULT_POLL_INTERVAL_S,
                   help="seconds between polls of an idle shard (default %(default)s: 4 GetRecords/s, "
                        "under the stream's 5/s per-shard limit)")
    p.add_argument("--discovery-interval", type=number(float, above=0), default=10.0, help="seconds between shard discoveries")
    p.add_argument("--partitions", type=partitions_arg, default=1, metavar="N|auto",
                   help="parallel readers; each owns a hash-partition of the shards (Dataflow: ~2 per worker). "
                        "auto: follow the stream's open shard count at launch (one partition per "
                        f"{SHARDS_PER_PARTITION} shards, at most {MAX_AUTO_PARTITIONS})")
    p.add_argument("--new-stream", action="store_true",
                   help="accept that the table's stream was replaced since the last run (changes in between "
                        "are lost; prefer a new backfill)")
    from ddb2bt.pipeline.source.kinesis_share import parse_share

    p.add_argument("--kinesis-share", type=parse_share, metavar="K/N",
                   help="Kinesis sources: this job's share of each shard's read budget (5 GetRecords/s, 2 MB/s, "
                        "shared by every reader of the stream), split between its tables on the stream "
                        "(default 1: all of it). Jobs reading one stream must add up to at most 1, e.g. 1/2 "
                        "each for two jobs; a start beyond the budget is refused")
    add_dlq_values_arg(p)


def add_ops_args(p: argparse.ArgumentParser) -> None:
    """One holder per job and give-up deadlines (run, migrate, backfill); see docs/operations.md."""
    from ddb2bt.pipeline.control.lease import DEFAULT_RENEW_S, DEFAULT_TTL_S
    from ddb2bt.pipeline.clients.retry import DEFAULT_DEADLINE_S

    g = p.add_argument_group("one running process per job, and deadlines")
    how = g.add_mutually_exclusive_group()
    how.add_argument("--take-over", action="store_true",
                     help="replace the process holding this job's lease: it stops before its next write, and this "
                          "one starts writing when the old lease expires (at most --lease-ttl)")
    how.add_argument("--standby", action="store_true",
                     help="if another process holds the job's lease, wait (applying nothing) and take over when "
                          "it stops or its lease expires")
    g.add_argument("--adopt-target", action="store_true",
                   help="make this job the owner of its target tables even if another job name owns them (that "
                        "job is retired or renamed; it must not write them any more). Without it, a target table "
                        "owned by another job is refused, naming it")
    g.add_argument("--lease-ttl", type=float, default=DEFAULT_TTL_S, metavar="SECONDS",
                   help="how long the lease outlives its last renewal: a crashed holder is replaced after it "
                        "(default %(default)s)")
    g.add_argument("--lease-renew", type=float, default=DEFAULT_RENEW_S, metavar="SECONDS",
                   help="seconds between lease renewals (default %(default)s; at most 3/8 of --lease-ttl)")
    g.add_argument("--bigtable-deadline", type=float, default=DEFAULT_DEADLINE_S, metavar="SECONDS",
                   help="give up on a Bigtable call failing with retryable errors after this long and stop "
                        "(default %(default)s)")
    g.add_argument("--dynamodb-deadline", type=float, default=DEFAULT_DEADLINE_S, metavar="SECONDS",
                   help="give up on a DynamoDB / Streams call failing with retryable errors (throttling, 5xx, "
                        "unreachable) after this long and stop (default %(default)s)")


def add_show_keys_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--show-keys", action="store_true",
                   help="show item keys and row keys in clear (default: redacted, as keys are often personal "
                        "data; the same for verify and dlq list)")


def add_metrics_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=number(int, minimum=METRICS_OFF, maximum=65535),
                   help=f"serve Prometheus /metrics on this port (0: a free port; {METRICS_OFF} or not given: off, "
                        "as for demo)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address for /metrics (default loopback)")
    p.add_argument("--metrics-pushgateway", metavar="URL",
                   help="push metrics to this Prometheus Pushgateway every 15 s, grouped by job and worker "
                        "(for Dataflow, whose workers cannot be scraped)")


# --- commands --------------------------------------------------------------------
# Each command's service is imported above (pipeline/services/, pipeline/app/local_commands.py):
# options in, its output and exit code out.


# --- parser ----------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse with "did you mean" for a mistyped choice (a command such as
    ``ddb2bt verfy``, ``dlq lst``, a --log-level); subcommand parsers are made
    of the same class."""

    _INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)$")

    def error(self, message: str):
        found = self._INVALID_CHOICE.search(message)
        if found:
            choices = re.findall(r"'([^']*)'", found.group(2))
            close = difflib.get_close_matches(found.group(1), choices, n=1, cutoff=DID_YOU_MEAN_CUTOFF)
            hint = f"did you mean '{close[0]}'?" if close else f"choose from {', '.join(choices)}"
            message = message[:found.start()] + f"invalid choice: '{found.group(1)}' ({hint})"
        super().error(message)


def _no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """Prefix matching off in every (sub)parser: `--segment 4` must not silently
    mean --segments (and an unknown prefix of ours must not reach Beam as ours)."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                _no_abbreviations(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ddb2bt", formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Replicate a live DynamoDB table into Cloud Bigtable (change data capture on Apache Beam).",
        epilog=EPILOG)
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    parser.add_argument("--log-format", default="text", choices=("text", "json"),
                        help="json: one JSON object per line, for log collectors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    raw = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("examples", help="list the example mappings that ship with ddb2bt, or copy them",
                       formatter_class=raw, description=(
                           "Lists the packaged example mappings (one per seed layout), each with a one-line description and its path. Any "
                           "--mapping option accepts example:NAME for one of them; --copy DIR copies them all "
                           "into DIR to edit."),
                       epilog="examples:\n  ddb2bt examples\n  ddb2bt explain -m example:product_catalog --item -\n"
                              "  ddb2bt examples --copy ./mappings")
    p.add_argument("--copy", metavar="DIR", help="copy every example into DIR (existing files are kept)")
    p.set_defaults(func=cmd_examples)

    p = sub.add_parser("demo", help="run everything locally: emulators, a changing table, live replication",
                       formatter_class=raw, description=(
                           "Starts cbtemulator and a local AWS emulator on 127.0.0.1 ($DDB2BT_LOCAL_DYNAMODB: "
                           f"{' or '.join(LOCAL_DYNAMODB_EMULATORS)}, default {LOCAL_DYNAMODB_DEFAULT}), creates the "
                           "ProductCatalog table with a stream, writes a realistic stream of changes while the pipeline replicates them on "
                           "the local runner, shows progress and lag, and ends with a summary and a row read "
                           "back from Bigtable. Needs no cloud account."),
                       epilog="examples:\n  ddb2bt demo --changes 2000 --rate 300\n  ddb2bt demo --kinesis")
    p.add_argument("--changes", type=number(int, minimum=1), default=1500, help="changes to write (default %(default)s)")
    p.add_argument("--items", type=number(int, minimum=1), default=300, help="distinct products (default %(default)s)")
    p.add_argument("--rate", type=number(float, above=0), default=250.0, help="target writes per second (default %(default)s)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--metrics-port", type=number(int, minimum=METRICS_OFF, maximum=65535), default=0,
                   help=f"serve /metrics here (0: a free port; {METRICS_OFF}: off)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--kinesis", action="store_true",
                   help="read the changes from a Kinesis data stream of several shards instead (records "
                        "shuffled, some twice, as Kinesis may deliver them), through the ordering guard "
                        "(docs/kinesis.md)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("validate", help="check a mapping file", formatter_class=raw, description=(
                           "Reads each mapping file to its end and lists every problem at once, each with its field "
                           "path and the name or value probably meant (did you mean …?). A row-key or index-key "
                           "placeholder that is neither a key attribute nor named in the mapping is an error: "
                           "every item would be a dead letter, or the index would stay empty."),
                       epilog="examples:\n  ddb2bt validate --mapping example:product_catalog\n"
                              "  ddb2bt validate --mapping mappings/        # every file of a directory")
    add_mapping_args(p)
    p.add_argument("--strict", action="store_true", help="warnings fail (exit 1); notes never do. Errors always "
                                                          "fail (exit 2): every one of every file, in one run")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("explain", help="show the row key and cells a mapping produces for an item",
                       formatter_class=raw,
                       epilog="example:\n  echo '{\"pk\":\"hats\",\"sk\":\"fedoras#brandA\",\"Price\":30}' | "
                              "ddb2bt explain -m example:product_catalog --item -\n"
                              f"exit code: 0 every change maps (or is skipped), {EXIT_DEAD_LETTER} at least one "
                              "would be a dead letter, 1 an input DynamoDB would refuse, 2 a bad mapping")
    add_mapping_args(p, several=False)
    p.add_argument("--item", default=None,
                   help="a DynamoDB JSON item, {\"Item\": …} (GetItem output, export line), a stream record or "
                        "Lambda event, or a plain JSON item; a file or '-' for stdin (required without --reverse)")
    p.add_argument("--reverse", action="store_true",
                   help="the way back (ddb2bt rollback): which rules invert and why not; with --item, the item "
                        "mapped forward and read back from its row")
    p.add_argument("--timestamp-ms", type=number(int, minimum=0), default=1_700_000_000_000, help="change time to show")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("lint", help="check a mapping against Bigtable's rules and schema best practices",
                       formatter_class=raw, description=(
                           "Reports timestamp-first, sequential or low-cardinality-first keys (hotspots: an index "
                           "keyed status#{Status}#… puts every PENDING row in one range), placeholders the "
                           "mapping does not name, keys and qualifiers near the "
                           "limits, families whose GC would drop versions or that mix retention needs, "
                           "attributes that look like personal data in row keys, and — with --sample — items "
                           "that match no rule or cannot be mapped."),
                       epilog="examples:\n  ddb2bt lint -m example:hr_orders\n"
                              "  ddb2bt lint -m m.yaml --sample 1000 --strict\n"
                              "  ddb2bt lint -m mappings/            # every file of a directory, each on its own")
    add_mapping_args(p)
    p.add_argument("--sample", type=number(int, minimum=0), default=0, metavar="N", help="also check N items sampled across the table (as draft samples)")
    p.add_argument("--strict", action="store_true", help="exit 1 when there are warnings")
    p.set_defaults(func=cmd_lint)

    p = sub.add_parser("draft", help="draft a mapping and an assessment from a DynamoDB table and a sample of it",
                       formatter_class=raw, description=(
                           "Reads DescribeTable (keys, GSIs and LSIs, stream), DescribeTimeToLive, "
                           "DescribeContinuousBackups and a bounded parallel sample of items, and writes a commented "
                           "mapping that validate accepts and lint passes: row key pk#sk (another delimiter when key "
                           "values hold '#'; numeric sort keys zero-padded), one rule per entity type found from "
                           "key prefixes, encodings from the sampled types, index rows per GSI, TTL as replicated "
                           "deletions (no family max age). The header lists what was guessed and what you must "
                           "decide. Beside it, an assessment: sizes, hot-key candidates, stream and PITR, Bigtable "
                           "nodes and backfill workers. Exit 1 when nothing can be drafted (no table, no "
                           "permission, no items) or the table has no NEW_AND_OLD_IMAGES stream (the draft is "
                           "still written)."),
                       epilog="examples:\n  ddb2bt draft --table Orders --out orders.yaml --report orders-report.txt\n"
                              "  ddb2bt draft --table Orders --sample 5000 --max-rcu 200 > orders.yaml\n"
                              "  ddb2bt create-table -m orders.yaml --split-from-sample")
    p.add_argument("--table", dest="source_table", required=True, metavar="NAME", help="the DynamoDB table")
    p.add_argument("--region", help="its AWS region (default: the AWS SDK's configured region)")
    p.add_argument("--sample", type=number(int, minimum=1), default=1000, metavar="N",
                   help="items to sample, read by parallel Scan segments (default %(default)s)")
    p.add_argument("--max-rcu", type=number(float, above=0),
                   help="read budget of the sample in capacity units per second (default: unlimited)")
    p.add_argument("--out", metavar="FILE", help="write the mapping here (default: standard output, the "
                                                  "assessment then goes to standard error)")
    p.add_argument("--report", metavar="FILE", help="also write the assessment here")
    p.add_argument("--bigtable-project", dest="project", metavar="PROJECT",
                   help="target.project of the draft (default: $GOOGLE_CLOUD_PROJECT, else my-project)")
    p.add_argument("--bigtable-instance", dest="instance", metavar="INSTANCE",
                   help="target.instance of the draft (default my-instance)")
    p.add_argument("--bigtable-table", dest="table", metavar="TABLE",
                   help="target.table of the draft (default: the DynamoDB table's name in snake case)")
    p.set_defaults(func=cmd_draft)

    p = sub.add_parser("create-table", help="create or update the Bigtable table (and the state table)",
                       formatter_class=raw, description=(
                           "Idempotent: creates the target table with the mapping's families and GC policies, "
                           "adds missing families, updates changed GC policies, and creates the state table. "
                           "--split-from-sample pre-splits a new target table at quantiles of the row keys of a "
                           "sample of the source table spread over its key space, every range the mapping writes "
                           "(main rows, each index's rows) starting at a split point of its own, so its backfill "
                           "does not start on one tablet."),
                       epilog="examples:\n  ddb2bt create-table --mapping example:product_catalog\n"
                              "  ddb2bt create-table --mapping m.yaml --split-from-sample --sample 5000")
    add_mapping_args(p)
    add_state_args(p)
    p.add_argument("--split-from-sample", action="store_true",
                   help="pre-split a target table created now at split points from a sample of the source")
    p.add_argument("--sample", type=number(int, minimum=1), default=1000, metavar="N",
                   help="with --split-from-sample: items to sample (default %(default)s)")
    p.add_argument("--max-rcu", type=number(float, above=0),
                   help="with --split-from-sample: the sample's read budget in capacity units per second")
    p.add_argument("--change-stream", type=number(int, minimum=1), nargs="?", const=CHANGE_STREAM_MIN_HOURS,
                   metavar="HOURS", help="turn the target table's change stream on (what the way back to DynamoDB "
                   f"reads), keeping changes HOURS ({CHANGE_STREAM_MIN_HOURS}-{CHANGE_STREAM_MAX_HOURS}; default "
                   f"{CHANGE_STREAM_MIN_HOURS}); the mapping's target.change_stream_retention_hours asks the same")
    p.set_defaults(func=cmd_create_table)

    def add_continuous_check_args(p) -> None:
        p.add_argument("--continuous-check", type=number(float, above=0), metavar="ITEMS_PER_S",
                       help="while the tail runs, compare this many items per second with their rows (after the tail "
                            "passed their last change); divergent items are counted (ddb2bt_verify_divergent_total), "
                            "logged with keys redacted and recorded as dead letters (reason divergent) for "
                            "`ddb2bt repair`. Where it stands is kept in the state table (a restart goes on from "
                            "there); nothing is checked while a migration is not LIVE. Locally a thread next to the "
                            "job; on Dataflow a branch of the job (its workers run it). Off by default")
        p.add_argument("--continuous-check-segments", type=number(int, minimum=1, maximum=MAX_TOTAL_SEGMENTS),
                       default=64, help="Scan segments one full pass of the continuous check walks, one at a time "
                                        "(default 64)")

    p = sub.add_parser("run", help="replicate the live stream (Beam job)", formatter_class=raw, description=(
        "Reads the source table's DynamoDB stream and applies every change to Bigtable. Resumes from the "
        "checkpoints in the state table when there are any. Unrecognised options go to Beam: locally the "
        "job uses the pure-Python FnApiRunner; pass --runner=DataflowRunner and the usual Dataflow options "
        "for production."),
        epilog="examples:\n  ddb2bt run -m example:product_catalog --until-idle 5\n"
               "  ddb2bt run -m m.yaml --metrics-port 9464\n"
               "  ddb2bt run -m m.yaml --runner=DataflowRunner --project=P --region=us-central1 "
               "--temp_location=gs://bucket/tmp")
    add_mapping_args(p)
    add_state_args(p)
    add_tail_args(p)
    add_metrics_args(p)
    add_ops_args(p)
    add_continuous_check_args(p)
    p.set_defaults(func=cmd_run, beam=True)

    def add_backfill_args(p) -> None:
        p.add_argument("--segments", type=number(int, minimum=1, maximum=MAX_TOTAL_SEGMENTS), default=8,
                       help="parallel Scan segments (default %(default)s)")
        p.add_argument("--tasks", type=number(int, minimum=1), default=1,
                       help="Beam elements the parts are spread over (Dataflow: about the worker count)")
        p.add_argument("--max-rcu", type=number(float, above=0), help="read budget in capacity units per second (whole job)")
        p.add_argument("--consistent-read", action=argparse.BooleanOptionalAction, default=True,
                       help="strongly consistent Scan (the default; 2x the RCUs of an eventually consistent one). "
                            "--no-consistent-read: cheaper, but the Scan may miss a delete made just before the "
                            "handoff and bring the item back (docs/design.md 6.6): verify after")
        p.add_argument("--page-size", type=number(int, minimum=1, maximum=MAX_SCAN_PAGE), default=1000,
                       help="items per Scan page (smaller: finer resume points and a smoother read budget)")
        p.add_argument("--from-export", metavar="DIR_OR_S3",
                       help="back-fill from a DynamoDB export (the directory or s3://bucket/prefix holding "
                            "manifest-summary.json); its ExportTime is the handoff time")
        p.add_argument("--restart", action="store_true",
                       help="begin a new backfill (new handoff time) instead of resuming the one in progress, "
                            "from any phase; on a table migrated before, a re-copy: rows and cells of items that "
                            "no longer exist are removed after the backfill (local runner)")

    p = sub.add_parser("backfill", help="copy the existing table (parallel Scan or an export)", formatter_class=raw,
                       description=(
                           "Copies every item through the mapping with cells one millisecond older than the "
                           "handoff second, so changes streamed after it always win. Resumes per segment/file. "
                           "Run the live tail alongside (ddb2bt run), or use ddb2bt migrate for both."),
                       epilog="examples:\n  ddb2bt backfill -m m.yaml --segments 16 --max-rcu 2000\n"
                              "  ddb2bt backfill -m m.yaml --from-export s3://bucket/AWSDynamoDB/01234-abcd/")
    add_mapping_args(p)
    add_state_args(p)
    add_backfill_args(p)
    add_dlq_values_arg(p)
    add_metrics_args(p)
    add_ops_args(p)
    p.set_defaults(func=cmd_backfill, beam=True)

    p = sub.add_parser("migrate", help="the whole cutover: live tail + backfill + catch-up, resumable",
                       formatter_class=raw, description=(
                           "Starts the live tail, records the handoff time, back-fills alongside, and keeps "
                           "tailing. Phases BACKFILLING → CATCHING_UP → LIVE are stored in the state table "
                           "(ddb2bt status shows them); rerun the same command after a stop or crash and every "
                           "part resumes where it stopped."),
                       epilog="examples:\n  ddb2bt migrate -m m.yaml --segments 16 --metrics-port 9464\n"
                              "  ddb2bt migrate -m m.yaml --until-idle 5     # tests: stop once caught up")
    add_mapping_args(p)
    add_state_args(p)
    add_backfill_args(p)
    add_tail_args(p)
    add_metrics_args(p)
    add_ops_args(p)
    add_continuous_check_args(p)
    p.set_defaults(func=cmd_migrate, beam=True)

    p = sub.add_parser("verify", help="prove Bigtable equals the mapping of the DynamoDB table", formatter_class=raw,
                       description=(
                           "Reads the source (parallel Scan) and the target and reports missing rows, extra "
                           "rows, missing cells, cells no item owns (orphans) and differing cells, with a few "
                           "examples (keys redacted unless --show-keys, values unless --show-values). Exit code 0 only when "
                           "identical."),
                       epilog="examples:\n  ddb2bt verify -m m.yaml --report verify.json\n"
                              "  ddb2bt verify -m m.yaml --sample-rate 0.01   # 1% of the rows, by row-key hash\n"
                              "  ddb2bt verify -m m.yaml --report gs://b/verify.json --runner DataflowRunner "
                              "--project p --region r --temp_location gs://b/tmp   # a Beam job")
    add_mapping_args(p)
    add_state_args(p)
    p.add_argument("--segments", type=number(int, minimum=1, maximum=MAX_TOTAL_SEGMENTS), default=8,
                   help="parallel Scan segments")
    p.add_argument("--sample-rate", type=number(float, above=0, maximum=1), default=1.0, help="fraction of target rows to check, each against every item mapping into it (default: all)")
    p.add_argument("--show-values", action="store_true", help="show cell values in examples (keys too)")
    add_show_keys_arg(p)
    p.add_argument("--eventually-consistent", action="store_true", help="cheaper, eventually consistent Scan")
    p.add_argument("--max-rcu", type=number(float, above=0),
                   help="read budget of the Scan in capacity units per second (default: unpaced)")
    p.add_argument("--report", metavar="FILE.json", help="write the machine-readable report here")
    p.add_argument("--recheck-wait", type=number(float, minimum=0), default=300.0, metavar="SECONDS",
                   help="re-check each difference once the live tail has applied every change up to then "
                        "(items changed while verify ran are not differences); wait at most this long for the "
                        "tail; 0: report differences as first seen (default: 300)")
    p.add_argument("--spill-dir", metavar="DIR", help="where the comparison's hash buckets are spilled "
                                                      "(default: the system temporary directory)")
    p.add_argument("--from-export", metavar="DIR_OR_S3",
                   help="read the source from a DynamoDB export instead of a Scan (no RCUs); runs verify as a "
                        "Beam job. Compare against a target that holds exactly the export's state")
    p.set_defaults(func=cmd_verify, beam=True, checkpoints=False)  # a Beam job that checkpoints nothing

    p = sub.add_parser("status", help="phase, lag, backfill progress, READY / NOT READY for cutover",
                       formatter_class=raw,
                       epilog="examples:\n  ddb2bt status -m m.yaml\n  ddb2bt status -m m.yaml --json\n"
                              "exit code: 0 READY, 1 NOT READY")
    add_mapping_args(p)
    add_state_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("recover", help="recover a job whose stream checkpoint was trimmed, from incremental exports",
                       formatter_class=raw, description=(
                           "A job down for more than the stream's 24 hours finds its checkpoint trimmed. Without "
                           "--from-export: says which changes are missing (from the last applied change to the "
                           "oldest record the stream holds) and prints the `aws dynamodb "
                           "export-table-to-point-in-time` commands for them (point-in-time recovery must be "
                           "enabled). With the finished exports: applies them (resumable per data file), sweeps the "
                           "target for cells a lost change would have deleted (an item changed just before and "
                           "just after its shard stopped), and sets the trimmed shards to resume at the stream's oldest record; then start the tail "
                           "(ddb2bt run). See docs/recover.md."),
                       epilog="examples:\n  ddb2bt recover -m m.yaml --s3-bucket my-exports\n"
                              "  ddb2bt recover -m m.yaml --from-export s3://my-exports/AWSDynamoDB/01700000000000-a1b2c3d4 "
                              "--from-export s3://my-exports/AWSDynamoDB/01700086400000-b2c3d4e5")
    add_mapping_args(p, several=False)
    add_state_args(p)
    p.add_argument("--from-export", action="append", metavar="DIR_OR_S3",
                   help="a COMPLETED incremental export (the directory or s3://bucket/prefix/AWSDynamoDB/<ExportId> "
                        "holding manifest-summary.json); repeat it for every window")
    p.add_argument("--s3-bucket", help="the bucket to put in the printed export commands")
    p.add_argument("--s3-prefix", help="the S3 prefix to put in the printed export commands")
    p.add_argument("--accept-inexact", action="store_true",
                   help="apply even when the mapping has a feature final images cannot restore exactly (named "
                        "before anything is written)")
    add_metrics_args(p)
    add_ops_args(p)
    p.set_defaults(func=cmd_recover)

    p = sub.add_parser("rollback", help="the way back after a cutover: Bigtable's changes written back to DynamoDB",
                       formatter_class=raw, description=(
                           "After the cutover the application writes to Bigtable. `rollback run` stops the forward "
                           "replication for good (it takes the forward tail's lease; the job becomes CUT_OVER) and "
                           "writes every Bigtable change since the cutover back to DynamoDB, as whole items, each "
                           "conditional on the version it replaces. `status` says READY to switch back; `verify` "
                           "compares DynamoDB with Bigtable. See docs/rollback.md."),
                       epilog="examples:\n  ddb2bt rollback prepare -m m.yaml\n  ddb2bt rollback run -m m.yaml --until-idle 10\n"
                              "  ddb2bt rollback status -m m.yaml\n  ddb2bt rollback verify -m m.yaml")
    rsub = p.add_subparsers(dest="rollback_cmd", required=True)
    pp = rsub.add_parser("prepare", help="before the cutover: turn on the target table's change stream")
    add_mapping_args(pp, several=False)
    pp.add_argument("--retention-hours", type=number(float, minimum=CHANGE_STREAM_MIN_HOURS,
                                                     maximum=CHANGE_STREAM_MAX_HOURS),
                    default=float(CHANGE_STREAM_MAX_HOURS), metavar="HOURS",
                    help=f"how long Bigtable keeps the changes ({CHANGE_STREAM_MIN_HOURS} to {CHANGE_STREAM_MAX_HOURS}; "
                         "default %(default)s): a switch back "
                         "decided later than this after the cutover cannot be written back from the stream")
    pp.set_defaults(func=cmd_rollback_prepare)
    pr = rsub.add_parser("run", help="write Bigtable's changes since the cutover back to DynamoDB")
    add_mapping_args(pr, several=False)
    add_state_args(pr)
    pr.add_argument("--until-idle", type=number(float, above=0), default=5.0, metavar="SECONDS",
                    help="end a pass over the change stream once no change arrived for this long (default "
                         "%(default)s)")
    pr.add_argument("--follow", action="store_true",
                    help="keep following the change stream, pass after pass, until stopped (Ctrl-C, SIGTERM): the "
                         "way back kept current from the cutover on")
    pr.add_argument("--full", action="store_true",
                    help="write every row back and delete every item whose row is gone (the whole table, not the "
                         "change stream): DynamoDB made equal to the inverse of Bigtable")
    pr.add_argument("--max-wcu", type=number(float, above=0), metavar="UNITS",
                    help="at most this many DynamoDB write capacity units per second (default: no limit)")
    pr.add_argument("--versions-table", metavar="TABLE",
                    help="the DynamoDB table keeping each written item's version (default: <source table>"
                         ".ddb2bt-rollback, created on first use)")
    add_show_keys_arg(pr)
    add_metrics_args(pr)
    add_ops_args(pr)
    pr.set_defaults(func=cmd_rollback_run)
    ps = rsub.add_parser("status", help="READY to switch back to DynamoDB, or why not")
    add_mapping_args(ps, several=False)
    add_state_args(ps)
    ps.add_argument("--max-lag", type=number(float, above=0), default=DEFAULT_MAX_LAG_S, metavar="SECONDS",
                    help="READY only when every change older than this is written back (default %(default)s)")
    ps.set_defaults(func=cmd_rollback_status)
    pv = rsub.add_parser("verify", help="compare DynamoDB with the inverse of Bigtable: IDENTICAL or not")
    add_mapping_args(pv, several=False)
    add_show_keys_arg(pv)
    pv.add_argument("--verbose", action="store_true", help="also say rule by rule what inverts")
    pv.set_defaults(func=cmd_rollback_verify)

    p = sub.add_parser("dlq", help="inspect dead letters", formatter_class=raw,
                       epilog="examples:\n  ddb2bt dlq list -m example:product_catalog\n"
                              "  ddb2bt dlq list -m m.yaml --reason row_key_too_long --json\n"
                              "  ddb2bt dlq show -m m.yaml 1700000000123#ab12cd34ef56\n"
                              "  ddb2bt dlq redrive -m m.yaml --reason unknown_family")
    dsub = p.add_subparsers(dest="dlq_cmd", required=True)
    pl = dsub.add_parser("list", help="list dead letters with their reasons")
    add_mapping_args(pl)
    add_state_args(pl)
    pl.add_argument("--reason", help="only this reason (e.g. unknown_family)")
    pl.add_argument("--since", type=number(float, minimum=0), help="only those at or after this Unix time (seconds)")
    pl.add_argument("--limit", type=number(int, minimum=1), default=50)
    pl.add_argument("--json", action="store_true", help="one JSON object per line (the stored record in full, "
                                                         "like dlq show)")
    add_show_keys_arg(pl)
    pl.set_defaults(func=cmd_dlq_list)
    ps = dsub.add_parser("show", help="one dead letter in full (the original record included)")
    add_mapping_args(ps)
    add_state_args(ps)
    ps.add_argument("id", help="the id printed by dlq list --json")
    ps.set_defaults(func=cmd_dlq_show)
    pr = dsub.add_parser("redrive", help="resolve dead letters once the cause is fixed (e.g. the mapping)",
                         description="For each item with dead letters: re-reads the item from DynamoDB "
                                     "(consistent GetItem) and writes its CURRENT state with the current mapping, "
                                     "removing the cells its stored images owned and it no longer does (nothing "
                                     "if the item is gone). A stored change is never re-applied, so a later "
                                     "delete or attribute removal stays applied. Resolved dead letters are "
                                     "removed, the others kept. Idempotent; safe with the tail running.")
    add_mapping_args(pr)
    add_state_args(pr)
    pr.add_argument("--reason", help="only this reason")
    pr.add_argument("--since", type=number(float, minimum=0), help="only those at or after this Unix time (seconds)")
    pr.add_argument("--dry-run", action="store_true", help="only report which dead letters now map; write nothing")
    pr.set_defaults(func=cmd_dlq_redrive)

    p = sub.add_parser("release-target", help="a retired job gives up its target tables (see --adopt-target)",
                       formatter_class=raw, description=(
                           "Each target table is owned by one job (its name: the mapping's, or --job-name): a "
                           "run, migrate or backfill under another job name is refused. Once a job is retired "
                           "(stopped for good), this frees its tables for another job name."),
                       epilog="example:\n  ddb2bt release-target -m m.yaml --job-name old-name")
    add_mapping_args(p)
    add_state_args(p)
    p.set_defaults(func=cmd_release_target)
    p = sub.add_parser("repair", help="rewrite items the continuous check found divergent, in their current state",
                       formatter_class=raw,
                       description="The redrive of the dead letters of reason 'divergent' (see dlq redrive): each "
                                   "item re-read from DynamoDB and written in its CURRENT state through the same "
                                   "path; safe with the tail running.",
                       epilog="examples:\n  ddb2bt dlq list -m m.yaml --reason divergent\n  ddb2bt repair -m m.yaml")
    add_mapping_args(p)
    add_state_args(p)
    p.add_argument("--dry-run", action="store_true", help="only report what would be rewritten")
    p.set_defaults(func=cmd_repair)

    p = sub.add_parser("sweep-tombstones", help="remove a Kinesis job's tombstones (deleted items' clocks) that "
                                                "no record can need any more", formatter_class=raw,
                       description=(
                           "With a Kinesis source, a deleted item leaves its clock cell in each row it had: the "
                           "tombstone that keeps a late, older change from bringing it back. Once a tombstone is "
                           "older than the stream's retention plus a margin, no such change can arrive: this "
                           "removes it (a compare-and-swap: a tombstone whose item came back meanwhile is kept). "
                           "Safe with the job running; run it daily, e.g. from cron."),
                       epilog="examples:\n  ddb2bt sweep-tombstones -m m.yaml --dry-run\n"
                              "  ddb2bt sweep-tombstones -m m.yaml --keep-hours 720")
    add_mapping_args(p)
    add_state_args(p)
    p.add_argument("--keep-hours", type=number(float, above=0), metavar="HOURS",
                   help="keep tombstones this long after their delete (default: the Kinesis stream's retention "
                        "+ 24 h); refused below the stream's retention + 1 h (the oldest "
                        "record the reader accepts)")
    p.add_argument("--dry-run", action="store_true", help="only count the tombstones that would be removed")
    p.set_defaults(func=cmd_sweep_tombstones)

    p = sub.add_parser("local", help="the local emulator stack (cbtemulator + moto or ministack)", formatter_class=raw,
                       epilog="examples:\n  ddb2bt local up              # foreground, Ctrl-C stops\n"
                              "  ddb2bt local up --detach && eval \"$(ddb2bt local env)\"\n"
                              "  ddb2bt local up --dynamodb ministack   # the other AWS emulator\n"
                              "  ddb2bt local up --change-streams       # Bigtable change streams (rollback)\n"
                              "  ddb2bt local run -- pytest tests/e2e\n  ddb2bt local down")
    lsub = p.add_subparsers(dest="local_cmd", required=True)
    up = lsub.add_parser("up", help="start both servers on free 127.0.0.1 ports")
    up.add_argument("--detach", action="store_true", help="keep running in the background (over a half-down stack: "
                                                          "start its dead server again on its port)")
    lsub.add_parser("env", help="print export lines for a detached stack (none running, or half down: says how to "
                                "start it, exits 1 and makes eval fail)")
    lsub.add_parser("down", help="stop a detached stack")
    run = lsub.add_parser("run", help="start the stack, run a command with its variables, stop it")
    for command in (up, run):
        command.add_argument("--dynamodb", choices=LOCAL_DYNAMODB_EMULATORS, default=None,
                             help="the AWS emulator (DynamoDB, Streams, S3, Kinesis) to start: moto or ministack, "
                                  "two independent implementations; ministack is closer to AWS on streams "
                                  "(whole-second record times, trimming, iterator expiry, 1 MB pages). "
                                  f"Default: ${LOCAL_DYNAMODB_ENV}, else {LOCAL_DYNAMODB_DEFAULT}")
        command.add_argument("--change-streams", action="store_true",
                             help="put the test change-stream server in front of cbtemulator (which has none), "
                                  "so tables created with a change stream can be read back: the rollback's "
                                  "rehearsal (docs/development.md)")
    run.add_argument("command", nargs=argparse.REMAINDER)
    # Rehearsing a recovery on the local stack (docs/recover.md, "Rehearse it locally").
    ch = lsub.add_parser("changes", formatter_class=raw, help="write changes to a mapping's source table on the "
                         "local stack (created with a stream and point-in-time recovery when missing)",
                         epilog="example:\n  ddb2bt local changes -m example:product_catalog --changes 300")
    add_mapping_args(ch, several=False)
    ch.add_argument("--changes", type=number(int, minimum=1), default=300, help="changes to write (default %(default)s)")
    ch.add_argument("--items", type=number(int, minimum=1), default=100, help="distinct items (default %(default)s)")
    ch.add_argument("--seed", type=int, help="repeat a run's changes (default: new ones each time)")
    tr = lsub.add_parser("trim", formatter_class=raw, help="make the local stream forget every record it holds, as "
                         "24 hours of retention would: a stopped job's checkpoint is then trimmed",
                         epilog="example:\n  ddb2bt local trim -m example:product_catalog && eval \"$(ddb2bt local "
                                "env)\"")
    add_mapping_args(tr, several=False)
    add_state_args(tr)
    ex = lsub.add_parser("export-table-to-point-in-time", formatter_class=raw,
                         help="write an incremental export in AWS's layout to the local S3, from the local "
                              "stream: the commands `ddb2bt recover` prints, with `ddb2bt local` for `aws dynamodb`",
                         epilog="example:\n  ddb2bt local export-table-to-point-in-time --table-arn ARN --s3-bucket "
                                "rehearsal --export-format DYNAMODB_JSON --export-type INCREMENTAL_EXPORT "
                                "--incremental-export-specification ExportFromTime=S,ExportToTime=S,"
                                "ExportViewType=NEW_AND_OLD_IMAGES")
    ex.add_argument("--table-arn", required=True)
    ex.add_argument("--s3-bucket", required=True, help="created on the local S3 when missing")
    ex.add_argument("--s3-prefix")
    ex.add_argument("--export-format", default="DYNAMODB_JSON", choices=("DYNAMODB_JSON",))
    ex.add_argument("--export-type", default="INCREMENTAL_EXPORT", choices=("INCREMENTAL_EXPORT",))
    ex.add_argument("--incremental-export-specification", required=True, metavar="SPEC",
                    help="ExportFromTime=EPOCH_S,ExportToTime=EPOCH_S,ExportViewType=NEW_AND_OLD_IMAGES")
    p.set_defaults(func=cmd_local)
    _no_abbreviations(parser)
    return parser


RESUME_HINT = " (nothing after the last checkpoint was acknowledged; rerun to resume)"


def main(argv: Optional[list] = None, *, bigtable_interceptors: Sequence = ()) -> int:
    """The ``ddb2bt`` command. ``bigtable_interceptors`` (gRPC client interceptors for
    the Bigtable write channel) is for programs that embed the CLI, such as the
    fault-injection runner in ``ddb2bt.pipeline.testing``; the command line has no
    flag for it."""
    as_program = argv is None  # run as the ddb2bt program (not embedded with an argument list)
    if as_program:
        from ddb2bt.pipeline.signals import exit_quietly_on_interrupt

        exit_quietly_on_interrupt()
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    misspelt = misspelt_options(parser, argv)
    if misspelt:
        parser.error(misspelt)
    args, unknown = parser.parse_known_args(argv)
    own = option_strings(parser, args)
    elsewhere = options_by_command(parser) if unknown else {}
    if unknown and not getattr(args, "beam", False):
        parser.error(check_beam_args(unknown, own, beam=False, elsewhere=elsewhere)
                     or f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "beam", False):
        problem = check_beam_args(unknown, own, elsewhere=elsewhere)
        if problem:
            parser.error(problem)
    args.beam_args = joined_beam_args(unknown) if getattr(args, "beam", False) else unknown  # one spelling
    args.bigtable_interceptors = tuple(bigtable_interceptors)
    from ddb2bt.pipeline.dataflow import is_dry_run  # not graph: that imports Beam

    args.dry = is_dry_run(unknown)
    setup_logging(args.log_level, args.log_format)
    from ddb2bt.pipeline.connect.connections import honour_aws_region

    honour_aws_region()
    from ddb2bt.pipeline.signals import run_command
    from ddb2bt.pipeline.services.jobs import resume_command

    try:
        return run_command(lambda: args.func(args) or 0, enabled=getattr(args, "beam", False),
                           exit_when_interrupted=as_program, resume=resume_command(argv),
                           checkpoints=getattr(args, "checkpoints", True))
    except ConfigError as exc:
        print(f"ddb2bt: configuration error: {exc}", file=sys.stderr)
        return 2
    except PermanentError as exc:
        print(f"ddb2bt: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a job's command says what its checkpoints hold; another claims nothing
        job = getattr(args, "beam", False) and getattr(args, "checkpoints", True)
        print(INTERRUPTED if job else INTERRUPTED_NO_JOB, file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of our output went away (`ddb2bt dlq list | head`): not an error
        # worth a word. Point stdout at devnull so the interpreter's final flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:  # a pipeline failure (Beam may wrap ours): one clear line, the detail in the log
        log.debug("failure", exc_info=True)
        print(f"ddb2bt: error: {describe_failure(exc)}{RESUME_HINT if getattr(args, 'job_started', False) else ''} "
              "(--log-level DEBUG for details)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
