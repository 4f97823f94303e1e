"""The example mappings that ship inside the package (``ddb2bt.examples``).

They are package data, so ``ddb2bt demo``, ``ddb2bt examples`` and
``--mapping example:NAME`` work from an installed wheel in any directory, not
only from a checkout of the repository.
"""
from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

from ddb2bt.transforms.errors import ConfigError

__all__ = ["EXAMPLE_PREFIX", "example_names", "example_path", "copy_examples", "resolve_mapping_path"]

PACKAGE = "ddb2bt.examples"
EXAMPLE_PREFIX = "example:"  # --mapping example:product_catalog names a packaged example
SUFFIX = ".yaml"


def _root() -> Path:
    # The examples are plain files inside the installed package (wheels are
    # unpacked), so a real path can be handed to the mapping loader.
    return Path(str(resources.files(PACKAGE)))


def example_names() -> list[str]:
    return sorted(p.name[: -len(SUFFIX)] for p in _root().iterdir() if p.name.endswith(SUFFIX))


def example_path(name: str) -> Path:
    """The file of one packaged example, by name (``product_catalog``) or file name."""
    stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name
    path = _root() / (stem + SUFFIX)
    if not path.is_file():
        raise ConfigError(f"no packaged example named {name!r}; the examples are: {', '.join(example_names())}")
    return path


def copy_examples(dest: Path) -> list[Path]:
    """Copy every packaged example into ``dest`` (created); existing files are kept."""
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in example_names():
        target = dest / (name + SUFFIX)
        if not target.exists():
            shutil.copyfile(example_path(name), target)
            copied.append(target)
    return copied


def resolve_mapping_path(value: str) -> str:
    """``example:NAME`` → the packaged file; anything else is returned unchanged."""
    if value.startswith(EXAMPLE_PREFIX):
        return str(example_path(value[len(EXAMPLE_PREFIX):]))
    return value
