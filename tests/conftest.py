"""Shared fixtures. The emulator stack is started once per session by the same
code as `ddb2bt local`; if cbtemulator or moto is missing the fixture raises and
every test that needs it FAILS (it never skips)."""
from __future__ import annotations

import json
import os
import sys
import time
import uuid
import warnings
from pathlib import Path

import pytest
import yaml

from ddb2bt.pipeline.local.local_stack import DYNAMODB_EMULATORS, LocalStack, default_dynamodb

warnings.filterwarnings("ignore", message="Connecting to Bigtable emulator")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def stacks(tmp_path_factory):
    """This worker's stacks, one per AWS emulator, each started on first use and
    shared by every test that asks for that emulator."""
    started: dict = {}

    def get(dynamodb: str) -> LocalStack:
        if dynamodb not in started:
            # raises StackError with install instructions when cbtemulator is absent
            started[dynamodb] = LocalStack(log_dir=tmp_path_factory.mktemp(f"stack-logs-{dynamodb}"),
                                           dynamodb=dynamodb).start()
        return started[dynamodb]

    yield get
    for s in started.values():
        s.stop()


@pytest.fixture(scope="session")
def stack(stacks):
    """The default emulator's stack ($DDB2BT_LOCAL_DYNAMODB chooses another), its
    variables set for the whole session."""
    s = stacks(default_dynamodb())
    previous = s.apply_env()
    yield s
    for k, v in previous.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(params=DYNAMODB_EMULATORS)
def emulator_stack(request, stacks, monkeypatch):
    """The test runs once against each AWS emulator (moto and ministack, two
    independent implementations), with that stack's variables set for the test."""
    s = stacks(request.param)
    for k, v in s.env().items():
        monkeypatch.setenv(k, v)
    return s


@pytest.fixture
def unique():
    return uuid.uuid4().hex[:8]


def patch_everywhere(monkeypatch, module, name: str, value) -> None:
    """Replace ``module.name`` and every loaded ddb2bt module's binding of the same
    object: a module that did ``from module import name`` holds its own reference,
    which patching the defining module alone does not reach. Only modules loaded
    now are patched: import the modules that use the name first. (One first
    imported while the patch is active would bind the fake and keep it after the
    test: monkeypatch restores only what it set.)"""
    original = getattr(module, name)
    for loaded in list(sys.modules.values()):
        if getattr(loaded, "__name__", "").startswith("ddb2bt.") and getattr(loaded, name, None) is original:
            monkeypatch.setattr(loaded, name, value)


def wait_for(predicate, timeout: float, what: str, step: float = 0.1, detail=lambda: ""):
    """Polls ``predicate`` every ``step`` s until it returns something truthy (returned),
    or fails after ``timeout`` s naming ``what`` (and ``detail()``, when given)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{detail()}")


def write_mapping(tmp_path: Path, base: str = "product_catalog.yaml", **changes) -> Path:
    """A copy of an example mapping with some fields replaced (dotted paths)."""
    data = yaml.safe_load((ROOT / "examples" / base).read_text())
    for dotted, value in changes.items():
        node = data
        *parents, last = dotted.split("__")
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        node[last] = value
    path = tmp_path / f"mapping-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    return path


# xdist workers per core for `-n logical` (pyproject addopts). The end-to-end tests
# mostly wait (the tail's polls, verify's re-check waits, leases, Beam's start):
# measured, one worker with its emulators used about a fifth of a core, so one
# worker per core left the machine mostly idle. Each worker has its own emulators
# and every test its own tables, so more workers share nothing. Measured on 2 cores
# (the whole suite, one run each, 2026-11-27): 3 workers 547 s, 4 workers ~450-506 s,
# 6 workers 392 s, 8 workers 406 s.
WORKERS_PER_CORE = 3


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: a run with -p no:xdist has no such hook
def pytest_xdist_auto_num_workers(config):
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # an explicit count: xdist's own hook reads it
    return WORKERS_PER_CORE * len(os.sched_getaffinity(0))


# Each test's measured duration (setup + call + teardown, seconds), by node id:
# the order the tests are handed out in. Refreshed with `--store-durations`.
DURATIONS = ROOT / "tests" / "durations.json"
# A test not in DURATIONS yet (a new one): an end-to-end test is assumed to take
# this long (about the median of the stored e2e tests), a `slow` one a minute (its
# marker's meaning), any other a fraction of a second, until the file is refreshed.
UNKNOWN_E2E_S = 18.0
UNKNOWN_SLOW_S = 60.0
UNKNOWN_UNIT_S = 0.1
# Tests expected to take at least this long are each followed by a short test
# (see pytest_collection_modifyitems); below it, queueing behind another test
# costs the run less than a few seconds.
LONG_TEST_S = 5.0


def pytest_addoption(parser):
    parser.addoption("--store-durations", action="store_true",
                     help=f"write each test's duration to {DURATIONS.relative_to(ROOT)} (the order of the next runs)")


def _expected_s(item, durations: dict) -> float:
    if item.nodeid in durations:
        return durations[item.nodeid]
    if item.get_closest_marker("slow") is not None:
        return UNKNOWN_SLOW_S
    return UNKNOWN_E2E_S if item.get_closest_marker("e2e") is not None else UNKNOWN_UNIT_S


def pytest_collection_modifyitems(config, items):
    """Longest first, each long test followed by a short one. xdist hands a worker
    the next test while it runs one (a worker only starts a test once it knows the
    one after it), so the test queued behind a long one waits for it: a second
    long test there would run only when the first ends, while other workers sit
    idle at the end of the run. Queued behind a short test, it starts within a
    second. With every long test started early (longest first) no worker is left
    starting a several-minute test when the others are done."""
    durations = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    ranked = sorted(items, key=lambda item: -_expected_s(item, durations))  # stable: ties keep file order
    long_ = [item for item in ranked if _expected_s(item, durations) >= LONG_TEST_S]
    short = ranked[len(long_):]
    ordered = []
    for item in long_:
        ordered.append(item)
        if short:
            ordered.append(short.pop())  # the shortest left
    items[:] = ordered + short


class _DurationRecorder:
    """Sums each test's phases as the reports arrive (in the controller under
    xdist) and writes them, rounded, when the session ends."""

    def __init__(self) -> None:
        self.durations: dict = {}

    def pytest_runtest_logreport(self, report):
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session):
        stored = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        # a test of a file that is gone is forgotten (a stale entry only moves a test in the order)
        stored = {k: v for k, v in stored.items() if (ROOT / k.split("::")[0]).exists()}
        stored.update({k: round(v, 1) for k, v in self.durations.items()})
        DURATIONS.write_text(json.dumps(dict(sorted(stored.items())), indent=0) + "\n")


def pytest_configure(config):
    # In the controller or a run without workers, never in an xdist worker (whose
    # reports the controller receives too).
    if config.getoption("--store-durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_DurationRecorder(), "ddb2bt-durations")


def ready_but_for_the_tail(out: str) -> bool:
    """``status`` output of a job whose tail has ended (a run with --until-idle)
    where every other condition of READY holds: NOT READY, only because no tail
    runs."""
    last = out.strip().splitlines()[-1]
    return last.startswith("NOT READY: the tail is not running") and "; " not in last
