"""What a new user tripped over on the first day (issue 26, items 1-6), one test
per item: the placeholder warning logic, one summary for every writing command,
hints that keep the state-selecting options, target-table ownership, a table
name on every log line of a job, read-only commands bounded in time, and the
small ones (did-you-mean, no prefix matching, explain's exit code, one key
redaction policy, example descriptions, the local env hint, the hotspot lint,
plain progress lines off a terminal)."""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from ddb2bt.pipeline.app.cli import main
from ddb2bt.transforms.attrs import from_plain
from ddb2bt.transforms.config import mapping_from_text
from ddb2bt.transforms.errors import ConfigError
from ddb2bt.transforms.lint import lint, placeholder_findings

HEAD = ("source: {table: Orders, key: {partition: PK}}\n"
        "target: {project: p, instance: i, table: orders}\n")


def findings_of(text: str) -> list:
    return placeholder_findings(mapping_from_text(HEAD + text))


# --- 1. the placeholder warnings ------------------------------------------------------

def test_an_index_attribute_mapped_by_other_attributes_is_mapped_and_a_missing_one_means_no_index_row():
    found = findings_of("""
families: {d: {}, idx: {}}
rules:
  - row_key: "{PK}"
    other_attributes: {family: d}
    indexes: [{name: by_status, row_key: "{Status}#{OrderDate}#{PK}", family: idx}]
""")
    assert [f.level for f in found] == ["INFO", "INFO"]  # nothing to warn of
    assert all("no index row (the index is sparse)" in f.message for f in found)
    assert not any("dead letter" in f.message or "neither" in f.message for f in found)


def test_a_row_key_attribute_mapped_by_the_item_column_is_mapped_and_its_absence_is_a_dead_letter():
    found = findings_of("""
families: {d: {}}
rules:
  - row_key: "{UserId}#{PK}"
    item_column: {column: "d:item"}
    other_attributes: {mode: ignore}
""")
    (finding,) = found
    assert finding.level == "INFO" and "mapped through the item_column" in finding.message
    assert "no row key and will be a dead letter" in finding.message


def test_a_typo_is_an_error_even_with_other_attributes_but_a_merely_similar_name_is_a_note():
    # Changed on purpose (issue 35): a typo used to be a warning, and the mapping
    # loaded and dead-lettered every item; now it does not load.
    with pytest.raises(ConfigError) as err:
        findings_of("""
families: {d: {}, idx: {}}
rules:
  - row_key: "{PK}#{OrderIdd}"
    columns: {OrderId: {column: "d:id"}}
    other_attributes: {family: d}
    indexes: [{name: by_date, row_key: "{OrderDate}#{PK}", family: idx}]
""")
    assert str(err.value).startswith("rules[0].row_key: {OrderIdd} is named nowhere else")
    assert "did you mean {OrderId}?" in str(err.value) and "OrderDate" not in str(err.value)
    found = findings_of("""
families: {d: {}, idx: {}}
rules:
  - row_key: "{PK}#{OrderId}"
    columns: {OrderId: {column: "d:id"}}
    other_attributes: {family: d}
    indexes: [{name: by_date, row_key: "{OrderDate}#{PK}", family: idx}]
""")
    assert [(f.level, f.code) for f in found] == [("INFO", "placeholder_via_other")]  # OrderDate: not a typo


def test_without_any_catch_all_an_unknown_index_attribute_is_an_error_saying_the_index_stays_empty():
    unnamed = """
families: {d: {}, idx: {}}
rules:
  - row_key: "{PK}"
    other_attributes: {mode: ignore}
    indexes: [{name: by_status, row_key: "{Statuss}#{PK}", family: idx}]
"""
    with pytest.raises(ConfigError, match=r"rules\[0\]\.indexes\[0\]\.row_key: \{Statuss\} is neither a key "
                                          r"attribute nor named anywhere.*the index stays empty"):
        findings_of(unnamed)
    # A sparse index on an attribute items do carry says so, and loads.
    assert findings_of(unnamed.replace("family: idx}", "family: idx, match: {attribute: Statuss, present: true}}")) == []


# --- 2. one summary for every writing command ---------------------------------------

def test_the_summary_counts_per_table_and_the_total_comes_first_with_each_tables_hints():
    from ddb2bt.pipeline.services.jobs import outcome_since, outcome_snapshot, write_summary
    from ddb2bt.pipeline.observe.metrics import PipelineMetrics

    metrics = PipelineMetrics(CollectorRegistry())
    metrics.changes_applied.labels("orders", "INSERT").inc(3)
    before = outcome_snapshot(metrics)
    metrics.changes_applied.labels("orders", "INSERT").inc(5)
    metrics.changes_applied.labels("lines", "MODIFY").inc(2)
    metrics.dead_letters.labels("lines", "map", "encoding").inc()
    counts = outcome_since(before, ["orders", "lines"], metrics)
    assert counts == {"orders": {"applied": 5, "dead_lettered": 0, "skipped": 0},
                      "lines": {"applied": 2, "dead_lettered": 1, "skipped": 0}}
    args = SimpleNamespace(mapping=["o.yaml", "l.yaml"], project=None, instance="inst2", table=None,
                           state_table="st2", job_name=None)
    mappings = [SimpleNamespace(origin="o.yaml"), SimpleNamespace(origin="l.yaml")]
    states = [SimpleNamespace(job="orders"), SimpleNamespace(job="lines")]
    out = write_summary(args, counts, mappings, states).splitlines()
    assert out[0] == "done: 7 change(s) applied, 1 dead-lettered, 0 skipped (2 tables)"
    assert out[1] == "  orders: 5 change(s) applied, 0 dead-lettered, 0 skipped"
    assert out[2] == "  lines: 2 change(s) applied, 1 dead-lettered, 0 skipped"
    assert "ddb2bt dlq list --mapping l.yaml --bigtable-instance inst2 --state-table st2" in out[3]
    assert len(out) == 5  # the redrive hint; none for the table without dead letters


def test_dlq_redrive_ends_with_the_same_summary_and_hints_with_the_state_options(monkeypatch, capsys):
    import ddb2bt.pipeline.recover.redrive as redrive
    import ddb2bt.pipeline.services.dead_letters as dead_letters  # the dlq commands' service

    monkeypatch.setattr(dead_letters, "state_spec", lambda args, mapping, *a: SimpleNamespace(
        job=args.job_name, store=lambda: "store"))
    monkeypatch.setattr(dead_letters, "Migration", lambda store: SimpleNamespace(phase="LIVE"))
    monkeypatch.setattr(redrive, "redrive_job", lambda *a: redrive.RedriveResult(items=3, resolved=2,
                                                                                  still_failing=1))
    assert main(["dlq", "redrive", "-m", "example:product_catalog", "--job-name", "shpo"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "done: 2 change(s) applied, 1 dead-lettered, 0 skipped"
    assert out[2].endswith("ddb2bt dlq list --mapping example:product_catalog --job-name shpo")


# --- 3. hints keep the state; one job per target table -------------------------------

def test_hints_carry_every_state_selecting_option_quoted():
    from ddb2bt.pipeline.services.jobs import mapping_flags

    args = SimpleNamespace(mapping=["my shop.yaml"], project="proj", instance="inst", table="t2",
                           state_table="ddb2bt_state", job_name="shpo")
    assert mapping_flags(args) == ("--mapping 'my shop.yaml' --bigtable-project proj --bigtable-instance inst "
                                   "--bigtable-table t2 --job-name shpo")  # the default state table left out


def _ownership(fake):
    from ddb2bt.pipeline.control.ownership import TargetOwnership

    return TargetOwnership(fake, "ddb2bt_state", "p", "i", now_ms=lambda: 1_700_000_000_000)


def test_a_target_table_is_owned_by_one_job_and_a_second_job_is_refused_naming_the_owner():
    from ddb2bt.pipeline.control.ownership import TargetOwned
    from ddb2bt.pipeline.testing.fakes import InMemoryBigtable

    fake = InMemoryBigtable()
    owners = _ownership(fake)
    assert owners.claim("orders", "shop", "run") == b""  # free: now owned
    assert owners.claim("orders", "shop", "migrate") is None  # the same job again: fine
    with pytest.raises(TargetOwned) as refused:
        owners.claim("orders", "shpo", "run")
    assert "owned by job 'shop'" in str(refused.value) and "--job-name shop" in str(refused.value)
    assert "--adopt-target" in str(refused.value)
    owners.claim("orders", "shpo", "run", adopt=True)  # told otherwise: the owner changes
    assert owners.owner("orders").job == "shpo"
    assert owners.release("orders", "shop") is False and owners.release("orders", "shpo") is True
    assert owners.owner("orders") is None
    assert owners.claim("orders", "shop", "run") is not None  # free again


def test_claims_of_a_multi_table_job_are_all_or_none():
    from ddb2bt.pipeline.control.ownership import TargetOwned, claim_targets
    from ddb2bt.pipeline.testing.fakes import InMemoryBigtable

    fake = InMemoryBigtable()
    _ownership(fake).claim("lines", "other", "run")
    mappings = [SimpleNamespace(target=SimpleNamespace(project="p", instance="i"), tables=("orders",)),
                SimpleNamespace(target=SimpleNamespace(project="p", instance="i"), tables=("lines",))]
    states = [SimpleNamespace(job="orders_job", table="ddb2bt_state"),
              SimpleNamespace(job="lines_job", table="ddb2bt_state")]
    with pytest.raises(TargetOwned):
        claim_targets(mappings, states, command="run", make_writer=lambda state: fake)
    assert _ownership(fake).owner("orders") is None  # the first claim was given back
    assert _ownership(fake).owner("lines").job == "other"


# --- 4. every log line of a table names it -------------------------------------------

def test_phase_lines_name_their_table_in_text_and_json(caplog):
    from ddb2bt.pipeline.control.phases import BACKFILLING, Migration
    from ddb2bt.pipeline.observe.logs import JsonFormatter
    from ddb2bt.pipeline.control.state import StateStore
    from ddb2bt.pipeline.testing.fakes import InMemoryBigtable

    store = StateStore(InMemoryBigtable(), "orders", lambda: 5)
    with caplog.at_level(logging.INFO):
        Migration(store).transition(BACKFILLING)
    (record,) = [r for r in caplog.records if "migration phase" in r.getMessage()]
    assert record.getMessage() == "[orders] migration phase: BACKFILLING"
    assert json.loads(JsonFormatter().format(record))["table"] == "orders"


# --- 5. read-only commands are bounded ------------------------------------------------

def test_probes_run_side_by_side_under_one_budget_and_name_what_did_not_answer():
    from ddb2bt.pipeline.connect.reachability import ServiceUnreachable, check_reachable

    release = threading.Event()
    try:
        with pytest.raises(ServiceUnreachable) as failed:
            check_reachable([], budget_s=0.5, probes={"Bigtable (emulator x)": release.wait,
                                                        "DynamoDB table T (y)": release.wait})
        assert "Bigtable (emulator x): no answer within 0.5s" in str(failed.value)
        assert "DynamoDB table T (y): no answer within 0.5s" in str(failed.value)
        # status can go on without the source: only Bigtable is required then
        reach = check_reachable([], dynamodb="optional", budget_s=0.5,
                                probes={"Bigtable (x)": lambda: None, "DynamoDB table T (y)": release.wait})
        assert not reach.dynamodb_ok and list(reach.problems) == ["DynamoDB table T (y)"]
    finally:
        release.set()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_status_against_a_stopped_stack_fails_naming_both_services(monkeypatch, capsys):
    """Both endpoints point at closed ports (a stopped local stack). The budget is
    shortened for the test; the default (20 s) is what keeps status within ~30 s."""
    import ddb2bt.pipeline.connect.reachability as reachability

    monkeypatch.setenv("BIGTABLE_EMULATOR_HOST", f"127.0.0.1:{_closed_port()}")
    # A `stack` fixture earlier in this worker left per-service endpoints (they win
    # over AWS_ENDPOINT_URL): point every one of them at the closed port too.
    closed_aws = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed_aws)
    for name in [n for n in os.environ if n.startswith("AWS_ENDPOINT_URL_")]:
        monkeypatch.setenv(name, closed_aws)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setattr(reachability, "READ_ONLY_BUDGET_S", 1.0)
    assert main(["status", "-m", "example:product_catalog"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach Bigtable (emulator 127.0.0.1:" in err and "DynamoDB table ProductCatalog" in err
    assert main(["dlq", "list", "-m", "example:product_catalog"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]  # (earlier probes may still be logging)
    assert "cannot reach Bigtable" in last and "DynamoDB" not in last  # dlq list needs only the state


# --- 6. the smaller ones --------------------------------------------------------------

def test_a_misspelt_command_or_subcommand_gets_did_you_mean(capsys):
    for argv, hint in ((["verfy"], "did you mean 'verify'?"), (["dlq", "lst"], "did you mean 'list'?")):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2 and hint in capsys.readouterr().err


def test_no_prefix_matching_of_options_anywhere(capsys):
    from ddb2bt.pipeline.app.cli import build_parser

    import argparse

    def parsers(p):
        yield p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    assert all(p.allow_abbrev is False for p in parsers(build_parser()))
    with pytest.raises(SystemExit):
        main(["backfill", "-m", "example:product_catalog", "--segment", "4"])
    assert "--segment (did you mean --segments?)" in capsys.readouterr().err


def test_a_misspelt_nested_key_gets_did_you_mean():
    with pytest.raises(ConfigError) as bad:
        mapping_from_text(HEAD + "families: {d: {}}\nrules:\n  - row_key: '{PK}'\n"
                                 "    other_attributes: {familly: d}\n")
    assert "rules[0].other_attributes.family" in str(bad.value) and "did you mean 'family'?" in str(bad.value)


def test_explain_exits_3_when_the_item_would_be_a_dead_letter(monkeypatch, capsys):
    import io

    from ddb2bt.pipeline.app.cli import EXIT_DEAD_LETTER

    monkeypatch.setattr(sys, "stdin", io.StringIO('{"pk": "hats", "sk": "x", "Price": 2.5}'))
    assert main(["explain", "-m", "example:product_catalog", "--item", "-"]) == EXIT_DEAD_LETTER == 3
    assert "dead letter [" in capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"pk": "hats", "sk": "x", "Price": 2}'))
    assert main(["explain", "-m", "example:product_catalog", "--item", "-"]) == 0


def test_verify_redacts_keys_and_row_keys_like_dlq_list_unless_show_keys():
    from ddb2bt.pipeline.verify.compare import LayoutDiff
    from ddb2bt.pipeline.verify.verify import Findings
    from ddb2bt.pipeline.observe.redaction import KEY_REDACTED
    from ddb2bt.transforms.errors import MappingError

    def findings(show_keys: bool) -> Findings:
        f = Findings(show=False, show_keys=show_keys)
        f.unmappable({"pk": {"S": "alice@example.com"}}, MappingError("bad", reason="encoding"))
        diff = LayoutDiff()
        diff.missing_rows = [b"alice@example.com#1"]
        f.add("t", diff, {}, {})
        return f

    hidden = findings(False)
    assert hidden.unmappable_json()["examples"][0]["key"] == {"pk": KEY_REDACTED}
    assert hidden.table_json("t")["missing_rows"]["examples"] == [{"row": KEY_REDACTED}]
    shown = findings(True)
    example = shown.unmappable_json()["examples"][0]
    assert example["key"] == {"pk": {"S": "alice@example.com"}} and example["message"] == "encoding"  # values stay hidden
    assert shown.table_json("t")["missing_rows"]["examples"] == [{"row": "alice@example.com#1"}]


def test_examples_lists_a_description_per_example(capsys):
    from ddb2bt.pipeline.local.examples import example_names

    assert main(["examples"]) == 0
    out = capsys.readouterr().out
    for name in example_names():
        line = next(line for line in out.splitlines() if line.startswith(f"example:{name} "))
        assert len(line.split(None, 1)[1]) > 20, line  # a description, not just the path


def test_the_local_env_hint_works_before_the_venv_is_on_path(monkeypatch, tmp_path):
    from ddb2bt.pipeline.app.cli import self_command

    program = tmp_path / "venv" / "bin" / "ddb2bt"
    program.parent.mkdir(parents=True)
    program.write_text("#!/bin/sh\n")
    monkeypatch.setattr(sys, "argv", [str(program.relative_to(tmp_path))])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert self_command() == str(program)  # absolute: works from anywhere, no PATH needed
    monkeypatch.setattr(sys, "argv", ["-c"])
    assert self_command() == f"{sys.executable} -m ddb2bt.pipeline.app.cli"


def test_hotspot_lint_for_low_cardinality_key_prefixes():
    mapping = mapping_from_text(HEAD + """
families: {d: {}, idx: {}}
rules:
  - row_key: "{PK}"
    other_attributes: {family: d}
    indexes:
      - {name: by_status, row_key: "status#{OrderStatus}#{OrderDate}#{PK}", family: idx}
      - {name: by_salted_status, row_key: "{OrderStatus|salt:16}#{PK}", family: idx}
      - {name: by_region, row_key: "{Shard}#{PK}", family: idx}
""")
    static = [f for f in lint(mapping) if f.code == "low_cardinality_prefix"]
    assert [f.where.rsplit(" ", 1)[-1] for f in static] == ["by_status"]  # salted: spread; Shard: no enum name
    # measured with --sample: {Shard} has 3 values, one of them in 80% of the items
    items = [{k: from_plain(v) for k, v in {"PK": f"o{i}", "SK": "x", "OrderStatus": "PENDING",
                                            "Shard": "a" if i % 5 else "b" if i % 10 else "c"}.items()}
             for i in range(40)]
    sampled = [f for f in lint(mapping, items) if f.code == "low_cardinality_prefix"]
    assert {f.where.rsplit(" ", 1)[-1] for f in sampled} == {"by_status", "by_region"}
    assert "PENDING" not in " ".join(f.message for f in sampled)  # item values are not printed


def test_progress_off_a_terminal_is_plain_log_lines(caplog, capsys):
    from ddb2bt.pipeline.observe import progress

    ticks = iter(range(0, 10_000, 31))  # each look at the clock: 31 s later
    done = threading.Event()
    worker = progress.Worker("verify", lambda: done.wait(5))
    worker.start()
    with caplog.at_level(logging.INFO):
        threading.Timer(1.2, done.set).start()
        progress.watch(worker, 100, "verify", lambda: 40, tty=False, clock=lambda: next(ticks))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("verify:")]
    assert lines and lines[-1].endswith("(done)") and "verify: 40/100 items (40%)" in lines[0]
    assert "\r" not in capsys.readouterr().err  # no bar redraws in a log


# --- issue 35, 3: a stopped local stack cannot mislead -----------------------------------

def test_eval_of_local_env_fails_when_no_stack_runs(tmp_path):
    import os
    import subprocess

    env = dict(os.environ, DDB2BT_STATE_DIR=str(tmp_path))
    env.pop("PYTHONPATH", None)
    shell = f'eval "$({sys.executable} -m ddb2bt.pipeline.app.cli local env)" && echo ran-on'
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0 and "ran-on" not in done.stdout  # `… && next` stops here
    assert "no local stack is running; start one with:" in done.stderr and "local up --detach" in done.stderr


def test_aws_region_is_honoured_like_aws_default_region(monkeypatch):
    from ddb2bt.pipeline.connect.connections import dynamodb_client

    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    assert main(["examples"]) == 0  # any command
    assert dynamodb_client().meta.region_name == "eu-west-3"


def test_missing_cloud_credentials_say_how_to_use_the_local_stack(monkeypatch, tmp_path):
    from botocore.exceptions import NoRegionError
    from google.auth.exceptions import DefaultCredentialsError

    from ddb2bt.pipeline.options import describe_failure

    monkeypatch.setenv("DDB2BT_STATE_DIR", str(tmp_path))
    for name in ("BIGTABLE_EMULATOR_HOST", "AWS_ENDPOINT_URL_DYNAMODB"):
        monkeypatch.delenv(name, raising=False)
    for exc in (NoRegionError(), DefaultCredentialsError("Your default credentials were not found.")):
        said = describe_failure(exc)
        assert 'none is running; start it with: ddb2bt local up --detach && eval "$(ddb2bt local env)"' in said
    monkeypatch.setenv("BIGTABLE_EMULATOR_HOST", "127.0.0.1:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_DYNAMODB", "http://127.0.0.1:1")
    assert "local stack" not in describe_failure(NoRegionError())  # it is set: not the cause
