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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltr

from pallas_kernels import (
    dispatch,
    numerics,
    online_softmax,
    paged_folds_gpu,
    paged_folds_tpu,
    stacked_pools,
    swa_decode,
)
from pallas_kernels import index_math as im
from pallas_kernels import input_checks as checks


def visible_entries(lengths, n_compressed, compress_ratio: int, capacity: int):
    """int32[batch]: compressed entries the newest token may attend to."""
    causal = im.div(jnp.maximum(lengths, 0), compress_ratio)
    return jnp.clip(jnp.minimum(n_compressed, causal), 0, capacity)


# ----------------------------------------------------------------------------------------------
# GPU kernel (Triton lowering): one program per (sequence, block of query heads).
# ----------------------------------------------------------------------------------------------
def hca_decode_kernel_gpu(
    lengths_ref,  # int32[batch]                                      (whole array)
    n_visible_ref,  # int32[batch]                                    (whole array)
    window_page_table_ref,  # int32[batch, pages_per_seq]             (whole array)
    compressed_page_table_ref,  # int32[batch, c_pages_per_seq]       (whole array)
    window_pool_ref,  # [num_pages * page_size, head_dim]             (whole pool, rows)
    compressed_pool_ref,  # [c_num_pages * c_page_size, head_dim]     (whole pool, rows)
    q_ref,  # [block_h, head_dim]
    sinks_ref,  # f32[block_h, 1]
    out_ref,  # [block_h, head_dim]
    *,
    window: int,
    page_size: int,
    compressed_page_size: int,
    block_k: int,
    scale: float,
):
    b = pl.program_id(0)
    length = lengths_ref[b]
    q = q_ref[...]
    state = online_softmax.init_state(sinks_ref[...], q_ref.shape[1])
    state = paged_folds_gpu.fold_range(
        state,
        q,
        window_pool_ref,
        window_page_table_ref,
        b,
        jnp.maximum(length - window, 0),
        length,
        page_size=page_size,
        block_k=block_k,
        scale=scale,
    )
    state = paged_folds_gpu.fold_range(
        state,
        q,
        compressed_pool_ref,
        compressed_page_table_ref,
        b,
        0,
        n_visible_ref[b],
        page_size=compressed_page_size,
        block_k=block_k,
        scale=scale,
    )
    out_ref[...] = online_softmax.finalize(state, out_ref.dtype)


def _hca_decode_gpu(
    q,
    window_pool,
    window_page_table,
    lengths,
    sinks,
    compressed_pool,
    compressed_page_table,
    n_visible,
    *,
    window,
    scale,
    interpret,
    block_h=swa_decode.GPU_BLOCK_H,
    block_k=swa_decode.GPU_BLOCK_K,
    num_warps=4,
    num_stages=2,
):
    batch, num_heads, head_dim = q.shape
    num_pages, page_size, _ = window_pool.shape
    c_num_pages, c_page_size, _ = compressed_pool.shape
    q_padded, sinks_padded = swa_decode.pad_heads(q, sinks, block_h)
    whole = lambda shape: pl.BlockSpec(shape, lambda b, h: (0,) * len(shape))
    out = pl.pallas_call(
        functools.partial(
            hca_decode_kernel_gpu,
            window=window,
            page_size=page_size,
            compressed_page_size=c_page_size,
            block_k=block_k,
            scale=scale,
        ),
        grid=(batch, q_padded.shape[1] // block_h),
        in_specs=[
            whole(lengths.shape),
            whole(n_visible.shape),
            whole(window_page_table.shape),
            whole(compressed_page_table.shape),
            whole((num_pages * page_size, head_dim)),
            whole((c_num_pages * c_page_size, head_dim)),
            pl.BlockSpec((None, block_h, head_dim), lambda b, h: (b, h, 0)),
            pl.BlockSpec((block_h, 1), lambda b, h: (h, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_h, head_dim), lambda b, h: (b, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q_padded.shape, q.dtype),
        interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="hca_decode_attention",
    )(
        lengths,
        n_visible,
        window_page_table,
        compressed_page_table,
        window_pool.reshape(num_pages * page_size, head_dim),
        compressed_pool.reshape(c_num_pages * c_page_size, head_dim),
        q_padded,
        sinks_padded,
    )
    return out[:, :num_heads]


# ----------------------------------------------------------------------------------------------
# TPU kernel (Mosaic): one program per sequence, all heads; window pages then compressed pages are
# DMA'd (double-buffered) from HBM.
# ----------------------------------------------------------------------------------------------
def hca_decode_kernel_tpu(
    lengths_ref,  # SMEM int32[batch]                                 scalar prefetch
    n_visible_ref,  # SMEM int32[batch]                               scalar prefetch
    window_page_table_ref,  # SMEM int32[batch * pages_per_seq]       scalar prefetch (flattened)
    compressed_page_table_ref,  # SMEM int32[batch * c_pages_per_seq] scalar prefetch (flattened)
    window_pool_hbm_ref,  # HBM [num_pages, page_size, head_dim]
    compressed_pool_hbm_ref,  # HBM [c_num_pages, c_page_size, head_dim]
    q_ref,  # VMEM [num_heads, head_dim]
    sinks_ref,  # VMEM f32[num_heads, 1]
    out_ref,  # VMEM [num_heads, head_dim]
    window_buf,  # VMEM [2, page_size, head_dim]
    compressed_buf,  # VMEM [2, c_page_size, head_dim]
    sems,  # DMA semaphores [2]
    *,
    window: int,
    pages_per_seq: int,
    compressed_pages_per_seq: int,
    scale: float,
):
    b = pl.program_id(0)
    length = lengths_ref[b]
    q = q_ref[...]
    state = online_softmax.init_state(sinks_ref[...], q_ref.shape[1])
    state = paged_folds_tpu.fold_page_range(
        state,
        q,
        window_pool_hbm_ref,
        window_page_table_ref,
        b * pages_per_seq,
        jnp.maximum(length - window, 0),
        length,
        window_buf,
        sems,
        pages_per_seq=pages_per_seq,
        scale=scale,
    )
    state = paged_folds_tpu.fold_page_range(
        state,
        q,
        compressed_pool_hbm_ref,
        compressed_page_table_ref,
        b * compressed_pages_per_seq,
        0,
        n_visible_ref[b],
        compressed_buf,
        sems,
        pages_per_seq=compressed_pages_per_seq,
        scale=scale,
    )
    out_ref[...] = online_softmax.finalize(state, out_ref.dtype)


def _hca_decode_tpu(
    q,
    window_pool,
    window_page_table,
    lengths,
    sinks,
    compressed_pool,
    compressed_page_table,
    n_visible,
    *,
    window,
    scale,
    interpret,
):
    batch, num_heads, head_dim = q.shape
    _, page_size, _ = window_pool.shape
    _, c_page_size, _ = compressed_pool.shape
    pages_per_seq = window_page_table.shape[1]
    c_pages_per_seq = compressed_page_table.shape[1]
    return pl.pallas_call(
        functools.partial(
            hca_decode_kernel_tpu,
            window=window,
            pages_per_seq=pages_per_seq,
            compressed_pages_per_seq=c_pages_per_seq,
            scale=scale,
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(batch,),
            in_specs=[
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec((None, num_heads, head_dim), lambda b, *_: (b, 0, 0)),
                pl.BlockSpec((num_heads, 1), lambda b, *_: (0, 0)),
            ],
            out_specs=pl.BlockSpec((None, num_heads, head_dim), lambda b, *_: (b, 0, 0)),
            scratch_shapes=[
                pltpu.VMEM((2, page_size, head_dim), window_pool.dtype),
                pltpu.VMEM((2, c_page_size, head_dim), compressed_pool.dtype),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="hca_decode_attention",
    )(
        lengths,
        n_visible,
        window_page_table.reshape(-1),
        compressed_page_table.reshape(-1),
        window_pool,
        compressed_pool,
        q,
        swa_decode.sinks_column(sinks, num_heads, num_heads),
    )


# ----------------------------------------------------------------------------------------------
# Public function.
# ----------------------------------------------------------------------------------------------
def check_compressed_inputs(q, compressed_pool, compressed_page_table, n_compressed, compress_ratio, compressed_layer):
    """Validation shared by the HCA and CSA decode attentions."""
    batch, _, head_dim = q.shape
    checks.check_array(
        "compressed_pool",
        compressed_pool,
        rank=checks.POOL_RANKS,
        dtypes=checks.FLOAT_DTYPES,
        layout="[(layers,) c_num_pages, c_page_size, head_dim]",
    )
    checks.check_same_dtype("compressed_pool", compressed_pool, "q", q)
    checks.check_dim("compressed_pool", compressed_pool, -1, head_dim, "q.shape[2], head_dim")
    stacked_pools.check_layer("compressed_pool", "compressed_layer", compressed_pool, compressed_layer)
    checks.check_page_table("compressed_page_table", compressed_page_table, batch)
    checks.check_counts("n_compressed", n_compressed, batch)
    checks.check_static_int("compress_ratio", compress_ratio, lo=1)


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
    swa_decode.check_window_inputs(q, window_pool, window_page_table, lengths, sinks, window, scale, window_layer)
    check_compressed_inputs(q, compressed_pool, compressed_page_table, n_compressed, compress_ratio, compressed_layer)
    window_pool, window_page_table = stacked_pools.flat_view(window_pool, window_page_table, window_layer)
    compressed_pool, compressed_page_table = stacked_pools.flat_view(
        compressed_pool, compressed_page_table, compressed_layer
    )
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    resolved = dispatch.resolve_backend(backend, interpret)
    if resolved == "reference":
        return hca_decode_attention_reference(
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
    capacity = compressed_page_table.shape[1] * compressed_pool.shape[1]
    n_visible = visible_entries(lengths, n_compressed, compress_ratio, capacity)
    mode = dispatch.pallas_interpret_arg(resolved, interpret)
    args = (q, window_pool, window_page_table, lengths, sinks, compressed_pool, compressed_page_table, n_visible)
    if resolved == "gpu":
        swa_decode.check_gpu_shapes(q)
        return _hca_decode_gpu(*args, window=window, scale=scale, interpret=mode)
    return _hca_decode_tpu(*args, window=window, scale=scale, interpret=mode)


# ----------------------------------------------------------------------------------------------
# Reference (plain jnp).
# ----------------------------------------------------------------------------------------------
def compressed_rows_reference(compressed_pool, compressed_page_table, entries, valid):
    """[batch, n, D] rows of compressed `entries` (int32[batch, n]); invalid ones are not looked up."""
    c_page_size = compressed_pool.shape[1]
    c_pages_per_seq = compressed_page_table.shape[1]
    safe = jnp.where(valid, entries, 0)  # (entries >= 0 where valid)
    logical = im.rem(im.div(safe, c_page_size), c_pages_per_seq)
    pages = jnp.where(valid, im.take_rows(compressed_page_table, logical), 0)
    return compressed_pool[pages, im.rem(safe, c_page_size)]


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
    scale = q.shape[2] ** -0.5 if scale is None else scale
    batch = q.shape[0]
    capacity = compressed_page_table.shape[1] * compressed_pool.shape[1]
    window_tiles = numerics.paged_tiles(window_pool, window_page_table, lengths, window)
    entries = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32)[None, :], (batch, capacity))
    n_visible = visible_entries(lengths, n_compressed, compress_ratio, capacity)
    entries_valid = entries < n_visible[:, None]
    entry_rows = compressed_rows_reference(compressed_pool, compressed_page_table, entries, entries_valid)
    tiles = [window_tiles, numerics.entry_tiles(entry_rows, entries_valid)]
    return swa_decode.attend_shared_rows(q, tiles, sinks, scale)
