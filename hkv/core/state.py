"""`HybridCache`: the whole device-side cache state as one immutable pytree.

Static capacities live in `CacheLayout` (hashable, a jit static argument); everything that changes
lives in `HybridCache` and is only ever replaced by a transition (`hkv.core.transitions`).

Per group g (see `CacheSpec.groups`), with S slots, P_g physical pages of `page_size` rows:
    pool        [L_g, P_g, page_size, dim_g]   rows of every layer of the group (`CacheLayout.pool_dtype`)
    page_table  int32[S, M_g]                  logical page -> physical page, -1 = unmapped
    page_gen    int32[S, M_g]                  generation of the physical page when it was mapped
    refcount    int32[P_g]                     references from page tables (0 = free)
    generation  int32[P_g]                     bumped whenever a page is freed
Row r of a slot (token position r for SWA, entry r for compressed/indexer groups) lives at
logical page r // page_size, offset r % page_size — the layout `pallas_kernels` reads.

Per compressor c (layer's compressor or indexer), TAIL state:
    tail_kv, tail_gate  [S, ratio, proj_width]   projected rows of the open window (first
                                                  length % ratio rows valid), gate not yet biased
    overlap_kv          [S, ratio, entry_dim]    Ca slice of the last closed window (overlap only)
    overlap_gate        f32[S, ratio, entry_dim] its gate, biased by `ape`; -inf = no window yet

The state table (article §3), per slot x cache block of `block_tokens` tokens:
    form        uint8[S, NB]   bitmask of ObjectKind present for the block (SWA, COMPRESSED, TAIL, INDEXER)
    indexer_version int32[S, NB]  version of the indexer keys covering the block
    residency   int8[S, NB]    ABSENT / DEVICE / HOST / DISK
    checksum    uint32[S, NB], location int32[S, NB]   of a swapped copy (0 / -1 when none)
    swa_start, swa_end int32[S]   SWA rows held: positions [swa_start, swa_end)
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .layout import CacheLayout, GroupState, StateTable, TailState
from .prefix_index import init_prefix
from .reasons import Reason
from .spec import CacheSpec, ObjectKind


@struct.dataclass
class HybridCache:
    """The cache state. `lengths[s]` tokens written to slot s; `active[s]` slot claimed."""

    lengths: jax.Array
    active: jax.Array
    groups: tuple[GroupState, ...]
    tails: tuple[TailState, ...]
    table: StateTable
    indexer_version: jax.Array  # int32 scalar (>= 1): version stamped on indexer keys written now
    abi: jax.Array  # uint32[4]: the spec's ABI fingerprint
    prefix: Any  # hkv.core.prefix_index.PrefixIndex: cached block records and TAIL snapshots
    counters: dict


COUNTERS = (
    "transitions",
    "failed_no_pages",
    "failed_slot_cap",
    "failed_context_cap",
    "pages_allocated",
    "pages_released",
    "tokens_written",
    "entries_sealed",
    "records_created",
    "snapshots_taken",
    "snapshots_skipped_full",
    "prefix_lookups",
    "prefix_hash_hit_tokens",
    "prefix_restored_tokens",
    "prefix_disk_restored_tokens",
    "evicted_swa_snapshots",
    "evicted_tail_snapshots",
    "evicted_records",
) + tuple(f"prefix_rejected_{r}" for r in Reason)


def init_cache(layout: CacheLayout) -> HybridCache:
    """An empty cache: no slot active, every page free, tails empty (overlap gates -inf).

    Built by one compiled program per layout (inside a trace it is inlined): built op by op it took
    one small compilation per distinct leaf shape in every new process.
    """
    return _init_cache_jit(layout)


def _init_cache(layout: CacheLayout) -> HybridCache:
    spec, s = layout.spec, layout.slots
    dt = spec.storage_dtype
    groups = []
    for g, grp in enumerate(layout.groups):
        p, m = layout.pool_pages(g), layout.logical_pages(g)
        groups.append(
            GroupState(
                pool=jnp.zeros((len(grp.layers), p, layout.page_size, spec.row_width(grp.dim)), layout.pool_dtype),
                page_table=jnp.full((s, m), -1, jnp.int32),
                page_gen=jnp.zeros((s, m), jnp.int32),
                refcount=jnp.zeros((p,), jnp.int32),
                generation=jnp.zeros((p,), jnp.int32),
            )
        )
    tails = []
    for _, _, c in spec.compressors():
        ov = c.ratio if c.overlap else 0
        tails.append(
            TailState(
                tail_kv=jnp.zeros((s, c.ratio, c.proj_width), dt),
                tail_gate=jnp.zeros((s, c.ratio, c.proj_width), dt),
                overlap_kv=jnp.zeros((s, ov, c.entry_dim), dt),
                overlap_gate=jnp.full((s, ov, c.entry_dim), -jnp.inf, jnp.float32),
            )
        )
    nb = layout.num_blocks
    table = StateTable(
        form=jnp.zeros((s, nb), jnp.uint8),
        indexer_version=jnp.zeros((s, nb), jnp.int32),
        residency=jnp.zeros((s, nb), jnp.int8),
        checksum=jnp.zeros((s, nb), jnp.uint32),
        location=jnp.full((s, nb), -1, jnp.int32),
        swa_start=jnp.zeros((s,), jnp.int32),
        swa_end=jnp.zeros((s,), jnp.int32),
    )
    return HybridCache(
        lengths=jnp.zeros((s,), jnp.int32),
        active=jnp.zeros((s,), bool),
        groups=tuple(groups),
        tails=tuple(tails),
        table=table,
        indexer_version=jnp.ones((), jnp.int32),
        abi=jnp.asarray(abi_words(spec)),
        prefix=init_prefix(layout),
        counters={k: jnp.zeros((), jnp.int32) for k in COUNTERS},
    )


_init_cache_jit = jax.jit(_init_cache, static_argnums=0)


@functools.lru_cache(maxsize=64)
def _layout_leaves(layout: CacheLayout) -> list:
    """(path, ShapeDtypeStruct) of every leaf of a cache of `layout` (traced once per layout: the
    `check_invariants` of a test's every step paid ~30 ms each for the trace)."""
    return jax.tree_util.tree_leaves_with_path(jax.eval_shape(lambda: _init_cache(layout)))


def check_layout(layout: CacheLayout, cache: HybridCache) -> None:
    """Raise ValueError if `cache` was not built for `layout` (any leaf's shape or dtype differs, or,
    on concrete values, the ABI fingerprint differs). Shape checks are free at trace time."""
    got_leaves = jax.tree_util.tree_leaves_with_path(cache)
    want_leaves = _layout_leaves(layout)
    if len(got_leaves) != len(want_leaves):
        raise ValueError(
            f"cache has {len(got_leaves)} arrays; the layout's spec needs {len(want_leaves)} "
            f"(a cache built for another spec?)"
        )
    for (path, g), (_, w) in zip(got_leaves, want_leaves, strict=True):
        if g.shape != w.shape or g.dtype != w.dtype:
            raise ValueError(
                f"cache{jax.tree_util.keystr(path)} is {g.dtype}{list(g.shape)} but the layout needs "
                f"{w.dtype}{list(w.shape)} (a cache built for another spec or config?)"
            )
    if not isinstance(cache.abi, jax.core.Tracer) and list(np.asarray(cache.abi)) != list(abi_words(layout.spec)):
        raise ValueError(
            f"cache ABI fingerprint differs from the layout's {layout.spec.fingerprint()} "
            f"(same shapes, different weights/dtypes/ratios/kernel layout)"
        )


def abi_words(spec: CacheSpec) -> np.ndarray:
    """The ABI fingerprint as uint32[4], stored in the cache so a value carries its spec identity."""
    return np.frombuffer(bytes.fromhex(spec.fingerprint()), dtype=np.uint32).copy()


def form_bits(*kinds: ObjectKind) -> int:
    """Bitmask of object kinds, as stored in `StateTable.form`."""
    return sum(1 << int(k) for k in kinds)
