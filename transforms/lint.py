"""`ddb2bt lint`: a dry-run report of a mapping against Bigtable's limits and the
schema-design best practices — statically, and over sampled items if given.

Each finding is (level, code, where, message): WARN for what will hurt in
production (hotspots, limits, lost versions, PII in keys), INFO for advice.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional

from ddb2bt.transforms.config import MappingConfig, catch_all, named_attributes
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.limits import MAX_QUALIFIER_BYTES, MAX_ROW_KEY_BYTES
from ddb2bt.transforms.mapping import conditions_hold, expected_cells, select_rule
from ddb2bt.transforms.rowkey import KeyTemplate, Placeholder

WARN, INFO = "WARN", "INFO"
# Near a limit: 75% of it leaves no room for growth.
NEAR_LIMIT = 0.75
# Bigtable's schema rules (cloud.google.com/bigtable/docs/schema-design): few
# families, and short family names and qualifiers, each stored with every cell.
# A mapping with more families than this, a family name longer than
# LONG_FAMILY_NAME characters or a qualifier longer than LONG_QUALIFIER bytes is
# flagged. (A family per entity type, map or set is what these catch; the shipped
# examples stay under them.)
MANY_FAMILIES = 10
LONG_FAMILY_NAME = 12
LONG_QUALIFIER = 64
_TIME_NAME = re.compile(r"(date|time|timestamp|created|updated|modified|^ts$|_at$|At$)", re.I)
_SEQUENTIAL_NAME = re.compile(r"(^id$|_id$|Id$|seq|serial|counter|number$)", re.I)
_PII_NAME = re.compile(r"(e-?mail|phone|mobile|ssn|social|name$|^name|address|birth|dob|passport|credit|card|iban|"
                       r"tax.?id|national.?id|ip.?addr)", re.I)
_ISO_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}")
_SPREADING = {"reverse", "salt", "max_minus"}
# Low-cardinality key prefixes (hotspots). Statically, a key whose first
# placeholder is named like an enum (the last word of OrderStatus, order_type,
# …; or an is_/has_ flag): a handful of values, so all rows of one value form
# one contiguous key range and the common value's writes land on one node.
_ENUM_WORDS = {"status", "state", "type", "kind", "category", "phase", "stage", "level", "priority", "tier",
               "flag", "enabled", "active", "deleted", "gender", "currency", "country", "region", "lang",
               "language", "channel", "mode", "bucket", "class", "group", "color", "colour", "visibility"}
_FLAG_WORDS = {"is", "has"}
_WORDS = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")
# With --sample, measured per key template over the items it is built for (a
# rule's row key: the items the rule maps; an index: those of them it indexes):
# a first placeholder with at most this many distinct values whose most common
# value holds at least DOMINANT_SHARE of those keys. Only judged from LOW_CARDINALITY_MIN_SAMPLE keys up: fewer prove nothing.
LOW_CARDINALITY_DISTINCT = 16
DOMINANT_SHARE = 0.3
LOW_CARDINALITY_MIN_SAMPLE = 20


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


def _rule_templates(mapping: MappingConfig) -> Iterable:
    """(where, template, rule, is_index) for every key template of the mapping."""
    for i, rule in enumerate(mapping.rules):
        if rule.row_key is not None:
            yield f"rules[{i}] {rule.name}: row_key", rule.row_key, rule, False
        for j, index in enumerate(rule.indexes):
            yield f"rules[{i}] {rule.name}: indexes[{j}] {index.name}", index.row_key, rule, True


def placeholder_findings(mapping: MappingConfig) -> list:
    """Key placeholders mapped only through a catch-all (``other_attributes`` in
    mode column, or the ``item_column``): mapped, only not by name, so a note
    says what an item without the attribute gets — no row key, a dead letter;
    no index row (a sparse index, like a GSI). A placeholder the mapping does
    not map at all, or one keystroke from a named attribute, is an error of
    the mapping itself (``config.placeholder_problems``): such a mapping does
    not load. Rules with a hook may make attributes up: skipped."""
    known = named_attributes(mapping.source, mapping.rules, mapping.ttl)
    out = []
    for where, template, rule, is_index in _rule_templates(mapping):
        via = catch_all(rule)
        if rule.hook or via is None:
            continue
        for source in template.sources:
            if source in known or source.startswith("match."):
                continue
            without = ("an item without it gets no index row (the index is sparse)" if is_index else
                       "an item without it has no row key and will be a dead letter")
            out.append(Finding(INFO, "placeholder_via_other", where,
                               f"{{{source}}} is mapped through {via}: {without}"))
    return out


def looks_enum_like(name: str) -> bool:
    """An attribute name that says "one of a few values": its last word is an
    enum word (OrderStatus, order_type) or its first is is/has (isActive)."""
    words = [w.lower() for w in _WORDS.findall(name)]
    return bool(words) and (words[-1] in _ENUM_WORDS or (len(words) > 1 and words[0] in _FLAG_WORDS))


def _leading_placeholder(t: KeyTemplate) -> Optional[Placeholder]:
    """The first placeholder of a key, not spread by salt/reverse/max_minus:
    what its rows are grouped by (a literal before it is the same for every
    row, so it moves the range but does not split it)."""
    for tok in t.tokens:
        if isinstance(tok, Placeholder):
            return None if _SPREADING & {name for name, _ in tok.transforms} else tok
    return None


def low_cardinality_findings(mapping: MappingConfig) -> list:
    out = []
    for where, t, _, _ in _rule_templates(mapping):
        lead = _leading_placeholder(t)
        if lead is not None and looks_enum_like(lead.source):
            out.append(Finding(WARN, "low_cardinality_prefix", where,
                               f"key {t.text!r}: its first variable part, {{{lead.source}}}, looks like one of a "
                               "few values (a status, type or flag): all rows of one value are one contiguous range, "
                               "so the common value's writes land on one node (hotspot). Put a high-cardinality "
                               "value first (the item's id), or salt it ({…|salt:N})"))
    return out


def _mapped_by(mapping: MappingConfig, items: list) -> dict:
    """{id(rule): [item, ...]}: each sampled item under the rule that maps it
    (the first whose conditions hold), as the live path selects it."""
    out: dict = {}
    for item in items:
        keys = {k: item[k] for k in mapping.source.key_attributes if k in item}
        rule, _ = select_rule(mapping, keys, item)
        if rule is not None:
            out.setdefault(id(rule), []).append(item)
    return out


def _sampled_templates(mapping: MappingConfig, items: list) -> Iterable:
    """(where, template, items it maps) for every key template: a rule's row key
    over the items that rule maps, an index's over those of them its conditions
    hold for. Counted per template, not over the whole sample: in a single-table
    design an overloaded index attribute (GSI1PK: an e-mail for customers, a
    status for orders) has hundreds of values over all items and three over the
    orders whose index rows are the hotspot."""
    by_rule = _mapped_by(mapping, items)
    for i, rule in enumerate(mapping.rules):
        mapped = by_rule.get(id(rule), [])
        if rule.row_key is not None:
            yield f"rules[{i}] {rule.name}: row_key", rule.row_key, mapped
        for j, index in enumerate(rule.indexes):
            indexed = [item for item in mapped if conditions_hold(
                index.conditions, {k: item[k] for k in mapping.source.key_attributes if k in item}, item)]
            yield f"rules[{i}] {rule.name}: indexes[{j}] {index.name}", index.row_key, indexed


def _sampled_low_cardinality(mapping: MappingConfig, items: list) -> list:
    out = []
    for where, t, mapped in _sampled_templates(mapping, items):
        lead = _leading_placeholder(t)
        if lead is None:
            continue
        # An item without the attribute gets no row from this key (a sparse
        # index, or a dead letter): it adds nothing to any range.
        values = Counter(repr(sorted(item[lead.source].items())) if isinstance(item[lead.source], dict)
                         else repr(item[lead.source]) for item in mapped if lead.source in item)
        total = sum(values.values())
        if total < LOW_CARDINALITY_MIN_SAMPLE or len(values) > LOW_CARDINALITY_DISTINCT:
            continue
        share = values.most_common(1)[0][1] / total
        if share >= DOMINANT_SHARE:
            # The value itself is not printed: it is item content.
            out.append(Finding(WARN, "low_cardinality_prefix", where,
                               f"{{{lead.source}}}, the key's first variable part, has {len(values)} distinct value(s) in "
                               f"the {total} sampled items this key is built for, the most common in {share:.0%} of "
                               "them: one contiguous range takes most writes (hotspot); put a high-cardinality value "
                               "first or salt it"))
    return out


def _feeding(mapping: MappingConfig, family: str) -> list:
    """The rules whose items get cells in ``family``."""
    out = []
    for rule in mapping.rules:
        families = {c.family for c in rule.columns} | {index.family for index in rule.indexes}
        if rule.other.mode == "column":
            families.add(rule.other.family)
        if rule.item_column is not None:
            families.add(rule.item_column.family)
        if family in families:
            out.append(rule)
    return out


def _requires(rule, attribute: str) -> bool:
    """Whether a rule maps only items carrying ``attribute`` (a ``present`` match on it)."""
    return any(c.attribute == attribute and c.kind == "present" and c.value is True for c in rule.conditions)


def schema_findings(mapping: MappingConfig, sampled: bool = False) -> list:
    """Bigtable's schema rules, statically: few families, short family names and
    qualifiers, and no age-based GC where items carry no TTL (``sampled``: the
    sample decides whether items feeding an aged family carry the TTL attribute,
    ``sampled_schema_findings``)."""
    out = []
    if len(mapping.families) > MANY_FAMILIES:
        out.append(Finding(WARN, "many_families", "families",
                           f"{len(mapping.families)} families: Bigtable advises few (columns read together in one "
                           f"family; more than {MANY_FAMILIES} is flagged). A family per entity type, map or set "
                           "is not needed: the row key tells the types apart, and a map or set fits one cell "
                           "(encoding json or dynamodb_json)"))
    for fam in mapping.families:
        if len(fam.name) > LONG_FAMILY_NAME:
            out.append(Finding(WARN, "long_family_name", f"families.{fam.name}",
                               f"a {len(fam.name)}-character family name is stored with every cell: keep it to "
                               f"{LONG_FAMILY_NAME} or fewer (one letter is common: d, idx)"))
        if fam.max_age_seconds and mapping.ttl is None:
            out.append(Finding(WARN, "age_gc_without_ttl", f"families.{fam.name}",
                               f"max_age_seconds {fam.max_age_seconds}: garbage collection deletes every cell of this "
                               "family older than that, counted from its write (a backfilled cell from the "
                               "backfill), while DynamoDB keeps the item: the mapping has no ttl, so nothing says "
                               "these items expire. Remove max_age_seconds (deletions arrive through the stream)"))
        elif fam.max_age_seconds and not sampled:
            unsure = [rule.name for rule in _feeding(mapping, fam.name) if not _requires(rule, mapping.ttl.attribute)]
            if unsure:
                out.append(Finding(WARN, "age_gc_without_ttl", f"families.{fam.name}",
                                   f"max_age_seconds {fam.max_age_seconds}: garbage collection deletes every cell of "
                                   "this family older than that (a backfilled cell counts from the backfill), but "
                                   f"rule(s) {', '.join(unsure)} feed it without requiring {mapping.ttl.attribute}: "
                                   "the cells of an item without it are deleted while DynamoDB keeps it. Remove "
                                   f"max_age_seconds, match {{attribute: {mapping.ttl.attribute}, present: true}}, "
                                   "or check with lint --sample that every item feeding it carries it"))
    for i, rule in enumerate(mapping.rules):
        for col in rule.columns:
            if col.qualifier_template is None and len(col.qualifier) > LONG_QUALIFIER:
                out.append(Finding(WARN, "long_qualifier", f"rules[{i}] {rule.name}: columns.{col.attribute}",
                                   f"a {len(col.qualifier)}-byte qualifier is stored with every cell: keep it to "
                                   f"{LONG_QUALIFIER} bytes or fewer"))
    return out


def _feeds(mapping: MappingConfig, items: list) -> tuple:
    """({family: [item, ...]}, {family: longest qualifier}): the sampled items
    each family gets cells from, and the longest qualifier they make there."""
    fed: dict = {}
    longest: Counter = Counter()
    for item in items:
        try:
            cells = expected_cells(mapping, item)
        except MappingError:
            continue
        for family in {c.family for c in cells.values()}:
            fed.setdefault(family, []).append(item)
        for cell in cells.values():
            longest[cell.family] = max(longest[cell.family], len(cell.qualifier))
    return fed, longest


def sampled_schema_findings(mapping: MappingConfig, items: list) -> list:
    """The schema rules over sampled items: an age-based GC on a family fed by
    items without the TTL attribute, an index attached to items that never carry
    its key attributes, qualifiers longer than LONG_QUALIFIER bytes."""
    out = []
    feeds, longest = _feeds(mapping, items)
    aged = {f.name: f for f in mapping.families if f.max_age_seconds}
    if mapping.ttl is not None:
        for name, fam in sorted(aged.items()):
            fed = feeds.get(name, [])
            without = sum(1 for item in fed if mapping.ttl.attribute not in item)
            if without:
                out.append(Finding(WARN, "age_gc_without_ttl", f"families.{name}",
                                   f"max_age_seconds {fam.max_age_seconds}, but {without} of the {len(fed)} sampled "
                                   f"items feeding it carry no {mapping.ttl.attribute}: DynamoDB keeps them, and "
                                   "garbage collection deletes their cells once that old (a backfilled cell counts "
                                   "from the backfill). Remove max_age_seconds, or keep it only on a family fed by "
                                   "expiring items alone"))
    by_rule = _mapped_by(mapping, items)
    for i, rule in enumerate(mapping.rules):
        mapped = by_rule.get(id(rule), [])
        for j, index in enumerate(rule.indexes):
            needed = sorted({s for s in index.row_key.sources if not s.startswith("match.")}
                            - set(mapping.source.key_attributes))
            if mapped and needed and not any(all(a in item for a in needed) for item in mapped):
                out.append(Finding(WARN, "index_without_keys", f"rules[{i}] {rule.name}: indexes[{j}] {index.name}",
                                   f"none of the {len(mapped)} sampled items this rule maps carries "
                                   f"{', '.join(needed)}: the index is attached to items that make no index row "
                                   "(a GSI holds only the items carrying its keys); attach it to the rules whose "
                                   "items carry them"))
    for family, n in sorted((f, n) for f, n in longest.items() if n > LONG_QUALIFIER):
        out.append(Finding(WARN, "long_qualifier", f"families.{family}",
                           f"sampled qualifiers up to {n} bytes (attribute names or map keys): each is stored with "
                           f"every cell; keep them to {LONG_QUALIFIER} bytes or fewer (rename in a column spec, or "
                           "keep the map in one cell)"))
    return out


def static_findings(mapping: MappingConfig, sampled: bool = False) -> list:
    out: list = placeholder_findings(mapping) + low_cardinality_findings(mapping) + schema_findings(mapping, sampled)
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
    findings = static_findings(mapping, sampled=items is not None)
    if items is not None:
        items = list(items)
        findings += sample_findings(mapping, items) + sampled_schema_findings(mapping, items)
        flagged = {f.where for f in findings if f.code == "low_cardinality_prefix"}
        findings += [f for f in _sampled_low_cardinality(mapping, items) if f.where not in flagged]
    return findings
