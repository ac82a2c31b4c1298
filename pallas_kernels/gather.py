"""Paged gather: the pages of one pool, through a page table, into contiguous rows per sequence.

Used where a dense copy of a paged object is needed: prefill attention over the cached prefix, and the
disk tier, which writes a sequence's block of rows out contiguously.

    pool:       [num_pages, page_size, dim]        bf16 | f32   one pool (one layer, one object)
    page_table: int32[batch, pages_per_seq]                     logical page i of b -> physical page
    lengths:    int32[batch]                                    rows that exist for b
    ->          [batch, pages_per_seq * page_size, dim]         row p of b = pool[pt[b, p // ps], p % ps]
                                                                for p < lengths[b], zeros after

Logical pages at or beyond cdiv(lengths[b], page_size) are never read, so their page-table entries may
hold anything (for example -1 for "unallocated"). Entries for pages that are read must be in
[0, num_pages): that is data, and cannot be checked at trace time. To gather only a range of logical
pages, slice the page table (and subtract the skipped rows from `lengths`) before calling.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltr

from pallas_kernels import dispatch, stacked_pools
from pallas_kernels import input_checks as checks


# ----------------------------------------------------------------------------------------------
# GPU kernel (Triton lowering): one program per (sequence, logical page).
# ----------------------------------------------------------------------------------------------
def paged_gather_kernel_gpu(
    lengths_ref,  # int32[batch]                                  (whole array)
    page_table_ref,  # int32[batch, pages_per_seq]                (whole array)
    pool_ref,  # [num_pages * page_size, dim]                     (whole pool, pages flattened to rows)
    out_ref,  # [page_size, dim]                                  logical page i of sequence b
):
    b, i = pl.program_id(0), pl.program_id(1)
    page_size, dim = out_ref.shape
    offsets = jax.lax.broadcasted_iota(jnp.int32, (page_size, dim), 0)  # [page_size, dim]
    cols = jax.lax.broadcasted_iota(jnp.int32, (page_size, dim), 1)  # [page_size, dim]
    valid = i * page_size + offsets < lengths_ref[b]  # [page_size, dim]
    page = page_table_ref[b, i]
    # Masked-off rows issue no memory access: pages past the length are never read.
    rows = jnp.where(valid, page * page_size + offsets, 0)
    out_ref[...] = pltr.load(pool_ref.at[rows, cols], mask=valid, other=0)


def _paged_gather_gpu(pool, page_table, lengths, *, interpret, num_warps: int = 4):
    num_pages, page_size, dim = pool.shape
    batch, pages_per_seq = page_table.shape
    whole = lambda shape: pl.BlockSpec(shape, lambda b, i: (0,) * len(shape))
    return pl.pallas_call(
        paged_gather_kernel_gpu,
        grid=(batch, pages_per_seq),
        in_specs=[
            whole((batch,)),
            whole((batch, pages_per_seq)),
            whole((num_pages * page_size, dim)),
        ],
        out_specs=pl.BlockSpec((None, page_size, dim), lambda b, i: (b, i, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, pages_per_seq * page_size, dim), pool.dtype),
        interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        name="paged_gather",
    )(lengths, page_table, pool.reshape(num_pages * page_size, dim))


# ----------------------------------------------------------------------------------------------
# TPU kernel (Mosaic): one program per (sequence, logical page); the page is DMA'd straight from
# HBM into the output block, and only when it holds at least one row below the length.
# ----------------------------------------------------------------------------------------------
def paged_gather_kernel_tpu(
    lengths_ref,  # SMEM int32[batch]                             scalar prefetch
    page_table_ref,  # SMEM int32[batch * pages_per_seq]          scalar prefetch (flattened)
    pool_hbm_ref,  # HBM [num_pages, page_size, dim]              (memory_space=ANY)
    out_ref,  # VMEM [1, page_size, dim]                          logical page i of sequence b
    sem,  # DMA semaphore
    *,
    pages_per_seq: int,
):
    b, i = pl.program_id(0), pl.program_id(1)
    _, page_size, dim = out_ref.shape
    length = lengths_ref[b]

    @pl.when(i * page_size < length)
    def _copy_page():
        page = page_table_ref[b * pages_per_seq + i]
        # The block keeps its leading unit axis so source and target of the DMA have equal shapes.
        copy = pltpu.make_async_copy(pool_hbm_ref.at[pl.ds(page, 1)], out_ref, sem)
        copy.start()
        copy.wait()
        positions = i * page_size + jax.lax.broadcasted_iota(jnp.int32, (1, page_size, dim), 1)
        out_ref[...] = jnp.where(positions < length, out_ref[...], jnp.zeros_like(out_ref))

    @pl.when(i * page_size >= length)
    def _zero_page():
        out_ref[...] = jnp.zeros_like(out_ref)


def _paged_gather_tpu(pool, page_table, lengths, *, interpret):
    _, page_size, dim = pool.shape
    batch, pages_per_seq = page_table.shape
    return pl.pallas_call(
        functools.partial(paged_gather_kernel_tpu, pages_per_seq=pages_per_seq),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, pages_per_seq),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((1, page_size, dim), lambda b, i, *_: (b * pages_per_seq + i, 0, 0)),
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct((batch * pages_per_seq, page_size, dim), pool.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="paged_gather",
    )(lengths, page_table.reshape(-1), pool).reshape(batch, pages_per_seq * page_size, dim)


# ----------------------------------------------------------------------------------------------
# Public function.
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("backend", "interpret"))
def paged_gather(
    pool: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    backend: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Gathers each sequence's rows from a paged pool into a contiguous array.

    Args:
      pool: [num_pages, page_size, dim], bf16 or f32; or [layers, num_pages, page_size, dim]
        stacked over layers, with `layer` set (see `pallas_kernels.stacked_pools`).
      page_table: int32[batch, pages_per_seq]; logical page i of sequence b is physical page
        `page_table[b, i]`. Entries of pages at or past cdiv(lengths[b], page_size) are never read.
      lengths: int32[batch]; rows (tokens) that exist for each sequence, at most
        pages_per_seq * page_size.
      layer: index into a stacked pool (int or int32 scalar, may be traced); None for rank 3.
      backend: "gpu" | "tpu" | "reference" | None (auto, see `pallas_kernels.dispatch`).
      interpret: run the Pallas kernel in the interpreter (CPU testing).

    Returns:
      [batch, pages_per_seq * page_size, dim] in pool.dtype; rows at or past lengths[b] are zero.
    """
    checks.check_array(
        "pool", pool, rank=checks.POOL_RANKS, dtypes=checks.FLOAT_DTYPES, layout="[(layers,) num_pages, page_size, dim]"
    )
    checks.check_array("lengths", lengths, rank=1, dtypes=checks.INT32, layout="int32[batch]")
    checks.check_page_table("page_table", page_table, lengths.shape[0])
    stacked_pools.check_layer("pool", "layer", pool, layer)
    pool, page_table = stacked_pools.flat_view(pool, page_table, layer)
    resolved = dispatch.resolve_backend(backend, interpret)
    if resolved == "reference":
        return paged_gather_reference(pool, page_table, lengths)
    if resolved == "gpu":
        _, page_size, dim = pool.shape
        checks.check_power_of_two("page_size", page_size, "Triton blocks are powers of two")
        checks.check_power_of_two("dim", dim, "Triton blocks are powers of two")
        return _paged_gather_gpu(
            pool, page_table, lengths, interpret=dispatch.pallas_interpret_arg(resolved, interpret)
        )
    return _paged_gather_tpu(pool, page_table, lengths, interpret=dispatch.pallas_interpret_arg(resolved, interpret))


# ----------------------------------------------------------------------------------------------
# Reference (plain jnp).
# ----------------------------------------------------------------------------------------------
def paged_gather_reference(pool: jax.Array, page_table: jax.Array, lengths: jax.Array) -> jax.Array:
    """jnp reference of `paged_gather`: same arguments and result, no validation."""
    _, page_size, _ = pool.shape
    _, pages_per_seq = page_table.shape
    positions = jnp.arange(pages_per_seq * page_size, dtype=jnp.int32)  # [rows]
    valid = positions[None, :] < lengths[:, None]  # [batch, rows]
    pages = jnp.where(valid, page_table[:, positions // page_size], 0)  # [batch, rows]
    rows = pool[pages, positions[None, :] % page_size]  # [batch, rows, dim]
    return jnp.where(valid[..., None], rows, jnp.zeros((), pool.dtype))
