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


def entry_rows(page_table_ref, b, entries, valid, *, page_size: int) -> jax.Array:
    """int32[block]: the rows of the pool viewed as [num_pages * page_size, ...] that hold `entries`
    (int32[block], entry or position indices) of sequence b (int32 scalar), through page_table_ref
    (int32[batch, pages_per_seq]; a ring when it is short); 0 where `valid` (bool[block]) is False, and
    those entries' page-table entries are not read."""
    pages_per_seq = page_table_ref.shape[1]
    logical_page = jnp.where(valid, lax.rem(entries // page_size, pages_per_seq), 0)
    physical_page = page_table_ref[b, logical_page]  # [block]
    return jnp.where(valid, physical_page * page_size + lax.rem(entries, page_size), 0)


def gather_rows(
    pool_ref,  # [num_pages * page_size, row]
    page_table_ref,  # int32[batch, pages_per_seq]
    b,  # int32 scalar: sequence
    entries,  # int32[block]: entry (position) indices
    valid,  # bool[block]: which entries to load
    col=None,  # int32 scalar: first column of a slice of the rows, or None: whole rows
    *,
    page_size: int,
    width: int | None = None,  # columns of the slice (with col)
) -> jax.Array:
    """[block, row] rows of `entries`, or [block, width] columns [col, col + width) of them; rows where
    `valid` is False are 0 and are not read."""
    rows = entry_rows(page_table_ref, b, entries, valid, page_size=page_size)
    cols = lax.broadcasted_iota(jnp.int32, (entries.shape[0], pool_ref.shape[1] if col is None else width), 1)
    if col is not None:
        cols = col + cols
    return pltr.load(pool_ref.at[rows[:, None], cols], mask=valid[:, None], other=0)


def fold_entry_blocks(state, lo, hi, fold, *, block_k: int):
    """Runs `fold(entries int32[block_k], valid bool[block_k], state) -> state` over the blocks of
    entries [lo, hi), block_k at a time from lo (valid: below hi); cdiv(hi - lo, block_k) iterations."""
    num_blocks = pl.cdiv(jnp.maximum(hi - lo, 0), block_k)

    def body(j, carry):
        entries = lo + j * block_k + lax.iota(jnp.int32, block_k)
        return fold(entries, entries < hi, carry)

    return lax.fori_loop(0, num_blocks, body, state)


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

    def fold(entries, valid, carry):
        kv = gather_rows(pool_ref, page_table_ref, b, entries, valid, page_size=page_size)
        return online_softmax.fold_block(carry, q, kv, valid[None, :], scale)

    return fold_entry_blocks(state, lo, hi, fold, block_k=block_k)


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
    head_dim = q.shape[1]

    def fold(entries, valid, carry):
        load = lambda col: gather_rows(
            pool_ref, page_table_ref, b, entries, valid, col, page_size=page_size, width=head_dim
        )
        k = load(k_col)
        v = k if v_col is None else load(v_col)
        return online_softmax.fold_block_kv(carry, q, k, v, valid[None, :], scale, softcap)

    return fold_entry_blocks(state, lo, hi, fold, block_k=block_k)
