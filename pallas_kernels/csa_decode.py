"""Sparse decode attention for CSA layers: the top-k selected compressed entries + the SWA window.

Compressed sparse attention (DeepSeek-V4 `compressed_sparse_attention`, ratio m = 4) gives each query
a top-k vector of compressed-entry indices chosen by the lightning indexer (`indexer_topk`), -1 where
there is no pick. The new token at position t = lengths[b] - 1 attends, in ONE softmax with its
per-head sink, to the window rows t - window < p <= t and to the selected entries. Only the selected
entries are read: the decode cost is window + k rows whatever the context length.

Layout: as `hca_decode` (window pool + its table, compressed pool + its table, n_compressed), plus

    topk_indices: int32[batch, k]   entry indices into the compressed pool, -1 = invalid

An index is skipped when it is -1 (or any negative value) or not below min(n_compressed[b],
lengths[b] // compress_ratio, capacity): the indexer only emits causal indices, and this makes a
stale or corrupt one harmless instead of an out-of-bounds read. Duplicated indices are attended as
many times as they appear (the indexer never emits duplicates).

The kernels are HCA's (`window_decode`) with the picks as an optional operand: the entry fold reads
the picks instead of every visible entry.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels import window_decode


@functools.partial(jax.jit, static_argnames=("window", "compress_ratio", "scale", "backend", "interpret"))
def csa_decode_attention(
    q: jax.Array,
    window_pool: jax.Array,
    window_page_table: jax.Array,
    lengths: jax.Array,
    sinks: jax.Array | None,
    compressed_pool: jax.Array,
    compressed_page_table: jax.Array,
    n_compressed: jax.Array,
    topk_indices: jax.Array,
    *,
    window: int,
    compress_ratio: int,
    window_layer: int | jax.Array | None = None,
    compressed_layer: int | jax.Array | None = None,
    scale: float | None = None,
    backend: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """CSA decode attention: one softmax over window rows, the selected compressed entries and sinks.

    Args:
      q, window_pool, window_page_table, lengths, sinks: as in `swa_decode_attention`.
      compressed_pool, compressed_page_table, n_compressed: as in `hca_decode_attention`.
      topk_indices: int32[batch, k] selected entries (`indexer_topk` output), -1 = none.
      window: sliding window rows (DeepSeek-V4: 128).
      compress_ratio: tokens per compressed entry m (DeepSeek-V4 CSA: 4).
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
        topk_indices,
        window=window,
        compress_ratio=compress_ratio,
        window_layer=window_layer,
        compressed_layer=compressed_layer,
        scale=scale,
        backend=backend,
        interpret=interpret,
    )


def csa_decode_attention_reference(
    q,
    window_pool,
    window_page_table,
    lengths,
    sinks,
    compressed_pool,
    compressed_page_table,
    n_compressed,
    topk_indices,
    *,
    window: int,
    compress_ratio: int,
    scale: float | None = None,
) -> jax.Array:
    """jnp reference of `csa_decode_attention`: same arguments and result, no validation; computed in
    `pallas_kernels.numerics`' order (window tiles, then the picks in their order)."""
    return window_decode.window_decode_attention_reference(
        q,
        window_pool,
        window_page_table,
        lengths,
        sinks,
        compressed_pool,
        compressed_page_table,
        n_compressed,
        topk_indices,
        window=window,
        compress_ratio=compress_ratio,
        scale=scale,
    )
