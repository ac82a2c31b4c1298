"""TPU (Mosaic) helpers: DMA K=V rows of a paged pool from HBM into VMEM and fold them.

Pools stay in HBM (`memory_space=ANY`); page tables are flattened int32 arrays in SMEM (scalar
prefetch), so sequence b's logical page i is `page_table_ref[b * pages_per_seq + i % pages_per_seq]`.
A DMA is started only for a page (or a selected row) that holds at least one attended row, so the
kernel never reads the others. Refs are indexed (`.at[...]`, `ref[slot]`), never reshaped.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import online_softmax


def table_page(page_table_ref, table_offset, logical_page, *, pages_per_seq: int):
    """The physical page of a sequence's logical page (int32 scalar >= 0): entry `logical_page %
    pages_per_seq` of the sequence's slice of the flattened SMEM table, which starts at `table_offset`
    (b * pages_per_seq); the modulo makes a short table a ring."""
    return page_table_ref[table_offset + lax.rem(logical_page, pages_per_seq)]


def mask_page(page, base, lo, hi):
    """(page with its rows outside entries [lo, hi) zeroed, valid bool[1, page_size]) for a page
    [page_size, D] whose first row is entry `base` (lo None: no lower bound, the range starts at 0).
    Rows outside the range may be unwritten slots (NaN): zeroed, they contribute exact zeros; `valid`
    masks their columns of the logits."""
    page_size = page.shape[0]
    row_pos = base + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)  # [page_size, 1]
    col_pos = base + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)  # [1, page_size]
    in_range = (lambda pos: pos < hi) if lo is None else (lambda pos: (pos >= lo) & (pos < hi))
    page = jnp.where(in_range(row_pos), page, jnp.zeros_like(page))
    return page, in_range(col_pos)


def scan_pages(
    pool_hbm_ref,  # HBM [num_pages, page_size, D]
    page_table_ref,  # SMEM int32[batch * pages_per_seq]
    table_offset,  # int32 scalar: b * pages_per_seq
    lo,  # int32 scalar: first entry (inclusive), >= 0
    hi,  # int32 scalar: last entry (exclusive)
    page_buf,  # VMEM [2, page_size, D]: double buffer
    sems,  # DMA semaphores [2]
    fn,  # fn(j, base, page [page_size, D], carry) -> carry
    init,
    *,
    pages_per_seq: int,
):
    """Runs `fn` on every page overlapping entries [lo, hi), DMA-ing page j+1 while `fn` runs on j.

    `j` counts pages from the one holding `lo`; `base` is the entry index of the page's first row.
    Rows of a page outside [lo, hi) are whatever the page holds (possibly never written): `fn`
    masks them. Pages that do not overlap [lo, hi) are never copied.
    """
    page_size = page_buf.shape[1]
    first_page = lax.div(lo, page_size)  # lo >= 0; lax.div, not //, which needs sign()
    num_pages = jnp.maximum(pl.cdiv(hi, page_size) - first_page, 0)

    def page_copy(j, slot):
        page = table_page(page_table_ref, table_offset, first_page + j, pages_per_seq=pages_per_seq)
        return pltpu.make_async_copy(pool_hbm_ref.at[page], page_buf.at[slot], sems.at[slot])

    @pl.when(num_pages > 0)
    def _prefetch_first():
        page_copy(0, 0).start()

    def body(j, carry):
        slot = lax.rem(j, 2)

        @pl.when(j + 1 < num_pages)
        def _prefetch_next():
            page_copy(j + 1, 1 - slot).start()

        page_copy(j, slot).wait()
        return fn(j, (first_page + j) * page_size, page_buf[slot], carry)

    return lax.fori_loop(0, num_pages, body, init)


def fold_page_range(
    state: online_softmax.SoftmaxState,
    q,  # [heads, D]
    pool_hbm_ref,  # HBM [num_pages, page_size, D]
    page_table_ref,  # SMEM int32[batch * pages_per_seq]
    table_offset,  # int32 scalar: b * pages_per_seq
    lo,  # int32 scalar: first entry (inclusive)
    hi,  # int32 scalar: last entry (exclusive)
    page_buf,  # VMEM [2, page_size, D]: double buffer
    sems,  # DMA semaphores [2]
    *,
    pages_per_seq: int,
    scale: float,
) -> online_softmax.SoftmaxState:
    """Folds entries [lo, hi) of one sequence into the softmax state, page by page."""

    def fold_page(j, base, kv, carry):
        del j
        kv, valid = mask_page(kv, base, lo, hi)
        return online_softmax.fold_block(carry, q, kv, valid, scale)

    return scan_pages(
        pool_hbm_ref,
        page_table_ref,
        table_offset,
        lo,
        hi,
        page_buf,
        sems,
        fold_page,
        state,
        pages_per_seq=pages_per_seq,
    )


def fold_selected_rows(
    state: online_softmax.SoftmaxState,
    q,  # [heads, D]
    pool_hbm_ref,  # HBM [num_pages, page_size, D]
    page_table_ref,  # SMEM int32[batch * pages_per_seq]
    table_offset,  # int32 scalar: b * pages_per_seq
    indices_smem_ref,  # SMEM int32[1, topk_padded]: selected entries, -1 = none
    indices_vmem_ref,  # VMEM int32[num_chunks, block_k]: the same indices, as vectors
    num_visible,  # int32 scalar: entries >= this are skipped like -1
    row_buf,  # VMEM [block_k, D]: zeroed by the caller before the first call
    sem,  # DMA semaphore
    *,
    pages_per_seq: int,
    scale: float,
) -> online_softmax.SoftmaxState:
    """Folds selected entries, block_k at a time: one row DMA per valid index, none for -1."""
    block_k = row_buf.shape[0]
    page_size = pool_hbm_ref.shape[1]
    num_chunks = indices_vmem_ref.shape[0]

    def row_copy(entry, r):
        page = table_page(page_table_ref, table_offset, lax.div(entry, page_size), pages_per_seq=pages_per_seq)
        return pltpu.make_async_copy(
            pool_hbm_ref.at[page, pl.ds(lax.rem(entry, page_size), 1)], row_buf.at[pl.ds(r, 1)], sem
        )

    def body(c, carry):
        entries = [indices_smem_ref[0, c * block_k + r] for r in range(block_k)]
        oks = [(e >= 0) & (e < num_visible) for e in entries]
        for r in range(block_k):
            pl.when(oks[r])(lambda r=r: row_copy(entries[r], r).start())
        for r in range(block_k):
            pl.when(oks[r])(lambda r=r: row_copy(entries[r], r).wait())
        # Rows of skipped indices still hold zeros or rows of an earlier chunk: finite, and masked.
        chunk = indices_vmem_ref[pl.ds(c, 1), :]  # [1, block_k]
        valid = (chunk >= 0) & (chunk < num_visible)
        return online_softmax.fold_block(carry, q, row_buf[...], valid, scale)

    return lax.fori_loop(0, num_chunks, body, state)
