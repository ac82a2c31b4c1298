"""Online softmax with per-head sinks over blocks of K=V rows: the shared body of the decode attentions.

DeepSeek-V4 attention has one shared K=V head, many query heads and a per-head sink logit that joins
the softmax denominator only (a virtual key whose value is zero). Every decode attention here
(sliding window, HCA, CSA) is one softmax over a union of row sets, so the kernels fold blocks of
gathered rows into one running state:

    m: [heads, 1] f32   running max of all logits seen, the sink included
    l: [heads, 1] f32   running sum of exp(logit - m), the sink included
    o: [heads, D] f32   running sum of exp(logit - m) * row

The state starts at the sink (m = sink, l = 1, o = 0), so the sink needs no special final step,
and the result is o / l. A sink of -inf means "no sink" (m = -inf, l = 0). A fold whose logits are
all masked leaves the state unchanged, so blocks past the end of a range cost no correctness care.

These functions are plain jnp on values; they lower with both Triton (GPU) and Mosaic (TPU) and
run in the Pallas interpreter. Callers guarantee that rows of `kv` outside `valid` hold finite values
(zeros from a masked load, or real rows), so masked columns contribute exactly 0 and never NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class SoftmaxState(NamedTuple):
    """The running state of an online softmax over the rows folded so far (see the module docstring)."""

    o: jax.Array  # [heads, D] f32
    m: jax.Array  # [heads, 1] f32
    l: jax.Array  # [heads, 1] f32


def init_state(sinks: jax.Array, head_dim: int) -> SoftmaxState:
    """The state after seeing only the sink logits `sinks` ([heads, 1] f32, -inf = no sink)."""
    sinks = sinks.astype(jnp.float32)
    l = jnp.where(sinks == -jnp.inf, 0.0, 1.0).astype(jnp.float32)
    o = jnp.zeros((sinks.shape[0], head_dim), jnp.float32)
    return SoftmaxState(o=o, m=sinks, l=l)


def dot_precision(dtype) -> lax.Precision:
    """The `lax.dot_general` precision for operands of `dtype`: f32 pools get true f32 products (HIGHEST,
    not TF32); bf16 uses the native bf16 x bf16 -> f32 path (DEFAULT)."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def fold_block(
    state: SoftmaxState,
    q: jax.Array,  # [heads, D]   query dtype (== kv dtype)
    kv: jax.Array,  # [block, D]  rows, key and value at once
    valid: jax.Array,  # [1, block] bool; False columns are not part of the softmax
    scale: float,
) -> SoftmaxState:
    """Folds one block of K=V rows into the running softmax state: `fold_block_kv` with k = v = kv."""
    return fold_block_kv(state, q, kv, kv, valid, scale)


def fold_block_kv(
    state: SoftmaxState,
    q: jax.Array,  # [heads, D]   query dtype (== k, v dtype)
    k: jax.Array,  # [block, D]   keys
    v: jax.Array,  # [block, D]   values (pass k again for K=V rows)
    valid: jax.Array,  # [1, block] bool; False columns are not part of the softmax
    scale: float,
    softcap: float | None = None,
) -> SoftmaxState:
    """`fold_block` with separate keys and values and optional logit soft-capping.

    With `softcap` the scaled logits become softcap * tanh(logits / softcap) before the softmax
    (Gemma-style); the sink logits in the state are not capped.
    """
    precision = dot_precision(k.dtype)
    logits = (
        lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32) * scale
    )  # [heads, block]
    if softcap is not None:
        logits = softcap * jnp.tanh(logits * (1.0 / softcap))
    logits = jnp.where(valid, logits, -jnp.inf)
    m_next = jnp.maximum(state.m, jnp.max(logits, axis=1, keepdims=True))  # [heads, 1]
    # All -inf so far (no sink, nothing valid yet): shift by 0 so exp() gives 0, not NaN.
    m_shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    alpha = jnp.exp(state.m - m_shift)  # [heads, 1]
    p = jnp.exp(logits - m_shift)  # [heads, block]
    l_next = alpha * state.l + jnp.sum(p, axis=1, keepdims=True)
    pv = lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )  # [heads, D]
    return SoftmaxState(o=alpha * state.o + pv, m=m_next, l=l_next)


def finalize(state: SoftmaxState, dtype) -> jax.Array:
    """o / l in `dtype`; a head that saw nothing (no sink, no valid row) gets zeros."""
    l = jnp.where(state.l == 0.0, 1.0, state.l)
    return (state.o / l).astype(dtype)


# ----------------------------------------------------------------------------------------------
# Reference (plain jnp): the same softmax written the direct way, used by every op's reference.
# ----------------------------------------------------------------------------------------------
def attend_rows_reference(
    q: jax.Array,  # [batch, heads, D]
    rows: jax.Array,  # [batch, n, D]   K = V rows; invalid rows may hold anything (even NaN)
    valid: jax.Array,  # bool[batch, n]
    sinks: jax.Array | None,  # f32[heads] or None (no sink)
    scale: float,
) -> jax.Array:
    """softmax([q.k_j * scale for valid j] ++ [sink_h]) @ [v_j] ++ [0], all in f32; q.dtype out."""
    batch, heads, _ = q.shape
    precision = dot_precision(rows.dtype)
    rows = jnp.where(valid[..., None], rows, jnp.zeros((), rows.dtype))
    logits = jnp.einsum("bhd,bnd->bhn", q, rows, precision=precision, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(valid[:, None, :], logits, -jnp.inf)
    if sinks is None:
        sink = jnp.full((batch, heads, 1), -jnp.inf, jnp.float32)
    else:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], (batch, heads, 1))
    all_logits = jnp.concatenate([logits, sink], axis=-1)  # [batch, heads, n + 1]
    m = jnp.max(all_logits, axis=-1, keepdims=True)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    e = jnp.exp(all_logits - m)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    probs = e[..., :-1] / jnp.where(denom == 0.0, 1.0, denom)  # the sink's value is zero
    out = jnp.einsum("bhn,bnd->bhd", probs, rows.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return out.astype(q.dtype)
