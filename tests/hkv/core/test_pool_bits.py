"""bfloat16 pools held as uint16 bit patterns on CPU (`CacheLayout.pool_bits`).

XLA:CPU widens a bfloat16 array to float32 around every in-place write into it: a step that wrote one
row into a bfloat16 pool converted the whole pool twice (a tiny Gemma 3 with 16K x 8 slots of pools took
~50 s for a 1000-token request, 0.5 s with the pools as uint16). The layout a CPU engine builds holds
them as uint16; the rows read back, the logits and the cached bits are those of a bfloat16 pool.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hkv
from hkv.core import kv_quant as kvq
from models import deepseek_v4, gemma3

FAMILIES = {
    "gemma3": lambda: gemma3.init(gemma3.tiny_config(), seed=5, dtype=jnp.bfloat16),
    "deepseek_v4": lambda: deepseek_v4.init(deepseek_v4.tiny_config(), seed=5, dtype=jnp.bfloat16),
}
CONFIG = hkv.CacheConfig(slots=2, max_context=256, page_size=16, prefix_records=8)


def _layouts(model) -> tuple[hkv.CacheLayout, hkv.CacheLayout]:
    spec = model.cache_spec(block_tokens=16)
    return hkv.CacheLayout(spec, CONFIG), hkv.CacheLayout(spec, CONFIG, pool_bits=False)


def _run(model, layout, prompt, new, **options):
    """Prefill `prompt` into a claimed slot, then `new` greedy decode steps: (cache, logits of every step)."""
    cache, slot, status = hkv.transitions.claim_slot(layout, hkv.init_cache(layout))
    assert int(status) == 0
    step = jax.jit(lambda cache, toks, n: model.cached_step(layout, cache, toks, slot[None], n, **options))
    cache, logits, status = step(cache, jnp.asarray([prompt], jnp.int32), jnp.array([len(prompt)]))
    assert int(status) == 0
    out = [np.asarray(logits[0, len(prompt) - 1])]
    for _ in range(new):
        tok = jnp.argmax(logits[:, -1 if logits.shape[1] == 1 else len(prompt) - 1], axis=-1).astype(jnp.int32)
        cache, logits, status = step(cache, tok[:, None], jnp.array([1]))
        assert int(status) == 0
        out.append(np.asarray(logits[0, 0]))
    return cache, np.stack(out)


def test_a_cpu_layout_holds_bfloat16_pools_as_uint16_and_other_dtypes_as_they_are():
    model = FAMILIES["gemma3"]()
    bits, plain = _layouts(model)
    assert jax.default_backend() == "cpu" and bits.pool_bits and not plain.pool_bits
    assert bits.pool_dtype == np.uint16 and plain.pool_dtype == jnp.bfloat16
    assert {g.pool.dtype for g in hkv.init_cache(bits).groups} == {np.dtype(np.uint16)}
    assert {g.pool.dtype for g in hkv.init_cache(plain).groups} == {np.dtype(jnp.bfloat16)}
    f32 = hkv.CacheLayout(gemma3.init(gemma3.tiny_config(), seed=5).cache_spec(block_tokens=16), CONFIG)
    assert f32.pool_bits and f32.pool_dtype == np.float32  # only bfloat16 rows change
    assert memory_bytes(bits) == memory_bytes(plain)
    with pytest.raises(ValueError, match="pool_bits=1 must be True, False or None"):
        hkv.CacheLayout(bits.spec, CONFIG, pool_bits=1)


def memory_bytes(layout) -> int:
    return sum(int(np.prod(g.pool.shape)) * g.pool.dtype.itemsize for g in hkv.init_cache(layout).groups)


def test_to_pool_and_from_pool_keep_every_bit_pattern():
    x = jnp.asarray(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)).view(jnp.bfloat16)  # NaNs, infs, -0
    stored = kvq.to_pool(x, np.uint16)
    assert stored.dtype == np.uint16
    np.testing.assert_array_equal(np.asarray(stored), np.arange(1 << 16, dtype=np.uint32).astype(np.uint16))
    back = kvq.from_pool(stored, jnp.bfloat16)
    assert back.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(back).view(np.uint16), np.asarray(stored))
    assert kvq.to_pool(x, jnp.bfloat16).dtype == jnp.bfloat16  # a bfloat16 pool takes the rows as they are
    packed = jnp.arange(8, dtype=jnp.uint8)  # an FP8 cache's packed rows pass through unchanged
    assert kvq.from_pool(packed, jnp.uint8) is packed


# DeepSeek-V4's uint16 pools are checked against its stateless forward in the fast suite
# (test_numerical_contract.py); the bfloat16 layout beside them is the slow half of this check.
BOTH = ["gemma3", pytest.param("deepseek_v4", marks=pytest.mark.slow)]


@pytest.mark.parametrize("family", BOTH)
def test_uint16_pools_give_the_bits_of_bfloat16_pools(family):
    """Prefill and decode (jnp reference) through either layout: the same logits bit for bit, and pools
    holding the same bits."""
    model = FAMILIES[family]()
    prompt = np.random.default_rng(3).integers(0, model.vocab_size, 37).tolist()
    bits, plain = _layouts(model)
    cache_b, logits_b = _run(model, bits, prompt, 4)
    cache_p, logits_p = _run(model, plain, prompt, 4)
    np.testing.assert_array_equal(logits_b.view(np.uint32), logits_p.view(np.uint32))
    for gb, gp in zip(cache_b.groups, cache_p.groups, strict=True):
        assert gb.pool.dtype == np.uint16 and gp.pool.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(gb.pool), np.asarray(gp.pool).view(np.uint16))


def test_the_pallas_decode_kernels_read_a_uint16_pool_as_its_bfloat16_rows():
    """The decode kernels (Pallas, interpreted) over a uint16 pool's bfloat16 view: the reference's bits."""
    model = FAMILIES["gemma3"]()
    prompt = np.random.default_rng(4).integers(0, model.vocab_size, 21).tolist()
    bits, _ = _layouts(model)
    _, ref = _run(model, bits, prompt, 2)
    _, kern = _run(model, bits, prompt, 2, kernel_backend="gpu", interpret=True)
    np.testing.assert_array_equal(kern.view(np.uint32), ref.view(np.uint32))


def _materialized_float_shapes(hlo: str) -> set[str]:
    """The float array shapes ("f32[2,48,16,64]") that instructions outside fused computations yield:
    what a compiled program materializes (a fused computation's values exist only element by element)."""
    fused = set(re.findall(r"calls=(%[\w.\-]+)", hlo))
    out, name = set(), None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?(%[\w.\-]+) ", line)
        if head and line.rstrip().endswith("{"):
            name = head.group(1)
            continue
        if name is not None and name not in fused:
            out.update(re.findall(r"= ((?:f32|bf16|f16)\[[\d,]+\])", line))
    return out


@pytest.mark.parametrize("family", BOTH)  # every kind's rows are written by `transitions.put_rows`
def test_a_step_writes_its_rows_without_widening_a_whole_pool(family):
    """Regression: with bfloat16 pools every row written converted the whole pool to float32 and back
    (a fusion yielding a bfloat16 copy of the pool). The compiled prefill chunk and decode step of a CPU
    layout materialize no float array of a pool's shape."""
    model = FAMILIES[family]()
    layout, _ = _layouts(model)
    cache = hkv.init_cache(layout)
    pools = {",".join(map(str, g.pool.shape)) for g in cache.groups}
    for chunk in (16, 1):
        step = jax.jit(lambda c, t: model.cached_step(layout, c, t, jnp.array([1]), jnp.array([t.shape[1]])))
        hlo = step.lower(cache, jnp.zeros((1, chunk), jnp.int32)).compile().as_text()
        widened = {s for s in _materialized_float_shapes(hlo) if s.split("[")[1].rstrip("]") in pools}
        assert not widened, f"a {chunk}-token step materializes pool-shaped float arrays {sorted(widened)}"
