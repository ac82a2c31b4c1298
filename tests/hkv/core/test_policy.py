"""Eviction policy (hkv.core.policy.eviction_order) on synthetic prefix-index snapshots: leaves only,
pinned chains never evicted whole, snapshots before records, and admission control (`used_before`)
restricting candidates to chains last used before the requesting sequence's own previous use or
shorter than its own restored chain, or never reused (one-shot content)."""

from __future__ import annotations

import numpy as np

from hkv.core.policy import (
    chain_hits,
    chain_last_used,
    chain_max_length,
    eviction_order,
    record_bytes,
    snapshot_bytes,
)
from hkv.core.spec import CacheSpec, LayerSpec
from models.deepseek_v4 import tiny_config
from models.deepseek_v4.cache_spec import cache_spec

SPEC = cache_spec(tiny_config(), block_tokens=16)


def meta(parent, length, last_used, snap, state=None):
    n = len(parent)
    return {
        "state": np.asarray(state if state is not None else [1] * n, np.int8),
        "parent": np.asarray(parent, np.int32),
        "length": np.asarray(length, np.int32),
        "last_used": np.asarray(last_used, np.int32),
        "swa_held": np.asarray(snap, bool),
        "tail_slot": np.where(np.asarray(snap, bool), 0, -1).astype(np.int32),
    }


# chain A: 0 -> 1 -> 2 (used at 10, 11, 12); chain B: 3 -> 4 (used at 20, 21); chain C shares A's root:
# 0 -> 5 (used at 30); record 6 is dead. Snapshots at the leaves 2, 4, 5.
M = meta(
    parent=[-1, 0, 1, -1, 3, 0, -1],
    length=[16, 32, 48, 16, 32, 32, 16],
    last_used=[10, 11, 12, 20, 21, 30, 99],
    snap=[0, 0, 1, 0, 1, 1, 0],
    state=[1, 1, 1, 1, 1, 1, 0],
)


def test_chain_last_used_is_the_latest_use_through_each_record():
    assert chain_last_used(M).tolist() == [30, 12, 12, 21, 21, 30, -1]


def test_only_leaves_whole_and_snapshots_first():
    order = eviction_order(SPEC, M)
    kinds = [k for k, _ in order]
    assert kinds == sorted(kinds, key=lambda k: k != "snapshot")  # every snapshot before any record
    assert {r for k, r in order if k == "record"} == {2, 4, 5}
    assert {r for k, r in order if k == "snapshot"} == {2, 4, 5}
    assert 6 not in {r for _, r in order}  # dead records are never candidates


def test_pinned_leaf_is_never_evicted_whole():
    order = eviction_order(SPEC, M, pinned={4})
    assert ("record", 4) not in order and ("snapshot", 4) in order


def test_admission_control_only_evicts_chains_used_before():
    # a sequence whose own previous use was at clock 15 may take chain A's leaf, not B's or C's
    order = eviction_order(SPEC, M, used_before=15)
    assert {r for k, r in order if k == "record"} == {2}
    assert {r for k, r in order if k == "snapshot"} == {2}
    # previous use older than every chain (a re-recording turn, or no previous use): nothing
    assert eviction_order(SPEC, M, used_before=5) == []
    assert eviction_order(SPEC, M, used_before=-1) == []
    # a shared root is protected by its most recent extension: A's root (0) is used at 30 through C
    m = dict(M, last_used=np.asarray([10, 11, 12, 20, 21, 13, 99], np.int32))
    order = eviction_order(SPEC, m, used_before=15)
    assert {r for k, r in order if k == "record"} == {2, 5}
    # and pinning still applies under admission control
    assert ("record", 2) not in eviction_order(SPEC, M, pinned={2}, used_before=15)


def test_admission_control_none_is_the_full_policy():
    assert eviction_order(SPEC, M, used_before=None) == eviction_order(SPEC, M)
    assert eviction_order(SPEC, M, used_before=10**9) == eviction_order(SPEC, M)


def test_chain_max_length_is_the_furthest_boundary_through_each_record():
    assert chain_max_length(M).tolist() == [48, 48, 48, 32, 32, 32, -1]


def test_admission_control_shorter_chains():
    # a sequence that restored 40 tokens may take chains reaching <= 32 (B, C), never A (48) or A's
    # shared root (reached to 48 through A)
    order = eviction_order(SPEC, M, shorter_than=40)
    assert {r for k, r in order if k == "record"} == {4, 5}
    assert {r for k, r in order if k == "snapshot"} == {4, 5}
    assert eviction_order(SPEC, M, shorter_than=32) == []  # equal length is not shorter
    # either condition admits: B is short, A was last used before 13
    order = eviction_order(SPEC, M, used_before=13, shorter_than=33)
    assert {r for k, r in order if k == "record"} == {2, 4, 5}
    # pinned still wins
    assert ("record", 4) not in eviction_order(SPEC, M, pinned={4}, shorter_than=40)
    # snapshots still before records
    kinds = [k for k, _ in eviction_order(SPEC, M, used_before=13, shorter_than=33)]
    assert kinds == sorted(kinds, key=lambda k: k != "snapshot")


def test_chain_hits_and_never_reused_chains():
    # A's root (0) was restored twice, so A (0, 1, 2) and C (0 -> 5) count as reused; B never was
    m = dict(M, hits=np.asarray([2, 0, 0, 0, 0, 0, 7], np.int32))
    assert chain_hits(m).tolist() == [2, 2, 2, 0, 0, 2, 0]
    order = eviction_order(SPEC, m, never_hit=True)
    assert {r for k, r in order if k == "record"} == {4}
    assert {r for k, r in order if k == "snapshot"} == {4}
    # a hit below a record protects it too: B's leaf restored once protects B's root's snapshot
    m2 = dict(m, hits=np.asarray([2, 0, 0, 0, 1, 0, 7], np.int32))
    assert chain_hits(m2).tolist()[3:5] == [1, 1]
    assert eviction_order(SPEC, m2, never_hit=True) == []
    # combined with the other conditions (any one admits)
    order = eviction_order(SPEC, m, used_before=13, never_hit=True)
    assert {r for k, r in order if k == "record"} == {2, 4}


def test_a_spec_of_full_attention_layers_only_ranks_its_snapshots_last():
    """No window and no compressor: a snapshot holds no bytes (`snapshot_bytes` 0), and the ranking
    divided by it (ZeroDivisionError under page pressure for a Llama-like spec). Such snapshots free
    nothing, so they go after every record."""
    spec = CacheSpec(layers=(LayerSpec(4, None), LayerSpec(4, None)), block_tokens=8, model_id="llama-like")
    assert snapshot_bytes(spec) == 0 and record_bytes(spec) > 0
    meta = {
        "state": np.array([1, 1], np.int8),
        "parent": np.array([-1, 0]),
        "length": np.array([8, 16]),
        "last_used": np.array([1, 2]),
        "swa_held": np.array([True, True]),
        "tail_slot": np.array([0, 1]),
    }
    assert eviction_order(spec, meta) == [("record", 1), ("snapshot", 0), ("snapshot", 1)]
