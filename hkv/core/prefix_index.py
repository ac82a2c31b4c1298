"""`PrefixIndex`: the prefix cache's records and TAIL snapshots, a node of `HybridCache`.

The transitions that fill and read it (record, restore, evict) are in `hkv.core.prefix`.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from flax import struct

from .layout import CacheLayout, TailState


class RecordState(enum.IntEnum):
    EMPTY = 0
    ALIVE = 1
    TOMBSTONE = 2  # evicted; kept (without page references) so a later hit reports why it failed


@struct.dataclass
class PrefixIndex:
    """NR records, NT TAIL snapshot slots; per group, the few pages each record holds itself (see
    `hkv.core.prefix`: a record's rows before its own block are its ancestors')."""

    key: jax.Array  # uint32[NR, 4]
    parent: jax.Array  # int32[NR]   record of the previous block, -1 for the first block
    tokens: jax.Array  # int32[NR, block_tokens]
    length: jax.Array  # int32[NR]   boundary L
    abi: jax.Array  # uint32[NR, 4]
    iver: jax.Array  # int32[NR]
    state: jax.Array  # int8[NR]  RecordState
    last_used: jax.Array  # int32[NR]
    hits: jax.Array  # int32[NR]
    # per group int32[NR, K_g] (K_g = `CacheLayout.record_pages`): the physical pages of logical pages
    # first, first + 1, ... (-1 = none), first = `hkv.core.prefix.record_first_page`: the pages the
    # record's own block's rows overlap, or (a windowed SWA group, with a snapshot) its window's
    pages: tuple
    gens: tuple  # per group int32[NR, K_g]: generation of each page when recorded
    swa_held: jax.Array  # bool[NR]
    tail_slot: jax.Array  # int32[NR]  snapshot slot, -1 = none
    checksum: jax.Array  # uint32[NR]
    on_disk: jax.Array  # bool[NR]  a committed disk-tier copy exists (set when its manifest is published)
    snaps: tuple  # per compressor TailState with leading dim NT
    snap_used: jax.Array  # bool[NT]
    # int32[NT, 2] (slot, boundary L) whose TAIL a prefill step staged in this free snapshot slot
    # (`hkv.core.layers.InteriorSnapshots`), -1 = none: only that slot's record at L may take it
    staged: jax.Array
    clock: jax.Array  # int32


def init_prefix(layout: CacheLayout) -> PrefixIndex:
    nr, nt = layout.config.prefix_records, layout.tail_snapshots
    bt = layout.spec.block_tokens
    dt = layout.spec.storage_dtype
    snaps = []
    for _, _, c in layout.spec.compressors():
        ov = c.ratio if c.overlap else 0
        snaps.append(
            TailState(
                tail_kv=jnp.zeros((nt, c.ratio, c.proj_width), dt),
                tail_gate=jnp.zeros((nt, c.ratio, c.proj_width), dt),
                overlap_kv=jnp.zeros((nt, ov, c.entry_dim), dt),
                overlap_gate=jnp.full((nt, ov, c.entry_dim), -jnp.inf, jnp.float32),
            )
        )
    m = [layout.record_pages(g) for g in range(len(layout.groups))]
    return PrefixIndex(
        key=jnp.zeros((nr, 4), jnp.uint32),
        parent=jnp.full((nr,), -1, jnp.int32),
        tokens=jnp.zeros((nr, bt), jnp.int32),
        length=jnp.zeros((nr,), jnp.int32),
        abi=jnp.zeros((nr, 4), jnp.uint32),
        iver=jnp.zeros((nr,), jnp.int32),
        state=jnp.zeros((nr,), jnp.int8),
        last_used=jnp.zeros((nr,), jnp.int32),
        hits=jnp.zeros((nr,), jnp.int32),
        pages=tuple(jnp.full((nr, mg), -1, jnp.int32) for mg in m),
        gens=tuple(jnp.zeros((nr, mg), jnp.int32) for mg in m),
        swa_held=jnp.zeros((nr,), bool),
        tail_slot=jnp.full((nr,), -1, jnp.int32),
        checksum=jnp.zeros((nr,), jnp.uint32),
        on_disk=jnp.zeros((nr,), bool),
        snaps=tuple(snaps),
        snap_used=jnp.zeros((nt,), bool),
        staged=jnp.full((nt, 2), -1, jnp.int32),
        clock=jnp.zeros((), jnp.int32),
    )
