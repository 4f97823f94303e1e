"""recover's boundary sweep: rows/s and peak memory at two target sizes, on the
Bigtable emulator (docs/design.md §8.1.1).

The target holds N rows, each with a cell written inside the swept window; the
window's export lists every other item (their cells are owned), the rest were
created and deleted inside it (left out by AWS: their cells are stale). The
sweep runs in a fresh process; its own peak RSS is its VmHWM, less what it held
once imported and connected (so the emulator and this bench's load are not
counted). Memory should not follow N: the rows read and the new images go to
hash buckets on disk (spill.py) and are compared a bucket at a time.

    .venv/bin/python bench/recover_sweep.py [--sizes 10000 100000] [--runs 2]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WINDOW_S = 1_700_000_000  # the swept window [WINDOW_S, WINDOW_S + 900) in seconds
WINDOW_LEN_S = 900
LOAD_BATCH = 1000  # rows per MutateRows while loading
SIZES = (10_000, 100_000)


def _vm(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(field + ":"))) / 1024


def _key(i: int) -> dict:
    return {"pk": {"S": f"cat{i % 50:02d}"}, "sk": {"S": f"item#{i:07d}"}}


def _load(mapping, n: int) -> None:
    from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
    from ddb2bt.transforms.model import SetCell

    writer = GrpcMutationWriter(mapping.target.project, mapping.target.instance)
    try:
        for start in range(0, n, LOAD_BATCH):
            entries = []
            for i in range(start, min(n, start + LOAD_BATCH)):
                k = _key(i)
                row = f"{k['pk']['S']}#{k['sk']['S']}".encode()
                ts = (WINDOW_S + i % WINDOW_LEN_S) * 1000
                entries.append((row, [SetCell("SKU", b"Price", str(i).encode(), ts)]))
            assert all(s.ok for s in writer.mutate_rows(mapping.target.table, entries))
    finally:
        writer.close()


def _sweep(mapping_path: str, n: int, out) -> None:
    """In a fresh process: the sweep over the loaded table; reports to ``out``."""
    from ddb2bt.pipeline.source.exports import ExportManifest
    from ddb2bt.pipeline.recover.recover import SWEEP_LOOKBACK_MS, ExportChange, IncrementalExport
    from ddb2bt.pipeline.recover.straddle import BoundarySweep
    from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
    from ddb2bt.pipeline.sink.sink import BatchingWriter, SinkConfig
    from ddb2bt.transforms.config import load_mapping

    mapping = load_mapping(mapping_path)
    writer = GrpcMutationWriter(mapping.target.project, mapping.target.instance)
    batcher = BatchingWriter(writer, None, SinkConfig(overlap_writes=False))

    def lines(export, rel):  # generated, never held: every other item is listed
        for i in range(0, n, 2):
            keys = _key(i)
            yield ExportChange(keys, {**keys, "Price": {"N": str(i)}}, None,
                               (WINDOW_S + i % WINDOW_LEN_S) * 1_000_000)

    manifest = ExportManifest("INCREMENTAL_EXPORT", "DYNAMODB_JSON", "arn:aws:dynamodb:us-east-1:1:table/T", None,
                              n // 2)
    window = IncrementalExport("mem://w", manifest, WINDOW_S * 1000, (WINDOW_S + WINDOW_LEN_S) * 1000,
                               "NEW_AND_OLD_IMAGES", (("data/a.json.gz", n // 2),))
    # The window before it, nothing changed in it: the first swept window is read
    # from SWEEP_LOOKBACK_MS before its start and judged with it, as recover does.
    before = IncrementalExport("mem://before", manifest, window.from_ms - WINDOW_LEN_S * 1000, window.from_ms,
                               "NEW_AND_OLD_IMAGES", (("data/b.json.gz", 0),))
    sweep = BoundarySweep(mapping, writer, batcher, None, lambda export, rel: lines(export, rel)
                          if export is window else iter(()))
    base = _vm("VmRSS")
    start = time.perf_counter()
    result = sweep.run([(window, "data/a.json.gz")], window.from_ms, window.to_ms,
                       lookback_files=[(before, "data/b.json.gz")], read_from_ms=window.from_ms - SWEEP_LOOKBACK_MS)
    wall = time.perf_counter() - start
    batcher.close()
    writer.close()
    out.put({"rows": n, "wall_s": round(wall, 2), "rows_per_s": round(n / wall),
             "rows_read": result.rows_read, "deleted": result.cells_deleted,
             "base_mib": round(base, 1), "peak_mib": round(_vm("VmHWM"), 1),
             "added_mib": round(_vm("VmHWM") - base, 1)})


def main() -> int:
    from ddb2bt.pipeline.local.local_stack import LocalStack
    from ddb2bt.pipeline.clients.bigtable.admin import ensure_mapping_table
    from ddb2bt.transforms.config import load_mapping
    from tests.conftest import write_mapping  # the suite's helper: a copy of an example, fields replaced

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    results = []
    with LocalStack() as stack:
        stack.apply_env()
        ctx = multiprocessing.get_context("spawn")
        tmp = Path(f"/tmp/ddb2bt-bench-sweep-{uuid.uuid4().hex[:6]}")
        tmp.mkdir()
        for run in range(args.runs):
            for n in args.sizes:
                name = f"sw_{uuid.uuid4().hex[:6]}"
                path = write_mapping(tmp, "product_catalog.yaml", target__table=name, name=name)
                mapping = load_mapping(path)
                ensure_mapping_table(mapping)
                _load(mapping, n)
                out = ctx.Queue()
                proc = ctx.Process(target=_sweep, args=(str(path), n, out))
                proc.start()
                got = out.get(timeout=1800)
                proc.join()
                got["run"] = run + 1
                assert got["deleted"] == n - (n + 1) // 2, got  # every item left out: its cell deleted
                print(json.dumps(got), flush=True)
                results.append(got)
    by = {n: [r for r in results if r["rows"] == n] for n in args.sizes}
    small, large = min(args.sizes), max(args.sizes)
    ratios = [b["added_mib"] / max(a["added_mib"], 0.1) for a, b in zip(by[small], by[large])]
    print(json.dumps({"added_memory_ratio_large_to_small": [round(r, 2) for r in ratios],
                      "rows_per_s": {n: [r["rows_per_s"] for r in rs] for n, rs in by.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
