"""Memory accounting: what a cache allocates and holds per object kind, and the architectural minimum.

The architectural minimum for a spec after `n` tokens of one sequence is what any cache must keep to
continue decoding exactly: per layer the last `window - 1` K=V rows (all `n` for full attention),
`n // ratio` compressed entries and indexer keys, and each compressor's TAIL — the `n % ratio`
projected rows of the open window (kv and gate) plus, for overlapping compressors, the previous
window's slice (kv, and its gate in float32).
"""

from __future__ import annotations

import jax
import numpy as np

from .layout import CacheLayout
from .spec import CacheSpec
from .state import HybridCache, init_cache

KINDS = ("SWA", "COMPRESSED", "INDEXER", "TAIL")


def architectural_minimum(spec: CacheSpec, context: int) -> dict[str, int]:
    """Bytes per object kind (and "total") that one sequence of `context` tokens needs at minimum."""
    if context < 0:
        raise ValueError(f"{context=} must be >= 0")
    item = spec.storage_dtype.itemsize
    out = dict.fromkeys(KINDS, 0)
    for layer in spec.layers:
        rows = context if layer.window is None else min(layer.window - 1, context)
        out["SWA"] += rows * layer.kv_dim * item
        for kind, c in (("COMPRESSED", layer.compressor), ("INDEXER", layer.indexer)):
            if c is None:
                continue
            out[kind] += (context // c.ratio) * c.entry_dim * item
            out["TAIL"] += 2 * (context % c.ratio) * c.proj_width * item
            if c.overlap and context >= c.ratio:
                out["TAIL"] += c.ratio * c.entry_dim * (item + 4)
    out["total"] = sum(out[k] for k in KINDS)
    return out


def memory_report(layout: CacheLayout, cache: HybridCache) -> dict[str, dict[str, int]]:
    """{"allocated" | "live": {kind: bytes, "total": bytes}} for a cache.

    allocated: device bytes reserved by the pools and TAIL arrays. live: bytes of pages referenced
    by some page table, and the TAIL bytes of active slots' open windows and overlap slices.
    """
    # Only refcounts and lengths come to the host; sizes come from shapes (no pool is copied).
    item = layout.spec.storage_dtype.itemsize
    live = dict.fromkeys(KINDS, 0)
    for gi, grp in enumerate(layout.groups):
        used = int((np.asarray(jax.device_get(cache.groups[gi].refcount)) > 0).sum())
        live[grp.kind.name] += used * len(grp.layers) * layout.page_size * grp.dim * item
    lengths, active = np.asarray(jax.device_get(cache.lengths)), np.asarray(jax.device_get(cache.active))
    for _, _, spec in layout.spec.compressors():
        for s in np.nonzero(active)[0]:
            n = int(lengths[s])
            live["TAIL"] += 2 * (n % spec.ratio) * spec.proj_width * item
            if spec.overlap and n >= spec.ratio:
                live["TAIL"] += spec.ratio * spec.entry_dim * (item + 4)
    live["total"] = sum(live[k] for k in KINDS)
    return {"allocated": allocated_bytes(layout), "live": live}


def allocated_bytes(layout: CacheLayout) -> dict[str, int]:
    """Bytes `init_cache(layout)` allocates per object kind, computed from shapes only (nothing is
    allocated, so it works for a 1M-token layout on any machine)."""
    shapes = jax.eval_shape(lambda: init_cache(layout))
    out = dict.fromkeys(KINDS, 0)
    for gi, grp in enumerate(layout.groups):
        pool = shapes.groups[gi].pool
        out[grp.kind.name] += int(np.prod(pool.shape)) * pool.dtype.itemsize
    for t in shapes.tails:
        out["TAIL"] += sum(
            int(np.prod(a.shape)) * a.dtype.itemsize for a in (t.tail_kv, t.tail_gate, t.overlap_kv, t.overlap_gate)
        )
    out["total"] = sum(out[k] for k in KINDS)
    return out


def uniform_full_kv_bytes(spec: CacheSpec, context: int, page_size: int = 16) -> int:
    """What a uniform paged full-KV cache (every layer keeps every token's K=V row, pages of
    `page_size` tokens) needs for one sequence of `context` tokens."""
    item = spec.storage_dtype.itemsize
    pages = -(-context // page_size)
    return sum(pages * page_size * l.kv_dim * item for l in spec.layers)
