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
    hca_decode,
    numerics,
    online_softmax,
    paged_folds_gpu,
    paged_folds_tpu,
    stacked_pools,
    swa_decode,
)
from pallas_kernels import input_checks as checks


def pad_indices(topk_indices, multiple: int):
    """topk_indices padded with -1 to a multiple of `multiple` columns."""
    k = topk_indices.shape[1]
    return jnp.pad(topk_indices, ((0, 0), (0, pl.cdiv(k, multiple) * multiple - k)), constant_values=-1)


# ----------------------------------------------------------------------------------------------
# GPU kernel (Triton lowering): one program per (sequence, block of query heads).
# ----------------------------------------------------------------------------------------------
def csa_decode_kernel_gpu(
    lengths_ref,  # int32[batch]                                      (whole array)
    n_visible_ref,  # int32[batch]                                    (whole array)
    window_page_table_ref,  # int32[batch, pages_per_seq]             (whole array)
    compressed_page_table_ref,  # int32[batch, c_pages_per_seq]       (whole array)
    window_pool_ref,  # [num_pages * page_size, head_dim]             (whole pool, rows)
    compressed_pool_ref,  # [c_num_pages * c_page_size, head_dim]     (whole pool, rows)
    topk_indices_ref,  # int32[k_padded]                              this sequence's picks
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
    state = paged_folds_gpu.fold_selected(
        state,
        q,
        compressed_pool_ref,
        compressed_page_table_ref,
        b,
        topk_indices_ref,
        n_visible_ref[b],
        page_size=compressed_page_size,
        block_k=block_k,
        scale=scale,
    )
    out_ref[...] = online_softmax.finalize(state, out_ref.dtype)


def _csa_decode_gpu(
    q,
    window_pool,
    window_page_table,
    lengths,
    sinks,
    compressed_pool,
    compressed_page_table,
    n_visible,
    topk_indices,
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
    indices = pad_indices(topk_indices, block_k)
    whole = lambda shape: pl.BlockSpec(shape, lambda b, h: (0,) * len(shape))
    out = pl.pallas_call(
        functools.partial(
            csa_decode_kernel_gpu,
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
            pl.BlockSpec((None, indices.shape[1]), lambda b, h: (b, 0)),
            pl.BlockSpec((None, block_h, head_dim), lambda b, h: (b, h, 0)),
            pl.BlockSpec((block_h, 1), lambda b, h: (h, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_h, head_dim), lambda b, h: (b, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q_padded.shape, q.dtype),
        interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="csa_decode_attention",
    )(
        lengths,
        n_visible,
        window_page_table,
        compressed_page_table,
        window_pool.reshape(num_pages * page_size, head_dim),
        compressed_pool.reshape(c_num_pages * c_page_size, head_dim),
        indices,
        q_padded,
        sinks_padded,
    )
    return out[:, :num_heads]


# ----------------------------------------------------------------------------------------------
# TPU kernel (Mosaic): one program per sequence, all heads; window pages by double-buffered page
# DMAs, selected entries by one row DMA per valid index, block_k rows at a time.
# ----------------------------------------------------------------------------------------------
def csa_decode_kernel_tpu(
    lengths_ref,  # SMEM int32[batch]                                 scalar prefetch
    n_visible_ref,  # SMEM int32[batch]                               scalar prefetch
    window_page_table_ref,  # SMEM int32[batch * pages_per_seq]       scalar prefetch (flattened)
    compressed_page_table_ref,  # SMEM int32[batch * c_pages_per_seq] scalar prefetch (flattened)
    window_pool_hbm_ref,  # HBM [num_pages, page_size, head_dim]
    compressed_pool_hbm_ref,  # HBM [c_num_pages, c_page_size, head_dim]
    topk_smem_ref,  # SMEM int32[1, k_padded]                         this sequence's picks
    topk_vmem_ref,  # VMEM int32[k_padded // block_k, block_k]        the same, as vectors
    q_ref,  # VMEM [num_heads, head_dim]
    sinks_ref,  # VMEM f32[num_heads, 1]
    out_ref,  # VMEM [num_heads, head_dim]
    window_buf,  # VMEM [2, page_size, head_dim]
    row_buf,  # VMEM [block_k, head_dim]
    window_sems,  # DMA semaphores [2]
    row_sem,  # DMA semaphore
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
        window_sems,
        pages_per_seq=pages_per_seq,
        scale=scale,
    )
    row_buf[...] = jnp.zeros_like(row_buf)  # skipped picks must read as finite values
    state = paged_folds_tpu.fold_selected_rows(
        state,
        q,
        compressed_pool_hbm_ref,
        compressed_page_table_ref,
        b * compressed_pages_per_seq,
        topk_smem_ref,
        topk_vmem_ref,
        n_visible_ref[b],
        row_buf,
        row_sem,
        pages_per_seq=compressed_pages_per_seq,
        scale=scale,
    )
    out_ref[...] = online_softmax.finalize(state, out_ref.dtype)


def _csa_decode_tpu(
    q,
    window_pool,
    window_page_table,
    lengths,
    sinks,
    compressed_pool,
    compressed_page_table,
    n_visible,
    topk_indices,
    *,
    window,
    scale,
    interpret,
    block_k=16,
):
    batch, num_heads, head_dim = q.shape
    _, page_size, _ = window_pool.shape
    pages_per_seq = window_page_table.shape[1]
    c_pages_per_seq = compressed_page_table.shape[1]
    indices = pad_indices(topk_indices, block_k)
    k_padded = indices.shape[1]
    return pl.pallas_call(
        functools.partial(
            csa_decode_kernel_tpu,
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
                # [batch, 1, k]: a unit axis, so the block's last two dims equal the array's.
                pl.BlockSpec((None, 1, k_padded), lambda b, *_: (b, 0, 0), memory_space=pltpu.SMEM),
                pl.BlockSpec((None, k_padded // block_k, block_k), lambda b, *_: (b, 0, 0)),
                pl.BlockSpec((None, num_heads, head_dim), lambda b, *_: (b, 0, 0)),
                pl.BlockSpec((num_heads, 1), lambda b, *_: (0, 0)),
            ],
            out_specs=pl.BlockSpec((None, num_heads, head_dim), lambda b, *_: (b, 0, 0)),
            scratch_shapes=[
                pltpu.VMEM((2, page_size, head_dim), window_pool.dtype),
                pltpu.VMEM((block_k, head_dim), compressed_pool.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SemaphoreType.DMA(()),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="csa_decode_attention",
    )(
        lengths,
        n_visible,
        window_page_table.reshape(-1),
        compressed_page_table.reshape(-1),
        window_pool,
        compressed_pool,
        indices[:, None, :],
        indices.reshape(batch, k_padded // block_k, block_k),
        q,
        swa_decode.sinks_column(sinks, num_heads, num_heads),
    )


# ----------------------------------------------------------------------------------------------
# Public function.
# ----------------------------------------------------------------------------------------------
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
    swa_decode.check_window_inputs(q, window_pool, window_page_table, lengths, sinks, window, scale, window_layer)
    hca_decode.check_compressed_inputs(
        q, compressed_pool, compressed_page_table, n_compressed, compress_ratio, compressed_layer
    )
    checks.check_array("topk_indices", topk_indices, rank=2, dtypes=checks.INT32, layout="int32[batch, k]")
    checks.check_dim("topk_indices", topk_indices, 0, q.shape[0], "q.shape[0], batch")
    window_pool, window_page_table = stacked_pools.flat_view(window_pool, window_page_table, window_layer)
    compressed_pool, compressed_page_table = stacked_pools.flat_view(
        compressed_pool, compressed_page_table, compressed_layer
    )
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    resolved = dispatch.resolve_backend(backend, interpret)
    if resolved == "reference":
        return csa_decode_attention_reference(
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
    capacity = compressed_page_table.shape[1] * compressed_pool.shape[1]
    n_visible = hca_decode.visible_entries(lengths, n_compressed, compress_ratio, capacity)
    mode = dispatch.pallas_interpret_arg(resolved, interpret)
    args = (
        q,
        window_pool,
        window_page_table,
        lengths,
        sinks,
        compressed_pool,
        compressed_page_table,
        n_visible,
        topk_indices,
    )
    if resolved == "gpu":
        swa_decode.check_gpu_shapes(q)
        return _csa_decode_gpu(*args, window=window, scale=scale, interpret=mode)
    return _csa_decode_tpu(*args, window=window, scale=scale, interpret=mode)


# ----------------------------------------------------------------------------------------------
# Reference (plain jnp).
# ----------------------------------------------------------------------------------------------
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
    scale = q.shape[2] ** -0.5 if scale is None else scale
    capacity = compressed_page_table.shape[1] * compressed_pool.shape[1]
    window_tiles = numerics.paged_tiles(window_pool, window_page_table, lengths, window)
    n_visible = hca_decode.visible_entries(lengths, n_compressed, compress_ratio, capacity)
    picks_valid = (topk_indices >= 0) & (topk_indices < n_visible[:, None])
    pick_rows = hca_decode.compressed_rows_reference(compressed_pool, compressed_page_table, topk_indices, picks_valid)
    tiles = [window_tiles, numerics.entry_tiles(pick_rows, picks_valid)]
    return swa_decode.attend_shared_rows(q, tiles, sinks, scale)
