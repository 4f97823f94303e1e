"""The schedule every process shares for a stream's DescribeStream calls
(pipeline/control/shared_rate.py): however many processes ask at once, the calls
are at least 1/rate apart; contention, a retried swap and an unreachable state
table never lose a call nor stop discovery."""
from __future__ import annotations

import logging

import pytest

from ddb2bt.pipeline.clients.bigtable.errors import BigtableRetryable
from ddb2bt.pipeline.control.shared_rate import MAX_AHEAD_S, SharedRate, describe_rate_name
from ddb2bt.pipeline.control.state import StateStore, shared_rate_key
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable

NAME = describe_rate_name("2024-01-01T00:00:00.000")


class Clock:
    def __init__(self) -> None:
        self.ms = 1_700_000_000_000.0

    def now_ms(self) -> int:
        return int(self.ms)

    def sleep(self, seconds: float) -> None:
        self.ms += seconds * 1000


def store_of(backend, clock: Clock) -> StateStore:
    return StateStore(backend, "job", clock.now_ms)


def test_processes_starting_together_take_slots_a_gap_apart():
    """Sixteen processes (each its own SharedRate on the one state table) each
    list 20 pages at the same moment: the calls queue at 8 per second."""
    clock, backend = Clock(), InMemoryBigtable()
    rates = [SharedRate(store_of(backend, clock), NAME, 8.0, clock.now_ms, lambda s: None) for _ in range(16)]
    start = clock.ms
    slots = []
    for rate in rates:  # every process asks at the same instant: none has slept yet
        for _ in range(20):
            waited = rate.take()
            slots.append(start + waited * 1000)
    slots.sort()
    gaps = [b - a for a, b in zip(slots, slots[1:])]
    assert len(slots) == 320 and min(gaps) == pytest.approx(125.0)
    assert max(sum(1 for t in slots if w <= t < w + 1000) for w in slots) == 8
    assert slots[-1] - start == pytest.approx(319 * 125.0)


def test_a_caller_after_a_quiet_spell_goes_at_once():
    clock, backend = Clock(), InMemoryBigtable()
    rate = SharedRate(store_of(backend, clock), NAME, 8.0, clock.now_ms, clock.sleep)
    assert rate.take() == 0.0
    assert rate.take() == pytest.approx(0.125)
    clock.sleep(5.0)
    assert rate.take() == 0.0


class Racing:
    """The state table, with another process winning the first ``losses`` swaps."""

    def __init__(self, store: StateStore, clock: Clock, losses: int) -> None:
        self.store, self.clock, self.losses = store, clock, losses

    def load_shared_rate(self, name):
        return self.store.load_shared_rate(name)

    def swap_shared_rate(self, name, expected, value):
        if self.losses > 0:  # the other process's slot lands first
            self.losses -= 1
            self.store.swap_shared_rate(name, expected, f"{self.clock.ms + 125:.3f} other")
            return False
        return self.store.swap_shared_rate(name, expected, value)


def test_a_lost_race_reads_again_and_queues_behind_the_winner():
    clock, backend = Clock(), InMemoryBigtable()
    racing = Racing(store_of(backend, clock), clock, losses=3)
    rate = SharedRate(racing, NAME, 8.0, clock.now_ms, clock.sleep)
    assert rate.take() == pytest.approx(0.125)  # behind the winner's slot, not beside it
    assert rate.fallbacks == 0


class AppliedButAnsweredFalse:
    """A retried CheckAndMutateRow whose first attempt was applied answers False."""

    def __init__(self, store: StateStore) -> None:
        self.store, self.first = store, True

    def load_shared_rate(self, name):
        return self.store.load_shared_rate(name)

    def swap_shared_rate(self, name, expected, value):
        written = self.store.swap_shared_rate(name, expected, value)
        if self.first:
            self.first = False
            return False
        return written


def test_a_swap_applied_but_answered_false_keeps_its_slot():
    clock, backend = Clock(), InMemoryBigtable()
    store = store_of(backend, clock)
    rate = SharedRate(AppliedButAnsweredFalse(store), NAME, 8.0, clock.now_ms, clock.sleep)
    assert rate.take() == 0.0
    # One slot taken, not two: the next caller's slot is one gap later.
    assert SharedRate(store, NAME, 8.0, clock.now_ms, clock.sleep).take() == pytest.approx(0.125)


class Unreachable:
    def load_shared_rate(self, name):
        raise BigtableRetryable("UNAVAILABLE: the state table's deadline passed")

    def swap_shared_rate(self, name, expected, value):
        raise AssertionError("not reached")


def test_an_unreachable_state_table_falls_back_to_local_spacing(caplog):
    clock = Clock()
    rate = SharedRate(Unreachable(), NAME, 8.0, clock.now_ms, clock.sleep)
    with caplog.at_level(logging.WARNING):
        waits = [rate.take() for _ in range(3)]
    assert waits == [pytest.approx(0.125)] * 3 and rate.fallbacks == 3
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1 and "DescribeStream" in warnings[0].getMessage()


def test_a_slot_far_in_the_future_is_a_skewed_clock_not_a_queue():
    clock, backend = Clock(), InMemoryBigtable()
    store = store_of(backend, clock)
    assert store.swap_shared_rate(NAME, None, f"{clock.ms + (MAX_AHEAD_S + 60) * 1000:.3f} skewed")
    rate = SharedRate(store, NAME, 8.0, clock.now_ms, clock.sleep)
    assert rate.take() == 0.0
    assert rate.take() == pytest.approx(0.125)


def test_the_rate_lives_outside_every_jobs_rows():
    """Every job of the state table shares it: its row is no job's prefix."""
    clock, backend = Clock(), InMemoryBigtable()
    a = SharedRate(StateStore(backend, "orders", clock.now_ms), NAME, 8.0, clock.now_ms, clock.sleep)
    b = SharedRate(StateStore(backend, "carts", clock.now_ms), NAME, 8.0, clock.now_ms, clock.sleep)
    assert a.take() == 0.0 and b.take() == pytest.approx(0.125)
    assert shared_rate_key(NAME).startswith(b"#")


def test_a_rate_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        SharedRate(Unreachable(), NAME, 0.0)


def test_one_process_without_a_store_spaces_its_own_calls():
    """A local run (one process) keeps its own schedule: no state-table call."""
    clock = Clock()
    rate = SharedRate(None, NAME, 6.0, clock.now_ms, clock.sleep)
    waits = [rate.take() for _ in range(4)]
    assert waits[0] == 0.0 and all(w == pytest.approx(1 / 6, abs=0.002) for w in waits[1:])
    assert rate.fallbacks == 0
