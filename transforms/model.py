"""Frozen values passed between the pipeline's stages.

Stream source ──RecordBatch / ShardClosed──▶ mapping ──MappedBatch / ShardClosed──▶
Bigtable sink ──DeadLetter──▶ (dead-letter output, also stored durably)
(the backfill source likewise: RecordBatch / PartDone; single ChangeRecords and
MappedChanges are accepted too)

Timestamps are integer milliseconds since the Unix epoch everywhere: Bigtable's
emulator and service accept only whole-millisecond cell timestamps, and keeping
them integral from the start means no rounding can ever differ between a write
and its replay.
"""
from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field, fields
from operator import itemgetter
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

AttributeValue = Mapping[str, Any]  # boto3 low-level form: {"S": "x"}, {"N": "1"}, {"B": b"..."}
Item = Mapping[str, AttributeValue]

INSERT = "INSERT"
MODIFY = "MODIFY"
REMOVE = "REMOVE"
EVENT_NAMES = (INSERT, MODIFY, REMOVE)

# change_ms of a stream record that carried no ApproximateCreationDateTime: kept
# missing (not invented) so the mapping dead-letters it saying exactly that.
NO_CHANGE_TIME = -1

_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
_ONE_MS = _dt.timedelta(milliseconds=1)


def datetime_to_ms(value: Any) -> int:
    """Whole milliseconds since the epoch, rounded down, from what boto3 gives for
    ``ApproximateCreationDateTime`` (a datetime; numbers are taken as seconds)."""
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.timezone.utc)
        return (value - _EPOCH) // _ONE_MS  # integer arithmetic: no float rounding
    if isinstance(value, (int, float)):
        return int(value * 1000)
    raise TypeError(f"not a timestamp: {type(value).__name__}")


@dataclass(frozen=True, slots=True)
class StreamPosition:
    """Where a record sits in a DynamoDB stream. Sequence numbers are decimal
    strings of up to 40 digits; they only grow within a shard."""

    stream_arn: str
    shard_id: str
    sequence_number: str


@dataclass(frozen=True, slots=True)
class BackfillPosition:
    """Where a backfilled item sits: a scan segment or an export data file, and
    the token to resume from so that nothing before this item is read again
    needlessly and nothing after it is skipped (the *previous* page's key for all
    but a page's last item). ``count`` is the item's ordinal in its part."""

    source: str  # "scan" | "export"
    part: str  # e.g. "segment-0003-of-0016" or a data file name
    resume: Optional[str]
    count: int


class StreamElement:
    """What passes between the pipelines' stages (RecordBatch, MappedBatch and
    the ShardClosed / PartDone markers): one type, so the pipeline can give it one
    coder whose size estimate is cheap (``ddb2bt.pipeline.source.coders``)."""

    __slots__ = ()

    def estimated_bytes(self) -> int:
        return ELEMENT_OVERHEAD_BYTES


# A marker's size, and a record's beyond its image bytes, in size estimates.
ELEMENT_OVERHEAD_BYTES = 100


@dataclass(frozen=True, slots=True)
class PartDone(StreamElement):
    """Marker: a backfill part (segment or file) was read to its end."""

    source: str
    part: str
    count: int


@dataclass(frozen=True, slots=True)
class ChangeRecord:
    """One DynamoDB change, as read from a stream (or synthesised by a backfill).

    ``change_ms`` is the cell timestamp the change is written with (docs/design.md §3):
    the record's ApproximateCreationDateTime for stream records, the handoff time
    minus one millisecond for backfill records.
    """

    event_name: str
    keys: Item
    new_image: Optional[Item]
    old_image: Optional[Item]
    change_ms: int
    position: Optional[StreamPosition] = None
    event_id: str = ""
    # True for TTL expiries: a REMOVE by userIdentity principal dynamodb.amazonaws.com.
    is_ttl_delete: bool = False
    size_bytes: int = 0
    # Backfill only: the handoff second. Rows holding versioned cells are written
    # only if the live tail has not touched the item since then (see mapping.py).
    backfill_since_ms: Optional[int] = None
    # The change time in microseconds where the source gives it that precisely
    # (Kinesis with MICROSECOND precision); -1: only change_ms is known. Only the
    # ordering guard reads it (docs/design.md §10).
    change_us: int = -1

    @property
    def item(self) -> Optional[Item]:
        """The image describing the item for key and rule purposes."""
        return self.new_image if self.new_image is not None else self.old_image


# Mutations are NamedTuples, not frozen dataclasses: equally immutable and typed,
# but built ~3x faster, and a typical change builds 10-20 of them (the frozen
# dataclass __init__ was a tenth of the pipeline's CPU).
class SetCell(NamedTuple):
    family: str
    qualifier: bytes
    value: bytes
    timestamp_ms: int


class DeleteCells(NamedTuple):
    """Delete every version of one column in ``[start_ms, end_ms)``: time-bounded,
    so a replay can never erase data newer than the change that caused it."""

    family: str
    qualifier: bytes
    start_ms: int
    end_ms: int


Mutation = Union[SetCell, DeleteCells]


@dataclass(frozen=True, slots=True)
class Guard:
    """How a backfill row is protected against the live tail (mapping.py explains).

    The row's touch marker is ``family:qualifier``; the tail touched the item
    after the handoff when the marker has a version at or after ``since_ms``.
    ``conditional``: write with CheckAndMutateRow, only if not touched (rows with
    versioned cells). Otherwise write normally and, once acknowledged, if the
    item was touched, delete the backfill's own cells (``[0, backfill_ms + 1)``,
    never the tail's, which are all at or after ``since_ms``)."""

    family: str
    qualifier: bytes
    since_ms: int
    conditional: bool
    backfill_ms: int


@dataclass(frozen=True, slots=True)
class RowChange:
    """The effect of one source change on one Bigtable row, in order."""

    table: str
    row_key: bytes
    # tuple[Mutation, ...]; built from wire bytes alone (build_row_change), decoded
    # from them when first read: EncodedMutations says how.
    mutations: tuple
    guard: Optional[Guard] = None  # backfill rows only
    # Request bytes this row adds to a batch. The mapping computes it while it
    # checks the limits (one pass); computed here when not given.
    size_bytes: int = -1
    # Versioned cells (timestamp from an attribute) this change writes or deletes:
    # ((family, qualifier, version_ms, is_write), ...), and the item that owns them
    # (its key as canonical typed JSON). Two items may map to one version; the sink
    # then refuses the later one (dead letter ``version_clash``) and never lets one
    # item's delete remove another's version.
    versioned: tuple = ()
    owner: bytes = b""
    # ``mutations`` already in Bigtable's wire format (transforms.wire.encode_mutations:
    # the Entry.mutations fields), when whoever built the change encoded them (the
    # compiled mapping does); None: the sink encodes the tuples.
    # Not an __init__ argument, so ``dataclasses.replace(change, mutations=...)``
    # cannot carry bytes that no longer match: the copy has None. Not compared: two
    # changes with the same mutations are equal whether or not one was encoded.
    wire: Optional[bytes] = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.size_bytes < 0:
            object.__setattr__(self, "size_bytes", mutations_size(self.row_key, self.mutations))

    @property
    def mutation_count(self) -> int:
        """len(mutations), without decoding them (see EncodedMutations)."""
        held = _MUTATIONS_SLOT.__get__(self)
        return held.count if type(held) is EncodedMutations else len(held)

    @property
    def set_columns(self) -> set:
        """{(family, qualifier)} of the SetCell mutations, read from the wire bytes
        where the change holds only those (see EncodedMutations)."""
        held = _MUTATIONS_SLOT.__get__(self)
        if type(held) is EncodedMutations:
            if held.columns is not None:
                return set(held.columns)
            from ddb2bt.transforms.wire import set_cell_columns  # inside: transforms.wire imports this module
            return set_cell_columns(self.wire)
        return {(m.family, m.qualifier) for m in held if isinstance(m, SetCell)}

    @property
    def set_column_order(self) -> tuple:
        """``set_columns`` sorted, as a tuple: for the compiled mapping's common
        row the very tuple the mapping keeps for the item's shape (so a caller
        may key a cache on it), read without touching the wire bytes."""
        held = _MUTATIONS_SLOT.__get__(self)
        if type(held) is EncodedMutations and held.columns is not None:
            return held.columns
        return tuple(sorted(self.set_columns))

    @property
    def families(self):
        """The column families of the mutations, as an iterable (repeats allowed),
        without decoding them (see EncodedMutations)."""
        held = _MUTATIONS_SLOT.__get__(self)
        return held.families if type(held) is EncodedMutations else map(_FAMILY_OF, held)


class EncodedMutations(NamedTuple):
    """What a RowChange built from its wire bytes alone holds in its mutations slot
    (the compiled mapping's, on the live path: most changes are only ever sent,
    and building their mutation tuples was ~a tenth of the live path's CPU).
    Reading ``RowChange.mutations`` decodes them from ``RowChange.wire`` once
    (transforms.wire.decode_mutations: exactly the tuples the bytes were written
    from) and keeps them; what the sink reads for every change — how many, which
    families — is here."""

    count: int
    families: tuple  # the column families of the mutations, each once
    # The (family, qualifier) of every SetCell, sorted, when whoever encoded the
    # bytes knew them (the compiled mapping's common row: a backfill's repair
    # intent records them for every row; reading them back from the bytes cost
    # the export backfill a sixth of its CPU); None: read from the bytes.
    columns: Optional[tuple] = None


class _DecodedOnRead:
    """RowChange.mutations: the slot's value, unless it holds EncodedMutations:
    then the tuples decoded from the change's wire bytes, stored in the slot on
    first read (a race only decodes the same bytes twice)."""

    def __init__(self, slot) -> None:
        self.slot = slot  # the slot's own descriptor: what slot_builder fills

    def __get__(self, change, owner=None):
        if change is None:
            return self
        held = self.slot.__get__(change, owner)
        if type(held) is EncodedMutations:
            from ddb2bt.transforms.wire import decode_mutations  # inside: transforms.wire imports this module
            held = decode_mutations(change.wire)
            self.slot.__set__(change, held)
        return held

    def __set__(self, change, value) -> None:
        self.slot.__set__(change, value)

    def __delete__(self, change) -> None:
        self.slot.__delete__(change)


_MUTATIONS_SLOT = RowChange.mutations
RowChange.mutations = _DecodedOnRead(_MUTATIONS_SLOT)
# A mutation's column family: field 0 of SetCell and of DeleteCells.
_FAMILY_OF = itemgetter(0)


# A mutation's framing in a request beyond its family, qualifier and value bytes
# (tags, lengths, timestamps): an estimate, used only to keep batches under limits.
MUTATION_OVERHEAD_BYTES = 16


def mutations_size(row_key: bytes, mutations) -> int:
    total = len(row_key)
    for m in mutations:
        total += len(m.family) + len(m.qualifier) + MUTATION_OVERHEAD_BYTES
        if type(m) is SetCell:
            total += len(m.value)
    return total


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A record that could not be applied, with why. Stored durably and counted;
    ``ddb2bt dlq list`` shows them."""

    reason: str  # short stable code, e.g. "row_key_too_long", "unknown_family"
    error_class: str
    message: str
    stage: str  # "map" or "write"
    record: ChangeRecord
    failed_at_ms: int


@dataclass(frozen=True, slots=True)
class MappedChange:
    """A record and everything mapping it produced: either row changes or (if it
    could not be mapped) one dead letter; possibly neither (a skipped record)."""

    record: ChangeRecord
    rows: tuple = ()  # tuple[RowChange, ...]
    dead_letter: Optional[DeadLetter] = None


@dataclass(frozen=True, slots=True)
class RecordBatch(StreamElement):
    """Consecutive ChangeRecords of one read round, in stream order: what passes
    from the stream source to the mapping. One element per page instead of per
    record: the runner's cost per element (~12 us) was a tenth of the pipeline's
    CPU. Markers (ShardClosed) still travel alone, in order."""

    records: tuple  # tuple[ChangeRecord, ...]

    def estimated_bytes(self) -> int:
        return sum(r.size_bytes + ELEMENT_OVERHEAD_BYTES for r in self.records)


@dataclass(frozen=True, slots=True)
class MappedBatch(StreamElement):
    """A RecordBatch mapped: its MappedChanges in the same order."""

    changes: tuple  # tuple[MappedChange, ...]

    def estimated_bytes(self) -> int:
        return sum(2 * c.record.size_bytes + ELEMENT_OVERHEAD_BYTES for c in self.changes)


@dataclass(frozen=True, slots=True)
class ShardClosed(StreamElement):
    """Marker: the reader reached the end of a closed shard. The sink records the
    shard as finished only after every write before this marker is acknowledged,
    which is what lets the shard's children start (per-key order, docs/design.md §4.2)."""

    stream_arn: str
    shard_id: str
    last_sequence_number: Optional[str] = None


def slot_builder(cls, computed_by_caller: bool = False) -> Callable:
    """A function ``build(*values)`` making a ``cls`` (a frozen dataclass with
    slots and no ``__post_init__``) from every field's value in declaration order
    (``init=False`` fields too), as ``cls(*values)`` would, by filling the slots
    directly. A frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``, about twice this; the live path builds a few such
    objects per change. The same fields, equality, hash and pickling as the
    constructor's (``tests/unit/transforms/test_model_builders.py``). ``computed_by_caller``:
    the class has a ``__post_init__`` that is not run, and every caller passes
    the values it would compute (RowChange's size_bytes)."""
    if ("__post_init__" in cls.__dict__) != computed_by_caller or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__}: slot_builder needs slots, and a __post_init__ only if the caller "
                        "computes what it would")
    names = [f.name for f in fields(cls)]
    if sorted(names) != sorted(cls.__slots__):
        raise TypeError(f"{cls.__name__}: its slots are not its fields")
    # Only generated identifiers enter the source; the class and its slots'
    # setters are bound as constants.
    scope = {"_new": object.__new__, "_cls": cls}
    # (A slot read through a descriptor of its own, like RowChange.mutations, is
    # filled through the slot's.)
    scope.update({f"_s{i}": getattr(getattr(cls, name), "slot", getattr(cls, name)).__set__
                  for i, name in enumerate(names)})
    args = ", ".join(f"a{i}" for i in range(len(names)))
    body = "".join(f"    _s{i}(o, a{i})\n" for i in range(len(names)))
    exec(f"def build({args}):\n    o = _new(_cls)\n{body}    return o\n", scope)  # noqa: S102
    build = scope["build"]
    build.__qualname__ = build.__name__ = f"build_{cls.__name__}"
    return build


def stream_of(element) -> str:
    """The stream (ARN) a live-path element came from: what routes it to its
    table's mapping and sink in a multi-table job (docs/design.md §4.3)."""
    kind = type(element)
    if kind is RecordBatch:
        first = element.records[0] if element.records else None
        return stream_of(first) if first is not None else _no_stream(element)
    if kind is MappedBatch:
        first = element.changes[0] if element.changes else None
        return stream_of(first.record) if first is not None else _no_stream(element)
    if kind is ShardClosed:
        return element.stream_arn
    if kind is MappedChange:
        return stream_of(element.record)
    if kind is ChangeRecord and type(element.position) is StreamPosition:
        return element.position.stream_arn
    return _no_stream(element)


def _no_stream(element) -> str:
    raise ValueError(f"{type(element).__name__} carries no stream position: a multi-table job cannot route it "
                     "(steps between the reader and the writer must keep every record's position)")


# Built once per record or change on the live path (slot_builder says why).
build_change_record = slot_builder(ChangeRecord)
build_stream_position = slot_builder(StreamPosition)
build_mapped_change = slot_builder(MappedChange)
# Once per back-filled item (a backfill reads millions).
build_backfill_position = slot_builder(BackfillPosition)
build_guard = slot_builder(Guard)
# Only for a caller that passes size_bytes (>= 0: what __post_init__ would compute) and
# the wire bytes of exactly these mutations, or None (mutations then a tuple), or
# EncodedMutations of the wire bytes as the mutations: the compiled mapping.
build_row_change = slot_builder(RowChange, computed_by_caller=True)
