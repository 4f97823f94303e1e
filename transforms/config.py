"""The mapping file: model, loading and validation.

A mapping file (YAML) says which DynamoDB table is replicated into which Bigtable
table and how every item becomes a row. Validation is complete and happens before
anything runs: every problem is a ``ConfigError`` naming the field path
(``rules[0].columns.Price.encoding``), the bad value and, where a close name or
value exists, the one probably meant. Parsing goes on past a problem wherever
the rest of the file can still be read, so one run reports them all
(``ConfigProblems`` when there are several).

See docs/mapping.md for the reference; ``examples/*.yaml`` for real files.
"""
from __future__ import annotations

import contextvars
import difflib
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import yaml

from ddb2bt.transforms.encoding import ENCODINGS
from ddb2bt.transforms.errors import ConfigError, ConfigProblems
from ddb2bt.transforms.rowkey import KeyTemplate, parse_template

SUPPORTED_VERSIONS = (1,)
_FAMILY_NAME = re.compile(r"[_a-zA-Z0-9][-_.a-zA-Z0-9]*\Z")
_TABLE_ID = re.compile(r"[_a-zA-Z0-9][-_.a-zA-Z0-9]{0,49}\Z")
_DDB_TABLE = re.compile(r"[a-zA-Z0-9_.-]{3,255}\Z")
MAX_FAMILIES = 100  # Bigtable's recommended ceiling per table
# Column families of ddb2bt's own (the migration's touch markers, ddb2bt_touch):
# the cutover creates and drops them, so a mapping that used such a name would
# have its data dropped with them (docs/design.md §7).
RESERVED_FAMILY_PREFIX = "ddb2bt_"


# The problems found so far while a mapping file is parsed (parse_mapping sets
# it): a problem that leaves the rest readable is recorded here and parsing goes
# on; outside parse_mapping (None) every problem raises at once.
_PROBLEMS: contextvars.ContextVar = contextvars.ContextVar("ddb2bt_mapping_problems", default=None)


def _report(problem: ConfigError) -> None:
    """Record a problem and go on, or raise it when nothing is collecting."""
    found = _PROBLEMS.get()
    if found is None:
        raise problem
    found.append(problem)


def _section(parse: Callable[[], Any], default: Any = None) -> Any:
    """Parse one independent part of the file (a rule, a column, an index…): a
    problem that stops it is recorded, and the parts after it are still read."""
    try:
        return parse()
    except _Reported:
        return default
    except ConfigError as exc:
        _report(exc)
        return default


def _did_you_mean(value: Any, choices) -> str:
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _not_reserved(name: str, path: str) -> None:
    if name.lower().startswith(RESERVED_FAMILY_PREFIX):
        _report(ConfigError(f"column family {name!r}: names starting with {RESERVED_FAMILY_PREFIX!r} are reserved "
                          "for ddb2bt's own bookkeeping (the migration drops them when it finishes); choose another "
                          "name", path))
OTHER_MODES = ("column", "ignore", "dead_letter")
MATCH_KINDS = ("equals", "prefix", "regex", "present")


@dataclass(frozen=True)
class KinesisSourceConfig:
    """``source.kinesis``: the table's changes come from a Kinesis data stream
    (docs/kinesis.md); ``precision`` is the destination's
    ApproximateCreationDateTimePrecision ("auto": told apart by magnitude)."""

    stream: str
    precision: str = "auto"


KINESIS_PRECISIONS = ("auto", "millisecond", "microsecond")


@dataclass(frozen=True)
class SourceConfig:
    table: str
    partition_key: str
    sort_key: Optional[str] = None
    region: Optional[str] = None
    kinesis: Optional[KinesisSourceConfig] = None

    @property
    def key_attributes(self) -> tuple:
        return (self.partition_key,) + ((self.sort_key,) if self.sort_key else ())


@dataclass(frozen=True)
class TargetConfig:
    project: str
    instance: str
    table: str
    app_profile: Optional[str] = None
    # The target table's change stream (the way back to DynamoDB reads it):
    # ``create-table`` enables it with this retention; None: no change stream asked.
    change_stream_retention_hours: Optional[int] = None


@dataclass(frozen=True)
class FamilyConfig:
    name: str
    max_versions: Optional[int] = None
    max_age_seconds: Optional[int] = None
    # With both limits: "union" deletes a cell when either says so (Bigtable's usual
    # choice); "intersection" only when both do.
    gc: str = "union"


# Bigtable keeps a change stream's records for 1 to 7 days.
CHANGE_STREAM_MIN_HOURS = 24
CHANGE_STREAM_MAX_HOURS = 7 * 24

TIMESTAMP_FORMATS = ("iso8601", "epoch_seconds", "epoch_millis")
COLUMN_KINDS = ("value", "set", "map", "list_versions")
SET_MARKERS = {"empty": b"", "zero": b"\x00"}


@dataclass(frozen=True)
class TimestampSource:
    """Cell timestamp taken from an attribute (versioned columns): each distinct
    value is its own version, and a delete removes exactly that version."""

    attribute: str
    format: str = "iso8601"


@dataclass(frozen=True)
class ColumnConfig:
    attribute: str
    family: str
    qualifier: bytes  # literal qualifier (when no template)
    encoding: str
    kind: str = "value"  # value | set | map | list_versions
    qualifier_template: Optional[KeyTemplate] = None
    timestamp: Optional[TimestampSource] = None
    set_marker: bytes = b""

    @property
    def versioned(self) -> bool:
        return self.timestamp is not None


@dataclass(frozen=True)
class ItemColumn:
    """The whole item serialized into one column (for changing or unknown queries)."""

    family: str
    qualifier: bytes
    encoding: str = "json"
    include_keys: bool = True


@dataclass(frozen=True)
class IndexConfig:
    """Rows that replace a GSI: one per item whose image matches, keyed by a
    template that includes the item's key; kept correct on update and delete."""

    name: str
    row_key: KeyTemplate
    family: str
    table: Optional[str] = None  # None: the mapping's target table
    conditions: tuple = ()
    project: tuple = ()  # attributes copied into the index row (auto encoding)


@dataclass(frozen=True)
class OtherAttributes:
    """What happens to attributes a rule does not list."""

    mode: str = "column"  # column → family:<attribute name>; ignore; dead_letter
    family: Optional[str] = None
    encoding: str = "auto"


@dataclass(frozen=True)
class MatchCondition:
    attribute: str
    kind: str  # equals | prefix | regex | present
    value: Any = None
    pattern: Optional[re.Pattern] = None


def memo(config, name: str, build: Callable[[], Any]) -> Any:
    """A value derived from a frozen config object, built on first use and kept on
    the object (the hot paths look these up per attribute of every record)."""
    value = config.__dict__.get(name)
    if value is None:
        value = build()
        object.__setattr__(config, name, value)
    return value


@dataclass(frozen=True)
class RuleConfig:
    name: str
    conditions: tuple  # tuple[MatchCondition, ...]; empty = matches every item
    skip: bool = False
    row_key: Optional[KeyTemplate] = None
    columns: tuple = ()  # tuple[ColumnConfig, ...]
    other: OtherAttributes = OtherAttributes()
    include_key_attributes: bool = False
    item_column: Optional[ItemColumn] = None
    indexes: tuple = ()  # tuple[IndexConfig, ...]
    hook: Optional[str] = None  # "module:function" escape hatch
    # Attributes the rule uses up in templates and timestamps: placed, not "other".
    consumed: frozenset = frozenset()

    def column_for(self, attribute: str) -> Optional[ColumnConfig]:
        # built once: this is on the per-attribute hot path
        return memo(self, "_by_attribute", lambda: {c.attribute: c for c in self.columns}).get(attribute)


@dataclass(frozen=True)
class TtlConfig:
    """DynamoDB TTL: the attribute holding the expiry, and whether the stream's TTL
    deletions (userIdentity principal dynamodb.amazonaws.com) are applied or ignored
    (then a family max-age usually expires the data in Bigtable instead)."""

    attribute: str
    deletions: str = "apply"  # apply | ignore


@dataclass(frozen=True)
class MappingConfig:
    name: str
    source: SourceConfig
    target: TargetConfig
    families: tuple  # tuple[FamilyConfig, ...]
    rules: tuple  # tuple[RuleConfig, ...]
    delimiter: str = "#"
    unmatched: str = "dead_letter"  # what to do with items no rule matches: dead_letter | skip
    ttl: Optional["TtlConfig"] = None
    version: int = 1
    origin: str = "<memory>"
    description: Optional[str] = None  # one line for people (ddb2bt examples lists it); no effect

    def __getstate__(self) -> dict:
        # The compiled form (compiled.compile_mapping, kept on the mapping) is
        # generated code: rebuilt on first use after unpickling, never shipped.
        return {k: v for k, v in self.__dict__.items() if k != "_compiled"}

    def table_families(self) -> dict:
        """{table id: [FamilyConfig]} for create-table: the target gets every
        declared family; an index table gets its index family (one version).
        The migration's touch-marker family is not here: the cutover creates it
        when a backfill begins and drops it at the finish."""
        out = {self.target.table: list(self.families)}
        for rule in self.rules:
            for index in rule.indexes:
                if index.table:
                    fams = out.setdefault(index.table, [])
                    if all(f.name != index.family for f in fams):
                        fams.append(FamilyConfig(index.family, max_versions=1))
        return out

    @property
    def tables(self) -> tuple:
        """Every Bigtable table the mapping writes (target first, then index tables)."""
        out = [self.target.table]
        for rule in self.rules:
            for index in rule.indexes:
                if index.table and index.table not in out:
                    out.append(index.table)
        return tuple(out)

    @property
    def family_names(self) -> frozenset:
        return frozenset(f.name for f in self.families)

    def with_overrides(
        self, project: Optional[str] = None, instance: Optional[str] = None, table: Optional[str] = None
    ) -> "MappingConfig":
        target = replace(
            self.target,
            project=project or self.target.project,
            instance=instance or self.target.instance,
            table=table or self.target.table,
        )
        return replace(self, target=target)


# --- parsing ---------------------------------------------------------------------


class _Node:
    """A dict being read, which knows its path and rejects unknown keys."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"must be a mapping, got {type(data).__name__}", path or "<root>")
        self.data = data
        self.path = path
        self.used: set = set()
        self.explained: set = set()  # keys a "did you mean" already named (not reported again as unknown)

    def sub(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, default: Any = None, required: bool = False) -> Any:
        self.used.add(key)
        if key not in self.data or self.data[key] is None:
            if required:
                self.missing(key)
            return default
        return self.data[key]

    def missing(self, key: str, why: str = "") -> None:
        """Raise "is required": a required key that is missing is most often a
        misspelt one, so a key of this node close to it is named."""
        near = difflib.get_close_matches(key, [str(k) for k in self.data if k != key and k not in self.used], n=1)
        hint = f" (found {near[0]!r}: did you mean {key!r}?)" if near else ""
        self.explained.update(near)
        raise ConfigError(f"is required{why}{hint}", self.sub(key))

    def string(self, key: str, required: bool = False, default: Optional[str] = None) -> Optional[str]:
        value = self.get(key, default, required)
        if value is not None and (not isinstance(value, str) or not value):
            problem = ConfigError(f"must be a non-empty string, got {value!r}", self.sub(key))
            if required:
                raise problem  # nothing to go on with
            _report(problem)
            return default
        return value

    def integer(self, key: str, minimum: int = 0) -> Optional[int]:
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            _report(ConfigError(f"must be an integer ≥ {minimum}, got {value!r}", self.sub(key)))
            return None
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            _report(ConfigError(f"must be true or false, got {value!r}", self.sub(key)))
            return default
        return value

    def choice(self, key: str, choices: tuple, default: str) -> str:
        value = self.get(key, default)
        if value not in choices:
            _report(ConfigError(f"must be one of {', '.join(choices)}; got {value!r}{_did_you_mean(value, choices)}",
                                self.sub(key)))
            return default
        return value

    def node(self, key: str, required: bool = False) -> Optional["_Node"]:
        value = self.get(key, None, required)
        return None if value is None else _Node(value, self.sub(key))

    def done(self) -> None:
        for key in (k for k in self.data if k not in self.used and k not in self.explained):
            hint = difflib.get_close_matches(str(key), sorted(self.used), n=1)
            suffix = f" (did you mean {hint[0]!r}?)" if hint else f" (known: {', '.join(sorted(self.used))})"
            _report(ConfigError(f"unknown field{suffix}", self.sub(str(key))))


def parse_mapping(data: Any, origin: str = "<memory>") -> MappingConfig:
    """The mapping, or ConfigError: the one problem found, or ConfigProblems
    listing every problem the file has (each with its field path)."""
    problems: list = []
    token = _PROBLEMS.set(problems)
    try:
        mapping = _section(lambda: _parse_mapping(data, origin))
    finally:
        _PROBLEMS.reset(token)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigProblems.of(problems, origin)
    return mapping


def _parse_source(root: "_Node") -> SourceConfig:
    src = root.node("source", required=True)
    source_table = src.string("table", required=True)
    if not _DDB_TABLE.match(source_table):
        _report(ConfigError(f"{source_table!r} is not a valid DynamoDB table name", src.sub("table")))
    key = src.node("key", required=True)
    source = SourceConfig(
        table=source_table,
        partition_key=key.string("partition", required=True),
        sort_key=key.string("sort"),
        region=src.string("region"),
        kinesis=_section(lambda: _parse_kinesis(src.node("kinesis"))),
    )
    key.done()
    src.done()
    return source


def _parse_target(root: "_Node") -> TargetConfig:
    tgt = root.node("target", required=True)
    target = TargetConfig(
        project=tgt.string("project", required=True),
        instance=tgt.string("instance", required=True),
        table=tgt.string("table", required=True),
        app_profile=tgt.string("app_profile"),
        change_stream_retention_hours=tgt.integer("change_stream_retention_hours", minimum=1),
    )
    retention = target.change_stream_retention_hours
    if retention is not None and not CHANGE_STREAM_MIN_HOURS <= retention <= CHANGE_STREAM_MAX_HOURS:
        _report(ConfigError(f"a change stream keeps its changes {CHANGE_STREAM_MIN_HOURS} to "
                            f"{CHANGE_STREAM_MAX_HOURS} hours (1 to 7 days), got {retention}",
                            tgt.sub("change_stream_retention_hours")))
    if not _TABLE_ID.match(target.table):
        _report(ConfigError(f"{target.table!r} is not a valid Bigtable table id", tgt.sub("table")))
    tgt.done()
    return target


def _parse_mapping(data: Any, origin: str) -> Optional[MappingConfig]:
    root = _Node(data, "")
    version = root.get("version", 1)
    if version not in SUPPORTED_VERSIONS:
        _report(ConfigError(f"unsupported version {version!r} (supported: {SUPPORTED_VERSIONS})", "version"))

    source = _section(lambda: _parse_source(root))
    target = _section(lambda: _parse_target(root))

    delimiter = root.string("delimiter", default="#")
    if len(delimiter) != 1 or delimiter == "\\" or delimiter in "{}|":
        _report(ConfigError(f"must be a single character other than \\ {{ }} |, got {delimiter!r}", "delimiter"))
        delimiter = "#"  # to read the templates on

    # Every declared name counts as declared even when its settings are wrong:
    # one bad family must not make each column that uses it a second problem.
    families, family_names = _section(lambda: _parse_families(root), ((), _ANY_NAME))
    rules_data = root.get("rules", required=True)
    if not isinstance(rules_data, list) or not rules_data:
        raise ConfigError("must be a non-empty list of rules", "rules")
    parsed = [_section(lambda i=i, r=r: _parse_rule(r, f"rules[{i}]", delimiter, family_names, source))
              for i, r in enumerate(rules_data)]
    names = [r.name if r is not None else None for r in parsed]
    for i, name in enumerate(names):
        if name is not None and name in names[:i]:
            _report(ConfigError(f"duplicate rule name {name!r}", f"rules[{i}].name"))
    rules = tuple(r for r in parsed if r is not None)

    unmatched = root.choice("unmatched", ("dead_letter", "skip"), "dead_letter")
    ttl = _section(lambda: _parse_ttl(root.node("ttl")))
    name = root.string("name")
    description = root.string("description")
    root.done()
    if source is not None and len(rules) == len(parsed):
        for problem in placeholder_problems(source, rules, ttl, delimiter):
            _report(problem)
    if _PROBLEMS.get() or source is None or target is None:
        return None  # the problems are raised by parse_mapping
    return MappingConfig(
        name=name or target.table,
        source=source,
        target=target,
        families=families,
        rules=rules,
        delimiter=delimiter,
        unmatched=unmatched,
        ttl=ttl,
        version=version,
        origin=origin,
        description=description,
    )


def _parse_kinesis(node: Optional[_Node]) -> Optional[KinesisSourceConfig]:
    if node is None:
        return None
    config = KinesisSourceConfig(stream=node.string("stream", required=True),
                                 precision=node.choice("precision", KINESIS_PRECISIONS, "auto"))
    node.done()
    return config


def _parse_families(root: _Node) -> tuple:
    fams = root.node("families", required=True)
    if not fams.data:
        raise ConfigError("declare at least one column family", "families")
    if len(fams.data) > MAX_FAMILIES:
        raise ConfigError(f"{len(fams.data)} families; Bigtable allows about {MAX_FAMILIES} per table", "families")
    out = []
    for name in fams.data:
        family = _section(lambda name=name: _parse_family(fams, name))
        if family is not None:
            out.append(family)
    fams.done()
    return tuple(out), {str(name) for name in fams.data}


def _parse_family(fams: _Node, name: Any) -> FamilyConfig:
    path = fams.sub(str(name))
    spec = fams.get(name) or {}
    if not isinstance(name, str) or not _FAMILY_NAME.match(name):
        raise ConfigError(f"{name!r} is not a valid column family name", path)
    _not_reserved(name, path)
    node = _Node(spec, path)
    family = FamilyConfig(
        name=name,
        max_versions=node.integer("max_versions", 1),
        max_age_seconds=node.integer("max_age_seconds", 1),
        gc=node.choice("gc", ("union", "intersection"), "union"),
    )
    if family.gc == "intersection" and not (family.max_versions and family.max_age_seconds):
        _report(ConfigError("gc: intersection needs both max_versions and max_age_seconds", node.sub("gc")))
    node.done()
    return family


def _undeclared(family: str, family_names: set) -> str:
    return f"family {family!r} is not declared under 'families'{_did_you_mean(family, sorted(family_names))}"


def _family_of(column: str, path: str, family_names: set, delimiter: str) -> tuple:
    family, sep, qualifier = column.partition(":")
    if not sep or not family or not qualifier:
        raise ConfigError(f"must be 'family:qualifier', got {column!r}", path)
    if family not in family_names:
        raise ConfigError(_undeclared(family, family_names), path)
    template = parse_template(qualifier, delimiter, path) if "{" in qualifier else None
    return family, qualifier.encode("utf-8"), template


def _parse_timestamp(node: Optional[_Node]) -> Optional[TimestampSource]:
    if node is None:
        return None
    ts = TimestampSource(
        attribute=node.string("attribute", required=True),
        format=node.choice("format", TIMESTAMP_FORMATS, "iso8601"),
    )
    node.done()
    return ts


def _parse_column(attribute: str, spec: Any, path: str, family_names: set, delimiter: str) -> ColumnConfig:
    if isinstance(spec, str):
        spec = {"column": spec}
    node = _Node(spec, path)
    kind = node.choice("as", COLUMN_KINDS, "value")
    if kind in ("set", "map"):
        family = node.string("family", required=True)
        if family not in family_names:
            _report(ConfigError(_undeclared(family, family_names), node.sub("family")))
        if "column" in node.data:
            _report(ConfigError(f"a {kind} fills a whole family: give 'family', not 'column'", node.sub("column")))
            node.used.add("column")
        qualifier, template = b"", None
    else:
        family, qualifier, template = _family_of(node.string("column", required=True), node.sub("column"),
                                                 family_names, delimiter)
    encoding = node.choice("encoding", ENCODINGS, "auto")
    marker = node.choice("marker", tuple(SET_MARKERS), "empty")
    if kind != "set" and "marker" in node.data:
        _report(ConfigError("only a set (as: set) has a marker", node.sub("marker")))
    timestamp = _section(lambda: _parse_timestamp(node.node("timestamp")))
    if timestamp is not None and kind != "value":
        _report(ConfigError(f"a {kind} cannot take its timestamp from an attribute", node.sub("timestamp")))
    node.done()
    return ColumnConfig(attribute=attribute, family=family, qualifier=qualifier, encoding=encoding, kind=kind,
                        qualifier_template=template, timestamp=timestamp, set_marker=SET_MARKERS[marker])


def _parse_match(data: Any, path: str) -> tuple:
    if data is None:
        return ()
    items = data if isinstance(data, list) else [data]
    out = []
    for i, spec in enumerate(items):
        condition = _section(lambda i=i, spec=spec: _parse_condition(spec, f"{path}[{i}]" if isinstance(data, list)
                                                                      else path))
        if condition is not None:
            out.append(condition)
    return tuple(out)


def _parse_condition(spec: Any, path: str) -> MatchCondition:
    node = _Node(spec, path)
    attribute = node.string("attribute", required=True)
    kinds = [k for k in MATCH_KINDS if k in node.data]
    if len(kinds) != 1:
        # None given is most often one misspelt ("prefx"): name it and the kind meant.
        near = [(k, difflib.get_close_matches(str(k), MATCH_KINDS, n=1)) for k in node.data if k != "attribute"]
        near = [(k, close[0]) for k, close in near if close] if not kinds else []
        hint = f" (found {near[0][0]!r}: did you mean {near[0][1]!r}?)" if near else ""
        raise ConfigError(f"give exactly one of {', '.join(MATCH_KINDS)}{hint}", node.path)
    kind = kinds[0]
    value = node.get(kind)
    pattern = None
    if kind == "regex":
        try:
            pattern = re.compile(value)
        except (re.error, TypeError) as exc:
            raise ConfigError(f"invalid regular expression {value!r}: {exc}", node.sub("regex")) from None
    elif kind == "prefix" and (not isinstance(value, str) or not value):
        raise ConfigError("must be a non-empty string", node.sub("prefix"))
    elif kind == "present" and not isinstance(value, bool):
        raise ConfigError("must be true or false", node.sub("present"))
    node.done()
    return MatchCondition(attribute=attribute, kind=kind, value=value, pattern=pattern)


def _parse_index(data: Any, path: str, delimiter: str, family_names: set,
                 source: Optional[SourceConfig]) -> IndexConfig:
    node = _Node(data, path)
    name = node.string("name", required=True)
    template = parse_template(node.get("row_key", required=True), delimiter, node.sub("row_key"))
    missing = [k for k in source.key_attributes if k not in template.sources] if source is not None else []
    if missing:
        _report(ConfigError(
            f"must include the item's key ({', '.join('{' + k + '}' for k in missing)} missing): "
            "one index row per item, so two items can never share one", node.sub("row_key")))
    family = node.string("family", required=True)
    _not_reserved(family, node.sub("family"))
    table = node.string("table")
    if table is None and family not in family_names:
        _report(ConfigError(_undeclared(family, family_names), node.sub("family")))
    if table is not None and not _TABLE_ID.match(table):
        _report(ConfigError(f"{table!r} is not a valid Bigtable table id", node.sub("table")))
    project = node.get("project", [])
    if not isinstance(project, list) or not all(isinstance(p, str) and p for p in project):
        _report(ConfigError("must be a list of attribute names", node.sub("project")))
        project = []
    index = IndexConfig(name=name, row_key=template, family=family, table=table,
                        conditions=_parse_match(node.get("match"), node.sub("match")), project=tuple(project))
    node.done()
    return index


def _parse_rule(data: Any, path: str, delimiter: str, family_names: set,
                source: Optional[SourceConfig]) -> RuleConfig:
    node = _Node(data, path)
    name = node.string("name", default=path)
    conditions = _parse_match(node.get("match"), node.sub("match"))
    skip = node.boolean("skip", False)
    if skip:
        node.done()
        return RuleConfig(name=name, conditions=conditions, skip=True)
    hook = node.string("hook")
    if hook is not None:
        _section(lambda: resolve_hook(hook, node.sub("hook")))
        node.done()
        return RuleConfig(name=name, conditions=conditions, hook=hook)
    # A rule whose row key cannot be read is still read to its end: its columns
    # and indexes may hold problems of their own.
    template = _section(lambda: parse_template(node.get("row_key", required=True), delimiter, node.sub("row_key")))
    cols = node.node("columns")
    columns = []
    if cols is not None:
        for attribute in cols.data:
            column = _section(lambda attribute=attribute: _parse_column(
                str(attribute), cols.get(attribute), cols.sub(str(attribute)), family_names, delimiter))
            cols.used.add(attribute)
            if column is not None:
                columns.append(column)
        cols.done()
    seen: dict = {}
    for c in columns:
        if c.qualifier_template is not None or c.kind in ("set", "map"):
            continue
        where = (c.family, c.qualifier)
        if where in seen and not (c.versioned and next(x for x in columns if x.attribute == seen[where]).versioned):
            _report(ConfigError(
                f"attributes {seen[where]!r} and {c.attribute!r} both map to {c.family}:{c.qualifier.decode()}",
                node.sub("columns"),
            ))
        seen[where] = c.attribute
    item_column = _section(lambda: _parse_item_column(node.node("item_column"), family_names, delimiter))
    other = _section(lambda: _parse_other(node.node("other_attributes"), family_names), OtherAttributes("ignore"))
    _section(lambda: _check_exclusive_families(columns, other, item_column, node.sub("columns")))
    include_keys = node.boolean("include_key_attributes", False)
    indexes_data = node.get("indexes", [])
    if not isinstance(indexes_data, list):
        _report(ConfigError("must be a list", node.sub("indexes")))
        indexes_data = []
    parsed = [_section(lambda i=i, d=d: _parse_index(d, f"{node.sub('indexes')}[{i}]", delimiter, family_names,
                                                     source))
              for i, d in enumerate(indexes_data)]
    node.done()
    if template is None or None in parsed:
        raise _Reported("")  # its problems are recorded; a rule with a part missing is no rule
    consumed = set(template.sources)
    for c in columns:
        if c.qualifier_template is not None:
            consumed |= set(c.qualifier_template.sources)
        if c.timestamp is not None:
            consumed.add(c.timestamp.attribute)
    consumed -= {c.attribute for c in columns}
    return RuleConfig(
        name=name,
        conditions=conditions,
        row_key=template,
        columns=tuple(columns),
        other=other,
        include_key_attributes=include_keys,
        item_column=item_column,
        indexes=tuple(parsed),
        consumed=frozenset(consumed),
    )


class _AnyName:
    """The declared family names when the families could not be read at all:
    every name passes, so that one problem is not reported again at each use."""

    def __contains__(self, name: object) -> bool:
        return True

    def __iter__(self):
        return iter(())


_ANY_NAME = _AnyName()


class _Reported(ConfigError):
    """A part of the file whose problems are already recorded: nothing more to say."""


def _parse_item_column(item_node: Optional[_Node], family_names: set, delimiter: str) -> Optional[ItemColumn]:
    if item_node is None:
        return None
    family, qualifier, template_q = _family_of(item_node.string("column", required=True),
                                               item_node.sub("column"), family_names, delimiter)
    if template_q is not None:
        raise ConfigError("the item column's qualifier must be a literal", item_node.sub("column"))
    item_column = ItemColumn(family=family, qualifier=qualifier,
                             encoding=item_node.choice("encoding", ("json", "dynamodb_json"), "json"),
                             include_keys=item_node.boolean("include_keys", True))
    item_node.done()
    return item_column


def named_attributes(source: SourceConfig, rules: Sequence[RuleConfig], ttl: Optional[TtlConfig] = None) -> set:
    """Attributes the mapping names anywhere: keys, columns, qualifiers,
    conditions, timestamps, projections, the TTL attribute."""
    known = set(source.key_attributes) | ({ttl.attribute} if ttl is not None else set())
    for rule in rules:
        known.update(c.attribute for c in rule.columns)
        known.update(c.timestamp.attribute for c in rule.columns if c.timestamp is not None)
        known.update(s for c in rule.columns if c.qualifier_template is not None for s in c.qualifier_template.sources)
        known.update(cond.attribute for cond in rule.conditions)
        for index in rule.indexes:
            known.update(index.project)
            known.update(cond.attribute for cond in index.conditions)
    return known


def catch_all(rule: RuleConfig) -> Optional[str]:
    """How a rule maps attributes it does not name, if it maps them at all:
    ``other_attributes`` (mode column) or the ``item_column``."""
    if rule.other.mode == "column":
        return f"other_attributes (family {rule.other.family})"
    if rule.item_column is not None:
        return "the item_column"
    return None


def is_typo(a: str, b: str) -> bool:
    """One edit apart, ignoring case (two for names of 8+ characters): a slip of
    the keyboard, not merely a similar name."""
    a, b = a.lower(), b.lower()
    if a == b:
        return True
    limit = 2 if min(len(a), len(b)) >= 8 else 1
    if abs(len(a) - len(b)) > limit:
        return False
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1] <= limit


def placeholder_problems(source: SourceConfig, rules: Sequence[RuleConfig], ttl: Optional[TtlConfig],
                         delimiter: str = "#") -> list:
    """Row-key and index-key placeholders that name an attribute the mapping
    never names and no catch-all of the rule maps (or that is one keystroke
    from a named one): almost always a typo ({PKK} for {PK}), which makes every
    item a dead letter (a row key) or leaves the index empty. An attribute
    items do carry is said so by naming it: a column, or a ``present``
    condition. ``{match.X}`` comes from the rule's regex and rules with a hook
    may make attributes up: neither is judged here."""
    known = named_attributes(source, rules, ttl)
    out = []
    for i, rule in enumerate(rules):
        if rule.hook or rule.skip:
            continue
        keys = [(f"rules[{i}].row_key", rule.row_key, None)]
        keys += [(f"rules[{i}].indexes[{j}].row_key", index.row_key, index) for j, index in enumerate(rule.indexes)]
        for where, template, index in keys:
            for name in template.sources:
                if name in known or name.startswith("match."):
                    continue
                without = ("an item without it gets no index row, so the index stays empty" if index is not None
                           else "an item without it has no row key and is a dead letter")
                via = catch_all(rule)
                typo = next((k for k in sorted(known) if is_typo(name, k)), None)
                if via is not None and typo is None:
                    continue  # mapped through the catch-all, only not by name (lint notes it)
                close = typo or next(iter(difflib.get_close_matches(name, sorted(known), n=1)), None)
                hint = f" (did you mean {{{close}}}?)" if close else ""
                where_match = f"the index's match" if index is not None else "the rule's match"
                said = (f"is named nowhere else in the mapping; only {via} would map it" if via is not None
                        else "is neither a key attribute nor named anywhere in the mapping")
                out.append(ConfigError(
                    f"{{{name}}} {said}{hint}: {without}. If items do carry {name}, name it: a column, or "
                    f"{{attribute: {name}, present: true}} in {where_match}", where))
    return out


def _check_exclusive_families(columns: list, other: OtherAttributes, item_column: Optional[ItemColumn],
                              path: str) -> None:
    """A set or map fills its family with qualifiers taken from the data (members,
    map keys), so nothing else may write to that family: any shared qualifier
    would make every such item a dead letter (column_collision) at run time."""
    claims = []  # (family, description, fills the whole family, field path)
    for c in columns:
        if c.kind in ("set", "map"):
            claims.append((c.family, f"the {c.kind} {c.attribute!r} (as: {c.kind})", True, f"{path}.{c.attribute}"))
        else:
            shown = c.qualifier_template.text if c.qualifier_template is not None else c.qualifier.decode()
            claims.append((c.family, f"the column {c.attribute!r} ({c.family}:{shown})", False,
                           f"{path}.{c.attribute}"))
    if other.mode == "column":
        claims.append((other.family, "other_attributes (one column per unlisted attribute)", False,
                       path.rsplit(".", 1)[0] + ".other_attributes"))
    if item_column is not None:
        claims.append((item_column.family, f"the item_column ({item_column.family}:{item_column.qualifier.decode()})",
                       False, path.rsplit(".", 1)[0] + ".item_column"))
    for i, (family, what, whole, field) in enumerate(claims):
        for family2, what2, whole2, _ in claims[:i]:
            if family == family2 and (whole or whole2):
                filler = what if whole else what2
                raise ConfigError(f"family {family!r} is used by both {what2} and {what}; {filler} fills its "
                                  "family with qualifiers from the data, so it needs a family of its own", field)


def resolve_hook(spec: str, field: str = "hook"):
    """Import ``module:function`` (validated at start-up, so a typo fails fast)."""
    import importlib

    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise ConfigError(f"must be 'module:function', got {spec!r}", field)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r}: {exc}", field) from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(f"{module_name!r} has no function {func_name!r}", field)
    return func


def _parse_other(node: Optional[_Node], family_names: set) -> OtherAttributes:
    if node is None:
        # Loses nothing by default: an attribute the mapping does not place is a
        # dead letter until the user says where it goes (or to ignore it).
        return OtherAttributes(mode="dead_letter")
    mode = node.choice("mode", OTHER_MODES, "column")
    family = node.string("family")
    if mode == "column":
        if family is None:
            node.missing("family", " when mode is 'column'")
        if family not in family_names:
            _report(ConfigError(_undeclared(family, family_names), node.sub("family")))
    encoding = node.choice("encoding", ENCODINGS, "auto")
    node.done()
    return OtherAttributes(mode=mode, family=family, encoding=encoding)


def _parse_ttl(node: Optional[_Node]) -> Optional[TtlConfig]:
    if node is None:
        return None
    ttl = TtlConfig(attribute=node.string("attribute", required=True),
                    deletions=node.choice("deletions", ("apply", "ignore"), "apply"))
    node.done()
    return ttl


def load_mapping(path: str | Path) -> MappingConfig:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read mapping file: {exc.strerror}", str(p)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", str(p)) from None
    return parse_mapping(data, origin=str(p))


def mapping_from_text(text: str, origin: str = "<text>") -> MappingConfig:
    return parse_mapping(yaml.safe_load(text), origin=origin)


def check_distinct_tables(mappings: Sequence[MappingConfig], labels: Sequence[str],
                          state_names: Optional[Sequence[str]] = None) -> None:
    """The mappings of one job must differ in name (each table's state key), in
    source table (its stream is read once) and in target tables (each table's
    cutover creates and drops its marker family on its own schedule, and two
    writers of one row would clash). ``labels`` name the mappings in the error
    (their files); ``state_names`` the state keys when not the mappings' names."""
    names = list(state_names) if state_names is not None else [m.name for m in mappings]
    seen: dict = {}
    for mapping, label, name in zip(mappings, labels, names):
        source = f"{mapping.source.region}/{mapping.source.table}" if mapping.source.region else mapping.source.table
        keys = [("state name", name), ("source table", source)]
        keys += [("target table", f"{mapping.target.project}/{mapping.target.instance}/{t}") for t in mapping.tables]
        for what, value in keys:
            other = seen.setdefault((what, value), label)
            if other != label:
                raise ConfigError(f"{other} and {label} have the same {what} ({value}): one job replicates each "
                                  "table once, under its own name, into its own target tables", "--mapping")
