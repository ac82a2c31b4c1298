"""DeepSeek-V4's cached path: prefill chunks and decode steps that read and write only through hkv.

`cached_step(model, layout, cache, tokens, slots, n_valid)` runs `tokens[b, :n_valid[b]]` of each
row b as the next tokens of slot `slots[b]` (decode: C = 1 for a batch of slots; prefill: a chunk of
C tokens that may end mid-window and mid-compression-block). It is one pure transition:

    reserve pages (hkv.core.transitions.reserve)     -> fails as a whole: cache unchanged + status
    per layer: SWA rows      -> write_swa        (only rows that stay in the window)
               compressor    -> append_tail / seal_compressed   (windows closed by this step)
               indexer       -> append_tail / write_indexer
               attention over cached window rows + new rows + compressed entries
    advance lengths, slide SWA windows (pages that left every window are released)

The compressor math is `compressor.compress_windows`, the same function the stateless forward
uses, fed with the TAIL rows the cache kept; so cached logits equal the stateless forward's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from hkv.core import transitions as tr
from hkv.core.spec import ObjectKind
from hkv.core.layout import CacheLayout, Status
from hkv.core.state import HybridCache, check_layout

from .attention import Attention, attend_with_sinks, selection_bias, sliding_window_bias
from .compressor import Compressor, causal_entry_limit, compress_windows, indexer_scores, select_topk
from .hyper_connection import merge
from .model import DeepseekV4
from .norms import rms_norm


def _compress_step(
    layout: CacheLayout,
    cache: HybridCache,
    tail_index: int,
    comp: Compressor,
    slots,
    x,
    old_len,
    n_valid,
    mask,
    freqs: np.ndarray,
    eps: float,
):
    """Feed this step's rows to a compressor: close every window the step completes.

    Returns (cache with the new TAIL, entries [B, NW, D], count int32[B] of closed windows,
    first entry index int32[B])."""
    m, d = comp.ratio, comp.head_dim
    b, c = x.shape[:2]
    kv, gate = comp.project(x)  # [B, C, width]
    t = cache.tails[tail_index]
    tail_len = old_len % m
    lb = -(-(m - 1 + c) // m) * m  # static buffer length: open-window rows + chunk, whole windows
    j = jnp.arange(lb)[None, :]
    ci = j - tail_len[:, None]
    from_tail = j < tail_len[:, None]
    from_chunk = (ci >= 0) & (ci < n_valid[:, None])

    def assemble(tail_rows, chunk_rows):
        tr_ = jnp.take_along_axis(tail_rows[slots].astype(chunk_rows.dtype), jnp.clip(j, 0, m - 1)[..., None], 1)
        cr = jnp.take_along_axis(chunk_rows, jnp.clip(ci, 0, c - 1)[..., None], 1)
        return jnp.where(from_tail[..., None], tr_, jnp.where(from_chunk[..., None], cr, 0))

    buf_kv, buf_gate = assemble(t.tail_kv, kv), assemble(t.tail_gate, gate)
    total = tail_len + n_valid
    count = total // m
    first_entry = old_len // m
    prior_kv = prior_gate = None
    if comp.overlap:
        prior_kv, prior_gate = t.overlap_kv[slots], t.overlap_gate[slots]
    entries = compress_windows(
        buf_kv,
        buf_gate,
        comp.ape.value,
        comp.norm.value,
        first_entry * m,
        ratio=m,
        head_dim=d,
        overlap=comp.overlap,
        freqs=freqs,
        eps=eps,
        prior_kv=prior_kv,
        prior_gate=prior_gate,
    )
    # new TAIL: rows of the still-open window, moved to the front; everything after them empty
    i = jnp.arange(m)[None, :]
    src = jnp.clip(count[:, None] * m + i, 0, lb - 1)
    keep = i < (total - count * m)[:, None]
    new_tail_kv = jnp.where(keep[..., None], jnp.take_along_axis(buf_kv, src[..., None], 1), 0)
    new_tail_gate = jnp.where(keep[..., None], jnp.take_along_axis(buf_gate, src[..., None], 1), 0)
    ov_kv = ov_gate = None
    if comp.overlap:  # Ca slice (and its ape-biased gate) of the last window this step closed
        last = jnp.clip((count - 1)[:, None] * m + i, 0, lb - 1)
        ca_kv = jnp.take_along_axis(buf_kv, last[..., None], 1)[..., :d]
        ca_gate = (jnp.take_along_axis(buf_gate, last[..., None], 1) + comp.ape.value)[..., :d]
        closed = (count > 0)[:, None, None]
        ov_kv = jnp.where(closed, ca_kv, prior_kv.astype(ca_kv.dtype))
        ov_gate = jnp.where(closed, ca_gate.astype(jnp.float32), prior_gate)
    cache = tr.append_tail(
        layout,
        cache,
        tail_index,
        slots,
        new_tail_kv,
        new_tail_gate,
        ov_kv if ov_kv is not None else jnp.zeros((b, 0, d)),
        ov_gate if ov_gate is not None else jnp.zeros((b, 0, d)),
        mask,
    )
    return cache, entries, jnp.where(mask, count, 0), first_entry


def _attention(
    model: DeepseekV4,
    attn: Attention,
    layer: int,
    layout: CacheLayout,
    cache: HybridCache,
    slots,
    x,
    positions,
    valid,
    old_len,
    new_len,
    n_valid,
    mask,
    rope,
    kernel_options: dict,
    seal: bool = True,
):
    """One layer's cached attention; returns (cache with this layer's objects written, output [B, C, hidden])."""
    b, c = x.shape[:2]
    cos, sin = rope[attn.rope_family]
    q, q_residual = attn.queries(x, cos, sin)
    kv = attn.shared_kv(x, cos, sin)  # [B, C, D]
    decode = c == 1
    # ---- writes: every object of this layer, each through its own hkv write path
    keep = attn.window - 1
    past_pos = old_len[:, None] - keep + jnp.arange(keep)[None, :]  # window rows already cached
    past_ok = past_pos >= 0
    past = None if decode else tr.read_rows(layout, cache, ObjectKind.SWA, layer, slots, past_pos, past_ok)
    cache = tr.write_swa(layout, cache, layer, slots, positions, kv, valid & mask[:, None])
    iq = iw = None
    if attn.compressor is not None:
        tails = {(l, n): i for i, (l, n, _) in enumerate(layout.spec.compressors())}
        freqs, eps = model.freqs["compress"], attn.eps
        cache, entries, count, first = _compress_step(
            layout, cache, tails[(layer, "compressor")], attn.compressor, slots, x, old_len, n_valid, mask, freqs, eps
        )
        if seal:
            cache = tr.seal_compressed(layout, cache, layer, slots, first, entries, count)
        if attn.indexer is not None:
            ix = attn.indexer
            cache, ikeys_new, icount, ifirst = _compress_step(
                layout, cache, tails[(layer, "indexer")], ix.compressor, slots, x, old_len, n_valid, mask, freqs, eps
            )
            if seal:
                cache = tr.write_indexer(layout, cache, layer, slots, ifirst, ikeys_new, icount)
            ccos, csin = rope["compress"]
            iq, iw = ix.queries(q_residual, ccos, csin), ix.head_weights(x)
    # ---- reads
    if decode:  # pallas_kernels ops read the pools in place (Pallas kernels on GPU/TPU)
        o = _decode_attention(
            layout,
            cache,
            attn,
            layer,
            slots,
            q[:, 0],
            new_len * mask,
            None if iq is None else (iq[:, 0], iw[:, 0]),
            kernel_options,
        )[:, None]
        return cache, attn.project_output(o, cos, sin)
    # prefill: dense reference attention over window rows, this chunk's rows and compressed entries
    k_pos = jnp.concatenate([past_pos, positions], axis=1)
    k_ok = jnp.concatenate([past_ok, valid], axis=1)
    keys = [past.astype(kv.dtype), kv]
    biases = [sliding_window_bias(positions, k_pos, attn.window) + jnp.where(k_ok, 0.0, -jnp.inf)[:, None, :]]
    if attn.compressor is not None:
        n_max = layout.config.max_context // attn.ratio
        n_now = new_len // attn.ratio
        w = jnp.arange(n_max)[None, :]
        rows, rows_ok = jnp.broadcast_to(w, (b, n_max)), w < n_now[:, None]
        keys.append(tr.read_rows(layout, cache, ObjectKind.COMPRESSED, layer, slots, rows, rows_ok).astype(kv.dtype))
        limit = jnp.minimum(causal_entry_limit(positions, attn.ratio), n_now[:, None])  # [B, C]
        if attn.indexer is None:
            cbias = jnp.where(w[:, None, :] < limit[..., None], 0.0, -jnp.inf)
        else:
            ikeys = tr.read_rows(layout, cache, ObjectKind.INDEXER, layer, slots, rows, rows_ok)
            picks = select_topk(indexer_scores(iq, iw, ikeys, attn.indexer.head_dim), limit, attn.indexer.topk)
            cbias = selection_bias(picks, n_max)
        biases.append(cbias.astype(jnp.float32))
    o = attend_with_sinks(
        q, jnp.concatenate(keys, axis=1), jnp.concatenate(biases, axis=-1), attn.attn_sink.value, attn.head_dim**-0.5
    )
    return cache, attn.project_output(o, cos, sin)


def _decode_attention(
    layout: CacheLayout,
    cache: HybridCache,
    attn: Attention,
    layer: int,
    slots,
    q,
    lengths,
    index_query,
    kernel_options: dict,
):
    """Decode attention through `pallas_kernels` on the stacked pools. q [B, H, D]; lengths int32[B]
    include the new token (0 = idle row); index_query = (q_idx [B, Hi, Di], weights f32[B, Hi]) for
    CSA layers, whose indexer top-k is also a pallas_kernels op. Returns [B, H, D]."""
    spec = layout.spec
    sg = spec.group_of(ObjectKind.SWA, layer)
    swa = cache.groups[sg]
    common = dict(window=attn.window, window_layer=layout.groups[sg].layers.index(layer), **kernel_options)
    args = (q, swa.pool, swa.page_table[slots], lengths, attn.attn_sink.value)
    if attn.compressor is None:
        return pk.swa_decode_attention(*args, **common)
    cg = spec.group_of(ObjectKind.COMPRESSED, layer)
    comp = cache.groups[cg]
    cargs = (comp.pool, comp.page_table[slots], lengths // attn.ratio)
    common.update(compress_ratio=attn.ratio, compressed_layer=layout.groups[cg].layers.index(layer))
    if attn.indexer is None:
        return pk.hca_decode_attention(*args, *cargs, **common)
    ig = spec.group_of(ObjectKind.INDEXER, layer)
    idx = cache.groups[ig]
    picks = pk.indexer_topk(
        index_query[0],
        index_query[1],
        idx.pool,
        idx.page_table[slots],
        lengths,
        lengths // attn.ratio,
        k=attn.indexer.topk,
        compress_ratio=attn.ratio,
        index_layer=layout.groups[ig].layers.index(layer),
        **kernel_options,
    )
    return pk.csa_decode_attention(*args, *cargs, picks, **common)


def cached_step(
    model: DeepseekV4,
    layout: CacheLayout,
    cache: HybridCache,
    tokens: jax.Array,
    slots: jax.Array,
    n_valid: jax.Array,
    *,
    kernel_backend: str | None = None,
    interpret: bool = False,
    seal: bool = True,
) -> tuple[HybridCache, jax.Array, jax.Array]:
    """Run tokens[b, :n_valid[b]] as the next tokens of slot slots[b] (rows with n_valid 0 are idle).

    kernel_backend / interpret select the `pallas_kernels` implementation of the decode ops
    (None: Pallas on GPU/TPU, the jnp reference on CPU; see `pallas_kernels.dispatch`).
    seal=False rebuilds SWA rows and TAIL only, leaving compressed entries and indexer keys as they
    are (the prefix cache's window recompute, `hkv.core.prefix.restore(recompute=R)`).

    tokens int32[B, C], slots int32[B], n_valid int32[B] in [0, C].
    Returns (cache, float32[B, C, vocab] logits, status int32). On a status other than OK the cache
    is returned unchanged and the logits are zeros.
    """
    kernel_options = {"backend": kernel_backend, "interpret": interpret}
    check_layout(layout, cache)  # shapes/dtypes: a cache of another spec fails here, at trace time
    b, c = tokens.shape
    old_len = cache.lengths[slots]
    new_len = old_len + n_valid
    reserved, status = tr.reserve(layout, cache, slots, new_len, n_valid > 0)
    ok = status == Status.OK
    # A failed reserve turns every write of the step into a no-op (all write paths are masked), so
    # the cache comes back unchanged without a cond or a select over the pools: either would make
    # XLA copy every pool each step.
    mask = (n_valid > 0) & ok

    def run(cache):
        positions = old_len[:, None] + jnp.arange(c)[None, :]
        valid = jnp.arange(c)[None, :] < n_valid[:, None]
        safe_tokens = jnp.where(valid, tokens, 0)
        rope = model.rope_tables(positions)
        streams = model.embed_streams(safe_tokens)
        for i, layer in enumerate(model.layers):
            post, comb, collapsed = layer.hc_attn(streams)
            x = rms_norm(collapsed, layer.attn_norm.value, layer.eps)
            cache, out = _attention(
                model,
                layer.attn,
                i,
                layout,
                cache,
                slots,
                x,
                positions,
                valid,
                old_len,
                new_len,
                n_valid,
                mask,
                rope,
                kernel_options,
                seal,
            )
            streams = merge(post, comb, out, streams)
            streams = layer.ffn_block(streams, safe_tokens)
        cache = tr.advance(layout, cache, slots, new_len, mask)
        cache = tr.slide(layout, cache, slots, mask)
        return cache, model.logits(streams)

    out, logits = run(reserved)
    counters = jax.tree.map(lambda new, old: jnp.where(ok, new, old), out.counters, reserved.counters)
    return out.replace(counters=counters), jnp.where(ok, logits, 0.0), status
