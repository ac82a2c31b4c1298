"""Grouped-query decode attention over a paged pool of per-token K/V rows: full or sliding window.

One new token per sequence sits at absolute position t = lengths[b] - 1 (`lengths` counts tokens
including it; its row is already written). Query head h attends with KV head h // (num_heads //
num_kv_heads) (GQA; MQA is num_kv_heads=1) to the positions p with t - window < p <= t (`window`
set) or 0 <= p <= t (`window=None`, full causal attention), in one softmax whose denominator also
holds exp(sinks[h]). Logits are q.k * scale, soft-capped to softcap * tanh(logits / softcap) when
`softcap` is set (Gemma-style; the sinks are not capped).

Layout (rows are addressed by absolute position through the page table, as in `swa_decode`):

    q:          [batch, num_heads, head_dim]                 bf16 | f32
    kv_pool:    [num_pages, page_size, row]                  same dtype as q (or stacked over
                                                             layers, see `stacked_pools`)
    page_table: int32[batch, pages_per_seq]
    lengths:    int32[batch]
    sinks:      f32[num_heads] | None

The row of a token holds its keys and values of every KV head side by side:

    row = [K head 0 | K head 1 | ... | K head Hkv-1 | V head 0 | ... | V head Hkv-1]   2 * Hkv * head_dim
    row = [K head 0 | ... | K head Hkv-1], V = K                       (shared_kv)       Hkv * head_dim

Position p of sequence b lives in physical page `page_table[b, (p // page_size) % pages_per_seq]` at
row `p % page_size`. With a window, the table needs >= cdiv(window - 1, page_size) + 1 entries (a
ring of window pages when short, or the whole context). With `window=None` the table must cover
every position of the longest sequence (pages_per_seq * page_size >= max(lengths), which is data
and cannot be checked); a sequence longer than that capacity attends to its last pages_per_seq *
page_size positions, all that a ring of that many rows holds: full attention is a sliding window of
the table's capacity, in the kernels and the reference alike. Only the pages overlapping the
attended positions are read, and of those only the attended rows; page-table entries of other
logical pages are never read and may hold anything. lengths[b] == 0 (an empty slot) gives zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common, dispatch, numerics, online_softmax, paged_folds_gpu, paged_folds_tpu, stacked_pools
from pallas_kernels import input_checks as checks


def attended_span(window: int | None, page_table, page_size: int) -> int:
    """The most positions a query attends to: `window`, or the table's capacity for full attention."""
    return window if window is not None else page_table.shape[1] * page_size


def row_width(num_kv_heads: int, head_dim: int, shared_kv: bool) -> int:
    """Elements per pool row: K (and V unless shared) of every KV head."""
    return (1 if shared_kv else 2) * num_kv_heads * head_dim


def group_heads(x, num_kv_heads: int, padded_group: int):
    """[batch, num_heads, ...] -> [batch, num_kv_heads, padded_group, ...], zero-padded per group."""
    batch, num_heads = x.shape[:2]
    group = num_heads // num_kv_heads
    x = x.reshape(batch, num_kv_heads, group, *x.shape[2:])
    pad = [(0, 0)] * x.ndim
    pad[2] = (0, padded_group - group)
    return jnp.pad(x, pad)


def grouped_sinks(sinks, num_heads: int, num_kv_heads: int, padded_group: int):
    """sinks as f32[num_kv_heads, padded_group, 1]; None (no sink) becomes -inf, padding heads 0."""
    if sinks is None:
        sinks = jnp.full((num_heads,), -jnp.inf, jnp.float32)
    return group_heads(sinks.astype(jnp.float32)[None, :, None], num_kv_heads, padded_group)[0]


# ----------------------------------------------------------------------------------------------
# GPU kernel (Triton lowering): one program per (sequence, KV head, block of its query heads).
# ----------------------------------------------------------------------------------------------
def gqa_decode_kernel_gpu(
    lengths_ref,  # int32[batch]                                  (whole array)
    page_table_ref,  # int32[batch, pages_per_seq]                (whole array)
    kv_pool_ref,  # [num_pages * page_size, row]                  (whole pool, rows)
    q_ref,  # [block_h, head_dim]                                 query heads of KV head g
    sinks_ref,  # f32[block_h, 1]
    out_ref,  # [block_h, head_dim]
    *,
    span: int,
    num_kv_heads: int,
    shared_kv: bool,
    page_size: int,
    block_k: int,
    scale: float,
    softcap: float | None,
):
    b, g = pl.program_id(0), pl.program_id(1)
    head_dim = q_ref.shape[1]
    length = lengths_ref[b]
    state = online_softmax.init_state(sinks_ref[...], head_dim)
    state = paged_folds_gpu.fold_range_kv(
        state,
        q_ref[...],
        kv_pool_ref,
        page_table_ref,
        b,
        jnp.maximum(length - span, 0),
        length,
        g * head_dim,
        None if shared_kv else (num_kv_heads + g) * head_dim,
        page_size=page_size,
        block_k=block_k,
        scale=scale,
        softcap=softcap,
    )
    out_ref[...] = online_softmax.finalize(state, out_ref.dtype)


def _gqa_decode_gpu(
    q,
    kv_pool,
    page_table,
    lengths,
    sinks,
    *,
    num_kv_heads,
    span,
    shared_kv,
    scale,
    softcap,
    interpret,
    block_h=common.GPU_BLOCK_H,  # query heads of one KV head per program
    block_k=common.GPU_BLOCK_K,
    num_warps=4,
    num_stages=2,
):
    batch, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    padded_group = pl.cdiv(group, block_h) * block_h
    kernel = functools.partial(
        gqa_decode_kernel_gpu,
        span=span,
        num_kv_heads=num_kv_heads,
        shared_kv=shared_kv,
        page_size=kv_pool.shape[1],
        block_k=block_k,
        scale=scale,
        softcap=softcap,
    )
    out = common.decode_call_gpu(
        kernel,
        group_heads(q, num_kv_heads, padded_group),  # [batch, Hkv, padded_group, D]
        grouped_sinks(sinks, num_heads, num_kv_heads, padded_group),  # [Hkv, padded_group, 1]
        [lengths, page_table, common.pool_rows(kv_pool)],
        block_h=block_h,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        name="gqa_decode_attention",
    )
    return out[:, :, :group].reshape(batch, num_heads, head_dim)


# ----------------------------------------------------------------------------------------------
# TPU kernel (Mosaic): one program per sequence, all query heads at once; pages of whole rows (K and
# V of every KV head) are DMA'd one by one (double-buffered) from HBM, then each KV head's columns
# are folded into the states of its query heads.
# ----------------------------------------------------------------------------------------------
def gqa_decode_kernel_tpu(
    lengths_ref,  # SMEM int32[batch]                             scalar prefetch
    page_table_ref,  # SMEM int32[batch * pages_per_seq]          scalar prefetch (flattened)
    kv_pool_hbm_ref,  # HBM [num_pages, page_size, row]
    q_ref,  # VMEM [num_kv_heads, group, head_dim]
    sinks_ref,  # VMEM f32[num_kv_heads, group, 1]
    out_ref,  # VMEM [num_kv_heads, group, head_dim]
    page_buf,  # VMEM [2, page_size, row]
    sems,  # DMA semaphores [2]
    *,
    span: int,
    pages_per_seq: int,
    shared_kv: bool,
    scale: float,
    softcap: float | None,
):
    b = pl.program_id(0)
    num_kv_heads, _, head_dim = q_ref.shape
    length = lengths_ref[b]
    lo = jnp.maximum(length - span, 0)
    states = tuple(online_softmax.init_state(sinks_ref[g], head_dim) for g in range(num_kv_heads))

    def fold_page(j, base, page, states):
        del j
        page, valid = paged_folds_tpu.mask_page(page, base, lo, length)
        folded = []
        for g in range(num_kv_heads):
            k = page[:, g * head_dim : (g + 1) * head_dim]  # [page_size, head_dim]
            v = k if shared_kv else page[:, (num_kv_heads + g) * head_dim : (num_kv_heads + g + 1) * head_dim]
            folded.append(online_softmax.fold_block_kv(states[g], q_ref[g], k, v, valid, scale, softcap))
        return tuple(folded)

    states = paged_folds_tpu.scan_pages(
        kv_pool_hbm_ref,
        page_table_ref,
        b * pages_per_seq,
        lo,
        length,
        page_buf,
        sems,
        fold_page,
        states,
        pages_per_seq=pages_per_seq,
    )
    for g in range(num_kv_heads):
        out_ref[g] = online_softmax.finalize(states[g], out_ref.dtype)


def _gqa_decode_tpu(
    q, kv_pool, page_table, lengths, sinks, *, num_kv_heads, span, shared_kv, scale, softcap, interpret
):
    batch, num_heads, head_dim = q.shape
    pages_per_seq = page_table.shape[1]
    group = num_heads // num_kv_heads
    kernel = functools.partial(
        gqa_decode_kernel_tpu, span=span, pages_per_seq=pages_per_seq, shared_kv=shared_kv, scale=scale, softcap=softcap
    )
    out = common.decode_call_tpu(
        kernel,
        group_heads(q, num_kv_heads, group),  # [batch, Hkv, group, D]
        grouped_sinks(sinks, num_heads, num_kv_heads, group),  # [Hkv, group, 1]
        [lengths, page_table.reshape(-1)],
        [kv_pool],
        [pltpu.VMEM((2, *kv_pool.shape[1:]), kv_pool.dtype), pltpu.SemaphoreType.DMA((2,))],
        interpret=interpret,
        name="gqa_decode_attention",
    )
    return out.reshape(batch, num_heads, head_dim)


# ----------------------------------------------------------------------------------------------
# Public function.
# ----------------------------------------------------------------------------------------------
def check_softcap(softcap) -> None:
    """softcap must be None or a positive Python number; raises ValueError."""
    if softcap is None:
        return
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0:
        raise ValueError(f"{softcap=} must be None (no capping) or a positive Python float")


def check_gqa_inputs(q, kv_pool, page_table, lengths, sinks, num_kv_heads, window, layer, scale, softcap, shared_kv):
    """Trace-time validation of `gqa_decode_attention`'s shapes, dtypes and static arguments."""
    checks.check_array("q", q, rank=3, dtypes=checks.FLOAT_DTYPES, layout="[batch, num_heads, head_dim]")
    _, num_heads, head_dim = q.shape
    checks.check_static_int("num_kv_heads", num_kv_heads, lo=1, hi=num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_kv_heads=} must divide q.shape[1]={num_heads} (num_heads)")
    if not isinstance(shared_kv, bool):
        raise ValueError(f"{shared_kv=} must be a Python bool")
    checks.check_pool(
        "kv_pool",
        kv_pool,
        layout="[(layers,) num_pages, page_size, row]",
        like_name="q",
        like=q,
        row=row_width(num_kv_heads, head_dim, shared_kv),
        row_meaning="num_kv_heads * head_dim, K = V" if shared_kv else "2 * num_kv_heads * head_dim, K then V",
        layer_name="layer",
        layer=layer,
    )
    checks.check_decode_batch(q, lengths, "page_table", page_table, sinks)
    if window is not None:
        checks.check_static_int("window", window, lo=1)
        common.check_window_table("page_table", page_table, window, kv_pool.shape[-2])
    checks.check_scale(scale)
    check_softcap(softcap)


@functools.partial(
    jax.jit, static_argnames=("num_kv_heads", "window", "scale", "softcap", "shared_kv", "backend", "interpret")
)
def gqa_decode_attention(
    q: jax.Array,
    kv_pool: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    sinks: jax.Array | None,
    *,
    num_kv_heads: int,
    window: int | None = None,
    layer: int | jax.Array | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    shared_kv: bool = False,
    backend: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """GQA / MQA decode attention with optional sliding window, sinks and soft-capping, paged K/V.

    Args:
      q: [batch, num_heads, head_dim] queries of the newest token of each sequence.
      kv_pool: [num_pages, page_size, row], q.dtype; row = [K heads | V heads] (2 * num_kv_heads *
        head_dim), or [K heads] (num_kv_heads * head_dim) with shared_kv. Or [layers, num_pages,
        page_size, row] stacked, with `layer` set.
      page_table: int32[batch, pages_per_seq]; logical page i at entry i % pages_per_seq. With a
        window, pages_per_seq >= cdiv(window - 1, page_size) + 1 (a ring if short); with
        window=None it must cover max(lengths) (longer sequences see their last pages_per_seq *
        page_size positions).
      lengths: int32[batch] tokens per sequence including the new one (0 = empty slot).
      sinks: f32[num_heads] per-head sink logits, or None for no sink.
      num_kv_heads: KV heads; divides num_heads, query head h uses KV head h // (num_heads //
        num_kv_heads). 1 = MQA.
      window: attended rows, the new token's included; None = full causal attention.
      layer: layer of a stacked kv_pool (int or int32 scalar, may be traced).
      scale: logit scale; None = head_dim ** -0.5.
      softcap: None, or cap the scaled logits to softcap * tanh(logits / softcap) (sinks uncapped).
      shared_kv: rows hold K only and V = K (DeepSeek-style K=V rows).
      backend: "gpu" | "tpu" | "reference" | None (auto, see `pallas_kernels.dispatch`).
      interpret: run the Pallas kernel in the interpreter (CPU testing).

    Returns:
      [batch, num_heads, head_dim] in q.dtype.
    """
    check_gqa_inputs(q, kv_pool, page_table, lengths, sinks, num_kv_heads, window, layer, scale, softcap, shared_kv)
    kv_pool, page_table = stacked_pools.flat_view(kv_pool, page_table, layer)
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    softcap = None if softcap is None else float(softcap)
    kw = dict(num_kv_heads=num_kv_heads, shared_kv=shared_kv, scale=scale, softcap=softcap)
    resolved = dispatch.resolve_backend(backend, interpret)
    if resolved == "reference":
        return gqa_decode_attention_reference(q, kv_pool, page_table, lengths, sinks, window=window, **kw)
    span = attended_span(window, page_table, kv_pool.shape[1])
    mode = dispatch.pallas_interpret_arg(resolved, interpret)
    if resolved == "gpu":
        common.check_gpu_head_dim("head_dim", q.shape[2])
        return _gqa_decode_gpu(q, kv_pool, page_table, lengths, sinks, span=span, interpret=mode, **kw)
    return _gqa_decode_tpu(q, kv_pool, page_table, lengths, sinks, span=span, interpret=mode, **kw)


# ----------------------------------------------------------------------------------------------
# Reference (plain jnp).
# ----------------------------------------------------------------------------------------------
def gqa_decode_attention_reference(
    q,
    kv_pool,
    page_table,
    lengths,
    sinks,
    *,
    num_kv_heads: int,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    shared_kv: bool = False,
) -> jax.Array:
    """jnp reference of `gqa_decode_attention` (one layer's pool): same arguments and result, no
    validation; computed in `pallas_kernels.numerics`' order."""
    batch, num_heads, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else scale
    span = attended_span(window, page_table, kv_pool.shape[1])
    # K and V tiles gathered head-major ([B, T, Hkv, KT, D]): the value product reads a head's rows
    # contiguously without a transposed copy of the gathered tiles; presented to `numerics.attend` in
    # its [B, 1, T, KT, Hkv, D] order as a transposed view, which XLA folds into the gather.
    pairs = ((0, num_kv_heads),) if shared_kv else ((0, num_kv_heads), (num_kv_heads, num_kv_heads))
    tiles, valid = numerics.paged_head_tiles(kv_pool, page_table, lengths, span, head_dim, pairs)
    k = tiles[0].transpose(0, 1, 3, 2, 4)[:, None]
    v = k if shared_kv else tiles[1].transpose(0, 1, 3, 2, 4)[:, None]
    group = num_heads // num_kv_heads
    qg = q.reshape(batch, 1, num_kv_heads, group, head_dim)
    out = numerics.attend(qg, [numerics.KeyTiles(k, v, valid[:, None])], scale=scale, sinks=sinks, softcap=softcap)
    return out.reshape(batch, num_heads, head_dim)
