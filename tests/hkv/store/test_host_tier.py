"""`hkv.HostTier` and `hkv.TieredStore` (host memory over disk): exact round trips, the byte budget
and its spill to disk, promotion on hit, prefetch of a chain's later blocks, and faults in either
tier through the engine ending in a shorter plan with its reason and exact tokens, as the disk tier's do."""

# ruff: noqa: F811 — the fixtures model, engine and stored are imported from test_disk

from __future__ import annotations

import concurrent.futures
import shutil
import threading

import numpy as np
import pytest

import hkv
from hkv.store import digest as hkv_digest
from hkv.store.host import HOST_SEGMENT, HostTier, digest
from hkv.store.tier import DiskTier
from hkv.store.tiered import TieredStore

from ..engine.test_disk import (
    CUT,
    FAULTS,
    NEW,
    _segment,
    assert_fault_is_a_shorter_plan,
    assert_same,
    engine,  # noqa: F401 — the fixture
    fill,
    forget_device,
    model,  # noqa: F401 — the fixture
    reference,
    stored,  # noqa: F401 — the fixture
)
from ..engine.test_prefix import BASE, BT, diverge
from .test_tier import ABI, assert_same_payloads, chain


def nbytes(blocks) -> int:
    return sum(a.nbytes for b in blocks for a, _ in b.objects.values())


def lookup(tier, blocks):
    return tier.find_chain(ABI, [b.key for b in blocks], [b.tokens for b in blocks])


# ------------------------------------------------------------------------------ no model
def test_round_trip_returns_the_exact_bytes_read_only():
    tier = HostTier()
    blocks = chain("a", 5, snapshot_every=2)
    assert tier.write_async(ABI, blocks).result() == [b.key for b in blocks]
    found = lookup(tier, blocks)
    assert found.stop is None and [r.segment for r in found.refs] == [HOST_SEGMENT] * 5
    res = tier.read(found.refs)
    assert res.reason is None
    assert_same_payloads(res.payloads, blocks)
    a = res.payloads[0].objects["g0.rows"][0]
    with pytest.raises(ValueError):
        a[0, 0, 0] = 1  # a read hands out read-only views: the caller cannot damage the tier
    assert tier.contains(ABI, blocks[1].key) == (True, True) and tier.contains(ABI, blocks[0].key) == (True, False)
    assert tier.stored_bytes() == nbytes(blocks) and tier.counters["blocks_read"] == 5


def test_chain_stops_at_an_absent_block_a_collision_or_a_foreign_abi():
    tier = HostTier()
    blocks = chain("a", 4)
    tier.write(ABI, blocks[:3])
    assert len(lookup(tier, blocks).refs) == 3 and lookup(tier, blocks).stop == "absent"
    toks = [b.tokens for b in blocks[:3]]
    toks[1] = [9] * BT
    got = tier.find_chain(ABI, [b.key for b in blocks[:3]], toks)
    assert len(got.refs) == 1 and got.stop == "collision"
    got = tier.find_chain("cd" * 16, [b.key for b in blocks[:3]], [b.tokens for b in blocks[:3]])
    assert got.refs == [] and got.stop == "disk_abi"


@pytest.mark.parametrize("check", ["sum64", "crc32"])
def test_digest_many_equals_digest_on_one_thread_and_on_every_core(check, monkeypatch):
    rng = np.random.default_rng(3)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in (5, 3 << 20, 0, 4 << 20, 17, 2 << 20)]
    arrays.insert(2, None)
    want = [None if a is None else digest(a, check) for a in arrays]
    assert sum(a.nbytes for a in arrays if a is not None) >= hkv_digest.PARALLEL_BYTES  # the threaded path
    assert hkv_digest.digest_many(arrays, check) == want
    monkeypatch.setattr(hkv_digest, "PARALLEL_BYTES", 1 << 40)
    assert hkv_digest.digest_many(arrays, check) == want
    with pytest.raises(ValueError, match="check='md5' must be one of"):
        hkv_digest.digest_many(arrays, "md5")


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("check", ["sum64", "crc32"])
def test_a_changed_byte_or_shape_is_refused_with_a_reason_and_the_blocks_before_it_kept(check, parallel, monkeypatch):
    if parallel:  # the digests of a read on every core, as for a long chain
        monkeypatch.setattr(hkv_digest, "PARALLEL_BYTES", 0)
    tier = HostTier(check=check)
    blocks = chain("a", 4)
    tier.write(ABI, blocks)
    refs = lookup(tier, blocks).refs
    held = tier._blocks[(ABI, blocks[2].key, True)]
    before = digest(held.buf, check)
    held.buf[1234] ^= 0x10  # one bit of host memory changed
    assert digest(held.buf, check) != before
    res = tier.read(refs)
    assert len(res.payloads) == 2 and res.reason == "disk_checksum" and "host tier" in res.detail
    assert_same_payloads(res.payloads, blocks[:2])
    held.buf[1234] ^= 0x10
    assert_same_payloads(tier.read(refs).payloads, blocks)
    a = blocks[0].objects["g0.rows"][0]
    want = {"g0.rows": (a.dtype, (2, 99, 4)), "t0.tail_kv": (np.float32, (4, 8))}
    res = tier.read(refs, expect=lambda ref: want)
    assert res.payloads == [] and res.reason == "disk_checksum" and "engine needs" in res.detail
    assert tier.counters["rejected_disk_checksum"] == 2


def test_a_block_evicted_after_its_lookup_is_disk_missing_and_the_budget_holds():
    blocks = chain("a", 6)
    tier = HostTier(budget_bytes=nbytes(blocks[:4]))
    tier.write(ABI, blocks[:4])
    refs = lookup(tier, blocks[:4]).refs
    other = chain("b", 2)
    tier.write(ABI, other)  # over budget: the least recently used leaves go (a's last two blocks)
    assert tier.stored_bytes() <= tier.budget_bytes
    assert [tier.holds(ABI, b.key) for b in blocks[:4]] == [True, True, False, False]
    res = tier.read(refs)
    assert len(res.payloads) == 2 and res.reason == "disk_missing"


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="budget_bytes"):
        HostTier(budget_bytes=-1)
    with pytest.raises(ValueError, match="check"):
        HostTier(check="md5")
    with pytest.raises(ValueError, match="abi"):
        HostTier().write("xyz", chain("a", 1))
    with pytest.raises(ValueError, match="prefetch_blocks"):
        TieredStore(HostTier(), DiskTier(str(tmp_path / "d")), prefetch_blocks=-1)
    with pytest.raises(ValueError, match=r"hkv\.HostTier"):
        TieredStore(DiskTier(str(tmp_path / "d")), DiskTier(str(tmp_path / "d")))


def test_over_budget_blocks_spill_to_disk_and_come_back_promoted(tmp_path):
    a, b = chain("a", 4, snapshot_every=2), chain("b", 4, snapshot_every=2)
    host = HostTier(budget_bytes=nbytes(a) + nbytes(b[:2]))
    store = TieredStore(host, DiskTier(str(tmp_path / "d"), linger_seconds=0))
    store.write(ABI, a)
    store.write(ABI, b)  # a's two last blocks are the least recently used leaves: written to disk, dropped
    store.flush()
    assert host.stored_bytes() <= host.budget_bytes
    assert [host.holds(ABI, x.key) for x in a] == [True, True, False, False]
    assert all(store.disk.contains(ABI, x.key)[0] for x in a[2:]) and not store.disk.contains(ABI, a[0].key)[0]
    assert host.counters["blocks_spilled"] == 2 and store.counters["host_blocks_spilled"] == 2
    found = lookup(store, a)
    assert [r.segment == HOST_SEGMENT for r in found.refs] == [True, True, False, False] and found.stop is None
    res = store.read(found.refs)
    assert res.reason is None
    assert_same_payloads(res.payloads, a)
    store.flush()
    assert all(host.holds(ABI, x.key) for x in a)  # promoted on the hit; b's leaves went to disk in turn
    assert store.disk.contains(ABI, b[3].key)[0] and not host.holds(ABI, b[3].key)
    res = store.read(lookup(store, b).refs)
    assert_same_payloads(res.payloads, b)
    store.close()
    assert store.closed and host.closed
    with pytest.raises(hkv.DiskTierClosedError):
        host.find_chain(ABI, [a[0].key], [a[0].tokens])
    assert DiskTier(str(tmp_path / "d")).contains(ABI, b[0].key)[0]  # close() wrote the host-only blocks


def test_host_blocks_spilled_between_lookup_and_read_are_read_from_disk(tmp_path):
    a, b = chain("a", 4, snapshot_every=2), chain("b", 4, snapshot_every=2)
    host = HostTier(budget_bytes=nbytes(a) + nbytes(b[:2]))
    store = TieredStore(host, DiskTier(str(tmp_path / "d"), linger_seconds=0))
    store.write(ABI, a)
    refs = lookup(store, a).refs
    assert all(r.segment == HOST_SEGMENT for r in refs)
    store.write(ABI, b)  # a's two last blocks move to disk after the lookup
    store.flush()
    assert not host.holds(ABI, a[3].key)
    res = store.read(refs)
    assert res.reason is None
    assert_same_payloads(res.payloads, a)
    store.close(persist=False)


def test_a_chain_found_on_disk_is_prefetched_and_the_first_blocks_do_not_wait_for_the_rest(tmp_path):
    disk = DiskTier(str(tmp_path / "d"), linger_seconds=0)
    blocks = chain("a", 8, snapshot_every=2)
    disk.write(ABI, blocks)
    store = TieredStore(HostTier(), disk, prefetch_blocks=2)
    gate, real = threading.Event(), disk.read

    def slow_after_the_first_pieces(refs, expect=None, count=True):
        if refs and refs[0].entry["index"] >= 2:  # the pieces after the first: blocks [2, 6) and [6, 8)
            assert gate.wait(30)
        return real(refs, expect, count)

    disk.read = slow_after_the_first_pieces
    found = lookup(store, blocks)
    assert found.stop is None and all(r.segment != HOST_SEGMENT for r in found.refs)
    res = store.read(found.refs[:2])  # its piece is loaded while the later pieces wait
    assert_same_payloads(res.payloads, blocks[:2])
    assert not any(store.host.holds(ABI, b.key) for b in blocks[2:])
    gate.set()
    store.wait_prefetch()
    assert all(store.host.holds(ABI, b.key) for b in blocks) and store.prefetched == 8  # no other request
    read_before = disk.counters["blocks_read"]
    res = store.read(lookup(store, blocks).refs)
    assert_same_payloads(res.payloads, blocks)
    assert disk.counters["blocks_read"] == read_before  # from host memory
    store.close()


@pytest.mark.parametrize("how", ["raises", "fails_later"])
def test_a_failed_spill_drops_the_blocks_and_counts_them(how):
    """Blocks evicted to a spill that fails (at once, or once its write resolves) are dropped, counted
    in `spill_failures` (not `blocks_spilled`), and stay readable until the spill resolves."""
    a, b = chain("a", 4, snapshot_every=2), chain("b", 2, snapshot_every=2)
    pending: list = []

    def spill(abi, payloads):
        if how == "raises":
            raise OSError("disk full")
        fut = concurrent.futures.Future()
        pending.append(fut)
        return fut

    host = HostTier(budget_bytes=nbytes(a), spill=spill)
    host.write(ABI, a)
    host.write(ABI, b)  # over budget: a's two last blocks (its leaves, least recently used) leave
    if how == "fails_later":
        assert host.holds(ABI, a[3].key)  # readable until the spill resolves
        assert_same_payloads(host.read(lookup(host, a).refs).payloads, a)
        (fut,) = pending
        fut.set_exception(OSError("disk full"))
    assert [host.holds(ABI, x.key) for x in a] == [True, True, False, False]
    assert host.counters["spill_failures"] == 2 and host.counters["blocks_spilled"] == 0
    found = lookup(host, a)
    assert len(found.refs) == 2
    assert_same_payloads(host.read(found.refs).payloads, a[:2])
    host.close()


def test_a_prefetched_block_the_engine_cannot_use_is_refused_and_counted(tmp_path):
    """A block still in its prefetch piece whose objects are not what the engine expects is refused
    with the disk tier's reason and counted as that tier's rejection, as a direct disk read is."""
    disk = DiskTier(str(tmp_path / "d"), linger_seconds=0)
    blocks = chain("a", 4, snapshot_every=2)
    disk.write(ABI, blocks)
    store = TieredStore(HostTier(), disk, prefetch_blocks=4)
    gate, real_put = threading.Event(), store.host.put

    def held(*args, **kwargs):  # promotion waits: the blocks stay in their prefetch piece
        assert gate.wait(30)
        return real_put(*args, **kwargs)

    store.host.put = held
    found = lookup(store, blocks)
    store.wait_prefetch(timeout=1.0)  # the piece's disk read is done; its promotion is held
    assert not any(store.host.holds(ABI, b.key) for b in blocks)

    def expect(ref):
        want = {n: (a.dtype, a.shape) for n, (a, _) in blocks[ref.entry["index"]].objects.items()}
        if ref.entry["index"] == 1:
            dt, shape = want["g0.rows"]
            want["g0.rows"] = (dt, (shape[0] + 1,) + shape[1:])
        return want

    before = store.counters.get("rejected_disk_checksum", 0)
    res = store.read(found.refs, expect=expect)
    assert res.reason == "disk_checksum" and "g0.rows" in res.detail
    assert_same_payloads(res.payloads, blocks[:1])
    assert store.counters["rejected_disk_checksum"] == before + 1
    gate.set()
    store.close(persist=False)


# ------------------------------------------------------------------------- through the engine
def test_engine_restores_token_exact_from_host_memory_and_from_disk_below_it(model, engine, tmp_path):
    store = TieredStore(HostTier(), DiskTier(str(tmp_path / "d")))
    fill(engine, store)
    host = store.host
    per_block = host.stored_bytes() // len(host)
    host.budget_bytes = per_block * 8  # the chain's later blocks spill to disk
    host.enforce_budget()
    store.flush()
    assert host.counters["blocks_spilled"] > 0 and host.stored_bytes() <= host.budget_bytes
    prompts = [diverge(k * BT, tail=3, seed=k) for k in (4, len(BASE) // BT)]
    gens = []
    for k, prompt in zip((4, len(BASE) // BT), prompts, strict=True):
        forget_device(engine)
        (g,) = engine.generate([prompt], NEW, return_logits=True)
        assert g.plan.restored_tokens == k * BT and g.plan.disk_tokens == (0, k * BT), g.plan
        gens.append(g)
    assert_same(gens, reference(model, prompts))
    assert store.disk.counters["blocks_read"] > 0 and host.counters["blocks_read"] > 0
    metrics = engine.metrics_text()
    assert "hkv_disk_stored_bytes" in metrics and "hkv_disk_blocks_total" in metrics
    engine.disk = None


def _drop(host, i):
    with host._lock:
        for b in [b for b in host._blocks.values() if b.payload.index == i]:
            host._remove(b)


def _flip_host(host, i):
    for b in [b for b in host._blocks.values() if b.payload.index == i]:
        b.buf[b.buf.nbytes // 3] ^= 0x10  # one bit of host memory changed


def _reshape_host(host, i):
    for b in [b for b in host._blocks.values() if b.payload.index == i]:
        name, (a, row) = next(iter(b.payload.objects.items()))
        b.payload.objects[name] = (a.reshape(-1), row)


HOST_FAULTS = {
    "flipped byte": (_flip_host, "disk_checksum"),
    "changed shape": (_reshape_host, "disk_checksum"),
    "evicted since the device's tombstone said stored": (_drop, "disk_missing"),
}


@pytest.mark.parametrize("fault", list(HOST_FAULTS))
def test_a_host_fault_gives_a_shorter_plan_with_reason_and_exact_output(model, engine, fault):
    host = HostTier()
    fill(engine, host)
    damage, reason = HOST_FAULTS[fault]
    damage(host, CUT // BT)
    prompt = diverge(len(BASE) // BT * BT, tail=3, seed=7)
    (g,) = engine.generate([prompt], NEW, return_logits=True)
    assert g.plan.hash_hit_tokens == len(BASE) // BT * BT
    assert g.plan.restored_tokens == CUT and g.plan.disk_tokens == (0, CUT), g.plan
    assert g.plan.reason == reason and g.plan.first_failed_stage == "byte"
    assert_same([g], reference(model, [prompt]))
    assert engine.stats()["prefix"]["rejections"]["byte"][reason] >= 1
    engine.disk = None


@pytest.mark.parametrize(
    "fault", ["flipped byte", "truncated chunk", "deleted manifest", "damaged block pointer", "manifest of another ABI"]
)
def test_a_disk_fault_under_the_host_tier_is_the_disk_tiers_shorter_plan(model, engine, stored, tmp_path, fault):
    """The disk tier's fault matrix (tests/hkv/engine/test_disk.py) with a TieredStore in front:
    the first segment is prefetched into host memory, the damaged second one stops the plan by name."""
    root = tmp_path / "copy"
    shutil.copytree(stored, root)
    store = TieredStore(HostTier(), DiskTier(str(root)), prefetch_blocks=4)
    engine.disk = store
    forget_device(engine)
    abi, seg = _segment(root, CUT // BT)
    damage, reason = FAULTS[fault]
    damage(root, abi, seg)
    assert_fault_is_a_shorter_plan(model, engine, reason, str(root), hidden="pointer" in fault)
    store.wait_prefetch()
    assert store.counters["host_blocks_promoted"] >= CUT // BT
    engine.disk = None


def test_the_engine_takes_a_host_tier_or_a_tiered_store_and_refuses_other_things(model, tmp_path):
    from ..engine.test_disk import make_engine

    assert make_engine(model, disk=hkv.HostTier()).disk is not None
    with pytest.raises(ValueError, match="TieredStore"):
        make_engine(model, disk=object())
