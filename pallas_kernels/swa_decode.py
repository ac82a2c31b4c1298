"""Sliding-window decode attention over a paged pool of shared K=V rows, with per-head sinks.

One new token per sequence sits at absolute position t = lengths[b] - 1 (`lengths` counts tokens
including it; its K=V row is already written). Query head h attends to the rows at positions p with
t - window < p <= t, in one softmax whose denominator also holds exp(sinks[h]).

Layout (the window is addressed by absolute position through the page table):

    q:                 [batch, num_heads, head_dim]          bf16 | f32
    window_pool:       [num_pages, page_size, head_dim]      same dtype as q (or stacked over
                                                             layers, see `stacked_pools`)
    window_page_table: int32[batch, pages_per_seq]
    lengths:           int32[batch]
    sinks:             f32[num_heads] | None

Position p of sequence b lives in physical page `window_page_table[b, (p // page_size) %
pages_per_seq]` at row `p % page_size`. If the table covers the whole context the modulo does
nothing; if it has only R >= cdiv(window - 1, page_size) + 1 entries it is a ring of R pages that the
cache rewrites as the window slides. Either way the kernel reads only the (at most
cdiv(window - 1, page_size) + 1) pages that overlap [t - window + 1, t], and of those only the rows
inside the window; page-table entries of other logical pages are never read and may hold anything.
A sequence with lengths[b] == 0 (an empty batch slot) reads nothing and gets zeros.

The kernels (GPU and TPU) are `window_decode`'s, which the HCA and CSA decode attentions share.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels import window_decode


@functools.partial(jax.jit, static_argnames=("window", "scale", "backend", "interpret"))
def swa_decode_attention(
    q: jax.Array,
    window_pool: jax.Array,
    window_page_table: jax.Array,
    lengths: jax.Array,
    sinks: jax.Array | None,
    *,
    window: int,
    window_layer: int | jax.Array | None = None,
    scale: float | None = None,
    backend: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Sliding-window decode attention with sinks over a paged, shared K=V pool.

    Args:
      q: [batch, num_heads, head_dim] queries of the newest token of each sequence.
      window_pool: [num_pages, page_size, head_dim], q.dtype; K=V rows by absolute position. Or
        [layers, num_pages, page_size, head_dim] stacked, with `window_layer` set.
      window_page_table: int32[batch, pages_per_seq], pages_per_seq >= cdiv(window - 1,
        page_size) + 1; logical page i at entry i % pages_per_seq (a ring if it is short).
      lengths: int32[batch] tokens per sequence including the new one (0 = empty slot).
      sinks: f32[num_heads] per-head sink logits, or None for no sink.
      window: attended rows, the new token's included (DeepSeek-V4: 128).
      window_layer: layer of a stacked window_pool (int or int32 scalar, may be traced).
      scale: logit scale; None = head_dim ** -0.5.
      backend: "gpu" | "tpu" | "reference" | None (auto, see `pallas_kernels.dispatch`).
      interpret: run the Pallas kernel in the interpreter (CPU testing).

    Returns:
      [batch, num_heads, head_dim] in q.dtype.
    """
    return window_decode.window_decode_attention(
        q,
        window_pool,
        window_page_table,
        lengths,
        sinks,
        window=window,
        window_layer=window_layer,
        scale=scale,
        backend=backend,
        interpret=interpret,
    )


def swa_decode_attention_reference(
    q, window_pool, window_page_table, lengths, sinks, *, window: int, scale: float | None = None
) -> jax.Array:
    """jnp reference of `swa_decode_attention`: same arguments and result, no validation; computed in
    `pallas_kernels.numerics`' order (the numerical contract: equal to hkv's prefill and the stateless
    forward bit for bit)."""
    return window_decode.window_decode_attention_reference(
        q, window_pool, window_page_table, lengths, sinks, window=window, scale=scale
    )
