"""Shared fixtures. The emulator stack is started once per session by the same
code as `ddb2bt local`; if cbtemulator or moto is missing the fixture raises and
every test that needs it FAILS (it never skips)."""
from __future__ import annotations

import os
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
# and every test its own tables, so more workers share nothing.
WORKERS_PER_CORE = 2


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: a run with -p no:xdist has no such hook
def pytest_xdist_auto_num_workers(config):
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # an explicit count: xdist's own hook reads it
    return WORKERS_PER_CORE * len(os.sched_getaffinity(0))


def pytest_collection_modifyitems(config, items):
    """Start the `slow` tests first. With one test handed out at a time
    (`--maxschedchunk 1`), longest-first keeps every worker busy to the end instead
    of one worker starting a several-minute test when the others are done."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
