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
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
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
    pool_pages: physical pages per group (in `CacheSpec.groups()` order); None sizes the pools with
      `memory_bytes` (below).
    prefix_records: capacity of the prefix index (cached block boundaries); 0 disables prefix reuse;
      None (the default) turns it on and sizes it with the pools (below).
    tail_snapshots: capacity of TAIL snapshot copies (None: prefix_records when that is given, else
      sized with the records: `hkv.core.memory.auto_snapshots`).
    memory_bytes: the device bytes of the whole cache (pools, TAIL state, prefix index, state table).
      The running slots' reservation comes first (`slots` sequences of `max_context` tokens always
      fit); every byte left goes to cached prefix blocks: pool pages, records and TAIL snapshots
      sized together so each cached block can keep its rows, its record and its snapshot.
      `ValueError` when the reservation alone exceeds it. None (with `pool_pages` None): room for as
      many cached tokens as the slots hold (`slots * max_context`; twice the reservation's pages).
      Exclusive with `pool_pages`, `prefix_records` and `tail_snapshots`.

    `CacheLayout(spec, config).config` is the resolved config: every capacity an integer,
    `memory_bytes` None (`CacheLayout.budget` keeps the split; see `resolve_config`).
    """

    slots: int = 4
    max_context: int = 4096
    page_size: int = 16
    pool_pages: tuple[int, ...] | None = None
    prefix_records: int | None = None
    tail_snapshots: int | None = None
    memory_bytes: int | None = None

    def __post_init__(self):
        for name in ("slots", "max_context", "page_size"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if self.prefix_records is not None and (not _is_int(self.prefix_records) or self.prefix_records < 0):
            raise ValueError(
                f"prefix_records={self.prefix_records!r} must be an integer >= 0 (0 = no prefix cache) or None "
                "(sized with the pools)"
            )
        if self.tail_snapshots is not None and (not _is_int(self.tail_snapshots) or self.tail_snapshots < 0):
            raise ValueError(f"tail_snapshots={self.tail_snapshots!r} must be an integer >= 0 or None")
        if self.pool_pages is not None and (
            not isinstance(self.pool_pages, tuple) or not all(_is_int(p) and p >= 1 for p in self.pool_pages)
        ):
            raise ValueError(f"pool_pages={self.pool_pages!r} must be a tuple of positive integers (one per group)")
        if self.memory_bytes is not None:
            if not _is_int(self.memory_bytes) or self.memory_bytes < 1:
                raise ValueError(f"memory_bytes={self.memory_bytes!r} must be a positive integer (bytes) or None")
            given = [n for n in ("pool_pages", "prefix_records", "tail_snapshots") if getattr(self, n) is not None]
            if given:
                raise ValueError(
                    f"memory_bytes={self.memory_bytes} sizes the pools, records and snapshots itself; "
                    f"leave {', '.join(given)} None (or drop memory_bytes)"
                )


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


# Sizing needs the cache's shapes (`hkv.core.state.init_cache`), which are built from this module:
# `hkv.core.memory` (imported by `hkv`) registers its `resolve_config` and `budget_of` here, so the
# dependency points one way (memory -> layout) and `CacheLayout(spec, config)` still resolves itself.
_SIZING: dict[str, Callable] = {}


def register_sizing(resolve: Callable, budget: Callable) -> None:
    """Install `resolve(spec, config) -> CacheConfig` and `budget(layout, requested) -> Budget`
    (called once by `hkv.core.memory`)."""
    _SIZING.update(resolve=resolve, budget=budget)


def _is_resolved(config: CacheConfig) -> bool:
    return config.memory_bytes is None and None not in (config.pool_pages, config.prefix_records, config.tail_snapshots)


@dataclasses.dataclass(frozen=True)
class Budget:
    """How a resolved `CacheConfig` splits device memory (bytes; see `resolve_config`).

    Attributes:
      running: pool pages reserved for `slots` sequences of `max_context` tokens, and their TAIL state.
      prefix_pages: pool pages beyond that reservation (room for cached blocks).
      prefix_index: the prefix index's records and TAIL snapshots.
      other: the state table, lengths and counters.
      total: the sum (what `init_cache` allocates).
      requested: `memory_bytes` as given (None: sized by default).
      cached_blocks: cached blocks of `block_tokens` tokens the pools have room for beyond the reservation.
    """

    running: int
    prefix_pages: int
    prefix_index: int
    other: int
    total: int
    requested: int | None
    cached_blocks: int


def default_pool_bits() -> bool:
    """`CacheLayout.pool_bits` where it is None: True on a CPU backend (`jax.default_backend()`)."""
    return jax.default_backend() == "cpu"


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Spec + config resolved into every static shape. Hashable: used as a jit static argument.

    pool_bits: whether bfloat16 pools hold their rows as uint16 bit patterns (`pool_dtype`); None
    (the default) resolves to True on a CPU backend (`jax.default_backend()`) and False elsewhere.
    XLA:CPU widens a bfloat16 array to float32 around every in-place write into it, so each row a
    step wrote into a bfloat16 pool converted the whole pool twice; integer pools are written in
    place. The bits read back are the same either way (`hkv.core.kv_quant.to_pool` / `from_pool`).
    """

    spec: CacheSpec
    config: CacheConfig
    pool_bits: bool | None = None

    def __post_init__(self):
        if self.pool_bits is None:
            object.__setattr__(self, "pool_bits", default_pool_bits())
        elif not isinstance(self.pool_bits, bool):
            raise ValueError(f"pool_bits={self.pool_bits!r} must be True, False or None (True on a CPU backend)")
        if self.config.pool_pages is not None and len(self.config.pool_pages) != len(self.groups):
            raise ValueError(
                f"len(pool_pages)={len(self.config.pool_pages)} must equal the number of groups {len(self.groups)}"
            )
        requested = self.config.memory_bytes
        if self.config.page_size > self.config.max_context:
            raise ValueError(
                f"page_size={self.config.page_size} must be <= max_context={self.config.max_context} "
                "(a page larger than a whole sequence cannot hold a sliding window's ring of pages); lower page_size"
            )
        for g, grp in enumerate(self.groups):
            if grp.keep is not None:
                need = -(-grp.keep // self.page_size) + 1  # pages a window of keep + 1 rows can overlap
                if self.logical_pages(g) < need:
                    raise ValueError(
                        f"page_size={self.page_size} with max_context={self.config.max_context} gives group {g} "
                        f"({grp.kind.name}, window of {grp.keep + 1} rows) {self.logical_pages(g)} pages per "
                        f"sequence, fewer than the {need} its window can overlap: lower page_size or raise max_context"
                    )
        if not _is_resolved(self.config):
            object.__setattr__(self, "config", _SIZING["resolve"](self.spec, self.config))
        object.__setattr__(self, "_requested", requested)  # not a field: layouts of one resolved config are equal
        for g in range(len(self.groups)):
            rows = self.pool_pages(g) * self.page_size
            if rows >= 2**31:
                raise ValueError(
                    f"group {g} would hold {self.pool_pages(g)} pages x {self.page_size} rows = {rows} rows, past "
                    f"int32 row indices (2**31); lower pool_pages / prefix_records / memory_bytes"
                )
        if self.config.prefix_records >= 2**31 or self.tail_snapshots >= 2**31:
            raise ValueError(
                f"prefix_records={self.config.prefix_records} / tail_snapshots={self.tail_snapshots} must be < 2**31"
            )

    @property
    def budget(self) -> Budget:
        """How this layout's cache splits device memory (see `Budget`)."""
        return _SIZING["budget"](self, getattr(self, "_requested", None))

    def reserved_pages(self, g: int) -> int:
        """Pages of group g that `slots` sequences of `max_context` tokens can hold at once."""
        return self.slots * self.pages_per_slot(g)

    def cached_block_pages(self, g: int, blocks: int) -> int:
        """Pages of group g beyond the reservation that `blocks` cached blocks need (every row of a
        block, windowed groups included: snapshots at every block hold the whole history's rows), plus
        one partly filled page per slot."""
        if blocks <= 0:
            return 0
        rows = math.ceil(blocks * self.spec.block_tokens / self.groups[g].unit)
        return math.ceil(rows / self.page_size) + self.slots

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

    def record_pages(self, g: int) -> int:
        """K_g: page entries a prefix record keeps for group g, independent of max_context. A
        windowed group (`keep` rows: sliding-window SWA) keeps its window's pages at the record's
        boundary, with a snapshot; every other group (COMPRESSED, INDEXER, full attention) keeps the
        pages its own block's rows overlap — the rows before them are its ancestors' (a record's
        parent is alive while it is: `hkv.core.prefix`)."""
        grp = self.groups[g]
        rows = grp.keep if grp.keep is not None else -(-self.spec.block_tokens // grp.unit)
        return min(self.logical_pages(g), -(-rows // self.page_size) + 1)

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
        """Physical pages of group g (the resolved config's `pool_pages[g]`)."""
        return self.config.pool_pages[g]

    @property
    def pool_dtype(self) -> np.dtype:
        """The pools' element dtype: `CacheSpec.row_dtype()`, or uint16 for bfloat16 rows with
        `pool_bits` (the rows' bit patterns)."""
        rdt = self.spec.row_dtype()
        return np.dtype(np.uint16) if self.pool_bits and rdt == jnp.bfloat16 else np.dtype(rdt)


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


def set_tail_row(dst: TailState, row, cond, src: TailState, src_row=None, *, skip_empty: bool = False) -> TailState:
    """`dst` with row `row` of every field set to the same field of `src` where `cond`, else kept: the
    conditional TAIL copy between a slot's TAIL state and a TAIL snapshot (or host rows).

    Args:
      dst: TailState with fields [N, rows, width] (N slots, or N snapshot slots).
      row: int32 scalar in [0, N): the row of dst written.
      cond: bool scalar: write (else dst[row] is written back unchanged).
      src: TailState with fields [M, rows, width] when `src_row` is given, else [rows, width].
      src_row: int32 scalar in [0, M): the row of src read; None reads src's fields whole.
      skip_empty: leave a field with no rows (shape[1] == 0: the overlap slice of a compressor without
        overlap) as it is, tracing no write into it.
    Returns:
      TailState like dst, src's values cast to dst's dtypes. A field of dst with N == 0, or of src with
      M == 0 (no snapshot slots: tail_snapshots=0), is returned as it is (indexing it is undefined).
    """

    def put(d, a):
        if not d.shape[0] or (src_row is not None and not a.shape[0]) or (skip_empty and not d.shape[1]):
            return d
        new = a if src_row is None else a[src_row]
        return d.at[row].set(jnp.where(cond, new.astype(d.dtype), d[row]))

    return jax.tree.map(put, dst, src)


@struct.dataclass
class StateTable:
    form: jax.Array
    indexer_version: jax.Array
    residency: jax.Array
    checksum: jax.Array
    location: jax.Array
    swa_start: jax.Array
    swa_end: jax.Array
