"""Memory accounting: what a cache allocates and holds per object kind, and the architectural minimum.

The architectural minimum for a spec after `n` tokens of one sequence is what any cache must keep to
continue decoding exactly: per layer the last `window - 1` K=V rows (all `n` for full attention),
`n // ratio` compressed entries and indexer keys, and each compressor's TAIL — the `n % ratio`
projected rows of the open window (kv and gate) plus, for overlapping compressors, the previous
window's slice (kv, and its gate in float32).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from .layout import Budget, CacheConfig, CacheLayout, register_sizing
from .spec import CacheSpec
from .state import HybridCache, init_cache

KINDS = ("SWA", "COMPRESSED", "INDEXER", "TAIL")


def resolve_config(spec: CacheSpec, config: CacheConfig) -> CacheConfig:
    """`config` with every capacity an integer (what `CacheLayout` stores; shapes come from it).

    The running slots' reservation comes first: per group `slots * pages_per_slot` pages. Then N
    cached blocks of `spec.block_tokens` tokens get room: `cached_block_pages(g, N)` more pages per
    group and N prefix records. N is
      - `prefix_records` when given (0: no prefix cache, the pools are the reservation alone);
      - with `memory_bytes`: the largest N whose whole cache (`allocated_total`) fits in it;
      - otherwise `slots * ceil(max_context / block_tokens)`: as many cached tokens as the slots hold.
    `pool_pages` given: kept as is. `tail_snapshots` None: `prefix_records` when that was given, else
    `auto_snapshots(N, slots)` — a TAIL snapshot holds every compressor's open window (ratio rows:
    128 for HCA), often more bytes than several blocks' rows, so they are sized apart; the engine
    evicts the least recently used snapshot when it needs a slot.

    Raises:
      ValueError: `memory_bytes` below the reservation's bytes (the message names both).
    """
    n_groups = len(spec.groups())
    probe = CacheLayout(
        spec,
        dataclasses.replace(config, pool_pages=(1,) * n_groups, prefix_records=0, tail_snapshots=0, memory_bytes=None),
    )
    groups = range(n_groups)
    reserved = tuple(probe.reserved_pages(g) for g in groups)

    def build(n: int, pools: tuple[int, ...] | None = None, ts: int | None = None) -> CacheConfig:
        if pools is None:
            pools = tuple(reserved[g] + probe.cached_block_pages(g, n) for g in groups)
        if ts is None:
            ts = auto_snapshots(n, probe.slots) if config.tail_snapshots is None else config.tail_snapshots
        return dataclasses.replace(config, pool_pages=pools, prefix_records=n, tail_snapshots=ts, memory_bytes=None)

    if config.prefix_records is not None:
        ts = config.prefix_records if config.tail_snapshots is None else config.tail_snapshots
        return build(config.prefix_records, config.pool_pages, ts)
    if config.memory_bytes is None:
        return build(probe.slots * probe.num_blocks, config.pool_pages)
    budget = config.memory_bytes
    floor = allocated_total(CacheLayout(spec, build(0, ts=0)))
    if floor > budget:
        raise ValueError(
            f"memory_bytes={budget:,} is below the {floor:,} bytes that {config.slots} running slots of "
            f"max_context={config.max_context} need (pools, TAIL state, state table); raise memory_bytes to at "
            f"least {floor:,} or lower slots / max_context"
        )
    per_record = allocated_total(CacheLayout(spec, build(1, reserved, 0))) - floor
    per_snapshot = allocated_total(CacheLayout(spec, build(0, reserved, 1))) - floor
    # a page costs its rows plus its refcount and generation words: measured, like the records
    page = [
        allocated_total(CacheLayout(spec, build(0, tuple(r + (g == h) for h, r in enumerate(reserved)), 0))) - floor
        for g in groups
    ]

    def total(n: int) -> int:
        pages = sum(page[g] * probe.cached_block_pages(g, n) for g in groups)
        return floor + n * per_record + auto_snapshots(n, probe.slots) * per_snapshot + pages

    lo, hi = 0, 1
    while total(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # total is increasing in n: the largest n with total(n) <= budget
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid)
    return build(lo)


def auto_snapshots(records: int, slots: int) -> int:
    """TAIL snapshot slots sized with `records` cached blocks: one per 16 blocks, at least two per
    running slot, at most one per record (0 without records)."""
    if records <= 0:
        return 0
    return min(records, max(2 * slots, -(-records // 16)))


def page_bytes(layout: CacheLayout, g: int) -> int:
    """Bytes of one physical page of group g (every layer of the group)."""
    grp = layout.groups[g]
    return len(grp.layers) * layout.page_size * layout.spec.row_bytes(grp.dim)


def tree_bytes(tree) -> int:
    """Bytes of every array (or `jax.ShapeDtypeStruct`) in a pytree."""
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def allocated_total(layout: CacheLayout) -> int:
    """Bytes of every array `init_cache(layout)` allocates (shapes only; nothing is allocated)."""
    return tree_bytes(jax.eval_shape(lambda: init_cache(layout)))


def budget_of(layout: CacheLayout, requested: int | None = None) -> Budget:
    """How `layout`'s cache splits device memory: the running slots' reservation, pages beyond it,
    the prefix index, the rest (see `Budget`)."""
    shapes = jax.eval_shape(lambda: init_cache(layout))
    groups = range(len(layout.groups))
    reserved = [min(layout.pool_pages(g), layout.reserved_pages(g)) for g in groups]
    running = sum(reserved[g] * page_bytes(layout, g) for g in groups) + tree_bytes(shapes.tails)
    spare = sum((layout.pool_pages(g) - reserved[g]) * page_bytes(layout, g) for g in groups)
    index = tree_bytes(shapes.prefix)
    total = tree_bytes(shapes)
    pools = sum(layout.pool_pages(g) * page_bytes(layout, g) for g in groups)
    return Budget(
        running=running,
        prefix_pages=spare,
        prefix_index=index,
        other=total - pools - tree_bytes(shapes.tails) - index,
        total=total,
        requested=requested,
        cached_blocks=layout.config.prefix_records,
    )


def architectural_minimum(spec: CacheSpec, context: int) -> dict[str, int]:
    """Bytes per object kind (and "total") that one sequence of `context` tokens needs at minimum."""
    if context < 0:
        raise ValueError(f"{context=} must be >= 0")
    item = spec.storage_dtype.itemsize
    out = dict.fromkeys(KINDS, 0)
    for layer in spec.layers:
        rows = context if layer.window is None else min(layer.window - 1, context)
        out["SWA"] += rows * spec.row_bytes(layer.kv_dim)
        for kind, c in (("COMPRESSED", layer.compressor), ("INDEXER", layer.indexer)):
            if c is None:
                continue
            out[kind] += (context // c.ratio) * spec.row_bytes(c.entry_dim)
            out["TAIL"] += 2 * (context % c.ratio) * c.proj_width * item
            if c.overlap and context >= c.ratio:
                out["TAIL"] += c.ratio * c.entry_dim * (item + 4)
    out["total"] = sum(out[k] for k in KINDS)
    return out


def memory_report(layout: CacheLayout, cache: HybridCache) -> dict[str, dict[str, int]]:
    """{"allocated" | "live": {kind: bytes, "total": bytes}, "split": {...}} for a cache.

    allocated: device bytes reserved by the pools and TAIL arrays. live: bytes of pages referenced
    by some page table, and the TAIL bytes of active slots' open windows and overlap slices.
    split: how the whole cache's bytes divide (`CacheLayout.budget`): "running" (the slots'
    reservation), "prefix_pages" (pool pages beyond it, for cached blocks), "prefix_index" (records
    and TAIL snapshots), "other" (state table, counters), "total", and "prefix_records" (a count).
    """
    # Only refcounts and lengths come to the host; sizes come from shapes (no pool is copied).
    item = layout.spec.storage_dtype.itemsize
    live = dict.fromkeys(KINDS, 0)
    for gi, grp in enumerate(layout.groups):
        used = int((np.asarray(jax.device_get(cache.groups[gi].refcount)) > 0).sum())
        live[grp.kind.name] += used * page_bytes(layout, gi)
    lengths, active = np.asarray(jax.device_get(cache.lengths)), np.asarray(jax.device_get(cache.active))
    for _, _, spec in layout.spec.compressors():
        for s in np.nonzero(active)[0]:
            n = int(lengths[s])
            live["TAIL"] += 2 * (n % spec.ratio) * spec.proj_width * item
            if spec.overlap and n >= spec.ratio:
                live["TAIL"] += spec.ratio * spec.entry_dim * (item + 4)
    live["total"] = sum(live[k] for k in KINDS)
    b = layout.budget
    split = {
        "running": b.running,
        "prefix_pages": b.prefix_pages,
        "prefix_index": b.prefix_index,
        "other": b.other,
        "total": b.total,
        "prefix_records": b.cached_blocks,
    }
    return {"allocated": allocated_bytes(layout), "live": live, "split": split}


def allocated_bytes(layout: CacheLayout) -> dict[str, int]:
    """Bytes `init_cache(layout)` allocates per object kind, computed from shapes only (nothing is
    allocated, so it works for a 1M-token layout on any machine)."""
    shapes = jax.eval_shape(lambda: init_cache(layout))
    out = dict.fromkeys(KINDS, 0)
    for gi, grp in enumerate(layout.groups):
        pool = shapes.groups[gi].pool
        out[grp.kind.name] += int(np.prod(pool.shape)) * pool.dtype.itemsize
    for t in shapes.tails:
        out["TAIL"] += tree_bytes((t.tail_kv, t.tail_gate, t.overlap_kv, t.overlap_gate))
    out["total"] = sum(out[k] for k in KINDS)
    return out


def uniform_full_kv_bytes(spec: CacheSpec, context: int, page_size: int = 16) -> int:
    """What a uniform paged full-KV cache (every layer keeps every token's K=V row, pages of
    `page_size` tokens) needs for one sequence of `context` tokens."""
    pages = -(-context // page_size)
    return sum(pages * page_size * spec.row_bytes(l.kv_dim) for l in spec.layers)


register_sizing(resolve_config, budget_of)
