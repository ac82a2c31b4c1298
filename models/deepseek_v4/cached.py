"""DeepSeek-V4's cached path, written only against hkv's model-facing API (`hkv.core.layers`).

`cached_step(model, layout, cache, tokens, slots, n_valid)` runs `tokens[b, :n_valid[b]]` of each
row b as the next tokens of slot `slots[b]` (decode: C = 1 for a batch of slots; prefill: a chunk of
C tokens that may end mid-window and mid-compression-block). It is one pure transition
(`hkv.run_step`: reserve pages, the layers, commit lengths and slide windows); per layer:

    kv = LayerCache(step, i)                  # the layer's objects for this step's slots
    kv.write_kv(cache, k)                     # shared K=V rows of one head (only rows kept in the window)
    kv.compress(cache, kv_proj, gate, ...)    # CSA/HCA: TAIL bookkeeping; sealed windows -> COMPRESSED
    kv.compress(..., which="indexer")         # CSA: indexer keys
    kv.index_topk(cache, iq, iw, k)           # CSA: the indexer's top-k entries
    kv.attend(cache, q, k, sinks=..., compressed=..., picks=...)

The compressor math is `compressor.compress_windows`, the same function the stateless forward
uses, fed with the TAIL rows the cache kept; so cached logits equal the stateless forward's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hkv.core.layers import InteriorSnapshots, LayerCache, Step, run_step
from hkv.core.layout import CacheLayout
from hkv.core.state import HybridCache
from models.layer_stack import run_cached_layers

from .compressor import compress_windows
from .hyper_connection import merge
from .norms import rms_norm


def _compress(kv_view: LayerCache, cache: HybridCache, comp, x, freqs, eps: float, which: str) -> HybridCache:
    """Feed this step's rows of `x` to compressor `comp` (the layer's, or its indexer's) through hkv."""
    kv, gate = comp.project(x)  # [B, C, width]

    def math(buf_kv, buf_gate, first_token, prior_kv, prior_gate):
        return compress_windows(buf_kv, buf_gate, comp.ape.value, comp.norm.value, first_token, ratio=comp.ratio,
                                head_dim=comp.head_dim, overlap=comp.overlap, freqs=freqs, eps=eps,
                                prior_kv=prior_kv, prior_gate=prior_gate)  # fmt: skip

    return kv_view.compress(cache, kv, gate, math, which=which, gate_bias=comp.ape.value)


def _attention(attn, view: LayerCache, cache: HybridCache, x, rope, freqs) -> tuple[HybridCache, jax.Array]:
    """One layer's cached attention (`attn` the layer's `Attention`, `view` its `LayerCache`); returns
    (cache with the layer's objects written, output [B, C, hidden])."""
    cos, sin = rope[attn.rope_family]
    q, q_residual = attn.queries(x, cos, sin)
    k = attn.shared_kv(x, cos, sin)[:, :, None, :]  # [B, C, 1, D]: one shared K=V head
    cache = view.write_kv(cache, k)
    picks = None
    if attn.compressor is not None:
        cache = _compress(view, cache, attn.compressor, x, freqs, attn.eps, "compressor")
        if attn.indexer is not None:
            ix = attn.indexer
            cache = _compress(view, cache, ix.compressor, x, freqs, attn.eps, "indexer")
            ccos, csin = rope["compress"]
            picks = view.index_topk(cache, ix.queries(q_residual, ccos, csin), ix.head_weights(x), ix.topk)
    o = view.attend(cache, q, k, sinks=attn.attn_sink.value, scale=attn.head_dim**-0.5,
                    compressed=attn.compressor is not None, picks=picks)  # fmt: skip
    return cache, attn.project_output(o, cos, sin)


def _layer(layer, view: LayerCache, cache: HybridCache, streams, step: Step, rope, freqs):
    """One decoder layer through the cache: streams [B, C, N, hidden] -> (cache, new streams)."""
    post, comb, collapsed = layer.hc_attn(streams)
    x = rms_norm(collapsed, layer.attn_norm.value, layer.eps)
    cache, out = _attention(layer.attn, view, cache, x, rope, freqs)
    streams = merge(post, comb, out, streams)
    return cache, layer.ffn_block(streams, step.tokens)


def cached_step(
    model,
    layout: CacheLayout,
    cache: HybridCache,
    tokens: jax.Array,
    slots: jax.Array,
    n_valid: jax.Array,
    *,
    kernel_backend: str | None = None,
    interpret: bool = False,
    seal: bool = True,
    scan_layers: bool | None = None,
    read_tokens: int | None = None,
    logit_rows: jax.Array | None = None,
    snapshots: InteriorSnapshots | None = None,
) -> tuple[HybridCache, jax.Array, jax.Array]:
    """Run tokens[b, :n_valid[b]] as the next tokens of slot slots[b] (rows with n_valid 0 are idle).

    The `hkv.CachedModel.cached_step` of `models.deepseek_v4.DeepseekV4`. kernel_backend / interpret
    select the `pallas_kernels` implementation of the decode ops (None: Pallas on GPU/TPU, the jnp
    reference on CPU). seal=False rebuilds SWA rows and TAIL only, leaving compressed entries and
    indexer keys as they are (the prefix cache's window rebuild). scan_layers: run repeating layers under
    one `jax.lax.scan` over their stacked weights (None: `layer_scan.SCAN_LAYERS`, True; False: a
    Python loop over the layers; see `models.deepseek_v4.layer_scan`). read_tokens: a bound on the tokens any
    row holds after the step, so prefill reads of compressed entries cover only that many tokens
    (`hkv.Step.read_tokens`; None: max_context). logit_rows: int32[B, R], the rows whose logits to
    compute and return (`hkv.run_step`; None: all C). snapshots: the interior block boundaries whose
    SWA + TAIL snapshot the step prepares (`hkv.InteriorSnapshots`; None: none).

    tokens int32[B, C], slots int32[B], n_valid int32[B] in [0, C].
    Returns (cache, float32[B, C, vocab] logits, status int32). On a status other than OK the cache
    is returned unchanged and the logits are zeros.
    """

    def forward(cache: HybridCache, step: Step):
        rope = model.rope_tables(step.positions)
        streams = model.embed_streams(step.tokens)
        freqs = model.freqs["compress"]

        def one(layer, view: LayerCache, cache: HybridCache, streams):
            return _layer(layer, view, cache, streams, step, rope, freqs)

        cache, streams = run_cached_layers(model, step, cache, streams, one, scan_layers)
        return cache, model.logits(step.head_rows(streams))

    return run_step(layout, cache, jnp.asarray(tokens), jnp.asarray(slots), jnp.asarray(n_valid), forward,
                    seal=seal, kernel_backend=kernel_backend, interpret=interpret, read_tokens=read_tokens,
                    logit_rows=logit_rows, snapshots=snapshots)  # fmt: skip
