"""The restore route's pure pieces (`hkv.core.plan`), without an engine: cost estimates, the route
choice, and the plan extended by the disk stage and the window rebuild."""

import dataclasses

import pytest

import hkv
from hkv.core.plan import (
    DevicePlan,
    DiskStage,
    MeasuredCosts,
    RestoreCosts,
    RestorePlan,
    RouteReach,
    estimate_restore_costs,
    extend_with_disk,
    started_cold,
    with_window_rebuilt,
)

BT = 16


def device_plan(hash_blocks=4, byte_blocks=2, reason="swa_missing", record=3) -> DevicePlan:
    r = hkv.Reason(reason)
    return DevicePlan.make(
        hash_blocks=hash_blocks,
        lifecycle_blocks=hash_blocks,
        abi_blocks=hash_blocks,
        intersection_blocks=byte_blocks,
        byte_blocks=byte_blocks,
        first_failed_stage=hkv.core.reasons.STAGES.index(r.stage),
        reason=r.code,
        status=int(hkv.Status.OK),
        record=record,
    ).host()


def test_measured_costs_average_each_sample_in_and_refuse_an_unknown_kind():
    m = MeasuredCosts()
    m.measure("chunk", 2.0)
    m.measure("chunk", 1.0)
    m.measure("chunk", 0.5, width=8)
    m.measure("disk_token", 0.01)
    assert (m.chunk, m.narrow, m.disk_token, m.via_prefill) == (pytest.approx(1.8), {8: 0.5}, 0.01, None)
    m.measure("window", 5.0)  # a first rebuild may be the step's first run in the process: not kept
    assert (m.window, m.window_runs) == (None, 1)
    m.measure("window", 0.3)
    assert m.window == 0.3
    with pytest.raises(ValueError, match=r"what='prefill' must be 'chunk', 'disk_token', 'via_prefill' or 'window'"):
        m.measure("prefill", 1.0)


def test_estimates_follow_the_measured_costs_and_offer_only_possible_routes():
    kw = dict(chunk=32, widths=(8, 32), window_tokens=24, prompt=100, l0=32)
    unmeasured = estimate_restore_costs(MeasuredCosts(), window_at=None, disk_at=32, **kw)
    # 68 tokens: two chunks of 1 s, then 4 tokens in the 8-wide step, a quarter of a chunk pro rata
    assert unmeasured == RestoreCosts(shrink=2.25)
    assert unmeasured.offered() == {"shrink": 2.25}
    m = MeasuredCosts(chunk=2.0, narrow={8: 0.1}, disk_token=0.001)
    got = estimate_restore_costs(m, window_at=64, disk_at=96, **kw)
    assert got.shrink == pytest.approx(2 * 2.0 + 0.1)
    assert got.window == pytest.approx(24 / 32 * 2.0 + 2.0 + 0.1)  # R tokens, then 36 = a chunk and 4
    assert got.disk == pytest.approx(64 * 0.001 + 0.1)
    # a measured rebuild costs what it took: 2.5 s makes the window route dearer than recomputing
    # (it read as R tokens' share of a chunk before, so the first rebuild of colab/02 was chosen at
    # several times a recompute's cost)
    slow = dataclasses.replace(m, window=2.5)
    got = estimate_restore_costs(slow, window_at=64, disk_at=96, **kw)
    assert got.window == pytest.approx(2.5 + 2.0 + 0.1)
    assert got.window > got.shrink


def test_the_choice_is_the_cheapest_or_the_longest_route_ties_to_the_cheaper():
    costs = RestoreCosts(shrink=1.0, window=0.5, disk=0.7)
    assert costs.choose("cheapest", RouteReach(shrink=0, window=64, disk=96)) == "window"
    assert costs.choose("longest", RouteReach(shrink=0, window=64, disk=96)) == "disk"
    assert costs.choose("longest", RouteReach(shrink=0, window=96, disk=96)) == "window"
    assert RestoreCosts(shrink=1.0, disk=1.0).choose("cheapest", RouteReach(0, 0, 64)) == "shrink"
    with pytest.raises(ValueError, match="rule='fastest' must be 'cheapest' or 'longest'"):
        costs.choose("fastest", RouteReach(0, 0, 0))


def test_a_disk_stage_that_installed_nothing_and_found_nothing_wrong_leaves_the_plan():
    vec = device_plan()
    plan = RestorePlan.from_device(vec, BT, 100)
    got = extend_with_disk(plan, vec, DiskStage(found=2 * BT, snapshot_end=2 * BT, installed=2 * BT), BT)
    assert got == (plan, vec)


def test_the_disk_stage_extends_the_plan_and_the_device_counters_alike():
    vec = device_plan(hash_blocks=4, byte_blocks=2)
    plan = RestorePlan.from_device(vec, BT, 100)
    stage = DiskStage(found=6 * BT, snapshot_end=5 * BT, installed=5 * BT)
    got, v = extend_with_disk(plan, vec, stage, BT)
    assert got.hash_hit_tokens == 6 * BT and got.restored_tokens == 5 * BT
    assert got.tokens_after_stage == {"lifecycle": 6 * BT, "abi": 6 * BT, "intersection": 5 * BT, "byte": 5 * BT}
    assert (got.disk_tokens, got.recompute) == ((2 * BT, 5 * BT), (5 * BT, 100))
    assert (got.first_failed_stage, got.reason) == (plan.first_failed_stage, plan.reason)  # the device's
    assert (v.hash_blocks, v.byte_blocks, v.disk_blocks) == (6, 5, 3)
    assert RestorePlan.from_device(v, BT, 100).restored_tokens == got.restored_tokens


def test_a_disk_stage_that_stopped_short_names_its_reason_and_one_that_restored_the_hit_none():
    vec = device_plan(hash_blocks=4, byte_blocks=2)
    plan = RestorePlan.from_device(vec, BT, 100)
    bad, v = extend_with_disk(plan, vec, DiskStage(6 * BT, 5 * BT, 3 * BT, reason="disk_checksum"), BT)
    assert (bad.first_failed_stage, bad.reason, bad.disk_tokens) == ("byte", hkv.Reason.DISK_CHECKSUM, (32, 48))
    assert (v.reason, v.first_failed_stage) == (hkv.Reason.DISK_CHECKSUM.code, 4)
    whole, v = extend_with_disk(plan, vec, DiskStage(6 * BT, 6 * BT, 6 * BT), BT)
    assert (whole.first_failed_stage, whole.reason, v.reason, v.first_failed_stage) == (None, None, 0, -1)


def test_a_window_rebuild_names_the_tokens_it_reran_and_a_failed_route_starts_cold():
    vec = device_plan(hash_blocks=6, byte_blocks=6, reason="swa_missing")
    plan = RestorePlan.from_device(vec, BT, 100)
    assert with_window_rebuilt(plan, 24).window_recomputed == (6 * BT - 24, 6 * BT)
    cold, v = started_cold(plan, vec)
    assert (cold.restored_tokens, cold.recompute, v.byte_blocks) == (0, (0, 100), 0)
    assert cold.hash_hit_tokens == plan.hash_hit_tokens  # what was found is still reported
