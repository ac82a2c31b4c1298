"""The FP8 KV cache through the engine (issue 47 item 3): a DeepSeek-V4 built with `kv_quant="fp8_e4m3"`
gives the stateless forward's bits (which rounds its K/V the same way) on every path — prefill in any
chunk, decode, a prefix restored from device memory, from the host tier and from disk — in bfloat16."""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import pytest

import hkv
from hkv.testing import check_model, force_route
from models import deepseek_v4, gemma3
from models.stateless import forward_fn, greedy_stateless

NEW = 6
BT = 16
CFG = deepseek_v4.tiny_config(index_head_dim=32, kv_quant="fp8_e4m3", kv_quant_tile=16)


@pytest.fixture(scope="module")
def model():
    return deepseek_v4.init(CFG, seed=11, dtype=jnp.bfloat16)


@pytest.fixture(scope="module")
def prompts(model):
    rng = np.random.default_rng(5)
    base = rng.integers(0, model.vocab_size, 70).tolist()
    return {"a": base[:45], "b": rng.integers(0, model.vocab_size, 29).tolist(), "warm": base}


@pytest.fixture(scope="module")
def reference(model, prompts):
    fwd = forward_fn(model)
    pad = max(len(p) for p in prompts.values()) + NEW
    return {k: greedy_stateless(model, [p], NEW, pad_to=pad, fwd=fwd) for k, p in prompts.items()}


def engine_of(model, **kw) -> hkv.Engine:
    cfg = hkv.CacheConfig(slots=2, max_context=128, page_size=16, prefix_records=32)
    return hkv.Engine(model, cfg, block_tokens=BT, **{"prefill_chunk": 16, **kw})


def assert_stateless(gens, names, reference, what):
    for g, name in zip(gens, names, strict=True):
        (want_t,), (want_l,) = reference[name]
        diff = np.argwhere(np.asarray(g.logits) != want_l)
        assert g.tokens == want_t and not len(diff), f"{what}, prompt {name}: differs first at {diff[:1].tolist()}"


def test_the_fp8_format_is_not_a_no_op(model):
    """The stateless forward with the unquantized cache format gives other logits: the rounding the
    tests below find on every path is really there."""
    plain = deepseek_v4.init(deepseek_v4.tiny_config(index_head_dim=32), seed=11, dtype=jnp.bfloat16)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (1, 40)), jnp.int32)
    assert not np.array_equal(np.asarray(model(tokens)), np.asarray(plain(tokens)))


@pytest.mark.parametrize("chunk", [16, pytest.param(32, marks=pytest.mark.slow)])
def test_every_path_gives_the_stateless_forwards_bits(model, prompts, reference, chunk):
    engine = engine_of(model, prefill_chunk=chunk)
    assert engine.layout.spec.kv_quant == hkv.KVQuant(tile=16, rope_dims=CFG.qk_rope_head_dim)
    assert all(g.pool.dtype == jnp.uint8 for g in engine.cache.groups)  # packed rows
    for call in range(2):  # the first call decodes through the prefill step, the second through the decode step
        engine.evict_prefixes()
        assert_stateless(engine.generate([prompts["a"]], NEW, return_logits=True), ["a"], reference, f"call {call}")
        time.sleep(0.5)
    gens = engine.generate([prompts["b"], prompts["a"]], NEW, return_logits=True)
    assert_stateless(gens, ["b", "a"], reference, "batch")
    (g,) = engine.generate([prompts["warm"]], NEW, return_logits=True)
    assert g.plan.restored_tokens >= 32, g.plan  # the shared prefix came from the device's prefix cache
    assert_stateless([g], ["warm"], reference, "warm from device")


@pytest.mark.parametrize("tier", ["disk", "host"])
def test_a_prefix_comes_back_exact_from_the_disk_and_host_tiers(model, prompts, reference, tier, tmp_path):
    disk = hkv.DiskTier(str(tmp_path / "store"))
    store = disk if tier == "disk" else hkv.TieredStore(hkv.HostTier(budget_bytes=64 << 20), disk)
    engine = engine_of(model, disk=store)
    engine.generate([prompts["a"]], NEW)
    assert engine.evict_prefixes() >= 2
    engine.flush_disk()
    if tier == "disk":  # a restarted process: an empty device cache on the same store
        engine = engine_of(model, disk=hkv.DiskTier(str(tmp_path / "store")))
    force_route(engine, "disk")
    (g,) = engine.generate([prompts["warm"]], NEW, return_logits=True)
    assert g.plan.disk_tokens is not None and g.plan.disk_tokens[1] >= 32, g.plan
    assert_stateless([g], ["warm"], reference, f"warm from {tier}")
    # (a restore checks each object's dtype and shape against `expected_objects`: uint8 rows, row_width wide)
    engine.close()
    store.close()


def test_gemma3_with_the_fp8_cache_gives_the_stateless_forwards_bits():
    """Gemma 3 (separate K and V, full-attention layers): the whole row quantized, a scale per head."""
    cfg = gemma3.tiny_config(kv_quant="fp8_e4m3", kv_quant_tile=16)
    model = gemma3.init(cfg, seed=11, dtype=jnp.bfloat16)
    rng = np.random.default_rng(6)
    base = rng.integers(0, cfg.vocab_size, 60).tolist()
    prompts = {"a": base[:37], "b": rng.integers(0, cfg.vocab_size, 21).tolist(), "warm": base}
    fwd = forward_fn(model)
    reference = {k: greedy_stateless(model, [p], NEW, pad_to=66, fwd=fwd) for k, p in prompts.items()}
    engine = engine_of(model)
    assert engine.layout.spec.kv_quant == hkv.KVQuant(tile=16)
    gens = engine.generate([prompts["a"], prompts["b"]], NEW, return_logits=True)
    assert_stateless(gens, ["a", "b"], reference, "batch")
    (g,) = engine.generate([prompts["warm"]], NEW, return_logits=True)
    assert g.plan.restored_tokens >= 32, g.plan
    assert_stateless([g], ["warm"], reference, "warm from device")
    with pytest.raises(gemma3.ConfigError, match=r"kv_quant_tile=12 must be a positive divisor of head_dim=16"):
        gemma3.tiny_config(kv_quant="fp8_e4m3", kv_quant_tile=12)


@pytest.mark.slow  # the Pallas interpreter; the dequantized views are the same ones the default path reads
def test_decode_through_the_pallas_kernels_reads_the_dequantized_pages(model, prompts, reference):
    """The Pallas GPU kernels (in the interpreter) read the step's pages dequantized
    (`hkv.core.kv_quant.dequantized_pages`): the same tokens as the stateless forward."""
    engine = engine_of(model, kernel_options={"kernel_backend": "gpu", "interpret": True})
    engine.decode_while_building = False  # every token after the first from the decode step
    (g,) = engine.generate([prompts["b"]], 3, return_logits=True)
    (want,), (want_logits,) = reference["b"]
    assert g.tokens == want[:3]
    assert np.abs(np.asarray(g.logits, np.float32) - want_logits[:3]).max() < 0.05  # Pallas' own order


@pytest.mark.slow  # ~2 min: every restore route of `hkv.testing.check_model`, both families
@pytest.mark.parametrize("family", ["deepseek_v4", "gemma3"])
def test_the_conformance_kit_passes_with_the_fp8_cache(family):
    if family == "deepseek_v4":
        model = deepseek_v4.init(CFG, seed=2, dtype=jnp.bfloat16)
    else:
        model = gemma3.init(gemma3.tiny_config(kv_quant="fp8_e4m3", kv_quant_tile=16), seed=2, dtype=jnp.bfloat16)
    report = check_model(model)
    assert report.max_abs_diff == 0.0 and "restore[disk]@48" in report.checks, report
