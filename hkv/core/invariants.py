"""`check_invariants`: proves the declared cache state equals the actual state (host-side, numpy).

Usable after every transition in tests. It checks, per group: refcounts equal page-table references,
no page mapped twice, free + used == capacity, every mapping carries its page's current generation
(a reused page is never mistaken for the old one); per slot: exactly the pages its length needs are
mapped (SWA pages that left the window are released), lengths within capacity, inactive slots own
nothing; the state table's window bounds, object form bits, residency and indexer versions match
the lengths; TAIL rows beyond the open window are empty and the overlap slice exists iff a window
has closed.
"""

from __future__ import annotations

import jax
import numpy as np

from .layout import CacheLayout, Residency
from .prefix import record_first_page
from .spec import ObjectKind
from .state import HybridCache, check_layout
from .transitions import block_forms


class InvariantError(AssertionError):
    """The cache's declared state and actual state disagree; the message says where."""


def _fail(msg: str) -> None:
    raise InvariantError(msg)


def _checked_fields(cache: HybridCache) -> HybridCache:
    """`cache` without the leaves no invariant reads (None in their place): the KV pools, the
    overlap rows, checksums and locations, the prefix records' keys, tokens and TAIL snapshots, the
    counters. Fetching a leaf costs ~20 us whatever its size, so `check_invariants` fetches ~40% of
    the leaves of a DeepSeek-V4 cache instead of all of them."""
    px = cache.prefix
    return cache.replace(
        groups=tuple(g.replace(pool=None) for g in cache.groups),
        tails=tuple(t.replace(overlap_kv=None) for t in cache.tails),
        table=cache.table.replace(checksum=None, location=None),
        indexer_version=None,
        abi=None,
        counters={},
        prefix=px.replace(
            key=None,
            tokens=None,
            abi=None,
            iver=None,
            last_used=None,
            hits=None,
            checksum=None,
            on_disk=None,
            snaps=(),
            clock=None,
        ),
    )


def check_invariants(layout: CacheLayout, cache: HybridCache) -> None:
    """Raise `InvariantError` naming the first violated invariant; return None when all hold.
    `ValueError` (naming the array) when `cache` was not built for `layout`."""
    check_layout(layout, cache)
    c = jax.device_get(_checked_fields(cache))
    lengths = np.asarray(c.lengths)
    active = np.asarray(c.active)
    if (lengths < 0).any() or (lengths > layout.config.max_context).any():
        _fail(f"lengths {lengths.tolist()} outside [0, max_context={layout.config.max_context}]")
    if (lengths[~active] != 0).any():
        _fail(f"inactive slots {np.nonzero(~active & (lengths != 0))[0].tolist()} have nonzero length")
    for gi in range(len(layout.groups)):
        _check_group(layout, c, gi, lengths, active)
    _check_table(layout, c, lengths, active)
    _check_prefix(layout, c)
    _check_tails(layout, c, lengths, active)


def _check_group(layout: CacheLayout, c: HybridCache, gi: int, lengths: np.ndarray, active: np.ndarray) -> None:
    """Group gi's pages: references, sharing, generations and the pages each slot maps.

    Args:
      layout: the cache's layout.
      c: the cache's checked fields on the host (`_checked_fields`).
      gi: the group.
      lengths: int32[slots] slot lengths; active: bool[slots].
    """
    g = c.groups[gi]
    pt, pg = np.asarray(g.page_table), np.asarray(g.page_gen)
    rc, gen = np.asarray(g.refcount), np.asarray(g.generation)
    p = rc.shape[0]
    mapped = pt[pt >= 0]
    if (mapped >= p).any():
        _fail(f"group {gi}: page ids {mapped[mapped >= p].tolist()} beyond pool of {p}")
    px = c.prefix
    alive = np.asarray(px.state) == 1
    rec_rows = np.asarray(px.pages[gi])[alive]
    _check_refcounts(gi, mapped, rec_rows, rc)
    _check_sharing(layout, gi, pt, mapped, p, lengths, active)
    rec_gen = np.asarray(px.gens[gi])[alive]
    if (rec_rows >= 0).any() and not (rec_gen[rec_rows >= 0] == gen[rec_rows[rec_rows >= 0]]).all():
        _fail(f"group {gi}: an alive prefix record maps a page of an older generation")
    if int((rc == 0).sum() + (rc > 0).sum()) != p:
        _fail(f"group {gi}: free + used != capacity {p}")
    s_idx, l_idx = np.nonzero(pt >= 0)
    stale = pg[s_idx, l_idx] != gen[pt[s_idx, l_idx]]
    if stale.any():
        _fail(f"group {gi}: slot {s_idx[stale][0]} logical page {l_idx[stale][0]} maps a page of an older generation")
    _check_slot_pages(layout, gi, pt, lengths, active)


def _check_refcounts(gi: int, mapped: np.ndarray, rec_rows: np.ndarray, rc: np.ndarray) -> None:
    """Group gi's refcounts equal its references: from page tables (mapped: the page ids of every
    mapping, int32[n]) and alive prefix records (rec_rows int32[alive records, M], -1 = none).
    rc int32[P]: the refcounts."""
    p = rc.shape[0]
    rec_mapped = rec_rows[rec_rows >= 0]
    if (rec_mapped >= p).any():
        _fail(f"group {gi}: prefix records reference page ids beyond pool of {p}")
    refs = np.bincount(mapped, minlength=p) + np.bincount(rec_mapped, minlength=p)
    if (rc < 0).any():
        _fail(f"group {gi}: negative refcounts at pages {np.nonzero(rc < 0)[0].tolist()}")
    if not (refs == rc).all():
        bad = np.nonzero(refs != rc)[0][:8].tolist()
        _fail(f"group {gi}: refcount != references at pages {bad}: {rc[bad].tolist()} vs {refs[bad].tolist()}")


def _check_sharing(
    layout: CacheLayout, gi: int, pt: np.ndarray, mapped: np.ndarray, p: int, lengths: np.ndarray, active: np.ndarray
) -> None:
    """No slot maps one page twice, and no slot's write frontier is shared.

    Args:
      gi: the group.
      pt: int32[slots, M] its page table (-1 = unmapped); mapped: the page ids of every mapping.
      p: the group's pool pages.
      lengths: int32[slots]; active: bool[slots].
    """
    unit = layout.groups[gi].unit
    ps = layout.page_size
    for s in range(layout.slots):
        row = pt[s][pt[s] >= 0]
        if len(np.unique(row)) != len(row):
            _fail(f"group {gi}: slot {s} maps one page at two logical pages")
    # A page may be shared (a restored prefix), but a slot's write frontier — the partially filled
    # page its next rows go to — is never mapped by another slot.
    owners = np.bincount(mapped, minlength=p)
    for s in range(layout.slots):
        if not active[s]:
            continue
        hi = int(lengths[s]) // unit
        if hi % ps and pt[s, hi // ps] >= 0 and owners[pt[s, hi // ps]] > 1:
            _fail(f"group {gi}: slot {s}'s write frontier page {pt[s, hi // ps]} is owned twice")


def _check_slot_pages(layout: CacheLayout, gi: int, pt: np.ndarray, lengths: np.ndarray, active: np.ndarray) -> None:
    """Each active slot maps exactly the logical pages its length needs in group gi (an SWA group's
    pages that left the window are released); an inactive slot maps none.

    Args:
      gi: the group; pt: int32[slots, M] its page table (-1 = unmapped).
      lengths: int32[slots]; active: bool[slots].
    """
    grp = layout.groups[gi]
    ps = layout.page_size
    for s in range(layout.slots):
        row = pt[s]
        if not active[s]:
            if (row >= 0).any():
                _fail(f"group {gi}: inactive slot {s} still maps pages")
            continue
        n = int(lengths[s])
        hi = n // grp.unit
        lo = 0 if grp.keep is None else max(hi - grp.keep, 0)
        need = np.zeros(row.shape, bool)
        need[lo // ps : (hi + ps - 1) // ps] = True
        if not (row[need] >= 0).all():
            _fail(f"group {gi} ({grp.kind.name}): slot {s} length {n} misses pages for rows [{lo}, {hi})")
        if (row[~need] >= 0).any():
            extra = np.nonzero((row >= 0) & ~need)[0].tolist()
            _fail(f"group {gi} ({grp.kind.name}): slot {s} length {n} maps unneeded logical pages {extra}")


def _check_table(layout: CacheLayout, c: HybridCache, lengths: np.ndarray, active: np.ndarray) -> None:
    """The state table matches the lengths: SWA window bounds, object form bits, residency, indexer
    versions. c: the checked fields on the host; lengths int32[slots], active bool[slots]."""
    tb = c.table
    keep = [g.keep for g in layout.groups if g.kind == ObjectKind.SWA and g.keep is not None]
    want_start = np.maximum(lengths - min(keep), 0) if keep else np.zeros_like(lengths)
    act_start, act_end = np.asarray(tb.swa_start), np.asarray(tb.swa_end)
    if not (act_end[active] == lengths[active]).all() or not (act_start[active] == want_start[active]).all():
        _fail(
            f"SWA window bounds {list(zip(act_start.tolist(), act_end.tolist(), strict=True))} do not match lengths "
            f"{lengths.tolist()} (want starts {want_start.tolist()})"
        )
    form = np.asarray(block_forms(layout, lengths))
    if not (np.asarray(tb.form) == form).all():
        s, b = np.argwhere(np.asarray(tb.form) != form)[0]
        _fail(f"state table form of slot {s} block {b} is {tb.form[s, b]:#x}, expected {form[s, b]:#x}")
    res = np.asarray(tb.residency)
    want_res = np.where(form > 0, Residency.DEVICE, Residency.ABSENT)
    if not (res == want_res).all():
        _fail("state table residency disagrees with the objects held on device")
    written = np.arange(layout.num_blocks)[None, :] * layout.spec.block_tokens < lengths[:, None]
    iv = np.asarray(tb.indexer_version)
    if (iv[written] <= 0).any() or (iv[~written] != 0).any():
        _fail("indexer versions must be >= 1 on written blocks and 0 elsewhere")


def _check_tails(layout: CacheLayout, c: HybridCache, lengths: np.ndarray, active: np.ndarray) -> None:
    """Every compressor's TAIL: rows beyond the open window are empty, and the overlap slice exists iff
    a window has closed. c: the checked fields on the host; lengths int32[slots], active bool[slots]."""
    for ti, (layer, name, spec) in enumerate(layout.spec.compressors()):
        t = c.tails[ti]
        for s in range(layout.slots):
            n = int(lengths[s]) if active[s] else 0
            open_rows = n % spec.ratio
            if np.any(np.asarray(t.tail_kv[s, open_rows:]) != 0) or np.any(np.asarray(t.tail_gate[s, open_rows:]) != 0):
                _fail(f"layer {layer} {name} tail of slot {s}: rows beyond the open window ({open_rows}) not empty")
            if spec.overlap:
                closed = n >= spec.ratio
                empty = np.all(np.isneginf(np.asarray(t.overlap_gate[s])))
                if closed == empty:
                    _fail(
                        f"layer {layer} {name} slot {s}: overlap slice {'missing' if closed else 'present'} "
                        f"with {n} tokens (ratio {spec.ratio})"
                    )


def _check_prefix(layout: CacheLayout, c: HybridCache) -> None:
    """Records: alive ones chain to alive parents (no cached block left unrestorable while holding
    memory), hold the pages their boundary needs, and own their TAIL snapshot slot exclusively."""
    px = c.prefix
    state = np.asarray(px.state)
    alive = state == 1
    parent = np.asarray(px.parent)
    length = np.asarray(px.length)
    bt = layout.spec.block_tokens
    ps = layout.page_size
    for r in np.nonzero(alive)[0]:
        if parent[r] >= 0 and not alive[parent[r]]:
            _fail(f"prefix record {r} is alive but its parent record {parent[r]} is not")
        if parent[r] >= 0 and length[parent[r]] + bt != length[r]:
            _fail(f"prefix record {r} (boundary {length[r]}) does not extend its parent ({length[parent[r]]})")
        for gi, grp in enumerate(layout.groups):
            # its own block's rows (the earlier ones are its ancestors'), or a window with its snapshot
            row = np.asarray(px.pages[gi][r])
            L = int(length[r])
            hi = L // grp.unit
            lo = max(L - bt, 0) // grp.unit if grp.keep is None else max(hi - grp.keep, 0)
            first = record_first_page(layout, gi, L, np)
            if -(-hi // ps) - first > len(row):
                _fail(f"prefix record {r} (boundary {L}): group {gi} rows [{lo}, {hi}) span more than {len(row)} pages")
            need = first + np.arange(len(row)) < -(-hi // ps)
            if grp.keep is not None and not bool(px.swa_held[r]):
                need[:] = False
            if not (row[need] >= 0).all() or (row[~need] >= 0).any():
                _fail(f"prefix record {r} (boundary {L}): group {gi} pages do not cover rows [{lo}, {hi})")
    tails = np.asarray(px.tail_slot)
    used = np.asarray(px.snap_used)
    held = tails[alive & (tails >= 0)]
    if len(np.unique(held)) != len(held):
        _fail("two prefix records share one TAIL snapshot slot")
    want = np.zeros(used.shape, bool)
    want[held] = True
    if not (want == used).all():
        _fail(f"TAIL snapshot slots in use {np.nonzero(used)[0].tolist()} != held by records {sorted(held.tolist())}")
