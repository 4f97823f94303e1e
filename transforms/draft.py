"""`ddb2bt draft`: a first mapping and an assessment, from the table itself.

Pure: DescribeTable (with DescribeTimeToLive and DescribeContinuousBackups) and
a sample of items in, a commented mapping document, an assessment and split
points out. No I/O, no Beam: the reads are ``ddb2bt.pipeline.services.draft``'s.

What it guesses, and why, is documented rule by rule in docs/mapping.md
("Drafting a mapping"). It follows the Bigtable-for-DynamoDB guide (row key
``pk#sk``, int64 only for integers, index rows for GSIs as in example 4) and
Bigtable's schema rules, which ``ddb2bt.transforms.lint`` checks on any mapping:
few families with short names (one data family, one for index rows; sets and
maps in one cell), no age-based GC (TTL deletions arrive through the stream),
each index only on the items carrying its keys and salted when led by a value
of few values.
"""
from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Iterable, Optional, Sequence

import yaml

from ddb2bt.transforms.config import MappingConfig, parse_mapping
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.limits import MAX_QUALIFIER_BYTES, MIB
from ddb2bt.transforms.lint import DOMINANT_SHARE, LONG_QUALIFIER, LOW_CARDINALITY_DISTINCT, looks_enum_like
from ddb2bt.transforms.mapping import expected_cells

# Row-key delimiters tried in order: the seed's own three (`#`, `:`, `/`),
# then characters rare in ids. The first that no sampled value of a leading key
# part contains keeps keys readable (no escapes); the engine escapes in any case.
DELIMITER_CANDIDATES = ("#", ":", "/", "~", "!", ";", "^")
# Separators that end a type prefix in single-table designs (`CUST#…`,
# `Invoice-0123`): the key-part separators first, then the weaker `-` and `_`.
_STRONG_SEPARATORS = "#:|/"
_WEAK_SEPARATORS = "-_"
_TYPE_WORD = re.compile(r"[A-Za-z][A-Za-z_-]*\Z")
_PURE_WORD = re.compile(r"[A-Za-z]+\Z")
_ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
# More distinct prefixes than this are data (categories, names), not entity types.
MAX_ENTITY_TYPES = 24
# A word sort key (`Video`) is an entity type only when it recurs across
# partitions; a word seen in one partition is more likely data (`Europe`).
MIN_PARTITIONS_FOR_WORD_TYPE = 2
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Zero-pad width for integer sort keys: every unsigned 64-bit integer fits; a
# longer value is a dead letter (row_key), never a silently misordered row.
SORT_KEY_PAD = 20
# Write-sharding buckets for a time-like partition key (the seed's "salting"):
# readable, and a Query by partition key still reads one computed prefix.
TIME_KEY_SALT = 16
# Families: few and short (cloud.google.com/bigtable/docs/schema-design: a family
# name is stored with every cell, and columns read together belong together).
# Every rule's attributes go to one data family (the row key already tells the
# entity types apart); index rows to one index family.
DATA_FAMILY = "d"
# Words longer than this are data, not an entity type's name.
TYPE_WORD_CHARS = 32
INDEX_PREFIX = "idx"
INDEX_FAMILY = "idx"
CATCH_ALL = "other"
# An index whose leading attribute has few values (a status) gets this many salt
# buckets from the item's partition key before it: its rows spread over as many
# ranges, and a read of one value is this many prefix reads.
INDEX_SALT = 16
# An entity type seen in fewer sampled items than this is reported as rare: its
# attributes may be incomplete, and types rarer still may be missing.
RARE_TYPE_ITEMS = 5
# Bigtable's recommended sizes (cloud.google.com/bigtable/docs/schema-design,
# "Limits"; read 2026-11): keep a cell under 10 MB and a row under 100 MB.
RECOMMENDED_CELL_BYTES = 10 * MIB
RECOMMENDED_ROW_BYTES = 100 * MIB
# Sizing, from Google's published guidance (read 2026-11):
# cloud.google.com/bigtable/docs/performance: an SSD node serves about 10,000
# writes/s of 1 KB rows; cloud.google.com/bigtable/quotas ("Storage utilization
# per node"): at most 5 TB of SSD data per node (older versions said 2.5 TB).
WRITES_PER_NODE_S = 10_000
SSD_BYTES_PER_NODE = 5 * 10**12
# The backfill's measured rate per vCPU: bench/results/latest.json,
# backfill.export_items_per_s = 14,471 items/s in one local process
# (docs/benchmarks.md, "Backfill"; tests/unit/project/test_sizing_figures.py
# holds the two equal). A Scan backfill is bounded by the source's read rate
# instead (--max-rcu).
BACKFILL_ITEMS_PER_VCPU_S = 14_471
# What a Dataflow vCPU is planned at: half the measured rate (the worker
# harness, bursts and the tail running next to the backfill take the rest;
# docs/deploy-dataflow.md, "Where the numbers come from").
PLANNED_SHARE = 0.5
# docs/deploy-dataflow.md recommends n2-standard-4 workers (4 vCPUs).
VCPUS_PER_WORKER = 4
# The backfill window the worker count is sized for: a working day, leaving the
# rest of the stream's 24-hour retention spare (docs/design.md §7.5).
TARGET_BACKFILL_HOURS = 8
# Split points: quantiles of the sampled row keys. Fewer than this many sampled
# keys per range make the quantiles noise; more than MAX_INITIAL_SPLITS tablets
# buy nothing at the start (Bigtable re-splits by load afterwards).
MIN_SAMPLED_KEYS_PER_SPLIT = 10
MAX_INITIAL_SPLITS = 100
PERCENTILES = (50, 90, 99)
STREAM_VIEW_NEEDED = "NEW_AND_OLD_IMAGES"


# --- what DynamoDB says about the table ------------------------------------------


@dataclass(frozen=True)
class IndexFacts:
    name: str
    kind: str  # GSI | LSI
    partition_key: str
    sort_key: Optional[str]
    projection: str  # ALL | KEYS_ONLY | INCLUDE
    non_key_attributes: tuple = ()


@dataclass(frozen=True)
class TableFacts:
    name: str
    partition_key: str
    sort_key: Optional[str]
    key_types: tuple  # ((attribute, S|N|B), ...)
    indexes: tuple = ()  # IndexFacts
    item_count: int = 0
    size_bytes: int = 0
    stream_view_type: Optional[str] = None  # None: no stream
    ttl_attribute: Optional[str] = None
    ttl_status: Optional[str] = None
    pitr_status: Optional[str] = None  # ENABLED | DISABLED | None (not known)
    billing_mode: Optional[str] = None
    region: Optional[str] = None

    def key_type(self, attribute: str) -> Optional[str]:
        return dict(self.key_types).get(attribute)


def table_facts(describe: dict, ttl: Optional[dict] = None, backups: Optional[dict] = None,
                region: Optional[str] = None) -> TableFacts:
    """DescribeTable's ``Table``, DescribeTimeToLive's and
    DescribeContinuousBackups' answers (None: not readable) → TableFacts."""
    keys = {k["KeyType"]: k["AttributeName"] for k in describe["KeySchema"]}
    types = tuple((a["AttributeName"], a["AttributeType"]) for a in describe.get("AttributeDefinitions", []))
    indexes = []
    for kind, field_name in (("GSI", "GlobalSecondaryIndexes"), ("LSI", "LocalSecondaryIndexes")):
        for index in describe.get(field_name) or []:
            ikeys = {k["KeyType"]: k["AttributeName"] for k in index["KeySchema"]}
            projection = index.get("Projection") or {}
            indexes.append(IndexFacts(index["IndexName"], kind, ikeys["HASH"], ikeys.get("RANGE"),
                                      projection.get("ProjectionType", "ALL"),
                                      tuple(projection.get("NonKeyAttributes") or ())))
    stream = describe.get("StreamSpecification") or {}
    ttl_desc = (ttl or {}).get("TimeToLiveDescription") or {}
    pitr = ((backups or {}).get("ContinuousBackupsDescription") or {}).get("PointInTimeRecoveryDescription") or {}
    return TableFacts(
        name=describe["TableName"], partition_key=keys["HASH"], sort_key=keys.get("RANGE"), key_types=types,
        indexes=tuple(indexes), item_count=int(describe.get("ItemCount") or 0),
        size_bytes=int(describe.get("TableSizeBytes") or 0),
        stream_view_type=stream.get("StreamViewType") if stream.get("StreamEnabled") else None,
        ttl_attribute=ttl_desc.get("AttributeName") if ttl_desc.get("TimeToLiveStatus") in ("ENABLED", "ENABLING")
        else None,
        ttl_status=ttl_desc.get("TimeToLiveStatus") if ttl is not None else None,
        pitr_status=pitr.get("PointInTimeRecoveryStatus") if backups is not None else None,
        billing_mode=(describe.get("BillingModeSummary") or {}).get("BillingMode"),
        region=region,
    )


@dataclass(frozen=True)
class SampleFacts:
    """How the sample was taken (``ddb2bt.pipeline.services.draft.sample_table``)."""

    items: int
    scanned_pages: int
    consumed_rcu: float
    stopped: str  # "limit" (the read budget), "end" (the whole table), "deadline"
    segments: int
    seconds: float
    read: int = 0  # items read (the sample is drawn from them)
    read_bytes: int = 0  # their size by DynamoDB's rules
    largest_read: int = 0  # the largest item read, in bytes (kept in the sample)
    segments_done: int = 0  # segments read to their end


# --- values ----------------------------------------------------------------------


def _tag(value) -> str:
    return next(iter(value))


def _number(text: str) -> Optional[Decimal]:
    try:
        return Decimal(text)
    except (InvalidOperation, TypeError):
        return None


def _is_int64(text: str) -> bool:
    number = _number(text)
    return number is not None and number == number.to_integral_value() and INT64_MIN <= int(number) <= INT64_MAX


def _is_natural(text: str) -> bool:
    number = _number(text)
    return (number is not None and number == number.to_integral_value() and number >= 0
            and len(str(int(number))) <= SORT_KEY_PAD)


def _text_of(value) -> Optional[str]:
    tag = _tag(value)
    if tag in ("S", "N"):
        return value[tag]
    if tag == "B":
        return bytes(value["B"]).decode("latin-1")
    return None


def type_prefix(text: str) -> Optional[str]:
    """The entity-type prefix of a key value: ``CUST#``, ``HR-EMPLOYEE#`` from
    ``HR-EMPLOYEE#0001``, ``Invoice-`` from ``Invoice-0123``; None for ids,
    dates and plain words."""
    for separators in (_STRONG_SEPARATORS, _WEAK_SEPARATORS):
        cut = min((i for i in (text.find(s) for s in separators) if i > 0), default=-1)
        if cut > 0 and cut < len(text) - 1 and _TYPE_WORD.match(text[:cut]):
            return text[:cut + 1]
    return None


def type_signature(item: dict, keys: tuple) -> tuple:
    """What an item's key values say about its entity type, per key attribute:
    the type prefix (``CUST#``), a plain word (``PROFILE``), or None (an id, a
    number). Items of one type share it; the sample keeps every one it reads."""
    out = []
    for attribute in keys:
        value = item.get(attribute)
        text = value.get("S") if isinstance(value, dict) else None
        if not isinstance(text, str):
            out.append(None)
        elif _PURE_WORD.match(text) and len(text) <= TYPE_WORD_CHARS:
            out.append(text)
        else:
            out.append(type_prefix(text))
    return tuple(out)


def item_size(item: dict) -> int:
    """An item's size by DynamoDB's rules (names + values; numbers about one
    byte per two digits plus one; containers 3 bytes plus one per element)."""
    return sum(len(name.encode("utf-8")) + _value_size(v) for name, v in item.items())


def _value_size(value) -> int:
    tag = _tag(value)
    payload = value[tag]
    if tag == "S":
        return len(payload.encode("utf-8"))
    if tag == "N":
        return len(payload.lstrip("-").replace(".", "")) // 2 + 1
    if tag == "B":
        return len(payload)
    if tag in ("BOOL", "NULL"):
        return 1
    if tag in ("SS", "NS", "BS"):
        return sum(_value_size({tag[0]: v}) for v in payload)
    if tag == "L":
        return 3 + sum(1 + _value_size(v) for v in payload)
    return 3 + sum(1 + len(k.encode("utf-8")) + _value_size(v) for k, v in payload.items())  # M


def _percentile(sorted_values: Sequence[int], pct: int) -> int:
    if not sorted_values:
        return 0
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(pct / 100 * len(sorted_values)) - 1))]


# --- the draft -------------------------------------------------------------------


@dataclass(frozen=True)
class Draft:
    text: str  # the commented YAML mapping
    data: dict  # the same mapping as a document
    delimiter: str
    guesses: tuple  # what was guessed from the sample (the header lists them)
    decisions: tuple  # what the user must decide
    types: tuple = ()  # ((rule name, sampled items it maps), ...) in rule order

    def mapping(self) -> MappingConfig:
        return parse_mapping(self.data, origin="<draft>")


def _safe_name(text: str, fallback: str) -> str:
    """A family / rule name from a type or attribute: lower snake case,
    [_a-zA-Z0-9][-_.a-zA-Z0-9]* (Bigtable's family name rule)."""
    words = re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+", text)
    name = "_".join(w.lower() for w in words)[:40].strip("_")
    return name or fallback


def _unique(name: str, taken: set) -> str:
    out, n = name, 2
    while out in taken or out.lower().startswith("ddb2bt_"):
        out, n = f"{name}_{n}", n + 1
    taken.add(out)
    return out


def choose_delimiter(row_leading: Iterable[str], index_leading: Iterable[str]) -> tuple:
    """(delimiter, note): the first candidate no leading key part contains;
    else one the row key's leading part lacks (index keys escape); else `#`,
    escaped by the engine (docs/mapping.md, "Row keys": injectivity)."""
    row_values, index_values = list(row_leading), list(index_leading)
    for candidate in DELIMITER_CANDIDATES:
        if not any(candidate in v for v in row_values + index_values):
            return candidate, None
    for candidate in DELIMITER_CANDIDATES:
        if not any(candidate in v for v in row_values):
            return candidate, (f"index key values hold every candidate delimiter: {candidate!r} is escaped "
                               f"inside them (\\{candidate})")
    return "#", "leading key values hold every candidate delimiter: '#' is escaped inside them (\\#)"


@dataclass
class _Group:
    conditions: tuple  # ((attribute, kind, value), ...)
    name: str
    items: list = field(default_factory=list)

    def attributes(self, keys: tuple) -> frozenset:
        return frozenset(a for it in self.items for a in it if a not in keys)


def _entity_groups(facts: TableFacts, items: list) -> list:
    """One group per entity type found from the key prefixes, most specific
    first; one group for everything when no types are found."""
    pk, sk = facts.partition_key, facts.sort_key
    keys = (pk,) + ((sk,) if sk else ())

    def pk_type(it):
        text = _text_of(it[pk]) if pk in it else None
        return type_prefix(text) if text is not None and _tag(it[pk]) == "S" else None

    sk_words: dict = {}
    if sk:
        for it in items:
            if sk in it and _tag(it[sk]) == "S" and _PURE_WORD.match(it[sk]["S"]):
                sk_words.setdefault(it[sk]["S"], set()).add(repr(it.get(pk)))

    def sk_type(it):
        if not sk or sk not in it or _tag(it[sk]) != "S":
            return None
        text = it[sk]["S"]
        prefix = type_prefix(text)
        if prefix is not None:
            return ("prefix", prefix)
        if text in sk_words and len(sk_words[text]) >= MIN_PARTITIONS_FOR_WORD_TYPE:
            return ("equals", text)
        return None

    typed = [(pk_type(it), sk_type(it), it) for it in items]
    if len({p for p, _, _ in typed}) < 2:  # one prefix for all (Invoice-) or none: says nothing
        typed = [(None, s, it) for _, s, it in typed]
    groups: dict = {}
    for p, s, it in typed:
        groups.setdefault((p, s), []).append(it)
    everything = [_Group((), "item", list(items))]
    typed_groups = [k for k in groups if k != (None, None)]
    if not typed_groups or len(typed_groups) > MAX_ENTITY_TYPES:
        return everything
    if len({frozenset(a for it in groups[k] for a in it if a not in keys) for k in groups}) < 2:
        return everything  # the same attributes everywhere: categories, not entity types
    out = []
    taken: set = set()
    for (p, s) in sorted(typed_groups, key=lambda k: (-(k[0] is not None) - (k[1] is not None), str(k))):
        conditions, words = [], []
        if p is not None:
            conditions.append((pk, "prefix", p))
            words.append(p)
        if s is not None:
            conditions.append((sk, s[0], s[1]))
            if s[1] != p:
                words.append(s[1])
        out.append(_Group(tuple(conditions), _unique(_safe_name(" ".join(words), "entity"), taken), groups[(p, s)]))
    rest = groups.get((None, None), [])
    out.append(_Group((), _unique(CATCH_ALL, taken), rest))
    return out


def _key_part(attribute: str, values: list, key_type: Optional[str], leading: bool, notes: list,
              decisions: list) -> list:
    """The template part(s) of one key attribute: order-preserving for numeric
    sort keys, spread for a sequential or time-like leading part."""
    texts = [_text_of(v) for v in values if _tag(v) in ("S", "N", "B")]
    if key_type == "N":
        if leading:
            if texts and all(_is_int64(t) for t in texts):
                notes.append(f"{attribute}: an integer partition key may be a sequential id; it is reversed "
                             f"({{{attribute}|reverse}}) so consecutive ids land on different tablets")
                return [f"{{{attribute}|reverse}}"]
            return [f"{{{attribute}}}"]
        if texts and all(_is_natural(t) for t in texts):
            notes.append(f"{attribute}: a numeric sort key is zero-padded to {SORT_KEY_PAD} digits "
                         f"({{{attribute}|pad:{SORT_KEY_PAD}}}) so rows sort in numeric order; a longer or "
                         "negative value would be a dead letter (row_key)")
            return [f"{{{attribute}|pad:{SORT_KEY_PAD}}}"]
        decisions.append(f"{attribute}: the numeric sort key has negative or fractional values; no key transform "
                         "keeps their numeric order, so rows sort as text. Decide whether range reads need it")
        return [f"{{{attribute}}}"]
    if leading and texts and sum(1 for t in texts if _ISO_DATE.match(t)) > len(texts) / 2:
        notes.append(f"{attribute}: the partition key looks like a date: a {TIME_KEY_SALT}-way salt prefix "
                     f"({{{attribute}|salt:{TIME_KEY_SALT}}}) spreads writes; read a partition at its computed "
                     "prefix")
        return [f"{{{attribute}|salt:{TIME_KEY_SALT}}}", f"{{{attribute}}}"]
    return [f"{{{attribute}}}"]


def _values(items: list, attribute: str) -> list:
    return [it[attribute] for it in items if attribute in it]


def _valid_qualifier(name: str) -> bool:
    """Whether an attribute name can be a literal column qualifier in a mapping:
    braces start a template, and a qualifier holds at most 16 KiB."""
    return "{" not in name and "}" not in name and len(name.encode("utf-8")) <= MAX_QUALIFIER_BYTES


def _typed_inside(value) -> bool:
    """Whether a map or list holds a set or a binary value somewhere (plain JSON
    would give them back as lists and base64 text)."""
    tag = _tag(value)
    if tag in ("B", "SS", "NS", "BS"):
        return True
    if tag == "M":
        return any(_typed_inside(v) for v in value["M"].values())
    if tag == "L":
        return any(_typed_inside(v) for v in value["L"])
    return False


def short_qualifier(attribute: str) -> str:
    """The attribute's name as a qualifier, or, over LONG_QUALIFIER bytes, its
    start and a hash of the whole name (``…~1a2b3c4d``): short, and still one
    qualifier per name."""
    raw = attribute.encode("utf-8")
    if len(raw) <= LONG_QUALIFIER:
        return attribute
    digest = hashlib.sha256(raw).hexdigest()[:8]
    return raw[:LONG_QUALIFIER - len(digest) - 1].decode("utf-8", "ignore") + "~" + digest


def _column_spec(attribute: str, values: list, family: str, notes: list) -> dict:
    """The column spec of one attribute from its sampled values: one qualifier
    (the attribute's name, shortened past LONG_QUALIFIER bytes) in the rule's
    family, encoded by the sampled type."""
    qualifier = short_qualifier(attribute)
    if qualifier != attribute:
        notes.append(f"{attribute[:24]}…: a name of {len(attribute.encode('utf-8'))} bytes is stored with every "
                     f"cell: its column is {family}:{qualifier}")
    column = f"{family}:{qualifier}"
    tags = {_tag(v) for v in values}
    if len(tags) != 1:
        notes.append(f"{attribute} holds several types ({', '.join(sorted(tags))}): encoding auto "
                     "(each value by its type; a NULL is the byte 0xFF, apart from an empty string)")
        return {"column": column, "encoding": "auto"}
    tag = tags.pop()
    if tag == "S":
        return {"column": column, "encoding": "utf8"}
    if tag == "N":
        if all(_is_int64(v["N"]) for v in values):
            notes.append(f"{attribute}: every sampled value is an integer in 64 bits: int64 (Increment "
                         "works); a later fraction or larger number would be a dead letter (encoding)")
            return {"column": column, "encoding": "int64"}
        return {"column": column, "encoding": "decimal"}
    if tag == "B":
        return {"column": column, "encoding": "bytes"}
    if tag == "BOOL":
        return {"column": column, "encoding": "bool"}
    if tag == "NULL":
        return {"column": column, "encoding": "null"}
    if tag in ("SS", "NS", "BS"):
        return {"column": column, "encoding": "json"}  # a sorted JSON array; decoded by the attribute's type
    if any(_typed_inside(v) for v in values):
        return {"column": column, "encoding": "dynamodb_json"}  # keeps nested sets and binary exact
    return {"column": column, "encoding": "json"}


def _carries(item: dict, attributes: tuple) -> bool:
    return all(a in item for a in attributes)


def _few_values(index: IndexFacts, items: list) -> bool:
    """Whether an index's leading attribute has few values: named like one (a
    status, a type, a flag) or, over the items carrying it, at most
    LOW_CARDINALITY_DISTINCT values with one in DOMINANT_SHARE of them."""
    if looks_enum_like(index.partition_key):
        return True
    values = Counter(repr(it[index.partition_key]) for it in items if index.partition_key in it)
    total = sum(values.values())
    return bool(total) and len(values) <= LOW_CARDINALITY_DISTINCT and \
        values.most_common(1)[0][1] / total >= DOMINANT_SHARE


def draft_mapping(facts: TableFacts, items: list, *, project: str, instance: str, table: Optional[str] = None,
                  now_s: float) -> Draft:
    """The mapping ``ddb2bt draft`` writes. ``items``: sampled items (boto3
    AttributeValue form); ``now_s``: the current time (TTL's backstop)."""
    pk, sk = facts.partition_key, facts.sort_key
    keys = (pk,) + ((sk,) if sk else ())
    guesses: list = []
    decisions: list = []
    indexes = list(facts.indexes)

    # The delimiter: what the leading parts (all but each template's last) hold.
    row_leading = [t for t in (_text_of(v) for v in _values(items, pk)) if t is not None] if sk else []
    index_leading = []
    for index in indexes:
        for attribute in (index.partition_key, index.sort_key, pk):
            if attribute:
                index_leading += [t for t in (_text_of(v) for v in _values(items, attribute)) if t is not None]
    delimiter, note = choose_delimiter(row_leading, index_leading)
    if delimiter != "#":
        guesses.append(f"delimiter {delimiter!r}: sampled values of a leading key part contain '#'"
                       + (f" (and {', '.join(repr(c) for c in DELIMITER_CANDIDATES[1:DELIMITER_CANDIDATES.index(delimiter)])})"
                          if DELIMITER_CANDIDATES.index(delimiter) > 1 else ""))
    if note:
        guesses.append(note)
    d = delimiter

    parts = _key_part(pk, _values(items, pk), facts.key_type(pk), True, guesses, decisions)
    if sk:
        parts += _key_part(sk, _values(items, sk), facts.key_type(sk), False, guesses, decisions)
    row_key = d.join(parts)

    groups = _entity_groups(facts, items)
    if len(groups) > 1:
        guesses.append(f"{len(groups) - 1} entity type(s) found from the key prefixes, one rule each; the rule "
                       f"'{groups[-1].name}' takes the types the sample did not see")
    table_id = table or _safe_name(facts.name, "table")[:50]
    families: dict = {DATA_FAMILY: {"max_versions": 1}}
    # Each index goes to the rules whose sampled items carry its key attributes
    # (a GSI holds only those); none seen: the catch-all rule, where unseen types go.
    index_keys = {index.name: tuple(a for a in (index.partition_key, index.sort_key) if a) for index in indexes}
    carriers = {index.name: [g for g in groups if any(_carries(it, index_keys[index.name]) for it in g.items)]
                for index in indexes}
    catch_all = groups[-1] if len(groups) > 1 else None
    for index in indexes:
        if catch_all is not None and catch_all not in carriers[index.name]:
            carriers[index.name].append(catch_all)  # an unseen type carrying the keys is indexed too
        if not any(g.items for g in carriers[index.name] if g is not catch_all) and len(groups) > 1:
            decisions.append(f"index {index.name}: no sampled item carries {' and '.join(index_keys[index.name])}; "
                             f"its rows are drafted on rule '{groups[-1].name}' only: move them to the rule of the "
                             "items that carry them")
        elif len(groups) > 1:
            guesses.append(f"index {index.name}: rows for the items carrying {' and '.join(index_keys[index.name])} "
                           f"(rule(s) {', '.join(g.name for g in carriers[index.name])}), as in the GSI")
    salted = set()
    for index in indexes:
        carrying = [it for g in carriers[index.name] for it in g.items if _carries(it, index_keys[index.name])]
        # An LSI (or a GSI on the table's partition key) is led by the partition key itself:
        # a salt of the same value would not spread it.
        if index.partition_key != pk and _few_values(index, carrying):
            salted.add(index.name)
            guesses.append(f"index {index.name}: {index.partition_key} has few values, so its rows start with a "
                           f"{INDEX_SALT}-way salt of the item's partition key ({{{pk}|salt:{INDEX_SALT}}}): one "
                           f"value's rows spread over {INDEX_SALT} ranges (no hotspot); read a value with "
                           f"{INDEX_SALT} prefix reads, one per salt 00..{INDEX_SALT - 1:02d}")
    rules = []
    comments: list = []
    types = []
    for group in groups:
        columns: dict = {}
        invalid = []
        seen = sorted(group.attributes(keys))
        for attribute in seen:
            if not _valid_qualifier(attribute):
                invalid.append(attribute)
                continue
            columns[attribute] = _column_spec(attribute, _values(group.items, attribute), DATA_FAMILY, guesses)
        rule: dict = {"name": group.name}
        if group.conditions:
            conds = [{"attribute": a, kind: v} for a, kind, v in group.conditions]
            rule["match"] = conds[0] if len(conds) == 1 else conds
        rule["row_key"] = row_key
        if columns:
            rule["columns"] = columns
        rule["other_attributes"] = {"mode": "column", "family": DATA_FAMILY, "encoding": "auto"}
        rule_indexes = [_index_spec(index, facts, items, group, keys, d, index.name in salted)
                        for index in indexes if group in carriers[index.name]]
        if rule_indexes:
            rule["indexes"] = rule_indexes
            families[INDEX_FAMILY] = {"max_versions": 1}
        rules.append(rule)
        types.append((group.name, len(group.items)))
        why = (f"{len(group.items)} sampled item(s)" + (f" matching {' and '.join(_cond_text(c) for c in group.conditions)}"
                                                        if group.conditions else "")
               + (f"; attributes not valid as qualifiers go to other_attributes: {', '.join(invalid)}"
                  if invalid else ""))
        comments.append(why)

    ttl_block = None
    if facts.ttl_attribute:
        ttl_block = {"attribute": facts.ttl_attribute, "deletions": "apply"}
        guesses.append(f"TTL on {facts.ttl_attribute}: DynamoDB's TTL deletions arrive through the stream and are "
                       "replicated (deletions: apply); no family gets a max age, which would also collect the "
                       "cells of items that carry no TTL or outlive it")
    if facts.stream_view_type != STREAM_VIEW_NEEDED:
        decisions.append(f"the table's stream is {facts.stream_view_type or 'off'}: ddb2bt needs "
                         f"{STREAM_VIEW_NEEDED} (aws dynamodb update-table --table-name {facts.name} "
                         f"--stream-specification StreamEnabled=true,StreamViewType={STREAM_VIEW_NEEDED}) "
                         "before run or migrate")
    decisions.append(f"target: project {project!r}, instance {instance!r}, table {table_id!r} (change them here "
                     "or with --bigtable-project/--bigtable-instance/--bigtable-table)")
    decisions.append("family names and GC policies (one version each: every column holds the item's current value; "
                     "no max age: a cell is deleted when its item is, TTL deletions included)")
    if indexes:
        decisions.append("which index rows you need: each GSI/LSI became one; drop those no reader uses")

    data: dict = {"version": 1, "name": table_id,
                  "description": f"drafted by ddb2bt draft from {facts.name}",
                  "source": {"table": facts.name, "key": {"partition": pk, **({"sort": sk} if sk else {})}},
                  "target": {"project": project, "instance": instance, "table": table_id},
                  "delimiter": d, "families": families}
    if facts.region:
        data["source"]["region"] = facts.region
    if ttl_block:
        data["ttl"] = ttl_block
    data["rules"] = rules
    text = _render(data, facts, guesses, decisions, comments, ttl_block is not None)
    return Draft(text=text, data=data, delimiter=d, guesses=tuple(guesses), decisions=tuple(decisions),
                 types=tuple(types) if len(groups) > 1 else ())  # one rule for all: no entity types


def _cond_text(cond: tuple) -> str:
    attribute, kind, value = cond
    return f"{attribute} {'starting with' if kind == 'prefix' else '='} {value!r}"


def _index_spec(index: IndexFacts, facts: TableFacts, items: list, group: _Group, keys: tuple, d: str,
                salted: bool = False) -> dict:
    """Index rows for a GSI/LSI, keyed as the seed's example 4 prescribes:
    idx#<index>#<index keys>#<item keys> (sparse: an item without an index key
    attribute gets no row, as in a GSI); ``salted``: idx#<index>#<salt of the
    item's partition key>#<index keys>#<item keys>, for a leading index key of
    few values."""
    parts, used = ([f"{{{facts.partition_key}|salt:{INDEX_SALT}}}"] if salted else []), []
    for attribute in (index.partition_key, index.sort_key):
        if attribute and attribute not in used:
            key_type = facts.key_type(attribute)
            values = _values(items, attribute)  # the whole sample: one key form for every rule
            if key_type == "N" and values and all(_tag(v) == "N" and _is_natural(v["N"]) for v in values):
                parts.append(f"{{{attribute}|pad:{SORT_KEY_PAD}}}")
            else:
                parts.append(f"{{{attribute}}}")
            used.append(attribute)
    for attribute in keys:
        if attribute not in used:
            parts.append(f"{{{attribute}}}")
            used.append(attribute)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", index.name).lower()  # index names are [a-zA-Z0-9_.-] already
    spec: dict = {"name": name, "row_key": d.join([INDEX_PREFIX, name] + parts), "family": INDEX_FAMILY}
    if index.projection == "INCLUDE" and index.non_key_attributes:
        spec["project"] = list(index.non_key_attributes)
    elif index.projection == "ALL":
        projected = sorted(a for a in group.attributes(keys) if a not in used)
        if projected:
            spec["project"] = projected
    return spec


def _dump(value) -> str:
    return yaml.safe_dump(value, sort_keys=False, allow_unicode=True, default_flow_style=None, width=120)


def _render(data: dict, facts: TableFacts, guesses: list, decisions: list, rule_comments: list,
            has_ttl: bool) -> str:
    lines = [f"# Drafted by `ddb2bt draft --table {facts.name}` from DescribeTable and a sample of items.",
             "# It validates and lints as it is; read it before you migrate.", "#",
             "# Guessed from the sample:"]
    lines += [f"#   - {g}" for g in guesses] or ["#   - (nothing beyond the defaults)"]
    lines += ["#", "# For you to decide:"]
    lines += [f"#   - {d}" for d in decisions]
    lines += ["#", "# Attributes the sample did not see go to each rule's family (other_attributes, encoded",
              "# by their type), so nothing is lost; docs/mapping.md (\"Drafting a mapping\") explains each guess."]
    out = "\n".join(lines) + "\n"
    for key, value in data.items():
        if key == "families":
            out += ("# One data family for every rule (the row key tells the entity types apart) and one for "
                    "index rows:\n# a family's name is stored with every cell. No max age: an age-based GC "
                    "would also collect\n# the cells of items DynamoDB keeps (a backfilled cell is as old as the "
                    "backfill); deletions,\n# TTL deletions included, arrive through the stream.\n")
        if key == "ttl":
            out += "# DynamoDB's TTL deletions (REMOVEs by dynamodb.amazonaws.com) delete the item's cells.\n"
        if key != "rules":
            out += (_dump({key: value}) if isinstance(value, (dict, list))
                    else yaml.safe_dump({key: value}, sort_keys=False, allow_unicode=True, default_flow_style=False))
            continue
        out += "rules:\n"
        for rule, comment in zip(value, rule_comments):
            out += f"  # {comment}\n"
            out += "".join(f"  {line}\n" for line in _dump([rule]).splitlines())
    return out


# --- split points ----------------------------------------------------------------


def sampled_row_keys(mapping: MappingConfig, items: Iterable) -> list:
    """The sorted distinct row keys (of the target table) the sampled items map to."""
    keys = set()

    for item in items:
        try:
            cells = expected_cells(mapping, item)
        except MappingError:
            continue  # lint reports unmappable items; a split point needs none of them
        keys.update(c.row_key for c in cells.values() if c.table == mapping.target.table)
    return sorted(keys)


def _key_heads(mapping: MappingConfig) -> list:
    """The literal start of every key template writing the target table, longest
    first: each names a range of the table (``idx#bystatus#``: an index's rows;
    ``b""``: the keys that start with a value)."""
    heads = {b""}
    for rule in mapping.rules:
        templates = ([rule.row_key] if rule.row_key is not None else []) + [
            index.row_key for index in rule.indexes if (index.table or mapping.target.table) == mapping.target.table]
        for template in templates:
            first = template.tokens[0]
            if isinstance(first, bytes):
                heads.add(first)
    return sorted(heads, key=len, reverse=True)


def split_points(mapping: MappingConfig, items: Iterable, limit: int = MAX_INITIAL_SPLITS) -> list:
    """Split points for a fresh target table, so a backfill starts on many
    tablets, not one: the sampled row keys grouped by the range they belong to
    (the main rows; each index's rows), each range starting at a split point of
    its own and its keys cut at evenly spaced quantiles, the points shared out
    by the ranges' sampled keys (MIN_SAMPLED_KEYS_PER_SPLIT each)."""
    keys = sampled_row_keys(mapping, items)
    count = min(limit, len(keys) // MIN_SAMPLED_KEYS_PER_SPLIT)
    if count < 1:
        return []
    heads = _key_heads(mapping)
    ranges: dict = {}
    for key in keys:
        ranges.setdefault(next(h for h in heads if key.startswith(h)), []).append(key)
    starts = {group[0] for group in ranges.values()} - {keys[0]}  # each range on tablets of its own
    cuts = set()
    for group in ranges.values():  # sorted already: keys are
        share = min(len(group) // MIN_SAMPLED_KEYS_PER_SPLIT, round(count * len(group) / len(keys)))
        cuts.update(group[(i * len(group)) // (share + 1)] for i in range(1, share + 1))
    cuts = sorted(cuts - starts)
    room = max(0, limit - len(starts))
    if len(cuts) > room:  # evenly spread over them
        cuts = [cuts[(i * len(cuts)) // room] for i in range(room)]
    return sorted(starts | set(cuts))[:limit]


# --- the assessment --------------------------------------------------------------


@dataclass(frozen=True)
class Assessment:
    lines: tuple

    def render(self) -> str:
        return "\n".join(self.lines) + "\n"


_STOPPED = {"limit": "its read budget, ten times --sample", "end": "the end of the table", "deadline": "the time limit"}


def _mb(n: float) -> str:
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n / 10**3:,.1f} KB"


def percent_text(p: float) -> str:
    """A share for a report: 100%, 20%, 2.5%, 0.05% (never 1e+02%)."""
    return f"{p:,.0f}%" if p >= 10 else f"{p:.2g}%" if p >= 0.01 else "under 0.01%"


def _percent(part: float, whole: float) -> str:
    """``part`` as a share of ``whole``, written by ``percent_text``."""
    return percent_text(100 * part / whole)


def coverage_lines(facts: TableFacts, sample: SampleFacts, types: Sequence) -> list:
    """What the sample saw: how much of the table it read, each entity type
    with its sampled items, and where a type may be missing."""
    out = []
    if sample.stopped == "end":
        seen = f"the whole table ({sample.read:,} items read)"
    elif facts.item_count:
        seen = (f"{_percent(sample.read, facts.item_count)} of the table's items "
                f"({sample.read:,} of ~{facts.item_count:,})"
                + (f", {_percent(sample.read_bytes, facts.size_bytes)} of its bytes" if facts.size_bytes else ""))
    else:
        seen = f"{sample.read:,} items (DescribeTable does not count the items yet)"
    out.append(f"coverage: the sample read {seen} over {sample.segments} segment(s), "
               f"{sample.segments_done} read to their end; largest item read {sample.largest_read:,} B")
    typed = [(name, n) for name, n in types if name != CATCH_ALL]
    if typed:
        out.append("entity types (sampled items): " + ", ".join(f"{name} {n:,}" for name, n in types))
    warnings = []
    if sample.stopped != "end":
        rare = f"1 in {sample.read:,}" if sample.read else "any"
        warnings.append(f"the sample did not read the whole table ({_STOPPED.get(sample.stopped, sample.stopped)}): "
                        f"an entity type rarer than about {rare} items may be missing, and its items would go "
                        f"to the rule '{CATCH_ALL}' (raise --sample to read more)")
    for name, n in typed:
        if n < RARE_TYPE_ITEMS:
            warnings.append(f"entity type '{name}' is in only {n} sampled item(s): its columns may be incomplete "
                            "(other_attributes keeps the rest), and a type as rare may be missing")
    other = dict(types).get(CATCH_ALL, 0)
    if typed and other:
        warnings.append(f"{other} sampled item(s) match no entity type found: they go to the rule '{CATCH_ALL}'")
    out.append("where a type may be missing: " + ("none" if not warnings else ""))
    out += [f"  WARN {w}" for w in warnings]
    return out


def assess(facts: TableFacts, sample: SampleFacts, items: list, mapping: MappingConfig, findings: Sequence,
           splits: int, types: Sequence = ()) -> Assessment:
    """The report printed beside the draft. ``findings``: lint's on the drafted
    mapping and the sample (``ddb2bt.transforms.lint.lint``); ``types``: the
    draft's (rule, sampled items) pairs."""
    out = [f"Assessment of DynamoDB table {facts.name}", ""]
    out.append(f"table: {facts.item_count:,} items, {_mb(facts.size_bytes)} (DescribeTable; DynamoDB updates "
               "these about every six hours)")
    share = f", {_percent(sample.items, facts.item_count)} of the items" if facts.item_count else ""
    out.append(f"sample: {sample.items:,} items in {sample.scanned_pages} page(s) over {sample.segments} "
               f"segment(s), {sample.consumed_rcu:,.1f} RCU, {sample.seconds:.1f} s, stopped at "
               f"{_STOPPED.get(sample.stopped, sample.stopped)}{share}")
    out += coverage_lines(facts, sample, types)
    sizes = sorted(item_size(it) for it in items)
    if sizes:
        out.append("item size (sampled, DynamoDB's rules): " + ", ".join(
            f"p{p} {_percentile(sizes, p):,} B" for p in PERCENTILES) + f", max {sizes[-1]:,} B")
    big_cells = big_rows = 0
    mapped_bytes = 0
    rows: Counter = Counter()
    for item in items:
        try:
            cells = expected_cells(mapping, item)
        except MappingError:
            continue
        for cell in cells.values():
            size = len(cell.row_key) + len(cell.family) + len(cell.qualifier) + len(cell.value or b"") + sum(
                len(v) for v in cell.values or ())
            mapped_bytes += size
            big_cells += size > RECOMMENDED_CELL_BYTES
            rows[(cell.table, cell.row_key)] += size
    big_rows = sum(1 for n in rows.values() if n > RECOMMENDED_ROW_BYTES)
    out.append(f"over Bigtable's recommended sizes: {big_cells} cell(s) > 10 MB, {big_rows} row(s) > 100 MB "
               "(a DynamoDB item is at most 400 KB, so only rows many items share can grow)")
    names = {a for it in items for a in it}
    invalid = sorted(a for a in names if not _valid_qualifier(a))
    out.append("attribute names not valid as column qualifiers: " + (", ".join(invalid) if invalid else "none"))
    hot = [f for f in findings if f.level == "WARN"]
    out.append("hot-key candidates and other warnings (ddb2bt lint on the draft and the sample): "
               + ("none" if not hot else ""))
    out += [f"  {f}" for f in hot]
    out.append(f"stream: {facts.stream_view_type or 'OFF'} — "
               + ("the live tail can start" if facts.stream_view_type == STREAM_VIEW_NEEDED else
                  f"enable a {STREAM_VIEW_NEEDED} stream before run or migrate: the tail needs the old image "
                  "to delete the cells an update or delete leaves behind"))
    with_pitr = ("the backfill can read an export (--from-export, no RCUs) and a job stopped longer than the "
                 "stream's 24 hours can recover from incremental exports (ddb2bt recover)")
    out.append(f"point-in-time recovery: {facts.pitr_status or 'unknown (DescribeContinuousBackups not readable)'} "
               "— " + (with_pitr if facts.pitr_status == "ENABLED" else
                       f"if enabled, {with_pitr}" if facts.pitr_status is None else
                       "without it the backfill must Scan (RCUs) and a job stopped longer than the stream's 24 "
                       "hours must back-fill again"))
    if facts.ttl_attribute:
        out.append(f"TTL: {facts.ttl_attribute} ({facts.ttl_status}) — replicated deletions (deletions: apply); no "
                   "family max age (see the draft's comment)")
    per_item = mapped_bytes / len(items) if items else 0
    storage = per_item * facts.item_count
    nodes_storage = max(1, math.ceil(storage / SSD_BYTES_PER_NODE))
    planned_per_vcpu_s = BACKFILL_ITEMS_PER_VCPU_S * PLANNED_SHARE
    core_s = facts.item_count / planned_per_vcpu_s
    workers = max(1, math.ceil(core_s / (TARGET_BACKFILL_HOURS * 3600 * VCPUS_PER_WORKER)))
    hours = core_s / (workers * VCPUS_PER_WORKER) / 3600
    # The rows per second Bigtable must take to finish in the target window
    # (each item's main row; index rows add to it).
    write_rate = math.ceil(facts.item_count / (TARGET_BACKFILL_HOURS * 3600))
    nodes_writes = max(1, math.ceil(write_rate / WRITES_PER_NODE_S))
    out.append(f"sizing: Bigtable storage ~{_mb(storage)} ({per_item:,.0f} B per item as mapped, sampled); "
               f"SSD nodes: {nodes_storage} for storage (5 TB each), {nodes_writes} for the backfill's "
               f"~{write_rate:,} rows/s over {TARGET_BACKFILL_HOURS} h (10,000 writes/s each) — size for the "
               "larger, then scale down")
    out.append(f"backfill: {core_s / 3600:,.2f} vCPU-hours at {planned_per_vcpu_s:,.0f} items/s per vCPU (half "
               f"the measured {BACKFILL_ITEMS_PER_VCPU_S:,} items/s per vCPU of bench/results/latest.json, as "
               f"docs/deploy-dataflow.md plans): {workers} Dataflow worker(s) of {VCPUS_PER_WORKER} vCPUs finish in "
               f"~{hours:,.2f} h (sized for {TARGET_BACKFILL_HOURS} h; a Scan backfill is further bounded by "
               "--max-rcu)")
    out.append(f"pre-split: {splits} split point(s) from the sampled row keys "
               "(ddb2bt create-table --split-from-sample uses them for a new table)")
    return Assessment(tuple(out))
