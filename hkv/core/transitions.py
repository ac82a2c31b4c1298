"""Pure transitions of `HybridCache`: `new_cache, result = op(layout, cache, ...)`.

Every function is jit-traceable with `layout` static. Allocation transitions (`claim_slot`,
`reserve`) either complete or return the input cache unchanged with a `Status` (the admission cap
rule: nothing is ever half-applied). Each object kind has its own write path — `write_swa`,
`append_tail`, `seal_compressed`, `write_indexer` — with the kind fixed by the function, never
inferred from the data (the five-state routing rule).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import index_math as im

from . import kv_quant as kvq
from .layout import CacheLayout, Residency, Status, TailState
from .spec import ObjectKind
from .state import HybridCache, form_bits


def _count(cache: HybridCache, name: str, n) -> dict:
    c = dict(cache.counters)
    c[name] = c[name] + jnp.asarray(n, jnp.int32)
    return c


def keep_if(ok, new: HybridCache, old: HybridCache) -> HybridCache:
    """`new` where ok else `old`, leaf by leaf: how a transition that cannot complete returns its
    input unchanged.

    Args:
      ok: bool scalar (traced).
      new, old: caches of one layout (identical shapes).
    Returns:
      A HybridCache; leaves that are the same traced value in both are passed through (no select).
    """
    # Leaves the transition did not touch (the pools, usually) are the same traced value: no select.
    return jax.tree.map(lambda a, b: a if a is b else jnp.where(ok, a, b), new, old)


def first_failure(*checks: tuple[jax.Array, Status]) -> jax.Array:
    """int32 status: the code of the first check (in order) whose flag is set, else Status.OK.

    Args:
      checks: (failed, code) pairs; `failed` a bool scalar, `code` a Status.

    One reduction over the stacked flags, not a chain of `jnp.where`: XLA copies a chain of scalar
    ops into every fusion that reads its result (a step's status gates every masked write: ~50
    fusions in a prefill step each recomputed the whole chain), while a reduction is computed once
    and its result read from memory.
    """
    keys = [16 * i + int(code) for i, (_, code) in enumerate(checks)]  # order first, then the code
    if any(not 0 < int(code) < 16 for _, code in checks):
        raise ValueError(f"codes {[int(c) for _, c in checks]} must be failure Status values in [1, 15]")
    failed = jnp.stack([jnp.asarray(f, bool) for f, _ in checks])
    first = jnp.min(jnp.where(failed, jnp.asarray(keys, jnp.int32), jnp.int32(16 * len(checks))))
    return first & 15  # 16 * len(checks) & 15 == Status.OK


def _set_rows(arr: jax.Array, slots: jax.Array, mask: jax.Array, new: jax.Array) -> jax.Array:
    """arr[slots[b]] = new[b] for the masked batch rows only. An idle (masked-out) row writes
    nothing, so its slot id may be padding that repeats a live row's slot (or any id at all)."""
    idx = jnp.where(mask, slots, arr.shape[0])  # >= 0: no negative-index wrap in the scatter
    return arr.at[idx].set(new.astype(arr.dtype), mode="drop", wrap_negative_indices=False)


def add_refs(group, pages: jax.Array, delta: int):
    """refcount += delta for the valid (>= 0) page ids in `pages`; a page whose count drops to 0 is
    free and gets a new generation. Returns (group, number of pages freed)."""
    p = group.refcount.shape[0]
    idx = jnp.where(pages >= 0, pages, p).reshape(-1)
    refcount = group.refcount.at[idx].add(delta, mode="drop", wrap_negative_indices=False)
    if delta >= 0:
        return group.replace(refcount=refcount), jnp.int32(0)
    freed = jnp.zeros((p,), bool).at[idx].set(True, mode="drop", wrap_negative_indices=False) & (refcount == 0)
    return group.replace(refcount=refcount, generation=group.generation + freed.astype(jnp.int32)), jnp.sum(freed)


# --------------------------------------------------------------------------------- slots
def claim_slot(layout: CacheLayout, cache: HybridCache) -> tuple[HybridCache, jax.Array, jax.Array]:
    """Claim the lowest free slot. Returns (cache, slot int32, status); SLOT_CAP when all are taken."""
    free = ~cache.active
    ok = jnp.any(free)
    slot = jnp.argmax(free).astype(jnp.int32)
    new = cache.replace(
        active=cache.active.at[slot].set(True),
        lengths=cache.lengths.at[slot].set(0),
        counters=_count(cache, "transitions", 1),
    )
    failed = cache.replace(counters=_count(cache, "failed_slot_cap", 1))
    out = keep_if(ok, new, failed)
    return out, jnp.where(ok, slot, -1), jnp.where(ok, Status.OK, Status.SLOT_CAP).astype(jnp.int32)


def checked_slot(layout: CacheLayout, slot) -> tuple[jax.Array, jax.Array]:
    """(known: `slot` is in [0, slots), the slot clipped into that range) for a transition on one
    slot: it indexes with the clipped slot and changes nothing unless known (an index outside would
    wrap, or clamp, to another slot)."""
    slot = jnp.asarray(slot, jnp.int32)
    return (slot >= 0) & (slot < layout.slots), jnp.clip(slot, 0, layout.slots - 1)


def release_slot(layout: CacheLayout, cache: HybridCache, slot: jax.Array) -> tuple[HybridCache, jax.Array]:
    """Free every page of `slot`, clear its tails and state-table rows. UNKNOWN_SLOT if `slot` is not
    in [0, slots), SLOT_INACTIVE if it is not claimed; the cache is then unchanged."""
    known, slot = checked_slot(layout, slot)
    ok = known & cache.active[slot]
    groups = []
    released = jnp.zeros((), jnp.int32)
    for g in cache.groups:
        g, n = add_refs(g, g.page_table[slot], -1)
        released = released + n
        groups.append(
            g.replace(
                page_table=g.page_table.at[slot].set(-1),
                page_gen=g.page_gen.at[slot].set(0),
            )
        )
    tails = tuple(
        t.replace(
            tail_kv=t.tail_kv.at[slot].set(0),
            tail_gate=t.tail_gate.at[slot].set(0),
            overlap_kv=t.overlap_kv.at[slot].set(0),
            overlap_gate=t.overlap_gate.at[slot].set(-jnp.inf),
        )
        for t in cache.tails
    )
    tb = cache.table
    table = tb.replace(
        form=tb.form.at[slot].set(0),
        indexer_version=tb.indexer_version.at[slot].set(0),
        residency=tb.residency.at[slot].set(Residency.ABSENT),
        checksum=tb.checksum.at[slot].set(0),
        location=tb.location.at[slot].set(-1),
        swa_start=tb.swa_start.at[slot].set(0),
        swa_end=tb.swa_end.at[slot].set(0),
    )
    counters = _count(cache, "pages_released", released)
    counters["transitions"] = counters["transitions"] + 1
    new = cache.replace(
        lengths=cache.lengths.at[slot].set(0),
        active=cache.active.at[slot].set(False),
        groups=tuple(groups),
        tails=tails,
        table=table,
        counters=counters,
    )
    status = jnp.where(ok, Status.OK, jnp.where(known, Status.SLOT_INACTIVE, Status.UNKNOWN_SLOT))
    return keep_if(ok, new, cache), status.astype(jnp.int32)


# ----------------------------------------------------------------------------- allocation
def required_rows(layout: CacheLayout, g: int, length: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows [lo, hi) group g must hold for a slot of `length` tokens (after a step). `length` >= 0
    (a negative one, which `reserve` refuses, gives rows rounded towards 0)."""
    grp = layout.groups[g]
    hi = im.div(length, grp.unit)
    lo = jnp.zeros_like(hi) if grp.keep is None else jnp.maximum(hi - grp.keep, 0)
    return lo, hi


def _page_needs(layout: CacheLayout, cache: HybridCache, slots, new_lengths, upto, mask):
    """The pages `reserve` maps: per group (need bool[B, M], page rows int32[B, M]) for the rows the
    windows at `upto` tokens need up to `new_lengths`, whether every pool has them free, and their
    number."""
    ps = layout.page_size
    needs, enough, allocated = [], jnp.array(True), jnp.zeros((), jnp.int32)
    for gi, g in enumerate(cache.groups):
        m = g.page_table.shape[1]
        lo, _ = required_rows(layout, gi, upto)
        _, hi = required_rows(layout, gi, new_lengths)
        first = im.div(lo, ps)  # (lo, hi >= 0 for every request reserve accepts)
        last = im.div(hi + ps - 1, ps)  # exclusive
        logical = jnp.arange(m)[None, :]
        rows = im.take(g.page_table, slots)  # [B, M]
        need = mask[:, None] & (logical >= first[:, None]) & (logical < last[:, None]) & (rows < 0)
        n_need = jnp.sum(need)
        enough = enough & (n_need <= jnp.sum(g.refcount == 0))
        needs.append((need, rows))
        allocated = allocated + n_need
    return needs, enough, allocated


def reserve(
    layout: CacheLayout,
    cache: HybridCache,
    slots: jax.Array,
    new_lengths: jax.Array,
    mask: jax.Array,
    hold: jax.Array | None = None,
) -> tuple[HybridCache, jax.Array] | tuple[HybridCache, jax.Array, jax.Array]:
    """Map pages so that every group can store the rows of `new_lengths[b]` tokens for each slot
    `slots[b]` where `mask[b]`. All or nothing: CONTEXT_CAP if a length exceeds max_context,
    UNKNOWN_SLOT / SLOT_INACTIVE if a slot is out of range / not claimed, BAD_REQUEST if a slot
    appears twice or a length would shrink, NO_PAGES if any pool runs out — and then the cache is
    unchanged. Newly mapped pages are zeroed.

    hold: int32[B] or None. Given, also map the pages of each slot's windows at `min(new_lengths,
    hold)` tokens (`slide`'s hold: a prefill step's interior snapshots) when the pools have them
    free, else reserve as without it; returns (cache, status, held bool) then."""
    unknown = jnp.any(mask & ((slots < 0) | (slots >= layout.slots)))
    slots = jnp.clip(slots, 0, layout.slots - 1)
    over = jnp.any(mask & (new_lengths > layout.config.max_context))
    inactive = jnp.any(mask & ~im.take(cache.active, slots))
    same = (slots[:, None] == slots[None, :]) & mask[:, None] & mask[None, :]
    bad = (jnp.sum(same) > jnp.sum(mask)) | jnp.any(mask & (new_lengths < im.take(cache.lengths, slots)))
    needs, enough, allocated = _page_needs(layout, cache, slots, new_lengths, new_lengths, mask)
    held = jnp.bool_(False)
    if hold is not None:
        held_needs, held_enough, held_allocated = _page_needs(
            layout, cache, slots, new_lengths, jnp.minimum(new_lengths, hold), mask
        )
        held = held_enough
        needs = jax.tree.map(lambda a, b: jnp.where(held, a, b), held_needs, needs)
        enough, allocated = held_enough | enough, jnp.where(held, held_allocated, allocated)

    def allocate(groups):
        """Map the needed pages (refcount, page table and generations) and zero them in the pools."""
        out = []
        for g, (need, rows) in zip(groups, needs, strict=True):
            free_ids = jnp.nonzero(g.refcount == 0, size=g.refcount.shape[0], fill_value=-1)[0]
            rank = jnp.cumsum(need.reshape(-1)) - 1
            pages = jnp.where(need.reshape(-1), free_ids[jnp.clip(rank, 0, free_ids.shape[0] - 1)], -1)
            pages = pages.reshape(need.shape)
            new_gen = jnp.where(need, g.generation[jnp.maximum(pages, 0)], im.take(g.page_gen, slots))
            tgt = jnp.where(need, pages, g.refcount.shape[0]).reshape(-1)
            out.append(
                g.replace(
                    page_table=_set_rows(g.page_table, slots, mask, jnp.where(need, pages, rows)),
                    page_gen=_set_rows(g.page_gen, slots, mask, new_gen),
                    refcount=g.refcount.at[tgt].add(1, mode="drop", wrap_negative_indices=False),
                    # newly mapped pages are cleared: a freed page never shows its previous occupant's rows
                    pool=zero_pages(g.pool, pages.reshape(-1), need.reshape(-1)),
                )
            )
        return tuple(out)

    status = first_failure(
        (unknown, Status.UNKNOWN_SLOT),
        (bad, Status.BAD_REQUEST),
        (over, Status.CONTEXT_CAP),
        (inactive, Status.SLOT_INACTIVE),
        (~enough, Status.NO_PAGES),
    )
    # Most steps map no page (a decode step crosses a page boundary once per page_size tokens): the
    # allocation (a nonzero, a cumsum, gathers and five scatters per group; ~110 us of a ~600 us
    # decode step on the tiny model at batch 8) runs only when something is needed and the request
    # is valid; otherwise every group comes back as it was. Both outcomes then share the same group
    # values, so no select over the pools is needed below.
    ok = status == Status.OK
    groups = jax.lax.cond(ok & (allocated > 0), allocate, lambda gs: tuple(gs), cache.groups)
    counters = _count(cache, "pages_allocated", allocated)
    new = cache.replace(groups=groups, counters=counters)
    fail_name = {Status.NO_PAGES: "failed_no_pages", Status.CONTEXT_CAP: "failed_context_cap"}
    failed = cache.replace(groups=groups)
    for st, name in fail_name.items():
        failed = failed.replace(counters=_count(failed, name, (status == st).astype(jnp.int32)))
    if hold is not None:
        return keep_if(ok, new, failed), status, held & ok
    return keep_if(ok, new, failed), status


def slide(
    layout: CacheLayout, cache: HybridCache, slots: jax.Array, mask: jax.Array, hold: jax.Array | None = None
) -> HybridCache:
    """Release SWA pages whose rows have left every window (all rows < length - keep) for each
    masked slot, and record the window bounds [swa_start, swa_end) in the state table.

    hold: int32[B] or None: keep instead every page the window at `min(length, hold[b])` tokens
    needs (a prefill step holds the windows of the interior block boundaries it snapshots, for the
    `hkv.core.prefix.record_many` right after it, which slides them away)."""
    ps = layout.page_size
    lengths = im.take(cache.lengths, slots)
    upto = lengths if hold is None else jnp.minimum(lengths, hold)
    groups, released = list(cache.groups), jnp.zeros((), jnp.int32)
    for gi, grp in enumerate(layout.groups):
        if grp.kind != ObjectKind.SWA or grp.keep is None:
            continue
        g = cache.groups[gi]
        lo, _ = required_rows(layout, gi, upto)
        logical = jnp.arange(g.page_table.shape[1])[None, :]
        rows = im.take(g.page_table, slots)
        drop = mask[:, None] & ((logical + 1) * ps <= lo[:, None]) & (rows >= 0)
        g, n = add_refs(g, jnp.where(drop, rows, -1).reshape(-1), -1)
        released = released + n
        groups[gi] = g.replace(
            page_table=_set_rows(g.page_table, slots, mask, jnp.where(drop, -1, rows)),
            page_gen=_set_rows(g.page_gen, slots, mask, jnp.where(drop, 0, im.take(g.page_gen, slots))),
        )
    keep = min((grp.keep for grp in layout.groups if grp.kind == ObjectKind.SWA and grp.keep is not None), default=None)
    start = jnp.zeros_like(lengths) if keep is None else jnp.maximum(lengths - keep, 0)
    tb = cache.table
    table = tb.replace(
        swa_start=_set_rows(tb.swa_start, slots, mask, start),
        swa_end=_set_rows(tb.swa_end, slots, mask, lengths),
    )
    return cache.replace(groups=tuple(groups), table=table, counters=_count(cache, "pages_released", released))


# ---------------------------------------------------------------------------- typed writes
def locate_rows(layout: CacheLayout, g, slots: jax.Array, rows: jax.Array, valid: jax.Array):
    """Where rows of a storage group live in its pool.

    Args:
      layout: the cache layout (its page size).
      g: the group's `GroupState` (page table [S, M], pool [L_g, P, page_size, dim]).
      slots: int32[B] slot of each batch row; rows: int32[B, R] row indices; valid: bool[B, R].
    Returns:
      (page, offset, ok), each [B, R]: page = P (out of range, so a scatter drops it) where invalid,
      unmapped, or beyond the page table (a row past capacity is not the last page's row); the
      offset of a negative row (never ok) is some row of a page.
    """
    ps = layout.page_size
    m = g.page_table.shape[1]
    logical = jnp.clip(im.div(rows, ps), 0, m - 1)  # (a negative row: any page; it is not ok)
    page = im.take_rows(im.take(g.page_table, slots), logical)
    ok = valid & (rows >= 0) & (rows < m * ps) & (page >= 0)
    return jnp.where(ok, page, g.pool.shape[1]), im.rem(rows, ps), ok


def put_rows(pool: jax.Array, layer, page: jax.Array, off: jax.Array, values: jax.Array, ok: jax.Array) -> jax.Array:
    """pool[layer, page[i], off[i]] = values[i] for the rows where ok[i], in row order, touching
    only those rows.

    A scatter whose updates may fall outside the pool (how a masked row is dropped) is expanded by
    XLA into a select over the whole pool per update (`select(in_bounds, dynamic_update_slice(...),
    pool)`), so a decode step that wrote one row per layer read and wrote every pool once per row:
    its cost grew with the pools (max_context, slots and the prefix cache's pages), not with the
    rows written. Here each row is an in-place `dynamic_update_slice` at an index clamped into the
    pool, writing back the value already there when the row is masked. Up to 16 rows (a decode step)
    the loop is unrolled; beyond (a prefill chunk) unrolled by 8, which drops most of the loop's own
    per-row work (its counter and carry copies): XLA:CPU runs each of them as a thunk of its own.

    Args:
      pool: [L, P, page_size, D]; layer: the layer index (int or traced int32).
      page, off: int32[...] page (P or more: masked) and row within it; values: [..., D]; ok: bool[...].
    Returns:
      the pool with the rows written.
    """
    d = pool.shape[-1]
    page, off, ok = page.reshape(-1), off.reshape(-1), ok.reshape(-1)
    vals = kvq.to_pool(values.reshape(-1, d), pool.dtype)
    last = pool.shape[1] - 1
    layer = jnp.asarray(layer, jnp.int32)

    def one(i, pool):
        at = (layer, jnp.clip(page[i], 0, last), off[i], jnp.int32(0))
        cur = jax.lax.dynamic_slice(pool, at, (1, 1, 1, d))
        return jax.lax.dynamic_update_slice(pool, jnp.where(ok[i], vals[i].reshape(1, 1, 1, d), cur), at)

    n = page.shape[0]
    return jax.lax.fori_loop(0, n, one, pool, unroll=n if n <= 16 else 8)


def zero_pages(pool: jax.Array, pages: jax.Array, need: jax.Array) -> jax.Array:
    """pool[:, pages[i]] = 0 for every i where need[i], touching only those pages.

    A scatter of zeros over every (page table entry) index, masked ones dropped, is expanded by XLA
    into a loop over all the indices that selects over the whole pool at each: a step that mapped
    one page paid for slots x pages_per_seq passes over the pool (at 8K context, more than the rest
    of a decode step). Here the needed entries are compacted first and the loop runs once per page
    actually mapped, each an in-place `dynamic_update_slice`.

    Args:
      pool: [L, P, page_size, D]; pages: int32[N] page ids (read where need); need: bool[N].
    Returns:
      the pool with those pages zeroed in every layer.
    """
    n = need.shape[0]
    at = jnp.nonzero(need, size=n, fill_value=0)[0]  # the needed entries first, in order
    count = jnp.sum(need.astype(jnp.int32))
    zeros = jnp.zeros((pool.shape[0], 1) + pool.shape[2:], pool.dtype)
    last = pool.shape[1] - 1

    def one(i, pool):
        page = jnp.clip(pages[at[i]], 0, last)
        return jax.lax.dynamic_update_slice(pool, zeros, (jnp.int32(0), page, jnp.int32(0), jnp.int32(0)))

    return jax.lax.fori_loop(0, count, one, pool)


def _write_rows(layout, cache, kind, layer, slots, rows, values, valid):
    gi = layout.spec.group_of(kind, layer)
    grp = layout.groups[gi]
    g = cache.groups[gi]
    li = grp.layers.index(layer)
    page, off, ok = locate_rows(layout, g, slots, rows, valid)
    pool = put_rows(g.pool, li, page, off, values, ok)
    groups = list(cache.groups)
    groups[gi] = g.replace(pool=pool)
    return cache.replace(groups=tuple(groups))


def write_swa(layout, cache, layer: int, slots, positions, kv, valid, hold=None) -> HybridCache:
    """SWA write path: K=V rows kv[B, C, D] at token `positions[B, C]`; rows already outside the
    window being kept (and invalid ones) are dropped, never written. hold: int32[B] or None: keep the
    rows of the window at min(end, hold[b]) instead (`reserve`'s hold)."""
    gi = layout.spec.group_of(ObjectKind.SWA, layer)
    keep = layout.groups[gi].keep
    if keep is not None:
        valid = valid & (positions >= window_start(positions, valid, keep, hold))
    return _write_rows(layout, cache, ObjectKind.SWA, layer, slots, positions, kv, valid)


def window_start(positions: jax.Array, valid: jax.Array, keep: int, hold: jax.Array | None = None) -> jax.Array:
    """int32[B, 1]: the first position a step's SWA writes keep: `keep` rows before the end of each
    row's tokens (`positions[B, C]` where `valid`), or before hold[b] when that is earlier."""
    end = jnp.max(jnp.where(valid, positions + 1, 0), axis=1, keepdims=True)
    if hold is not None:
        end = jnp.minimum(end, hold[:, None])
    return end - keep


def seal_compressed(layout, cache, layer: int, slots, first_entry, entries, count) -> HybridCache:
    """COMPRESSED write path: entries[B, W, D] become entries first_entry[b] + w for w < count[b]."""
    w = jnp.arange(entries.shape[1])[None, :]
    c = _write_rows(
        layout, cache, ObjectKind.COMPRESSED, layer, slots, first_entry[:, None] + w, entries, w < count[:, None]
    )
    return c.replace(counters=_count(c, "entries_sealed", jnp.sum(count)))


def write_indexer(layout, cache, layer: int, slots, first_entry, keys, count) -> HybridCache:
    """INDEXER write path: keys[B, W, Di] at entries first_entry[b] + w (w < count[b]). `advance`
    stamps the blocks they cover with the cache's current indexer version."""
    w = jnp.arange(keys.shape[1])[None, :]
    return _write_rows(
        layout, cache, ObjectKind.INDEXER, layer, slots, first_entry[:, None] + w, keys, w < count[:, None]
    )


def append_tail(layout, cache, tail_index: int, slots, tail_kv, tail_gate, overlap_kv, overlap_gate, mask):
    """TAIL write path: replace compressor `tail_index`'s open-window rows and overlap slice for the
    masked slots. tail_kv/gate [B, ratio, width]; overlap_kv [B, ratio, D]; overlap_gate f32 (biased)."""
    t = cache.tails[tail_index]

    def put(arr, new):
        return _set_rows(arr, slots, mask, new)

    new = TailState(
        tail_kv=put(t.tail_kv, tail_kv),
        tail_gate=put(t.tail_gate, tail_gate),
        overlap_kv=put(t.overlap_kv, overlap_kv) if t.overlap_kv.shape[1] else t.overlap_kv,
        overlap_gate=put(t.overlap_gate, overlap_gate) if t.overlap_gate.shape[1] else t.overlap_gate,
    )
    tails = list(cache.tails)
    tails[tail_index] = new
    return cache.replace(tails=tuple(tails))


# ----------------------------------------------------------------------------------- reads
def read_rows(layout, cache, kind: ObjectKind, layer: int, slots, rows, valid) -> jax.Array:
    """Gather rows[B, R] of `kind` for `layer` -> [B, R, D]; invalid or unmapped rows read as 0."""
    gi = layout.spec.group_of(kind, layer)
    g = cache.groups[gi]
    li = layout.groups[gi].layers.index(layer)
    return rows_at(layout, g, li, *locate_rows(layout, g, slots, rows, valid))


def rows_at(layout, g, li, page, off, ok) -> jax.Array:
    """Group state g's pool rows of layer index li (int or traced) at `locate_rows`' (page, off, ok):
    [..., D] as the spec's rows (`kv_quant.from_pool`), 0 where not ok."""
    vals = kvq.from_pool(g.pool[li, jnp.minimum(page, g.pool.shape[1] - 1), off], layout.spec.row_dtype())
    return jnp.where(ok[..., None], vals, 0)


# --------------------------------------------------------------------------------- advance
def advance(layout: CacheLayout, cache: HybridCache, slots, new_lengths, mask) -> HybridCache:
    """Commit new lengths; refresh the state table (form bits, residency, indexer versions of newly
    written blocks) for every slot from the lengths."""
    lengths = _set_rows(cache.lengths, slots, mask, new_lengths)
    tb = cache.table
    form = block_forms(layout, lengths)
    start = jnp.arange(layout.num_blocks)[None, :] * layout.spec.block_tokens
    written = start < lengths[:, None]
    table = tb.replace(
        form=form,
        residency=jnp.where(form > 0, jnp.int8(Residency.DEVICE), jnp.int8(Residency.ABSENT)),
        indexer_version=jnp.where(
            written, jnp.where(tb.indexer_version > 0, tb.indexer_version, cache.indexer_version), 0
        ),
    )
    written_tokens = jnp.sum(jnp.where(mask, new_lengths - im.take(cache.lengths, slots), 0))
    counters = _count(cache, "tokens_written", written_tokens)
    counters["transitions"] = counters["transitions"] + 1
    return cache.replace(lengths=lengths, table=table, counters=counters)


def block_forms(layout: CacheLayout, lengths: jax.Array) -> jax.Array:
    """uint8[S, NB] object bits per block implied by `lengths` (what `check_invariants` expects).

    Computed with numpy when `lengths` is a numpy array (`check_invariants`, on the host: no eager
    device op per group), with jax.numpy otherwise (inside a transition)."""
    xp = np if isinstance(lengths, np.ndarray) else jnp
    bt = layout.spec.block_tokens
    start = xp.arange(layout.num_blocks)[None, :] * bt
    end = start + bt
    n = lengths[:, None]
    written = start < n
    form = xp.zeros(written.shape, xp.int32)
    for grp in layout.groups:
        if grp.kind == ObjectKind.SWA:
            lo = 0 if grp.keep is None else xp.maximum(n - grp.keep, 0)
            form = form | xp.where(written & (end > lo), form_bits(ObjectKind.SWA), 0)
        else:
            m = grp.unit
            sealed_to = (n // m) * m  # tokens covered by sealed entries
            bit = form_bits(ObjectKind.COMPRESSED if grp.kind == ObjectKind.COMPRESSED else ObjectKind.INDEXER)
            form = form | xp.where(written & (start < sealed_to), bit, 0)
            form = form | xp.where(written & (end > sealed_to), form_bits(ObjectKind.TAIL), 0)
    return form.astype(xp.uint8)
