"""Random interleavings of admit / decode / release / evict (and indexer-version bumps) with the prefix
cache on tight pools: `check_invariants` holds after every round and no sequence's output changes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hkv
from hkv.core import prefix as px
from models.deepseek_v4 import init, tiny_config
from models.stateless import greedy_stateless

from .test_prefix import BT, make_engine

CFG = tiny_config()


@pytest.fixture(scope="module")
def model():
    return init(CFG, seed=3)


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])  # seed 1: make test-slow
def test_random_interleavings_keep_invariants_and_outputs(model, seed):
    rng = np.random.default_rng(seed)
    bases = [rng.integers(0, CFG.vocab_size, 200).tolist() for _ in range(3)]
    engine = make_engine(model, scale=1, records=24)
    restored = 0
    for _ in range(5):
        prompts = []
        for _ in range(int(rng.integers(1, 4))):
            base = bases[int(rng.integers(3))]
            prompts.append(
                base[: int(rng.integers(1, 200))] + rng.integers(0, CFG.vocab_size, int(rng.integers(1, 40))).tolist()
            )
        new = int(rng.integers(1, 4))
        gens = engine.generate(prompts, new, return_logits=True)
        tokens, logits = greedy_stateless(model, prompts, new, pad_to=256)
        for g, t, lg in zip(gens, tokens, logits, strict=True):
            assert g.tokens == t
            assert np.abs(g.logits - lg).max() < 1e-4
            assert g.plan.restored_tokens % BT == 0 and g.plan.restored_tokens <= g.plan.prompt_tokens - 1
            restored += g.plan.restored_tokens
        hkv.check_invariants(engine.layout, engine.cache)
        # random evictions: snapshots anywhere, whole records only where nothing alive extends them
        p = jax.device_get(engine.cache.prefix)
        alive = np.asarray(p.state) == px.RecordState.ALIVE
        parent = np.asarray(p.parent)
        has_child = np.zeros_like(alive)
        has_child[parent[alive & (parent >= 0)]] = True
        swa = alive & (rng.random(alive.shape) < 0.3)
        tail = alive & (rng.random(alive.shape) < 0.2)
        whole = alive & ~has_child & (rng.random(alive.shape) < 0.3)
        engine.cache = px.evict(engine.layout, engine.cache, jnp.asarray(swa), jnp.asarray(tail), jnp.asarray(whole))
        if rng.random() < 0.2:
            engine.cache = px.bump_indexer_version(engine.cache)
        hkv.check_invariants(engine.layout, engine.cache)
    assert restored > 0  # the workload really reused prefixes
