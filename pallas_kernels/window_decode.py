"""The decode kernel of DeepSeek-V4's attention layers: the sliding window, then compressed entries.

One new token per sequence sits at position t = lengths[b] - 1 and attends, in ONE softmax with its
per-head sink, to its window rows t - window < p <= t and then (as `swa_decode`, `hca_decode` and
`csa_decode` say, where the layouts are):

    SWA (`swa_decode_attention`): nothing more;
    HCA (`hca_decode_attention`): every visible compressed entry, w < n_visible[b], in index order;
    CSA (`csa_decode_attention`): the picked compressed entries, in the picks' order, skipping -1 and
        any pick not below n_visible[b];

with n_visible = `common.visible_entries`. So the three share one kernel per backend: the compressed
operands are None for SWA, and the picks are an optional operand of HCA's kernel, which makes it
CSA's. The kernels fold the window, then the entries, into one online softmax (`online_softmax`);
the references compute the same in `pallas_kernels.numerics`' order (window tiles, then entry tiles).
The GPU and TPU kernels share the softmax state and its order; how they read rows is each
backend's own (masked per-row loads on GPU, `paged_folds_gpu`; page and row DMAs on TPU,
`paged_folds_tpu`), so they are two kernel bodies.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common, dispatch, numerics, online_softmax, paged_folds_gpu, paged_folds_tpu, stacked_pools
from pallas_kernels import input_checks as checks

# Picks per chunk of row DMAs on the TPU (CSA).
TPU_PICKS_BLOCK = 16


# ----------------------------------------------------------------------------------------------
# Padding.
# ----------------------------------------------------------------------------------------------
def sinks_column(sinks, num_heads: int, padded_heads: int) -> jax.Array:
    """Per-head sink logits as the kernels read them.

    Args:
      sinks: f32[num_heads], or None (no sink).
      num_heads: query heads.
      padded_heads: heads of the padded query (>= num_heads).

    Returns:
      f32[padded_heads, 1]: the sinks (-inf for None), then 0 for the padding heads.
    """
    if sinks is None:
        sinks = jnp.full((num_heads,), -jnp.inf, jnp.float32)
    return jnp.pad(sinks.astype(jnp.float32), (0, padded_heads - num_heads))[:, None]


def pad_heads(q, sinks, block_h: int) -> tuple[jax.Array, jax.Array]:
    """q with zero heads up to a multiple of `block_h`, and the matching sinks column.

    Args:
      q: [batch, num_heads, head_dim].
      sinks: f32[num_heads] or None.
      block_h: query heads per GPU program.

    Returns:
      (q [batch, padded_heads, head_dim], f32[padded_heads, 1] as `sinks_column`), padded_heads =
      cdiv(num_heads, block_h) * block_h.
    """
    num_heads = q.shape[1]
    padded = pl.cdiv(num_heads, block_h) * block_h
    q = jnp.pad(q, ((0, 0), (0, padded - num_heads), (0, 0)))
    return q, sinks_column(sinks, num_heads, padded)


def pad_indices(indices, multiple: int) -> jax.Array:
    """int32[batch, k] entry indices (CSA's picks) padded with -1 (no pick) to a multiple of `multiple`
    columns: int32[batch, cdiv(k, multiple) * multiple]."""
    k = indices.shape[1]
    return jnp.pad(indices, ((0, 0), (0, pl.cdiv(k, multiple) * multiple - k)), constant_values=-1)


# ----------------------------------------------------------------------------------------------
# GPU kernel (Triton lowering): one program per (sequence, block of query heads).
# ----------------------------------------------------------------------------------------------
def window_decode_kernel_gpu(
    lengths_ref,  # int32[batch]                                      (whole array)
    n_visible_ref,  # int32[batch]                                    (whole array; None: SWA)
    window_page_table_ref,  # int32[batch, pages_per_seq]             (whole array)
    compressed_page_table_ref,  # int32[batch, c_pages_per_seq]       (whole array; None: SWA)
    window_pool_ref,  # [num_pages * page_size, head_dim]             (whole pool, rows)
    compressed_pool_ref,  # [c_num_pages * c_page_size, head_dim]     (whole pool, rows; None: SWA)
    picks_ref,  # int32[k_padded]                                     this sequence's picks (CSA; else None)
    q_ref,  # [block_h, head_dim]
    sinks_ref,  # f32[block_h, 1]
    out_ref,  # [block_h, head_dim]
    *,
    window: int,
    page_size: int,
    compressed_page_size: int | None,
    block_k: int,
    scale: float,
):
    """One program's query heads of sequence b: sinks, window rows, then the entries (HCA) or the picks
    (CSA); refs absent for SWA (HCA) are None."""
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
    if picks_ref is not None:  # CSA: the picks
        state = paged_folds_gpu.fold_selected(
            state,
            q,
            compressed_pool_ref,
            compressed_page_table_ref,
            b,
            picks_ref,
            n_visible_ref[b],
            page_size=compressed_page_size,
            block_k=block_k,
            scale=scale,
        )
    elif compressed_pool_ref is not None:  # HCA: every visible entry
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


def window_decode_gpu(
    q,
    window_pool,
    window_page_table,
    lengths,
    sinks,
    compressed_pool=None,
    compressed_page_table=None,
    n_visible=None,
    picks=None,
    *,
    window: int,
    scale: float,
    interpret,
    block_h: int = common.GPU_BLOCK_H,
    block_k: int = common.GPU_BLOCK_K,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """The GPU kernel of the SWA, HCA and CSA decode attentions, without validation or dispatch.

    Args:
      q, window_pool, window_page_table, lengths, sinks: as in `swa_decode.swa_decode_attention`
        (one layer's pool).
      compressed_pool, compressed_page_table: as in `hca_decode.hca_decode_attention` (one layer's
        pool); None for SWA.
      n_visible: int32[batch] visible entries (`common.visible_entries`); None for SWA.
      picks: int32[batch, k] CSA's picks (-1 = none), or None: every visible entry (HCA).
      window: attended window rows; scale: logit scale.
      interpret: `pl.pallas_call`'s (`dispatch.pallas_interpret_arg`).
      block_h, block_k: query heads per program, rows folded per step; num_warps, num_stages: Triton's
        (benchmarks/decode_kernels.py --sweep tries others).

    Returns:
      [batch, num_heads, head_dim] in q.dtype.
    """
    q_padded, sinks_padded = pad_heads(q, sinks, block_h)
    compressed = compressed_pool is not None
    kernel = functools.partial(
        window_decode_kernel_gpu,
        window=window,
        page_size=window_pool.shape[1],
        compressed_page_size=compressed_pool.shape[1] if compressed else None,
        block_k=block_k,
        scale=scale,
    )
    operands = [
        lengths,
        n_visible,
        window_page_table,
        compressed_page_table,
        common.pool_rows(window_pool),
        common.pool_rows(compressed_pool) if compressed else None,
    ]
    out = common.decode_call_gpu(
        kernel,
        q_padded,
        sinks_padded,
        operands,
        [None if picks is None else pad_indices(picks, block_k)],
        block_h=block_h,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        name=kernel_name(compressed_pool, picks),
    )
    return out[:, : q.shape[1]]


# ----------------------------------------------------------------------------------------------
# TPU kernel (Mosaic): one program per sequence, all query heads at once; window pages (and HCA's
# entry pages) are DMA'd one by one, double-buffered, from HBM; CSA's picks by one row DMA each,
# block_k rows at a time.
# ----------------------------------------------------------------------------------------------
def window_decode_kernel_tpu(
    lengths_ref,  # SMEM int32[batch]                                 scalar prefetch
    n_visible_ref,  # SMEM int32[batch]                               scalar prefetch (None: SWA)
    window_page_table_ref,  # SMEM int32[batch * pages_per_seq]       scalar prefetch (flattened)
    compressed_page_table_ref,  # SMEM int32[batch * c_pages_per_seq] scalar prefetch (flattened; None: SWA)
    window_pool_hbm_ref,  # HBM [num_pages, page_size, head_dim]
    compressed_pool_hbm_ref,  # HBM [c_num_pages, c_page_size, head_dim]  (None: SWA)
    picks_smem_ref,  # SMEM int32[1, k_padded]                        this sequence's picks (CSA; else None)
    picks_vmem_ref,  # VMEM int32[k_padded // block_k, block_k]       the same, as vectors (CSA; else None)
    q_ref,  # VMEM [num_heads, head_dim]
    sinks_ref,  # VMEM f32[num_heads, 1]
    out_ref,  # VMEM [num_heads, head_dim]
    window_buf,  # VMEM [2, page_size, head_dim]
    compressed_buf,  # VMEM [2, c_page_size, head_dim]                (HCA; else None)
    row_buf,  # VMEM [block_k, head_dim]                              (CSA; else None)
    sems,  # DMA semaphores [2]
    row_sem,  # DMA semaphore                                         (CSA; else None)
    *,
    window: int,
    pages_per_seq: int,
    compressed_pages_per_seq: int | None,
    scale: float,
):
    """Sequence b's query heads: sinks, window pages, then the entry pages (HCA) or the picked rows
    (CSA); refs and scratch absent for SWA (HCA) are None."""
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
    if picks_smem_ref is not None:  # CSA: the picks, one row DMA each
        row_buf[...] = jnp.zeros_like(row_buf)  # skipped picks must read as finite values
        state = paged_folds_tpu.fold_selected_rows(
            state,
            q,
            compressed_pool_hbm_ref,
            compressed_page_table_ref,
            b * compressed_pages_per_seq,
            picks_smem_ref,
            picks_vmem_ref,
            n_visible_ref[b],
            row_buf,
            row_sem,
            pages_per_seq=compressed_pages_per_seq,
            scale=scale,
        )
    elif compressed_pool_hbm_ref is not None:  # HCA: every visible entry, page by page
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


def window_decode_tpu(
    q,
    window_pool,
    window_page_table,
    lengths,
    sinks,
    compressed_pool=None,
    compressed_page_table=None,
    n_visible=None,
    picks=None,
    *,
    window: int,
    scale: float,
    interpret,
    block_k: int = TPU_PICKS_BLOCK,
) -> jax.Array:
    """The TPU kernel of the SWA, HCA and CSA decode attentions, without validation or dispatch.

    Args: as `window_decode_gpu`'s, but block_k: CSA's picks per chunk of row DMAs.

    Returns:
      [batch, num_heads, head_dim] in q.dtype.
    """
    batch, num_heads, head_dim = q.shape
    hca, csa = compressed_pool is not None and picks is None, picks is not None
    flat = lambda table: None if table is None else table.reshape(-1)
    picks = None if picks is None else pad_indices(picks, block_k)
    kernel = functools.partial(
        window_decode_kernel_tpu,
        window=window,
        pages_per_seq=window_page_table.shape[1],
        compressed_pages_per_seq=None if compressed_page_table is None else compressed_page_table.shape[1],
        scale=scale,
    )
    scratch = [
        pltpu.VMEM((2, *window_pool.shape[1:]), window_pool.dtype),
        pltpu.VMEM((2, *compressed_pool.shape[1:]), compressed_pool.dtype) if hca else None,
        pltpu.VMEM((block_k, head_dim), compressed_pool.dtype) if csa else None,
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.SemaphoreType.DMA(()) if csa else None,
    ]
    per_sequence = [
        # [batch, 1, k]: a unit axis, so the block's last two dims equal the array's.
        (picks[:, None, :] if csa else None, pltpu.SMEM),
        (picks.reshape(batch, -1, block_k) if csa else None, None),
    ]
    return common.decode_call_tpu(
        kernel,
        q,
        sinks_column(sinks, num_heads, num_heads),
        [lengths, n_visible, flat(window_page_table), flat(compressed_page_table)],
        [window_pool, compressed_pool],
        scratch,
        per_sequence,
        interpret=interpret,
        name=kernel_name(compressed_pool, picks),
    )


def kernel_name(compressed_pool, picks) -> str:
    """The kernel's name in profiles: "swa_decode_attention" without a compressed pool, else
    "hca_decode_attention", or "csa_decode_attention" with picks."""
    kind = "swa" if compressed_pool is None else "hca" if picks is None else "csa"
    return f"{kind}_decode_attention"


# ----------------------------------------------------------------------------------------------
# The public functions' body: validation, stacked pools, backend.
# ----------------------------------------------------------------------------------------------
def check_window_inputs(q, window_pool, window_page_table, lengths, sinks, window, scale, window_layer) -> None:
    """Validation of the SWA, HCA and CSA decode attentions (their window arguments, as in
    `swa_decode.swa_decode_attention`); raises ValueError."""
    checks.check_array("q", q, rank=3, dtypes=checks.FLOAT_DTYPES, layout="[batch, num_heads, head_dim]")
    head_dim = q.shape[2]
    checks.check_pool(
        "window_pool",
        window_pool,
        layout="[(layers,) num_pages, page_size, head_dim]",
        like_name="q",
        like=q,
        row=head_dim,
        row_meaning="q.shape[2], head_dim",
        layer_name="window_layer",
        layer=window_layer,
    )
    checks.check_decode_batch(q, lengths, "window_page_table", window_page_table, sinks)
    checks.check_static_int("window", window, lo=1)
    checks.check_scale(scale)
    common.check_window_table("window_page_table", window_page_table, window, window_pool.shape[-2])


def check_compressed_inputs(
    q, compressed_pool, compressed_page_table, n_compressed, compress_ratio, compressed_layer
) -> None:
    """Validation of the HCA and CSA decode attentions (their compressed-entry arguments, as in
    `hca_decode.hca_decode_attention`); raises ValueError."""
    batch, _, head_dim = q.shape
    checks.check_pool(
        "compressed_pool",
        compressed_pool,
        layout="[(layers,) c_num_pages, c_page_size, head_dim]",
        like_name="q",
        like=q,
        row=head_dim,
        row_meaning="q.shape[2], head_dim",
        layer_name="compressed_layer",
        layer=compressed_layer,
    )
    checks.check_page_table("compressed_page_table", compressed_page_table, batch)
    checks.check_counts("n_compressed", n_compressed, batch)
    checks.check_static_int("compress_ratio", compress_ratio, lo=1)


def check_topk_indices(topk_indices, batch: int) -> None:
    """CSA's picks must be int32[batch, k]; raises ValueError."""
    checks.check_array("topk_indices", topk_indices, rank=2, dtypes=checks.INT32, layout="int32[batch, k]")
    checks.check_dim("topk_indices", topk_indices, 0, batch, "q.shape[0], batch")


def window_decode_attention(
    q,
    window_pool,
    window_page_table,
    lengths,
    sinks,
    compressed_pool=None,
    compressed_page_table=None,
    n_compressed=None,
    picks=None,
    *,
    window: int,
    compress_ratio: int | None = None,
    window_layer=None,
    compressed_layer=None,
    scale: float | None = None,
    backend: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """`swa_decode_attention` (no compressed pool), `hca_decode_attention` (a compressed pool) or
    `csa_decode_attention` (and picks): their arguments (picks = topk_indices) and result, validated at
    trace time; stacked pools read in place; the backend's kernel or the reference."""
    check_window_inputs(q, window_pool, window_page_table, lengths, sinks, window, scale, window_layer)
    compressed = compressed_pool is not None
    if compressed:
        check_compressed_inputs(
            q, compressed_pool, compressed_page_table, n_compressed, compress_ratio, compressed_layer
        )
        compressed_pool, compressed_page_table = stacked_pools.flat_view(
            compressed_pool, compressed_page_table, compressed_layer
        )
    if picks is not None:
        check_topk_indices(picks, q.shape[0])
    window_pool, window_page_table = stacked_pools.flat_view(window_pool, window_page_table, window_layer)
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    args = (q, window_pool, window_page_table, lengths, sinks, compressed_pool, compressed_page_table)
    resolved = dispatch.resolve_backend(backend, interpret)
    if resolved == "reference":
        return window_decode_attention_reference(
            *args, n_compressed, picks, window=window, compress_ratio=compress_ratio, scale=scale
        )
    n_visible = None
    if compressed:
        capacity = compressed_page_table.shape[1] * compressed_pool.shape[1]
        n_visible = common.visible_entries(lengths, n_compressed, compress_ratio, capacity)
    mode = dispatch.pallas_interpret_arg(resolved, interpret)
    if resolved == "gpu":
        common.check_gpu_head_dim("head_dim", q.shape[2])
        return window_decode_gpu(*args, n_visible, picks, window=window, scale=scale, interpret=mode)
    return window_decode_tpu(*args, n_visible, picks, window=window, scale=scale, interpret=mode)


# ----------------------------------------------------------------------------------------------
# Reference (plain jnp).
# ----------------------------------------------------------------------------------------------
def window_decode_attention_reference(
    q,
    window_pool,
    window_page_table,
    lengths,
    sinks,
    compressed_pool=None,
    compressed_page_table=None,
    n_compressed=None,
    picks=None,
    *,
    window: int,
    compress_ratio: int | None = None,
    scale: float | None = None,
) -> jax.Array:
    """The references of the SWA, HCA and CSA decode attentions (`window_decode_attention`'s arguments,
    one layer's pools, no validation): `numerics.attend` over the window tiles, then (HCA) every visible
    entry in index order or (CSA) the valid picks in their order."""
    scale = q.shape[2] ** -0.5 if scale is None else scale
    tiles = [numerics.paged_tiles(window_pool, window_page_table, lengths, window)]
    if compressed_pool is not None:
        batch = q.shape[0]
        capacity = compressed_page_table.shape[1] * compressed_pool.shape[1]
        n_visible = common.visible_entries(lengths, n_compressed, compress_ratio, capacity)
        if picks is None:  # HCA
            entries = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32)[None, :], (batch, capacity))
            valid = entries < n_visible[:, None]
        else:  # CSA
            entries = picks
            valid = (picks >= 0) & (picks < n_visible[:, None])
        rows = common.compressed_rows_reference(compressed_pool, compressed_page_table, entries, valid)
        tiles.append(numerics.entry_tiles(rows, valid))
    return attend_shared_rows(q, tiles, sinks, scale)


def attend_shared_rows(q, tiles, sinks, scale: float) -> jax.Array:
    """`numerics.attend` of one-head K=V row tiles, the decode attentions' references.

    Args:
      q: [batch, num_heads, head_dim].
      tiles: [(rows [batch, T, KEY_TILE, head_dim], valid bool[batch, T, KEY_TILE]), ...], the sources
        in their order (`numerics.paged_tiles`, `numerics.entry_tiles`).
      sinks: f32[num_heads] or None.
      scale: logit scale.

    Returns:
      [batch, num_heads, head_dim] in q.dtype, in `numerics.attend`'s order.
    """
    batch, heads, d = q.shape
    sources = [numerics.KeyTiles(r[:, None, :, :, None, :], r[:, None, :, :, None, :], v[:, None]) for r, v in tiles]
    out = numerics.attend(q.reshape(batch, 1, 1, heads, d), sources, scale=scale, sinks=sinks)
    return out.reshape(batch, heads, d)
