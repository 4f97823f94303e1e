"""`ddb2bt lint`: a dry-run report of a mapping against Bigtable's limits and the
schema-design best practices — statically, and over sampled items if given.

Each finding is (level, code, where, message): WARN for what will hurt in
production (hotspots, limits, lost versions, PII in keys), INFO for advice.
"""
from __future__ import annotations

import difflib
import re
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional

from ddb2bt.transforms.config import MappingConfig
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.limits import MAX_QUALIFIER_BYTES, MAX_ROW_KEY_BYTES
from ddb2bt.transforms.mapping import expected_cells, select_rule
from ddb2bt.transforms.rowkey import KeyTemplate, Placeholder

WARN, INFO = "WARN", "INFO"
# Near a limit: 75% of it leaves no room for growth.
NEAR_LIMIT = 0.75
FAMILIES_ADVISED = 30
_TIME_NAME = re.compile(r"(date|time|timestamp|created|updated|modified|^ts$|_at$|At$)", re.I)
_SEQUENTIAL_NAME = re.compile(r"(^id$|_id$|Id$|seq|serial|counter|number$)", re.I)
_PII_NAME = re.compile(r"(e-?mail|phone|mobile|ssn|social|name$|^name|address|birth|dob|passport|credit|card|iban|"
                       r"tax.?id|national.?id|ip.?addr)", re.I)
_ISO_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}")
_SPREADING = {"reverse", "salt", "max_minus"}


@dataclass(frozen=True)
class Finding:
    level: str
    code: str
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.level} {self.code:<22} {self.where}: {self.message}"


def _first_placeholder(t: KeyTemplate) -> Optional[Placeholder]:
    first = t.tokens[0]
    return first if isinstance(first, Placeholder) else None


def _templates(mapping: MappingConfig) -> Iterable:
    for i, rule in enumerate(mapping.rules):
        if rule.row_key is not None:
            yield f"rules[{i}] {rule.name}: row_key", rule.row_key
        for j, index in enumerate(rule.indexes):
            yield f"rules[{i}] {rule.name}: indexes[{j}] {index.name}", index.row_key


def _known_attributes(mapping: MappingConfig) -> set:
    """Attributes the mapping names anywhere: keys, columns, conditions, timestamps."""
    known = set(mapping.source.key_attributes)
    for rule in mapping.rules:
        known.update(c.attribute for c in rule.columns)
        known.update(c.timestamp.attribute for c in rule.columns if c.timestamp is not None)
        known.update(cond.attribute for cond in rule.conditions)
        for index in rule.indexes:
            known.update(index.project)
            known.update(cond.attribute for cond in index.conditions)
    return known


def placeholder_findings(mapping: MappingConfig) -> list:
    """Row-key placeholders that name an attribute the mapping knows nothing of
    (neither a key attribute nor mapped anywhere): likely a typo, and then every
    item lacking it is a dead letter. Rules with a hook may make up attributes."""
    known = _known_attributes(mapping)
    out = []
    hooked = {rule.name for rule in mapping.rules if rule.hook}
    for where, template in _templates(mapping):
        if any(f" {name}:" in where for name in hooked):
            continue
        for source in template.sources:
            if source not in known:
                close = difflib.get_close_matches(source, sorted(known), n=1)
                hint = f" (did you mean {{{close[0]}}}?)" if close else ""
                out.append(Finding(WARN, "unknown_placeholder", where,
                                   f"{{{source}}} is neither a key attribute nor mapped anywhere{hint}: every "
                                   "item without it will be a dead letter"))
    return out


def static_findings(mapping: MappingConfig) -> list:
    out: list = placeholder_findings(mapping)
    for where, t in _templates(mapping):
        first = _first_placeholder(t)
        if first is not None and not _SPREADING & {name for name, _ in first.transforms}:
            if _TIME_NAME.search(first.source):
                out.append(Finding(WARN, "timestamp_first_key", where,
                                   f"key starts with {{{first.source}}}, which looks like a time: sequential "
                                   "writes all land on one node (hotspot). Put a high-cardinality value first, "
                                   "or salt it ({…|salt:N})"))
            elif _SEQUENTIAL_NAME.search(first.source) and first.source not in mapping.source.key_attributes:
                out.append(Finding(INFO, "maybe_sequential_key", where,
                                   f"key starts with {{{first.source}}}: if it is a sequential id, reverse or "
                                   "salt it to spread writes"))
        for tok in t.tokens:
            if isinstance(tok, Placeholder) and _PII_NAME.search(tok.source):
                out.append(Finding(WARN, "pii_in_row_key", where,
                                   f"{{{tok.source}}} looks like personal data; row keys show up in logs, "
                                   "monitoring and tablet boundaries — prefer an opaque id"))
    family_use: dict = {}
    for i, rule in enumerate(mapping.rules):
        for col in rule.columns:
            family_use.setdefault(col.family, set()).add("versioned" if col.versioned else
                                                         "list" if col.kind == "list_versions" else "single")
        if rule.other.mode == "column":
            family_use.setdefault(rule.other.family, set()).add("single")
    families = {f.name: f for f in mapping.families}
    for name, uses in sorted(family_use.items()):
        fam = families.get(name)
        if fam is None:
            continue
        many = {"versioned", "list"} & uses
        if "list" in uses and fam.max_versions is not None and fam.max_versions < 2:
            out.append(Finding(WARN, "versions_collected", f"families.{name}",
                               f"keeps {fam.max_versions} version but holds list columns (one version per "
                               "element): garbage collection will drop all but the last element"))
        elif many and fam.max_versions is not None and fam.max_versions < 2:
            out.append(Finding(INFO, "versions_collected", f"families.{name}",
                               f"keeps {fam.max_versions} version and holds columns timestamped by an attribute: "
                               "fine while one item owns each column; if several items share one (like "
                               "comments), raise max_versions (lint --sample checks)"))
        if many and "single" in uses:
            out.append(Finding(WARN, "mixed_retention", f"families.{name}",
                               "mixes single-value columns with versioned/list columns: GC is per family, so "
                               "they cannot get different retention; give the versioned data its own family"))
    if len(mapping.families) > FAMILIES_ADVISED:
        out.append(Finding(INFO, "many_families", "families",
                           f"{len(mapping.families)} families: every family is a separate storage unit; "
                           "keep the count small (Bigtable's ceiling is about 100)"))
    if mapping.ttl is not None and mapping.ttl.deletions == "ignore" and not any(f.max_age_seconds for f in mapping.families):
        out.append(Finding(WARN, "ttl_never_expires", "ttl",
                           "TTL deletions are ignored but no family has max_age_seconds: expired items "
                           "stay in Bigtable forever"))
    for i, rule in enumerate(mapping.rules):
        if rule.other.mode == "ignore":
            out.append(Finding(INFO, "attributes_ignored", f"rules[{i}] {rule.name}",
                               "unlisted attributes are dropped on purpose (other_attributes: ignore)"))
    return out


def sample_findings(mapping: MappingConfig, items: Iterable) -> list:
    """Findings from real items: unmatched items, unmappable ones, keys and
    qualifiers near the limits, timestamp-looking key prefixes, version clashes."""
    out: list = []
    unmatched = 0
    errors: Counter = Counter()
    first_error: dict = {}  # reason -> the first item's message (an example for the finding)
    max_key = max_qual = 0
    first_parts: list = []
    versions: Counter = Counter()
    count = 0
    for item in items:
        count += 1
        keys = {k: item[k] for k in mapping.source.key_attributes if k in item}
        rule, _ = select_rule(mapping, keys, item)
        if rule is None:
            unmatched += 1
        try:
            cells = expected_cells(mapping, item)
        except MappingError as exc:
            errors[exc.reason] += 1
            first_error.setdefault(exc.reason, exc.message)
            continue
        for cell in cells.values():
            max_key = max(max_key, len(cell.row_key))
            max_qual = max(max_qual, len(cell.qualifier))
            if cell.version_ms is not None:
                versions[(cell.table, cell.row_key, cell.family, cell.qualifier, cell.version_ms)] += 1
            if cell.table == mapping.target.table:
                first_parts.append(cell.row_key.split(mapping.delimiter.encode(), 1)[0])
    if count == 0:
        return [Finding(INFO, "empty_sample", "sample", "no items sampled")]
    if unmatched and mapping.unmatched == "dead_letter":
        out.append(Finding(WARN, "unmatched_items", "rules",
                           f"{unmatched} of {count} sampled items match no rule: they would be dead letters"))
    for reason, n in errors.most_common():
        if reason == "timestamp_unit":
            out.append(Finding(WARN, "timestamp_unit", "sample",
                               f"{n} of {count} sampled items have a timestamp attribute in the other unit than "
                               f"the column's format ({first_error[reason]}): they would be dead letters"))
            continue
        out.append(Finding(WARN, "unmappable_items", "sample",
                           f"{n} of {count} sampled items cannot be mapped ({reason}): they would be dead letters"))
    if max_key > NEAR_LIMIT * MAX_ROW_KEY_BYTES:
        out.append(Finding(WARN, "row_key_near_limit", "sample",
                           f"longest row key {max_key} bytes, limit {MAX_ROW_KEY_BYTES} (shorter keys are faster)"))
    if max_qual > NEAR_LIMIT * MAX_QUALIFIER_BYTES:
        out.append(Finding(WARN, "qualifier_near_limit", "sample",
                           f"longest qualifier {max_qual} bytes, limit {MAX_QUALIFIER_BYTES}"))
    if first_parts and sum(1 for p in first_parts if _ISO_DATE.match(p.decode("utf-8", "replace")))\
            > len(first_parts) / 2:
        out.append(Finding(WARN, "timestamp_first_key", "sample",
                           "most sampled row keys start with a date: writes will hotspot"))
    shared: Counter = Counter()
    for (table, row, family, qualifier, _), n in versions.items():
        shared[(table, family, row, qualifier)] += 1
    families = {f.name: f for f in mapping.families}
    for (table, family, row, qualifier), n in shared.items():
        fam = families.get(family)
        if table == mapping.target.table and fam is not None and fam.max_versions is not None and n > fam.max_versions:
            out.append(Finding(WARN, "versions_collected", f"families.{family}",
                               f"a sampled column holds {n} versions from different items but the family keeps "
                               f"{fam.max_versions}: garbage collection will drop the oldest"))
            break
    clashes = sum(1 for n in versions.values() if n > 1)
    if clashes:
        out.append(Finding(WARN, "version_clash", "sample",
                           f"{clashes} versioned cells are claimed by more than one item (same row, column and "
                           "timestamp): the first written keeps it, later ones are refused as dead letters "
                           "(version_clash); make the version unique (a finer timestamp attribute)"))
    out.append(Finding(INFO, "sampled", "sample", f"{count} items checked; longest row key {max_key} bytes"))
    return out


def lint(mapping: MappingConfig, items: Optional[Iterable] = None) -> list:
    findings = static_findings(mapping)
    if items is not None:
        findings += sample_findings(mapping, items)
    return findings
