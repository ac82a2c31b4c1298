"""DeepSeek-V4's hyper-connections: the Sinkhorn-Knopp iterations run as a loop on CPU and written out
on GPU / TPU (issue 46: a loop there is a kernel launch per op per iteration and a device-to-host test
of its condition, 8 loops per token of the tiny model), with the same bits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hkv import numerics
from models.deepseek_v4 import tiny_config
from models.deepseek_v4.model import init

CFG = tiny_config()


def _hc():
    return init(CFG, 0).layers[1].hc_attn


def test_sinkhorn_written_out_is_the_loop_bit_for_bit():
    hc = _hc()
    n = CFG.hc_mult
    comb = jnp.asarray(np.random.default_rng(0).uniform(0.01, 1.0, (3, 5, n, n)), jnp.float32)
    loop = numerics.jit(lambda c: hc.sinkhorn(c, unroll=False))(comb)
    written = numerics.jit(lambda c: hc.sinkhorn(c, unroll=True))(comb)
    np.testing.assert_array_equal(np.asarray(loop).view(np.uint32), np.asarray(written).view(np.uint32))
    # doubly stochastic up to eps after the iterations
    np.testing.assert_allclose(np.asarray(loop).sum(-2), 1.0, atol=1e-3)


def test_the_gpu_and_tpu_programs_have_no_sinkhorn_loop():
    """Lowered for each platform here (no device needed): CPU keeps the loop, CUDA and TPU have none."""
    hc = _hc()
    streams = jnp.ones((2, 1, CFG.hc_mult, CFG.hidden_size), jnp.float32)
    traced = jax.jit(lambda s: hc(s)).trace(streams)
    text = {p: traced.lower(lowering_platforms=(p,)).as_text() for p in ("cpu", "cuda", "tpu")}
    assert "stablehlo.while" in text["cpu"]
    assert "stablehlo.while" not in text["cuda"] and "stablehlo.while" not in text["tpu"]
