"""Gemma 3's cached path, written only against hkv's model-facing API (`hkv.core.layers`).

`cached_step(model, layout, cache, tokens, slots, n_valid)` runs `tokens[b, :n_valid[b]]` of each row
b as the next tokens of slot `slots[b]` (decode: C = 1 for a batch of slots; prefill: a chunk of C
tokens). It is one pure transition (`hkv.run_step`: reserve pages, the layers, commit lengths and
slide windows); per layer the same pieces as the stateless forward, with the cache in between:

    kv = LayerCache(step, i)                       # the layer's K/V rows for this step's slots
    q, k, v = layer.attn.project_qkv(layer.input_norm(x), cos, sin)
    cache = kv.write_kv(cache, k, v)               # sliding layers keep only rows still in the window
    o = kv.attend(cache, q, k, v, scale=cfg.scaling)
    x = layer.ffn_block(x + layer.post_attention_norm(layer.attn.project_output(o)))

Gemma 3 has no attention sinks, and its `attn_logit_softcapping` is not applied (transformers 5.24,
the reference of the stateless forward, never passes it to attention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hkv.core.layers import InteriorSnapshots, LayerCache, Step, run_step
from hkv.core.layout import CacheLayout
from hkv.core.state import HybridCache
from models.layer_stack import run_cached_layers


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
    read_tokens: int | None = None,
    scan_layers: bool | None = None,
    logit_rows: jax.Array | None = None,
    snapshots: InteriorSnapshots | None = None,
) -> tuple[HybridCache, jax.Array, jax.Array]:
    """Run tokens[b, :n_valid[b]] as the next tokens of slot slots[b] (rows with n_valid 0 are idle).

    The `hkv.CachedModel.cached_step` of `models.gemma3.Gemma3`. kernel_backend / interpret select the
    `pallas_kernels` implementation of the decode attention (None: Pallas on GPU/TPU, the jnp reference
    on CPU). `seal` is accepted for the protocol; Gemma 3 has no compressed objects, so it changes nothing.
    `read_tokens` bounds the tokens any row holds after the step: prefill of a full-attention layer
    then reads that many past rows, not max_context (`hkv.Step.read_tokens`). scan_layers: run the
    repeating layers (5 sliding : 1 full) under one `jax.lax.scan` over their stacked weights (None:
    `models.layer_stack.SCAN_LAYERS`, True; False: a Python loop; see `models.layer_stack`).
    `logit_rows` int32[B, R]: compute and return the logits of these rows only (`hkv.run_step`).
    `snapshots`: the interior block boundaries whose SWA snapshot the step prepares
    (`hkv.InteriorSnapshots`; None: none).

    tokens int32[B, C], slots int32[B], n_valid int32[B] in [0, C].
    Returns (cache, float32[B, C, vocab] logits, status int32). On a status other than OK the cache is
    returned unchanged and the logits are zeros.
    """
    scale = model.cfg.scaling

    def forward(cache: HybridCache, step: Step):
        rope = model.rope_tables(step.positions)

        def one(layer, view: LayerCache, cache: HybridCache, x):
            cos, sin = rope[layer.layer_type]
            q, k, v = layer.attn.project_qkv(layer.input_norm(x), cos, sin)
            cache = view.write_kv(cache, k, v)
            o = view.attend(cache, q, k, v, scale=scale)
            return cache, layer.ffn_block(x + layer.post_attention_norm(layer.attn.project_output(o)))

        cache, x = run_cached_layers(model, step, cache, model.embed(step.tokens), one, scan_layers)
        return cache, model.logits(step.head_rows(x))

    return run_step(layout, cache, jnp.asarray(tokens), jnp.asarray(slots), jnp.asarray(n_valid), forward,
                    seal=seal, kernel_backend=kernel_backend, interpret=interpret, read_tokens=read_tokens,
                    logit_rows=logit_rows, snapshots=snapshots)  # fmt: skip
