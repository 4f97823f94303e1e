"""Strict command-line options: numbers in range, runners by name, and any flag
that is neither ours nor one of Beam's registered pipeline options refused with
a "did you mean" — a typo must never start a job that runs forever."""
from __future__ import annotations

import argparse
import difflib
from typing import Callable, Iterable, Optional
from ddb2bt.pipeline.local.local_stack import load_state

__all__ = ["METRICS_OFF", "joined_beam_args", "number", "KNOWN_RUNNERS", "LOCAL_RUNNER_NAMES", "beam_option_strings", "check_beam_args",
           "runner_of", "partitions_arg", "auto_partitions", "AUTO_PARTITIONS"]

# The runners ddb2bt is built and tested for: the local FnApiRunner (what
# DirectRunner means here) and Dataflow.
LOCAL_RUNNER_NAMES = ("DirectRunner", "FnApiRunner")
KNOWN_RUNNERS = LOCAL_RUNNER_NAMES + ("DataflowRunner",)
_CLOSE_MATCH_CUTOFF = 0.75  # difflib ratio: "--until-idel" ~ "--until-idle", not every option
# Beam registers hundreds of options: a looser match there suggests nonsense
# ("--segment" ~ "--user_agent" at 0.76), so Beam's need to be closer.
_BEAM_CLOSE_MATCH_CUTOFF = 0.85

# --partitions auto: one partition per this many open shards at launch. A
# partition reads its shards round-robin in one thread; 8 busy shards (up to
# 8,000 changes/s, ~5,000 per shard at the 5 GetRecords/s limit) is about what
# one worker thread maps and writes. Bounded: each partition is a reader and a
# lease check, and Dataflow runs ~2 per worker.
SHARDS_PER_PARTITION = 8
MAX_AUTO_PARTITIONS = 64
AUTO_PARTITIONS = "auto"
# --metrics-port: this value means "serve no /metrics", for every command alike
# (0 already means "a free port", so off needs a value of its own).
METRICS_OFF = -1


def auto_partitions(open_shards: int) -> int:
    """Partitions for a stream with ``open_shards`` open shards (``--partitions auto``)."""
    return max(1, min(MAX_AUTO_PARTITIONS, -(-open_shards // SHARDS_PER_PARTITION)))


def number(kind: type = float, minimum: Optional[float] = None, maximum: Optional[float] = None,
           above: Optional[float] = None) -> Callable[[str], float]:
    """An argparse ``type`` that parses ``kind`` and checks its range, with a
    message naming the value (argparse adds the option's name)."""
    noun = "a whole number" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"must be greater than {above:g}, got {text}")
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum:g}, got {text}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:g}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def partitions_arg(text: str):
    """``--partitions``: a whole number ≥ 1, or ``auto``."""
    return AUTO_PARTITIONS if text == AUTO_PARTITIONS else number(int, minimum=1)(text)


partitions_arg.__name__ = "partitions"


def _beam_parser() -> argparse.ArgumentParser:
    """A parser that knows every option Beam registers (as Beam's own
    ``PipelineOptions.get_all_options`` builds it)."""
    from apache_beam.options.pipeline_options import PipelineOptions

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    seen: set = set()
    pending = list(PipelineOptions.__subclasses__())
    while pending:
        cls = pending.pop()
        if cls in seen:
            continue
        seen.add(cls)
        pending.extend(cls.__subclasses__())
        cls._add_argparse_args(parser)
    return parser


def joined_beam_args(beam_args: Iterable[str]) -> list:
    """``--flag value`` → ``--flag=value`` for every Beam option that takes one
    value, so both spellings mean the same wherever the list is read: our own
    look-ups (the runner, the project, the job name) and Beam's, which keeps
    only what it recognises — given ``--runner DirectRunner`` with the runner
    taken out, it warned "Discarding unparseable args: ['DirectRunner']". A
    flag followed by another option (``--dry_run --project p``) is left alone."""
    args = list(beam_args)
    if not args:
        return args
    one_value = {o for action in _beam_parser()._actions if action.nargs is None and action.option_strings
                 for o in action.option_strings}
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if arg in one_value and i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append(f"{arg}={args[i + 1]}")
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


def beam_option_strings() -> list:
    return [o for action in _beam_parser()._actions for o in action.option_strings]


def without_runner(beam_args: list) -> list:
    """``beam_args`` less ``--runner`` and its value, in either spelling."""
    out: list = []
    skip = False
    for arg in beam_args:
        if skip:
            skip = False
        elif arg == "--runner":
            skip = True
        elif not arg.startswith("--runner="):
            out.append(arg)
    return out


def runner_of(beam_args: Iterable[str]) -> Optional[str]:
    args = list(beam_args)
    runner = None
    for i, arg in enumerate(args):
        if arg.startswith("--runner="):
            runner = arg.split("=", 1)[1]
        elif arg == "--runner" and i + 1 < len(args):
            runner = args[i + 1]
    return runner


def check_beam_args(beam_args: list, own_options: Iterable[str], beam: bool = True,
                    elsewhere: Optional[dict] = None) -> Optional[str]:
    """Why ``beam_args`` (what our parser did not know) cannot be passed to Beam,
    or None when Beam knows every one of them and the runner is supported.
    ``beam=False``: the command takes no Beam options, so every one is unknown.
    ``elsewhere``: {option: [commands]} of the other commands, to say that an
    option belongs to another command rather than guess a Beam one."""
    unknown = _beam_parser().parse_known_args(beam_args)[1] if beam else list(beam_args)
    flags = [a.split("=", 1)[0] for a in unknown if a.startswith("-")]
    if flags:
        own = list(own_options)
        others = {o: c for o, c in (elsewhere or {}).items() if o not in own}
        hints = [_hint(flag, own, others, beam_option_strings() if beam else []) for flag in flags]
        return f"unknown option{'s' if len(flags) > 1 else ''}: {', '.join(hints)}"
    if unknown:
        return f"unexpected argument{'s' if len(unknown) > 1 else ''}: {' '.join(unknown)}"
    runner = runner_of(beam_args)
    if runner is not None and runner not in KNOWN_RUNNERS:
        return (f"--runner {runner}: unknown runner; use DirectRunner (local, the default) or DataflowRunner")
    return None


def misspelt_options(parser: argparse.ArgumentParser, argv: list) -> Optional[str]:
    """Before parsing: the options the chosen (sub)command does not take, each
    with its did-you-mean, as ``check_beam_args`` says them after parsing. Run
    first, so every command says it: argparse would otherwise stop at a required
    option missing (``status --maping m.yaml``: "--mapping is required") and
    never name the misspelling. None when every option is known (an
    abbreviation argparse takes counts), or the command is not known (argparse
    says so)."""
    own = [o for a in parser._actions for o in a.option_strings]
    p, rest = parser, list(argv)
    while True:
        subs = next((a.choices for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)
        if not subs:
            break
        i = next((i for i, a in enumerate(rest) if not a.startswith("-")), None)
        if i is None or rest[i] not in subs:
            return None
        p, rest = subs[rest[i]], rest[i + 1:]
        own += [o for a in p._actions for o in a.option_strings]
    if "--" in rest:
        rest = rest[:rest.index("--")]
    if any(a.nargs == argparse.REMAINDER for a in p._actions):
        return None
    beam = beam_option_strings() if p.get_default("beam") else []
    flags = [a.split("=", 1)[0] for a in rest if a.startswith("--") and len(a) > 2]
    unknown = [f for f in flags if not any(o.startswith(f) for o in own + beam)]
    if not unknown:
        return None
    others = {o: c for o, c in options_by_command(parser).items() if o not in own}
    hints = [_hint(flag, own, others, beam) for flag in unknown]
    return f"unknown option{'s' if len(unknown) > 1 else ''}: {', '.join(hints)}"


def _hint(flag: str, own: list, others: dict, beam_options: list) -> str:
    """The flag with the most likely meant option: this command's, then another
    command's (saying which), then Beam's."""
    close = difflib.get_close_matches(flag, own, n=1, cutoff=_CLOSE_MATCH_CUTOFF)
    if close:
        return f"{flag} (did you mean {close[0]}?)"
    close = difflib.get_close_matches(flag, list(others), n=1, cutoff=_CLOSE_MATCH_CUTOFF)
    if close:
        commands = ", ".join(f"`{c}`" for c in others[close[0]])
        return f"{flag} ({close[0]} is an option of {commands}, not of this command)"
    close = difflib.get_close_matches(flag, beam_options, n=1, cutoff=_BEAM_CLOSE_MATCH_CUTOFF)
    return f"{flag} (did you mean {close[0]}?)" if close else flag


def options_by_command(parser: argparse.ArgumentParser, prefix: str = "") -> dict:
    """{option string: [command, ...]} over every (sub)command of ``parser``."""
    out: dict = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                command = f"{prefix} {name}".strip()
                for a in sub._actions:
                    for o in a.option_strings:
                        if o.startswith("--") and o != "--help":
                            out.setdefault(o, []).append(command)
                for o, commands in options_by_command(sub, command).items():
                    out.setdefault(o, []).extend(c for c in commands if c not in out[o])
    return out


def describe_failure(exc: BaseException) -> str:
    """One line for an unexpected failure, naming what users can act on."""
    from botocore.exceptions import NoCredentialsError, NoRegionError

    if isinstance(exc, NoRegionError):
        return "no AWS region: set source.region in the mapping, or AWS_REGION / AWS_DEFAULT_REGION" + local_hint()
    if isinstance(exc, NoCredentialsError):
        return "no AWS credentials found (environment, ~/.aws, or the instance's role)" + local_hint()
    first = str(exc).splitlines()[0] if str(exc) else ""
    if type(exc).__name__ == "DefaultCredentialsError":  # google.auth: no Google credentials, no emulator set
        return f"no Google credentials found: {first}" + local_hint()
    return f"{type(exc).__name__}: {first}"


# The variables the local stack sets (ddb2bt local env): without them, a
# command meant for the local stack talks to AWS and Google and fails on
# credentials or the region.
LOCAL_STACK_VARIABLES = ("BIGTABLE_EMULATOR_HOST", "AWS_ENDPOINT_URL_DYNAMODB")


def local_hint() -> str:
    """What to do when a command found no cloud credentials or region and the
    local stack's variables are not set: use the running stack, or start one."""
    import os

    if all(os.environ.get(v) for v in LOCAL_STACK_VARIABLES):
        return ""

    if load_state() is not None:
        return ('. A local stack is running but this shell does not use it: eval "$(ddb2bt local env)"')
    return ('. If you meant the local stack: none is running; start it with: '
            'ddb2bt local up --detach && eval "$(ddb2bt local env)"')


def option_strings(parser: argparse.ArgumentParser, args) -> list:
    """Every option string the chosen (sub)command accepts, for "did you mean"."""
    found = [o for a in parser._actions for o in a.option_strings]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, "command", None)
            # `local run -- CMD` keeps CMD (a list) in args.command as well.
            sub = action.choices.get(name) if isinstance(name, str) else None
            if sub is not None:
                found += option_strings(sub, args)
    return found
