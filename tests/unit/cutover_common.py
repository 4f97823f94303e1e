"""Shared set-up of the cutover unit tests (sink markers, version clashes, redrive, verify)."""
from __future__ import annotations

from ddb2bt.pipeline.retry import RetryPolicy
from ddb2bt.pipeline.sink.sink import SinkConfig
from ddb2bt.transforms.attrs import from_plain
from ddb2bt.transforms.config import load_mapping

CATALOG = load_mapping("examples/product_catalog.yaml")
VIDEOS = load_mapping("examples/videos.yaml")
FAST = SinkConfig(retry=RetryPolicy(0.001, 0.001, 1.0), overlap_writes=False)
T = 1_700_000_000_000


def item(**kw):
    return {k: from_plain(v) for k, v in kw.items()}
