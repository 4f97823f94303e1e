"""Which mapping a job runs, and what changed when it starts with another.

The job records the outline of its mapping (transforms/fingerprint.py) in its
state once its tail runs (`run`, `migrate`: a local job as it starts, a remote
one once its launch was accepted); a start with a different mapping is
told, line by line, what changed, and is recorded from then on. A verify
records the fingerprint it checked, so `status` is READY only after a verify of
the mapping the job now runs (docs/cutover.md, "Changing the mapping").
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Callable, Optional

from ddb2bt.transforms.config import MappingConfig
from ddb2bt.transforms.fingerprint import describe_changes, mapping_outline, outline_fingerprint

__all__ = ["MAPPING_META", "MappingChange", "fingerprint_of", "record_mapping", "running_mapping"]

log = logging.getLogger(__name__)

MAPPING_META = "mapping"  # meta row: {"fingerprint", "outline", "since_ms", "previous"}


@dataclass(frozen=True)
class MappingChange:
    """A start with a mapping other than the one the job ran."""

    previous: str  # fingerprints
    current: str
    changes: tuple  # one line per difference (fingerprint.describe_changes)


def fingerprint_of(mapping: MappingConfig) -> str:
    return outline_fingerprint(mapping_outline(mapping))


def running_mapping(store) -> Optional[dict]:
    """What the job recorded: {"fingerprint", "outline", "since_ms", "previous"} or None."""
    text = store.load_meta(MAPPING_META)
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def record_mapping(store, mapping: MappingConfig, now_ms: Callable[[], int]) -> Optional[MappingChange]:
    """Record ``mapping`` as the one the job runs; the change from the one it
    ran before, if any (None: the same, or the first record)."""
    outline = mapping_outline(mapping)
    fingerprint = outline_fingerprint(outline)
    before = running_mapping(store)
    if before is not None and before.get("fingerprint") == fingerprint:
        return None
    store.save_meta(MAPPING_META, json.dumps({"fingerprint": fingerprint, "outline": outline, "since_ms": now_ms(),
                                              "previous": before.get("fingerprint") if before else None},
                                             sort_keys=True))
    if before is None:
        return None
    return MappingChange(before.get("fingerprint", ""), fingerprint,
                         tuple(describe_changes(before.get("outline"), outline)))


def change_notice(name: str, change: MappingChange, flags: str, recopying: bool = False) -> str:
    """What a user starting a job with a changed mapping is told. ``recopying``:
    the command is the re-copy itself (`migrate --restart`), which is not advised
    to the user running it."""
    lines = [f"ddb2bt: the mapping of {name} changed since this job last ran "
             f"({change.previous} → {change.current}):"]
    lines += [f"  - {line}" for line in change.changes] or ["  - (no difference in what it writes)"]
    if recopying:
        lines.append("  This re-copy (migrate --restart) brings the whole table under the new mapping and removes what "
                     f"only the old one wrote; once it is LIVE: ddb2bt verify {flags} (status is NOT READY until a "
                     "verify of the new mapping).")
        return "\n".join(lines)
    lines.append("  The tail applies the new mapping to changes from now on, but what the old mapping wrote stays: "
                 "items that do not change keep it all, changed items keep the cells the new mapping no longer "
                 "writes, and a deleted item's rows under the old mapping's row keys stay. To bring the whole table "
                 f"under the new mapping and remove what only the old one wrote, re-copy it: ddb2bt migrate --restart "
                 f"{flags}, then ddb2bt verify {flags} (status is NOT READY until a verify of the new mapping).")
    return "\n".join(lines)
