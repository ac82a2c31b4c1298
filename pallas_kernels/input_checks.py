"""Trace-time validation of shapes, dtypes and static arguments shared by the public ops.

Every failure raises `ValueError` whose message starts with `name=value` (the `f"{x=}"` style) and
says what is allowed. Only static facts are checked (shapes, dtypes, Python ints): values inside
arrays (lengths, page ids, indices) are data, and the kernels define what they do with any value.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from pallas_kernels import stacked_pools

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
INT32 = (jnp.dtype(jnp.int32),)
POOL_RANKS = (3, 4)  # one layer's pool, or pools stacked over layers (see `stacked_pools`)


def check_array(name: str, x, *, rank: int | tuple[int, ...], dtypes: Sequence, layout: str) -> None:
    """`x` must be an array of rank `rank` (or one of them) with a dtype in `dtypes`; `layout`
    names the axes."""
    shape = getattr(x, "shape", None)
    if shape is None:
        raise ValueError(f"{name}={type(x).__name__} must be an array {layout}")
    ranks = (rank,) if isinstance(rank, int) else tuple(rank)
    if len(shape) not in ranks:
        allowed = " or ".join(map(str, ranks))
        raise ValueError(f"{name}.shape={tuple(shape)} must have rank {allowed}: {layout}")
    dtype = jnp.dtype(x.dtype)
    if dtype not in tuple(jnp.dtype(d) for d in dtypes):
        allowed = ", ".join(str(jnp.dtype(d)) for d in dtypes)
        raise ValueError(f"{name}.dtype={dtype} must be one of ({allowed})")


def check_dim(name: str, x, axis: int, expected: int, meaning: str) -> None:
    """`x.shape[axis]` must equal `expected` (`meaning` says where that number comes from)."""
    got = x.shape[axis]
    if got != expected:
        raise ValueError(f"{name}.shape={tuple(x.shape)}: axis {axis} is {got}, must be {expected} ({meaning})")


def check_same_dtype(name: str, x, other_name: str, other) -> None:
    """`x` must have `other`'s dtype."""
    if jnp.dtype(x.dtype) != jnp.dtype(other.dtype):
        raise ValueError(f"{name}.dtype={jnp.dtype(x.dtype)} must equal {other_name}.dtype={jnp.dtype(other.dtype)}")


def check_static_int(name: str, value, *, lo: int, hi: int | None = None) -> None:
    """`value` must be a Python int in [lo, hi] (hi=None: no upper bound)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r} must be a static Python int in [{lo}, {hi or 'inf'}]")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name}={value} must be in [{lo}, {hi if hi is not None else 'inf'}]")


def check_scale(scale) -> None:
    """`scale` must be None (head_dim**-0.5) or a positive Python number."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) or not scale > 0:
        raise ValueError(f"{scale=} must be None (head_dim**-0.5) or a positive Python float")


def check_power_of_two(name: str, value: int, why: str) -> None:
    """`value` must be a power of two (`why` says what needs it)."""
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two ({why})")


def check_sinks(sinks, num_heads: int) -> None:
    """`sinks` must be None or float32[num_heads]."""
    if sinks is None:
        return
    check_array("sinks", sinks, rank=1, dtypes=(jnp.float32,), layout="float32[num_heads]")
    check_dim("sinks", sinks, 0, num_heads, "q.shape[1], one sink logit per query head")


def check_page_table(name: str, page_table, batch: int) -> None:
    """`page_table` must be int32[batch, pages_per_seq] with pages_per_seq >= 1."""
    check_array(name, page_table, rank=2, dtypes=INT32, layout="int32[batch, pages_per_seq]")
    check_dim(name, page_table, 0, batch, "batch")
    if page_table.shape[1] < 1:
        raise ValueError(f"{name}.shape={tuple(page_table.shape)} must have pages_per_seq >= 1")


def check_counts(name: str, counts, batch: int) -> None:
    """`counts` (per-sequence lengths or entry counts) must be int32[batch]."""
    check_array(name, counts, rank=1, dtypes=INT32, layout="int32[batch]")
    check_dim(name, counts, 0, batch, "batch")


def check_pool(
    name: str, pool, *, layout: str, like_name: str, like, row: int, row_meaning: str, layer_name: str, layer
) -> None:
    """A paged pool: a float array of rank 3 (one layer's) or 4 (stacked over layers, with a layer index;
    `stacked_pools.check_layer`), in `like`'s dtype, rows of `row` elements.

    Args:
      name, pool: the pool argument's name and value.
      layout: its axes, for messages ("[(layers,) num_pages, page_size, head_dim]").
      like_name, like: the argument whose dtype the pool must have (the queries).
      row, row_meaning: the row width it must have, and where that number comes from.
      layer_name, layer: the layer-index argument's name and value.
    """
    check_array(name, pool, rank=POOL_RANKS, dtypes=FLOAT_DTYPES, layout=layout)
    check_same_dtype(name, pool, like_name, like)
    check_dim(name, pool, -1, row, row_meaning)
    stacked_pools.check_layer(name, layer_name, pool, layer)


def check_decode_batch(q, lengths, page_table_name: str, page_table, sinks) -> None:
    """A decode attention's per-sequence arguments against q [batch, num_heads, head_dim]: lengths
    int32[batch], the page table int32[batch, pages_per_seq] (named `page_table_name`), sinks
    f32[num_heads] or None."""
    batch, num_heads = q.shape[:2]
    check_array("lengths", lengths, rank=1, dtypes=INT32, layout="int32[batch]")
    check_dim("lengths", lengths, 0, batch, "q.shape[0], batch")
    check_page_table(page_table_name, page_table, batch)
    check_sinks(sinks, num_heads)
