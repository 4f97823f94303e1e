"""Every command the project prescribes names one that exists, with options it
takes: each `ddb2bt …` in the docs' code, the README, the alert rules' advice,
the deploy scripts and the hints and messages in the code. A runbook that
tells an operator to run `ddb2bt migrate --restart` must name a command and
options the CLI accepts (that each one does what it says is the e2e tests'
job: docs/cutover.md's runbook table names them)."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from ddb2bt.pipeline.app.cli import build_parser
from tests.conftest import ROOT

COMMAND = re.compile(r"\bddb2bt +([a-z][a-z-]*)((?:[ ]+[^\s`'\"|;()\\]+)*)")
# A `ddb2bt WORD` that is prose, not a command: only judged where a command
# would stand (start of a line or code span, after a prompt, "with:", "then").
COMMAND_CONTEXT = re.compile(r"(^|[`$;]|:|&&|\bthen|\bwith|\brun)\s*$")
# Shown on purpose, not prescribed: the typo of the did-you-mean example, and an
# error message quoted in troubleshooting ("…; ddb2bt needs NEW_AND_OLD_IMAGES").
NOT_COMMANDS = {"verfy", "needs"}


def _subparsers(p: argparse.ArgumentParser) -> dict:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return a.choices
    return {}


def _beam_options() -> set:
    """The pipeline options Beam takes (passed through by run, migrate, backfill, verify)."""
    from ddb2bt.pipeline.options import beam_option_strings

    return set(beam_option_strings())


def _code(path: Path) -> list:
    text = path.read_text()
    if path.suffix != ".md":
        return [text]
    blocks = re.findall(r"```.*?```", text, flags=re.S)
    rest = re.sub(r"```.*?```", "", text, flags=re.S)
    return blocks + re.findall(r"`([^`\n]+)`", rest)


def prescribed_commands() -> list:
    files = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "deploy/prometheus/alerts.yml"] \
        + sorted((ROOT / "deploy").rglob("*.sh")) + sorted((ROOT / "pipeline").rglob("*.py"))
    out = []
    for path in files:
        for span in _code(path):
            for m in COMMAND.finditer(span):
                line_start = span.rfind("\n", 0, m.start()) + 1
                out.append((path.relative_to(ROOT), m.group(1), m.group(2).split(),
                            bool(COMMAND_CONTEXT.search(span[line_start:m.start()]))))
    return out


def problems(commands: list) -> list:
    parser = build_parser()
    subs = _subparsers(parser)
    beam = _beam_options()
    bad = []
    for where, sub, tokens, in_command_position in commands:
        if sub not in subs:
            if in_command_position and where.suffix == ".md" and sub not in NOT_COMMANDS:
                bad.append(f"{where}: ddb2bt {sub}: no such command")
            continue
        p = subs[sub]
        nested = _subparsers(p)
        if nested and tokens and not tokens[0].startswith("-"):
            name = re.sub(r"\{.*", "", tokens[0])  # an f-string's {flags} glued on
            if name not in nested:
                bad.append(f"{where}: ddb2bt {sub} {name}: no such command")
                continue
            p = nested[name]
        known = {o for a in p._actions for o in a.option_strings} | beam
        for token in tokens:
            if token == "--":  # `ddb2bt local run -- CMD`: the rest is CMD's
                break
            if token.startswith("--"):
                flag = re.sub(r"\{.*", "", token.split("=")[0]).rstrip(".,:")
                if flag and flag != "--" and flag not in known:
                    bad.append(f"{where}: ddb2bt {sub} … {flag}: no such option")
    return bad


def test_every_prescribed_command_exists_with_the_options_it_names():
    commands = prescribed_commands()
    assert len(commands) > 300, "the docs and hints are read"
    assert problems(commands) == []


def test_a_misnamed_command_or_option_is_caught():
    assert problems([(Path("docs/x.md"), "migrate", ["--restrat"], True)]) == \
        ["docs/x.md: ddb2bt migrate … --restrat: no such option"]
    assert problems([(Path("docs/x.md"), "recopy", [], True)]) == ["docs/x.md: ddb2bt recopy: no such command"]
    assert problems([(Path("docs/x.md"), "dlq", ["redrve"], True)]) == ["docs/x.md: ddb2bt dlq redrve: no such command"]
    assert problems([(Path("docs/x.md"), "run", ["--runner=DataflowRunner", "--temp_location=gs://b"], True)]) == []
    assert problems([(Path("docs/x.md"), "needs", [], False)]) == []  # prose
