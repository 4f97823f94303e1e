"""The ``ddb2bt local``, ``demo`` and ``examples`` commands: the local stack's
life (up, down, env, run), the recovery rehearsals on it, the demo and the
packaged example mappings. The CLI (``pipeline/app/cli.py``) only parses and calls
these; what they print and return is the command's output and exit code.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ddb2bt.pipeline.services.jobs import load, state_spec
from ddb2bt.transforms.errors import ConfigError


def self_command() -> str:
    """How to run this same ddb2bt from a shell, for the commands we suggest:
    plain ``ddb2bt`` when that is what PATH finds, else this program's absolute
    path (``.venv/bin`` not on PATH yet, the usual first-day case), else the
    interpreter with ``-m``."""
    import shutil
    from shlex import quote

    program = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if program is not None and program.name == "ddb2bt" and program.exists():
        on_path = shutil.which("ddb2bt")
        if on_path and Path(on_path).resolve() == program.resolve():
            return "ddb2bt"
        return quote(str(program.absolute()))
    return f"{quote(sys.executable)} -m ddb2bt.pipeline.app.cli"


def env_hint() -> str:
    return f'eval "$({self_command()} local env)"'


def cmd_local(args) -> int:
    from ddb2bt.pipeline.local import local_stack as ls

    if args.local_cmd in REHEARSAL_COMMANDS:
        return cmd_local_rehearsal(args)
    if args.local_cmd == "env":
        state = ls.load_state()
        if state is None:
            half = ls.half_down()
            if half is not None:
                dead = ", ".join(ls.dead_servers(half))
                print(f"ddb2bt: the local stack is half down ({dead} stopped); restart it with: "
                      f"{self_command()} local up --detach   (or stop the rest: {self_command()} local down)",
                      file=sys.stderr)
            else:
                print(f"ddb2bt: no local stack is running; start one with: {self_command()} local up --detach",
                      file=sys.stderr)
            if not sys.stdout.isatty():
                # Read by `eval "$(ddb2bt local env)"`: make the eval fail too, so
                # `… && next-command` stops here instead of running without a stack.
                print("false")
            return 1
        for k, v in state["env"].items():
            print(f"export {k}={v}")
        return 0
    if args.local_cmd == "down":
        stopped = ls.stop_detached()
        print(f"local stack stopped ({stopped})" if stopped else "no local stack was running")
        return 0
    running = ls.load_state() if args.local_cmd == "up" and args.detach else None
    if running is not None and args.dynamodb and ls.recorded_dynamodb(running) != args.dynamodb:
        raise ConfigError(f"a local stack with {ls.recorded_dynamodb(running)} is already running; stop it first "
                          f"({self_command()} local down) to start one with {args.dynamodb}", "--dynamodb")
    wants_streams = bool(getattr(args, "change_streams", False))
    if running is not None and wants_streams and not ls.recorded_change_streams(running):
        raise ConfigError(f"a local stack without change streams is already running; stop it first "
                          f"({self_command()} local down) to start one with them", "--change-streams")
    if args.local_cmd == "up" and args.detach and ls.load_state() is not None:
        print(f"a local stack is already running ({ls.state_file()}); use it with:  {env_hint()}")
        return 0
    half = ls.half_down() if args.local_cmd == "up" and args.detach else None
    if half is not None and args.dynamodb and ls.recorded_dynamodb(half) != args.dynamodb:
        raise ConfigError(f"a local stack with {ls.recorded_dynamodb(half)} is half down; stop the rest first "
                          f"({self_command()} local down) to start one with {args.dynamodb}", "--dynamodb")
    if half is not None:  # restart what died on its ports; a second stack would leak the live half
        try:
            revived = ls.revive(half)
        except ls.StackError as exc:
            raise ls.StackError(f"the local stack is half down and {exc}; stop the rest with "
                                f"{self_command()} local down, then start again") from None
        print(f"local stack restarted ({', '.join(revived)} started again on the same port; the rest kept its "
              f"data); use it with:  {env_hint()}")
        return 0
    stack = ls.LocalStack(log_dir=ls.state_dir() / "logs", dynamodb=args.dynamodb or ls.default_dynamodb(),
                          change_streams=wants_streams)
    if args.local_cmd == "run":
        command = [c for c in args.command if c != "--"]
        if not command:
            raise ConfigError("give a command after --, e.g. ddb2bt local run -- pytest", "command")
        with stack:
            env = dict(os.environ)
            env.update(stack.env())
            return subprocess.call(command, env=env)
    # up
    if args.detach:
        stack.start()
        ls.save_state(stack)
        # Detach: the servers live in their own sessions; forget them here.
        stack._procs.clear()
        print(f"local stack running; use it with:  {env_hint()}   stop it with: {self_command()} local down")
        return 0
    with stack:
        for k, v in stack.env().items():
            print(f"export {k}={v}")
        print("# local stack running; Ctrl-C stops it", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


# `ddb2bt local` commands that rehearse a recovery on the local stack (docs/recover.md).
REHEARSAL_COMMANDS = ("changes", "trim", "export-table-to-point-in-time")


def cmd_local_rehearsal(args) -> int:
    from ddb2bt.pipeline.local import local_stack as ls
    from ddb2bt.pipeline.local import rehearse

    if args.local_cmd == "export-table-to-point-in-time":
        if args.export_type != "INCREMENTAL_EXPORT" or args.export_format != "DYNAMODB_JSON":
            raise ConfigError("the local stack writes incremental exports in DYNAMODB_JSON (--export-type "
                              "INCREMENTAL_EXPORT --export-format DYNAMODB_JSON), what `ddb2bt recover` asks for",
                              "--export-type")
        frm, to, view = rehearse.parse_incremental_spec(args.incremental_export_specification)
        written = rehearse.export_incremental(args.table_arn, args.s3_bucket, args.s3_prefix or "", frm, to, view)
        late = to > time.time()
        print(f"export COMPLETED: {written.items} item(s) changed in the window\n  ExportArn {written.arn}\n"
              f"  apply it with:  --from-export {written.location}"
              + ("\n  (the window ends in the future: locally the export holds the changes up to now; AWS would "
                 "wait until point-in-time recovery reaches its end)" if late else ""))
        return 0
    mapping = load(args)
    if args.local_cmd == "changes":
        written, created = rehearse.write_changes(mapping, args.changes, args.seed, args.items)
        print((f"created {mapping.source.table} (stream NEW_AND_OLD_IMAGES, point-in-time recovery on); " if created
               else "") + f"wrote {written} change(s) to {mapping.source.table}")
        return 0
    # trim
    spec = state_spec(args, mapping)
    changed = rehearse.ensure_trim_proxy(ls.state_dir())
    arn, trimmed = rehearse.trim_stream(mapping, lambda stream: spec.store().load_checkpoints(stream), ls.state_dir())
    lost = sum(t.lost for t in trimmed)
    print(f"trimmed {len(trimmed)} shard(s) of {mapping.source.table}'s stream: every record it held is gone, as "
          f"after 24 hours; job {spec.job} had not read {lost} of them"
          + ("" if lost else " (nothing is lost: `local changes` while the job is stopped, then trim)"))
    if changed:
        print(f"the stack's DynamoDB Streams endpoint is now a trimming proxy; point the shell at it:  {env_hint()}")
    return 0


def cmd_demo(args) -> int:
    from ddb2bt.pipeline.app.demo import run_demo

    return run_demo(args)


def cmd_examples(args) -> int:
    from ddb2bt.pipeline.local.examples import EXAMPLE_PREFIX, copy_examples, example_names, example_path

    if args.copy:
        copied = copy_examples(Path(args.copy))
        print(f"copied {len(copied)} example mapping(s) to {args.copy}"
              + (" (existing files kept)" if len(copied) < len(example_names()) else ""))
        return 0
    from ddb2bt.transforms.config import load_mapping

    names = example_names()
    width = max((len(EXAMPLE_PREFIX + n) for n in names), default=0)
    for name in names:
        description = load_mapping(example_path(name)).description or ""
        print(f"{EXAMPLE_PREFIX + name:<{width}}  {description}\n{'':<{width}}  {example_path(name)}")
    return 0
