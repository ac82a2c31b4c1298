"""Manifold-constrained hyper-connections (mHC): the residual is `hc_mult` parallel streams.

Before a block the streams collapse into one input (`pre` weights); after it the block output is
expanded back (`post`) and added to the streams mixed by `comb`, a matrix projected towards the
doubly-stochastic manifold by Sinkhorn-Knopp iterations. All in float32, in the numerical contract's
order (`hkv.numerics`: fixed-order sums, settled products).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hkv import numerics
from models.placement import put

from .norms import unweighted_rms_norm


class HyperConnection(nnx.Module):
    """fn: float32[(2 + N) * N, N * hidden]; base: float32[(2 + N) * N]; scale: float32[3]."""

    def __init__(self, fn, base, scale, *, hc_mult: int, iters: int, eps: float, norm_eps: float):
        self.fn = nnx.Param(put(fn, jnp.float32))
        self.base = nnx.Param(put(base, jnp.float32))
        self.scale = nnx.Param(put(scale, jnp.float32))
        self.hc_mult = hc_mult
        self.iters = iters
        self.eps = eps
        self.norm_eps = norm_eps

    def __call__(self, streams: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
        """streams [B, T, N, hidden] -> (post f32[B, T, N], comb f32[B, T, N, N], collapsed [B, T, hidden])."""
        b, t, n, _ = streams.shape
        flat = unweighted_rms_norm(streams.reshape(b, t, -1).astype(jnp.float32), self.norm_eps)
        mixes = numerics.matmul(flat, self.fn.value.T)
        pre_w, post_w, comb_w = mixes[..., :n], mixes[..., n : 2 * n], mixes[..., 2 * n :]
        base = self.base.value
        pre_b, post_b, comb_b = base[:n], base[n : 2 * n], base[2 * n :]
        s = self.scale.value
        pre = numerics.sigmoid(numerics.mul(pre_w, s[0]) + pre_b) + self.eps
        post = 2 * numerics.sigmoid(numerics.mul(post_w, s[1]) + post_b)
        logits = numerics.mul(comb_w.reshape(b, t, n, n), s[2]) + comb_b.reshape(n, n)
        comb = numerics.softmax(logits, axis=-1) + self.eps
        comb = numerics.div(comb, numerics.fixed_sum(comb, axis=-2, keepdims=True) + self.eps)
        comb = jax.lax.platform_dependent(
            comb, cpu=lambda c: self.sinkhorn(c, unroll=False), default=lambda c: self.sinkhorn(c, unroll=True)
        )
        return post, comb, collapse(pre, streams)

    def sinkhorn(self, comb: jnp.ndarray, *, unroll: bool) -> jnp.ndarray:
        """The `iters - 1` Sinkhorn-Knopp iterations after the first column normalization (each a row
        then a column normalization) of comb f32[..., N, N]. unroll=False: a `fori_loop` (on CPU: 19
        unrolled iterations were ~25% of every compiled step's program); True: written out (on GPU /
        TPU: a loop is a launch per op per iteration and a device-to-host test of its condition, 8
        such loops per token of the tiny model; unrolled, the iterations fuse). The same bits."""

        def one(_, c):
            c = numerics.div(c, numerics.fixed_sum(c, axis=-1, keepdims=True) + self.eps)
            return numerics.div(c, numerics.fixed_sum(c, axis=-2, keepdims=True) + self.eps)

        return jax.lax.fori_loop(0, self.iters - 1, one, comb, unroll=unroll)


def collapse(pre: jnp.ndarray, streams: jnp.ndarray) -> jnp.ndarray:
    """sum_j pre[j] * streams[j] in float32, cast to the streams' dtype. [B,T,N], [B,T,N,D] -> [B,T,D]."""
    return numerics.fixed_sum(pre[..., None] * streams.astype(jnp.float32), axis=2).astype(streams.dtype)


def merge(post: jnp.ndarray, comb: jnp.ndarray, block_out: jnp.ndarray, streams: jnp.ndarray) -> jnp.ndarray:
    """New streams = post ⊗ block_out + combᵀ · streams.  [B,T,N], [B,T,N,N], [B,T,D], [B,T,N,D] -> [B,T,N,D].
    The stream mix accumulates in float32 (`fixed_sum` over the N source streams), rounded once."""
    dt = streams.dtype
    expanded = numerics.mul(post.astype(dt)[..., None], block_out[..., None, :])
    comb_t = comb.astype(dt).astype(jnp.float32)[..., None]  # [B, T, N(j), N(k), 1]
    mixed = numerics.fixed_sum(comb_t * streams.astype(jnp.float32)[:, :, :, None, :], axis=2).astype(dt)
    return expanded + mixed


class HyperHead(nnx.Module):
    """Final collapse of the N streams before the output norm. fn [N, N*hidden], base [N], scale [1]."""

    def __init__(self, fn, base, scale, *, eps: float, norm_eps: float):
        self.fn = nnx.Param(put(fn, jnp.float32))
        self.base = nnx.Param(put(base, jnp.float32))
        self.scale = nnx.Param(put(scale, jnp.float32))
        self.eps = eps
        self.norm_eps = norm_eps

    def __call__(self, streams: jnp.ndarray) -> jnp.ndarray:
        b, t, _, _ = streams.shape
        flat = unweighted_rms_norm(streams.reshape(b, t, -1).astype(jnp.float32), self.norm_eps)
        mixes = numerics.matmul(flat, self.fn.value.T)
        pre = numerics.sigmoid(numerics.mul(mixes, self.scale.value[0]) + self.base.value) + self.eps
        return collapse(pre, streams)
