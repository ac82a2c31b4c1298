"""The prefix index: cached blocks as records inside `HybridCache`, and a hit as a restoration plan.

A *record* is created when a sequence's length reaches a block boundary L (a multiple of
`block_tokens`). Together with its ancestors (the records of the blocks before it, alive while it
is: eviction takes leaves only) it holds everything needed to restore a new sequence at L:
  * the rows of its own block, [(L - block_tokens) / m, L / m), of every COMPRESSED, INDEXER and
    full-attention group: references (refcount) to the few pages that hold them — shared with the
    sequence that wrote them, never copied. The rows before them are its ancestors'; a restore
    assembles the page table from the chain (`chain_page_row`), so a record's bookkeeping is a few
    pages per group whatever L (`CacheLayout.record_pages`), not a row of max_context's pages;
  * when the retention policy keeps a snapshot at L: the sliding windows [L - window + 1, L) as
    references to their pages (so sliding does not free them), and a copy of every compressor's
    TAIL at L;
  * the block's token ids and parent record (collision rejection), the ABI fingerprint, the indexer
    version, and a checksum of the snapshot bytes.

`restore` runs lookup, the four validation stages and the claim as ONE transition on one cache
value (no TOCTOU by construction):
  0. hash      longest chain of records whose keys match the prompt's block keys
  1. lifecycle each record of the chain alive (not evicted), tokens equal (collision), every page it
               holds still of the generation it was recorded with
  2. ABI       recorded ABI fingerprint == the running engine's
  3. multi-cache intersection  the longest boundary where SWA window, TAIL snapshot and indexer keys
               of the current version are all present
  4. byte      the snapshot's bytes still match their checksum
then maps the chain's pages into the slot (shared; the partially filled last page of each group is
copied so the new sequence never writes into a shared page) and installs the TAIL.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .layout import CacheLayout, Status, set_tail_row
from .plan import DevicePlan
from .policy import window_rebuild_tokens
from .prefix_index import PrefixIndex, RecordState, init_prefix
from .protocol import any_shard, lockstep_axes
from .reasons import Reason
from .spec import ObjectKind
from .state import HybridCache, abi_words
from .transitions import add_refs, advance, checked_slot, keep_if, slide


# ------------------------------------------------------------------------------------ helpers
def _row_range(layout: CacheLayout, g: int, length):
    """Rows [lo, hi) and logical pages [p0, p1) group g holds for a boundary at `length` tokens."""
    grp = layout.groups[g]
    ps = layout.page_size
    hi = length // grp.unit
    lo = jnp.zeros_like(hi) if grp.keep is None else jnp.maximum(hi - grp.keep, 0)
    return lo, hi, lo // ps, (hi + ps - 1) // ps


def record_first_page(layout: CacheLayout, g: int, length, xp=jnp):
    """The logical page of group g that a record at boundary `length` (tokens; int or int array)
    keeps in its first entry (`PrefixIndex.pages[g][r, 0]`): a windowed group's (`keep` rows) first
    window page; any other group's page holding the first row of the record's own block, rows
    [(length - block_tokens) / unit, length / unit). xp: jnp (traced) or np (host)."""
    grp = layout.groups[g]
    hi = length // grp.unit
    if grp.keep is not None:
        lo = xp.maximum(hi - grp.keep, 0)
    else:
        lo = xp.maximum(length - layout.spec.block_tokens, 0) // grp.unit
    return lo // layout.page_size


def chain_page_row(layout: CacheLayout, g: int, pages_g, rec, n, xp=jnp):
    """Group g's page row of a prefix of n blocks, assembled from the records of its chain.

    A record keeps only the pages of its own block (`CacheLayout.record_pages`); logical page p of
    the prefix comes from the last block of the chain whose rows overlap p (that record's sequence
    had every earlier row of the page mapped). A windowed group has no chain: its row is the last
    record's window pages, from `record_first_page` on.

    Args:
      layout: the cache's layout; g: the group.
      pages_g: `PrefixIndex.pages[g]`, int32[NR, K_g].
      rec: int[NB], rec[j] the record of block j (boundary (j + 1) * block_tokens) along the chain.
      n: the prefix's blocks (int or int32 scalar, 1 <= n <= NB; 0 gives an empty row).
      xp: jnp (traced) or np (host).
    Returns:
      int32[M_g]: logical page -> physical page (-1 past the rows of n blocks).
    """
    grp, ps, bt = layout.groups[g], layout.page_size, layout.spec.block_tokens
    p = xp.arange(layout.logical_pages(g))
    k = pages_g.shape[1]
    if grp.keep is not None:  # the window of the last record
        off = p - record_first_page(layout, g, n * bt, xp)
        got = pages_g[rec[xp.maximum(n - 1, 0)], xp.clip(off, 0, k - 1)]
        return xp.where((off >= 0) & (off < k), got, -1).astype(xp.int32)
    end = -(-(n * bt // grp.unit) // ps)
    # the last block j whose first row lies below page p's end: ((j * bt) // unit) // ps <= p
    j = xp.clip(((p + 1) * ps * grp.unit - 1) // bt, 0, xp.maximum(n - 1, 0))
    off = p - record_first_page(layout, g, (j + 1) * bt, xp)
    got = pages_g[rec[j], xp.clip(off, 0, k - 1)]
    return xp.where((p < end) & (off >= 0) & (off < k), got, -1).astype(xp.int32)


_UINT_OF_SIZE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _bytes_checksum(x: jax.Array, salt: int) -> jax.Array:
    """Position-weighted sum of x's elements, each read as the unsigned integer of its bits, mod 2**32
    with odd weights: any single changed element (any changed byte of 1-, 2- or 4-byte elements)
    changes it, an odd weight being invertible mod 2**32. One term per element, not per byte: a
    snapshot's window rows are checksummed at every block boundary a prefill chunk records."""
    word = _UINT_OF_SIZE.get(jnp.dtype(x.dtype).itemsize, jnp.uint8)  # (other sizes: byte by byte)
    b = jax.lax.bitcast_convert_type(x, word).reshape(-1).astype(jnp.uint32)
    w = (jnp.arange(b.shape[0], dtype=jnp.uint32) + jnp.uint32(salt)) * jnp.uint32(2654435761) | jnp.uint32(1)
    return jnp.sum((b + jnp.uint32(1)) * w, dtype=jnp.uint32)


def _snapshot_checksum(layout: CacheLayout, cache: HybridCache, pages_rows: tuple, length, tail_slot) -> jax.Array:
    """Checksum of a snapshot: the TAIL copy in slot `tail_slot` and the SWA window rows in `pages_rows`
    (a record's entries, `PrefixIndex.pages[g][r]`).

    An SWA group without a window (a full-attention layer's rows: keep None) is left out: its rows sit
    in pages the record holds references to, never rewritten while it lives (no ring: its page table
    covers max_context), like the COMPRESSED rows no checksum covers either. Summing them made every
    snapshot and every restore read the whole context (at 8K on the small Gemma 3, ~60 ms per prefill
    chunk, quadratic over a prompt)."""
    px = cache.prefix
    acc = jnp.uint32(0)
    t = jnp.maximum(tail_slot, 0)
    for ci, s in enumerate(px.snaps):
        for ai, a in enumerate((s.tail_kv, s.tail_gate, s.overlap_kv, s.overlap_gate)):
            if a.shape[0] and a.shape[1]:  # (no snapshot slots: tail_snapshots=0)
                acc = acc + _bytes_checksum(a[t], 7919 * (4 * ci + ai + 1))
    ps = layout.page_size
    for gi, grp in enumerate(layout.groups):
        if grp.kind != ObjectKind.SWA or grp.keep is None:
            continue
        lo, hi, p0, _ = _row_range(layout, gi, length)
        keep = grp.keep
        rows = lo + jnp.arange(min(keep, layout.config.max_context))
        ok = rows < hi
        # the record's entries start at the window's first page (`record_first_page`)
        page = jnp.take(pages_rows[gi], jnp.clip(rows // ps - p0, 0, pages_rows[gi].shape[0] - 1))
        pool = cache.groups[gi].pool
        vals = pool[:, jnp.clip(page, 0, pool.shape[1] - 1), rows % ps]  # [L_g, keep, dim]
        vals = jnp.where((ok & (page >= 0))[None, :, None], vals, jnp.zeros_like(vals))
        acc = acc + _bytes_checksum(vals, 104729 * (gi + 1))
    return acc


def _windows_mapped(layout: CacheLayout, cache: HybridCache, slot, length) -> jax.Array:
    """bool: every page the SWA windows at boundary `length` need is mapped in slot `slot`'s tables."""
    ok = jnp.bool_(True)
    for gi, grp in enumerate(layout.groups):
        if grp.kind != ObjectKind.SWA:
            continue
        _, _, p0, p1 = _row_range(layout, gi, length)
        table = cache.groups[gi].page_table[slot]
        logical = jnp.arange(table.shape[0])
        ok = ok & ~jnp.any((logical >= p0) & (logical < p1) & (table < 0))
    return ok


def _count(counters: dict, name: str, n) -> dict:
    c = dict(counters)
    c[name] = c[name] + jnp.asarray(n, jnp.int32)  # names are fixed in state.COUNTERS (static pytree)
    return c


# ------------------------------------------------------------------------------------- record
class _RecordDecision(NamedTuple):
    """What `record` does at its boundary, decided before any write (traced scalars)."""

    known: jax.Array  # bool: the slot given is in [0, slots)
    slot: jax.Array  # int32: that slot, clipped into [0, slots)
    length: jax.Array  # int32: the boundary L
    retain: jax.Array  # bool: a snapshot is wanted (and L is the current length)
    exists: jax.Array  # bool: an alive record with the same key, parent and tokens is reused
    r: jax.Array  # int32: the record written (or reused)
    ok_slot: jax.Array  # bool: the slot, boundary and parent allow a record
    do: jax.Array  # bool: a new record is written at r
    has_snap: jax.Array  # bool: a snapshot is wanted and a snapshot slot is free
    t: jax.Array  # int32: the snapshot slot taken, -1 = none
    upgrade: jax.Array  # bool: the reused record r gains the snapshot it lacked
    snap_now: jax.Array  # bool: a snapshot is taken into slot t
    ok: jax.Array  # bool: the record exists after the call
    staged: jax.Array  # bool: slot t's TAIL was written by the prefill step (`InteriorSnapshots`)


def _record_decision(
    layout: CacheLayout, cache: HybridCache, slot, key, parent, tokens, retain, length, enabled, snap_slot
) -> _RecordDecision:
    """Decide `record`'s writes; arguments as `record`'s (key uint32[4], parent int32, tokens
    int32[bt], retain bool, length int32 or None, enabled bool or None, snap_slot int32 or None).

    Returns:
      _RecordDecision: the record slot r, the snapshot slot t and the gates of every write.
    """
    px = cache.prefix
    known, slot = checked_slot(layout, slot)
    on = (jnp.bool_(True) if enabled is None else jnp.asarray(enabled, bool)) & known
    current = cache.lengths[slot]
    length = current if length is None else jnp.asarray(length, jnp.int32)
    nt = px.snap_used.shape[0]
    snap_slot = jnp.int32(-1) if snap_slot is None else jnp.asarray(snap_slot, jnp.int32)
    # a TAIL the prefill step staged in a free snapshot slot (`InteriorSnapshots`): a boundary inside it
    staged = (snap_slot >= 0) & (snap_slot < nt)
    if nt:  # free, and staged by this slot's last step at this very boundary
        ts = jnp.clip(snap_slot, 0, nt - 1)
        staged = staged & ~px.snap_used[ts] & jnp.all(px.staged[ts] == jnp.stack([slot, length]))
    else:
        staged = jnp.bool_(False)
    # a snapshot exists only at the current length, or where the step staged one, and only with
    # every page of its windows still mapped in the slot
    retain = retain & ((length == current) | staged) & _windows_mapped(layout, cache, slot, length)
    same = (
        (px.state == RecordState.ALIVE)
        & jnp.all(px.key == key[None, :], axis=1)
        & (px.parent == parent)
        & jnp.all(px.tokens == tokens[None, :], axis=1)
    )
    exists = jnp.any(same) & on
    free = px.state != RecordState.ALIVE
    empty = px.state == RecordState.EMPTY
    # prefer never-used slots: tombstones are overwritten last (they still explain later misses)
    slot_for_new = jnp.where(jnp.any(empty), jnp.argmax(empty), jnp.argmax(free))
    r = jnp.where(exists, jnp.argmax(same), slot_for_new).astype(jnp.int32)
    can = exists | jnp.any(free)
    ok_slot = cache.active[slot] & (length > 0) & (length % layout.spec.block_tokens == 0) & (length <= current)
    bt = layout.spec.block_tokens
    safe_parent = jnp.maximum(parent, 0)
    parent_ok = jnp.where(
        parent < 0, length == bt, (px.state[safe_parent] == RecordState.ALIVE) & (px.length[safe_parent] == length - bt)
    )
    ok_slot = ok_slot & parent_ok & on  # a chain whose parent was evicted is not extended (no orphans)
    do = can & ~exists & ok_slot
    snap_free = ~px.snap_used
    has_snap = retain & (staged | jnp.any(snap_free))
    # (no snapshot slots at all -- tail_snapshots=0 -- records keep no TAIL/window: argmax of nothing is undefined)
    # (a slot a step staged a TAIL in for another slot's record goes last)
    unmarked = snap_free & (px.staged[:, 0] < 0) if nt else snap_free
    pick = jnp.where(jnp.any(unmarked), jnp.argmax(unmarked), jnp.argmax(snap_free)) if nt else jnp.int32(-1)
    free_slot = jnp.where(staged, snap_slot, pick) if nt else jnp.int32(-1)
    t = jnp.where(has_snap, free_slot, -1).astype(jnp.int32)
    # a boundary crossed again (e.g. a branch point) may add the snapshot its record lacked
    upgrade = exists & ok_slot & has_snap & ~px.swa_held[r] & (px.tail_slot[r] < 0)
    snap_now = (do & has_snap) | upgrade
    ok = (can & ok_slot) | exists
    return _RecordDecision(
        known, slot, length, retain, exists, r, ok_slot, do, has_snap, t, upgrade, snap_now, ok, staged
    )


def _record_pages(layout: CacheLayout, cache: HybridCache, d: _RecordDecision) -> tuple[tuple, tuple, tuple]:
    """Reference the pages record d.r holds: the pages its own block's rows overlap in every group
    without a window (COMPRESSED, INDEXER, full attention: the earlier rows are its ancestors'), and
    a windowed group's window at boundary d.length only with a snapshot (d.snap_now).

    Returns:
      (groups, pages, gens): the cache's GroupStates with the references added (refcount [P_g]), and
      the prefix index's per-group page entries int32[NR, K_g] and their generations int32[NR, K_g].
    """
    px = cache.prefix
    groups = list(cache.groups)
    pages, gens = list(px.pages), list(px.gens)
    for gi, grp in enumerate(layout.groups):
        g = groups[gi]
        _, _, _, p1 = _row_range(layout, gi, d.length)
        k = px.pages[gi].shape[1]
        logical = record_first_page(layout, gi, d.length) + jnp.arange(k)
        take = logical < p1
        write = d.do
        if grp.keep is not None:  # a sliding window: held with the snapshot
            take = take & d.snap_now
            write = d.do | d.upgrade
        at = jnp.clip(logical, 0, g.page_table.shape[1] - 1)
        row = jnp.where(take, g.page_table[d.slot][at], -1)
        grow = jnp.where(take, g.page_gen[d.slot][at], 0)
        new_g, _ = add_refs(g, jnp.where(write, row, -1), +1)
        groups[gi] = new_g
        pages[gi] = px.pages[gi].at[d.r].set(jnp.where(write, row, px.pages[gi][d.r]))
        gens[gi] = px.gens[gi].at[d.r].set(jnp.where(write, grow, px.gens[gi][d.r]))
    return tuple(groups), tuple(pages), tuple(gens)


def _record_index(
    cache: HybridCache, d: _RecordDecision, key, parent, tokens, pages: tuple, gens: tuple
) -> PrefixIndex:
    """The prefix index after `record` (all but the checksum): record d.r's fields, its pages and
    gens (from `_record_pages`), the slot's TAIL copied into snapshot slot d.t, the clock ticked.

    Returns:
      PrefixIndex: NR records, NT snapshot slots, as `cache.prefix`.
    """
    px = cache.prefix
    r, do = d.r, d.do
    tt = jnp.maximum(d.t, 0)
    copy = d.snap_now & ~d.staged  # (a staged TAIL is in slot t already)
    snaps = tuple(set_tail_row(s, tt, copy, cache.tails[ci], d.slot) for ci, s in enumerate(px.snaps))
    snap_used = (
        px.snap_used.at[tt].set(jnp.where(d.snap_now, True, px.snap_used[tt]))
        if px.snap_used.shape[0]
        else px.snap_used
    )
    staged = px.staged.at[tt].set(jnp.where(d.snap_now, -1, px.staged[tt])) if px.staged.shape[0] else px.staged
    clock = px.clock + d.ok.astype(jnp.int32)
    return px.replace(
        key=px.key.at[r].set(jnp.where(do, key, px.key[r])),
        parent=px.parent.at[r].set(jnp.where(do, parent, px.parent[r])),
        tokens=px.tokens.at[r].set(jnp.where(do, tokens, px.tokens[r])),
        length=px.length.at[r].set(jnp.where(do, d.length, px.length[r])),
        abi=px.abi.at[r].set(jnp.where(do, cache.abi, px.abi[r])),
        iver=px.iver.at[r].set(jnp.where(do, cache.indexer_version, px.iver[r])),
        state=px.state.at[r].set(jnp.where(do, jnp.int8(RecordState.ALIVE), px.state[r])),
        last_used=px.last_used.at[r].set(jnp.where(do | d.exists, clock, px.last_used[r])),
        # a block someone else recorded first (a request computing the same content beside it, or one
        # that hashed to it but could not restore it) is content that came back: one more use, so
        # admission control (`hkv.core.policy`, never_hit) counts it reused, like a restore
        hits=px.hits.at[r].set(jnp.where(do, 0, px.hits[r] + d.exists.astype(jnp.int32))),
        on_disk=px.on_disk.at[r].set(jnp.where(do, False, px.on_disk[r])),
        pages=pages,
        gens=gens,
        swa_held=px.swa_held.at[r].set(jnp.where(do | d.upgrade, d.snap_now, px.swa_held[r])),
        tail_slot=px.tail_slot.at[r].set(jnp.where(d.snap_now, d.t, jnp.where(do, -1, px.tail_slot[r]))),
        snaps=snaps,
        snap_used=snap_used,
        staged=staged,
        clock=clock,
    )


def _record_status(cache: HybridCache, d: _RecordDecision) -> jax.Array:
    """`record`'s status (a scalar `Status` code, cast to int32 by the caller): OK, UNKNOWN_SLOT,
    NO_PAGES (no free record slot), ORPHAN_BLOCK or SLOT_INACTIVE."""
    return jnp.where(
        d.ok,
        Status.OK,
        jnp.where(
            ~d.known,
            Status.UNKNOWN_SLOT,
            jnp.where(
                d.ok_slot,
                Status.NO_PAGES,
                jnp.where(cache.active[d.slot], Status.ORPHAN_BLOCK, Status.SLOT_INACTIVE),
            ),
        ),
    )


def record(
    layout: CacheLayout,
    cache: HybridCache,
    slot: jax.Array,
    key: jax.Array,
    parent: jax.Array,
    tokens: jax.Array,
    retain: jax.Array,
    length: jax.Array | None = None,
    enabled: jax.Array | None = None,
    snap_slot: jax.Array | None = None,
) -> tuple[HybridCache, jax.Array, jax.Array]:
    """Record the block ending at boundary L = `length` (default: slot `slot`'s current length; a
    multiple of block_tokens, at most the current length). A boundary inside the last step (below the
    current length) gets COMPRESSED/INDEXER references only (its window and TAIL are gone already),
    unless the step staged its snapshot (`hkv.core.layers.InteriorSnapshots`): then `snap_slot` names
    the free snapshot slot holding its TAIL, and the step kept its window's pages mapped.

    key uint32[4]; parent int32 (record of the previous block, -1 for the first); tokens int32[bt];
    retain bool: also keep the SWA window and a TAIL snapshot at L (the retention policy's choice).
    Returns (cache, record index, status). An alive record with the same key, parent and tokens is
    reused (its index returned); if it has no snapshot and `retain`, the snapshot is added. A record
    only adds references (no page is allocated), but with no free record slot it returns
    Status.NO_PAGES and the cache unchanged (the policy evicts first). A slot outside [0, slots) gets
    Status.UNKNOWN_SLOT, SLOT_INACTIVE one not claimed, ORPHAN_BLOCK a block whose parent is gone (the
    cache unchanged). enabled=False (traced bool): the cache comes back unchanged and the record index
    is -1 (`record_many`'s skipped blocks).
    """
    d = _record_decision(layout, cache, slot, key, parent, tokens, retain, length, enabled, snap_slot)
    # every write below is gated by a subset of `ok` (do, upgrade, snap_now, exists), so a refused
    # record leaves the cache unchanged without a select over whole arrays (the TAIL snapshot pool
    # and page tables would otherwise be copied on every call)
    groups, pages, gens = _record_pages(layout, cache, d)
    new_px = _record_index(cache, d, key, parent, tokens, pages, gens)
    new = cache.replace(groups=groups, prefix=new_px)
    # summed only when this boundary takes a snapshot (a prefill chunk records 8 boundaries, 1 snapshot)
    csum = jax.lax.cond(
        d.snap_now,
        lambda: _snapshot_checksum(layout, new, tuple(p[d.r] for p in new_px.pages), d.length, d.t),
        lambda: new_px.checksum[d.r],
    )
    new_px = new_px.replace(checksum=new_px.checksum.at[d.r].set(csum))
    counters = _count(cache.counters, "records_created", d.do.astype(jnp.int32))
    counters = _count(counters, "snapshots_taken", d.snap_now.astype(jnp.int32))
    counters = _count(counters, "snapshots_skipped_full", (d.do & d.retain & ~d.has_snap).astype(jnp.int32))
    out = new.replace(prefix=new_px, counters=counters)
    status = _record_status(cache, d)
    return out, jnp.where(d.ok, d.r, -1), status.astype(jnp.int32)


def record_many(
    layout: CacheLayout,
    cache: HybridCache,
    slot: jax.Array,
    keys: jax.Array,
    parent: jax.Array,
    tokens: jax.Array,
    retain: jax.Array,
    lengths: jax.Array,
    valid: jax.Array,
    snap_slots: jax.Array | None = None,
    last: jax.Array | None = None,
) -> tuple[HybridCache, jax.Array, jax.Array, jax.Array]:
    """`record` of K consecutive blocks of one slot's chain in one transition (one dispatch instead
    of K: a prefill chunk or a restore from disk crosses many boundaries at once).

    keys uint32[K, 4]; tokens int32[K, bt]; retain bool[K]; lengths int32[K] (the boundaries, in
    order); valid bool[K] (a prefix of True: padding to a fixed K). Block j is recorded with parent =
    the record block j - 1 got (`parent` for j = 0), exactly as K `record` calls in a row. The first
    block that gets Status.NO_PAGES stops the batch (it and every later block are left unrecorded,
    for the caller to evict and retry from there). snap_slots int32[K] (None: all -1): the snapshot
    slot a prefill step staged each boundary's TAIL in (`record`'s snap_slot). last bool (None: True):
    this is the step's last batch of boundaries; then, when every valid block was processed, the
    slot's windows slide to its length (releasing the windows the step held for its interior
    snapshots). Returns (cache, records int32[K], statuses
    int32[K], done): records/statuses as `record` returned them (-1 for blocks not processed), done
    = the number of leading blocks processed (everything valid, or up to the NO_PAGES block).
    """

    k = keys.shape[0]

    def cond(carry):
        j, _, _, stop, _, _ = carry
        return (j < k) & ~stop

    def body(carry):
        # a loop that ends at the first padding row or NO_PAGES: one padded size (RECORD_BATCH) for
        # every call costs only the rows it records (a scan ran all K rows, masked)
        j, c, par, _, records, statuses = carry
        go = valid[j]
        c, r, st = record(
            layout, c, slot, keys[j], par, tokens[j], retain[j], lengths[j], enabled=go, snap_slot=staged[j]
        )
        no_pages = go & (st == Status.NO_PAGES)
        records = records.at[j].set(jnp.where(go, r, -1).astype(jnp.int32))
        statuses = statuses.at[j].set(jnp.where(go, st, -1).astype(jnp.int32))
        return j + 1, c, jnp.where(go & ~no_pages, r, par), no_pages | ~go, records, statuses

    none = jnp.full((k,), -1, jnp.int32)
    staged = none if snap_slots is None else jnp.asarray(snap_slots, jnp.int32)
    carry = (jnp.int32(0), cache, jnp.asarray(parent, jnp.int32), jnp.bool_(False), none, none)
    _, cache, _, _, records, statuses = jax.lax.while_loop(cond, body, carry)
    done = jnp.sum((statuses >= 0) & (statuses != Status.NO_PAGES)).astype(jnp.int32)
    known, s = checked_slot(layout, slot)
    finished = known & cache.active[s] & ~jnp.any(statuses == Status.NO_PAGES)
    finished = finished if last is None else finished & jnp.asarray(last, bool)
    cache = slide(layout, cache, s[None], finished[None])
    return cache, records, statuses, done


# ------------------------------------------------------------------------------------ restore
def _match_chain(px: PrefixIndex, keys: jax.Array, n_blocks: jax.Array) -> jax.Array:
    """int32[NB] record matching each block key along the parent chain, -1 after the first miss."""
    live = px.state != RecordState.EMPTY
    eq = jnp.all(px.key[None, :, :] == keys[:, None, :], axis=-1) & live[None, :]  # [NB, NR]

    alive = px.state == RecordState.ALIVE

    def body(prev, i):
        cand = eq[i] & (px.parent == prev)
        best = jnp.where(jnp.any(cand & alive), jnp.argmax(cand & alive), jnp.argmax(cand))  # alive over tombstone
        r = jnp.where(jnp.any(cand) & (i < n_blocks) & (prev != -2), best, -1).astype(jnp.int32)
        return jnp.where(r >= 0, r, -2).astype(jnp.int32), r

    _, match = jax.lax.scan(body, jnp.int32(-1), jnp.arange(keys.shape[0]))
    return match


def could_match(key: jax.Array, parent: jax.Array, state: jax.Array, first_key: jax.Array) -> jax.Array:
    """bool[]: whether a lookup whose first block key is `first_key` (uint32[4]) can match any record.

    key uint32[NR, 4], parent int32[NR], state int8[NR]: those fields of the `PrefixIndex`. A chain
    matches from its root (a record with parent -1), so when no record (alive, or a tombstone that
    may name a disk copy) is a root with that key, `restore` can only return the miss plan
    (`hkv.core.plan.DevicePlan.miss`) and would change nothing but the prefix clock, whose values
    only order records relative to each other. Reads NR * 21 bytes; `restore` reads the whole index.
    """
    roots = (state != RecordState.EMPTY) & (parent == -1)
    return jnp.any(roots & jnp.all(key == first_key[None, :], axis=1))


def _leading(ok: jax.Array) -> jax.Array:
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))


class _Stages(NamedTuple):
    """`restore`'s lookup and validation stages 0-3 over the prompt's NB blocks."""

    rec: jax.Array  # int32[NB]: the record matched for each block (0 past the chain)
    h: jax.Array  # int32: stage 0, blocks whose key chain matched
    i: jax.Array  # int32[NB]: block indices
    collision: jax.Array  # bool[NB]: the record's tokens differ from the block's
    reused: jax.Array  # bool[NB]: a recorded page now belongs to someone else
    n1: jax.Array  # int32: stage 1 (lifecycle), leading blocks passing
    n2: jax.Array  # int32: stage 2 (ABI), leading blocks passing
    iver_ok: jax.Array  # bool[NB]: the record's indexer keys are of the current version
    complete: jax.Array  # bool[NB]: boundary (i + 1) * bt passes stages 1-3
    n3: jax.Array  # int32: stage 3 (multi-cache intersection), the longest complete boundary in blocks


def _check_recompute(layout: CacheLayout, recompute: int) -> None:
    """Raise ValueError for a window rebuild (recompute > 0) of a spec with a full-attention layer."""
    if recompute and any(grp.kind == ObjectKind.SWA and grp.keep is None for grp in layout.groups):
        raise ValueError(
            f"recompute={recompute}: a window rebuild cannot restore a spec with full-attention "
            f"layers (window=None: the rebuild claims no attention rows, so theirs before L - R "
            f"would be missing); see hkv.core.policy.window_rebuild_tokens"
        )


def _lifecycle(cache: HybridCache, rec: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Stage 1 per block: the records rec int32[NB] against the prompt's tokens int32[NB, bt].

    Returns:
      (collision, freed, reused), each bool[NB]: the record's tokens differ (a key collision); the
      record or one of its pages was freed; a recorded page now belongs to someone else.
    """
    px = cache.prefix
    nb = rec.shape[0]
    collision = ~jnp.all(px.tokens[rec] == tokens, axis=1)
    freed = px.state[rec] != RecordState.ALIVE
    reused = jnp.zeros((nb,), bool)  # a recorded page now belongs to someone else (newer generation)
    for gi, g in enumerate(cache.groups):
        rows = px.pages[gi][rec]  # [NB, M]
        safe = jnp.maximum(rows, 0)
        stale = (rows >= 0) & (g.generation[safe] != px.gens[gi][rec])
        reused = reused | jnp.any(stale & (g.refcount[safe] > 0), axis=1)
        freed = freed | jnp.any(stale, axis=1)
    return collision, freed, reused


def _stages(layout: CacheLayout, cache: HybridCache, keys: jax.Array, tokens: jax.Array, n_blocks) -> _Stages:
    """Stages 0-3 of `restore` (hash, lifecycle, ABI, multi-cache intersection); keys uint32[NB, 4],
    tokens int32[NB, bt] and n_blocks as `restore`'s.

    Returns:
      _Stages: each stage's count of leading blocks passing, and the per-block facts behind them.
    """
    px = cache.prefix
    nb = keys.shape[0]
    match = _match_chain(px, keys, n_blocks)
    rec = jnp.maximum(match, 0)
    found = match >= 0
    h = _leading(found)
    i = jnp.arange(nb)
    before_h = i < h
    # stage 1: lifecycle
    collision, freed, reused = _lifecycle(cache, rec, tokens)
    ok1 = ~collision & ~freed & ~reused
    n1 = _leading(ok1 & before_h)
    # stage 2: ABI
    ok2 = jnp.all(px.abi[rec] == cache.abi[None, :], axis=1)
    n2 = _leading(ok2 & (i < n1))
    # stage 3: multi-cache intersection at each boundary (i + 1) * bt
    has_indexer = any(grp.kind == ObjectKind.INDEXER for grp in layout.groups)
    iver_ok = (px.iver[rec] == cache.indexer_version) if has_indexer else jnp.ones((nb,), bool)
    complete = px.swa_held[rec] & (px.tail_slot[rec] >= 0) & iver_ok & (i < n2)
    n3 = jnp.max(jnp.where(complete, i + 1, 0))
    return _Stages(rec, h, i, collision, reused, n1, n2, iver_ok, complete, n3)


def _byte_stage(layout: CacheLayout, cache: HybridCache, st: _Stages) -> jax.Array:
    """Stage 4: the snapshot's bytes still match their checksum, tried from the longest complete
    boundary (st.n3 blocks) down.

    Returns:
      int32: n4, the blocks of the longest complete boundary whose checksum holds (0: none).
    """
    px = cache.prefix
    rec, complete = st.rec, st.complete

    def csum_ok(j):
        r = rec[j]
        got = _snapshot_checksum(layout, cache, tuple(p[r] for p in px.pages), px.length[r], px.tail_slot[r])
        return got == px.checksum[r]

    def cond(j):
        return (j >= 0) & ~(complete[jnp.maximum(j, 0)] & csum_ok(jnp.maximum(j, 0)))

    j = jax.lax.while_loop(cond, lambda j: j - 1, st.n3 - 1)
    return j + 1


def _failure(cache: HybridCache, st: _Stages, n4: jax.Array, n_blocks) -> tuple[jax.Array, jax.Array]:
    """The first stage that shrank the plan, and why.

    Returns:
      (first_failed_stage, reason), int32 scalars: the stage 0-4 (-1 when none failed) and its
      `Reason` code (0 when none).
    """
    px, rec, h, n1, n2, n3 = cache.prefix, st.rec, st.h, st.n1, st.n2, st.n3
    last = jnp.maximum(n2 - 1, 0)
    stage3_reason = jnp.where(
        ~px.swa_held[rec[last]],
        Reason.SWA_MISSING.code,
        jnp.where(px.tail_slot[rec[last]] < 0, Reason.TAIL_MISSING.code, Reason.INDEXER_VERSION.code),
    )
    r1 = jnp.where(
        st.collision[n1],
        Reason.COLLISION.code,
        jnp.where(st.reused[n1], Reason.PAGE_REUSED.code, Reason.FREED.code),
    )
    # no block matched at all: a miss (a partial hash hit restored whole is no failure: no reason)
    fail_stage = jnp.where((h == 0) & (n_blocks > 0), 0, 5)
    fail_stage = jnp.where(n1 < h, 1, jnp.where(n2 < n1, 2, jnp.where(n3 < n2, 3, jnp.where(n4 < n3, 4, fail_stage))))
    reason = jnp.select(
        [fail_stage == 1, fail_stage == 2, fail_stage == 3, fail_stage == 4, fail_stage == 0],
        [r1, Reason.ABI_MISMATCH.code, stage3_reason, Reason.CHECKSUM.code, Reason.NO_HASH_MATCH.code],
        0,
    )
    fail_stage = jnp.where(fail_stage == 5, -1, fail_stage)
    return fail_stage, reason


def _writable_in_place(px: PrefixIndex, g, gi: int, unit: int, slot, src, last_l, hi) -> jax.Array:
    """Whether a slot restored at a boundary of `hi` rows may share the partly filled page `src`
    (logical page `last_l`) and write its next rows there instead of a copy: no alive record holding
    the page reaches past `hi` rows (the rows after the boundary are no record's), and no other slot
    maps it (no other writer). A record needs only the rows before its own boundary — as when the
    sequence that records a block inside a page goes on writing the rest of that page — so every
    record and snapshot over `src` stays valid. Without this, every restore inside a page kept one more
    page per group: a conversation restored at each turn held a page per turn in a group whose page
    spans 2,048 tokens (HCA, m = 128), and the pools sized for its blocks ran short."""
    holders = (px.state == RecordState.ALIVE) & jnp.any(px.pages[gi] == src, axis=1)
    reach = jnp.max(jnp.where(holders, px.length // unit, 0))
    others = (g.page_table[:, last_l] == src) & (jnp.arange(g.page_table.shape[0]) != slot)
    return (src >= 0) & (reach <= hi) & ~jnp.any(others)


def _claim_pages(
    layout: CacheLayout, cache: HybridCache, slot: jax.Array, rec: jax.Array, n: jax.Array, do, recompute: int
) -> tuple[tuple, jax.Array]:
    """Map the pages of the chain rec int32[NB]'s first n blocks (boundary `length` = n *
    block_tokens; `chain_page_row`) into `slot`'s page tables (shared, refcounted),
    copying the partially filled last page of each group (copy-on-write); with recompute > 0 the SWA
    groups are left alone (the window is rebuilt). Nothing is mapped unless `do`.

    Returns:
      (groups, enough): the GroupStates after the claim, and bool: every copy-on-write page was free.
    """
    px = cache.prefix
    groups = list(cache.groups)
    enough = jnp.array(True)
    ps = layout.page_size
    length = n * layout.spec.block_tokens
    for gi, grp in enumerate(layout.groups):
        g = groups[gi]
        if recompute and grp.kind == ObjectKind.SWA:
            continue  # the window is rebuilt by the recompute step
        _, hi, p0, p1 = _row_range(layout, gi, length)
        logical = jnp.arange(g.page_table.shape[1])
        row = jnp.where(do & (logical >= p0) & (logical < p1), chain_page_row(layout, gi, px.pages[gi], rec, n), -1)
        last_l = jnp.maximum(p1 - 1, 0)
        src = row[last_l]
        partial = (hi % ps != 0) & (p1 > p0) & do & ~_writable_in_place(px, g, gi, grp.unit, slot, src, last_l, hi)
        free_ids = jnp.nonzero(g.refcount == 0, size=g.refcount.shape[0], fill_value=-1)[0]
        new_page = free_ids[0]
        enough = enough & (~partial | (new_page >= 0))
        shared = jnp.where(partial & (logical == last_l), -1, row)
        g, _ = add_refs(g, shared, +1)
        # copy-on-write of the partially filled last page (scatter dropped when there is none)
        dst = jnp.where(partial & (new_page >= 0), new_page, g.pool.shape[1])
        g = g.replace(pool=g.pool.at[:, dst].set(g.pool[:, jnp.maximum(src, 0)], mode="drop"))
        g, _ = add_refs(g, jnp.where(partial, new_page, -1)[None], +1)
        mapped = jnp.where(partial & (logical == last_l), new_page, shared)
        g = g.replace(
            page_table=g.page_table.at[slot].set(mapped),
            page_gen=g.page_gen.at[slot].set(jnp.where(mapped >= 0, g.generation[jnp.maximum(mapped, 0)], 0)),
        )
        groups[gi] = g
    return tuple(groups), enough


def _touch_path(px: PrefixIndex, rec: jax.Array, i: jax.Array, n4: jax.Array) -> PrefixIndex:
    """Tick the prefix clock and mark the records rec[:n4] (rec int32[NB], i = arange(NB)) used:
    their last_used is the new clock, their hits one more."""
    clock = px.clock + 1
    on_path = i < n4
    used = jnp.zeros_like(px.last_used, bool).at[jnp.where(on_path, rec, px.last_used.shape[0])].set(True, mode="drop")
    return px.replace(
        last_used=jnp.where(used, clock, px.last_used), hits=px.hits + used.astype(jnp.int32), clock=clock
    )


def _claim(
    layout: CacheLayout, cache: HybridCache, slot: jax.Array, st: _Stages, n4: jax.Array, recompute: int
) -> tuple[HybridCache, jax.Array, jax.Array, jax.Array]:
    """Claim the first n4 blocks for `slot`: their chain's pages and (recompute == 0) record rec[n4 - 1]'s TAIL
    snapshot, the path's records marked used, the slot advanced to L = n4 * bt (L - recompute).

    Returns:
      (claimed, r, do, enough): the cache after the claim (to be kept only if the claim is ok), the
      record claimed (int32), whether any block is (bool: n4 > 0), and whether every copy-on-write
      page was free (bool).
    """
    px = cache.prefix
    bt = layout.spec.block_tokens
    length = n4 * bt
    r = st.rec[jnp.maximum(n4 - 1, 0)]
    do = n4 > 0
    groups, enough = _claim_pages(layout, cache, slot, st.rec, n4, do, recompute)
    ts = jnp.maximum(px.tail_slot[r], 0)
    tails = tuple(
        set_tail_row(t, slot, do, px.snaps[ci], ts) for ci, t in enumerate(cache.tails if not recompute else ())
    )
    new_px = _touch_path(px, st.rec, st.i, n4)
    claimed = cache.replace(groups=groups, tails=tails if not recompute else cache.tails, prefix=new_px)
    slots = slot[None]
    claimed = advance(layout, claimed, slots, (length - recompute * do)[None], do[None])
    if not recompute:
        claimed = slide(layout, claimed, slots, do[None])
    return claimed, r, do, enough


def _claim_status(cache: HybridCache, slot: jax.Array, known: jax.Array, enough: jax.Array):
    """`restore`'s outcome for the (clipped) slot: (ok bool, status int32 `Status` code) -- UNKNOWN_SLOT,
    SLOT_INACTIVE (not claimed, or not empty), NO_PAGES (a copy-on-write page unavailable) or OK."""
    valid_slot = known & cache.active[slot] & (cache.lengths[slot] == 0)
    ok = enough & valid_slot
    status = jnp.where(
        ~known,
        Status.UNKNOWN_SLOT,
        jnp.where(~valid_slot, Status.SLOT_INACTIVE, jnp.where(enough, Status.OK, Status.NO_PAGES)),
    )
    return ok, status


def restore(
    layout: CacheLayout,
    cache: HybridCache,
    slot: jax.Array,
    keys: jax.Array,
    tokens: jax.Array,
    n_blocks: jax.Array,
    recompute: int = 0,
    count: bool = True,
) -> tuple[HybridCache, jax.Array]:
    """Look up, validate and claim the longest restorable prefix for a freshly claimed `slot`.

    keys uint32[NB, 4] and tokens int32[NB, bt] of the prompt's blocks (NB = max_context // bt,
    rows >= n_blocks ignored); n_blocks: blocks the caller allows (at most (prompt_len - 1) // bt so
    one token is left to compute logits from). Returns (cache, `DevicePlan`).
    The slot gets length L = byte_blocks * block_tokens with its pages, TAIL and state table set; on
    NO_PAGES (copy-on-write pages unavailable), UNKNOWN_SLOT (`slot` outside [0, slots)) or
    SLOT_INACTIVE (not claimed, or not empty) the cache is unchanged but for the lookup counters
    (count=True) and plan.status says so.

    recompute = R > 0 (static) is the window-recompute mode, for a hit whose SWA window or TAIL is
    missing: claim only the COMPRESSED / INDEXER rows at the longest boundary L passing stages 1-2
    (whose indexer keys are current), and leave the slot at length L - R with no window and an empty
    TAIL; the caller then runs the model over tokens [L - R, L) without sealing, which rebuilds the
    SWA window and TAIL at L exactly when R >= layers x (window - 1). byte_blocks then reports L.
    Raises ValueError (at trace time) for a spec with a full-attention layer: the rebuild claims no
    attention rows, so no rebuild restores it (`hkv.core.policy.window_rebuild_tokens` is 0 there).
    """
    _check_recompute(layout, recompute)
    bt = layout.spec.block_tokens
    known, slot = checked_slot(layout, slot)
    st = _stages(layout, cache, keys, tokens, n_blocks)
    # stage 4: checksum of the snapshot, longest complete boundary first
    n4 = _byte_stage(layout, cache, st)
    # reason: the first stage that shrank the plan, and why
    fail_stage, reason = _failure(cache, st, n4, n_blocks)

    if recompute:  # window-recompute mode: entries only, at the longest lifecycle+ABI boundary
        n4 = jnp.where((st.n2 > 0) & st.iver_ok[jnp.maximum(st.n2 - 1, 0)] & (st.n2 * bt >= recompute), st.n2, 0)
    claimed, r, do, enough = _claim(layout, cache, slot, st, n4, recompute)
    ok, status = _claim_status(cache, slot, known, enough)
    plan = DevicePlan.make(
        hash_blocks=st.h,
        lifecycle_blocks=st.n1,
        abi_blocks=st.n2,
        intersection_blocks=st.n3,
        byte_blocks=jnp.where(ok, n4, 0),
        first_failed_stage=fail_stage,
        reason=reason,
        status=status,
        record=jnp.where(ok & do, r, -1),
    )
    counters = count_plan(layout, cache, plan).counters if count else cache.counters
    out = keep_if(ok, claimed.replace(counters=counters), cache.replace(counters=counters))
    return out, plan


def restore_window(
    model,
    layout: CacheLayout,
    cache: HybridCache,
    slot: jax.Array,
    keys: jax.Array,
    tokens: jax.Array,
    n_blocks: jax.Array,
    ids: jax.Array,
    force: jax.Array | bool = False,
    **step_options,
) -> tuple[HybridCache, DevicePlan, jax.Array]:
    """The window-rebuild route as one transition: `restore` in window-recompute mode (the
    COMPRESSED / INDEXER rows at the longest boundary L passing stages 1-2, the slot left at L - R),
    then the model's `cached_step` over tokens [L - R, L) without sealing, which rebuilds the SWA
    window and TAIL at L exactly (R = `hkv.core.policy.window_rebuild_tokens`).

    Args:
      model: a `hkv.CachedModel` (its `cached_step` runs R tokens of one row).
      layout, cache, slot, keys, tokens, n_blocks: as for `restore`.
      ids: int32[max_context] the prompt's token ids (padded): the rebuilt tokens are read from it.
      force: bool[] run the model's step even when nothing was restored, with no valid token (it
        writes nothing): `Engine.warmup` runs it so the rebuild's kernels have run once before a
        request's first rebuild — on the CPU the first run of the step inside this `lax.cond` branch
        costs several times a later one (colab/02_prefix_reuse's turn with the first rebuild was
        slower than its cold run).
      step_options: passed to `model.cached_step` (the engine's kernel choices).
    Returns:
      (cache, plan, status): plan as `restore`'s (byte_blocks reports L); status the cached step's
      (Status.OK when nothing was restored and no step ran).
    """
    r = window_rebuild_tokens(layout.spec)
    cache, plan = restore(layout, cache, slot, keys, tokens, n_blocks, recompute=r, count=False)
    length = plan.byte_blocks * layout.spec.block_tokens
    real = (plan.status == Status.OK) & (length > 0)
    window = jax.lax.dynamic_slice(ids, (jnp.maximum(length - r, 0),), (r,))[None]
    n_valid = jnp.where(real, r, 0).astype(jnp.int32)[None]  # forced alone: no valid token, nothing written

    def run(c):
        c, _, st = model.cached_step(layout, c, window, slot[None], n_valid, seal=False, **step_options)
        return c, st

    go = real | force
    axes = lockstep_axes(model)
    if axes:  # the step runs on every shard when any needs it; one that did not has no valid token:

        def run(c, run=run):  # it writes nothing, and keeps its counters and an OK status
            new, st = run(c)
            counters = jax.tree.map(lambda a, b: jnp.where(go, a, b), new.counters, c.counters)
            return new.replace(counters=counters), jnp.where(go, st, jnp.int32(Status.OK))

    cache, st = jax.lax.cond(any_shard(go, axes), run, lambda c: (c, jnp.int32(Status.OK)), cache)
    return cache, plan, st


def count_plan(layout: CacheLayout, cache: HybridCache, plan: DevicePlan) -> HybridCache:
    """Add one lookup's final plan to the metrics counters (hash-hit tokens, restored tokens, the
    reason). A caller that tries several plans for one request (window recompute, retries after
    eviction) restores with count=False and counts the plan it kept, once."""
    bt = layout.spec.block_tokens
    counters = _count(cache.counters, "prefix_lookups", 1)
    counters = _count(counters, "prefix_hash_hit_tokens", plan.hash_blocks * bt)
    counters = _count(counters, "prefix_restored_tokens", plan.byte_blocks * bt)
    counters = _count(counters, "prefix_disk_restored_tokens", plan.disk_blocks * bt)
    for reason_ in Reason:
        counters = _count(counters, f"prefix_rejected_{reason_}", (plan.reason == reason_.code).astype(jnp.int32))
    return cache.replace(counters=counters)


# -------------------------------------------------------------------------------------- evict
def evict(
    layout: CacheLayout, cache: HybridCache, swa_mask: jax.Array, tail_mask: jax.Array, record_mask: jax.Array
) -> HybridCache:
    """Evict, per record (bool[NR] masks): its SWA window (`swa_mask`), its TAIL snapshot (`tail_mask`),
    or the whole record (`record_mask`: also its block's COMPRESSED / INDEXER / full-attention
    references). A whole record
    becomes a tombstone: still found by a lookup, which then reports `freed` (or `page_reused` once
    its pages went to someone else). The policy (`hkv.core.policy`) evicts a snapshot's two parts together
    and whole records only as leaves, so a record never outlives what its descendants need."""
    px = cache.prefix
    alive = px.state == RecordState.ALIVE
    whole = record_mask & alive
    swa = (swa_mask | record_mask) & alive & px.swa_held
    tail = (tail_mask | record_mask) & alive & (px.tail_slot >= 0)
    groups = list(cache.groups)
    pages = list(px.pages)
    released = jnp.int32(0)
    for gi, grp in enumerate(layout.groups):
        g = groups[gi]
        drop = swa if grp.keep is not None else whole  # a window goes with its snapshot, rows with the record
        rows = jnp.where(drop[:, None], px.pages[gi], -1)
        g, n = add_refs(g, rows.reshape(-1), -1)
        released = released + n
        groups[gi] = g
        if grp.keep is not None:  # a tombstone keeps its page ids: a later hit can tell reuse from free
            pages[gi] = jnp.where((swa & ~whole)[:, None], -1, px.pages[gi])
    nt = px.snap_used.shape[0]
    snap_used = px.snap_used.at[jnp.where(tail, px.tail_slot, nt)].set(False, mode="drop") if nt else px.snap_used
    new_px = px.replace(
        pages=tuple(pages),
        swa_held=px.swa_held & ~swa,
        tail_slot=jnp.where(tail, -1, px.tail_slot),
        snap_used=snap_used,
        state=jnp.where(whole, jnp.int8(RecordState.TOMBSTONE), px.state),
    )
    c = _count(cache.counters, "evicted_swa_snapshots", jnp.sum(swa))
    c = _count(c, "evicted_tail_snapshots", jnp.sum(tail))
    c = _count(c, "evicted_records", jnp.sum(whole))
    c = _count(c, "pages_released", released)
    return cache.replace(groups=tuple(groups), prefix=new_px, counters=c)


def bump_indexer_version(cache: HybridCache) -> HybridCache:
    """New indexer weights/layout: keys written from now on carry a new version, and records holding
    keys of an older version no longer restore (stage 3, reason `indexer_version`)."""
    return cache.replace(indexer_version=cache.indexer_version + 1)


__all__ = [
    "DevicePlan",
    "PrefixIndex",
    "Reason",
    "RecordState",
    "abi_words",
    "bump_indexer_version",
    "chain_page_row",
    "count_plan",
    "evict",
    "init_prefix",
    "record",
    "record_first_page",
    "record_many",
    "restore",
    "restore_window",
]
