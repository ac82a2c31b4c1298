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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltr

from pallas_kernels import dispatch, numerics, online_softmax, paged_folds_gpu, paged_folds_tpu, stacked_pools
from pallas_kernels import index_math as im
from pallas_kernels import input_checks as checks

# GPU tiles: query heads per program (Triton dot tiles need >= 16) and rows folded per step. Untuned
# defaults; the private `_*_gpu` wrappers take others (benchmarks/kernels.py --sweep).
GPU_BLOCK_H = 16
GPU_BLOCK_K = 32


def window_pages(window: int, page_size: int) -> int:
    """The most pages a window of `window` consecutive rows can overlap."""
    return pl.cdiv(window - 1, page_size) + 1


# ----------------------------------------------------------------------------------------------
# GPU kernel (Triton lowering): one program per (sequence, block of query heads).
# ----------------------------------------------------------------------------------------------
def swa_decode_kernel_gpu(
    lengths_ref,  # int32[batch]                                  (whole array)
    window_page_table_ref,  # int32[batch, pages_per_seq]         (whole array)
    window_pool_ref,  # [num_pages * page_size, head_dim]         (whole pool, rows)
    q_ref,  # [block_h, head_dim]
    sinks_ref,  # f32[block_h, 1]
    out_ref,  # [block_h, head_dim]
    *,
    window: int,
    page_size: int,
    block_k: int,
    scale: float,
):
    b = pl.program_id(0)
    length = lengths_ref[b]
    state = online_softmax.init_state(sinks_ref[...], q_ref.shape[1])
    state = paged_folds_gpu.fold_range(
        state,
        q_ref[...],
        window_pool_ref,
        window_page_table_ref,
        b,
        jnp.maximum(length - window, 0),
        length,
        page_size=page_size,
        block_k=block_k,
        scale=scale,
    )
    out_ref[...] = online_softmax.finalize(state, out_ref.dtype)


def sinks_column(sinks, num_heads: int, padded_heads: int):
    """sinks as f32[padded_heads, 1]; None (no sink) becomes -inf, padding heads get 0."""
    if sinks is None:
        sinks = jnp.full((num_heads,), -jnp.inf, jnp.float32)
    return jnp.pad(sinks.astype(jnp.float32), (0, padded_heads - num_heads))[:, None]


def pad_heads(q, sinks, block_h: int):
    """q padded with zero heads to a multiple of block_h, and the matching sinks column."""
    num_heads = q.shape[1]
    padded = pl.cdiv(num_heads, block_h) * block_h
    q = jnp.pad(q, ((0, 0), (0, padded - num_heads), (0, 0)))
    return q, sinks_column(sinks, num_heads, padded)


def _swa_decode_gpu(
    q,
    window_pool,
    window_page_table,
    lengths,
    sinks,
    *,
    window,
    scale,
    interpret,
    block_h=GPU_BLOCK_H,
    block_k=GPU_BLOCK_K,
    num_warps=4,
    num_stages=2,
):
    batch, num_heads, head_dim = q.shape
    num_pages, page_size, _ = window_pool.shape
    q_padded, sinks_padded = pad_heads(q, sinks, block_h)
    whole = lambda shape: pl.BlockSpec(shape, lambda b, h: (0,) * len(shape))
    out = pl.pallas_call(
        functools.partial(swa_decode_kernel_gpu, window=window, page_size=page_size, block_k=block_k, scale=scale),
        grid=(batch, q_padded.shape[1] // block_h),
        in_specs=[
            whole(lengths.shape),
            whole(window_page_table.shape),
            whole((num_pages * page_size, head_dim)),
            pl.BlockSpec((None, block_h, head_dim), lambda b, h: (b, h, 0)),
            pl.BlockSpec((block_h, 1), lambda b, h: (h, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_h, head_dim), lambda b, h: (b, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q_padded.shape, q.dtype),
        interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="swa_decode_attention",
    )(lengths, window_page_table, window_pool.reshape(num_pages * page_size, head_dim), q_padded, sinks_padded)
    return out[:, :num_heads]


# ----------------------------------------------------------------------------------------------
# TPU kernel (Mosaic): one program per sequence, all query heads at once; window pages are DMA'd
# one by one (double-buffered) from HBM.
# ----------------------------------------------------------------------------------------------
def swa_decode_kernel_tpu(
    lengths_ref,  # SMEM int32[batch]                             scalar prefetch
    window_page_table_ref,  # SMEM int32[batch * pages_per_seq]   scalar prefetch (flattened)
    window_pool_hbm_ref,  # HBM [num_pages, page_size, head_dim]
    q_ref,  # VMEM [num_heads, head_dim]
    sinks_ref,  # VMEM f32[num_heads, 1]
    out_ref,  # VMEM [num_heads, head_dim]
    page_buf,  # VMEM [2, page_size, head_dim]
    sems,  # DMA semaphores [2]
    *,
    window: int,
    pages_per_seq: int,
    scale: float,
):
    b = pl.program_id(0)
    length = lengths_ref[b]
    state = online_softmax.init_state(sinks_ref[...], q_ref.shape[1])
    state = paged_folds_tpu.fold_page_range(
        state,
        q_ref[...],
        window_pool_hbm_ref,
        window_page_table_ref,
        b * pages_per_seq,
        jnp.maximum(length - window, 0),
        length,
        page_buf,
        sems,
        pages_per_seq=pages_per_seq,
        scale=scale,
    )
    out_ref[...] = online_softmax.finalize(state, out_ref.dtype)


def _swa_decode_tpu(q, window_pool, window_page_table, lengths, sinks, *, window, scale, interpret):
    batch, num_heads, head_dim = q.shape
    _, page_size, _ = window_pool.shape
    pages_per_seq = window_page_table.shape[1]
    return pl.pallas_call(
        functools.partial(swa_decode_kernel_tpu, window=window, pages_per_seq=pages_per_seq, scale=scale),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch,),
            in_specs=[
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec((None, num_heads, head_dim), lambda b, *_: (b, 0, 0)),
                pl.BlockSpec((num_heads, 1), lambda b, *_: (0, 0)),
            ],
            out_specs=pl.BlockSpec((None, num_heads, head_dim), lambda b, *_: (b, 0, 0)),
            scratch_shapes=[
                pltpu.VMEM((2, page_size, head_dim), window_pool.dtype),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="swa_decode_attention",
    )(lengths, window_page_table.reshape(-1), window_pool, q, sinks_column(sinks, num_heads, num_heads))


# ----------------------------------------------------------------------------------------------
# Public function.
# ----------------------------------------------------------------------------------------------
def check_window_inputs(q, window_pool, window_page_table, lengths, sinks, window, scale, window_layer):
    """Validation shared by the SWA, HCA and CSA decode attentions."""
    checks.check_array("q", q, rank=3, dtypes=checks.FLOAT_DTYPES, layout="[batch, num_heads, head_dim]")
    batch, num_heads, head_dim = q.shape
    checks.check_array(
        "window_pool",
        window_pool,
        rank=checks.POOL_RANKS,
        dtypes=checks.FLOAT_DTYPES,
        layout="[(layers,) num_pages, page_size, head_dim]",
    )
    checks.check_same_dtype("window_pool", window_pool, "q", q)
    checks.check_dim("window_pool", window_pool, -1, head_dim, "q.shape[2], head_dim")
    stacked_pools.check_layer("window_pool", "window_layer", window_pool, window_layer)
    checks.check_array("lengths", lengths, rank=1, dtypes=checks.INT32, layout="int32[batch]")
    checks.check_dim("lengths", lengths, 0, batch, "q.shape[0], batch")
    checks.check_page_table("window_page_table", window_page_table, batch)
    checks.check_sinks(sinks, num_heads)
    checks.check_static_int("window", window, lo=1)
    checks.check_scale(scale)
    needed = window_pages(window, window_pool.shape[-2])
    if window_page_table.shape[1] < needed:
        raise ValueError(
            f"window_page_table.shape={tuple(window_page_table.shape)} must have at least {needed} "
            f"pages per sequence (the most pages a window of {window} rows can overlap)"
        )


def check_gpu_shapes(q):
    """The GPU kernels load [rows, head_dim] blocks: head_dim must be a power of two >= 16."""
    head_dim = q.shape[2]
    checks.check_power_of_two("head_dim", head_dim, "Triton blocks are powers of two")
    if head_dim < 16:
        raise ValueError(f"{head_dim=} must be >= 16 on the GPU backend (Triton dot tiles)")


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
    check_window_inputs(q, window_pool, window_page_table, lengths, sinks, window, scale, window_layer)
    window_pool, window_page_table = stacked_pools.flat_view(window_pool, window_page_table, window_layer)
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    resolved = dispatch.resolve_backend(backend, interpret)
    if resolved == "reference":
        return swa_decode_attention_reference(
            q, window_pool, window_page_table, lengths, sinks, window=window, scale=scale
        )
    mode = dispatch.pallas_interpret_arg(resolved, interpret)
    if resolved == "gpu":
        check_gpu_shapes(q)
        return _swa_decode_gpu(
            q, window_pool, window_page_table, lengths, sinks, window=window, scale=scale, interpret=mode
        )
    return _swa_decode_tpu(
        q, window_pool, window_page_table, lengths, sinks, window=window, scale=scale, interpret=mode
    )


# ----------------------------------------------------------------------------------------------
# Reference (plain jnp).
# ----------------------------------------------------------------------------------------------
def window_rows_reference(window_pool, window_page_table, lengths, window: int):
    """([batch, window, D] rows, bool[batch, window] valid) of each sequence's sliding window."""
    _, page_size, _ = window_pool.shape
    pages_per_seq = window_page_table.shape[1]
    start = jnp.maximum(lengths - window, 0)  # [batch]
    positions = start[:, None] + jnp.arange(window, dtype=jnp.int32)[None, :]  # [batch, window]
    valid = positions < lengths[:, None]
    logical = im.rem(im.div(positions, page_size), pages_per_seq)  # (positions >= 0)
    pages = jnp.where(valid, im.take_rows(window_page_table, logical), 0)
    return window_pool[pages, im.rem(positions, page_size)], valid


def swa_decode_attention_reference(
    q, window_pool, window_page_table, lengths, sinks, *, window: int, scale: float | None = None
) -> jax.Array:
    """jnp reference of `swa_decode_attention`: same arguments and result, no validation; computed in
    `pallas_kernels.numerics`' order (the numerical contract: equal to hkv's prefill and the stateless
    forward bit for bit)."""
    scale = q.shape[2] ** -0.5 if scale is None else scale
    rows, valid = numerics.paged_tiles(window_pool, window_page_table, lengths, window)
    return attend_shared_rows(q, [(rows, valid)], sinks, scale)


def attend_shared_rows(q, tiles, sinks, scale: float) -> jax.Array:
    """`numerics.attend` of q [B, H, D] over K=V row tiles [(rows [B, T, KT, D], valid [B, T, KT]), ...]
    (one shared head, sources in order) -> [B, H, D]."""
    batch, heads, d = q.shape
    sources = [numerics.KeyTiles(r[:, None, :, :, None, :], r[:, None, :, :, None, :], v[:, None]) for r, v in tiles]
    out = numerics.attend(q.reshape(batch, 1, 1, heads, d), sources, scale=scale, sinks=sinks)
    return out.reshape(batch, heads, d)
