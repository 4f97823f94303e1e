"""The sink raises the cyclic garbage collector's thresholds once per process
(pipeline/sink/collector.py): a page of changes in flight was re-scanned by the young
generation's collections ~60 times, 5-6 µs of CPU per change."""
from __future__ import annotations

import gc

import pytest

from ddb2bt.pipeline.sink.collector import OLDER_THRESHOLD, YOUNG_THRESHOLD, tune_collector
from ddb2bt.pipeline.sink.sink import SinkConfig, _WriteToBigtableFn
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable

CPYTHON_DEFAULT = (700, 10, 10)


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


class _Bigtable:
    """The sink's Bigtable spec, over the in-memory fake."""

    def writer(self):
        return InMemoryBigtable()


def test_the_sinks_setup_raises_the_collectors_thresholds(thresholds):
    gc.set_threshold(*CPYTHON_DEFAULT)
    fn = _WriteToBigtableFn(_Bigtable(), None, SinkConfig(), check_families=False)
    fn.setup()
    try:
        assert gc.get_threshold() == (YOUNG_THRESHOLD, OLDER_THRESHOLD, OLDER_THRESHOLD)
    finally:
        fn.teardown()


def test_higher_thresholds_are_kept_and_a_disabled_collector_is_left_alone(thresholds):
    gc.set_threshold(YOUNG_THRESHOLD * 2, 5, OLDER_THRESHOLD * 3)
    tune_collector()
    assert gc.get_threshold() == (YOUNG_THRESHOLD * 2, OLDER_THRESHOLD, OLDER_THRESHOLD * 3)
    gc.set_threshold(0, 10, 10)
    tune_collector()
    assert gc.get_threshold() == (0, 10, 10)
