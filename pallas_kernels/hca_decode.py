"""Compressed decode attention for HCA layers: every visible compressed entry + the SWA window.

Heavily compressed attention (DeepSeek-V4 `heavily_compressed_attention`, ratio m = 128) keeps one
compressed K=V entry per m tokens. The new token at position t = lengths[b] - 1 attends, in ONE
softmax with its per-head sink, to the window rows t - window < p <= t and to the compressed entries
w < (t + 1) // m = lengths[b] // m.

Layout (the window part exactly as in `swa_decode`):

    q:                     [batch, num_heads, head_dim]       bf16 | f32
    window_pool:           [num_pages, page_size, head_dim]   q.dtype
    window_page_table:     int32[batch, pages_per_seq]
    lengths:               int32[batch]
    sinks:                 f32[num_heads] | None
    compressed_pool:       [c_num_pages, c_page_size, head_dim]  q.dtype; its own pool
    compressed_page_table: int32[batch, c_pages_per_seq]      entry w at logical page w // c_page_size
    n_compressed:          int32[batch]                       entries written for each sequence

Visible entries are w < min(n_compressed[b], lengths[b] // compress_ratio, c_pages_per_seq *
c_page_size): the cache's count, clamped by causality and by capacity, so a count that runs ahead
of the length (or past the table) can never expose an entry the query must not see. Only the pages
holding visible entries are read; the others' page-table entries may hold anything.

The kernels are `window_decode`'s: SWA's window, then the visible entries. CSA's kernel is the same
with the picks as an optional operand.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels import window_decode


@functools.partial(jax.jit, static_argnames=("window", "compress_ratio", "scale", "backend", "interpret"))
def hca_decode_attention(
    q: jax.Array,
    window_pool: jax.Array,
    window_page_table: jax.Array,
    lengths: jax.Array,
    sinks: jax.Array | None,
    compressed_pool: jax.Array,
    compressed_page_table: jax.Array,
    n_compressed: jax.Array,
    *,
    window: int,
    compress_ratio: int,
    window_layer: int | jax.Array | None = None,
    compressed_layer: int | jax.Array | None = None,
    scale: float | None = None,
    backend: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """HCA decode attention: one softmax over window rows, all visible compressed entries and sinks.

    Args:
      q, window_pool, window_page_table, lengths, sinks: as in `swa_decode_attention`.
      compressed_pool: [c_num_pages, c_page_size, head_dim], q.dtype; compressed K=V entries.
        Or [layers, c_num_pages, c_page_size, head_dim] stacked, with `compressed_layer` set.
      compressed_page_table: int32[batch, c_pages_per_seq]; entry w at logical page
        w // c_page_size.
      n_compressed: int32[batch] entries written per sequence.
      window: sliding window rows (DeepSeek-V4: 128).
      compress_ratio: tokens per compressed entry m (DeepSeek-V4 HCA: 128); entries
        w < lengths[b] // m are causally visible.
      window_layer, compressed_layer: layers of stacked pools (int or int32 scalar, may be traced).
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
        compressed_pool,
        compressed_page_table,
        n_compressed,
        window=window,
        compress_ratio=compress_ratio,
        window_layer=window_layer,
        compressed_layer=compressed_layer,
        scale=scale,
        backend=backend,
        interpret=interpret,
    )


def hca_decode_attention_reference(
    q,
    window_pool,
    window_page_table,
    lengths,
    sinks,
    compressed_pool,
    compressed_page_table,
    n_compressed,
    *,
    window: int,
    compress_ratio: int,
    scale: float | None = None,
) -> jax.Array:
    """jnp reference of `hca_decode_attention`: same arguments and result, no validation; computed in
    `pallas_kernels.numerics`' order (window tiles, then entry tiles)."""
    return window_decode.window_decode_attention_reference(
        q,
        window_pool,
        window_page_table,
        lengths,
        sinks,
        compressed_pool,
        compressed_page_table,
        n_compressed,
        window=window,
        compress_ratio=compress_ratio,
        scale=scale,
    )
