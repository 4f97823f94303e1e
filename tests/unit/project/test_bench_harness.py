"""The benchmark harness says what it measures (issue 36): bench/run.py's
``--sections`` runs the sections asked for, in the harness's order, and refuses
a name it does not know; its ``unpaced`` block takes the live readers' pacer away
and puts AWS's back afterwards, even when the block fails."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench import run  # noqa: E402
from ddb2bt.pipeline.clients.dynamodb import ShardPacer  # noqa: E402
from ddb2bt.pipeline.source import stream_source  # noqa: E402


def test_sections_run_in_the_harness_order() -> None:
    assert run.parse_sections("lag, throughput,backfill") == ("throughput", "lag", "backfill")


def test_an_unknown_section_is_named() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="unknown section.*verfy.*choose from throughput"):
        run.parse_sections("throughput,verfy")
    with pytest.raises(argparse.ArgumentTypeError, match="none given"):
        run.parse_sections(" , ")


def test_unpaced_takes_the_pacer_away_and_puts_it_back() -> None:
    assert stream_source.ShardPacer is ShardPacer
    with pytest.raises(RuntimeError):
        with run.unpaced():
            pacer = stream_source.ShardPacer()
            pacer.wait("shardId-0")
            assert pacer.ready_in("shardId-0") == 0.0  # a second call may follow at once
            raise RuntimeError("the measured run failed")
    assert stream_source.ShardPacer is ShardPacer


def test_the_unpaced_pacer_takes_every_call_the_real_one_does() -> None:
    # The reader calls the pacer it is given: a parameter added to ShardPacer's
    # methods and not to the stand-in failed the unpaced benchmark at its first
    # round (ready_in's at_least_s), not here.
    import inspect

    methods = {n: m for n, m in inspect.getmembers(ShardPacer, inspect.isfunction) if not n.startswith("_")}
    assert methods, "ShardPacer has public methods"
    for name, method in methods.items():
        stand_in = getattr(run._NoPacer, name, None)
        assert stand_in is not None, f"_NoPacer has no {name}"
        assert list(inspect.signature(stand_in).parameters) == list(inspect.signature(method).parameters), name


def test_the_cores_an_export_needs_are_its_cpu_at_the_live_rate() -> None:
    # bench-20261128-142849: 70.3 + 47.0 us an exported item at the live path's 18,873/s.
    backfill = {"export_client_cpu_us_per_item": 70.3, "export_emulator_cpu_us_per_item": 47.0}
    live = {"changes_per_s": 18_873, "client_cpu_s_per_1M": 40.0, "emulator_cpu_s_per_1M": 30.0}
    out = run.export_cores_at_live_rate(backfill, live)
    assert out["export_cores_needed_at_live_rate"] == 2.21
    assert out["live_cores_used"] == 1.32
    assert out["machine_cores"] >= 1


BENCH = Path(__file__).resolve().parents[3] / "bench"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_every_benchmark_starts_and_explains_itself(script, monkeypatch, capsys) -> None:
    # A benchmark is run by hand, rarely: a name a refactor moved (bench/
    # kinesis_vs_streams.py imported a pacer from a module that no longer had it)
    # must fail here, not on the day someone needs the figure. In this process (a
    # child each would cost a second and a half of CPU for Beam's import alone).
    import importlib.util

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    spec = importlib.util.spec_from_file_location(f"bench_smoke_{script[:-3]}", BENCH / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as done:
        module.main()
    assert done.value.code == 0
    assert "usage" in capsys.readouterr().out.lower()
