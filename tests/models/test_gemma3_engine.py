"""Gemma 3 through hkv: the cached path (`models.gemma3.cached`) equals the stateless forward.

Chunked prefill + decode through `hkv.Engine` give the stateless greedy tokens (logits within 1e-4) for a
5:1 sliding:full GQA config (10 query heads on 2 KV heads) and an MQA config with window 8; decode through
the Pallas kernels in the interpreter agrees; warm requests restore shared prefixes from kept snapshots
(device) and from the disk tier, and still give exactly the cold engine's tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hkv
from hkv.core import transitions
from models import gemma3
from models.gemma3 import FULL, SLIDING, tiny_config

from ..oracle import oracle_for

BT = 16
NEW = 3
GQA = tiny_config(num_attention_heads=10, num_key_value_heads=2)  # 5:1 layers, window 16, 5 q heads per kv head
MQA = tiny_config(
    num_hidden_layers=4,
    num_key_value_heads=1,
    sliding_window=8,
    layer_types=(SLIDING, SLIDING, FULL, SLIDING),
)
RNG = np.random.default_rng(7)
PROMPTS = [RNG.integers(0, GQA.vocab_size, n).tolist() for n in (83, 41)]
BASE = RNG.integers(0, GQA.vocab_size, 150).tolist()  # the shared prefix of the prefix-cache tests


@pytest.fixture(scope="module")
def gqa():
    return gemma3.init(GQA, seed=1)


@pytest.fixture(scope="module")
def mqa():
    return gemma3.init(MQA, seed=2)


@pytest.fixture(scope="module")
def cold(gqa):
    """The GQA model in an engine without the prefix cache (every request computed from scratch)."""
    return hkv.Engine(
        gqa, hkv.CacheConfig(slots=2, max_context=192, page_size=8, prefix_records=0), block_tokens=BT, prefill_chunk=7
    )


def assert_exact(model, prompts, gens, new=NEW):
    """The generations equal the stateless greedy oracle (its forward compiled once per model and
    shared by every test: `tests.oracle`)."""
    tokens, logits = oracle_for(model, pad_to=192)(prompts, new)
    for g, t, lg in zip(gens, tokens, logits, strict=True):
        assert g.tokens == t
        assert g.logits.shape == (new, model.vocab_size) and g.logits.dtype == np.float32
        assert np.abs(g.logits - lg).max() < 1e-4


def test_protocol_and_cache_spec(gqa, mqa):
    assert isinstance(gqa, hkv.CachedModel) and gqa.vocab_size == GQA.vocab_size
    spec = gqa.cache_spec(block_tokens=BT, model_id="tiny")
    assert spec.dtype == "float32" and spec.block_tokens == BT and spec.model_id == "tiny"
    assert [layer.window for layer in spec.layers] == [16] * 5 + [None]
    assert {(layer.num_kv_heads, layer.head_dim, layer.shared_kv) for layer in spec.layers} == {(2, 16, False)}
    assert [layer.window for layer in mqa.cache_spec().layers] == [8, 8, None, 8]
    assert {layer.num_kv_heads for layer in mqa.cache_spec().layers} == {1}
    assert gemma3.init(tiny_config(), 0, dtype="bfloat16").cache_spec().dtype == "bfloat16"


def test_gqa_cold_engine_equals_stateless(gqa, cold):
    gens = cold.generate(PROMPTS, NEW, return_logits=True)
    assert_exact(gqa, PROMPTS, gens)
    assert set(cold.compilations.values()) == {1} and len(cold.compilations) == 2
    hkv.check_invariants(cold.layout, cold.cache)


# Prefill chunk sizes: GQA 7 (the cold fixture: below and not dividing the window of 16) and 32 (the
# prefix-cache engine below: two windows per chunk); MQA 5 (below the window of 8) and 24 (three windows,
# with the decode through the Pallas kernels below).
# The MQA engine also runs prefill in read sizes 16 and 48 (of max_context 128): its full-attention
# layer reads that many past rows while the prompt is short (hkv.Step.read_tokens).
def test_mqa_chunked_prefill_and_decode_equal_stateless(mqa):
    engine = hkv.Engine(
        mqa,
        hkv.CacheConfig(slots=2, max_context=128, page_size=8, prefix_records=0),
        prefill_chunk=5,
        read_buckets=(16, 48),
    )
    assert_exact(mqa, PROMPTS, engine.generate(PROMPTS, NEW, return_logits=True))
    assert {n for n in engine.compilations if n.startswith("prefill")} == {
        "prefill[1x5@16]+logits",
        "prefill[1x5@48]+logits",
        "prefill[1x5]+logits",
    }
    hkv.check_invariants(engine.layout, engine.cache)


def test_a_decode_step_reads_its_read_bound_not_max_context(gqa):
    """The full-attention layer's decode reads the rows of `read_tokens` tokens, not max_context's (a
    conversation of 41 tokens in a cache of 1024 read all 1024 positions per token): far fewer flops,
    logits and cache bit for bit those of the unbounded step."""
    layout = hkv.CacheLayout(gqa.cache_spec(), hkv.CacheConfig(slots=2, max_context=1024, page_size=8))
    cache = hkv.init_cache(layout)
    cache, slot, _ = transitions.claim_slot(layout, cache)
    step = jax.jit(gqa.cached_step, static_argnums=0, static_argnames="read_tokens")
    prompt = jnp.asarray([PROMPTS[1][:40]], jnp.int32)
    cache, _, status = step(layout, cache, prompt, slot[None], jnp.asarray([40]))
    tok, n = jnp.asarray([[PROMPTS[1][40]]], jnp.int32), jnp.asarray([1])
    bounded, full = step(layout, cache, tok, slot[None], n, read_tokens=64), step(layout, cache, tok, slot[None], n)
    assert int(status) == int(bounded[2]) == int(full[2]) == hkv.Status.OK
    for a, b in zip(jax.tree.leaves(bounded[:2]), jax.tree.leaves(full[:2]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def flops(**kw):
        return step.lower(layout, cache, tok, slot[None], n, **kw).cost_analysis()["flops"]

    assert flops(read_tokens=64) < 0.7 * flops()  # 1.6M vs 2.5M here; equal if the bound were ignored


def test_decode_through_the_pallas_kernels_in_the_interpreter(mqa):
    # the decode attention (gqa_decode_attention, MQA rows) forced to its Pallas GPU kernel in the
    # interpreter on CPU: the same tokens and logits as the stateless forward (and the jnp reference above)
    engine = hkv.Engine(
        mqa,
        hkv.CacheConfig(slots=2, max_context=128, page_size=8, prefix_records=0),
        prefill_chunk=24,
        kernel_options={"kernel_backend": "gpu", "interpret": True},
    )
    assert_exact(mqa, PROMPTS, engine.generate(PROMPTS, NEW, return_logits=True))


def diverge(k: int, tail: int = 5, seed: int = 0) -> list[int]:
    """BASE's first k tokens, then `tail` tokens that differ from BASE right at position k."""
    rest = np.random.default_rng(100 + seed).integers(0, GQA.vocab_size, tail).tolist()
    if k < len(BASE) and rest[0] == BASE[k]:
        rest[0] = (rest[0] + 1) % GQA.vocab_size
    return BASE[:k] + rest


@pytest.fixture(scope="module")
def warm(gqa, tmp_path_factory):
    """A prefix-caching engine with a disk tier that has run BASE once (records at every block boundary,
    snapshots kept every 4 blocks and at the request's end: at 64, 128 and 144 tokens)."""
    config = hkv.CacheConfig(slots=2, max_context=192, page_size=8)
    layout = hkv.CacheLayout(gqa.cache_spec(block_tokens=BT), config)
    pages = tuple(4 * layout.reserved_pages(g) for g in range(len(layout.groups)))
    engine = hkv.Engine(
        gqa,
        hkv.CacheConfig(slots=2, max_context=192, page_size=8, pool_pages=pages, prefix_records=64),
        block_tokens=BT,
        prefill_chunk=32,
        retention=hkv.RetentionPolicy(every_n_blocks=4),
        disk=hkv.DiskTier(str(tmp_path_factory.mktemp("gemma3_disk") / "tier")),
    )
    (g,) = engine.generate([BASE], NEW, return_logits=True)
    assert g.plan.restored_tokens == 0
    assert_exact(gqa, [BASE], [g])
    return engine


# k: where the warm prompt leaves BASE (block boundaries and not); hit: BASE blocks it shares;
# restored: the longest kept snapshot within them (full-attention layers have no window rebuild; 144,
# BASE's last boundary, keeps its snapshot though its last prefill chunk crossed it mid-chunk)
@pytest.mark.parametrize(
    "k, hit, restored",
    [(20, 16, 0), (64, 64, 64), (70, 64, 64), (101, 96, 64), (137, 128, 128), (150, 144, 144)],
)
def test_warm_prefix_restores_are_exact(gqa, cold, warm, k, hit, restored):
    prompt = diverge(k, seed=k)
    (g,) = warm.generate([prompt], NEW, return_logits=True)
    assert g.plan.hash_hit_tokens == hit and g.plan.restored_tokens == restored, g.plan
    assert g.plan.reason == (None if hit == restored else "swa_missing")
    assert g.plan.window_recomputed is None and g.plan.disk_tokens is None
    (c,) = cold.generate([prompt], NEW, return_logits=True)
    assert g.tokens == c.tokens and np.abs(g.logits - c.logits).max() < 1e-4
    hkv.check_invariants(warm.layout, warm.cache)


def test_restore_from_disk_after_device_eviction(gqa, cold, warm):
    assert warm.write_through() > 0
    warm.flush_disk()
    assert warm.evict_prefixes() > 0
    prompt = diverge(133, seed=1)
    (g,) = warm.generate([prompt], NEW, return_logits=True)
    assert g.plan.restored_tokens == 128 and g.plan.disk_tokens == (0, 128), g.plan
    (c,) = cold.generate([prompt], NEW, return_logits=True)
    assert g.tokens == c.tokens and np.abs(g.logits - c.logits).max() < 1e-4
    assert warm.stats()["cache"]["prefix_disk_restored_tokens"] >= 128
    hkv.check_invariants(warm.layout, warm.cache)


def test_bfloat16_prefill_attention_accumulates_in_float32():
    """Regression: hkv's prefill attention computed bf16 scores; the logits of the prefill's last position
    were 0.0061 / 0.0068 off the stateless forward (which accumulates scores in f32), now 0.0020 / 0.0039.
    (Decode steps stay within bf16 rounding of it, ~0.008, either way.)"""
    model = gemma3.init(tiny_config(), 0, dtype="bfloat16")
    prompts = [RNG.integers(0, GQA.vocab_size, n).tolist() for n in (70, 41)]
    engine = hkv.Engine(
        model, hkv.CacheConfig(slots=2, max_context=128, page_size=8, prefix_records=0), prefill_chunk=16
    )
    gens = engine.generate(prompts, 4, return_logits=True)
    tokens, logits = gemma3.greedy_stateless(model, prompts, 4)
    assert [g.tokens for g in gens] == tokens
    prefill = [
        float(np.abs(g.logits[0] - np.asarray(lg, np.float32)[0]).max()) for g, lg in zip(gens, logits, strict=True)
    ]
    assert max(prefill) < 0.005, prefill
    assert (
        max(float(np.abs(g.logits - np.asarray(lg, np.float32)).max()) for g, lg in zip(gens, logits, strict=True))
        < 0.02
    )
