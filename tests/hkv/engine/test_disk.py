"""The disk tier through the engine: blocks evicted to disk come back exact at every block boundary
(file, ocdbt, memory stores), and every storage fault ends in a shorter plan with its named reason
and exact output. (Format-level checks: tests/hkv/store/test_tier.py; CLI and processes: store/test_cli.py,
store/test_tier_processes.py.)"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hkv
from hkv.core import prefix as px
from hkv.store import manifest as mf
from hkv.store import records
from hkv.store.tier import DiskTier
from hkv.testing import force_route
from models.deepseek_v4 import init
from models.stateless import greedy_stateless

from .test_prefix import BASE, BT, CFG, diverge
from .test_prefix import make_engine as _make_engine


def make_engine(model, **kw):
    """test_prefix's engine, taking the disk route whenever a restore offers it: these tests are about
    what comes back from disk, and the engine's cost-based choice may rightly prefer recomputing a
    tiny model's blocks (a CI run's measured disk reads, slowed by the other worker, did)."""
    engine = _make_engine(model, **kw)
    force_route(engine, "disk")
    return engine


NEW = 1
CUT = 160  # the store holds two segments: blocks [0, CUT) and [CUT, 304)


@pytest.fixture(scope="module")
def model():
    return init(CFG, seed=3)


@pytest.fixture(scope="module")
def engine(model):
    return make_engine(model)


def forget_device(engine, check=False):
    """Evict every cached record from device memory (tombstones remain, with their on_disk bits)."""
    every = jnp.ones((engine.layout.config.prefix_records,), bool)
    engine.cache = engine.steps.evict(engine.layout, engine.cache, every, every, every)
    if check:
        hkv.check_invariants(engine.layout, engine.cache)


def reference(model, prompts):
    tokens, logits = greedy_stateless(model, prompts, NEW)
    return tokens, logits


def assert_same(gens, ref):
    for g, t, lg in zip(gens, *ref, strict=True):
        assert g.tokens == t
        assert np.abs(g.logits - lg).max() < 1e-4


def fill(engine, tier):
    """Store BASE's blocks in `tier` as two segments ([0, CUT) then the rest); device forgets them."""
    engine.disk = tier
    forget_device(engine)
    engine.generate([BASE[: CUT + 1]], NEW, return_logits=True)
    assert engine.write_through() == CUT // BT
    engine.flush_disk()
    engine.generate([BASE], NEW, return_logits=True)  # restores [0, CUT) from device, records the rest
    assert engine.write_through() == len(BASE) // BT - CUT // BT
    engine.flush_disk()
    forget_device(engine, check=True)
    p = jax.device_get(engine.cache.prefix)
    assert np.asarray(p.on_disk).sum() >= len(BASE) // BT  # residency DISK once committed


@pytest.fixture(scope="module")
def stored(engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("store") / "s"
    fill(engine, DiskTier(str(root)))
    return root


STORES = {
    "file": lambda tmp: str(tmp / "file"),
    "ocdbt": lambda tmp: {"driver": "ocdbt", "base": f"file://{tmp}/ocdbt/"},
    "memory": lambda tmp: {"driver": "memory"},
}


ALL = range(0, len(BASE) // BT + 1)
SOME = (1, 7, CUT // BT + 2, len(BASE) // BT)


@pytest.mark.parametrize(
    "kind, ks",
    [
        ("file", ALL),
        ("ocdbt", SOME),
        ("memory", SOME),
        pytest.param("ocdbt", ALL, marks=pytest.mark.slow),
        pytest.param("memory", ALL, marks=pytest.mark.slow),
    ],
)
def test_round_trip_every_block_boundary(model, engine, tmp_path, kind, ks):
    """file: every boundary; ocdbt / memory: four here, every boundary under `make test-slow`."""
    fill(engine, DiskTier(STORES[kind](tmp_path)))
    prompts = [diverge(k * BT, tail=3, seed=k) for k in ks]
    gens = []
    for k, prompt in zip(ks, prompts, strict=True):
        forget_device(engine)
        (g,) = engine.generate([prompt], NEW, return_logits=True)
        assert g.plan.restored_tokens == g.plan.hash_hit_tokens == k * BT, (k, g.plan)
        assert g.plan.disk_tokens == ((0, k * BT) if k else None)
        assert g.plan.reason in (None, "no_hash_match")
        gens.append(g)
    assert_same(gens, reference(model, prompts))
    st = engine.stats()
    assert st["cache"]["prefix_disk_restored_tokens"] >= sum(ks) * BT
    hkv.check_invariants(engine.layout, engine.cache)


def _segment(root, first_block: int) -> tuple[str, str]:
    """(abi, segment) of the manifest holding block `first_block`."""
    for abi in os.listdir(root / "manifests"):
        for name in os.listdir(root / "manifests" / abi):
            doc = json.loads((root / "manifests" / abi / name).read_bytes())
            if any(b["index"] == first_block for b in doc["blocks"]):
                return abi, name[:-5]
    raise AssertionError(f"no segment holds block {first_block}")


def _flip(path, at=None):
    data = bytearray(path.read_bytes())
    data[len(data) // 3 if at is None else at] ^= 0x10
    path.write_bytes(bytes(data))


FAULTS = {
    "flipped byte": (lambda root, abi, seg: _flip(root / "data" / abi / seg / "c" / "0"), "disk_checksum"),
    "truncated chunk": (
        lambda root, abi, seg: (root / "data" / abi / seg / "c" / "0").write_bytes(
            (root / "data" / abi / seg / "c" / "0").read_bytes()[:1000]
        ),
        "disk_truncated",
    ),
    "deleted chunk": (lambda root, abi, seg: os.remove(root / "data" / abi / seg / "c" / "0"), "disk_missing"),
    # a lookup reads the block pointers (`hkv.store.records`): a damaged one stops the chain by name
    "damaged block pointer": (lambda root, abi, seg: [_flip(p, at=40) for p in _pointers(root, seg)], "disk_malformed"),
    "deleted manifest": (lambda root, abi, seg: os.remove(root / "manifests" / abi / f"{seg}.json"), "disk_missing"),
    "corrupted manifest": (
        lambda root, abi, seg: _flip(root / "manifests" / abi / f"{seg}.json", at=40),
        "disk_checksum",
    ),
    "manifest of another ABI": (
        lambda root, abi, seg: _reseal(root / "manifests" / abi / f"{seg}.json", abi="f" * 32),
        "disk_abi",
    ),
    # issue 11: each of these discarded the intact prefix before it (an exception out of read)
    "manifest with an overflowing shape": (
        lambda root, abi, seg: _reseal_object(root / "manifests" / abi / f"{seg}.json", shape=[2**64, 1]),
        "disk_malformed",
    ),
    "manifest nested too deep": (
        lambda root, abi, seg: (root / "manifests" / abi / f"{seg}.json").write_bytes(b"[" * 100_000 + b"]" * 100_000),
        "disk_malformed",
    ),
    "data shard is a symlink loop": (
        lambda root, abi, seg: _symlink_loop(root / "data" / abi / seg / "c" / "0"),
        "disk_missing",
    ),
    # issue 11: overwritten by the other segment's (valid) manifest: refused for naming another segment
    "manifest overwritten by another segment's": (
        lambda root, abi, seg: (root / "manifests" / abi / f"{seg}.json").write_bytes(_other_manifest(root, abi, seg)),
        "disk_malformed",
    ),
}


def _pointers(root, seg: str) -> list:
    """The block pointer files that name segment `seg`."""
    paths = sorted((root / "blocks").glob("*/*.json"))
    holders = {p: records.parse_pointer(p.read_bytes(), p.stem, None).holders for p in paths}
    return [p for p in paths if any(h.segment == seg for h in holders[p])]


def _repoint(root, seg: str, abi: str) -> None:
    """Rewrite every block pointer (`hkv.store.records`) that names segment `seg` to name it under `abi`."""
    for path in (root / "blocks").glob("*/*.json"):
        pointer = records.parse_pointer(path.read_bytes(), path.stem, None)
        holders = tuple(h._replace(abi=abi) if h.segment == seg else h for h in pointer.holders)
        if holders != pointer.holders:
            path.write_bytes(records.seal_pointer(dataclasses.replace(pointer, holders=holders), None))


def _reseal_object(path, **changes):
    doc = json.loads(path.read_bytes())
    doc["blocks"][0]["objects"][0].update(changes)
    _reseal(path)  # a valid checksum for the original first
    path.write_bytes(mf.seal({k: v for k, v in doc.items() if k not in ("checksum", "format", "version")}))


def _symlink_loop(path):
    os.remove(path)
    os.symlink(path.name + ".loop", path)
    os.symlink(path.name, path.parent / (path.name + ".loop"))


def _other_manifest(root, abi, seg) -> bytes:
    other = next(n for n in os.listdir(root / "manifests" / abi) if n != f"{seg}.json")
    return (root / "manifests" / abi / other).read_bytes()


def _reseal(path, **changes):
    doc = json.loads(path.read_bytes())
    doc.update(changes)
    path.write_bytes(mf.seal({k: v for k, v in doc.items() if k not in ("checksum", "format", "version")}))


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_gives_shorter_plan_with_reason_and_exact_output(model, engine, stored, tmp_path, fault):
    root = tmp_path / "copy"
    shutil.copytree(stored, root)
    tier = DiskTier(str(root))  # indexes both segments before the fault (manifests read at open)
    engine.disk = tier
    forget_device(engine)
    abi, seg = _segment(root, CUT // BT)
    damage, reason = FAULTS[fault]
    damage(root, abi, seg)
    assert_fault_is_a_shorter_plan(model, engine, reason, str(root), hidden="pointer" in fault)


def assert_fault_is_a_shorter_plan(model, engine, reason: str, store, hidden: bool = False) -> None:
    """After damage to the second segment of `stored`: the whole prompt hits the hash, the first
    segment is restored from disk, the plan stops at `reason`, the output is exact, the engine counts
    the rejection, and a freshly opened tier on `store` (a restarted server) never lists the broken
    segment's blocks as restorable. hidden: the damage hides those blocks from a lookup (a refused
    pointer), so the hash hit reaches past CUT only where the device's tombstones still match."""
    prompt = diverge(len(BASE) // BT * BT, tail=3, seed=7)
    (g,) = engine.generate([prompt], NEW, return_logits=True)
    assert g.plan.hash_hit_tokens in ((CUT, len(BASE) // BT * BT) if hidden else (len(BASE) // BT * BT,))
    assert g.plan.restored_tokens == CUT and g.plan.disk_tokens == (0, CUT), g.plan
    assert g.plan.reason == reason
    assert g.plan.first_failed_stage == ("abi" if reason == "disk_abi" else "byte")
    assert_same([g], reference(model, [prompt]))
    assert engine.stats()["prefix"]["rejections"][g.plan.first_failed_stage][reason] >= 1
    report = DiskTier(store).verify()
    assert report["blocks_ok"] == CUT // BT
    assert sum(report[r] for r in hkv.store.tier.DISK_REASONS) + report["orphaned_segments"] >= 1


def test_foreign_abi_blocks_are_reported_not_restored(model, engine, stored, tmp_path):
    """Blocks stored only under another ABI fingerprint (another model revision) stop the chain as
    `disk_abi` rather than a silent miss."""
    root = tmp_path / "copy"
    shutil.copytree(stored, root)
    abi, seg = _segment(root, CUT // BT)
    other = "e" * 32
    for sub, name in (("manifests", f"{seg}.json"), ("data", seg)):
        (root / sub / other).mkdir(parents=True, exist_ok=True)
        os.rename(root / sub / abi / name, root / sub / other / name)
    _reseal(root / "manifests" / other / f"{seg}.json", abi=other)
    _repoint(root, seg, other)  # as that revision's writer would have published them
    engine.disk = DiskTier(str(root))
    forget_device(engine)
    prompt = diverge(len(BASE) // BT * BT, tail=3, seed=8)
    (g,) = engine.generate([prompt], NEW, return_logits=True)
    assert g.plan.restored_tokens == CUT and g.plan.reason == "disk_abi" and g.plan.first_failed_stage == "abi"
    assert_same([g], reference(model, [prompt]))


def test_write_behind_marks_residency_only_after_the_manifest_commit(model, engine, tmp_path):
    tier = DiskTier(str(tmp_path / "slow"))
    gate = threading.Event()
    real = tier._writer.write_segment

    def slow(*a, **kw):
        assert gate.wait(60)
        return real(*a, **kw)

    tier._writer.write_segment = slow
    engine.disk = tier
    forget_device(engine)
    engine.generate([BASE[: CUT + 1]], NEW, return_logits=True)
    p = jax.device_get(engine.cache.prefix)
    mine = np.asarray(p.state) == px.RecordState.ALIVE
    assert mine.sum() == CUT // BT
    assert engine.write_through() == CUT // BT
    # the write is in flight: nothing is marked on disk, and generation goes on without waiting
    other = np.random.default_rng(9).integers(0, CFG.vocab_size, 40).tolist()
    (g,) = engine.generate([other], NEW, return_logits=True)
    assert g.tokens == reference(model, [other])[0][0]
    assert not np.asarray(engine.cache.prefix.on_disk)[mine].any()
    assert tier.stats()["segments"] == 0
    gate.set()
    engine.flush_disk()
    assert np.asarray(engine.cache.prefix.on_disk)[mine].all()
    assert tier.stats()["segments"] == 1


def test_eviction_under_pressure_writes_behind_and_restores_from_disk(model, tmp_path):
    engine = make_engine(model, scale=1, records=24, disk=DiskTier(str(tmp_path / "pressure")))
    first = BASE[: CUT + 1]
    # nothing shared with `first`: a shared block recorded by both would count as reused content, which
    # admission control keeps (test_prefix.py::test_content_two_requests_computed_side_by_side_...)
    other = diverge(0, tail=306, seed=11)
    engine.generate([first, other], NEW, return_logits=True)  # 29 blocks > 24 records: the policy evicts to disk
    engine.flush_disk()
    st = engine.stats()
    assert st["disk_blocks_offloaded"] > 0 and st["prefix"]["evictions"]["records"] > 0
    again = diverge(CUT, tail=3, seed=12)
    (g,) = engine.generate([again], NEW, return_logits=True)
    assert g.plan.restored_tokens == CUT and g.plan.disk_tokens is not None
    assert_same([g], reference(model, [again]))
    hkv.check_invariants(engine.layout, engine.cache)


def test_offloads_queued_behind_a_slow_write_are_committed_as_one_segment(model, tmp_path):
    tier = DiskTier(str(tmp_path / "group"))
    gate, calls, real_write, real_async = threading.Event(), [], tier._writer.write_segment, tier.write_async

    def slow_first(*a, **kw):
        if not calls:
            calls.append(1)
            assert gate.wait(60)
        return real_write(*a, **kw)

    offloads = []

    def counted(*a, **kw):
        offloads.append(1)
        return real_async(*a, **kw)

    tier._writer.write_segment, tier.write_async = slow_first, counted
    engine = make_engine(model, scale=1, records=24, disk=tier)
    engine.generate(
        [BASE[: CUT + 1], diverge(16, tail=290, seed=11)], NEW, return_logits=True
    )  # eviction passes queue offloads
    assert len(offloads) >= 3 and tier.counters["segments_written"] == 0  # nothing waited for the disk
    gate.set()
    engine.flush_disk()
    # group commit: the offloads that reached the writer within its linger share the first segment,
    # every offload queued behind it shares the second
    assert (
        tier.counters["segments_written"] in (1, 2)
        and tier.counters["blocks_written"] == engine.stats()["disk_blocks_offloaded"]
    )
    again = diverge(CUT, tail=3, seed=12)
    (g,) = engine.generate([again], NEW, return_logits=True)
    assert g.plan.restored_tokens == CUT and g.plan.disk_tokens is not None
    assert_same([g], reference(model, [again]))
    assert "hkv_disk_writes_dropped_total 0" in engine.metrics_text()


def test_a_new_engine_on_the_same_store_finds_its_blocks(model, stored, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(stored, root)
    fresh = make_engine(model, disk=DiskTier(str(root)))  # a restarted process: empty device cache
    prompt = diverge(CUT + 2 * BT, tail=3, seed=13)
    (g,) = fresh.generate([prompt], NEW, return_logits=True)
    assert g.plan.disk_tokens == (0, CUT + 2 * BT) and g.plan.reason is None
    assert_same([g], reference(model, [prompt]))
    assert "hkv_prefix_disk_restored_tokens_total" in fresh.metrics_text()


def test_swap_in_shapes_depend_on_the_block_count_alone(engine):
    """Every (l0, l1) a restore from disk can use maps to one of the shapes warmup compiles (the
    windowed SWA rows are padded to `keep`, compressed rows to the most n blocks can cross)."""
    from hkv.engine import offload

    layout, bt = engine.layout, engine.spec.block_tokens
    warm = {tuple(r.shape for r in rows) for rows, _ in offload.swap_in_warmup_inputs(layout)}
    every = {
        tuple(shape for _, shape in offload.swap_in_shapes(layout, l0, l1)[0])
        for l0 in range(0, layout.config.max_context, bt)
        for l1 in range(l0 + bt, layout.config.max_context + 1, bt)
    }
    assert every == warm


def test_swap_in_writes_the_pools_in_place_and_a_refused_one_changes_nothing(engine):
    """The compiled disk install step neither copies nor selects a whole pool (it used to end with
    a cache-wide `where(ok, new, old)`: three pool copies and four pool-sized selects per restore from
    disk, at run time as well as in the program), and a refused swap_in (a slot that is not active)
    still leaves every leaf of the cache as it was."""
    import re

    from hkv.core import install
    from hkv.engine import offload

    layout, cache = engine.layout, engine.cache
    rows, tails = offload.swap_in_warmup_inputs(layout)[0]
    bt = engine.spec.block_tokens
    args = (jnp.int32(0), jnp.int32(0), jnp.int32(bt), rows, tails)
    fn = jax.jit(install.swap_in, static_argnums=0, donate_argnums=1)  # as the engine compiles it
    hlo = fn.lower(layout, cache, *args).compile().as_text()
    pools = {tuple(g.pool.shape) for g in cache.groups}
    whole = [
        line
        for line in hlo.splitlines()
        if (m := re.search(r"= \w+\[([\d,]+)\]\S* (copy|select)\(", line))
        and tuple(int(d) for d in m.group(1).split(",")) in pools
    ]
    assert whole == []
    before = jax.device_get(cache)
    assert not np.asarray(before.active)[0]  # slot 0 is free between generate calls
    out, status = fn(layout, jax.tree.map(jnp.copy, cache), *args)
    assert int(status) == int(hkv.Status.BAD_REQUEST)
    for a, b in zip(jax.tree.leaves(jax.device_get(out)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)


def test_after_warmup_a_restore_from_disk_compiles_nothing(model, stored, tmp_path):
    """warmup() compiles the disk install step (`swap_in`) for every restore from disk into a fresh
    slot, so a request's first disk restore does not pay a compilation (which the engine would also
    have to leave out of its disk-read timing)."""
    from hkv.engine import compiled

    root = tmp_path / "copy"
    shutil.copytree(stored, root)
    compiled.clear()  # as in a new process: no step traced yet
    fresh = make_engine(model, disk=DiskTier(str(root)), warmup=True)
    warm = {k: v for k, v in fresh.compilations.items() if k.startswith("swap_in[")}
    assert len(warm) == len(hkv.engine.offload.swap_in_warmup_inputs(fresh.layout)) > 1
    assert set(warm.values()) == {1}
    prompts = [diverge(CUT + 2 * BT, tail=3, seed=14), diverge(3 * BT, tail=2, seed=15)]
    gens = [fresh.generate([p], NEW, return_logits=True)[0] for p in prompts]
    assert gens[0].plan.disk_tokens == (0, CUT + 2 * BT)  # the second: from disk or device, another bucket
    assert_same(gens, reference(model, prompts))
    after = {k: v for k, v in fresh.compilations.items() if k.startswith("swap_in[")}
    assert after == warm  # the restore used a warmed bucket: nothing compiled


def test_an_offload_builds_the_restore_step_of_its_chain_ahead(model, tmp_path):
    """Without warmup: offloading records to disk starts building (on a background thread) the
    `swap_in` bucket that restores their longest chain into an empty slot, so the first restore from
    disk finds its install step built instead of compiling it on the request's path."""
    from hkv.engine import compiled

    compiled.clear()  # as in a new process: no step traced yet
    fresh = make_engine(model, disk=DiskTier(str(tmp_path / "ahead")))
    fresh.generate([BASE[: CUT + 1]], NEW)
    traces = fresh._steps.traces
    assert not any(k.startswith("swap_in[") for k in traces)
    assert fresh.evict_prefixes() == CUT // BT
    compiled.wait_for_ahead()
    rows, _ = hkv.engine.offload.swap_in_zero_inputs(fresh.layout, 0, CUT)
    name = compiled.step_name("swap_in", hkv.engine.offload.swap_in_size(rows))
    assert {k: v for k, v in traces.items() if k.startswith("swap_in[")} == {name: 1}
    fresh.flush_disk()
    prompt = diverge(CUT, tail=3, seed=22)
    (g,) = fresh.generate([prompt], NEW, return_logits=True)
    assert g.plan.disk_tokens == (0, CUT)
    assert_same([g], reference(model, [prompt]))
    assert {k: v for k, v in traces.items() if k.startswith("swap_in[")} == {name: 1}  # used, not built again
    assert fresh.compilations[name] == 1


def test_a_store_that_fails_to_answer_is_a_miss_not_a_crash(model, engine, stored, tmp_path):
    engine.disk = DiskTier(str(stored))
    forget_device(engine)

    def offline(*a, **kw):
        raise RuntimeError("store offline")

    engine.disk.find_chain = offline
    prompt = diverge(CUT, tail=3, seed=17)
    (g,) = engine.generate([prompt], NEW, return_logits=True)
    assert g.plan.restored_tokens == 0 and g.plan.reason == "disk_missing"
    assert_same([g], reference(model, [prompt]))


def test_a_build_on_another_thread_during_a_disk_read_keeps_its_cost_sample(model, engine, stored):
    """The restore choice times disk reads (`disk_token`). A read timed with a compile on its own
    thread is no sample, but a step built meanwhile on another thread (a build ahead, the decode
    step building in the background) is none of its business: comparing the process's total build
    count dropped the sample whenever one happened."""
    engine.disk = DiskTier(str(stored))
    real = engine.prefix_manager.disk_read

    def read_while_another_thread_builds(*args):
        other = threading.Thread(target=engine._steps.count, args=("built elsewhere",))
        other.start()
        other.join()
        return real(*args)

    for i in range(2):  # the first restore from disk builds its install step: no sample
        forget_device(engine)
        if i:
            engine.prefix_manager.costs.disk_token = None
            engine.prefix_manager.disk_read = read_while_another_thread_builds
        (g,) = engine.generate([diverge(CUT, tail=3, seed=40 + i)], NEW)
        assert g.plan.disk_tokens == (0, CUT)
    assert engine._steps.traces["built elsewhere"] == 1
    assert engine.prefix_manager.costs.disk_token is not None


def test_evict_prefixes_moves_the_device_prefix_cache_to_disk(model, engine, tmp_path):
    engine.disk = DiskTier(str(tmp_path / "evict"))
    forget_device(engine)
    engine.generate([BASE[: CUT + 1]], NEW, return_logits=True)
    assert engine.evict_prefixes() == CUT // BT
    engine.flush_disk()
    assert engine.stats()["prefix"]["occupancy"]["records"] == 0
    prompt = diverge(CUT, tail=3, seed=18)
    (g,) = engine.generate([prompt], NEW, return_logits=True)
    assert g.plan.disk_tokens == (0, CUT)
    assert_same([g], reference(model, [prompt]))


def test_restore_choice_longest_reads_a_disk_that_cheapest_finds_too_slow(model, stored, tmp_path):
    """`restore_choice="cheapest"` (the default) weighs measured costs: with disk reads measured at 1 s
    per token it recomputes the tiny model's prompt instead; "longest" restores from disk whatever the
    timings (the notebook's reproducible route). Both outputs are exact; a bad choice is named."""
    prompt = diverge(CUT, tail=3, seed=21)
    ref = reference(model, [prompt])
    plans = {}
    for choice in ("cheapest", "longest"):
        root = tmp_path / choice
        shutil.copytree(stored, root)
        engine = _make_engine(model, disk=DiskTier(str(root)), restore_choice=choice)
        engine.prefix_manager.costs.disk_token = 1.0  # as if this engine had timed a disk read at 1 s per token
        (g,) = engine.generate([prompt], NEW, return_logits=True)
        assert_same([g], ref)
        plans[choice] = g.plan
    assert plans["cheapest"].disk_tokens is None and plans["cheapest"].restored_tokens == 0, plans["cheapest"]
    assert plans["longest"].disk_tokens == (0, CUT) and plans["longest"].restored_tokens == CUT, plans["longest"]
    with pytest.raises(ValueError, match=r"restore_choice='fastest' must be one of \('cheapest', 'longest'\)"):
        _make_engine(model, restore_choice="fastest")


def test_disk_tier_needs_the_prefix_cache(model, tmp_path):
    with pytest.raises(ValueError, match="prefix_records"):
        hkv.Engine(
            model, hkv.CacheConfig(slots=1, max_context=64, prefix_records=0), disk=DiskTier(str(tmp_path / "x"))
        )


def test_warm_restart_keeps_disk_residency_and_reopens_the_store(model, engine, stored, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(stored, root)
    engine.disk = DiskTier(str(root))
    forget_device(engine)  # the saved device cache holds only tombstones: the hit must come from disk
    engine.save(tmp_path / "ckpt")
    back = hkv.Engine.restore(tmp_path / "ckpt", model, disk=DiskTier(str(root)))
    assert np.array_equal(np.asarray(back.cache.prefix.on_disk), np.asarray(engine.cache.prefix.on_disk))
    prompt = diverge(CUT, tail=3, seed=14)
    (g,) = back.generate([prompt], NEW, return_logits=True)
    assert g.plan.disk_tokens == (0, CUT)
    assert_same([g], reference(model, [prompt]))


# ------------------------------------------------------------------- other processes, engine level
CHILD = r"""
import json, sys, time
import numpy as np
from hkv.store import tier as disk
from hkv.store.tier import BlockPayload, DiskTier, dtype_of

src, store, mode = sys.argv[1], sys.argv[2], sys.argv[3]
segments = json.load(open(f"{src}/segments.json"))

def load(seg):
    out = []
    for b in seg["blocks"]:
        objs = {o["name"]: (np.fromfile(f"{src}/{o['file']}", dtype=dtype_of(o["dtype"])).reshape(o["shape"]),
                            o["row_start"]) for o in b["objects"]}
        out.append(BlockPayload(bytes.fromhex(b["key"]), bytes.fromhex(b["parent"]) if b["parent"] else None,
                                b["index"], b["length"], b["tokens"], b["indexer_version"], b["snapshot"], objs))
    return seg["abi"], out

tier = DiskTier(store)
if mode == "hang-before-second-publish":
    real = tier.kv

    class HangOnSecondManifest:
        published = 0

        def __getattr__(self, name):
            return getattr(real, name)

        def __truediv__(self, other):
            return real / other

        def write(self, key, value, **kw):
            if key.startswith("manifests/"):
                HangOnSecondManifest.published += 1
                if HangOnSecondManifest.published == 2:
                    print("data committed, manifest not yet published", flush=True)
                    time.sleep(600)
            return real.write(key, value, **kw)

    tier.kv = HangOnSecondManifest()
    for seg in segments:
        tier.write(*load(seg))
        print("published", flush=True)
else:  # write every segment (another process does the same at the same time)
    for seg in segments:
        tier.write(*load(seg))
    print("done", flush=True)
"""


@pytest.fixture(scope="module")
def payload_files(engine, tmp_path_factory):
    """The two segments `fill` writes, as raw files another process can write to a store."""
    src = tmp_path_factory.mktemp("payloads")
    tier = DiskTier(str(src / "capture"))
    captured = []
    real = tier._writer.write_segment

    def capture(abi, blocks):
        captured.append((abi, blocks))
        return real(abi, blocks)

    tier._writer.write_segment = capture
    fill(engine, tier)
    segments = []
    for si, (abi, blocks) in enumerate(captured):
        seg = {"abi": abi, "blocks": []}
        for b in blocks:
            objs = []
            for name, (arr, row) in b.objects.items():
                f = f"s{si}-b{b.index}-{name}.bin"
                np.ascontiguousarray(arr).tofile(src / f)
                objs.append(
                    {"name": name, "file": f, "dtype": arr.dtype.name, "shape": list(arr.shape), "row_start": int(row)}
                )
            seg["blocks"].append(
                {
                    "key": b.key.hex(),
                    "parent": b.parent.hex() if b.parent else "",
                    "index": b.index,
                    "length": b.length,
                    "tokens": [int(t) for t in b.tokens],
                    "indexer_version": b.indexer_version,
                    "snapshot": b.snapshot,
                    "objects": objs,
                }
            )
        segments.append(seg)
    assert len(segments) == 2
    (src / "segments.json").write_text(json.dumps(segments))
    return src


def _child(src, store, mode):
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(src), str(store), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_writer_killed_with_sigkill_mid_write_leaves_a_restorable_prefix(model, engine, payload_files, tmp_path):
    import signal

    store = tmp_path / "killed"
    child = _child(payload_files, store, "hang-before-second-publish")
    lines = []
    for line in child.stdout:
        lines.append(line.strip())
        if line.startswith("data committed"):
            child.send_signal(signal.SIGKILL)  # the second segment's bytes are on disk, its manifest is not
            break
    assert child.wait(60) == -signal.SIGKILL, (lines, child.stderr.read())
    assert lines[0] == "published"
    tier = DiskTier(str(store))
    report = tier.verify()
    assert report["blocks_ok"] == CUT // BT and report["orphaned_segments"] == 1
    assert sum(report[r] for r in ("disk_checksum", "disk_missing", "disk_truncated", "disk_abi")) == 0
    engine.disk = tier
    forget_device(engine)
    prompt = diverge(len(BASE) // BT * BT, tail=3, seed=15)
    (g,) = engine.generate([prompt], NEW, return_logits=True)
    assert g.plan.disk_tokens == (0, CUT)
    assert g.plan.reason == "disk_missing"  # the tombstones say those blocks went to disk; that store lacks them
    assert_same([g], reference(model, [prompt]))


def test_two_processes_writing_the_same_blocks_to_one_store(model, engine, payload_files, tmp_path):
    store = tmp_path / "shared"
    store.mkdir()
    kids = [_child(payload_files, store, "write-all") for _ in range(2)]
    for k in kids:
        out, err = k.communicate(timeout=120)
        assert k.returncode == 0 and out.strip() == "done", err
    tier = DiskTier(str(store))
    report = tier.verify()
    assert report["segments"] == 4 and report["blocks_ok"] == 2 * (len(BASE) // BT)
    assert report["orphaned_segments"] == 0 and not report["problems"]
    engine.disk = tier
    forget_device(engine)
    prompt = diverge(len(BASE) // BT * BT, tail=3, seed=16)
    (g,) = engine.generate([prompt], NEW, return_logits=True)
    assert g.plan.disk_tokens == (0, len(BASE) // BT * BT) and g.plan.reason is None
    assert_same([g], reference(model, [prompt]))


KEY = bytes(range(100, 132))


@pytest.fixture(scope="module")
def stored_keyed(engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("keyed") / "s"
    fill(engine, DiskTier(str(root), key=KEY))
    return root


def _forge_swap(path, a: int, b: int) -> int:
    """What someone who can write the store but has no key can do: swap the bytes blocks a and b
    point at (every object they share by name, dtype and shape) and recompute the manifest's crc32;
    its HMAC, if any, is left stale. Returns the number of objects swapped."""
    doc = json.loads(path.read_bytes())
    ba, bb = (next(x for x in doc["blocks"] if x["index"] == i) for i in (a, b))
    n = 0
    for oa in ba["objects"]:
        ob = next((o for o in bb["objects"] if o["name"] == oa["name"]), None)
        if ob is not None and (ob["dtype"], ob["shape"]) == (oa["dtype"], oa["shape"]):
            for f in ("offset", "sum64", "sha256"):
                if f in oa:
                    oa[f], ob[f] = ob[f], oa[f]
            n += 1
    doc.pop("checksum")
    doc["checksum"] = mf.zlib.crc32(mf._canonical(doc))
    path.write_bytes(json.dumps(doc).encode())
    return n


def _payloads(tier, abi, seg) -> dict:
    """{block index: payload} of every block segment `seg` lists, read and verified by `tier`."""
    with open(tier.spec["path"] + f"manifests/{abi}/{seg}.json", "rb") as f:
        doc = json.loads(f.read())
    res = tier.read([hkv.store.tier.BlockRef(abi, seg, b) for b in doc["blocks"]], count=False)
    assert res.reason is None, res
    return {p.index: p for p in res.payloads}


@pytest.mark.parametrize("keyed", [False, True])
def test_a_resealed_manifest_pointing_a_block_at_another_blocks_bytes(
    model, engine, stored, stored_keyed, tmp_path, monkeypatch, keyed
):
    """Issue 11, defect 9. Without a key the store has integrity, not authenticity: a manifest
    resealed with a valid crc32 that points block CUT/BT + 1 at block CUT/BT + 3's bytes passes
    `verify` and restores wrong K/V (wrong logits). With a key it is `disk_auth`: the plan stops at
    the intact segment before it and the output is exact."""
    monkeypatch.delenv("HKV_STORE_KEY", raising=False)
    root = tmp_path / "copy"
    shutil.copytree(stored_keyed if keyed else stored, root)
    key = KEY if keyed else b""
    # keyed: indexed before the forgery (a running server re-reads it: disk_auth); unkeyed: opened
    # after it (a restarted server indexes the forged manifest as it is)
    tier = DiskTier(str(root), key=key) if keyed else None
    abi, seg = _segment(root, CUT // BT)
    assert _forge_swap(root / "manifests" / abi / f"{seg}.json", CUT // BT + 1, CUT // BT + 3) >= 1
    engine.disk = tier or DiskTier(str(root), key=key)
    forget_device(engine)
    prompt = diverge(len(BASE) // BT * BT, tail=3, seed=9)
    (g,) = engine.generate([prompt], NEW, return_logits=True)
    report = DiskTier(str(root), key=key).verify()
    if not keyed:  # the threat model without a key: undetected
        assert g.plan.restored_tokens == len(BASE) // BT * BT and g.plan.reason is None
        assert report["blocks_ok"] == len(BASE) // BT and not report["problems"]
        # ... and what it installed as block CUT/BT + 1 is block CUT/BT + 3's K/V
        got, orig = (_payloads(DiskTier(str(r), key=b""), abi, seg) for r in (root, stored))
        swapped = [n for n in got[CUT // BT + 1].objects if n in orig[CUT // BT + 3].objects]
        assert swapped and all(
            np.array_equal(got[CUT // BT + 1].objects[n][0], orig[CUT // BT + 3].objects[n][0]) for n in swapped
        )
        assert not np.array_equal(got[CUT // BT + 1].objects[swapped[0]][0], orig[CUT // BT + 1].objects[swapped[0]][0])
        return
    assert g.plan.restored_tokens == CUT and g.plan.disk_tokens == (0, CUT), g.plan
    assert g.plan.reason == "disk_auth" and g.plan.first_failed_stage == "byte"
    assert_same([g], reference(model, [prompt]))
    assert engine.stats()["prefix"]["rejections"]["byte"]["disk_auth"] >= 1
    assert 'hkv_prefix_rejections_total{reason="disk_auth",stage="byte"}' in engine.metrics_text()  # labels sorted
    assert report["disk_auth"] == 1 and report["blocks_ok"] == CUT // BT
    assert any(f"manifests/{abi}/{seg}.json: disk_auth: HMAC does not match" in p for p in report["problems"])
    # the intact keyed store restores everything with the key, and nothing without it
    for k, want in ((KEY, len(BASE) // BT * BT), (b"", 0), (b"y" * 32, 0)):
        engine.disk = DiskTier(str(stored_keyed), key=k)
        forget_device(engine)
        (g,) = engine.generate([prompt], NEW, return_logits=True)
        assert g.plan.restored_tokens == want, (k, g.plan)
        assert_same([g], reference(model, [prompt]))
