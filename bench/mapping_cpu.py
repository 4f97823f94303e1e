"""CPU per change of the mapping alone: the general engine (the reference) vs the
compiled mapping, for each example mapping, over realistic change histories.

    .venv/bin/python bench/mapping_cpu.py                      # all four examples
    .venv/bin/python bench/mapping_cpu.py --changes 5000 --reps 7
    .venv/bin/python bench/mapping_cpu.py --profile general     # cProfile, top entries
    .venv/bin/python bench/mapping_cpu.py --profile compiled

Measures process CPU time (time.process_time), not wall time: the two engines run
in one process over the same records, interleaved, several repetitions, so the
ratio holds on a busy machine where throughput numbers do not. Reported per
mapping and kind of record (stream changes; backfill records; stream changes
with touch markers; stream changes mapped into the ordering guard's rows, as a
Kinesis source maps them, the images' cells found by each engine): the median
µs per change of each engine and their ratio.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import statistics
import string
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from run import MS_PER_S, RECORD_SPACING_MS, stream_records  # noqa: E402  (the throughput bench's catalog stream)

from ddb2bt.transforms.config import load_mapping  # noqa: E402
from ddb2bt.transforms.errors import MappingError  # noqa: E402
from ddb2bt.transforms.mapping import backfill_record, general_map_change, map_change, owned_cells  # noqa: E402
from ddb2bt.transforms.ordering import guarded_rows  # noqa: E402
from ddb2bt.transforms.model import INSERT, MODIFY, REMOVE, ChangeRecord  # noqa: E402

START_MS = 1_700_000_000_000
HANDOFF_MS = START_MS - 5_000  # backfill records: a handoff before the stream's changes
EXAMPLES = ("product_catalog", "videos", "invoices", "hr_orders")
# Share of changes that are removes / modifies of an existing item (as run.py's stream).
REMOVE_SHARE = 0.1
MODIFY_SHARE = 0.35


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(string.ascii_letters + " ", k=n))


def _iso(rng: random.Random) -> str:
    return f"2023-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:" \
           f"{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}"


# --- item makers: (keys, item) for key number k; and a modification of an item ---


def _video(rng, k):
    pk = {"S": f"{k // 8:04d}"}
    kind = k % 8
    if kind == 0:
        sk, attrs = "Video", {"UploadDate": {"S": _iso(rng)},
                              "Formats": {"M": {r: {"S": f"https://storage.example/{k}/{r}"}
                                                for r in ("480", "720", "1080")}}}
    elif kind == 1:
        sk, attrs = "VideoStatsLikes", {"Count": {"N": str(rng.randint(0, 10**6))}}
    elif kind == 2:
        sk, attrs = "VideoStatsViews", {"Count": {"N": str(rng.randint(0, 10**7))}}
    else:
        sk, attrs = f"VideoComment#{k}", {"Content": {"S": _text(rng, 200)}, "CreatedAt": {"S": _iso(rng)}}
    keys = {"pk": pk, "sk": {"S": sk}}
    return keys, dict(keys, **attrs)


def _video_modify(rng, item):
    sk = item["sk"]["S"]
    if sk.startswith("VideoStats"):
        return dict(item, Count={"N": str(rng.randint(0, 10**7))})
    if sk == "Video":
        return dict(item, UploadDate={"S": _iso(rng)})
    return dict(item, Content={"S": _text(rng, 200)})


def _invoice(rng, k):
    pk = {"S": f"Invoice-{k // 4:04d}"}
    details = {"M": {"Amount": {"N": str(rng.randint(1, 10**5))}, "Currency": {"S": "EUR"},
                     "Note": {"S": _text(rng, 60)}}}
    sk = pk["S"] if k % 4 == 0 else f"Payment-{k:05d}"
    keys = {"pk": pk, "sk": {"S": sk}}
    return keys, dict(keys, Details=details, DateCreated={"S": _iso(rng)})


def _invoice_modify(rng, item):
    details = dict(item["Details"]["M"], Amount={"N": str(rng.randint(1, 10**5))})
    return dict(item, Details={"M": details})


def _hr(rng, k):
    kind = k % 7
    n = k // 7
    if kind == 0:
        pk = sk = f"HR-EMPLOYEE#{n:04d}"
        attrs = {"Name": {"S": f"Employee {n}"}, "HireDate": {"S": "2020-01-01"},
                 "Warehouse": {"S": f"W{n % 5}"}, "JobTitle": {"S": "Clerk"}, "Email": {"S": f"e{n}@example.com"}}
    elif kind == 1:
        pk, sk = f"HR-EMPLOYEE#{n:04d}", f"JH#2021-{n % 12 + 1:02d}-01"
        attrs = {"Job": {"M": {"title": {"S": "Clerk"}, "department": {"S": "Sales"}}}}
    elif kind == 2:
        pk = sk = f"OE-ORDER#{n:05d}"
        attrs = {"CustomerID": {"S": f"C{n % 40}"}, "OrderStatus": {"S": rng.choice(["OPEN", "SHIPPED"])},
                 "OrderDate": {"S": "2023-09-10"}, "Total": {"N": f"{rng.randint(1, 9999)}.{rng.randint(0, 99)}"}}
    elif kind == 3:
        pk, sk = f"OE-ORDER#{n:05d}", f"ITEM#P{n % 30}"
        attrs = {"Line": {"M": {"product": {"S": f"P{n % 30}"}, "quantity": {"N": "2"}, "price": {"N": "9.5"}}}}
    elif kind == 4:
        pk = sk = f"OE-PRODUCT#P{n:04d}"
        attrs = {"Name": {"S": f"Product {n}"}, "Price": {"N": str(rng.randint(1, 999))}}
    elif kind == 5:
        pk, sk = f"OE-PRODUCT#P{n:04d}", f"WAREHOUSE#W{n % 5}"
        attrs = {"Quantity": {"N": str(rng.randint(0, 500))}}
    else:
        pk = sk = f"OE-CUSTOMER#C{n:04d}"
        attrs = {"Name": {"S": f"Customer {n}"}, "AccountRep": {"S": f"HR-EMPLOYEE#{n % 9:04d}"}}
    keys = {"PK": {"S": pk}, "SK": {"S": sk}}
    return keys, dict(keys, **attrs)


def _hr_modify(rng, item):
    if "OrderStatus" in item:
        return dict(item, OrderStatus={"S": rng.choice(["OPEN", "SHIPPED", "CLOSED"])})
    if "Warehouse" in item:
        return dict(item, Warehouse={"S": f"W{rng.randint(0, 4)}"})
    if "Quantity" in item:
        return dict(item, Quantity={"N": str(rng.randint(0, 500))})
    if "Price" in item:
        return dict(item, Price={"N": str(rng.randint(1, 999))})
    return dict(item)


MAKERS = {"videos": (_video, _video_modify), "invoices": (_invoice, _invoice_modify), "hr_orders": (_hr, _hr_modify)}


def history(example: str, n: int, seed: int = 1, keys: int = 5000, whole_seconds: bool = True) -> list:
    """n ChangeRecords of one example: inserts, modifies and removes of ``keys`` items,
    their times whole seconds as DynamoDB Streams gives them (bench/run.py's
    ``stream_records``), or (``whole_seconds`` off) a millisecond each."""
    if example == "product_catalog":
        return [ChangeRecord(e, k, new, old, ts)
                for e, k, new, old, ts in stream_records(n, seed, keys, whole_seconds=whole_seconds)]
    make, modify = MAKERS[example]
    rng = random.Random(seed)
    state: dict = {}
    out = []
    now = START_MS
    for _ in range(n):
        k = rng.randrange(keys)
        old = state.get(k)
        roll = rng.random()
        now += RECORD_SPACING_MS
        ts = now - now % MS_PER_S if whole_seconds else now
        if old is not None and roll < REMOVE_SHARE:
            del state[k]
            out.append(ChangeRecord(REMOVE, old[0], None, old[1], ts))
            continue
        if old is not None and roll < REMOVE_SHARE + MODIFY_SHARE:
            new = (old[0], modify(rng, old[1]))
        else:
            new = make(rng, k)
        state[k] = new
        out.append(ChangeRecord(MODIFY if old else INSERT, new[0], new[1], old[1] if old else None, ts))
    return out


def backfill(records: list) -> list:
    """The items of a history as backfill records (one per item image written)."""
    return [backfill_record(r.keys, r.new_image, HANDOFF_MS) for r in records if r.new_image is not None]


ENGINES = (general_map_change, map_change)
# The ordering guard's rows of a change (a Kinesis source: ordering.guarded_rows),
# its images' cells found by the general engine against the compiled rules.
GUARD_ENGINES = (lambda mapping, record, mark: guarded_rows(mapping, record, owned_cells),
                 lambda mapping, record, mark: guarded_rows(mapping, record))


def run(engine, mapping, records: list, mark: bool) -> int:
    failed = 0
    for r in records:
        try:
            engine(mapping, r, mark)
        except MappingError:
            failed += 1
    return failed


def cpu_us(engine, mapping, records: list, mark: bool) -> float:
    t0 = time.process_time()
    run(engine, mapping, records, mark)
    return (time.process_time() - t0) / len(records) * 1e6


def measure(changes: int, reps: int, examples: tuple) -> list:
    rows = []
    for example in examples:
        mapping = load_mapping(ROOT / "examples" / f"{example}.yaml")
        stream = history(example, changes)
        kinds = (("stream", stream, False, ENGINES), ("stream+marker", stream, True, ENGINES),
                 ("backfill", backfill(stream), False, ENGINES), ("guarded", stream, False, GUARD_ENGINES))
        for kind, records, mark, (general_engine, compiled_engine) in kinds:
            run(general_engine, mapping, records, mark)  # warm-up (plans, compiled form, caches)
            run(compiled_engine, mapping, records, mark)
            general, compiled = [], []
            for _ in range(reps):  # interleaved: both see the same machine load
                general.append(cpu_us(general_engine, mapping, records, mark))
                compiled.append(cpu_us(compiled_engine, mapping, records, mark))
            g, c = statistics.median(general), statistics.median(compiled)
            rows.append((example, kind, len(records), g, c, g / c))
    return rows


def profile(engine_name: str, changes: int, examples: tuple, top: int) -> None:
    engine = general_map_change if engine_name == "general" else map_change
    for example in examples:
        mapping = load_mapping(ROOT / "examples" / f"{example}.yaml")
        records = history(example, changes)
        run(engine, mapping, records, False)
        prof = cProfile.Profile()
        prof.enable()
        run(engine, mapping, records, False)
        prof.disable()
        print(f"=== {example}: {engine_name}, {len(records)} stream changes")
        pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--changes", type=int, default=4000, help="stream changes per example mapping")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions (the median is reported)")
    ap.add_argument("--examples", default=",".join(EXAMPLES), help="comma-separated example mappings")
    ap.add_argument("--profile", choices=("general", "compiled"), help="print a cProfile instead")
    ap.add_argument("--top", type=int, default=25, help="profile entries shown")
    args = ap.parse_args(argv)
    examples = tuple(args.examples.split(","))
    gc.collect()
    gc.freeze()  # the pre-built records are not the engines' garbage (see run.py settle())
    if args.profile:
        profile(args.profile, args.changes, examples, args.top)
        return
    print(f"{'mapping':16} {'records':14} {'n':>6} {'general µs':>11} {'compiled µs':>12} {'ratio':>6}")
    for example, kind, n, g, c, ratio in measure(args.changes, args.reps, examples):
        print(f"{example:16} {kind:14} {n:6d} {g:11.1f} {c:12.1f} {ratio:6.2f}")


if __name__ == "__main__":
    main()
