"""The wheel lists its packages by name (pyproject.toml, [tool.setuptools]):
a new subpackage left off that list is missing on Dataflow's workers and in
the Flex Template image, though every test run from the checkout finds it."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def subpackages(package_dir: dict) -> set:
    """Every package under the mapped folders, by its installed name."""
    out = set()
    for name, folder in package_dir.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "__pycache__" not in rel.parts:
                out.add(".".join([name, *rel.parts]))
    return out


def test_every_package_of_the_checkout_is_in_the_wheel():
    # Read with a pattern, not tomllib: Python 3.10 (supported) has no tomllib.
    text = (ROOT / "pyproject.toml").read_text()
    package_dir = dict(re.findall(r'"([\w.]+)" = "(\w+)"', re.search(r"^package-dir = \{(.*)\}$", text, re.M).group(1)))
    listed = set(re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*?)\]", text, re.M | re.S).group(1)))
    found = subpackages(package_dir)
    assert "ddb2bt.pipeline.clients.bigtable" in found  # the walk reaches nested packages
    assert "ddb2bt.pipeline.clients.bigtable" in listed  # and the list is read whole
    assert sorted(found - listed) == []
