"""RMS norms of DeepSeek-V4 (weighted, with a float32 weight; and unweighted), and its linear layers,
in the numerical contract's order (`hkv.numerics`)."""

from __future__ import annotations

import jax.numpy as jnp

from hkv import numerics


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """Weighted RMSNorm over the last axis: computed in float32, multiplied by the float32 `weight`,
    cast once to x.dtype at the end. x [..., D], weight [D]."""
    x32 = x.astype(jnp.float32)
    y = x32 * numerics.rms_scale(x32, eps)
    return numerics.mul(weight.astype(jnp.float32), y).astype(x.dtype)


def unweighted_rms_norm(x: jnp.ndarray, eps: float) -> jnp.ndarray:
    """RMSNorm without weight (`q_b_norm`, the hyper-connection input norm). x [..., D]."""
    x32 = x.astype(jnp.float32)
    inv = numerics.rms_scale(x32, eps)
    return numerics.mul(x, inv.astype(x.dtype))


def linear(x: jnp.ndarray, weight: jnp.ndarray) -> jnp.ndarray:
    """y = x @ weight.T with a PyTorch-layout weight [out, in]; x [..., in] -> [..., out] in x.dtype
    (`hkv.numerics.linear`: float32 accumulation, the same bits for any number of rows)."""
    return numerics.linear(x, weight)
