"""What the paged decode attentions (SWA, HCA, CSA, GQA) and the indexer share outside their folds.

The folds themselves (reading paged rows and folding them into an online softmax) are
`paged_folds_gpu`, `paged_folds_tpu` and `online_softmax`; the SWA/HCA/CSA kernel is
`window_decode`'s. This module holds what more than one op module needs:

* GPU tiles: `GPU_BLOCK_H`, `GPU_BLOCK_K`.
* The `pl.pallas_call` of a decode attention: `decode_call_gpu` (one program per sequence and block
  of query heads), `decode_call_tpu` (one program per sequence), their BlockSpecs `whole_block` and
  `per_sequence_block`, and `pool_rows` (a pool as the rows the GPU kernels address).
* What the newest token sees: `window_pages`, `visible_entries`.
* Trace-time validation: `check_window_table`, `check_gpu_head_dim` (the generic checks are
  `input_checks`').
* References (plain jnp): `compressed_rows_reference`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltr

from pallas_kernels import index_math as im
from pallas_kernels import input_checks as checks

# GPU tiles: query heads per program (Triton dot tiles need >= 16) and rows folded per step. Untuned
# defaults; the GPU wrappers (`window_decode.window_decode_gpu`, `gqa_decode`'s) take others
# (benchmarks/decode_kernels.py --sweep).
GPU_BLOCK_H = 16
GPU_BLOCK_K = 32


# ----------------------------------------------------------------------------------------------
# BlockSpecs and the pallas_call of a decode attention.
# ----------------------------------------------------------------------------------------------
def whole_block(shape: Sequence[int]) -> pl.BlockSpec:
    """A BlockSpec by which every program (any grid, scalar-prefetch refs or not) sees the whole array
    of `shape`."""
    return pl.BlockSpec(tuple(shape), lambda *_: (0,) * len(shape))


def per_sequence_block(shape: Sequence[int], memory_space: Any = None) -> pl.BlockSpec:
    """A BlockSpec by which program (b, ...) sees row b of a [batch, ...] array of `shape`, without the
    batch axis (in `memory_space`; None: the backend's default)."""
    rest = tuple(shape[1:])
    return pl.BlockSpec((None, *rest), lambda b, *_: (b,) + (0,) * len(rest), memory_space=memory_space)


def pool_rows(pool) -> jax.Array:
    """A pool [num_pages, page_size, row] as [num_pages * page_size, row], the rows the GPU kernels
    address (`paged_folds_gpu`)."""
    num_pages, page_size, row = pool.shape
    return pool.reshape(num_pages * page_size, row)


def decode_call_gpu(
    kernel: Callable,
    q,
    sinks,
    operands: Sequence[jax.Array],
    per_sequence: Sequence[jax.Array] = (),
    *,
    block_h: int,
    num_warps: int,
    num_stages: int,
    interpret: Any,
    name: str,
) -> jax.Array:
    """A decode attention's GPU kernel (Triton lowering), one program per sequence and block of query heads.

    Args:
      kernel: kernel(*operand_refs, *per_sequence_refs, q_ref [block_h, head_dim], sinks_ref
        f32[block_h, 1], out_ref [block_h, head_dim]), static arguments bound.
      q: [batch, *heads, head_dim], the last head axis a multiple of block_h (padded); the grid is
        (batch, *heads[:-1], heads[-1] // block_h), e.g. (batch, num_kv_heads, group // block_h) for GQA.
      sinks: f32[*heads, 1] (padded like q).
      operands: arrays every program reads whole: counts, page tables, pools as rows (`pool_rows`); None
        (an operand this use of the kernel has not) reaches the kernel as None.
      per_sequence: [batch, ...] arrays (or None) of which program (b, ...) reads row b.
      block_h: query heads per program.
      num_warps, num_stages: Triton compiler parameters.
      interpret: `pl.pallas_call`'s (`dispatch.pallas_interpret_arg`).
      name: the kernel's name (in profiles).

    Returns:
      [batch, *heads, head_dim] in q.dtype.
    """
    *heads, head_dim = q.shape[1:]
    lead = (None,) * (len(heads) - 1)  # head axes a program sees one of (GQA's KV head)
    q_block = pl.BlockSpec((None, *lead, block_h, head_dim), lambda b, *h: (b, *h, 0))
    return pl.pallas_call(
        kernel,
        grid=(q.shape[0], *heads[:-1], heads[-1] // block_h),
        in_specs=[
            *(None if x is None else whole_block(x.shape) for x in operands),
            *(None if x is None else per_sequence_block(x.shape) for x in per_sequence),
            q_block,
            pl.BlockSpec((*lead, block_h, 1), lambda b, *h: (*h, 0)),
        ],
        out_specs=q_block,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=name,
    )(*operands, *per_sequence, q, sinks)


def decode_call_tpu(
    kernel: Callable,
    q,
    sinks,
    scalars: Sequence[jax.Array],
    pools: Sequence[jax.Array],
    scratch_shapes: Sequence[Any],
    per_sequence: Sequence[tuple[jax.Array, Any]] = (),
    *,
    interpret: Any,
    name: str,
) -> jax.Array:
    """A decode attention's TPU kernel (Mosaic), one program per sequence with all its query heads.

    Args:
      kernel: kernel(*scalar_refs, *pool_refs, *per_sequence_refs, q_ref, sinks_ref, out_ref,
        *scratch_refs), static arguments bound.
      q: [batch, *heads, head_dim]; program b reads q[b] into VMEM and writes out[b].
      sinks: f32[*heads, 1], read whole into VMEM.
      scalars: int32 arrays prefetched into SMEM (counts, page tables flattened to 1-D).
      pools: arrays left in HBM (memory_space ANY), which the kernel DMAs from.
      scratch_shapes: the kernel's VMEM buffers and DMA semaphores.
      per_sequence: (array [batch, ...], memory space or None for VMEM) pairs; program b reads row b.
      An array or scratch shape that is None (one this use of the kernel has not) reaches the kernel as
      None.
      interpret: `pl.pallas_call`'s (`dispatch.pallas_interpret_arg`).
      name: the kernel's name (in profiles).

    Returns:
      [batch, *heads, head_dim] in q.dtype.
    """
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(q.shape[0],),
            in_specs=[
                *(None if x is None else pl.BlockSpec(memory_space=pl.ANY) for x in pools),
                *(None if x is None else per_sequence_block(x.shape, space) for x, space in per_sequence),
                per_sequence_block(q.shape),
                whole_block(sinks.shape),
            ],
            out_specs=per_sequence_block(q.shape),
            scratch_shapes=list(scratch_shapes),
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name=name,
    )(*scalars, *pools, *(x for x, _ in per_sequence), q, sinks)


# ----------------------------------------------------------------------------------------------
# What the newest token sees.
# ----------------------------------------------------------------------------------------------
def window_pages(window: int, page_size: int) -> int:
    """The most pages a window of `window` consecutive rows can overlap: cdiv(window - 1, page_size) + 1."""
    return pl.cdiv(window - 1, page_size) + 1


def visible_entries(lengths, n_compressed, compress_ratio: int, capacity: int) -> jax.Array:
    """Compressed entries (or index keys) the newest token may attend to: min(n_compressed,
    lengths // compress_ratio) clipped to [0, capacity].

    Args:
      lengths: int32[batch] tokens per sequence, the newest included.
      n_compressed: int32[batch] entries written per sequence.
      compress_ratio: tokens per entry (static).
      capacity: entries the page table can address (pages_per_seq * page_size).

    Returns:
      int32[batch].
    """
    causal = im.div(jnp.maximum(lengths, 0), compress_ratio)
    return jnp.clip(jnp.minimum(n_compressed, causal), 0, capacity)


# ----------------------------------------------------------------------------------------------
# Trace-time validation.
# ----------------------------------------------------------------------------------------------
def check_window_table(name: str, page_table, window: int, page_size: int) -> None:
    """A page table addressed by absolute position must hold at least `window_pages(window, page_size)`
    pages per sequence (a ring of them when short); raises ValueError naming `name` otherwise."""
    needed = window_pages(window, page_size)
    if page_table.shape[1] < needed:
        raise ValueError(
            f"{name}.shape={tuple(page_table.shape)} must have at least {needed} pages per sequence "
            f"(the most pages a window of {window} rows can overlap)"
        )


def check_gpu_head_dim(name: str, head_dim: int) -> None:
    """The GPU kernels load [rows, head_dim] blocks and multiply them on Triton dot tiles: `head_dim`
    must be a power of two >= 16; raises ValueError naming `name` otherwise."""
    checks.check_power_of_two(name, head_dim, "Triton blocks are powers of two")
    if head_dim < 16:
        raise ValueError(f"{name}={head_dim} must be >= 16 on the GPU backend (Triton dot tiles)")


# ----------------------------------------------------------------------------------------------
# References (plain jnp).
# ----------------------------------------------------------------------------------------------
def compressed_rows_reference(pool, page_table, entries, valid) -> jax.Array:
    """The rows of entries of a paged pool of per-sequence entries (compressed K=V rows, index keys).

    Args:
      pool: [num_pages, page_size, dim]; entry w of sequence b is row w % page_size of physical page
        page_table[b, (w // page_size) % pages_per_seq].
      page_table: int32[batch, pages_per_seq].
      entries: int32[batch, n] entry indices, >= 0 where valid.
      valid: bool[batch, n]; invalid entries (and their page-table entries) are not looked up.

    Returns:
      [batch, n, dim]: the rows of valid entries; those of invalid ones are row 0 of page 0 (to mask).
    """
    page_size = pool.shape[1]
    pages_per_seq = page_table.shape[1]
    safe = jnp.where(valid, entries, 0)  # (entries >= 0 where valid)
    logical = im.rem(im.div(safe, page_size), pages_per_seq)
    pages = jnp.where(valid, im.take_rows(page_table, logical), 0)
    return pool[pages, im.rem(safe, page_size)]
