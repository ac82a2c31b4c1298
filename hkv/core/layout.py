"""Static shapes of the cache (`CacheConfig`, `CacheLayout`) and the pytree node types it is built of.

`CacheLayout` is a hashable jit static argument: spec + config resolved into every static shape.
`GroupState`, `TailState` and `StateTable` are the nodes of `HybridCache` (see `hkv.core.state`,
whose module docstring lists every array with its shape). `Status` is the outcome code of a
transition; `Residency` where a block's bytes live.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax
from flax import struct

from .spec import CacheSpec, Group


class Residency(enum.IntEnum):
    """Where a cache block's objects live, per slot and block in the state table (`residency`)."""

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
    BAD_TOKEN = 8  # a token id outside [0, vocab_size) (hkv.decode_loop with check=True)


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
