"""The package as users install it: one top-level name, examples as package data,
the console script working from an empty directory, and no test double reachable
from production code."""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TESTING = "ddb2bt.pipeline.testing"


def _imports(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_production_module_imports_the_testing_package():
    production = [p for folder in ("pipeline", "transforms") for p in (ROOT / folder).rglob("*.py")
                  if "testing" not in p.relative_to(ROOT).parts]
    assert len(production) > 30
    offenders = {str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith(TESTING))
                 for p in production}
    assert {k: v for k, v in offenders.items() if v} == {}
    # The check can fail: the testing package itself does import what it tests.
    assert any(n.startswith("ddb2bt.pipeline") for n in _imports(ROOT / "pipeline/testing/faults.py"))


def test_wheel_installs_one_top_level_name_and_runs_from_an_empty_directory(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(dist), str(ROOT)],
                   check=True, cwd=tmp_path)
    (wheel,) = dist.glob("ddb2bt-*.whl")
    tops = {name.split("/", 1)[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"ddb2bt"}, tops
    names = zipfile.ZipFile(wheel).namelist()
    assert "ddb2bt/examples/product_catalog.yaml" in names and "ddb2bt/transforms/mapping.schema.json" in names
    assert not any(n.startswith("ddb2bt/tests") or "/conftest" in n for n in names)
    assert any(re.fullmatch(r"ddb2bt/transforms/rowwriter_c\..*\.so", n) for n in names), names  # the C row writer

    # A fresh venv with only the wheel installed (no editable install, no source
    # tree on the path). Its dependencies are borrowed from this interpreter's
    # site-packages through a path entry (.pth files there are not executed, so
    # the development install of ddb2bt stays invisible) instead of downloading
    # Beam and the clients again.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), "install", "--quiet",
                    "--no-deps", str(wheel)], check=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}

    def ddb2bt(*args, stdin: str = "") -> str:
        out = subprocess.run([str(venv / "bin/ddb2bt"), *args], cwd=empty, env=env, input=stdin,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    where = subprocess.run([str(venv / "bin/python"), "-c", "import ddb2bt.pipeline as m; print(m.__file__)"],
                           cwd=empty, env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site)), where
    native = subprocess.run([str(venv / "bin/python"), "-c", "from ddb2bt.transforms import rowwriter as r; "
                             "print(r.NATIVE, r.rowwriter_c.__file__)"],
                            cwd=empty, env=env, capture_output=True, text=True, check=True).stdout
    assert native.startswith("True " + str(site)), native
    assert "migrate" in ddb2bt("--help")
    listed = ddb2bt("examples")
    assert "example:product_catalog" in listed and str(site) in listed
    item = '{"pk": {"S": "hats"}, "sk": {"S": "fedoras#brandA"}, "Price": {"N": "12"}}'
    shown = ddb2bt("explain", "-m", "example:product_catalog", "--item", "-", stdin=item)
    assert "hats#fedoras#brandA" in shown and "SKU:Price" in shown
    ddb2bt("examples", "--copy", "mappings")
    assert sorted(p.name for p in (empty / "mappings").iterdir()) == [
        "hr_orders.yaml", "invoices.yaml", "product_catalog.yaml", "videos.yaml"]
    shown = ddb2bt("explain", "-m", "mappings/product_catalog.yaml", "--item", "-", stdin=item)
    assert "hats#fedoras#brandA" in shown


def test_without_a_c_compiler_the_wheel_builds_and_leaves_the_c_writer_out(tmp_path):
    """The C row writer is optional (pyproject.toml): a machine without a
    compiler still installs ddb2bt, and the generated Python writes the rows
    (transforms/rowwriter.py; the mapping stage says so at WARNING)."""
    # The checkout's files alone: a build/ folder left by an earlier build would
    # hold a compiled writer that setuptools reuses without compiling.
    source = tmp_path / "source"
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    env = dict(os.environ, CC="false", LDSHARED="false")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path), str(source)],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("ddb2bt-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "ddb2bt/transforms/rowwriter.py" in names
    assert not any(n.endswith(".so") for n in names), names
