"""Weights identity (issue 11, defect 1): the ABI fingerprint covers the weights themselves
(`hkv.weights.weights_digest`), not the `model_id` label. One changed weight, or another dtype,
changes the fingerprint; another label does not; a disk store or a warm-restart checkpoint written
by other weights is never used (0 tokens restored, output equal to a cold run; restore refused)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hkv
from hkv.core import weights as hw
from hkv.core.weights import weights_digest
from hkv.engine import checkpoint as hc
from models.deepseek_v4 import init
from models.stateless import greedy_stateless

from ..engine.test_prefix import BASE, CFG, make_engine

NEW = 2
PROMPT = BASE[:100]  # 6 blocks of 16 tokens


@pytest.fixture(scope="module")
def seed0():
    return init(CFG, seed=0)


@pytest.fixture(scope="module")
def seed1():
    return init(CFG, seed=1)


def next_float(x: jax.Array, index) -> jax.Array:
    """`x` with the element at `index` moved to the next representable float (its lowest bit flipped)."""
    bits = jax.lax.bitcast_convert_type(x[index], jnp.uint32) ^ jnp.uint32(1)
    return x.at[index].set(jax.lax.bitcast_convert_type(bits, x.dtype))


# ------------------------------------------------------------------------------- the digest
def test_one_changed_weight_changes_the_engines_fingerprint(seed0):
    base = make_engine(seed0).spec
    assert base.weights_digest == weights_digest(nnx.state(seed0))
    flipped = init(CFG, seed=0)
    w = flipped.layers[1].ffn.w_down  # [experts, ...]: the last element of the last expert
    w.value = next_float(w.value, (-1, -1, -1))
    assert float(jnp.abs(w.value - seed0.layers[1].ffn.w_down.value).max()) < 1e-6  # a tiny change
    other = make_engine(flipped).spec
    assert other.weights_digest != base.weights_digest
    assert other.fingerprint() != base.fingerprint()
    assert dataclasses.replace(other, weights_digest=base.weights_digest).fingerprint() == base.fingerprint()


def test_every_single_element_change_of_every_leaf_is_detected(seed0):
    """Flip the lowest bit of the first and of the last element of each weight, one at a time: every
    variant has its own digest (the per-element mixer is a bijection of the value: a single change
    always changes the lane sums, not just with high probability)."""
    state = nnx.state(seed0)
    flat = jax.tree_util.tree_leaves_with_path(state)
    treedef = jax.tree_util.tree_structure(state)
    leaves = [x for _, x in flat]
    base = weights_digest(state)
    seen = {base}
    for i, x in enumerate(leaves):
        for index in sorted({0, x.size - 1}):
            u = jax.lax.bitcast_convert_type(x, jnp.uint32)  # float32 and int32 leaves
            flat_u = u.reshape(-1)
            changed = jax.lax.bitcast_convert_type(flat_u.at[index].set(flat_u[index] ^ 1), x.dtype).reshape(x.shape)
            variant = jax.tree_util.tree_unflatten(treedef, leaves[:i] + [changed] + leaves[i + 1 :])
            d = weights_digest(variant)
            assert d not in seen, (jax.tree_util.keystr(flat[i][0]), index)
            seen.add(d)
    assert len(seen) == 1 + sum(len({0, x.size - 1}) for x in leaves)


def test_every_position_and_bit_of_a_large_array_is_detected(monkeypatch):
    """An array past `SMALL` is hashed alone, in `CHUNK`s (the chunk number mixed in); with both made
    tiny here, single-bit flips anywhere (every chunk, every bit position) change the digest."""
    monkeypatch.setattr(hw, "SMALL", 64)
    monkeypatch.setattr(hw, "CHUNK", 100)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(450).astype(np.float32))
    base = weights_digest({"w": x})
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    seen = {base}
    for index in (0, 99, 100, 101, 250, 449):
        for bit in (0, 13, 31):
            flipped = u.at[index].set(u[index] ^ jnp.uint32(1 << bit))
            d = weights_digest({"w": jax.lax.bitcast_convert_type(flipped, jnp.float32)})
            assert d not in seen, (index, bit)
            seen.add(d)
    # swapping two chunks' contents (same multiset of values, other positions) is detected too
    swapped = jnp.concatenate([x[100:200], x[:100], x[200:]])
    assert weights_digest({"w": swapped}) != base


def test_digest_is_a_pinned_function_of_values_dtypes_shapes_and_paths():
    """Pinned values: the digest is a stable function (integer ops only, order-independent wrapping
    sums), equal on every backend and across processes; numpy and jax leaves with the same bits agree."""
    w = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    d = weights_digest({"w": w})
    assert d == PINNED["f32_3x4"]
    assert weights_digest({"w": np.arange(12, dtype=np.float32).reshape(3, 4)}) == d
    assert weights_digest({"w": w.reshape(4, 3)}) != d  # shape
    assert weights_digest({"v": w}) != d  # path
    assert weights_digest({"w": jax.lax.bitcast_convert_type(w, jnp.int32)}) != d  # same bits, other dtype
    assert weights_digest({"w": w.astype(jnp.bfloat16)}) != weights_digest({"w": w.astype(jnp.float16)})
    assert weights_digest({"w": w, "b": jnp.zeros((0,), jnp.float32)}) != d  # an empty leaf still counts
    assert len(d) == 32 and int(d, 16) >= 0


PINNED = {"f32_3x4": "2e9092684226d682341d3310df66ffce"}  # hkv-weights-v1


def test_bfloat16_copy_of_the_same_weights_has_another_fingerprint(seed0):
    f32 = make_engine(seed0).spec
    bf = init(CFG, seed=0, dtype=jnp.bfloat16)
    bf_spec = make_engine(bf).spec
    assert bf_spec.weights_digest != f32.weights_digest
    assert bf_spec.fingerprint() != f32.fingerprint()
    # the weights alone (same storage dtype): the digest of a bf16 cast differs from the f32 weights'
    state = nnx.state(seed0)
    cast = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, state)
    assert weights_digest(cast) != f32.weights_digest
    assert dataclasses.replace(f32, weights_digest=weights_digest(cast)).fingerprint() != f32.fingerprint()


def test_model_id_is_a_label_not_an_identity(seed0):
    a = make_engine(seed0, model_id="prod-2026-11").spec
    b = make_engine(seed0, model_id="something-else").spec
    assert (a.model_id, b.model_id) == ("prod-2026-11", "something-else")
    assert a.fingerprint() == b.fingerprint() and a.weights_digest == b.weights_digest
    assert "model_id" in a.to_json() and "model_id" not in a.abi_json()


def test_digest_is_computed_once_per_weights_and_again_after_a_change(seed0, monkeypatch):
    calls = []
    real = hw._digest

    def counting(leaves):
        calls.append(len(leaves))
        return real(leaves)

    monkeypatch.setattr(hw, "_digest", counting)
    model = init(CFG, seed=0)
    e1 = make_engine(model)
    e2 = make_engine(model, model_id="again")
    assert len(calls) == 1 and e1.spec.fingerprint() == e2.spec.fingerprint()
    # an in-memory change replaces an (immutable) array: a cache miss, hashed afresh
    leaf = model.embed
    leaf.value = next_float(leaf.value, (0, 0))
    e3 = make_engine(model)
    assert len(calls) == 2 and e3.spec.weights_digest != e1.spec.weights_digest
    # numpy leaves are mutable in place: never cached
    state = {"w": np.ones(4, np.float32)}
    d = weights_digest(state)
    state["w"][2] = 3.0
    assert weights_digest(state) != d and len(calls) == 4


def test_the_engine_runs_the_weights_its_fingerprint_names(seed0):
    """nnx.split shares Variables with the model: the engine keeps its own (a snapshot, no copy of the
    arrays), so changing the model afterwards cannot make the engine run weights its digest does not name."""
    model = init(CFG, seed=0)
    engine = make_engine(model)
    model.embed.value = model.embed.value * 2
    assert weights_digest(engine._weights) == engine.spec.weights_digest  # the weights the engine runs
    # the model steps get them as leaves (`CompiledSteps.flat_weights`): the same arrays
    assert all(a is b for a, b in zip(engine._step_weights, jax.tree.leaves(engine._weights), strict=True))
    assert weights_digest(nnx.state(model)) != engine.spec.weights_digest
    assert make_engine(model).spec.fingerprint() != engine.spec.fingerprint()


def test_spec_validates_the_digest():
    spec = init(CFG, seed=0).cache_spec()
    with pytest.raises(ValueError, match=r"weights_digest='XYZ' must be None or 32 lowercase hex"):
        dataclasses.replace(spec, weights_digest="XYZ")
    with pytest.raises(hw.WeightsDigestError, match=r"\['bad'\] is a object"):
        weights_digest({"bad": object(), "w": jnp.ones(2)})


# ------------------------------------------------------------------ defect 1: never a wrong token
def test_store_written_by_other_weights_restores_nothing(seed0, seed1, tmp_path):
    """Regression (issue 11 #1): a seed-1 engine on a disk store written by seed-0 weights restored
    the store's tokens (same default model_id "unknown") and generated wrong tokens."""
    store = str(tmp_path / "store")
    writer = make_engine(seed0, disk=hkv.DiskTier(store))
    writer.generate([PROMPT], 1, return_logits=True)
    assert writer.evict_prefixes() == len(PROMPT) // 16
    writer.flush_disk()
    reader = make_engine(seed1, disk=hkv.DiskTier(store))
    abis = hkv.DiskTier(store).stats()["abis"]
    assert abis[writer.spec.fingerprint()]["blocks"] == len(PROMPT) // 16  # the store holds the prompt ...
    assert reader.spec.fingerprint() not in abis  # ... under the writer's weights only
    (g,) = reader.generate([PROMPT], 1, return_logits=True)
    assert g.plan.restored_tokens == 0 and g.plan.disk_tokens is None, g.plan
    tokens, logits = greedy_stateless(seed1, [PROMPT], 1)  # a cold run of the seed-1 weights
    assert g.tokens == tokens[0]
    assert np.abs(g.logits - logits[0]).max() < 1e-4


def test_warm_restart_with_other_weights_is_refused(seed0, seed1, tmp_path):
    """Regression (issue 11 #1): Engine.restore(path, other_weights) accepted a checkpoint saved with
    other weights (its logits were off by 0.69)."""
    engine = make_engine(seed0)
    engine.save(tmp_path / "ckpt")
    with pytest.raises(hc.EngineCheckpointError, match=r"ABI fingerprint mismatch.*weights_digest") as e:
        hkv.Engine.restore(tmp_path / "ckpt", seed1)
    assert engine.spec.fingerprint() in str(e.value)
    assert make_engine(seed1).spec.fingerprint() in str(e.value)
    back = hkv.Engine.restore(tmp_path / "ckpt", init(CFG, seed=0))  # the same weights, another object
    assert back.spec.fingerprint() == engine.spec.fingerprint()
