"""Lightning-indexer scoring over paged index keys, and top-k selection for CSA layers.

At decode, the CSA indexer scores every causally visible compressed entry s of a sequence with

    score[s] = sum_h weights[h] * relu(q_idx[h] . key[s]) * scale        (f32; scale = d ** -0.5)

and the k highest-scoring entries are attended (`csa_decode_attention`). Entries s >= lengths[b] //
compress_ratio are masked to -inf (causal), as are entries not yet written (s >= n_entries[b]).

Layout:

    q_idx:            [batch, n_idx_heads, idx_head_dim]     bf16 | f32, already roped
    weights:          [batch, n_idx_heads]                   bf16 | f32, already scaled
    index_pool:       [num_pages, page_size, idx_head_dim]   q_idx.dtype; one index key per entry
    index_page_table: int32[batch, pages_per_seq]            entry s at logical page s // page_size
    lengths:          int32[batch]
    n_entries:        int32[batch]                           index keys written per sequence

The index keys have their own pool and page table (they may share the compressed entries' table if
the cache allocates both in lockstep). Scoring is the Pallas kernel; it reads only the pages holding
visible entries. Top-k is `lax.top_k` on the scores (XLA), which orders equal scores by lowest index
first. Picks that land on masked entries (fewer visible entries than k) are -1, and if k exceeds
the capacity pages_per_seq * page_size, the extra columns are -1 too: the result always has k columns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltr

from pallas_kernels import common, dispatch, numerics, online_softmax, paged_folds_gpu, paged_folds_tpu, stacked_pools
from pallas_kernels import input_checks as checks


def _score_block(q, weights, keys, scale: float):
    """f32[1, block]: sum_h weights[h] * relu(q[h] . keys[j]) * scale, for q [heads, d], weights
    [heads, 1] f32, keys [block, d]."""
    logits = lax.dot_general(
        q,
        keys,
        (((1,), (1,)), ((), ())),
        precision=online_softmax.dot_precision(keys.dtype),
        preferred_element_type=jnp.float32,
    )  # [heads, block]
    return jnp.sum(jnp.maximum(logits, 0.0) * weights, axis=0, keepdims=True) * scale


# ----------------------------------------------------------------------------------------------
# GPU kernel (Triton lowering): one program per (sequence, block of entries).
# ----------------------------------------------------------------------------------------------
def indexer_scores_kernel_gpu(
    n_visible_ref,  # int32[batch]                                    (whole array)
    index_page_table_ref,  # int32[batch, pages_per_seq]              (whole array)
    index_pool_ref,  # [num_pages * page_size, idx_head_dim]          (whole pool, rows)
    q_ref,  # [heads_padded, idx_head_dim]
    weights_ref,  # f32[heads_padded, 1]
    out_ref,  # f32[1, block_k]                                       scores of entries j*bk + ...
    *,
    page_size: int,
    scale: float,
):
    b, j = pl.program_id(0), pl.program_id(1)
    block_k = out_ref.shape[1]
    n_visible = n_visible_ref[b]

    @pl.when(j * block_k >= n_visible)
    def _masked_block():  # past the visible entries (most blocks, if the table is sized for 1M)
        out_ref[...] = jnp.full(out_ref.shape, -jnp.inf, jnp.float32)

    @pl.when(j * block_k < n_visible)
    def _score_block_of_entries():
        entries = j * block_k + lax.iota(jnp.int32, block_k)
        valid = entries < n_visible
        keys = paged_folds_gpu.gather_rows(index_pool_ref, index_page_table_ref, b, entries, valid, page_size=page_size)
        scores = _score_block(q_ref[...], weights_ref[...], keys, scale)
        out_ref[...] = jnp.where(valid[None, :], scores, -jnp.inf)


def pad_index_heads(q_idx, weights, multiple: int):
    """q_idx padded with zero heads, weights as f32[batch, padded, 1] padded with zeros."""
    heads = q_idx.shape[1]
    padded = pl.cdiv(heads, multiple) * multiple
    q_idx = jnp.pad(q_idx, ((0, 0), (0, padded - heads), (0, 0)))
    weights = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, padded - heads)))[..., None]
    return q_idx, weights


def _indexer_scores_gpu(
    q_idx, weights, index_pool, index_page_table, n_visible, *, scale, interpret, block_k=64, num_warps=4, num_stages=2
):
    batch, _, idx_head_dim = q_idx.shape
    num_pages, page_size, _ = index_pool.shape
    capacity = index_page_table.shape[1] * page_size
    q_padded, weights_padded = pad_index_heads(q_idx, weights, 16)
    heads_padded = q_padded.shape[1]
    num_blocks = pl.cdiv(capacity, block_k)
    whole = lambda shape: pl.BlockSpec(shape, lambda b, j: (0,) * len(shape))
    scores = pl.pallas_call(
        functools.partial(indexer_scores_kernel_gpu, page_size=page_size, scale=scale),
        grid=(batch, num_blocks),
        in_specs=[
            whole(n_visible.shape),
            whole(index_page_table.shape),
            whole((num_pages * page_size, idx_head_dim)),
            pl.BlockSpec((None, heads_padded, idx_head_dim), lambda b, j: (b, 0, 0)),
            pl.BlockSpec((None, heads_padded, 1), lambda b, j: (b, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, 1, block_k), lambda b, j: (b, 0, j)),
        out_shape=jax.ShapeDtypeStruct((batch, 1, num_blocks * block_k), jnp.float32),
        interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="indexer_scores",
    )(n_visible, index_page_table, index_pool.reshape(num_pages * page_size, idx_head_dim), q_padded, weights_padded)
    return scores[:, 0, :capacity]


# ----------------------------------------------------------------------------------------------
# TPU kernel (Mosaic): one program per sequence; pages holding visible entries are DMA'd
# (double-buffered) and scored, one row of the [pages_per_seq, page_size] output per page.
# ----------------------------------------------------------------------------------------------
def indexer_scores_kernel_tpu(
    n_visible_ref,  # SMEM int32[batch]                               scalar prefetch
    index_page_table_ref,  # SMEM int32[batch * pages_per_seq]        scalar prefetch (flattened)
    index_pool_hbm_ref,  # HBM [num_pages, page_size, idx_head_dim]
    q_ref,  # VMEM [n_idx_heads, idx_head_dim]
    weights_ref,  # VMEM f32[n_idx_heads, 1]
    out_ref,  # VMEM f32[pages_per_seq, page_size]                    scores of this sequence
    page_buf,  # VMEM [2, page_size, idx_head_dim]
    sems,  # DMA semaphores [2]
    *,
    scale: float,
):
    b = pl.program_id(0)
    pages_per_seq = out_ref.shape[0]
    n_visible = n_visible_ref[b]
    q = q_ref[...]
    weights = weights_ref[...]
    out_ref[...] = jnp.full(out_ref.shape, -jnp.inf, jnp.float32)

    def score_page(j, base, keys, carry):
        keys, valid = paged_folds_tpu.mask_page(keys, base, None, n_visible)  # unwritten slots -> 0
        scores = _score_block(q, weights, keys, scale)
        out_ref[pl.ds(j, 1), :] = jnp.where(valid, scores, -jnp.inf)
        return carry

    paged_folds_tpu.scan_pages(
        index_pool_hbm_ref,
        index_page_table_ref,
        b * pages_per_seq,
        0,
        n_visible,
        page_buf,
        sems,
        score_page,
        0,
        pages_per_seq=pages_per_seq,
    )


def _indexer_scores_tpu(q_idx, weights, index_pool, index_page_table, n_visible, *, scale, interpret):
    batch, n_idx_heads, idx_head_dim = q_idx.shape
    _, page_size, _ = index_pool.shape
    pages_per_seq = index_page_table.shape[1]
    scores = pl.pallas_call(
        functools.partial(indexer_scores_kernel_tpu, scale=scale),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch,),
            in_specs=[
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec((None, n_idx_heads, idx_head_dim), lambda b, *_: (b, 0, 0)),
                pl.BlockSpec((None, n_idx_heads, 1), lambda b, *_: (b, 0, 0)),
            ],
            out_specs=pl.BlockSpec((None, pages_per_seq, page_size), lambda b, *_: (b, 0, 0)),
            scratch_shapes=[
                pltpu.VMEM((2, page_size, idx_head_dim), index_pool.dtype),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((batch, pages_per_seq, page_size), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="indexer_scores",
    )(n_visible, index_page_table.reshape(-1), index_pool, q_idx, weights.astype(jnp.float32)[..., None])
    return scores.reshape(batch, pages_per_seq * page_size)


# ----------------------------------------------------------------------------------------------
# Public functions.
# ----------------------------------------------------------------------------------------------
def _check_indexer_inputs(
    q_idx, weights, index_pool, index_page_table, lengths, n_entries, compress_ratio, scale, index_layer
):
    checks.check_array("q_idx", q_idx, rank=3, dtypes=checks.FLOAT_DTYPES, layout="[batch, n_idx_heads, idx_head_dim]")
    batch, n_idx_heads, idx_head_dim = q_idx.shape
    checks.check_array("weights", weights, rank=2, dtypes=checks.FLOAT_DTYPES, layout="[batch, n_idx_heads]")
    checks.check_dim("weights", weights, 0, batch, "q_idx.shape[0], batch")
    checks.check_dim("weights", weights, 1, n_idx_heads, "q_idx.shape[1], n_idx_heads")
    checks.check_pool(
        "index_pool",
        index_pool,
        layout="[(layers,) num_pages, page_size, idx_head_dim]",
        like_name="q_idx",
        like=q_idx,
        row=idx_head_dim,
        row_meaning="q_idx.shape[2], idx_head_dim",
        layer_name="index_layer",
        layer=index_layer,
    )
    checks.check_page_table("index_page_table", index_page_table, batch)
    checks.check_counts("lengths", lengths, batch)
    checks.check_counts("n_entries", n_entries, batch)
    checks.check_static_int("compress_ratio", compress_ratio, lo=1)
    checks.check_scale(scale)


@functools.partial(jax.jit, static_argnames=("compress_ratio", "scale", "backend", "interpret"))
def indexer_scores(
    q_idx: jax.Array,
    weights: jax.Array,
    index_pool: jax.Array,
    index_page_table: jax.Array,
    lengths: jax.Array,
    n_entries: jax.Array,
    *,
    compress_ratio: int,
    index_layer: int | jax.Array | None = None,
    scale: float | None = None,
    backend: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Lightning-indexer scores of every entry slot, -inf where masked.

    Args:
      q_idx: [batch, n_idx_heads, idx_head_dim] indexer queries of the newest token (roped).
      weights: [batch, n_idx_heads] per-head weights (already scaled).
      index_pool: [num_pages, page_size, idx_head_dim], q_idx.dtype; one index key per entry.
        Or [layers, num_pages, page_size, idx_head_dim] stacked, with `index_layer` set.
      index_page_table: int32[batch, pages_per_seq]; entry s at logical page s // page_size.
      lengths: int32[batch] tokens per sequence including the new one.
      n_entries: int32[batch] index keys written per sequence.
      compress_ratio: tokens per entry m (DeepSeek-V4 CSA: 4); entries s >= lengths // m are masked.
      index_layer: layer of a stacked index_pool (int or int32 scalar, may be traced).
      scale: None = idx_head_dim ** -0.5.
      backend: "gpu" | "tpu" | "reference" | None (auto, see `pallas_kernels.dispatch`).
      interpret: run the Pallas kernel in the interpreter (CPU testing).

    Returns:
      f32[batch, pages_per_seq * page_size]: the score of entry s, or -inf if s is not visible.
    """
    _check_indexer_inputs(
        q_idx, weights, index_pool, index_page_table, lengths, n_entries, compress_ratio, scale, index_layer
    )
    index_pool, index_page_table = stacked_pools.flat_view(index_pool, index_page_table, index_layer)
    scale = q_idx.shape[2] ** -0.5 if scale is None else float(scale)
    resolved = dispatch.resolve_backend(backend, interpret)
    if resolved == "reference":
        return indexer_scores_reference(
            q_idx, weights, index_pool, index_page_table, lengths, n_entries, compress_ratio=compress_ratio, scale=scale
        )
    capacity = index_page_table.shape[1] * index_pool.shape[1]
    n_visible = common.visible_entries(lengths, n_entries, compress_ratio, capacity)
    mode = dispatch.pallas_interpret_arg(resolved, interpret)
    if resolved == "gpu":
        common.check_gpu_head_dim("idx_head_dim", q_idx.shape[2])
        return _indexer_scores_gpu(q_idx, weights, index_pool, index_page_table, n_visible, scale=scale, interpret=mode)
    return _indexer_scores_tpu(q_idx, weights, index_pool, index_page_table, n_visible, scale=scale, interpret=mode)


@functools.partial(jax.jit, static_argnames=("k", "compress_ratio", "scale", "backend", "interpret"))
def indexer_topk(
    q_idx: jax.Array,
    weights: jax.Array,
    index_pool: jax.Array,
    index_page_table: jax.Array,
    lengths: jax.Array,
    n_entries: jax.Array,
    *,
    k: int,
    compress_ratio: int,
    index_layer: int | jax.Array | None = None,
    scale: float | None = None,
    backend: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Top-k entries by lightning-indexer score, for `csa_decode_attention`.

    Args: as `indexer_scores`, plus
      k: picks per sequence (DeepSeek-V4: index_topk = 512).

    Returns:
      int32[batch, k]: entry indices by decreasing score, equal scores by increasing index; -1 for
      picks past the visible entries (and for columns past the capacity).
    """
    _check_indexer_inputs(
        q_idx, weights, index_pool, index_page_table, lengths, n_entries, compress_ratio, scale, index_layer
    )
    checks.check_static_int("k", k, lo=1)
    scores = indexer_scores(
        q_idx,
        weights,
        index_pool,
        index_page_table,
        lengths,
        n_entries,
        compress_ratio=compress_ratio,
        index_layer=index_layer,
        scale=scale,
        backend=backend,
        interpret=interpret,
    )
    return topk_from_scores(scores, k)


def topk_from_scores(scores: jax.Array, k: int) -> jax.Array:
    """int32[batch, k] top-k of f32[batch, capacity] scores; -inf picks and missing columns -> -1."""
    capacity = scores.shape[1]
    # lax.top_k orders floats totally (-0.0 < +0.0); adding +0.0 turns -0.0 into +0.0 so that equal
    # scores are ties, which lax.top_k breaks by lowest index.
    values, indices = lax.top_k(scores + 0.0, min(k, capacity))
    indices = jnp.where(values == -jnp.inf, -1, indices).astype(jnp.int32)
    return jnp.pad(indices, ((0, 0), (0, max(k - capacity, 0))), constant_values=-1)


# ----------------------------------------------------------------------------------------------
# References (plain jnp).
# ----------------------------------------------------------------------------------------------
def indexer_scores_reference(
    q_idx, weights, index_pool, index_page_table, lengths, n_entries, *, compress_ratio: int, scale: float | None = None
) -> jax.Array:
    """jnp reference of `indexer_scores`: same arguments and result, no validation."""
    scale = q_idx.shape[2] ** -0.5 if scale is None else scale
    batch = q_idx.shape[0]
    capacity = index_page_table.shape[1] * index_pool.shape[1]
    entries = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32)[None, :], (batch, capacity))
    n_visible = common.visible_entries(lengths, n_entries, compress_ratio, capacity)
    valid = entries < n_visible[:, None]
    keys = common.compressed_rows_reference(index_pool, index_page_table, entries, valid)
    keys = jnp.where(valid[..., None], keys, jnp.zeros((), keys.dtype))
    scores = numerics.indexer_scores(q_idx[:, None], weights[:, None], keys, scale)[:, 0]
    return jnp.where(valid, scores, -jnp.inf)


def indexer_topk_reference(
    q_idx,
    weights,
    index_pool,
    index_page_table,
    lengths,
    n_entries,
    *,
    k: int,
    compress_ratio: int,
    scale: float | None = None,
) -> jax.Array:
    """jnp reference of `indexer_topk`, selecting with a stable sort instead of `lax.top_k`."""
    scores = indexer_scores_reference(
        q_idx, weights, index_pool, index_page_table, lengths, n_entries, compress_ratio=compress_ratio, scale=scale
    )
    scores = scores + 0.0  # -0.0 and +0.0 are one value: a tie
    order = jnp.argsort(-scores, axis=1, stable=True)[:, :k].astype(jnp.int32)
    picked = jnp.take_along_axis(scores, order, axis=1)
    order = jnp.where(picked == -jnp.inf, -1, order)
    return jnp.pad(order, ((0, 0), (0, k - order.shape[1])), constant_values=-1)
