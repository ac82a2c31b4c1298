"""GPU (Triton lowering) helpers: gather K=V rows of a paged pool by entry index and fold them.

Rows are addressed per entry, not per page: entry e of sequence b lives at physical row
`page_table[b, (e // page_size) % pages_per_seq] * page_size + e % page_size` of the pool viewed as
[num_pages * page_size, D]. The `% pages_per_seq` is the identity when the page table covers the
whole context, and turns it into a ring when it only covers the window (see `swa_decode`).

Invalid entries are masked in the load itself, so they issue no memory access: a decode step reads
only the rows it attends to (plus their page-table entries). Blocks are `block_k` entries; all
loaded arrays have power-of-two sizes as the Triton lowering requires.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels import online_softmax


def gather_rows(
    pool_ref,  # [num_pages * page_size, D]
    page_table_ref,  # int32[batch, pages_per_seq]
    b,  # int32 scalar: sequence
    entries,  # int32[block]: entry (position) indices
    valid,  # bool[block]: which entries to load
    *,
    page_size: int,
) -> jax.Array:
    """[block, D] rows of `entries`; rows where `valid` is False are 0 and are not read."""
    pages_per_seq = page_table_ref.shape[1]
    head_dim = pool_ref.shape[1]
    logical_page = jnp.where(valid, lax.rem(entries // page_size, pages_per_seq), 0)
    physical_page = page_table_ref[b, logical_page]  # [block]
    rows = jnp.where(valid, physical_page * page_size + lax.rem(entries, page_size), 0)
    cols = lax.broadcasted_iota(jnp.int32, (entries.shape[0], head_dim), 1)
    return pltr.load(pool_ref.at[rows[:, None], cols], mask=valid[:, None], other=0)


def fold_range(
    state: online_softmax.SoftmaxState,
    q,  # [heads, D]
    pool_ref,  # [num_pages * page_size, D]
    page_table_ref,  # int32[batch, pages_per_seq]
    b,
    lo,  # int32 scalar: first entry (inclusive)
    hi,  # int32 scalar: last entry (exclusive)
    *,
    page_size: int,
    block_k: int,
    scale: float,
) -> online_softmax.SoftmaxState:
    """Folds entries [lo, hi) of sequence b; the loop runs cdiv(hi - lo, block_k) times."""
    num_blocks = pl.cdiv(jnp.maximum(hi - lo, 0), block_k)

    def body(j, carry):
        entries = lo + j * block_k + lax.iota(jnp.int32, block_k)
        valid = entries < hi
        kv = gather_rows(pool_ref, page_table_ref, b, entries, valid, page_size=page_size)
        return online_softmax.fold_block(carry, q, kv, valid[None, :], scale)

    return lax.fori_loop(0, num_blocks, body, state)


def fold_selected(
    state: online_softmax.SoftmaxState,
    q,  # [heads, D]
    pool_ref,  # [num_pages * page_size, D]
    page_table_ref,  # int32[batch, pages_per_seq]
    b,
    indices_ref,  # int32[topk_padded]: selected entries of sequence b, -1 = none
    num_visible,  # int32 scalar: entries >= this are skipped like -1
    *,
    page_size: int,
    block_k: int,
    scale: float,
) -> online_softmax.SoftmaxState:
    """Folds the selected entries of sequence b, skipping -1 and out-of-range indices."""
    num_blocks = indices_ref.shape[0] // block_k

    def body(j, carry):
        entries = indices_ref[pl.ds(j * block_k, block_k)]
        valid = (entries >= 0) & (entries < num_visible)
        kv = gather_rows(pool_ref, page_table_ref, b, entries, valid, page_size=page_size)
        return online_softmax.fold_block(carry, q, kv, valid[None, :], scale)

    return lax.fori_loop(0, num_blocks, body, state)


def gather_row_slices(
    pool_ref,  # [num_pages * page_size, row]
    page_table_ref,  # int32[batch, pages_per_seq]
    b,  # int32 scalar: sequence
    entries,  # int32[block]: entry (position) indices
    valid,  # bool[block]: which entries to load
    col,  # int32 scalar: first column of the slice
    *,
    width: int,
    page_size: int,
) -> jax.Array:
    """[block, width] columns [col, col + width) of the rows of `entries`; invalid rows are 0, unread."""
    pages_per_seq = page_table_ref.shape[1]
    logical_page = jnp.where(valid, lax.rem(entries // page_size, pages_per_seq), 0)
    physical_page = page_table_ref[b, logical_page]  # [block]
    rows = jnp.where(valid, physical_page * page_size + lax.rem(entries, page_size), 0)
    cols = col + lax.broadcasted_iota(jnp.int32, (entries.shape[0], width), 1)
    return pltr.load(pool_ref.at[rows[:, None], cols], mask=valid[:, None], other=0)


def fold_range_kv(
    state: online_softmax.SoftmaxState,
    q,  # [heads, D]
    pool_ref,  # [num_pages * page_size, row]: K and V of several heads side by side in a row
    page_table_ref,  # int32[batch, pages_per_seq]
    b,
    lo,  # int32 scalar: first entry (inclusive)
    hi,  # int32 scalar: last entry (exclusive)
    k_col,  # int32 scalar: first column of the keys (D wide)
    v_col,  # int32 scalar: first column of the values, or None: V = K
    *,
    page_size: int,
    block_k: int,
    scale: float,
    softcap: float | None = None,
) -> online_softmax.SoftmaxState:
    """`fold_range` over column slices of the rows: keys at k_col, values at v_col (None = the keys)."""
    num_blocks = pl.cdiv(jnp.maximum(hi - lo, 0), block_k)
    head_dim = q.shape[1]

    def body(j, carry):
        entries = lo + j * block_k + lax.iota(jnp.int32, block_k)
        valid = entries < hi
        load = lambda col: gather_row_slices(
            pool_ref, page_table_ref, b, entries, valid, col, width=head_dim, page_size=page_size
        )
        k = load(k_col)
        v = k if v_col is None else load(v_col)
        return online_softmax.fold_block_kv(carry, q, k, v, valid[None, :], scale, softcap)

    return lax.fori_loop(0, num_blocks, body, state)
