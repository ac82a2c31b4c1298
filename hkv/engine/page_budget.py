"""Whether a step's `reserve` would find enough free pages, decided on the host before the step runs.

A prefill step that reserves more pages than a pool has free fails with NO_PAGES after computing the
whole chunk (the status is known only at the end of the program); the scheduler then makes room and
runs the chunk again. With the prefix cache holding the pools (its normal state once warm), every
chunk paid for two prefills. `short_of_pages` reads only page bookkeeping (page tables and
refcounts, a few KB) and counts what `hkv.core.transitions.reserve` would map.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from hkv.core.layout import CacheLayout
from hkv.core.prefix import RecordState
from hkv.core.state import HybridCache


def pages_wanted(layout: CacheLayout, cache: HybridCache, slots, new_lengths, holds=None) -> tuple[int, ...]:
    """Per layout group, the pages `reserve(layout, cache, slots, new_lengths)` would map: for each slot,
    the unmapped pages of the rows [lo, hi) its group must hold at the new length
    (`transitions.required_rows`).

    Args:
      layout, cache: the engine's (only the page tables are read, copied to the host).
      slots: the slots of the step's rows; new_lengths: their lengths after it (same length).
      holds: per row, the boundary whose windows the step keeps mapped (`reserve`'s hold), or None.
    Returns:
      one count per group of `layout.groups`.
    """
    tables = jax.device_get([g.page_table for g in cache.groups])
    ps = layout.page_size
    wanted = []
    for gi, grp in enumerate(layout.groups):
        table = np.asarray(tables[gi])
        need = 0
        # reserve's row range (`transitions.required_rows`) restated in numpy: that function is jnp
        # code, which would dispatch (and compile) small programs on every request's path
        for j, (slot, length) in enumerate(zip(slots, new_lengths, strict=True)):
            hi = int(length) // grp.unit
            upto = hi if holds is None or holds[j] is None else min(int(length), holds[j]) // grp.unit
            lo = 0 if grp.keep is None else max(upto - grp.keep, 0)
            need += int((table[int(slot), lo // ps : -(-hi // ps)] < 0).sum())
        wanted.append(need)
    return tuple(wanted)


def free_pages(cache: HybridCache) -> tuple[int, ...]:
    """Per group, the pages no one references (refcount 0), read to the host."""
    return tuple(int((np.asarray(rc) == 0).sum()) for rc in jax.device_get([g.refcount for g in cache.groups]))


def fits(wanted: Sequence[int], free: Sequence[int]) -> bool:
    """Whether every group has the pages wanted free (per-group counts, `layout.groups` order)."""
    return all(w <= f for w, f in zip(wanted, free, strict=True))


def free_pages_after(
    layout: CacheLayout, cache: HybridCache, meta: dict[str, np.ndarray]
) -> Callable[[np.ndarray, np.ndarray], list[int]]:
    """What an eviction would leave free, computed on the host: a function of (snapshot mask, record
    mask), bool[records] as `hkv.core.prefix.evict` takes them, -> the free pages per group once
    those objects' page references are taken off the pools' refcounts as that step does (a window
    goes with its snapshot, the other groups' rows with the whole record). The refcounts and record
    pages are read now; `meta` holds the prefix index's `state` and `swa_held` columns as read with
    them (before any policy pass marks records evicted)."""
    refcounts, record_pages = jax.device_get(([g.refcount for g in cache.groups], cache.prefix.pages))
    refcounts = [np.asarray(r) for r in refcounts]
    record_pages = [np.asarray(p) for p in record_pages]
    alive, swa_held = meta["state"] == RecordState.ALIVE, meta["swa_held"]

    def free(snap: np.ndarray, whole: np.ndarray) -> list[int]:
        out = []
        for gi, grp in enumerate(layout.groups):
            drop = ((snap | whole) & swa_held if grp.keep is not None else whole) & alive
            ids = record_pages[gi][drop].ravel()
            taken = np.bincount(ids[ids >= 0], minlength=len(refcounts[gi]))
            out.append(int((refcounts[gi] - taken == 0).sum()))
        return out

    return free


def short_of_pages(layout: CacheLayout, cache: HybridCache, slots, new_lengths, holds=None) -> bool:
    """True when some pool has fewer free pages than `pages_wanted(layout, cache, slots, new_lengths,
    holds)`: the step would fail with NO_PAGES."""
    return not fits(pages_wanted(layout, cache, slots, new_lengths, holds), free_pages(cache))
