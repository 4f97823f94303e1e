"""The Flex Template offers every job option of the CLI.

The CLI grows options (other engineers add them in parallel); the template must
follow, or a Dataflow user silently cannot use them. These tests compare
deploy/dataflow/metadata.json and ddb2bt.pipeline.app.flex_main with the CLI's
run/backfill/migrate parsers and, when they differ, say exactly what to add
(the PARAMETERS line and the metadata entry), one line per option.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from ddb2bt.pipeline.app.cli import build_parser
from ddb2bt.pipeline.app.flex_main import COMMANDS, NOT_FOR, NOT_ON_DATAFLOW, PARAMETERS, translate

ROOT = Path(__file__).resolve().parents[3]
META = {p["name"]: p for p in json.loads((ROOT / "deploy/dataflow/metadata.json").read_text())["parameters"]}
FLOAT_RX, INT_RX, BOOL_RX = r"^[0-9]+(\\.[0-9]+)?$", "^[0-9]+$", "^(true|false)$"


def cli_options(command: str) -> dict:
    """``{template name: argparse action}`` for every option of ``ddb2bt [OPTIONS]
    COMMAND`` (``ddb2bt``'s own and the command's; the name is the first long
    option without its dashes, ``-`` → ``_``)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    options = {}
    for action in parser._actions + sub._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and not isinstance(action, argparse._HelpAction):
            options[longs[0][2:].replace("-", "_")] = action
    return options


def kind_of(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "flag"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "bool"
    return "value"


def what_to_add(name: str, action: argparse.Action) -> str:
    """The two pieces a missing option needs, ready to paste."""
    kind = kind_of(action)
    if kind != "value":
        rx = BOOL_RX
    elif action.choices:
        rx = "^(" + "|".join(map(str, action.choices)) + ")$"
    elif isinstance(action.default, float):
        rx = FLOAT_RX
    elif isinstance(action.default, int):
        rx = INT_RX
    else:
        rx = "^.+$"
    help_text = (action.help or "").replace("%(default)s", str(action.default)).replace('"', "'")
    entry = (f'{{"name": "{name}", "label": "…", "helpText": "{help_text}", "isOptional": true, '
             f'"paramType": "TEXT", "regexes": ["{rx}"]}}')
    return (f"  pipeline/app/flex_main.py PARAMETERS: \"{name}\": (\"{action.option_strings[0]}\", \"{kind}\"),\n"
            f"  deploy/dataflow/metadata.json parameters: {entry}")


def test_the_template_offers_every_job_option_of_the_cli():
    problems, unoffered = [], {}
    for command in COMMANDS:
        cli = cli_options(command)
        expected = set(cli) - set(NOT_ON_DATAFLOW)
        offered = {n for n in PARAMETERS if n not in NOT_FOR[command]}
        for name in sorted(expected - offered):
            if name in PARAMETERS:
                problems.append(f"{command}: {cli[name].option_strings[0]} exists, but NOT_FOR[{command!r}] in "
                                f"pipeline/app/flex_main.py drops template parameter {name}: take it out of "
                                "BACKFILL_ONLY/TAIL_ONLY")
            else:
                unoffered.setdefault(name, {})[command] = cli[name]
        for name in sorted(offered - set(cli)):
            problems.append(f"{command}: template parameter {name} reaches `ddb2bt {command}`, which has no "
                            f"{PARAMETERS[name][0]}: add it to BACKFILL_ONLY/TAIL_ONLY (NOT_FOR[{command!r}]) in "
                            "pipeline/app/flex_main.py, or remove it from PARAMETERS and metadata.json")
        for name in sorted(offered & set(cli)):
            if PARAMETERS[name][0] not in cli[name].option_strings:
                problems.append(f"{command}: template parameter {name} passes {PARAMETERS[name][0]}, the CLI "
                                f"calls it {cli[name].option_strings[0]}")
            elif PARAMETERS[name][1] != kind_of(cli[name]):
                problems.append(f"{command}: template parameter {name} is a {PARAMETERS[name][1]!r}, the CLI's "
                                f"{cli[name].option_strings[0]} a {kind_of(cli[name])!r} (flag: store_true; "
                                "bool: --x/--no-x)")
    for name, by_command in sorted(unoffered.items()):
        action = next(iter(by_command.values()))
        lacking = [c for c in COMMANDS if name not in cli_options(c)]
        scope = (" (and put it in " + ("TAIL_ONLY" if lacking == ["backfill"] else "BACKFILL_ONLY"
                                       if lacking == ["run"] else f"NOT_FOR of {lacking}") + ")") if lacking else ""
        problems.append(f"{action.option_strings[0]} ({', '.join(by_command)}) has no template parameter; add"
                        f"{scope}:\n" + what_to_add(name, action))
    missing_meta = sorted(set(PARAMETERS) - set(META))
    problems += [f"metadata.json has no entry for PARAMETERS[{n!r}]" for n in missing_meta]
    problems += [f"metadata.json lists {n}, which PARAMETERS (pipeline/app/flex_main.py) does not translate"
                 for n in sorted(set(META) - set(PARAMETERS) - {"command"})]
    assert not problems, "the Flex Template and the CLI differ:\n" + "\n".join(problems)


def test_the_options_left_out_of_the_template_still_exist_and_say_why():
    everywhere = set().union(*(cli_options(c) for c in COMMANDS))
    stale = sorted(set(NOT_ON_DATAFLOW) - everywhere)
    assert not stale, f"NOT_ON_DATAFLOW in pipeline/app/flex_main.py names options the CLI no longer has: {stale}"
    assert all(len(why) > 20 for why in NOT_ON_DATAFLOW.values())
    assert not set(NOT_ON_DATAFLOW) & set(PARAMETERS)


def _sample(action: argparse.Action):
    """(template value, the value the CLI must end up with)."""
    kind = kind_of(action)
    if kind == "flag":
        return "true", True
    if kind == "bool":
        return "false", False
    if action.choices:
        value = list(action.choices)[-1]
        return str(value), value
    if action.dest == "mapping":
        return "gs://bkt/m.yaml", ["gs://bkt/m.yaml"]
    if action.dest == "kinesis_share":  # a fraction of 1
        return "1/2", action.type("1/2")
    if action.type is None:
        return "s3://bkt/x" if action.dest == "from_export" else "x7", "s3://bkt/x" if action.dest == "from_export" else "x7"
    raw = "7.5" if isinstance(action.default, float) else "7"
    return raw, action.type(raw)  # the CLI's own conversion: the value arrived intact


@pytest.mark.parametrize("command", COMMANDS)
def test_each_template_parameter_sets_its_cli_option(command):
    """One parameter at a time through the launcher's translation and the CLI's
    parser: it lands in its option's value, not in Beam's leftovers."""
    cli = cli_options(command)
    for name in sorted(n for n in PARAMETERS if n not in NOT_FOR[command]):
        action = cli[name]
        raw, expected = _sample(action)
        argv = [f"--command={command}", f"--{name}={raw}"]
        if name != "mapping":
            argv.append("--mapping=gs://bkt/m.yaml")
        args, unknown = build_parser().parse_known_args(translate(argv))
        assert unknown == [], (name, unknown)
        assert getattr(args, action.dest) == expected, (command, name, getattr(args, action.dest))
        assert expected != action.default, f"the sample for {name} must differ from the CLI default"


def test_each_template_regex_takes_the_cli_default():
    """A parameter's regex accepts the value the CLI would use anyway (a regex
    that refuses the default is a typo), and true/false for switches."""
    checked = 0
    for name in sorted(set(META) - {"command"}):
        action = next(a for a in (cli_options(c).get(name) for c in COMMANDS) if a is not None)
        if kind_of(action) != "value":
            samples = ["true", "false"]
        elif action.default is not None:
            samples = [str(action.default)]
        else:
            continue  # no default (mapping, from_export, ...): the example parameter files cover those
        for value in samples:
            assert any(re.fullmatch(rx, value) for rx in META[name]["regexes"]), (name, value, META[name]["regexes"])
            checked += 1
    assert checked >= 15
