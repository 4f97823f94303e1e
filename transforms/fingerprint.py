"""What a mapping writes, as a plain outline; its fingerprint; and what changed
between two outlines, in words.

A running job records the outline of the mapping it runs (docs/cutover.md,
"Changing the mapping"): a start with another mapping is told what changed, and
`status` is READY only after a verify of the mapping now running. The outline
holds what decides the cells written — source keys, target, families, each
rule's match, row key, columns, indexes, other attributes, TTL — and leaves out
what does not (file name, description, comments, formatting), so reformatting a
file is no change. Pure: no I/O.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

from ddb2bt.transforms.config import ColumnConfig, MappingConfig, RuleConfig

__all__ = ["mapping_outline", "outline_fingerprint", "describe_changes"]


def _text(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return value


def _column(c: ColumnConfig) -> str:
    where = c.qualifier_template.text if c.qualifier_template is not None else _text(c.qualifier)
    out = f"{c.family}:{where} {c.encoding}"
    if c.kind != "value":
        out += f" as {c.kind}"
    if c.timestamp is not None:
        out += f" at {c.timestamp.attribute} ({c.timestamp.format})"
    return out


def _rule(r: RuleConfig) -> dict:
    return {
        "match": [f"{m.attribute} {m.kind} {_text(m.value)}" for m in r.conditions],
        "skip": r.skip,
        "row_key": r.row_key.text if r.row_key is not None else None,
        "columns": {c.attribute: _column(c) for c in r.columns},
        "other_attributes": f"{r.other.mode} {r.other.family or ''} {r.other.encoding}".strip(),
        "include_key_attributes": r.include_key_attributes,
        "item_column": None if r.item_column is None else
        f"{r.item_column.family}:{_text(r.item_column.qualifier)} {r.item_column.encoding}",
        "indexes": {ix.name: {"row_key": ix.row_key.text, "family": ix.family, "table": ix.table,
                              "match": [f"{m.attribute} {m.kind} {_text(m.value)}" for m in ix.conditions],
                              "project": list(ix.project)} for ix in r.indexes},
        "hook": r.hook,
    }


def mapping_outline(mapping: MappingConfig) -> dict:
    """JSON-ready: what the mapping writes (see the module docstring)."""
    s, t = mapping.source, mapping.target
    return {
        "source": {"table": s.table, "partition_key": s.partition_key, "sort_key": s.sort_key},
        "target": {"project": t.project, "instance": t.instance, "table": t.table},
        "families": {f.name: f"max_versions={f.max_versions} max_age_seconds={f.max_age_seconds} gc={f.gc}"
                     for f in mapping.families},
        "rules": {r.name: _rule(r) for r in mapping.rules},
        "rule_order": [r.name for r in mapping.rules],
        "delimiter": mapping.delimiter,
        "unmatched": mapping.unmatched,
        "ttl": None if mapping.ttl is None else f"{mapping.ttl.attribute} deletions={mapping.ttl.deletions}",
    }


def outline_fingerprint(outline: dict) -> str:
    """A short, stable digest of an outline (canonical JSON, SHA-256)."""
    text = json.dumps(outline, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe_changes(old: Optional[dict], new: dict) -> list:
    """One line per difference between two outlines: rules, columns, indexes,
    families, row keys, source and target. [] when they are the same."""
    if old is None:
        return []
    out: list = []
    _diff(old, new, [], out)
    return out


# How each level of the outline is named in a change's line.
_NAMES = {"rules": "rule", "families": "family", "columns": "column", "indexes": "index"}


def _diff(old: Any, new: Any, path: list, out: list) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        # Inside a named collection ("rules"), an entry is "rule NAME" and the
        # collection's own name leaves the path: "rule order column Status".
        kind = _NAMES.get(path[-1]) if path else None
        base = path[:-1] if kind else path
        for key in sorted(set(old) | set(new), key=str):
            sub = base + [f"{kind} {key}" if kind else str(key).replace("_", " ")]
            if key not in old:
                out.append(f"{' '.join(sub)}: added ({_show(new[key])})")
            elif key not in new:
                out.append(f"{' '.join(sub)}: removed (was {_show(old[key])})")
            else:
                _diff(old[key], new[key], sub, out)
        return
    if old != new:
        out.append(f"{' '.join(path) or 'mapping'}: {_show(new)} (was {_show(old)})")


def _show(value: Any) -> str:
    if isinstance(value, dict):
        if value and all(isinstance(v, str) for v in value.values()):
            return ", ".join(f"{k} {v}" for k, v in sorted(value.items()))
        return "…" if value else "none"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) or "none"
    return str(value)
