"""Pure device transitions that install what the disk tier verified: `swap_in` extends a slot from
host rows, `mark_on_disk` records in the prefix index which records have a published disk copy.

Like every transition they are `(layout, cache, ...) -> cache` (plus a status), jittable with the
layout static and the cache donated; `hkv.engine.offload` builds their inputs on the host and
`hkv.engine.compiled.CompiledSteps` compiles them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import kv_quant as kvq
from .layout import CacheLayout, Status, set_tail_row
from .spec import ObjectKind
from .state import HybridCache
from .transitions import advance, checked_slot, keep_if, locate_rows, reserve, slide


def swap_in(
    layout: CacheLayout, cache: HybridCache, slot: jax.Array, l0: jax.Array, l1: jax.Array, rows: tuple, tails: tuple
) -> tuple[HybridCache, jax.Array]:
    """Extend `slot` (active, holding exactly l0 tokens) to l1 tokens from host rows.

    rows[g]: for a COMPRESSED / INDEXER group, [L_g, R, dim] rows starting at l0 // unit (the first
    l1 // unit - l0 // unit are used); for an SWA group, [L_g, K, dim] window rows starting at
    max(l1 // unit - keep, 0) (rows < l1 used). tails[c]: TailState of compressor c at l1 without
    the slot dimension. Returns (cache, status): BAD_REQUEST unless l0 < l1, both on block boundaries
    and the slot holds l0 tokens; NO_PAGES if the pools cannot hold it — the cache then unchanged.
    """
    bt = layout.spec.block_tokens
    known, s = checked_slot(layout, slot)
    good = (
        known
        & cache.active[s]
        & (cache.lengths[s] == l0)
        & (l0 < l1)
        & (l0 % bt == 0)
        & (l1 % bt == 0)
        & (l1 <= layout.config.max_context)
    )
    c, st = reserve(layout, cache, s[None], l1[None], good[None])
    ok = good & (st == Status.OK)
    groups = list(c.groups)
    for gi, grp in enumerate(layout.groups):
        g = groups[gi]
        vals = rows[gi]
        if grp.kind == ObjectKind.SWA:
            hi = l1 // grp.unit
            lo = jnp.zeros_like(hi) if grp.keep is None else jnp.maximum(hi - grp.keep, 0)
        else:
            lo, hi = l0 // grp.unit, l1 // grp.unit
        pos = lo + jnp.arange(vals.shape[1])
        page, off, _ = locate_rows(layout, g, s[None], pos[None], (ok & (pos < hi))[None])
        groups[gi] = g.replace(pool=g.pool.at[:, page[0], off[0]].set(kvq.to_pool(vals, g.pool.dtype), mode="drop"))
    new_tails = [set_tail_row(t, s, ok, src, skip_empty=True) for t, src in zip(c.tails, tails, strict=True)]
    pools = [g.pool for g in groups]  # written under `ok` above: unchanged where it is False
    # the metadata transitions see the old pools: `ok` selects only the small leaves, so a failed
    # swap_in leaves the cache unchanged without copying (or selecting over) every pool
    c = c.replace(
        groups=tuple(g.replace(pool=old.pool) for g, old in zip(groups, cache.groups, strict=True)),
        tails=tuple(new_tails),
    )
    c = advance(layout, c, s[None], l1[None], ok[None])
    c = slide(layout, c, s[None], ok[None])
    out = keep_if(ok, c, cache)
    out = out.replace(groups=tuple(g.replace(pool=p) for g, p in zip(out.groups, pools, strict=True)))
    status = jnp.where(good, st, Status.BAD_REQUEST).astype(jnp.int32)
    return out, status


def mark_on_disk(layout: CacheLayout, cache: HybridCache, keys: jax.Array, valid: jax.Array) -> HybridCache:
    """Set `on_disk` for every record (alive or tombstone) whose key is one of keys uint32[K, 4]
    (rows where `valid`): their segment's manifest has been published."""
    px = cache.prefix
    hit = jnp.any(jnp.all(px.key[:, None, :] == keys[None, :, :], axis=-1) & valid[None, :], axis=1)
    hit = hit & (px.state != 0)
    return cache.replace(prefix=px.replace(on_disk=px.on_disk | hit))


__all__ = ["mark_on_disk", "swap_in"]
