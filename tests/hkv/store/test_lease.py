"""The disk tier's eviction lease (`hkv.store.coord.Lease`): one holder at a time, taken over only once
another process has seen it unrenewed for its ttl on its own monotonic clock — never by comparing
wall clocks across hosts."""

from __future__ import annotations

import time

import pytest

from hkv.store import coord
from hkv.store.context import TierContext
from hkv.store.coord import LEASE_KEY, Lease


class Clock:
    """A monotonic clock a test moves by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lease(tmp_path, name: str, clock: Clock, ttl: float = 30.0) -> Lease:
    ctx = TierContext.open(str(tmp_path), context=None, key=None, writer_id=name, budget_bytes=None, progress=None)
    return Lease(ctx, ttl=ttl, clock=clock)


def test_a_held_lease_is_taken_over_only_after_the_ttl_of_the_contenders_own_clock(tmp_path):
    a, b = _lease(tmp_path, "a", Clock()), _lease(tmp_path, "b", Clock())
    assert a.acquire()
    assert not b.acquire()  # first sighting: alive
    b.clock.now += 29.0
    assert not b.acquire()
    assert a.renew()  # a renewal is a new generation: b counts again from its next sighting
    b.clock.now += 2.0  # 31 s since b first saw the lease, 2 s since the renewal
    assert not b.acquire()
    b.clock.now += 30.0  # a renewed nothing for b's ttl: a is dead or stuck
    assert b.acquire()
    assert not a.renew()  # a learns it lost the lease before deleting anything
    assert a.generation is None and b.generation is not None


def test_a_contender_whose_wall_clock_runs_ahead_does_not_take_a_live_lease(tmp_path, monkeypatch):
    a, b = _lease(tmp_path, "a", Clock()), _lease(tmp_path, "b", Clock())
    assert a.acquire()
    real = time.time
    monkeypatch.setattr(coord.time, "time", lambda: real() + 3600.0)  # b's host is an hour ahead
    assert not b.acquire()
    assert not b.acquire()  # its own clock has not moved: still alive
    monkeypatch.setattr(coord.time, "time", real)
    assert a.renew()


def test_a_released_or_damaged_lease_is_free_at_once(tmp_path):
    a, b = _lease(tmp_path, "a", Clock()), _lease(tmp_path, "b", Clock())
    assert a.acquire()
    a.release()
    assert b.acquire()  # deleted: free without waiting
    (tmp_path / LEASE_KEY).write_bytes(b"{not json" + b" " * 100)
    assert a.acquire()  # damaged: free


@pytest.mark.parametrize("ttl", [0.0, 5.0])
def test_the_ttl_counts_from_the_first_sighting(tmp_path, ttl):
    a, b = _lease(tmp_path, "a", Clock()), _lease(tmp_path, "b", Clock(), ttl=ttl)
    assert a.acquire()
    assert not b.acquire()  # even with ttl 0 a first sighting is not an expiry
    b.clock.now += ttl
    assert b.acquire()
