"""`HybridCache`: the whole device-side cache state as one immutable pytree.

Static capacities live in `CacheLayout` (hashable, a jit static argument); everything that changes
lives in `HybridCache` and is only ever replaced by a transition (`hkv.transitions`).

Per group g (see `CacheSpec.groups`), with S slots, P_g physical pages of `page_size` rows:
    pool        [L_g, P_g, page_size, dim_g]   rows of every layer of the group (storage dtype)
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

import dataclasses
import enum
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .spec import CacheSpec, Group, ObjectKind


class Residency(enum.IntEnum):
    ABSENT = 0
    DEVICE = 1
    HOST = 2
    DISK = 3


class Status(enum.IntEnum):
    """Outcome of a transition. Anything but OK means the cache came back unchanged."""

    OK = 0
    NO_PAGES = 1
    SLOT_CAP = 2
    CONTEXT_CAP = 3
    UNKNOWN_SLOT = 4
    SLOT_INACTIVE = 5
    ORPHAN_BLOCK = 6  # a prefix record whose parent record is gone is not created
    BAD_REQUEST = 7  # a slot twice in one batch, or a length that would shrink


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Static capacities.

    slots: concurrent sequences. max_context: tokens per slot. page_size: rows per page.
    pool_pages: physical pages per group (in `CacheSpec.groups()` order); None sizes every pool
    for `slots` sequences of `max_context` tokens (no over-subscription) — with a prefix cache, give
    the pools room for cached blocks too.
    prefix_records: capacity of the prefix index (cached block boundaries); 0 disables prefix reuse.
    tail_snapshots: capacity of TAIL snapshot copies (None = prefix_records).
    """

    slots: int = 4
    max_context: int = 4096
    page_size: int = 16
    pool_pages: tuple[int, ...] | None = None
    prefix_records: int = 0
    tail_snapshots: int | None = None

    def __post_init__(self):
        for name in ("slots", "max_context", "page_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if not isinstance(self.prefix_records, int) or self.prefix_records < 0:
            raise ValueError(f"prefix_records={self.prefix_records!r} must be an integer >= 0 (0 = no prefix cache)")
        if self.tail_snapshots is not None and (not isinstance(self.tail_snapshots, int) or self.tail_snapshots < 0):
            raise ValueError(f"tail_snapshots={self.tail_snapshots!r} must be an integer >= 0 or None")


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Spec + config resolved into every static shape. Hashable: used as a jit static argument."""

    spec: CacheSpec
    config: CacheConfig

    def __post_init__(self):
        if self.config.pool_pages is not None and len(self.config.pool_pages) != len(self.groups):
            raise ValueError(
                f"len(pool_pages)={len(self.config.pool_pages)} must equal the number of groups {len(self.groups)}"
            )

    @property
    def groups(self) -> tuple[Group, ...]:
        return self.spec.groups()  # memoised per spec

    @property
    def slots(self) -> int:
        return self.config.slots

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def num_blocks(self) -> int:
        return math.ceil(self.config.max_context / self.spec.block_tokens)

    def logical_pages(self, g: int) -> int:
        """Page-table width M_g: logical pages to address max_context tokens' rows of group g."""
        grp = self.groups[g]
        return math.ceil(math.ceil(self.config.max_context / grp.unit) / self.page_size) or 1

    def pages_per_slot(self, g: int) -> int:
        """Physical pages one slot can hold at most in group g. A windowed group keeps `keep` rows,
        but during one step both the old window (still read) and the new one are mapped."""
        grp = self.groups[g]
        if grp.keep is None:
            return self.logical_pages(g)
        return min(self.logical_pages(g), 2 * (math.ceil(grp.keep / self.page_size) + 1))

    @property
    def tail_snapshots(self) -> int:
        ts = self.config.tail_snapshots
        return self.config.prefix_records if ts is None else ts

    def pool_pages(self, g: int) -> int:
        if self.config.pool_pages is not None:
            return self.config.pool_pages[g]
        return self.slots * self.pages_per_slot(g)


@struct.dataclass
class GroupState:
    pool: jax.Array
    page_table: jax.Array
    page_gen: jax.Array
    refcount: jax.Array
    generation: jax.Array


@struct.dataclass
class TailState:
    tail_kv: jax.Array
    tail_gate: jax.Array
    overlap_kv: jax.Array
    overlap_gate: jax.Array


@struct.dataclass
class StateTable:
    form: jax.Array
    indexer_version: jax.Array
    residency: jax.Array
    checksum: jax.Array
    location: jax.Array
    swa_start: jax.Array
    swa_end: jax.Array


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
    prefix: Any  # hkv.prefix.PrefixIndex: cached block records and TAIL snapshots
    counters: dict


PREFIX_REJECTIONS = (
    "no_hash_match",
    "collision",
    "freed",
    "page_reused",
    "abi_mismatch",
    "swa_missing",
    "tail_missing",
    "indexer_version",
    "checksum",
    "disk_checksum",
    "disk_missing",
    "disk_abi",
    "disk_truncated",
    "disk_auth",
    "disk_malformed",
)
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
) + tuple(f"prefix_rejected_{r}" for r in PREFIX_REJECTIONS)


def init_cache(layout: CacheLayout) -> HybridCache:
    """An empty cache: no slot active, every page free, tails empty (overlap gates -inf)."""
    from .prefix import init_prefix

    spec, s = layout.spec, layout.slots
    dt = spec.storage_dtype
    groups = []
    for g, grp in enumerate(layout.groups):
        p, m = layout.pool_pages(g), layout.logical_pages(g)
        groups.append(
            GroupState(
                pool=jnp.zeros((len(grp.layers), p, layout.page_size, grp.dim), dt),
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


def check_layout(layout: CacheLayout, cache: HybridCache) -> None:
    """Raise ValueError if `cache` was not built for `layout` (any leaf's shape or dtype differs, or,
    on concrete values, the ABI fingerprint differs). Shape checks are free at trace time."""
    want = jax.eval_shape(lambda: init_cache(layout))
    got_leaves = jax.tree_util.tree_leaves_with_path(cache)
    want_leaves = jax.tree_util.tree_leaves_with_path(want)
    if len(got_leaves) != len(want_leaves):
        raise ValueError(
            f"cache has {len(got_leaves)} arrays; the layout's spec needs {len(want_leaves)} "
            f"(a cache built for another spec?)"
        )
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        if g.shape != w.shape or g.dtype != w.dtype:
            raise ValueError(
                f"cache{jax.tree_util.keystr(path)} is {g.dtype}{list(g.shape)} but the layout needs "
                f"{w.dtype}{list(w.shape)} (a cache built for another spec or config?)"
            )
    if not isinstance(cache.abi, jax.core.Tracer):
        if list(np.asarray(cache.abi)) != list(abi_words(layout.spec)):
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
