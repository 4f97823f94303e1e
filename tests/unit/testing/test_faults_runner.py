"""The fault-injection runner: its own options before "--", the ddb2bt command
line after it, untouched, in either order of SPEC and --log."""
from __future__ import annotations

import pickle

from ddb2bt.pipeline.testing import faults
from tests.conftest import ROOT

MAPPING = str(ROOT / "examples/product_catalog.yaml")


def test_runner_passes_the_command_line_through(tmp_path, capsys):
    log = str(tmp_path / "faults.log")
    assert faults.main(["unavailable=0.1", "--log", log, "--", "validate", "--mapping", MAPPING]) == 0
    assert faults.main(["--log", log, "unavailable=0.1", "--", "validate", "--mapping", MAPPING]) == 0
    assert capsys.readouterr().out.count("OK:") == 2


def test_interceptor_survives_pickling_with_its_settings(tmp_path):
    injector = faults.FaultInterceptor.from_spec("unavailable=0.5,latency_ms=3,seed=4", str(tmp_path / "f.log"))
    copy = pickle.loads(pickle.dumps(injector))
    assert copy.__getstate__() == injector.__getstate__()
    assert [copy._draw() for _ in range(20)] == [injector._draw() for _ in range(20)]  # same seed, same faults
