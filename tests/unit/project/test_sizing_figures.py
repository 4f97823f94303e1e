"""One figure per fact across the docs: the throughput per core and per vCPU, the
CPU per million changes and the backfill's items per vCPU the docs quote are the
measured ones of bench/results/latest.json, and the sizing and cost table of
docs/deploy-dataflow.md is the arithmetic of those figures and the prices it
states."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
LATEST = json.loads((ROOT / "bench/results/latest.json").read_text())
# docs/deploy-dataflow.md "Where the numbers come from": plan on about half the
# measured rate per busy core (the worker harness, bursts, a backfill), in thousands.
PLANNING_SHARE = 0.5
HOURS_PER_MONTH = 720  # the guide's month
GB_PER_TB = 1024


def number(text: str) -> float:
    return float(text.replace(",", ""))


def measured_per_core() -> int:
    return round(1e6 / LATEST["throughput"]["ddb2bt"]["client_cpu_s_per_1M"], -2)


def planned_per_vcpu() -> int:
    return math.floor(measured_per_core() * PLANNING_SHARE / 1000) * 1000


def quotes(pattern: str) -> list:
    return [(doc.relative_to(ROOT), number(m.group(1))) for doc in DOCS
            for m in re.finditer(pattern, doc.read_text())]


def test_per_core_and_per_vcpu_figures_are_the_measured_ones():
    per_core = quotes(r"([\d,]+) changes/s per busy core")
    per_vcpu = quotes(r"~?([\d,]+) changes/s per vCPU") + quotes(r"÷ ~?([\d,]+) per vCPU")
    assert {doc for doc, _ in per_core} >= {Path("docs/operations.md"), Path("docs/deploy-dataflow.md")}, per_core
    assert {doc for doc, _ in per_vcpu} >= {Path("docs/operations.md"), Path("docs/deploy-dataflow.md")}, per_vcpu
    assert all(value == measured_per_core() for _, value in per_core), (per_core, measured_per_core())
    assert all(value == planned_per_vcpu() for _, value in per_vcpu), (per_vcpu, planned_per_vcpu())
    # No other wording of a per-core rate (each says busy core or vCPU).
    other = quotes(r"([\d,]+) changes/s[^.\n]{0,30}?per (?:worker )?core\b") + quotes(
        r"(?:worker )?core applies about ([\d,]+)")
    assert not other, other
    cpu = quotes(r"([\d.]+) CPU s per million changes")
    assert cpu and all(v == LATEST["throughput"]["ddb2bt"]["client_cpu_s_per_1M"] for _, v in cpu), cpu
    backfill = quotes(r"([\d,]+) items/s per vCPU")
    assert backfill and all(v == LATEST["backfill"]["export_items_per_s"] for _, v in backfill), backfill
    from ddb2bt.transforms.draft import BACKFILL_ITEMS_PER_VCPU_S  # what `ddb2bt draft` sizes with
    assert BACKFILL_ITEMS_PER_VCPU_S == LATEST["backfill"]["export_items_per_s"]


def test_one_cost_per_million_changes_everywhere_and_it_is_step_8s_arithmetic():
    """Every "$X per million changes" in the docs is the same figure, and it is
    the sum of step 8's lines: the measured CPU at the planned share (vCPU and
    its 4 GB), AWS egress and Cloud NAT for 2 GB (old and new image of a ~1 KB item)."""
    guide = (ROOT / "docs/deploy-dataflow.md").read_text()
    cited = quotes(r"\$([\d.]+) per million changes")
    assert {doc for doc, _ in cited} >= {Path("docs/deploy-dataflow.md")}, cited
    cpu_h = LATEST["throughput"]["ddb2bt"]["client_cpu_s_per_1M"] / 3600 / PLANNING_SHARE
    vcpu_h = price(guide, "Dataflow streaming worker vCPU") + 4 * price(guide, "Dataflow worker memory")
    gb = 2
    total = cpu_h * vcpu_h + gb * price(guide, "AWS data transfer out to the internet") + gb * price(
        guide, "Cloud NAT data processing")
    assert {value for _, value in cited} == {round(total, 2)}, (cited, total)


def price(guide: str, label: str) -> float:
    return number(re.search(rf"\| {re.escape(label)}[^|]*\| \$([\d.,]+)", guide).group(1))


def test_the_sizing_and_cost_table_is_the_arithmetic_of_the_figures_and_prices():
    guide = (ROOT / "docs/deploy-dataflow.md").read_text()
    section = guide.split("### Sizing and cost at a glance", 1)[1].split("\n## ", 1)[0]
    vcpu_h = price(guide, "Dataflow streaming worker vCPU") + 4 * price(guide, "Dataflow worker memory")
    node_h, ssd_gb = price(guide, "Bigtable node"), price(guide, "Bigtable SSD storage")
    writes_per_node = number(re.search(r"([\d,]+) writes/s and 5 TB per Bigtable SSD node", section).group(1))
    rows = re.findall(r"^\| ([\d,]+)/s, ([\d,]+) (GB|TB) \| ([\d.]+) \| `--workers (\d+) --max-workers (\d+) "
                      r"--machine-type n2-standard-(\d+)` \| (\d+) / (\d+) / (\d+) \| (\d+) \| \$([\d,]+) \| "
                      r"\$([\d,]+) \| \$([\d,]+) \| \*\*\$([\d,]+)\*\* \|$", section, flags=re.M)
    assert len(rows) >= 3, section
    for row in rows:
        peak, size, unit, vcpus, start, most, per_worker, partitions, tasks, segments, nodes = row[:11]
        dataflow, bt_nodes, storage, total = (number(v) for v in row[11:])
        peak, gb = number(peak), number(size) * (GB_PER_TB if unit == "TB" else 1)
        assert peak / planned_per_vcpu() == float(vcpus), row
        assert int(start) * int(per_worker) >= float(vcpus), row  # the workers at start carry the peak
        # flex.sh's fit (deploy/dataflow/flex.sh check_sizing): 2 partitions a worker, a task a vCPU, 4 segments a task
        assert (int(partitions), int(tasks), int(segments)) == (
            2 * int(most), int(most) * int(per_worker), 4 * int(most) * int(per_worker)), row
        assert int(nodes) == max(1, math.ceil(peak / writes_per_node), math.ceil(gb / (5 * GB_PER_TB))), row
        assert dataflow == round(int(start) * int(per_worker) * HOURS_PER_MONTH * vcpu_h), row
        assert bt_nodes == round(int(nodes) * HOURS_PER_MONTH * node_h), row
        assert storage == round(gb * ssd_gb), row
        assert total == dataflow + bt_nodes + storage, row
