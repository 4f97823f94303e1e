"""verify: items/s and peak RSS of `ddb2bt verify` at two table sizes, on the
local stack (moto server + Bigtable emulator), each run a fresh process whose
own peak RSS is its VmHWM, read as it exits (the emulators are not counted).
Not wait4's ru_maxrss: Linux carries the peak RSS of the process that spawned
a child into the child's ru_maxrss at exec (vfork or fork), so a child of this
bench reported the bench's own peak — ~400 MiB once it had built 100,000 items
to load — whatever verify itself used:

- ``local``: the bounded verify (parallel Scan, hash buckets spilled to disk);
- ``before``: the same command of the main checkout before it (everything in
  memory), when /work/main/.venv exists — the baseline;
- ``export``: the Scan-free variant, ``--from-export`` (a Beam job on the
  FnApiRunner reading an export in the real layout).

Items are ~400 bytes (product-catalog shaped), every one mapped to one row.
Part of ``bench/run.py`` (section ``verify``); alone::

    .venv/bin/python bench/verify.py [--sizes 10000 100000]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.run import MAPPING, RESULTS, ROOT, make_item  # noqa: E402
from ddb2bt.transforms.attrs import canonical_number  # noqa: E402

SIZES = (10_000, 100_000)
ITEM_SIZE = 400
BATCH = 25  # BatchWriteItem's limit
BT_BATCH = 1000
BEFORE = Path("/work/main")  # the checkout to compare with (its own .venv), when present


def _as_stored(item: dict) -> dict:
    """The item as DynamoDB keeps it, and a Scan or a stream gives it back: its
    numbers spelled canonically (``3.0`` as ``3``). The target is loaded by
    mapping this, so it holds what verify, reading the table, expects; mapped
    from the spelling written (make_item's ``Rating`` of ``3.0``), one row in
    ten would differ."""
    return {name: {"N": canonical_number(Decimal(value["N"]))} if "N" in value else value
            for name, value in item.items()}


def _load(n: int, project: str, instance: str, tmp: Path) -> tuple:
    """A source table and a target table holding exactly its mapping, and an
    export of it; returns (mapping path, export dir)."""
    import yaml

    from ddb2bt.pipeline.connect.connections import dynamodb_client
    from ddb2bt.pipeline.local import workload
    from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
    from ddb2bt.pipeline.clients.bigtable.admin import BigtableAdmin
    from ddb2bt.transforms.attrs import item_to_dynamodb_json
    from ddb2bt.transforms.mapping import map_change
    from ddb2bt.transforms.model import INSERT, ChangeRecord

    rng = random.Random(n)
    items = [_as_stored(make_item(rng, {"pk": {"S": f"cat{i % 50:02d}"}, "sk": {"S": f"item#{i:07d}"}}, ITEM_SIZE))
             for i in range(n)]
    source, target = f"Vb{uuid.uuid4().hex[:6]}", f"vb_{uuid.uuid4().hex[:6]}"
    ddb = dynamodb_client()
    workload.create_table(ddb, source)
    for i in range(0, n, BATCH):
        ddb.batch_write_item(RequestItems={source: [{"PutRequest": {"Item": it}} for it in items[i:i + BATCH]]})
    BigtableAdmin(project, instance).ensure_table(target, MAPPING.table_families()[MAPPING.target.table])
    mapping = MAPPING.with_overrides(table=target)
    writer = GrpcMutationWriter(project, instance)
    entries = []
    for it in items:
        keys = {"pk": it["pk"], "sk": it["sk"]}
        for ch in map_change(mapping, ChangeRecord(INSERT, keys, it, None, 1_700_000_000_000)):
            entries.append((ch.row_key, ch.mutations))
        if len(entries) >= BT_BATCH:
            writer.mutate_rows(target, entries)
            entries = []
    if entries:
        writer.mutate_rows(target, entries)
    data = yaml.safe_load((ROOT / "examples/product_catalog.yaml").read_text())
    data["source"]["table"], data["target"]["table"], data["name"] = source, target, target
    path = tmp / f"{target}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    export = tmp / f"export-{target}"
    (export / "data").mkdir(parents=True)
    files = []
    for f in range(4):
        name = f"data/{f:04d}.json.gz"
        with gzip.open(export / name, "wt") as fh:
            for it in items[f::4]:
                fh.write(json.dumps({"Item": item_to_dynamodb_json(it)}) + "\n")
        files.append(json.dumps({"dataFileS3Key": f"AWSDynamoDB/x/{name}", "itemCount": len(items[f::4])}))
    (export / "manifest-files.json").write_text("\n".join(files) + "\n")
    (export / "manifest-summary.json").write_text(json.dumps({
        "exportTime": "2030-01-01T00:00:00Z", "itemCount": n,
        "tableArn": f"arn:aws:dynamodb:us-east-1:123456789012:table/{source}"}))
    return path, export


# Runs `ddb2bt` (its module as __main__, as `python -m` does) and, as it exits,
# writes its own VmHWM (kB: the peak RSS of this process's memory since exec,
# nothing inherited) to the file named by HWM_ENV.
HWM_ENV = "DDB2BT_BENCH_HWM_FILE"
RUN_WITH_HWM = (
    "import atexit, os, runpy, sys\n"
    "def _hwm():\n"
    "    with open('/proc/self/status') as f:\n"
    "        kb = next(line.split()[1] for line in f if line.startswith('VmHWM:'))\n"
    f"    with open(os.environ['{HWM_ENV}'], 'w') as out:\n"
    "        out.write(kb)\n"
    "atexit.register(_hwm)\n"
    "sys.argv[0] = 'ddb2bt'\n"
    "runpy.run_module('ddb2bt.pipeline.app.cli', run_name='__main__', alter_sys=True)\n"
)


def _measure(python: str, cwd: Path, args: list) -> dict:
    """Wall seconds and peak RSS (MiB, the process's own VmHWM) of one `ddb2bt` process."""
    with tempfile.NamedTemporaryFile("r", suffix=".hwm") as hwm:
        t = time.perf_counter()
        proc = subprocess.Popen([python, "-c", RUN_WITH_HWM, *args], cwd=cwd,
                                env={**os.environ, HWM_ENV: hwm.name},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, _ = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        peak_kb = int(hwm.read() or 0)
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"verify exited {code}: {err[-2000:]}")
    if not peak_kb:
        raise RuntimeError("verify exited without writing its peak RSS")
    return {"seconds": round(wall, 1), "peak_rss_mib": round(peak_kb / 1024)}


def run_verify(sizes=SIZES, before: bool = True) -> dict:
    project, instance = MAPPING.target.project, MAPPING.target.instance
    from ddb2bt.pipeline.connect.preflight import ensure_state_table

    ensure_state_table(project, instance, "ddb2bt_state")
    out: dict = {"item_bytes": ITEM_SIZE}
    before_python = BEFORE / ".venv/bin/python"
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            path, export = _load(n, project, instance, Path(tmp))
            row: dict = {}
            variants = [("local", sys.executable, ROOT, ["verify", "--mapping", str(path), "--segments", "4"]),
                        ("export", sys.executable, ROOT, ["verify", "--mapping", str(path), "--from-export",
                                                          str(export), "--report", f"{tmp}/r.json"])]
            if before and before_python.exists():
                variants.insert(1, ("before", str(before_python), BEFORE, ["verify", "--mapping", str(path),
                                                                           "--segments", "4"]))
            for label, python, cwd, args in variants:
                m = _measure(python, cwd, args)
                m["items_per_s"] = round(n / m["seconds"])
                row[label] = m
                print(f"  {n:,} items, {label}: {m}", flush=True)
            out[str(n)] = row
    small, large = (str(s) for s in sizes[:2])
    out["local_peak_ratio"] = round(out[large]["local"]["peak_rss_mib"] / out[small]["local"]["peak_rss_mib"], 2)
    return out


def main() -> int:
    from ddb2bt.pipeline.local.local_stack import LocalStack

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs=2, default=list(SIZES), help="the two table sizes")
    parser.add_argument("--no-before", action="store_true", help="skip the previous verify (the baseline)")
    args = parser.parse_args()
    with LocalStack() as stack:
        stack.apply_env()
        results = run_verify(tuple(args.sizes), before=not args.no_before)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"verify-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
