"""The model-facing cache API: how a model's layers read and write their cache (any Flax model).

A model never sees group numbers, stacked pools or page tables. Its cached step is

    def cached_step(self, layout, cache, tokens, slots, n_valid, *, seal=True, kernel_backend=None,
                    interpret=False):
        def forward(cache, step):                      # step: `Step`, this step's slots and positions
            x = self.embed(step.tokens)
            for i, layer in enumerate(self.layers):
                kv = hkv.LayerCache(step, i)           # a view of layer i's objects for these slots
                q, k, v = layer.project_qkv(x, step.positions)
                cache = kv.write_kv(cache, k, v)       # K/V rows (only rows that stay in the window)
                o = kv.attend(cache, q, k, v, sinks=..., scale=..., softcap=...)
                x = layer.finish(x, o)
            return cache, self.logits(x)
        return hkv.run_step(layout, cache, tokens, slots, n_valid, forward, seal=seal,
                            kernel_backend=kernel_backend, interpret=interpret)

`run_step` reserves pages for the step (all or nothing: a failure returns the cache unchanged, zero
logits and the `Status`), and afterwards commits lengths and slides windows. Every op has a decode
path (one token per row: `pallas_kernels`, Pallas on GPU/TPU, the jnp reference on CPU) and a prefill
path (jnp), with the same signature; which one runs is decided by the step's shape (C == 1: decode).
A cached_step that also takes `read_tokens=None` and passes it on to `run_step` lets the engine run
prefill and decode in read sizes (`Step.read_tokens`: reads cover the tokens held, not max_context).

Layers with a compressor (article §2) also call `LayerCache.compress` (feed this step's projected
rows; hkv keeps the TAIL of the open window and seals every window the step closes, with the model's
own compression math) and, for sparse layers, `LayerCache.index_topk` (the learned indexer's top-k
over the INDEXER keys), then `attend(..., compressed=True, picks=...)`.

Layers of the same structure may run under one `jax.lax.scan` instead of a Python loop, so that the
traced program (and compile time) does not grow with depth: `plan_layer_runs` splits the layers into
runs of a repeating period, and `scan_layers(step, cache, run, body, carry, xs)` scans `body` over a
run's repetitions, handing it `LayerCache` views that address each layer's objects in the stacked
pools by a traced index (the decode kernels read stacked pools in place with it).

Shapes: B rows (slots) per step, C tokens per row, H query heads, Hkv KV heads, D head width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

import pallas_kernels as pk
from pallas_kernels import index_math as im
from pallas_kernels import numerics as nm

from . import kv_quant as kvq
from . import transitions as tr
from .layout import CacheLayout, Status, TailState
from .spec import ObjectKind
from .state import HybridCache, check_layout


@struct.dataclass
class Step:
    """One cached step: which slot each row runs and at which positions (built by `run_step`).

    Attributes:
      slots: int32[B] slot of each row.
      start: int32[B] tokens the slot held before this step (the first new token's position).
      n_valid: int32[B] new tokens of each row (0: an idle row).
      positions: int32[B, C] absolute position of each token (start + column).
      valid: bool[B, C] column < n_valid.
      mask: bool[B] the row runs (n_valid > 0 and the step's pages were reserved).
      tokens: int32[B, C] the step's token ids, 0 where not valid (safe to embed).
      layout: the cache layout (static).
      seal: whether windows this step closes are sealed into COMPRESSED / INDEXER rows (False: the
        prefix cache's window rebuild, which re-runs tokens whose entries are already sealed).
      read_tokens: a static bound on the tokens any running row holds after the step (None:
        `max_context`); prefill reads of compressed entries and full-attention rows, and the decode
        kernels' page tables (`LayerCache._step_table`), cover only that many tokens, so a step's
        cost follows the context held, not the capacity (`run_step` refuses a step whose rows would
        exceed it).
      backend, interpret: the `pallas_kernels` implementation of the decode ops.
      logit_rows: int32[B, R] the chunk rows whose logits the caller wants (None: every row);
        `head_rows` applies it.
      snapshot_at: int32[B, K] interior block boundaries (token counts in (start, start + n_valid])
        whose TAIL `LayerCache.compress` stages for a snapshot, -1 for none (`InteriorSnapshots`);
        None: no staging.
      hold: int32[B] the earliest of them per row (SWA writes keep the window there too), or None.
    """

    slots: jax.Array
    start: jax.Array
    n_valid: jax.Array
    positions: jax.Array
    valid: jax.Array
    mask: jax.Array
    tokens: jax.Array
    layout: CacheLayout = struct.field(pytree_node=False)
    seal: bool = struct.field(pytree_node=False, default=True)
    read_tokens: int | None = struct.field(pytree_node=False, default=None)
    backend: str | None = struct.field(pytree_node=False, default=None)
    interpret: bool = struct.field(pytree_node=False, default=False)
    logit_rows: jax.Array | None = None
    snapshot_at: jax.Array | None = None
    hold: jax.Array | None = None

    def head_rows(self, x: jax.Array) -> jax.Array:
        """x [B, C, ...] (the hidden states before the final norm and head) at the rows whose logits
        the step returns: [B, R, ...] when the caller asked for `logit_rows`, else x. A model that
        applies it computes R rows of logits instead of C (a prefill chunk samples from one row); one
        that does not still works (`run_step` picks the rows from its C)."""
        return x if self.logit_rows is None else im.take_rows(x, self.logit_rows)

    @property
    def new_len(self) -> jax.Array:
        """int32[B] tokens each slot holds after the step."""
        return self.start + self.n_valid

    @property
    def kernel_lengths(self) -> jax.Array:
        """int32[B] tokens per row including this step's, 0 for a masked row (reads nothing): the
        `lengths` argument of the `pallas_kernels` decode ops."""
        return self.new_len * self.mask

    @property
    def context_bound(self) -> int:
        """Tokens a prefill read covers (static): `read_tokens`, at most `max_context`."""
        m = self.layout.config.max_context
        return m if self.read_tokens is None else min(self.read_tokens, m)

    @property
    def decode(self) -> bool:
        """One token per row (static): the ops take their `pallas_kernels` decode path."""
        return self.positions.shape[1] == 1


class InteriorSnapshots(NamedTuple):
    """The block boundaries inside a prefill step whose SWA + TAIL snapshot the step prepares
    (`run_step(snapshots=...)`), so that a chunk of any width can be restored at each of them.

    For each row b and column k with `at[b, k]` a block boundary in (start, start + n_valid] and
    `slot[b, k]` a free TAIL snapshot slot (not `snap_used`), the step writes every compressor's
    TAIL as it stands at that boundary into snapshot slot `slot[b, k]` and keeps the SWA pages of
    the window at that boundary mapped after the step. `hkv.core.prefix.record_many`, run next for
    that slot with the same slots (`snap_slots`), turns them into snapshots of its records and slides
    the window. Other entries are ignored (use -1).

    Attributes:
      at: int32[B, K] boundaries (tokens held at the boundary), -1 for none.
      slot: int32[B, K] the TAIL snapshot slot of each, -1 for none; distinct among used entries.
    """

    at: jax.Array
    slot: jax.Array


def run_step(
    layout: CacheLayout,
    cache: HybridCache,
    tokens: jax.Array,
    slots: jax.Array,
    n_valid: jax.Array,
    forward: Callable[[HybridCache, Step], tuple[HybridCache, jax.Array]],
    *,
    seal: bool = True,
    kernel_backend: str | None = None,
    interpret: bool = False,
    read_tokens: int | None = None,
    logit_rows: jax.Array | None = None,
    snapshots: InteriorSnapshots | None = None,
) -> tuple[HybridCache, jax.Array, jax.Array]:
    """Run `forward(cache, step) -> (cache, logits)` as one pure transition of the cache.

    Reserves the pages every group needs for `n_valid[b]` more tokens of slot `slots[b]` (all or
    nothing), calls `forward` (whose layer ops write only masked rows), then commits the new lengths
    and slides the windows (pages that left every window are released).

    Args:
      layout: the cache layout (static under jit).
      cache: a cache of `layout` (`check_layout` runs at trace time).
      tokens: int32[B, C]; row b runs tokens[b, :n_valid[b]].
      slots: int32[B] claimed slots, each at most once among rows with n_valid > 0.
      n_valid: int32[B] in [0, C]; 0 = an idle row.
      forward: the model's layers over `Step`; returns (cache, logits float[B, C, V]).
      seal: see `Step.seal`.
      kernel_backend, interpret: see `Step.backend` (None: Pallas on GPU/TPU, the reference on CPU).
      read_tokens: see `Step.read_tokens`: an int in [1, max_context] bounding the tokens any running
        row holds after the step (a prefill read-size bucket, `read_buckets`), or None.
      logit_rows: int32[B, R] with R < C (or R = C = 1): return the logits of these chunk rows only
        (indices clipped into [0, C)); forward may compute just them (`Step.head_rows`). None: all.
      snapshots: `InteriorSnapshots` with [B, K] fields: prepare the snapshots of these interior
        block boundaries (TAILs written into the given snapshot slots, windows kept mapped) for
        the `record_many` that follows. None: none.

    Returns:
      (cache, float32[B, C, V] logits ([B, R, V] with logit_rows), status int32). On a status other
      than OK the cache comes back unchanged (the pools too: every write is masked, so no copy is
      made) and the logits are zeros.
      A row that would hold more than `read_tokens` tokens, or an n_valid outside [0, C], fails the
      step with BAD_REQUEST.
    """
    check_layout(layout, cache)
    max_context = layout.config.max_context
    if read_tokens is not None and (
        isinstance(read_tokens, bool) or not isinstance(read_tokens, int) or not 1 <= read_tokens <= max_context
    ):
        raise ValueError(f"read_tokens={read_tokens!r} must be None or an int in [1, {max_context}]")
    if tokens.ndim != 2 or slots.shape != tokens.shape[:1] or n_valid.shape != tokens.shape[:1]:
        raise ValueError(
            f"tokens{list(tokens.shape)}, slots{list(slots.shape)}, n_valid{list(n_valid.shape)} must be "
            f"[B, C], [B], [B]"
        )
    c = tokens.shape[1]
    if logit_rows is not None:
        logit_rows = jnp.asarray(logit_rows)
        r = logit_rows.shape[1] if logit_rows.ndim == 2 else 0
        if logit_rows.shape[:1] != tokens.shape[:1] or not (1 <= r < c or r == c == 1):
            raise ValueError(
                f"logit_rows{list(logit_rows.shape)} must be [{tokens.shape[0]}, R] with 1 <= R < C={c} (or R = C = 1)"
            )
        logit_rows = jnp.clip(logit_rows.astype(jnp.int32), 0, c - 1)
    if snapshots is not None:
        snapshots = InteriorSnapshots(*(jnp.asarray(a) for a in snapshots))
        if (
            snapshots.at.ndim != 2
            or snapshots.at.shape[:1] != tokens.shape[:1]
            or snapshots.slot.shape != snapshots.at.shape
        ):
            raise ValueError(
                f"snapshots.at{list(snapshots.at.shape)} and snapshots.slot{list(snapshots.slot.shape)} must both be "
                f"[{tokens.shape[0]}, K]"
            )
    start = im.take(cache.lengths, slots)
    new_len = start + n_valid
    # n_valid outside [0, C] names tokens the step does not hold (or none): refuse the step
    over = jnp.any((n_valid < 0) | (n_valid > c))
    # a row past the read bound would read truncated entries: refuse the step
    if read_tokens is not None and read_tokens < max_context:
        known = (slots >= 0) & (slots < layout.slots)  # an unknown slot stays reserve's UNKNOWN_SLOT
        over = over | jnp.any((n_valid > 0) & known & (new_len > read_tokens))
    snap_at = staged = hold = None
    if snapshots is None:
        reserved, status = tr.reserve(layout, cache, slots, new_len, (n_valid > 0) & ~over)
    else:  # the windows of the interior boundaries stay mapped (when the pools have room for them)
        staged = _snapshot_entries(layout, cache, snapshots, start, new_len, n_valid > 0)
        hold = jnp.min(jnp.where(staged, snapshots.at.astype(jnp.int32), _NO_HOLD), axis=1)
        reserved, status, held = tr.reserve(layout, cache, slots, new_len, (n_valid > 0) & ~over, hold)
    status = jnp.where(over, jnp.int32(Status.BAD_REQUEST), status)
    ok = status == Status.OK
    mask = (n_valid > 0) & ok
    positions = start[:, None] + jnp.arange(c)[None, :]
    valid = jnp.arange(c)[None, :] < n_valid[:, None]
    if snapshots is not None:
        staged = staged & mask[:, None] & held
        hold = jnp.where(held, hold, _NO_HOLD)
        snap_at = jnp.where(staged, snapshots.at.astype(jnp.int32), -1)
        reserved = _with_staging_rows(reserved, snap_at.size)
    step = Step(
        slots=slots,
        start=start,
        n_valid=n_valid,
        positions=positions,
        valid=valid,
        mask=mask,
        tokens=jnp.where(valid, tokens, 0),
        layout=layout,
        seal=seal,
        read_tokens=read_tokens,
        backend=kernel_backend,
        interpret=interpret,
        logit_rows=logit_rows,
        snapshot_at=snap_at,
        hold=hold,
    )
    out, logits = forward(reserved, step)
    if snapshots is not None:
        out = _install_staged(layout, out, slots, mask, staged, snapshots)
    if logit_rows is not None and logits.shape[1] != logit_rows.shape[1]:
        logits = im.take_rows(logits, logit_rows)  # a forward that computed every row
    out = tr.advance(layout, out, slots, new_len, mask)
    out = tr.slide(layout, out, slots, mask, hold)
    counters = jax.tree.map(lambda new, old: jnp.where(ok, new, old), out.counters, reserved.counters)
    return out.replace(counters=counters), jnp.where(ok, logits.astype(jnp.float32), 0.0), status


def _open_window(comp, buf_kv, buf_gate, total, prior_kv, prior_gate, gate_bias) -> tuple:
    """The TAIL a compressor keeps once the first `total` rows of its buffer are in.

    Args:
      comp: the compressor's `CompressorSpec` (ratio m, entry_dim d, proj_width W, overlap).
      buf_kv, buf_gate: [B, Lb, W] the open window's rows followed by the step's.
      total: int32[B, K] rows of the buffer taken (each in [0, Lb]).
      prior_kv, prior_gate: [B, m, d] the overlap state before the step (None without overlap).
      gate_bias: [m, W] added to the gate rows kept as the overlap state, or None.
    Returns:
      (tail_kv, tail_gate [B, K, m, W]: the still-open window's rows moved to the front, the rest
      zero; overlap_kv, overlap_gate [B, K, m, d] (float32 gate): the first d columns of the last
      window closed, or the prior state when none closed ([B, K, 0, d] without overlap)).
    """
    m, d, width = comp.ratio, comp.entry_dim, comp.proj_width
    b, k = total.shape
    lb = buf_kv.shape[1]
    count = im.div(total, m)
    i = jnp.arange(m)

    def rows(buf, idx):
        return im.take_rows(buf, idx.reshape(b, k * m)).reshape(b, k, m, width)

    src = jnp.clip(count[..., None] * m + i, 0, lb - 1)
    keep = (i < (total - count * m)[..., None])[..., None]
    tail_kv, tail_gate = jnp.where(keep, rows(buf_kv, src), 0), jnp.where(keep, rows(buf_gate, src), 0)
    if not comp.overlap:
        return tail_kv, tail_gate, jnp.zeros((b, k, 0, d)), jnp.zeros((b, k, 0, d))
    bias = jnp.zeros((m, width), jnp.float32) if gate_bias is None else gate_bias
    last = jnp.clip((count - 1)[..., None] * m + i, 0, lb - 1)
    ca_kv = rows(buf_kv, last)[..., :d]
    ca_gate = (rows(buf_gate, last) + bias)[..., :d]
    closed = (count > 0)[..., None, None]
    ov_kv = jnp.where(closed, ca_kv, prior_kv[:, None].astype(ca_kv.dtype))
    ov_gate = jnp.where(closed, ca_gate.astype(jnp.float32), prior_gate[:, None])
    return tail_kv, tail_gate, ov_kv, ov_gate


_TAIL_FIELDS = tuple(f.name for f in dataclasses.fields(TailState))  # what `_open_window` returns, in order
_NO_HOLD = np.iinfo(np.int32).max  # a hold past every length: windows slide as without one


def _snapshot_entries(layout, cache, snapshots: InteriorSnapshots, start, new_len, mask) -> jax.Array:
    """bool[B, K]: the `InteriorSnapshots` entries a step prepares: a block boundary inside the row's
    new tokens, of a running row, with a free snapshot slot (never one a record holds)."""
    at, slot = snapshots.at.astype(jnp.int32), snapshots.slot.astype(jnp.int32)
    px = cache.prefix
    nt = px.snap_used.shape[0]
    free = ~im.take(px.snap_used, jnp.clip(slot, 0, max(nt - 1, 0))) if nt else jnp.zeros(slot.shape, bool)
    inside = (at > start[:, None]) & (at <= new_len[:, None]) & (at % layout.spec.block_tokens == 0)
    ok = inside & mask[:, None] & (slot >= 0) & (slot < nt) & free
    # one entry per snapshot slot: a slot named twice keeps its first entry
    flat = jnp.where(ok, slot, -1).reshape(-1)
    first = jnp.argmax(flat[:, None] == flat[None, :], axis=1) == jnp.arange(flat.shape[0])
    return ok & first.reshape(ok.shape)


def _with_staging_rows(cache: HybridCache, n: int) -> HybridCache:
    """The cache with n rows appended to every TAIL field: where `LayerCache.compress` stages the
    TAILs of a step's `InteriorSnapshots` (row `slots + b * K + k`)."""
    pad = lambda a: jnp.concatenate([a, jnp.zeros((n, *a.shape[1:]), a.dtype)])
    return cache.replace(tails=tuple(jax.tree.map(pad, t) for t in cache.tails))


def _install_staged(
    layout: CacheLayout,
    cache: HybridCache,
    slots: jax.Array,
    mask: jax.Array,
    staged: jax.Array,
    snaps: InteriorSnapshots,
) -> HybridCache:
    """Move the staged TAIL rows (`_with_staging_rows`) of entries `staged` bool[B, K] into the prefix
    index's snapshot slots `snaps.slot` int32[B, K], marking each with (cache slot, boundary) in
    `PrefixIndex.staged` (the marks of the step's running slots from earlier steps are cleared
    first: only the record right after the step may take them); drop the staging rows."""
    s = layout.slots
    px = cache.prefix
    nt = px.snap_used.shape[0]
    idx = jnp.where(staged, snaps.slot, nt).reshape(-1)
    ran = jnp.any((px.staged[:, :1] == jnp.where(mask, slots, -2)[None, :]), axis=1)
    cleared = jnp.where(ran[:, None], -1, px.staged)
    row_slot = jnp.broadcast_to(slots[:, None], staged.shape).astype(jnp.int32)
    mark = jnp.stack([row_slot, snaps.at.astype(jnp.int32)], axis=-1).reshape(-1, 2)
    marks = cleared.at[idx].set(mark, mode="drop", wrap_negative_indices=False) if nt else cleared
    tails, snaps = [], list(px.snaps)
    for ci, t in enumerate(cache.tails):
        tails.append(jax.tree.map(lambda a: a[:s], t))
        if nt:
            snaps[ci] = jax.tree.map(
                lambda d, a: d.at[idx].set(a[s:].astype(d.dtype), mode="drop", wrap_negative_indices=False),
                px.snaps[ci],
                t,
            )
    return cache.replace(tails=tuple(tails), prefix=px.replace(snaps=tuple(snaps), staged=marks))


def default_read_buckets(max_context: int, smallest: int = 1024) -> tuple[int, ...]:
    """The default prefill read sizes (`run_step`'s `read_tokens`) for a cache of `max_context` tokens:
    powers of two in [smallest, 3/4 of max_context] (one compilation per size and prefill width;
    one within a quarter of max_context would save too little to pay for its compile). A step then
    reads at most twice the entries its rows hold, or max_context's worth (without them: always).

    >>> default_read_buckets(8224)
    (1024, 2048, 4096)
    """
    if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1:
        raise ValueError(f"max_context={max_context!r} must be a positive integer")
    if isinstance(smallest, bool) or not isinstance(smallest, int) or smallest < 1:
        raise ValueError(f"smallest={smallest!r} must be a positive integer")
    out, r = [], 1 << (smallest - 1).bit_length()
    while 4 * r <= 3 * max_context:
        out.append(r)
        r *= 2
    return tuple(out)


def read_size(sizes: Sequence[int | None], tokens: int) -> int | None:
    """The smallest of ascending `sizes` (the last is max_context, or (None,)) holding `tokens`."""
    return next((r for r in sizes if r is None or r >= tokens), sizes[-1])


# ------------------------------------------------------------------------------ attention math
def causal_entry_limit(positions: jax.Array, ratio: int) -> jax.Array:
    """Compressed entries visible to a query at absolute position t: (t + 1) // ratio (t >= 0)."""
    return im.div(positions + 1, ratio)


def indexer_scores(q: jax.Array, weights: jax.Array, keys: jax.Array, head_dim: int) -> jax.Array:
    """Lightning-indexer scores  sum_h w[h] * relu(q_h . k_s) / sqrt(head_dim), in the order of the
    numerical contract (`pallas_kernels.numerics.indexer_scores`, the decode kernels' reference too).

    q: [B, S, H, Dh]; weights: float32[B, S, H]; keys: [B, N, Dh] -> float32[B, S, N].
    """
    return nm.indexer_scores(q, weights, keys, head_dim**-0.5)


def select_topk(scores: jax.Array, limit: jax.Array, k: int) -> jax.Array:
    """Top-k entries per query with causal masking.

    scores: float32[B, S, N]; limit: int[B, S] number of entries each query may see.
    Returns int32[B, S, k] indices, best first; ties break by the LOWEST index first (`lax.top_k`
    is stable); picks that fall on masked entries, and slots beyond N, are -1.
    """
    n = scores.shape[-1]
    entry = jnp.arange(n, dtype=jnp.int32)
    masked = jnp.where(entry[None, None, :] < limit[..., None], scores, -jnp.inf)
    kk = min(k, n)
    if kk == 0:
        return jnp.full(scores.shape[:-1] + (k,), -1, jnp.int32)
    _, idx = jax.lax.top_k(masked, kk)
    idx = jnp.where(idx < limit[..., None], idx, -1).astype(jnp.int32)
    if kk < k:
        idx = jnp.concatenate([idx, jnp.full(idx.shape[:-1] + (k - kk,), -1, jnp.int32)], axis=-1)
    return idx


def gather_picks(entries: jax.Array, picks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each query's picked compressed entries (the keys of a sparse layer's attention).

    entries: [B, N, D] rows of one shared K=V head; picks: int32[B, T, k] (-1 = none) ->
    (rows [B, T, k, 1, D], bias float32[B, T, k]: 0 at a pick, -inf at -1). With no entry yet (N = 0)
    every pick is -1 and the rows are zeros.
    """
    b = entries.shape[0]
    if entries.shape[1] == 0:
        entries = jnp.zeros((b, 1, entries.shape[2]), entries.dtype)
    rows = entries[jnp.arange(b)[:, None, None], jnp.maximum(picks, 0)]  # [B, T, k, D]
    bias = jnp.where(picks >= 0, 0.0, -jnp.inf).astype(jnp.float32)
    return rows[:, :, :, None, :], bias


SCORE_BLOCK_ELEMENTS = 1 << 22  # float32 elements of [queries x heads x entries] scored at once (16 MiB)


def indexer_topk(
    q: jax.Array, weights: jax.Array, keys: jax.Array, limit: jax.Array, k: int, *, block: int | None = None
) -> jax.Array:
    """`select_topk(indexer_scores(q, weights, keys, Dh), limit, k)` scored in blocks of queries, so the
    [queries x heads x entries] products are never all materialised at once (a long prefill chunk over a
    long context would need gigabytes).

    q: [B, S, H, Dh]; weights: float32[B, S, H]; keys: [B, N, Dh]; limit: int[B, S]; k: picks.
    block: queries per block (None: as many as keep B x block x H x N under `SCORE_BLOCK_ELEMENTS`).
    Returns int32[B, S, k] as `select_topk`.
    """
    b, s, h, dh = q.shape
    n = keys.shape[1]
    if block is None:
        block = max(1, SCORE_BLOCK_ELEMENTS // max(1, b * h * n))
    if block < 1:
        raise ValueError(f"{block=} must be >= 1")
    if s <= block:
        return select_topk(indexer_scores(q, weights, keys, dh), limit, k)

    def one(qb, wb, lb):
        return select_topk(indexer_scores(qb, wb, keys, dh), lb, k)

    return _in_query_blocks(one, block, (q, weights, limit), (0, 0, 0))  # padded queries see no entries


def _in_query_blocks(fn, block: int, args: tuple, fills: tuple) -> jax.Array:
    """`fn` a block of `block` queries at a time (`jax.lax.map`): args are [B, S, ...] arrays, each
    padded along S to whole blocks with its `fills` value; fn(*[B, block, ...] pieces) -> [B, block,
    ...]. Returns fn's outputs for the S queries, [B, S, ...]."""
    b, s = args[0].shape[:2]
    nb = -(-s // block)
    pad = nb * block - s

    def blocks(x, fill):  # [B, S, ...] -> [nb, B, block, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return jnp.moveaxis(x.reshape((b, nb, block) + x.shape[2:]), 1, 0)

    out = jax.lax.map(lambda xs: fn(*xs), tuple(blocks(x, f) for x, f in zip(args, fills, strict=True)))
    return jnp.moveaxis(out, 0, 1).reshape((b, nb * block) + out.shape[3:])[:, :s]


def selection_bias(indices: jax.Array, n_entries: int) -> jax.Array:
    """int32[B, S, k] entry indices (-1 = none) -> float32[B, S, n_entries], 0 at selected, -inf elsewhere."""
    b, s, _ = indices.shape
    safe = jnp.where(indices >= 0, indices, n_entries)
    base = jnp.full((b, s, n_entries + 1), -jnp.inf, jnp.float32)
    return base.at[jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None], safe].set(0.0)[..., :n_entries]


def _compressed_source(entries: jax.Array, limit: jax.Array | None, picks: jax.Array | None) -> nm.KeyTiles:
    """The compressed entries a query attends, as key tiles after the window's: every causal entry
    (`limit` int32[B, C]: entries each query sees; tiles shared by the row's queries) or each query's
    `picks` (int32[B, C, k], -1 = none; tiles per query, in pick order). entries: [B, N, D] (one K=V head)."""
    if picks is None:
        rows = nm.pad_tiles(entries, 1)[:, None, :, :, None, :]  # [B, 1, T, KT, 1, D]
        e = jnp.arange(rows.shape[2] * nm.KEY_TILE, dtype=jnp.int32).reshape(rows.shape[2], nm.KEY_TILE)
        return nm.KeyTiles(rows, rows, e[None, None] < limit[:, :, None, None])
    got, bias = gather_picks(entries, picks)  # [B, C, k, 1, D]
    rows = nm.pad_tiles(jnp.where((bias == 0)[..., None, None], got, jnp.zeros((), got.dtype)), 2)
    return nm.KeyTiles(rows, rows, nm.pad_tiles(bias == 0, 2))  # rows [B, C, T, KT, 1, D]


# Elements of picked compressed rows ([queries x picks x D]) a prefill chunk's sparse attention
# gathers at once: beyond, its queries run a block at a time (a 4K-token chunk of DeepSeek-V4-Flash,
# 512 picks of 512, gathers 1G elements; blocks of 512 queries hold 128M). Small models run whole.
PICKED_ELEMENTS = 1 << 27


def _attend_picked(q, k_tiles, v_tiles, valid, entries, picks, *, scale, sinks, softcap) -> jax.Array:
    """`_attend_tiles` of a sparse (CSA) layer's chunk with each query's picked entries
    (`_compressed_source`), its queries a block at a time when their gathered rows exceed
    `PICKED_ELEMENTS` (`_in_query_blocks`; the last block padded with queries that see nothing). A
    query's output depends on its own scores only, so the bits are those of one call.

    q [B, C, H, D]; k/v tiles [B, T, KT, Hkv, D]; valid [B, C, T, KT]; entries [B, N, D]; picks
    int32[B, C, k] -> [B, C, H, D]."""
    b, c = q.shape[:2]
    block = max(1, PICKED_ELEMENTS // max(1, b * picks.shape[-1] * entries.shape[-1]))

    def one(qb, vb, pb):
        extra = _compressed_source(entries, None, pb)
        return _attend_tiles(qb, k_tiles, v_tiles, vb, extra, scale=scale, sinks=sinks, softcap=softcap)

    if block >= c:
        return one(q, valid, picks)
    return _in_query_blocks(one, block, (q, valid, picks), (0, False, -1))


# Queries per chunk from which a sliding layer's banded attention also compiles the band one tile
# narrower (`_attend_banded`): both branches of its `lax.cond` compile, and a small chunk saves little.
NARROW_BAND_QUERIES = 512


def _attend_banded(q, k_tiles, v_tiles, valid, window: int, first=None, *, scale, sinks, softcap) -> jax.Array:
    """`_attend_tiles` of a sliding-window layer's chunk, its queries in blocks of KEY_TILE: block j
    (queries j * KT .. j * KT + KT - 1) attends only tiles j .. j + W - 1 of the run (W = the tiles one
    block's windows span), the only tiles holding keys its queries see; the others hold invisible keys
    only, which `attend` ignores bit for bit. A 512-query chunk at window 128 then scores 4 tiles per
    query instead of 11. The run's tiles start at the tile boundary below `start - (window - 1)`, so
    block j's first visible key is in tile j whatever the alignment (`tiles_from_rows`). With `first`
    (int32[B], each row's `start - (window - 1)`) and at least `NARROW_BAND_QUERIES` queries, a chunk
    whose rows all start where a block's windows span one tile fewer (a chunk starting on a tile
    boundary: 3 tiles at window 128) attends W - 1 tiles (`lax.cond`; the same bits, the dropped tile
    being invisible).

    q [B, C, H, D]; k/v tiles [B, T, KT, Hkv, D] with T = tile_count(window - 1 + C); valid [B, C, T, KT].
    Falls back to `_attend_tiles` when C is not a multiple of KT or the band covers every tile."""
    c = q.shape[1]
    kt = nm.KEY_TILE
    band = -(-(kt + window - 1) // kt) + 1
    kw = {"scale": scale, "sinks": sinks, "softcap": softcap}
    if c % kt or band >= k_tiles.shape[1]:
        return _attend_tiles(q, k_tiles, v_tiles, valid, None, **kw)
    if first is None or c < NARROW_BAND_QUERIES:
        return _attend_band(q, k_tiles, v_tiles, valid, band, **kw)
    return jax.lax.cond(
        _band_fits(first, window, band - 1),
        lambda: _attend_band(q, k_tiles, v_tiles, valid, band - 1, **kw),
        lambda: _attend_band(q, k_tiles, v_tiles, valid, band, **kw),
    )


def _band_fits(first: jax.Array, window: int, width: int) -> jax.Array:
    """Whether a band of `width` tiles holds every key a block of KEY_TILE queries sees, in every row:
    from block j's first visible key (tile j) to its last query's position. first int32[B]."""
    kt = nm.KEY_TILE
    span = (first + (window - 1) + (kt - 1)) // kt - first // kt + 1
    return jnp.all(span <= width)


def _attend_band(q, k_tiles, v_tiles, valid, band: int, *, scale, sinks, softcap) -> jax.Array:
    """`_attend_banded`'s blocks of KEY_TILE queries, block j over tiles j .. j + band - 1."""
    b, c, h, d = q.shape
    kt = nm.KEY_TILE
    t = k_tiles.shape[1]
    nb = c // kt
    idx = np.arange(nb)[:, None] + np.arange(band)[None, :]  # [nb, band] tile of each block's band
    assert idx[-1, -1] < t, (c, band, t)  # tile_count(window - 1 + C) = nb - 1 + band

    def per_block(x):  # [B, T, ...] -> [B * nb, band, ...]
        return x[:, idx].reshape((b * nb, band) + x.shape[2:])

    v_band = None if v_tiles is k_tiles else per_block(v_tiles)
    k_band = per_block(k_tiles)
    vis = valid.reshape(b, nb, kt, t, kt)[:, np.arange(nb)[:, None], :, idx]  # [nb, band, B, KT(q), KT]
    vis = jnp.moveaxis(vis, (2, 3), (0, 2)).reshape(b * nb, kt, band, kt)
    out = _attend_tiles(q.reshape(b * nb, kt, h, d), k_band, k_band if v_band is None else v_band, vis, None,
                        scale=scale, sinks=sinks, softcap=softcap)  # fmt: skip
    return out.reshape(b, c, h, d)


def _attend_tiles(q, k_tiles, v_tiles, valid, extra, *, scale, sinks, softcap) -> jax.Array:
    """q [B, C, H, D] over row tiles k/v [B, T, KT, Hkv, D] (valid [B, C, T, KT]) and an optional
    compressed source, in the contract's order -> [B, C, H, D]."""
    b, c, h, d = q.shape
    hkv = k_tiles.shape[3]
    sources = [nm.KeyTiles(k_tiles[:, None], v_tiles[:, None], valid)]
    if extra is not None:
        sources.append(extra)
    out = nm.attend(q.reshape(b, c, hkv, h // hkv, d), sources, scale=scale, sinks=sinks, softcap=softcap)
    return out.reshape(b, c, h, d)


def sequence_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    window: int | None,
    scale: float,
    sinks: jax.Array | None = None,
    softcap: float | None = None,
    entries: jax.Array | None = None,
    entry_limit: jax.Array | None = None,
    picks: jax.Array | None = None,
) -> jax.Array:
    """Stateless attention over a whole sequence (positions 0..T-1) in the numerical contract's order:
    what a model's stateless forward calls, so that its logits equal the cached paths' bit for bit.

    q: [B, T, H, D]; k, v: [B, T, Hkv, D] (H % Hkv == 0); window: attended tokens including the
    current one (None: full causal attention); scale: logit scale; sinks: float32[H] or None; softcap:
    logit soft-capping or None. Compressed entries (K=V, one KV head): entries [B, N, D] with
    entry_limit int32[B, T] (the entries each query sees: all of them, HCA) or picks int32[B, T, k]
    (each query's indexer picks, -1 = none: CSA). Returns [B, T, H, D] in q.dtype.
    """
    t = q.shape[1]
    pos = jnp.arange(t, dtype=jnp.int32)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask = mask & (pos[None, :] > pos[:, None] - window)
    extra = None
    if entries is not None:
        extra = _compressed_source(entries, entry_limit, picks)
    return masked_attention(q, k, v, mask, scale=scale, sinks=sinks, softcap=softcap, extra=extra)


def masked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    scale: float,
    sinks: jax.Array | None = None,
    softcap: float | None = None,
    extra: nm.KeyTiles | None = None,
) -> jax.Array:
    """Attention of q over keys k/v taken as absolute positions 0..S-1, with a visibility mask, in the
    numerical contract's order (key tiles of `KEY_TILE` positions, `pallas_kernels.numerics.attend`).

    q: [B, T, H, D]; k, v: [B, S, Hkv, D]; mask: bool broadcastable to [B, T, S] (True = visible);
    scale, sinks (float32[H] or None), softcap (None: off); extra: further key tiles after these (a
    layer's compressed entries). Returns [B, T, H, D] in q.dtype; a query that sees nothing gets zeros.
    """
    b, t = q.shape[:2]
    s = k.shape[1]
    k_tiles, v_tiles = nm.pad_tiles(k, 1), nm.pad_tiles(v, 1)  # [B, S', KT, Hkv, D]
    valid = nm.pad_tiles(jnp.broadcast_to(mask, (b, t, s)), 2)  # [B, T, S', KT]; padded keys invisible
    return _attend_tiles(q, k_tiles, v_tiles, valid, extra, scale=scale, sinks=sinks, softcap=softcap)


# ---------------------------------------------------------------------------------- the view
class LayerCache:
    """A view of one layer's cache objects for the slots of one step, and the ops on them.

    Static facts (from the layer's `LayerSpec`): `window` (None: full attention), `num_kv_heads`,
    `head_dim`, `shared_kv`, `ratio` (compression ratio, None without a compressor), `has_indexer`.
    Every op takes the cache and returns the new cache (writes) or an array (reads); masked rows
    of the step (idle or failed) write nothing.
    """

    def __init__(self, step: Step, layer: int):
        spec = step.layout.spec
        if not 0 <= layer < len(spec.layers):
            raise ValueError(f"layer={layer} must be in [0, {len(spec.layers)})")
        self.step, self.layer = step, layer
        # kind -> traced int32 index of the layer in its group's stacked pool (inside `scan_layers`;
        # `layer` is then the run's first layer, whose static facts every layer of the run shares)
        self._index: dict[ObjectKind, jax.Array] = {}
        self.spec = ls = spec.layers[layer]
        self.window = ls.window
        self.num_kv_heads = ls.num_kv_heads
        self.head_dim = ls.head_dim
        self.shared_kv = ls.shared_kv
        self.ratio = None if ls.compressor is None else ls.compressor.ratio
        self.has_indexer = ls.indexer is not None
        self._layout = step.layout

    # ------------------------------------------------------------------ helpers
    def _group(self, kind: ObjectKind) -> tuple[int, int | jax.Array]:
        """(group index, this layer's index within the group's stacked pool: an int, or a traced
        int32 scalar inside `scan_layers`)."""
        gi = self._layout.spec.group_of(kind, self.layer)
        if kind in self._index:
            return gi, self._index[kind]
        return gi, self._layout.groups[gi].layers.index(self.layer)

    def _dim(self, kind: ObjectKind) -> int:
        """Values in one row of this layer's `kind` object."""
        if kind == ObjectKind.SWA:
            return self.spec.kv_dim
        return (self.spec.compressor if kind == ObjectKind.COMPRESSED else self.spec.indexer).entry_dim

    def _read(self, cache: HybridCache, kind: ObjectKind, rows: jax.Array, valid: jax.Array) -> jax.Array:
        """`transitions.read_rows` of this layer's `kind` rows[B, R] -> [B, R, D] in the spec's dtype
        (dequantized with `kv_quant`; traced index too)."""
        if kind not in self._index:
            vals = tr.read_rows(self._layout, cache, kind, self.layer, self.step.slots, rows, valid)
        else:
            gi, li = self._group(kind)
            g = cache.groups[gi]
            vals = tr.rows_at(self._layout, g, li, *tr.locate_rows(self._layout, g, self.step.slots, rows, valid))
        return kvq.load(self._layout.spec, vals, self._dim(kind))

    def _pages(self, cache: HybridCache, kind: ObjectKind) -> tuple[jax.Array, jax.Array, int | jax.Array]:
        """(pool, this step's page table int32[B, M], layer index) of this layer's `kind` object as the
        decode kernels read it: the stacked pool itself (a uint16 pool viewed as its bfloat16 rows:
        `kv_quant.from_pool`), or with `kv_quant` the step's pages
        dequantized (`kv_quant.dequantized_pages`, those below the rows held; layer index None)."""
        gi, li = self._group(kind)
        g = cache.groups[gi]
        pt = self._step_table(g, gi)
        spec = self._layout.spec
        if spec.kv_quant is None:
            return kvq.from_pool(g.pool, spec.row_dtype()), pt, li  # a view of uint16 bit patterns
        lengths = self.step.kernel_lengths
        window = self.window if kind == ObjectKind.SWA else None  # a sliding layer: its window's pages
        held = lengths if kind == ObjectKind.SWA else im.div(lengths, self.ratio)  # rows, or entries / keys
        pool, pt = kvq.dequantized_pages(spec, g.pool, li, pt, self._dim(kind), held, window)
        return pool, pt, None

    def _step_table(self, g, gi: int) -> jax.Array:
        """This step's page table of group `gi` (state `g`), int32[B, M]: the rows' slots' entries, cut
        to the pages that `Step.context_bound` tokens' rows span where the group keeps every row (full
        attention, COMPRESSED, INDEXER) and the step has `read_tokens`. The decode kernels read what
        the table addresses (a full-attention layer `page_table.shape[1] * page_size` positions), so a
        decode step's reads follow its read bound instead of `max_context`; `run_step` refuses a row
        that would hold more. The pages cut hold no row a query may see: the same bits."""
        pt = im.take(g.page_table, self.step.slots)
        grp = self._layout.groups[gi]
        if grp.keep is not None or self.step.read_tokens is None:
            return pt
        rows = -(-self.step.context_bound // grp.unit)
        return pt[:, : max(1, -(-rows // self._layout.page_size))]

    def _write(self, cache: HybridCache, kind: ObjectKind, rows: jax.Array, values: jax.Array, valid: jax.Array):
        """Write values[B, R, D] at this layer's `kind` rows[B, R] where valid, at a traced pool index
        (the `transitions` write paths take a static layer)."""
        gi, li = self._group(kind)
        g = cache.groups[gi]
        page, off, ok = tr.locate_rows(self._layout, g, self.step.slots, rows, valid)
        pool = tr.put_rows(g.pool, li, page, off, values, ok)
        groups = list(cache.groups)
        groups[gi] = g.replace(pool=pool)
        return cache.replace(groups=tuple(groups))

    def _rows(self, k: jax.Array, v: jax.Array | None) -> jax.Array:
        """K [B, C, Hkv, D] (+ V) -> SWA rows [B, C, kv_dim] in the spec's row layout."""
        want = (self.num_kv_heads, self.head_dim)
        if k.ndim != 4 or tuple(k.shape[2:]) != want:
            raise ValueError(f"k.shape={tuple(k.shape)} must be [B, C, {want[0]}, {want[1]}] for layer {self.layer}")
        b, c = k.shape[:2]
        if self.shared_kv:
            if v is not None and v is not k:
                raise ValueError(f"layer {self.layer} stores shared K=V rows: pass v=None (or v=k)")
            return k.reshape(b, c, -1)
        if v is None or v.shape != k.shape:
            raise ValueError(f"v.shape={None if v is None else tuple(v.shape)} must equal k.shape={tuple(k.shape)}")
        return jnp.concatenate([k.reshape(b, c, -1), v.reshape(b, c, -1).astype(k.dtype)], axis=-1)

    def _entries(self, cache: HybridCache, kind: ObjectKind) -> tuple[jax.Array, jax.Array]:
        """Prefill read of every sealed COMPRESSED / INDEXER row of this layer: (rows [B, N, D] with
        N = step.context_bound // ratio, unsealed rows zero; limit int32[B, C], entries each query may
        see)."""
        st, m = self.step, self.ratio
        n_max = st.context_bound // m
        n_now = im.div(st.new_len, m)
        w = jnp.arange(n_max)[None, :]
        rows, ok = jnp.broadcast_to(w, (st.slots.shape[0], n_max)), w < n_now[:, None]
        entries = self._read(cache, kind, rows, ok)
        return entries, jnp.minimum(causal_entry_limit(st.positions, m), n_now[:, None])

    # ------------------------------------------------------------------- writes
    def write_kv(self, cache: HybridCache, k: jax.Array, v: jax.Array | None = None) -> HybridCache:
        """Write this step's K/V rows (SWA object) at the step's positions.

        k, v: [B, C, Hkv, D] (v=None for shared K=V rows). Rows that are already outside the window
        kept after the step, invalid columns and masked rows are not written.
        """
        st = self.step
        rows = self._rows(k, v)
        pool_dtype = self._layout.spec.storage_dtype
        if rows.dtype != pool_dtype:
            raise ValueError(
                f"layer {self.layer}: its K/V rows are {rows.dtype} but the cache stores {pool_dtype} "
                f"(CacheSpec.dtype): build the spec with dtype={rows.dtype.name!r} (the model's activation dtype) "
                "or cast k/v before write_kv; the decode kernels need one dtype for queries and cache"
            )
        valid = st.valid & st.mask[:, None]
        rows = kvq.store(self._layout.spec, rows)
        if ObjectKind.SWA not in self._index:
            return tr.write_swa(self._layout, cache, self.layer, st.slots, st.positions, rows, valid, st.hold)
        keep = self._layout.groups[self._group(ObjectKind.SWA)[0]].keep  # as `transitions.write_swa`
        if keep is not None:
            valid = valid & (st.positions >= tr.window_start(st.positions, valid, keep, st.hold))
        return self._write(cache, ObjectKind.SWA, st.positions, rows, valid)

    def compress(
        self,
        cache: HybridCache,
        kv: jax.Array,
        gate: jax.Array,
        compress_fn: Callable[..., jax.Array],
        *,
        which: str = "compressor",
        gate_bias: jax.Array | None = None,
    ) -> HybridCache:
        """Feed this step's projected rows to the layer's compressor (or indexer compressor).

        hkv assembles, per row, the open window's TAIL rows followed by this step's rows into whole
        windows, calls the model's math on them, seals every window the step closes (COMPRESSED
        entries, or INDEXER keys for `which="indexer"`; only when `step.seal`) and keeps the rows of the
        still-open window as the new TAIL.

        Args:
          kv, gate: [B, C, proj_width] this step's projections (the compressor's `proj_width`).
          compress_fn: `(kv [B, Lb, W], gate [B, Lb, W], first_token int32[B], prior_kv, prior_gate)
            -> entries [B, Lb // ratio, entry_dim]`: window w of the buffer covers tokens
            first_token + w * ratio ...; prior_* are the overlap state (below) or None. It runs
            (under a `lax.cond`) only on steps where some row closes a window and `step.seal`.
          which: "compressor" or "indexer".
          gate_bias: [ratio, proj_width], added to the gate rows kept as the overlap state (an
            overlapping compressor keeps the first `entry_dim` columns of its last closed window's
            kv and biased gate as `prior_kv` / `prior_gate` for the next window).
        """
        if which not in ("compressor", "indexer"):
            raise ValueError(f"which={which!r} must be 'compressor' or 'indexer'")
        comp = self.spec.compressor if which == "compressor" else self.spec.indexer
        if comp is None:
            raise ValueError(f"layer {self.layer} has no {which}")
        st, layout = self.step, self._layout
        m, d, width = comp.ratio, comp.entry_dim, comp.proj_width
        if kv.shape[-1] != width or gate.shape != kv.shape:
            raise ValueError(f"kv{list(kv.shape)} and gate{list(gate.shape)} must be [B, C, {width}]")
        tail_index = [(l, n) for l, n, _ in layout.spec.compressors()].index((self.layer, which))
        t = cache.tails[tail_index]
        b, c = kv.shape[:2]
        # positions and counts are >= 0: `index_math` (one op each, no sign corrections)
        tail_len = im.rem(st.start, m)
        lb = -(-(m - 1 + c) // m) * m  # static buffer length: open-window rows + chunk, whole windows
        j = jnp.arange(lb)[None, :]
        ci = j - tail_len[:, None]
        from_tail = j < tail_len[:, None]
        from_chunk = (ci >= 0) & (ci < st.n_valid[:, None])

        def assemble(tail_rows, chunk_rows):
            # open-window rows j < tail_len < m first (padded: rows past m are never selected), then the chunk
            tr_ = jnp.pad(im.take(tail_rows, st.slots).astype(chunk_rows.dtype), ((0, 0), (0, lb - m), (0, 0)))
            cr = im.take_rows(chunk_rows, jnp.clip(ci, 0, c - 1))
            return jnp.where(from_tail[..., None], tr_, jnp.where(from_chunk[..., None], cr, 0))

        buf_kv, buf_gate = assemble(t.tail_kv, kv), assemble(t.tail_gate, gate)
        total = tail_len + st.n_valid
        count = im.div(total, m)
        first_entry = im.div(st.start, m)
        prior_kv = prior_gate = None
        if comp.overlap:
            prior_kv, prior_gate = im.take(t.overlap_kv, st.slots), im.take(t.overlap_gate, st.slots)
        # new TAIL: rows of the still-open window, moved to the front; everything after them empty
        new = _open_window(comp, buf_kv, buf_gate, total[:, None], prior_kv, prior_gate, gate_bias)
        new_kv, new_gate, ov_kv, ov_gate = (a[:, 0] for a in new)
        if st.snapshot_at is not None:  # the TAIL at each interior snapshot's boundary, as a step ending there
            at = jnp.clip(tail_len[:, None] + st.snapshot_at - st.start[:, None], 0, buf_kv.shape[1])
            cache = self._stage_tails(
                cache, tail_index, _open_window(comp, buf_kv, buf_gate, at, prior_kv, prior_gate, gate_bias)
            )
        cache = tr.append_tail(layout, cache, tail_index, st.slots, new_kv, new_gate, ov_kv, ov_gate, st.mask)
        if st.seal:
            count = jnp.where(st.mask, count, 0)
            kind = ObjectKind.COMPRESSED if which == "compressor" else ObjectKind.INDEXER
            # The model's pooling runs only on steps that close a window: a decode step closes one on
            # 1 step in `ratio` per row (skipping it was ~10% of a tiny-model decode step on CPU).
            # Entries of rows that close none are never written, so zeros stand in for them; both
            # branches give what the pool stores (packed rows with `kv_quant`).
            sp = layout.spec
            entries = jax.lax.cond(
                jnp.any(count > 0),
                lambda: kvq.store(sp, compress_fn(buf_kv, buf_gate, first_entry * m, prior_kv, prior_gate)),
                lambda: jnp.zeros((b, lb // m, sp.row_width(d)), sp.row_dtype()),
            )
            if kind not in self._index:
                write = tr.seal_compressed if which == "compressor" else tr.write_indexer
                return write(layout, cache, self.layer, st.slots, first_entry, entries, count)
            w = jnp.arange(entries.shape[1])[None, :]  # as `transitions.seal_compressed` / `write_indexer`
            cache = self._write(cache, kind, first_entry[:, None] + w, entries, w < count[:, None])
            if kind == ObjectKind.COMPRESSED:
                cache = cache.replace(counters=tr._count(cache, "entries_sealed", jnp.sum(count)))
        return cache

    def _stage_tails(self, cache, tail_index: int, staged: tuple) -> HybridCache:
        """Write `staged` (`_open_window` at each `Step.snapshot_at` boundary: [B, K, ...] per TAIL field)
        into this compressor's staging rows, row `slots + b * K + k` (`run_step` moves them into
        snapshot slots)."""
        s = self._layout.slots
        t = cache.tails[tail_index]

        def put(dst, v):
            if not v.shape[2]:  # (no overlap: an empty field)
                return dst
            return jax.lax.dynamic_update_slice_in_dim(dst, v.reshape(-1, *v.shape[2:]).astype(dst.dtype), s, axis=0)

        tails = list(cache.tails)
        tails[tail_index] = t.replace(**{f: put(getattr(t, f), v) for f, v in zip(_TAIL_FIELDS, staged, strict=True)})
        return cache.replace(tails=tuple(tails))

    # -------------------------------------------------------------------- reads
    def index_topk(self, cache: HybridCache, q: jax.Array, weights: jax.Array, k: int) -> jax.Array:
        """The learned indexer's top-k compressed entries for each query of the step.

        q: [B, C, Hi, Di] indexer queries; weights: float32[B, C, Hi] per-head weights; k: picks.
        Returns int32[B, C, k] entry indices, best first, -1 for none (only causal entries: a query at
        position t sees entries [0, (t + 1) // ratio)). Decode: `pallas_kernels.indexer_topk`.
        """
        if not self.has_indexer:
            raise ValueError(f"layer {self.layer} has no indexer")
        st = self.step
        m = self.ratio
        if st.decode:
            lengths = st.kernel_lengths
            pool, pt, li = self._pages(cache, ObjectKind.INDEXER)
            picks = pk.indexer_topk(q[:, 0], weights[:, 0], pool, pt, lengths, im.div(lengths, m), k=k,
                                    compress_ratio=m, index_layer=li, backend=st.backend,
                                    interpret=st.interpret)  # fmt: skip
            return picks[:, None]
        keys, limit = self._entries(cache, ObjectKind.INDEXER)
        return indexer_topk(q, weights, keys, limit, k)

    def attend(
        self,
        cache: HybridCache,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array | None = None,
        *,
        sinks: jax.Array | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        compressed: bool = False,
        picks: jax.Array | None = None,
    ) -> jax.Array:
        """Attention of this step's queries over the layer's cached rows plus this step's rows.

        Windowed layers see positions (t - window, t]; full-attention layers [0, t]. With
        `compressed=True` the same softmax also covers the layer's COMPRESSED entries a query may see
        (all causal ones, or only `picks` from `index_topk`: a sparse layer).

        Args:
          q: [B, C, H, D] queries (H % num_kv_heads == 0).
          k, v: [B, C, Hkv, D] this step's keys and values (v=None for shared K=V), as written.
          sinks: float32[H] per-head sink logits or None. scale: logit scale (None: D ** -0.5).
          softcap: logit soft-capping (None: off; not with compressed attention).
          compressed: include compressed entries (needs a compressor; shared K=V with one KV head, the
            DeepSeek-V4 layout the compressed kernels read).
          picks: int32[B, C, topk] from `index_topk`, or None.
        Returns:
          [B, C, H, D] in q.dtype. Decode (C == 1) reads the pools in place through `pallas_kernels`.
        """
        st = self.step
        _, c, h, d = q.shape
        if d != self.head_dim or h % self.num_kv_heads:
            raise ValueError(
                f"q.shape={tuple(q.shape)}: head_dim must be {self.head_dim} and heads a multiple of "
                f"num_kv_heads={self.num_kv_heads} (layer {self.layer})"
            )
        scale = d**-0.5 if scale is None else float(scale)
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap={softcap} must be None or > 0")
        if compressed and (self.ratio is None or not self.shared_kv or self.num_kv_heads != 1):
            raise ValueError(
                f"compressed attention needs a compressor and shared K=V rows of one head (layer {self.layer})"
            )
        if compressed and softcap is not None:
            raise ValueError("softcap is not supported with compressed attention")
        if picks is not None and not (compressed and self.has_indexer):
            raise ValueError(f"picks need compressed=True on a layer with an indexer (layer {self.layer})")
        if st.decode:
            return self._decode(cache, q[:, 0], sinks, scale, softcap, compressed, picks)[:, None]
        rows = kvq.round_rows(self._layout.spec.kv_quant, self._rows(k, v))  # the values the cache keeps
        keep = (self.window - 1) if self.window is not None else st.context_bound
        past_pos = st.start[:, None] - keep + jnp.arange(keep)[None, :]
        past = self._read(cache, ObjectKind.SWA, past_pos, past_pos >= 0)
        run = jnp.concatenate([past.astype(rows.dtype), rows], axis=1)  # positions start - keep, ...
        first = st.start - keep
        tiles = nm.tiles_from_rows(run, first, keep + c)  # [B, T, KT, kv_dim] at absolute positions
        pos = nm.tile_positions(first, tiles.shape[1])[:, None]  # [B, 1, T, KT]
        t = st.positions[:, :, None, None]
        valid = (pos >= 0) & (pos < st.new_len[:, None, None, None]) & (pos <= t)
        if self.window is not None:
            valid = valid & (pos > t - self.window)
        k_tiles, v_tiles = self._split_tiles(tiles)
        extra = None
        if compressed:
            entries, limit = self._entries(cache, ObjectKind.COMPRESSED)
            if picks is not None:
                return _attend_picked(q, k_tiles, v_tiles, valid, entries.astype(rows.dtype), picks,
                                      scale=scale, sinks=sinks, softcap=softcap)  # fmt: skip
            extra = _compressed_source(entries.astype(rows.dtype), limit, None)
        if extra is None and self.window is not None:
            return _attend_banded(
                q, k_tiles, v_tiles, valid, self.window, first, scale=scale, sinks=sinks, softcap=softcap
            )
        return _attend_tiles(q, k_tiles, v_tiles, valid, extra, scale=scale, sinks=sinks, softcap=softcap)

    def _split_tiles(self, tiles: jax.Array) -> tuple[jax.Array, jax.Array]:
        """SWA rows in tiles [B, T, KT, kv_dim] -> (K, V) [B, T, KT, Hkv, D]."""
        b, t, kt = tiles.shape[:3]
        shape = (b, t, kt, self.num_kv_heads, self.head_dim)
        if self.shared_kv:
            k = tiles.reshape(shape)
            return k, k
        k, v = jnp.split(tiles, 2, axis=-1)
        return k.reshape(shape), v.reshape(shape)

    def _decode(self, cache, q, sinks, scale, softcap, compressed, picks):
        """Decode attention through `pallas_kernels` on the stacked pools. q [B, H, D] -> [B, H, D]."""
        st = self.step
        kernels = dict(backend=st.backend, interpret=st.interpret)
        lengths = st.kernel_lengths
        swa_pool, pt, sl = self._pages(cache, ObjectKind.SWA)
        if not compressed:
            if self.shared_kv and self.num_kv_heads == 1 and self.window is not None and softcap is None:
                return pk.swa_decode_attention(q, swa_pool, pt, lengths, sinks, window=self.window, window_layer=sl,
                                               scale=scale, **kernels)  # fmt: skip
            return pk.gqa_decode_attention(q, swa_pool, pt, lengths, sinks, num_kv_heads=self.num_kv_heads,
                                           window=self.window, layer=sl, scale=scale, softcap=softcap,
                                           shared_kv=self.shared_kv, **kernels)  # fmt: skip
        n_comp = im.div(lengths, self.ratio)
        if picks is not None and self._layout.spec.kv_quant is not None:  # only the picked entries, dequantized
            cg, cl = self._group(ObjectKind.COMPRESSED)
            g, dim = cache.groups[cg], self._dim(ObjectKind.COMPRESSED)
            pt_c = self._step_table(g, cg)
            comp_pool, comp_pt, sel = kvq.dequantized_picks(
                self._layout.spec, g.pool, cl, pt_c, picks[:, 0], n_comp, self.ratio, lengths, dim
            )
            picks, cl = sel[:, None], None
        else:
            comp_pool, comp_pt, cl = self._pages(cache, ObjectKind.COMPRESSED)
        args = (q, swa_pool, pt, lengths, sinks, comp_pool, comp_pt, n_comp)
        common = dict(window=self.window, window_layer=sl, compress_ratio=self.ratio, compressed_layer=cl,
                      scale=scale, **kernels)  # fmt: skip
        if picks is None:
            return pk.hca_decode_attention(*args, **common)
        return pk.csa_decode_attention(*args, picks[:, 0], **common)


# ------------------------------------------------------------------------ scans over layers
@dataclasses.dataclass(frozen=True)
class LayerRun:
    """Layers `start + r * period + j` for r < count, j < period: a pattern of `period` layers repeated
    `count` times (count 1: the layers run once, unrolled in Python)."""

    start: int
    period: int
    count: int

    @property
    def stop(self) -> int:
        """One past the run's last layer."""
        return self.start + self.period * self.count

    def layers(self, j: int) -> tuple[int, ...]:
        """The layers at position j of the period, one per repetition."""
        return tuple(self.start + r * self.period + j for r in range(self.count))


def plan_layer_runs(keys: Sequence[Hashable], *, min_count: int = 2) -> tuple[LayerRun, ...]:
    """Split layers into runs of a repeating period, so that a model traces as few layer bodies as it can.

    keys[i] is layer i's structure (equal keys: the same code on same-shaped weights and the same
    cache objects). A run of period p repeated c >= min_count times costs p traced layers (one scan
    body); any other layer costs one. The split minimises the total (dynamic programming; ties go to
    fewer runs), e.g. keys `a a a b c b c b c` -> [0, 1, 3) scanned, then (b c) x 3 scanned.

    Returns runs covering 0..len(keys)-1 in order; layers nothing repeats around get count-1 runs
    of period 1.
    """
    n = len(keys)
    best: list[tuple[int, int, LayerRun | None]] = [(0, 0, None)] * (n + 1)  # (traced, runs, first run)
    for i in range(n - 1, -1, -1):
        cand = (best[i + 1][0] + 1, best[i + 1][1] + 1, LayerRun(i, 1, 1))
        for p in range(1, (n - i) // 2 + 1):
            c = 1
            while i + (c + 1) * p <= n and tuple(keys[i + c * p : i + (c + 1) * p]) == tuple(keys[i : i + p]):
                c += 1
            for cc in range(max(min_count, 2), c + 1):
                nxt = best[i + cc * p]
                cand = min(cand, (nxt[0] + p, nxt[1] + 1, LayerRun(i, p, cc)), key=lambda t: t[:2])
        best[i] = cand
    runs, i = [], 0
    while i < n:
        runs.append(best[i][2])
        i = runs[-1].stop
    return tuple(runs)


def scan_layers(
    step: Step,
    cache: HybridCache,
    run: LayerRun,
    body: Callable[[HybridCache, Any, tuple[LayerCache, ...], Any], tuple[HybridCache, Any]],
    carry: Any,
    xs: Any,
) -> tuple[HybridCache, Any]:
    """Run the layers of `run` as one `jax.lax.scan` over its repetitions (the traced program holds one
    period of layers however many times it repeats).

    Every repetition must have the same cache objects at each position of the period (equal
    `LayerSpec`s, so they live in the same groups); each layer's objects are addressed by its traced
    index in its group's stacked pools, its TAIL rows are stacked for the scan and put back after.

    Args:
      step: this step (`run_step`'s forward argument).
      cache: the cache.
      run: the layers (`plan_layer_runs`).
      body: `body(cache, carry, views, x) -> (cache, carry)` for one repetition: views[j] is the
        `LayerCache` of the repetition's layer at period position j (static facts as for any layer;
        use only views[j] for position j), x the repetition's slice of `xs`.
      carry: the model's loop state (e.g. residual streams).
      xs: a pytree whose leaves have a leading axis of `run.count` (e.g. stacked layer weights).

    Returns:
      (cache, carry) after the last repetition.
    """
    layout = step.layout
    spec = layout.spec
    comps = [(l, w) for l, w, _ in spec.compressors()]
    index: list[dict[ObjectKind, jax.Array]] = []
    tails: list[dict[int, tuple[int, ...]]] = []  # per position: tail index of layer r=0 -> all r
    for j in range(run.period):
        layers = run.layers(j)
        first = spec.layers[layers[0]]
        for l in layers[1:]:
            if spec.layers[l] != first:
                raise ValueError(f"layers {layers[0]} and {l} have different cache objects: they cannot share a scan")
        idx = {}
        for kind in ObjectKind:
            try:
                gi = spec.group_of(kind, layers[0])
            except ValueError:
                continue
            members = layout.groups[gi].layers
            idx[kind] = jnp.asarray([members.index(l) for l in layers], jnp.int32)
        index.append(idx)
        tails.append({comps.index((layers[0], w)): tuple(comps.index((l, w)) for l in layers)
                      for w in ("compressor", "indexer") if (layers[0], w) in comps})  # fmt: skip
    stacked_tails = [
        {t0: jax.tree.map(lambda *a: jnp.stack(a), *[cache.tails[t] for t in ts]) for t0, ts in pos.items()}
        for pos in tails
    ]

    def one(state, x):
        cache, carry = state
        idx_r, tails_r, x_r = x
        cache = cache.replace(tails=tuple(_put(cache.tails, {t0: tails_r[j][t0] for j in range(run.period)
                                                              for t0 in tails_r[j]})))  # fmt: skip
        views = []
        for j in range(run.period):
            v = LayerCache(step, run.start + j)
            v._index = dict(idx_r[j])
            views.append(v)
        cache, carry = body(cache, carry, tuple(views), x_r)
        new_tails = [{t0: cache.tails[t0] for t0 in pos} for pos in tails_r]
        return (cache.replace(tails=no_tails), carry), new_tails

    # TAILs do not travel in the loop's carry: the body's come in through xs and leave through ys, the
    # rest stay outside the loop (fewer carried arrays: faster compiles)
    out = list(cache.tails)
    no_tails = (None,) * len(out)
    (cache, carry), ys = jax.lax.scan(one, (cache.replace(tails=no_tails), carry), (index, stacked_tails, xs))
    for j, pos in enumerate(tails):
        for t0, ts in pos.items():
            for r, t in enumerate(ts):
                out[t] = jax.tree.map(lambda a, r=r: a[r], ys[j][t0])
    return cache.replace(tails=tuple(out)), carry


def _put(items: tuple, replace: dict[int, Any]) -> list:
    """items with items[i] replaced by replace[i]."""
    return [replace.get(i, x) for i, x in enumerate(items)]


__all__ = [
    "InteriorSnapshots",
    "LayerCache",
    "LayerRun",
    "Step",
    "causal_entry_limit",
    "default_read_buckets",
    "gather_picks",
    "indexer_scores",
    "indexer_topk",
    "masked_attention",
    "plan_layer_runs",
    "read_size",
    "run_step",
    "scan_layers",
    "select_topk",
    "selection_bias",
    "sequence_attention",
]
