"""Re-checking `verify`'s differences once the live tail has caught up with them.

A verify of a table that is being written reads the source and the target at
different moments, so an item changed in between looks different although the
replication is right: the tail simply has not applied that change yet. A
difference is therefore only reported when it stays: for every divergent row,
verify waits until the tail has passed the moment of the re-check (every shard
has applied all records created before it: ``tail_passed``), reads the row's
owning items again (GetItem, strongly consistent) and the row again, and
compares. A row that matches now was in flight; a row that still differs is
checked once more in a later round (a fresh time, a fresh wait for the tail)
and reported only when that round finds it different again, the same row with
its owners in the same state (docs/design.md §11): one round's verdict rests
on the stream's record times, which are approximate, and one look can fall
between two changes of a busy item that leave it as it was (a put then a
delete: the owner reads None before and after, the row shows the put). Rows
whose items keep changing are re-checked up to ``rounds`` times, then counted
unsettled: not proven either way, never a difference.

Why this is exact for rows verify found: the target is read before the source
is scanned (see verify.py), so a row of an item created during verify is seen
as *missing* (its owner known: re-read), and a row of an item deleted during
verify as *extra* (re-read: gone once the tail applied the delete). What it
cannot resolve: an extra row whose item was deleted and created again while
verify ran (it then has no owner verify saw); such a row is reported.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ddb2bt.pipeline.verify.compare import LayoutDiff, add_cells, diff_layout
from ddb2bt.transforms.attrs import canonical_typed_json
from ddb2bt.transforms.config import MappingConfig
from ddb2bt.transforms.errors import MappingError
from ddb2bt.transforms.mapping import expected_cells
from ddb2bt.pipeline.clients.dynamodb import list_shards
from ddb2bt.transforms.model import datetime_to_ms
from ddb2bt.transforms.rowkey import Placeholder, split_key

__all__ = ["RecheckOptions", "RecheckResult", "recheck", "stream_watermark"]

log = logging.getLogger(__name__)

# Records reach a DynamoDB stream shortly after the write (typically well under
# a second); "the tail is at the head" only covers a moment once this has passed.
STREAM_VISIBILITY_MS = 3000
# A change readable at t can carry a record time after t: the record is stamped
# when the stream makes it, which can follow the write becoming readable (the
# local emulator stamps it after storing the item; AWS calls the time
# approximate). Records up to this much after t count as owed at t.
STAMP_SLACK_MS = 1000
# Checks of a row that must find it different, each after its own wait for the tail.
CONFIRMATIONS = 2
POLL_S = 1.0
# Records pending and no checkpoint moved for this long: no tail is running (a
# running one checkpoints every few seconds while it has work), so waiting on.
TAIL_STALLED_S = 30.0


@dataclass(frozen=True)
class RecheckOptions:
    wait_s: float = 300.0  # how long to wait for the tail to pass a re-check's time; 0 disables re-checks
    rounds: int = 5  # re-checks of a row whose item keeps changing
    max_rows: int = 10_000  # divergent rows held for re-checking (bounded memory); beyond: reported as found

    def __post_init__(self) -> None:
        if self.enabled and self.rounds < CONFIRMATIONS:
            raise ValueError(f"rounds: at least {CONFIRMATIONS} (a difference is confirmed by that many looks)")

    @property
    def enabled(self) -> bool:
        return self.wait_s > 0


@dataclass
class RecheckResult:
    rows: int = 0  # rows re-checked
    resolved: int = 0  # ...that matched once the tail had caught up
    rounds: int = 0
    timed_out: bool = False  # the tail did not pass in time: what is left is reported unconfirmed
    unsettled: int = 0  # rows whose items changed on every re-check: not proven either way
    unconfirmed: set = field(default_factory=set)  # (table, row) left when the wait ended: reported as found
    still: dict = field(default_factory=dict)  # table -> (want, have, LayoutDiff) of rows confirmed different

    def to_json(self) -> dict:
        return {"rows": self.rows, "resolved": self.resolved, "rounds": self.rounds, "timed_out": self.timed_out,
                "unsettled": self.unsettled}


def recheck(mapping: MappingConfig, suspects: dict, get_item: Callable[[dict], Optional[dict]],
            read_rows: Callable[[str, list], dict], tail_passed: Callable[[int], bool],
            options: RecheckOptions = RecheckOptions(), now_ms: Callable[[], int] = lambda: time.time_ns() // 10**6,
            sleep: Callable[[float], None] = time.sleep) -> RecheckResult:
    """``suspects``: {(table, row_key): [owner item keys]} (an extra row has no
    owner). One round: read the owners, note the time g, wait until the tail has
    applied everything up to g, read the rows, read the owners again. A row
    whose owners did not change in between must now equal their mapping: it
    is resolved, or confirmed different. A row whose owners changed is
    re-checked next round; after ``rounds`` it is counted unsettled (changing
    on every look: not proven either way, reported, not a difference)."""
    result = RecheckResult(rows=len(suspects))
    # A row no item owned when verify scanned (extra) may belong to an item
    # deleted and created again meanwhile: its candidate owners are the keys
    # its row key spells, where the key template can be read back.
    remaining = {at: owners or owner_candidates(mapping, *at) for at, owners in suspects.items()}
    confirmed: dict = {}  # table -> [want, have, LayoutDiff]
    strikes: dict = {}  # (table, row) -> _Strikes: consecutive looks that found the row different
    clock = time.monotonic
    while remaining and result.rounds < options.rounds:
        before = _read_owners(remaining, get_item)
        # The time the tail must pass is taken AFTER the read: a change that lands
        # between a time taken first and the read would be in `before` (and, unchanged,
        # in `after`) but not yet owed by the tail, a false "different".
        at = now_ms()
        started = clock()
        while not tail_passed(at):
            stalled = getattr(tail_passed, "stalled_s", lambda: 0.0)()
            if clock() - started > options.wait_s or stalled > TAIL_STALLED_S:
                log.warning("verify: the tail did not pass the re-check time (%s); %d row(s) reported unconfirmed",
                            f"no progress for {stalled:.0f}s: is it running?" if stalled > TAIL_STALLED_S else
                            f"waited {options.wait_s:.0f}s", len(remaining))
                result.timed_out = True
                result.unconfirmed = set(remaining)
                result.still = {t: tuple(v) for t, v in confirmed.items()}
                return result
            sleep(POLL_S)
        result.rounds += 1
        have_all = {table: read_rows(table, sorted(r for t, r in remaining if t == table))
                    for table in {t for t, _ in remaining}}
        after = _read_owners(remaining, get_item)
        settled = {at_row for at_row, owners in remaining.items()
                   if all(before[_key_id(k)] == after[_key_id(k)] for k in owners)}
        # A row whose owners changed during this look breaks its chain of
        # confirmations: what it showed before is no longer evidence.
        for at_row in set(remaining) - settled:
            strikes.pop(at_row, None)
        want: dict = {}
        owned: dict = {}
        clashes: list = []
        for keys, current in (v for k, v in after.items()):
            if current is None:
                continue
            try:
                cells = expected_cells(mapping, current)
            except MappingError:
                continue  # refused now: its rows compare as extra; verify's unmappable count has it
            add_cells(want, owned, clashes, keys, [c for c in cells.values() if (c.table, c.row_key) in settled])
        for table, have in have_all.items():
            rows = {r for t, r in settled if t == table}
            if not rows:
                continue
            want_t = {r: cols for r, cols in want.get(table, {}).items() if r in rows}
            diff = diff_layout(want_t, {r: v for r, v in have.items() if r in rows})
            diff.version_clashes = [c for c in clashes if c.table == table and c.row_key in rows]
            different = diff.rows()
            result.resolved += len(rows - different)
            for r in rows - different:
                strikes.pop((table, r), None)
            for r in different:
                evidence = (_owners_state(remaining[(table, r)], after), have.get(r))
                chain = strikes.get((table, r))
                # Only the same row, seen the same way while its owners held the
                # same state, adds to a chain: two looks at two different states
                # of a busy item (each can fall between two of its changes, a put
                # and a delete, say) prove nothing together.
                count = chain.count + 1 if chain is not None and chain.evidence == evidence else 1
                strikes[(table, r)] = _Strikes(count, evidence, (want_t.get(r), have.get(r), diff.only_rows({r})))
                if count >= CONFIRMATIONS:
                    _confirm(confirmed, table, r, strikes.pop((table, r)).seen)
        remaining = {k: v for k, v in remaining.items() if k not in settled or k in strikes}
    # Out of rounds: a row not confirmed CONFIRMATIONS times in a row (its items
    # changed, or one look found it different and the next could not look) is
    # not proven either way: unsettled, never a difference.
    result.unsettled = len(remaining)
    result.still = {t: tuple(v) for t, v in confirmed.items()}
    return result


@dataclass(frozen=True)
class _Strikes:
    count: int  # consecutive looks that found the row different
    evidence: tuple  # (the owners' state, the row as read): the same on every look of a chain
    seen: tuple  # (want row, have row, LayoutDiff of the row) of the last look


def _owners_state(owners: list, read: dict) -> tuple:
    """The owners' items as one comparable value (canonical JSON, None: absent)."""
    out = []
    for keys in owners:
        current = read[_key_id(keys)][1]
        out.append((_key_id(keys), None if current is None else canonical_typed_json({"M": current})))
    return tuple(sorted(out, key=lambda kv: kv[0]))


def _confirm(confirmed: dict, table: str, row: bytes, seen: tuple) -> None:
    want, have, diff = seen
    slot = confirmed.setdefault(table, [{}, {}, LayoutDiff()])
    if want is not None:
        slot[0][row] = want
    if have is not None:
        slot[1][row] = have
    slot[2].extend(diff, sort=True)



def owner_candidates(mapping: MappingConfig, table: str, row_key: bytes) -> list:
    """Item keys whose rows could be ``row_key``: every rule and index template
    of ``table`` read back (split_key) where each key attribute appears as a
    placeholder without transforms; a part that reads as a number is tried as
    N too. Candidates are only looked up: an item counts as the row's owner
    only if it exists and maps to that row."""
    key_attrs = mapping.source.key_attributes
    out: list = []
    templates = []
    for rule in mapping.rules:
        if rule.row_key is not None and table == mapping.target.table:
            templates.append(rule.row_key)
        templates += [ix.row_key for ix in rule.indexes if (ix.table or mapping.target.table) == table]
    for template in templates:
        try:
            parts = split_key(template, row_key)
        except ValueError:
            continue
        placeholders = [t for t in template.tokens if isinstance(t, Placeholder)]
        found: dict = {}
        for ph, raw in zip(placeholders, parts):
            if ph.source in key_attrs and not ph.transforms:
                try:
                    found[ph.source] = raw.decode("utf-8")
                except UnicodeDecodeError:
                    pass
        if set(found) != set(key_attrs):
            continue
        options = [{}]
        for name in key_attrs:
            typed = [{"S": found[name]}]
            try:
                float(found[name])
                typed.append({"N": found[name]})
            except ValueError:
                pass
            options = [dict(o, **{name: t}) for o in options for t in typed]
        out += [o for o in options if o not in out]
    return out


def _key_id(keys: dict) -> str:
    return canonical_typed_json({"M": keys})


def _read_owners(rows: dict, get_item: Callable) -> dict:
    """{key id: (keys, current item or None)} of every owner of ``rows``."""
    out: dict = {}
    for owners in rows.values():
        for keys in owners:
            k = _key_id(keys)
            if k not in out:
                out[k] = (keys, get_item(keys))
    return out





UNKNOWN = -1  # _pending_since: the shard's position could not be read


def _pending_since(streams, stream_arn: str, shard_id: str, after: Optional[str]) -> Optional[int]:
    """Creation time of the first record after ``after`` (None: nothing pending;
    UNKNOWN: the read failed).
    One GetRecords of one record per unfinished shard and re-check round: rounds
    come seconds apart and only while differences wait, well inside the shard's
    5 calls/s that the tail shares (docs/operations.md, AWS's limits); `status`
    reads the readers' reports instead and makes no such call."""
    from botocore.exceptions import ClientError

    args = {"ShardIteratorType": "AFTER_SEQUENCE_NUMBER", "SequenceNumber": after} if after else \
        {"ShardIteratorType": "TRIM_HORIZON"}
    try:
        it = streams.get_shard_iterator(StreamArn=stream_arn, ShardId=shard_id, **args)["ShardIterator"]
        records = streams.get_records(ShardIterator=it, Limit=1).get("Records", [])
    except ClientError as exc:
        # Not knowing is not "nothing pending": the caller waits and asks again
        # (a trimmed checkpoint stalls, and the wait reports it).
        log.debug("verify: could not read the position of %s: %s", shard_id, exc.response.get("Error", {}))
        return UNKNOWN
    if not records:
        return None
    return datetime_to_ms(records[0]["dynamodb"]["ApproximateCreationDateTime"])


def stream_watermark(streams, stream_arn: Optional[str], store, now_ms: Callable[[], int] = lambda: time.time_ns()
                     // 10**6) -> Callable[[int], bool]:
    """``passed(t)``: has the tail applied every stream record created up to
    ``t`` ms? Each unfinished shard's oldest record after its checkpoint (the
    tail checkpoints only what Bigtable holds) must be newer than ``t``, or the
    shard fully applied at a moment when records up to ``t`` are visible. No
    stream: nothing can arrive through a tail, so always passed."""
    if not stream_arn:
        return lambda t: True
    seen = {"positions": None, "moved": time.monotonic()}

    def passed(t: int) -> bool:
        listed = list_shards(streams, stream_arn, metrics_table=getattr(store, "job", None)).shards
        checkpoints = store.load_checkpoints(stream_arn, listed)  # the listed shards': not the stream's history
        positions = {s: (c.sequence_number, c.finished) for s, c in checkpoints.items()}
        if positions != seen["positions"]:
            seen["positions"], seen["moved"] = positions, time.monotonic()
        now = now_ms()
        for shard_id in listed:
            c = checkpoints.get(shard_id)
            if c is not None and c.finished:
                continue
            pending = _pending_since(streams, stream_arn, shard_id, c.sequence_number if c else None)
            if pending is UNKNOWN:
                return False
            if pending is None:
                if now - t < STREAM_VISIBILITY_MS:
                    return False
            elif pending <= t + STAMP_SLACK_MS:
                return False
        seen["moved"] = time.monotonic()
        return True

    # How long no checkpoint has moved while records were pending.
    passed.stalled_s = lambda: time.monotonic() - seen["moved"]
    return passed
