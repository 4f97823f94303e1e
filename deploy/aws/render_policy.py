"""Fill a policy template of deploy/aws/ and print it as one line of JSON.

    python3 deploy/aws/render_policy.py deploy/aws/permissions-policy.json \
        AWS_REGION=eu-west-1 AWS_ACCOUNT=123456789012 TABLE=Orders TABLE=Customers

``${NAME}`` placeholders are replaced; a name given several times (TABLE) turns
every string holding it into one string per value. Statements that need the
export bucket are dropped when EXPORT_BUCKET is not given (a Scan backfill).
A placeholder left without a value is an error naming it. Standard library only
(deploy/aws/setup.sh runs it with the system python3).
"""
from __future__ import annotations

import json
import re
import sys

OPTIONAL = ("EXPORT_BUCKET", "EXPORT_PREFIX")
_PLACEHOLDER = re.compile(r"\$\{([A-Z_]+)\}")


def _names(node) -> set:
    if isinstance(node, str):
        return set(_PLACEHOLDER.findall(node))
    if isinstance(node, list):
        return set().union(*map(_names, node)) if node else set()
    if isinstance(node, dict):
        return set().union(*map(_names, node.values())) if node else set()
    return set()


def _fill(node, values: dict):
    if isinstance(node, str):
        out = [node]
        for name in _PLACEHOLDER.findall(node):
            out = [s.replace("${%s}" % name, v) for s in out for v in values[name]]
        return out if len(out) > 1 else out[0]
    if isinstance(node, list):
        filled = []
        for item in node:
            value = _fill(item, values)
            filled.extend(value if isinstance(item, str) and isinstance(value, list) else [value])
        return filled
    if isinstance(node, dict):
        return {k: _fill(v, values) for k, v in node.items()}
    return node


def render(template: dict, values: dict) -> dict:
    """``values``: name → list of values."""
    policy = dict(template)
    if not values.get("EXPORT_BUCKET"):
        policy["Statement"] = [s for s in template["Statement"] if not _names(s) & set(OPTIONAL)]
    values = {**values, "EXPORT_PREFIX": values.get("EXPORT_PREFIX") or [""]}
    missing = sorted(_names(policy) - set(values))
    if missing:
        raise SystemExit(f"render_policy: no value for {', '.join(missing)}")
    return _fill(policy, values)


def main(argv: list) -> int:
    if not argv or "=" in argv[0]:
        raise SystemExit(__doc__)
    values: dict = {}
    for pair in argv[1:]:
        name, sep, value = pair.partition("=")
        if not sep or not value:
            raise SystemExit(f"render_policy: expected NAME=VALUE, got {pair!r}")
        values.setdefault(name, []).append(value)
    with open(argv[0], encoding="utf-8") as fh:
        print(json.dumps(render(json.load(fh), values), separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
