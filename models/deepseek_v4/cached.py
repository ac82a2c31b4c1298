"""DeepSeek-V4's cached path: prefill chunks and decode steps that read and write only through hkv.

`cached_step(model, layout, cache, tokens, slots, n_valid)` runs `tokens[b, :n_valid[b]]` of each
row b as the next tokens of slot `slots[b]` (decode: C = 1 for a batch of slots; prefill: a chunk of
C tokens that may end mid-window and mid-compression-block). It is one pure transition:

    reserve pages (hkv.transitions.reserve)     -> fails as a whole: cache unchanged + status
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

from hkv import transitions as tr
from hkv.spec import ObjectKind
from hkv.state import CacheLayout, HybridCache, Status, check_layout

from .attention import Attention, attend_with_sinks, selection_bias, sliding_window_bias
from .compressor import Compressor, causal_entry_limit, compress_windows, indexer_scores, select_topk
from .hyper_connection import merge
from .model import DeepseekV4
from .norms import rms_norm


def _compress_step(layout: CacheLayout, cache: HybridCache, tail_index: int, comp: Compressor, slots, x, old_len,
                   n_valid, mask, freqs: np.ndarray, eps: float):
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
    entries = compress_windows(buf_kv, buf_gate, comp.ape.value, comp.norm.value, first_entry * m, ratio=m,
                               head_dim=d, overlap=comp.overlap, freqs=freqs, eps=eps,
                               prior_kv=prior_kv, prior_gate=prior_gate)
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
    cache = tr.append_tail(layout, cache, tail_index, slots, new_tail_kv, new_tail_gate,
                           ov_kv if ov_kv is not None else jnp.zeros((b, 0, d)),
                           ov_gate if ov_gate is not None else jnp.zeros((b, 0, d)), mask)
    return cache, entries, jnp.where(mask, count, 0), first_entry


def _attention(model: DeepseekV4, attn: Attention, layer: int, layout: CacheLayout, cache: HybridCache, slots,
               x, positions, valid, old_len, new_len, n_valid, mask, rope):
    """One layer's cached attention; returns (cache with this layer's objects written, output [B, C, hidden])."""
    b, c = x.shape[:2]
    cos, sin = rope[attn.rope_family]
    q, q_residual = attn.queries(x, cos, sin)
    kv = attn.shared_kv(x, cos, sin)  # [B, C, D]
    keep = attn.window - 1
    # SWA: the window rows already cached (positions old_len-keep .. old_len-1), then this step's rows
    past_pos = old_len[:, None] - keep + jnp.arange(keep)[None, :]
    past_ok = past_pos >= 0
    past = tr.read_rows(layout, cache, ObjectKind.SWA, layer, slots, past_pos, past_ok).astype(kv.dtype)
    cache = tr.write_swa(layout, cache, layer, slots, positions, kv, valid & mask[:, None])
    keys = [past, kv]
    k_pos = jnp.concatenate([past_pos, positions], axis=1)
    k_ok = jnp.concatenate([past_ok, valid], axis=1)
    bias = sliding_window_bias(positions, k_pos, attn.window) + jnp.where(k_ok, 0.0, -jnp.inf)[:, None, :]
    biases = [bias]
    if attn.compressor is not None:
        tails = {(l, n): i for i, (l, n, _) in enumerate(layout.spec.compressors())}
        freqs = model.freqs["compress"]
        eps = attn.eps
        cache, entries, count, first = _compress_step(layout, cache, tails[(layer, "compressor")], attn.compressor,
                                                      slots, x, old_len, n_valid, mask, freqs, eps)
        cache = tr.seal_compressed(layout, cache, layer, slots, first, entries, count)
        n_max = layout.config.max_context // attn.ratio
        n_now = new_len // attn.ratio
        w = jnp.arange(n_max)[None, :]
        compressed = tr.read_rows(layout, cache, ObjectKind.COMPRESSED, layer, slots,
                                  jnp.broadcast_to(w, (b, n_max)), w < n_now[:, None]).astype(kv.dtype)
        limit = jnp.minimum(causal_entry_limit(positions, attn.ratio), n_now[:, None])  # [B, C]
        if attn.indexer is None:
            cbias = jnp.where(w[:, None, :] < limit[..., None], 0.0, -jnp.inf)
        else:
            ix = attn.indexer
            cache, ikeys_new, icount, ifirst = _compress_step(layout, cache, tails[(layer, "indexer")], ix.compressor,
                                                              slots, x, old_len, n_valid, mask, freqs, eps)
            cache = tr.write_indexer(layout, cache, layer, slots, ifirst, ikeys_new, icount)
            ikeys = tr.read_rows(layout, cache, ObjectKind.INDEXER, layer, slots,
                                 jnp.broadcast_to(w, (b, n_max)), w < n_now[:, None]).astype(kv.dtype)
            ccos, csin = rope["compress"]
            scores = indexer_scores(ix.queries(q_residual, ccos, csin), ix.head_weights(x), ikeys, ix.head_dim)
            picks = select_topk(scores, limit, ix.topk)
            cbias = selection_bias(picks, n_max)
        keys.append(compressed)
        biases.append(cbias.astype(jnp.float32))
    o = attend_with_sinks(q, jnp.concatenate(keys, axis=1), jnp.concatenate(biases, axis=-1),
                          attn.attn_sink.value, attn.head_dim**-0.5)
    return cache, attn.project_output(o, cos, sin)


def cached_step(model: DeepseekV4, layout: CacheLayout, cache: HybridCache, tokens: jax.Array, slots: jax.Array,
                n_valid: jax.Array) -> tuple[HybridCache, jax.Array, jax.Array]:
    """Run tokens[b, :n_valid[b]] as the next tokens of slot slots[b] (rows with n_valid 0 are idle).

    tokens int32[B, C], slots int32[B], n_valid int32[B] in [0, C].
    Returns (cache, float32[B, C, vocab] logits, status int32). On a status other than OK the cache
    is returned unchanged and the logits are zeros.
    """
    check_layout(layout, cache)  # shapes/dtypes: a cache of another spec fails here, at trace time
    b, c = tokens.shape
    mask = n_valid > 0
    old_len = cache.lengths[slots]
    new_len = old_len + n_valid
    reserved, status = tr.reserve(layout, cache, slots, new_len, mask)

    def run(cache):
        positions = old_len[:, None] + jnp.arange(c)[None, :]
        valid = jnp.arange(c)[None, :] < n_valid[:, None]
        safe_tokens = jnp.where(valid, tokens, 0)
        rope = model.rope_tables(positions)
        streams = model.embed_streams(safe_tokens)
        for i, layer in enumerate(model.layers):
            post, comb, collapsed = layer.hc_attn(streams)
            x = rms_norm(collapsed, layer.attn_norm.value, layer.eps)
            cache, out = _attention(model, layer.attn, i, layout, cache, slots, x, positions, valid, old_len, new_len,
                                    n_valid, mask, rope)
            streams = merge(post, comb, out, streams)
            streams = layer.ffn_block(streams, safe_tokens)
        cache = tr.advance(layout, cache, slots, new_len, mask)
        cache = tr.slide(layout, cache, slots, mask)
        return cache, model.logits(streams)

    def skip(cache):
        return cache, jnp.zeros((b, c, model.cfg.vocab_size), jnp.float32)

    # cond, not select: a failed step must not cost a copy of every pool
    out, logits = jax.lax.cond(status == Status.OK, run, skip, reserved)
    return out, logits, status
