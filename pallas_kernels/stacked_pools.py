"""Pools stacked over layers: `[layers, num_pages, page_size, dim]` plus a layer index.

A cache that keeps every layer of a group in one array, with one page table shared by the layers
(page p of layer l is `pool[l, p]`), passes the stacked pool and the layer index. The kernels then
read the stacked array in place: it is viewed as `[layers * num_pages, page_size, dim]` (a free
reshape of a contiguous array) and the page table is offset by `layer * num_pages`. Slicing
`pool[layer]` instead would, inside jit, copy the layer's whole pool on every call.

Page-table entries the kernel does not need (-1 for unmapped, say) are offset too and stay unread.
The layer index is data (a traced int32 scalar under jit, so one compile serves every layer of a
scanned stack); it is clamped to [0, layers - 1], never checked against the range.
"""

from __future__ import annotations

import jax.numpy as jnp


def check_layer(pool_name: str, layer_name: str, pool, layer) -> None:
    """A rank-4 (stacked) pool needs a layer index; a rank-3 pool must not get one."""
    if pool.ndim == 3:
        if layer is not None:
            raise ValueError(
                f"{layer_name}={layer!r} must be None: {pool_name}.shape="
                f"{tuple(pool.shape)} is one layer's pool (rank 3)"
            )
        return
    num_layers = pool.shape[0]
    if layer is None:
        raise ValueError(
            f"{layer_name}=None: {pool_name}.shape={tuple(pool.shape)} is stacked "
            f"[layers, num_pages, page_size, dim]; pass {layer_name} in [0, {num_layers - 1}]"
        )
    # Under jit a Python int arrives as a traced int32 scalar: only its shape and dtype are known.
    shape, dtype = getattr(layer, "shape", None), getattr(layer, "dtype", None)
    if shape != () or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{layer_name}={layer!r} must be a Python int or an integer scalar array")


def flat_view(pool, page_table, layer):
    """(pool as [pages, page_size, dim], page_table addressing it) for a rank-3 or rank-4 pool."""
    if pool.ndim == 3:
        return pool, page_table
    num_layers, num_pages, page_size, dim = pool.shape
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1)
    return (pool.reshape(num_layers * num_pages, page_size, dim), page_table + layer * jnp.int32(num_pages))
