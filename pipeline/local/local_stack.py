"""The local stack: cbtemulator (Bigtable) and one of two AWS emulators (DynamoDB +
Streams + S3 + Kinesis + STS), moto's server or ministack, on free 127.0.0.1 ports,
for `ddb2bt local`, `ddb2bt demo` and the tests.

The two AWS emulators are independent implementations; which is closer to AWS on
what is in docs/development.md ("Two AWS emulators"). Both servers bind to loopback
only. ``LocalStack.env()`` gives the standard
variables every client here honours: ``BIGTABLE_EMULATOR_HOST``,
``AWS_ENDPOINT_URL_DYNAMODB``, ``AWS_ENDPOINT_URL_DYNAMODBSTREAMS`` (and
``AWS_ENDPOINT_URL_DYNAMODB_STREAMS``, the spelling botocore reads),
``AWS_ENDPOINT_URL_S3``, dummy credentials and a region.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from ddb2bt.pipeline.local.exits import on_hard_exit
from ddb2bt.pipeline.local.ministack_server import MINISTACK_RETENTION_ENV  # noqa: F401 (its one definition)
from ddb2bt.transforms.errors import PermanentError

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
READY_TIMEOUT_S = 30.0
READY_POLL_S = 0.05
STOP_GRACE_S = 5.0
DEFAULT_REGION = "us-east-1"
MOTO, MINISTACK = "moto", "ministack"
DYNAMODB_EMULATORS = (MOTO, MINISTACK)
# The default AWS emulator: the closer to AWS and the faster, measured
# (bench/emulators.py, docs/benchmarks.md "The two AWS emulators").
DEFAULT_DYNAMODB = MINISTACK
# Chooses the emulator where no --dynamodb is given (`ddb2bt demo`, the test suite's
# `stack` fixture, `local up`), e.g. DDB2BT_LOCAL_DYNAMODB=ministack.
DYNAMODB_ENV = "DDB2BT_LOCAL_DYNAMODB"
# The AWS services ddb2bt talks to; ministack serves only these (SERVICES), which
# keeps its start-up small and its listeners to the one HTTP port.
MINISTACK_SERVICES = "dynamodb,dynamodbstreams,s3,kinesis,sts,iam"
# ministack pins one botocore release exactly (1.5.33: botocore==1.43.106), which
# would hold the project's boto3 back; so it runs from a virtualenv of its own,
# which deploy/local/setup.sh makes next to .venv with this requirement.
MINISTACK_REQUIREMENT = "ministack>=1.5.33,<1.6"
MINISTACK_VENV = ".venv-ministack"
MINISTACK_PYTHON_ENV = "DDB2BT_MINISTACK_PYTHON"  # another ministack's Python, e.g. /opt/ministack/bin/python
MINISTACK_LAUNCHER = Path(__file__).with_name("ministack_server.py")
# Dummy credentials: moto accepts anything; real ones must never be needed locally.
DUMMY_KEY_ID = "testing"
DUMMY_SECRET = "testing"
# The test change-stream server in front of cbtemulator (``LocalStack.change_streams``).
CHANGE_STREAMS = "change-streams"
CHANGE_STREAM_SERVER = "ddb2bt.pipeline.testing.change_stream_server"
STATE_DIR_ENV = "DDB2BT_STATE_DIR"
STATE_FILE_NAME = "local-stack.json"
# Where `ddb2bt local up --detach` recorded its stack before it had one place per user.
LEGACY_STATE_FILE = Path(".ddb2bt") / STATE_FILE_NAME


def state_dir() -> Path:
    """One place per user for the detached stack's record and logs, whatever the
    working directory: $DDB2BT_STATE_DIR, else $XDG_RUNTIME_DIR/ddb2bt (a per-user
    tmpfs, cleared at logout like the stack's processes), else ~/.cache/ddb2bt."""
    explicit = os.environ.get(STATE_DIR_ENV)
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "ddb2bt" if runtime else Path.home() / ".cache" / "ddb2bt"


def state_file() -> Path:
    return state_dir() / STATE_FILE_NAME

INSTALL_HELP = """\
cbtemulator (the Cloud Bigtable emulator) was not found.
Looked on PATH, in $CBTEMULATOR, and under the Google Cloud CLI's SDK root
(platform/bigtable-emulator/cbtemulator). Install it with one of:
  gcloud components install bigtable                       # gcloud from the installer
  sudo apt-get install google-cloud-cli-bigtable-emulator  # gcloud from Debian/Ubuntu apt
or point CBTEMULATOR at the binary."""


MINISTACK_HELP = f"""\
ministack (the default local AWS emulator) was not found.
Looked at ${MINISTACK_PYTHON_ENV}, for {MINISTACK_VENV}/bin/python next to this
virtualenv and in the source tree, and in this Python. It runs from a virtualenv of
its own (it pins one botocore release, which would hold ddb2bt's boto3 back).
Install it with one of:
  deploy/local/setup.sh                       # in a clone: makes {MINISTACK_VENV}
  python3 -m venv DIR && DIR/bin/pip install '{MINISTACK_REQUIREMENT}' && export {MINISTACK_PYTHON_ENV}=DIR/bin/python
or use moto instead: --dynamodb moto (or {DYNAMODB_ENV}=moto)."""


class StackError(PermanentError):
    """The local stack could not be started."""


def default_dynamodb() -> str:
    """The AWS emulator to start: $DDB2BT_LOCAL_DYNAMODB, else the measured default."""
    chosen = os.environ.get(DYNAMODB_ENV) or DEFAULT_DYNAMODB
    if chosen not in DYNAMODB_EMULATORS:
        raise StackError(f"{DYNAMODB_ENV}={chosen!r} is not an AWS emulator ddb2bt can start; "
                         f"choose one of: {', '.join(DYNAMODB_EMULATORS)}")
    return chosen


def find_ministack_python() -> str:
    """The Python that runs ministack, or StackError with install instructions."""
    explicit = os.environ.get(MINISTACK_PYTHON_ENV)
    if explicit:
        if os.access(explicit, os.X_OK):
            return explicit
        raise StackError(f"{MINISTACK_PYTHON_ENV}={explicit} is not an executable file.\n{MINISTACK_HELP}")
    # next to the running virtualenv (setup.sh's layout), or in the source tree of an
    # editable install (pipeline/local/ is two levels below its root)
    for root in dict.fromkeys((Path(sys.prefix).parent, Path(__file__).resolve().parents[2])):
        python = root / MINISTACK_VENV / "bin" / "python"
        if python.is_file() and os.access(python, os.X_OK):
            return str(python)
    if importlib.util.find_spec("ministack") is not None:
        return sys.executable
    raise StackError(MINISTACK_HELP)


# Where the Google Cloud CLI's installers put it (Debian package, tarball, snap-less).
USUAL_SDK_ROOTS = (Path("/usr/lib/google-cloud-sdk"), Path("/usr/share/google-cloud-sdk"),
                   Path.home() / "google-cloud-sdk", Path("/opt/google-cloud-sdk"))


def _sdk_roots() -> Iterator[Path]:
    """Where the Google Cloud CLI may be installed, cheapest guess first.

    ``gcloud info`` is the authority but costs ~1 s of CPU (gcloud is a Python
    program): it is asked only when the directory gcloud itself lives in and the
    usual install places hold no emulator (a stack starts per test worker and per
    ``local up``, so the answer is looked for often)."""
    gcloud = shutil.which("gcloud")
    if gcloud:
        # gcloud is usually <root>/bin/gcloud (possibly via a symlink)
        yield Path(os.path.realpath(gcloud)).parent.parent
    yield from USUAL_SDK_ROOTS
    if gcloud:
        try:
            out = subprocess.run(
                [gcloud, "info", "--format=value(installation.sdk_root)"],
                capture_output=True, text=True, timeout=30, check=False,
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        if out:
            yield Path(out)


def find_cbtemulator() -> str:
    """Path of the cbtemulator binary, or StackError with install instructions."""
    explicit = os.environ.get("CBTEMULATOR")
    if explicit:
        if os.access(explicit, os.X_OK):
            return explicit
        raise StackError(f"CBTEMULATOR={explicit} is not an executable file.\n{INSTALL_HELP}")
    on_path = shutil.which("cbtemulator")
    if on_path:
        return on_path
    for root in _sdk_roots():
        candidate = root / "platform" / "bigtable-emulator" / "cbtemulator"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise StackError(INSTALL_HELP)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _wait_tcp(port: int, proc: subprocess.Popen, name: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StackError(f"{name} exited with code {proc.returncode} before it was ready")
        try:
            with socket.create_connection((LOOPBACK, port), timeout=0.5):
                return
        except OSError:
            time.sleep(READY_POLL_S)
    raise StackError(f"{name} did not accept connections on {LOOPBACK}:{port} within {READY_TIMEOUT_S:.0f}s")


def _wait_http(url: str, proc: subprocess.Popen, name: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StackError(f"{name} exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:  # noqa: S310 - loopback only
                if resp.status < 500:
                    return
        except OSError:
            time.sleep(READY_POLL_S)
    raise StackError(f"{name} did not answer {url} within {READY_TIMEOUT_S:.0f}s")


def stack_env(bigtable_port: int, aws_port: int, region: str = DEFAULT_REGION) -> dict:
    aws = f"http://{LOOPBACK}:{aws_port}"
    return {
        "BIGTABLE_EMULATOR_HOST": f"{LOOPBACK}:{bigtable_port}",
        "AWS_ENDPOINT_URL_DYNAMODB": aws,
        "AWS_ENDPOINT_URL_DYNAMODBSTREAMS": aws,
        # What botocore actually reads for the "DynamoDB Streams" service id.
        "AWS_ENDPOINT_URL_DYNAMODB_STREAMS": aws,
        "AWS_ENDPOINT_URL_S3": aws,
        "AWS_ENDPOINT_URL_KINESIS": aws,  # Kinesis Data Streams for DynamoDB (docs/kinesis.md)
        "AWS_ACCESS_KEY_ID": DUMMY_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": DUMMY_SECRET,
        "AWS_DEFAULT_REGION": region,
        "AWS_REGION": region,
    }


@dataclass
class LocalStack:
    """cbtemulator + an AWS emulator (``dynamodb``: moto or ministack). Use as a
    context manager, or start()/stop().

    ``stream_retention_s`` (ministack only) shortens its streams' 24-hour retention,
    so a test or a rehearsal sees records trimmed; moto never trims.

    ``change_streams``: cbtemulator (which has no change streams) listens on a
    port of its own behind the test change-stream server
    (``ddb2bt.pipeline.testing.change_stream_server``), which takes
    ``bigtable_port``: every Bigtable call goes through it, and a table created
    with a change stream can be read back as one (the rollback's rehearsal)."""

    region: str = DEFAULT_REGION
    log_dir: Optional[Path] = None
    bigtable_port: int = 0
    aws_port: int = 0
    dynamodb: str = field(default_factory=default_dynamodb)
    stream_retention_s: Optional[float] = None
    change_streams: bool = False
    emulator_port: int = 0  # cbtemulator's own port: bigtable_port unless change_streams puts a front there
    _procs: dict = field(default_factory=dict)
    _logs: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.dynamodb not in DYNAMODB_EMULATORS:
            raise StackError(f"unknown AWS emulator {self.dynamodb!r}; choose one of: {', '.join(DYNAMODB_EMULATORS)}")
        if self.stream_retention_s is not None and self.dynamodb != MINISTACK:
            raise StackError(f"{self.dynamodb} never trims its streams; a stream retention needs ministack")

    @property
    def moto_port(self) -> int:
        """The AWS emulator's port, whichever it is (the name older callers use)."""
        return self.aws_port

    def start(self) -> "LocalStack":
        binary = find_cbtemulator()
        self.bigtable_port = self.bigtable_port or free_port()
        self.aws_port = self.aws_port or free_port()
        self.emulator_port = self.emulator_port or (free_port() if self.change_streams else self.bigtable_port)
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            self._procs["bigtable"] = self._spawn(
                "cbtemulator", [binary, "-host", LOOPBACK, "-port", str(self.emulator_port)]
            )
            self._procs[self.dynamodb] = self._spawn_aws()
            _wait_tcp(self.emulator_port, self._procs["bigtable"], "cbtemulator", deadline)
            if self.change_streams:
                self._procs[CHANGE_STREAMS] = self._spawn(CHANGE_STREAMS, [
                    sys.executable, "-m", CHANGE_STREAM_SERVER, "--upstream", f"{LOOPBACK}:{self.emulator_port}",
                    "--port", str(self.bigtable_port)])
                _wait_tcp(self.bigtable_port, self._procs[CHANGE_STREAMS], "the change-stream server", deadline)
            _wait_http(self._ready_url(), self._procs[self.dynamodb], f"{self.dynamodb} server", deadline)
        except BaseException:
            self.stop()
            raise
        log.info("local stack up: bigtable %s:%d%s, %s %s:%d", LOOPBACK, self.bigtable_port,
                 " (change streams)" if self.change_streams else "", self.dynamodb, LOOPBACK, self.aws_port)
        return self

    def _spawn_aws(self) -> subprocess.Popen:
        if self.dynamodb == MOTO:
            return self._spawn(MOTO, [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(self.aws_port)])
        # ministack binds 0.0.0.0 unless told otherwise, and by default also opens
        # an MQTT listener (IoT) and may talk to Docker: loopback, one port, no Docker.
        extra = {"BIND_HOST": LOOPBACK, "GATEWAY_PORT": str(self.aws_port), "SERVICES": MINISTACK_SERVICES,
                 "IOT_MTLS_ENABLED": "0", "SFTP_ENABLED": "0", "PERSIST_STATE": "0",
                 "MINISTACK_REGION": self.region, "LOG_LEVEL": "WARNING"}
        if self.stream_retention_s is not None:
            extra[MINISTACK_RETENTION_ENV] = repr(float(self.stream_retention_s))
        # -I: ministack's Python sees neither PYTHONPATH nor the launcher's directory
        return self._spawn(MINISTACK, [find_ministack_python(), "-I", str(MINISTACK_LAUNCHER)], extra)

    def _ready_url(self) -> str:
        path = "/moto-api/" if self.dynamodb == MOTO else "/_ministack/ready"
        return f"http://{LOOPBACK}:{self.aws_port}{path}"

    def _spawn(self, name: str, argv: list, extra_env: Optional[dict] = None) -> subprocess.Popen:
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")
            self._logs.append(out)
        else:
            out = subprocess.DEVNULL
        env = dict(os.environ)
        env.update(stack_env(self.bigtable_port, self.aws_port, self.region))
        env.update(extra_env or {})
        # start_new_session: Ctrl-C in the terminal reaches us, and we stop the
        # servers in order, instead of them dying half-way through a write.
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        _RUNNING.add(proc)
        return proc

    def restart_aws(self) -> None:
        """Start the AWS emulator again on its port (a new, empty server)."""
        proc = self._procs.pop(self.dynamodb, None)
        if proc:
            _terminate(proc)
        self._procs[self.dynamodb] = self._spawn_aws()
        _wait_http(self._ready_url(), self._procs[self.dynamodb], f"{self.dynamodb} server",
                   time.monotonic() + READY_TIMEOUT_S)

    def env(self) -> dict:
        return stack_env(self.bigtable_port, self.aws_port, self.region)

    def apply_env(self) -> dict:
        """Set the variables in this process; returns the previous values."""
        previous = {k: os.environ.get(k) for k in self.env()}
        os.environ.update(self.env())
        return previous

    def restart_bigtable(self) -> None:
        """Kill and restart the emulator on the same port (it loses all data)."""
        proc = self._procs.pop("bigtable", None)
        if proc:
            _terminate(proc)
        port = self.emulator_port or self.bigtable_port
        self._procs["bigtable"] = self._spawn(
            "cbtemulator", [find_cbtemulator(), "-host", LOOPBACK, "-port", str(port)]
        )
        _wait_tcp(port, self._procs["bigtable"], "cbtemulator", time.monotonic() + READY_TIMEOUT_S)

    @property
    def pids(self) -> dict:
        return {name: p.pid for name, p in self._procs.items()}

    def stop(self) -> None:
        # The AWS emulator first, then Bigtable (the order a writer would stop in).
        for name in (*DYNAMODB_EMULATORS, CHANGE_STREAMS, "bigtable"):
            proc = self._procs.pop(name, None)
            if proc is not None:
                _terminate(proc)
        for handle in self._logs:
            handle.close()
        self._logs.clear()

    def __enter__(self) -> "LocalStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# The servers this process started and has not stopped. In sessions of their own
# the terminal's Ctrl-C never reaches them, so a command that ends at once (a
# stop past its grace, a second Ctrl-C: signals.CommandScope.hard_exit, which
# skips the stack's own stop) ends them on its way out (local/exits.py).
_RUNNING: set = set()


def _end_running() -> None:
    for proc in list(_RUNNING):
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # no wait: the process is about to end
        except (ProcessLookupError, PermissionError):
            pass


on_hard_exit(_end_running)


def _terminate(proc: subprocess.Popen) -> None:
    _RUNNING.discard(proc)
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# --- a detached stack for `ddb2bt local up --detach` / `local env` / `local down` ----


def _read(path: Path) -> list:
    """The stacks recorded in ``path`` (older records hold one stack, not a list)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return data.get("stacks", []) if "stacks" in data else [data]


def _stack_alive(stack: dict) -> bool:
    pids = stack.get("pids", {}).values()
    return bool(pids) and all(_alive(pid) for pid in pids)


def dead_servers(stack: dict) -> list:
    """The servers of a recorded stack that are no longer running."""
    return sorted(name for name, pid in stack.get("pids", {}).items() if not _alive(pid))


def _any_alive(stack: dict) -> bool:
    return any(_alive(pid) for pid in stack.get("pids", {}).values())


def save_state(stack: LocalStack, path: Optional[Path] = None) -> None:
    path = path or state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    # A record is dropped only once nothing of it runs: a stack with one server
    # left stays recorded, so `local down` still stops that one (never leaked).
    stacks = [s for s in _read(path) if _any_alive(s)]
    stacks.append({"pids": stack.pids, "env": stack.env(), "dynamodb": stack.dynamodb})
    path.write_text(json.dumps({"stacks": stacks}, indent=2))


def recorded_change_streams(stack: dict) -> bool:
    """Whether a recorded stack serves change streams (its front is one of its servers)."""
    return CHANGE_STREAMS in stack.get("pids", {})


def recorded_dynamodb(stack: dict) -> str:
    """The AWS emulator of a recorded stack (records from before ministack: moto)."""
    return stack.get("dynamodb", MOTO)


def half_down(path: Optional[Path] = None) -> Optional[dict]:
    """The newest recorded stack of which some servers run and some died, or None."""
    for stack in reversed(_read(path or state_file())):
        if _any_alive(stack) and dead_servers(stack):
            return stack
    return None


def _ports(stack: dict) -> tuple:
    env = stack["env"]
    return (int(env["BIGTABLE_EMULATOR_HOST"].rsplit(":", 1)[1]),
            int(env["AWS_ENDPOINT_URL_DYNAMODB"].rsplit(":", 1)[1]))


def revive(stack: dict, path: Optional[Path] = None) -> list:
    """Start the servers of a half-down recorded stack that died, on the ports
    its users were given (the live half and its data are kept), and record the
    new processes; returns their names. StackError when one cannot start (its
    port taken meanwhile): the record is left as it was, so `local down` stops
    the live half."""
    path = path or state_file()
    bigtable_port, aws_port = _ports(stack)
    revived = LocalStack(log_dir=state_dir() / "logs", bigtable_port=bigtable_port, aws_port=aws_port,
                         dynamodb=recorded_dynamodb(stack))
    dead = dead_servers(stack)
    unknown = [name for name in dead if name not in ("bigtable", revived.dynamodb)]
    if recorded_change_streams(stack):  # cbtemulator's own port is not recorded: nothing starts again here
        unknown = dead
    if unknown:  # e.g. `local trim`'s proxy: not a server this can start again
        raise StackError(f"{', '.join(unknown)} cannot be started again here")
    try:
        for name in dead:
            revived.restart_bigtable() if name == "bigtable" else revived.restart_aws()
    except BaseException:
        revived.stop()
        raise
    pids = dict(stack["pids"], **revived.pids)
    stacks = [dict(s, pids=pids) if s == stack else s for s in _read(path) if _any_alive(s) or s == stack]
    path.write_text(json.dumps({"stacks": stacks}, indent=2))
    revived._procs.clear()  # detached: the servers live in their own sessions
    for handle in revived._logs:
        handle.close()
    return dead


def load_state(path: Optional[Path] = None) -> Optional[dict]:
    """The running detached stack ({pids, env}), or None."""
    for stack in reversed(_read(path or state_file())):
        if _stack_alive(stack):
            return stack
    return None


def replace_state(old: dict, new: dict, path: Optional[Path] = None) -> None:
    """Replace the recorded stack ``old`` by ``new`` (`ddb2bt local trim` adds its
    proxy to the stack's processes and variables, so `local env` and `local down`
    know it)."""
    path = path or state_file()
    stacks = [new if s == old else s for s in _read(path)]
    path.write_text(json.dumps({"stacks": stacks}, indent=2))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def stop_detached(path: Optional[Path] = None) -> int:
    """Stop every detached stack recorded for this user (and one recorded in the
    working directory by older versions); returns how many were running."""
    stopped = 0
    for record in (path or state_file(), LEGACY_STATE_FILE):
        for stack in _read(record):
            if _stack_alive(stack):
                stopped += 1
            for pid in stack.get("pids", {}).values():
                try:
                    os.killpg(pid, signal.SIGTERM)
                except OSError:
                    pass
        record.unlink(missing_ok=True)
    return stopped
