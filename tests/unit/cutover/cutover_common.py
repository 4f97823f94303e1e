"""Shared set-up of the cutover unit tests (sink markers, version clashes, redrive, verify)."""
from __future__ import annotations

from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.sink.sink import SinkConfig
from ddb2bt.transforms.attrs import from_plain
from ddb2bt.transforms.config import load_mapping

CATALOG = load_mapping("examples/product_catalog.yaml")
VIDEOS = load_mapping("examples/videos.yaml")
FAST = SinkConfig(retry=RetryPolicy(0.001, 0.001, 1.0), overlap_writes=False)
T = 1_700_000_000_000


def item(**kw):
    return {k: from_plain(v) for k, v in kw.items()}


# Item generators of the model tests (handoff, ordering guard, recover): version n
# of an item, so that consecutive versions add, change and remove attributes.
def video_item(pk, sk, n):
    if sk == "Video":
        return item(pk=pk, sk=sk, UploadDate=f"2023-09-10T15:21:{n:02d}", Formats={"480": f"u{n}"})
    if sk == "VideoStatsLikes":
        return item(pk=pk, sk=sk, Count=n)
    return item(pk=pk, sk=sk, Content=f"c{n}", CreatedAt=f"2023-09-1{sk[-1]}T00:00:{n:02d}")


def catalog_item(pk, sk, n):
    attrs = {"pk": pk, "sk": sk, "Price": n}
    if n % 2:
        attrs["Description"] = f"d{n}"  # present or removed from one version to the next
    if n % 3 == 0:
        attrs["Color"] = ["red"] if n % 2 else ["blue", "red"]
    return item(**attrs)


def hr_item(pk, sk, n):
    attrs = {"PK": pk, "SK": sk, "Name": f"n{n % 4}", "Warehouse": f"w{n % 3}"}  # index rows move
    if n % 2:
        attrs["JobTitle"] = f"t{n}"
    return item(**attrs)


def assert_target_is_the_mapping_of(bt, mapping, items) -> None:
    """Every target table of the in-memory Bigtable ``bt`` equals the mapping of
    ``items``: the same rows and columns; per column the newest version is the
    value (single-value columns: an older version a late write left below it is
    never read, and the family's max_versions GC removes it), exactly the
    versions (versioned columns) or the elements in order (list columns)."""
    from ddb2bt.pipeline.verify.compare import expected_layout

    layout = expected_layout(mapping, items)
    for table in sorted(set(layout) | {mapping.target.table}):
        expected = layout.get(table, {})
        have = bt.versions(table)
        assert set(have) == set(expected), f"rows of {table} differ (a resurrected or a missing row)"
        for row, cols in expected.items():
            assert set(have[row]) == set(cols), row
            for col, want in cols.items():
                versions = have[row][col]
                if want.kind == "single":
                    assert versions[max(versions)] == want.value, (row, col, versions)
                elif want.kind == "list":  # the elements in timestamp order
                    assert tuple(versions[t] for t in sorted(versions)) == tuple(want.value), (row, col, versions)
                else:
                    assert versions == want.value, (row, col, versions)
