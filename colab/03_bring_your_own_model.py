# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Bring your own model: a Flax NNX hybrid model on hkv's cache
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/hkv-project/hkv/blob/main/colab/03_bring_your_own_model.ipynb)
#
# **What you will see.** A small hybrid-attention model written from scratch in this notebook with
# Flax NNX — a sliding-window GQA layer, a full-attention layer, a heavily compressed layer (HCA-style:
# a window plus one pooled entry per *m* tokens) and a sparse compressed layer (CSA-style: a learned
# indexer picks the top-k entries) — plugged into hkv through its model-facing API (`hkv.run_step`,
# `hkv.LayerCache`, the `hkv.CachedModel` protocol). `hkv.testing.check_model` then proves its cached
# path equals its own stateless forward (prefill in several chunk sizes, decode, and prefix restores by
# every route), and `hkv.Engine` serves it: the second turn of a conversation restores the first
# turn's prefix, and its tokens equal a cold run's.
#
# Runs on a CPU runtime; on a GPU or TPU runtime the decode steps run the Pallas kernels (the next
# cells say which).

# %%
# On Colab only: install hkv (without the `parity` extra, which pulls torch and transformers).
import subprocess
import sys

if "google.colab" in sys.modules:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "hkv[notebooks] @ git+https://github.com/hkv-project/hkv"],
        check=True,
    )

# %% tags=["parameters"]
# Parameters. HKV_NOTEBOOK_SMALL=1 (set by the test suite) shrinks the run to seconds.
import os

SMALL = os.environ.get("HKV_NOTEBOOK_SMALL") == "1"
HIDDEN = 32 if SMALL else 64  # model width
NEW_TOKENS = 6 if SMALL else 24  # tokens generated per turn
SYSTEM_TOKENS = 40 if SMALL else 150  # the conversation's first prompt
CHECK_CHUNKS = (16,) if SMALL else (16, 32)  # prefill chunk sizes check_model compares
MAX_CONTEXT = 128 if SMALL else 512  # tokens per sequence

# %%
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import hkv
import hkv.testing
from pallas_kernels.dispatch import describe_backend

print(f"JAX {jax.__version__} on {jax.default_backend()}: {jax.devices()}")
print("decode attention runs as", describe_backend())

# %% [markdown]
# ## The model's shape
#
# Each layer is described by one `Kind`: a `window` (the last *w* tokens; `None` is full attention),
# its number of KV heads, and optionally a compression `ratio` *m* (one pooled entry per *m* tokens,
# visible to a query at position *t* when the entry's *m* tokens are all ≤ *t*) with a `topk` (a
# learned indexer keeps only the *k* best entries per query). hkv's compressed layers store shared K=V
# rows of one head — DeepSeek-V4's layout, which its compressed decode kernels read.


# %%
@dataclasses.dataclass(frozen=True)
class Kind:
    window: int | None  # attend to the last `window` tokens; None = full attention
    kv_heads: int = 1
    ratio: int | None = None  # compress every `ratio` tokens into one entry (shared K=V, one head)
    topk: int | None = None  # a learned indexer picks this many entries (None: every causal entry)


@dataclasses.dataclass(frozen=True)
class Config:
    kinds: tuple = (
        Kind(window=8, kv_heads=2),  # sliding-window GQA (SWA)
        Kind(window=None),  # full attention
        Kind(window=4, ratio=4, topk=2),  # sparse: window + the indexer's top-2 entries (CSA-like)
    ) + (() if SMALL else (Kind(window=4, ratio=4),))  # heavily compressed: window + every entry (HCA-like)
    vocab_size: int = 128
    hidden: int = HIDDEN
    heads: int = 4
    head_dim: int = 8
    index_heads: int = 4
    index_dim: int = 8


cfg = Config()

# %% [markdown]
# ## The math, shared by both paths
#
# The stateless forward (over a whole sequence) and the cached step (over a chunk, reading the cache)
# use the same functions: RMS norm, softmax-gated pooling of each window of *m* projected rows into one
# compressed entry, the indexer's score (DeepSeek's lightning indexer, Σₕ wₕ·relu(qₕ·k)/√d — the score
# `LayerCache.index_topk` uses on the cache), and for the stateless path hkv's `sequence_attention`.
#
# **The numerical contract.** hkv promises the same logits, bit for bit, on every path (the stateless
# forward, any prefill chunk, decode, a restored prefix): `check_model` checks it. A floating-point sum
# depends on its order, so every reduction here goes through `hkv.numerics` (fixed-order sums,
# products whose kernel does not change with the number of rows, see docs/numerics.md), not
# `jnp.sum` / `x @ w`.


# %%
nm = hkv.numerics


def rms_norm(x):
    return nm.mul(x, nm.rms_scale(x, 1e-6))


def linear(x, layer: nnx.Linear):
    """`layer(x)` (no bias) with a product whose bits do not depend on how many rows x holds."""
    return nm.matmul(x, layer.kernel.value).astype(x.dtype)


def pool(kv, gate, ratio):
    """Softmax-gated pooling of each window of `ratio` rows: [B, T, W] -> [B, T // ratio, W]."""
    b, t, w = kv.shape
    n = t // ratio
    kv, gate = kv[:, : n * ratio].reshape(b, n, ratio, w), gate[:, : n * ratio].reshape(b, n, ratio, w)
    return nm.fixed_sum(kv * nm.softmax(gate, axis=2), axis=2).astype(kv.dtype)


def index_scores(q, weights, keys):
    """q [B, T, Hi, Di], weights [B, T, Hi], keys [B, N, Di] -> float32[B, T, N]."""
    return nm.indexer_scores(q, weights, keys, q.shape[-1] ** -0.5)


# %% [markdown]
# ## One attention layer, two paths
#
# `spec()` tells hkv what the layer keeps: `hkv.LayerSpec.attention(head_dim, kv_heads, window, ...)`
# with a `hkv.CompressorSpec` for the pooled entries (and one for the indexer's keys). `__call__` is the
# stateless forward over a whole sequence — the oracle. `cached` is the same layer over one step of the
# cache, through its `hkv.LayerCache` view: `write_kv` stores this step's K/V rows, `compress` feeds the
# projected rows to the compressor (hkv keeps the open window's tail and seals each window the step
# closes, calling our `pool`), `index_topk` asks the indexer for the best entries, and `attend` runs
# attention over the cached rows plus this step's (decode steps go through the Pallas kernels).


# %%
class Attention(nnx.Module):
    def __init__(self, cfg: Config, kind: Kind, rngs: nnx.Rngs):
        self.kind, self.cfg = kind, cfg
        d, h = cfg.head_dim, cfg.hidden
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)
        self.wq, self.wo = lin(h, cfg.heads * d), lin(cfg.heads * d, h)
        self.wk = lin(h, kind.kv_heads * d)
        self.wv = None if kind.ratio else lin(h, kind.kv_heads * d)  # compressed layers: V = K
        self.up, self.down = lin(h, 2 * h), lin(2 * h, h)
        if kind.ratio:
            self.ckv, self.cgate = lin(h, d), lin(h, d)  # what gets pooled into compressed entries
        if kind.topk:
            self.iq, self.iw = lin(h, cfg.index_heads * cfg.index_dim), lin(h, cfg.index_heads)
            self.ikv, self.igate = lin(h, cfg.index_dim), lin(h, cfg.index_dim)  # pooled into indexer keys

    def spec(self) -> hkv.LayerSpec:
        k, d = self.kind, self.cfg.head_dim
        if not k.ratio:
            return hkv.LayerSpec.attention(d, k.kv_heads, k.window)
        comp = hkv.CompressorSpec(k.ratio, entry_dim=d, proj_width=d, overlap=False)
        idx = hkv.CompressorSpec(k.ratio, self.cfg.index_dim, self.cfg.index_dim, overlap=False) if k.topk else None
        return hkv.LayerSpec.attention(d, 1, k.window, shared_kv=True, compressor=comp, indexer=idx)

    def qkv(self, h):
        b, t, _ = h.shape
        q = linear(h, self.wq).reshape(b, t, self.cfg.heads, self.cfg.head_dim)
        k = linear(h, self.wk).reshape(b, t, self.kind.kv_heads, self.cfg.head_dim)
        return q, k, (k if self.wv is None else linear(h, self.wv).reshape(k.shape))

    def indexer_query(self, h):
        b, t, _ = h.shape
        return linear(h, self.iq).reshape(b, t, self.cfg.index_heads, self.cfg.index_dim), linear(h, self.iw)

    def finish(self, x, o):  # output projection and an MLP, both residual
        x = x + linear(o.reshape(*o.shape[:2], -1), self.wo)
        return x + linear(nm.gelu_tanh(linear(rms_norm(x), self.up)), self.down)

    def __call__(self, x):
        """Stateless: x [B, T, hidden] over the whole sequence."""
        kind, h = self.kind, rms_norm(x)
        q, k, v = self.qkv(h)
        entries = limit = picks = None
        if kind.ratio:
            m = kind.ratio
            entries = pool(linear(h, self.ckv), linear(h, self.cgate), m)  # [B, T // m, D]
            n = entries.shape[1]
            t = jnp.arange(x.shape[1])
            limit = jnp.broadcast_to((t + 1) // m, x.shape[:2])  # entries a query at position t may see
            if kind.topk:
                scores = index_scores(*self.indexer_query(h), pool(linear(h, self.ikv), linear(h, self.igate), m))
                scores = jnp.where(jnp.arange(n) < limit[..., None], scores, -jnp.inf)
                _, best = jax.lax.top_k(scores, min(kind.topk, n))  # ties: the lowest index first
                picks = jnp.where(best < limit[..., None], best, -1).astype(jnp.int32)
        o = hkv.core.layers.sequence_attention(q, k, v, window=kind.window, scale=self.cfg.head_dim**-0.5,
                                               entries=entries, entry_limit=limit, picks=picks)  # fmt: skip
        return self.finish(x, o)

    def cached(self, cache, view: hkv.LayerCache, x):
        """The same layer over one cached step: reads and writes through its `hkv.LayerCache` view."""
        kind, h = self.kind, rms_norm(x)
        q, k, v = self.qkv(h)
        shared = bool(kind.ratio)
        cache = view.write_kv(cache, k, None if shared else v)
        picks = None
        if shared:
            fn = lambda kv, gate, *_: pool(kv, gate, kind.ratio)  # windows start at 0, no overlap
            cache = view.compress(cache, linear(h, self.ckv), linear(h, self.cgate), fn)
            if kind.topk:
                cache = view.compress(cache, linear(h, self.ikv), linear(h, self.igate), fn, which="indexer")
                picks = view.index_topk(cache, *self.indexer_query(h), kind.topk)
        o = view.attend(cache, q, k, None if shared else v, compressed=shared, picks=picks)
        return cache, self.finish(x, o)


# %% [markdown]
# ## The model: `hkv.CachedModel`
#
# An `hkv.CachedModel` is a Flax NNX module with four members: `vocab_size`, `cache_spec(block_tokens)`
# (one `LayerSpec` per layer in an `hkv.CacheSpec`), the stateless `__call__(tokens)`, and
# `cached_step(layout, cache, tokens, slots, n_valid, ...)`. The cached step hands its layers to
# `hkv.run_step`, which reserves the step's pages (all or nothing), builds the `hkv.Step` (slots,
# positions, valid tokens), runs them, then commits the new lengths and slides the windows — one pure
# transition. The model never sees a page table or a pool.


# %%
class HybridLM(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden, rngs=rngs)
        self.layers = nnx.List([Attention(cfg, kind, rngs) for kind in cfg.kinds])
        self.head = nnx.Linear(cfg.hidden, cfg.vocab_size, use_bias=False, rngs=rngs)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def cache_spec(self, block_tokens: int = 16, model_id: str = "hybrid-lm") -> hkv.CacheSpec:
        layers = tuple(layer.spec() for layer in self.layers)
        return hkv.CacheSpec(layers, dtype="float32", block_tokens=block_tokens, model_id=model_id)

    def __call__(self, tokens):
        """Stateless forward: int32[B, T] -> float32[B, T, vocab]."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return linear(rms_norm(x), self.head).astype(jnp.float32)

    def cached_step(self, layout, cache, tokens, slots, n_valid, *, seal=True, kernel_backend=None, interpret=False):
        def forward(cache, step: hkv.Step):
            x = self.embed(step.tokens)
            for i, layer in enumerate(self.layers):
                cache, x = layer.cached(cache, hkv.LayerCache(step, i), x)
            return cache, linear(rms_norm(x), self.head)

        return hkv.run_step(
            layout,
            cache,
            jnp.asarray(tokens),
            jnp.asarray(slots),
            jnp.asarray(n_valid),
            forward,
            seal=seal,
            kernel_backend=kernel_backend,
            interpret=interpret,
        )


model = HybridLM(cfg, nnx.Rngs(0))
assert isinstance(model, hkv.CachedModel)
spec = model.cache_spec()
for i, (kind, ls) in enumerate(zip(cfg.kinds, spec.layers, strict=True)):
    print(f"layer {i}: {kind}\n         caches rows of {ls.kv_dim} values, window {ls.window}")

# %% [markdown]
# ## The conformance kit: `hkv.testing.check_model`
#
# `check_model` uses only the protocol, with the stateless forward as the oracle: cold prefill in each
# chunk size followed by greedy decode must give the same tokens and the same logits, bit for bit; a prefix
# restored at every block boundary and at mid-block cuts, by every route the spec allows (kept
# snapshots, the disk tier, a window rebuild), must equal a cold run; invariants must hold and every
# step must compile once. A failure raises an `AssertionError` naming the check. Put this line in your
# model's test suite.

# %%
report = hkv.testing.check_model(model, chunk_sizes=CHECK_CHUNKS, max_context=MAX_CONTEXT, new_tokens=2)
print(
    f"{len(report.checks)} checks passed, max |Δ logits| vs the stateless forward = {report.max_abs_diff:.2g} (bitwise)"
)
for route, cuts in report.routes.items():
    print(f"  {route:<15} at prompt cuts {cuts}")
assert report.max_abs_diff == 0.0
assert {"snapshot", "disk"} <= set(report.routes)
# a full-attention layer needs every past token: a window rebuild cannot restore it, and check_model
# verified that the engine refused that route (restoring nothing rather than something wrong)
assert report.window_rebuild_tokens == 0 and "window_refused" in report.routes

# %% [markdown]
# ## Serving it with `hkv.Engine`, with prefix reuse
#
# The engine takes any `hkv.CachedModel`. With `prefix_records > 0` it records every 16-token block
# a sequence reaches and, for a new prompt, restores the longest *verified* cached prefix — the
# `Generation.plan` (an `hkv.RestorePlan`) says how many tokens the hash matched, how many survived
# each validation stage, and how many were restored.
#
# `report.engine_config` / `report.engine_options` are the configuration of the engine `check_model`
# ran its restore checks on (pools with 4x the pages two sequences need, so cached prefixes fit next to
# the live sequences; 64 prefix records; 16-token blocks and prefill chunks). Serving with it reuses the
# steps compiled during the check: nothing compiles again.


# %%
def serving_engine() -> hkv.Engine:
    # the configuration of the engine check_model's restore checks ran on: its programs are compiled
    return hkv.Engine(model, report.engine_config, **report.engine_options)


engine = serving_engine()
print("prefix records", report.engine_config.prefix_records, "| engine options", report.engine_options)
rng = np.random.default_rng(1)
turn1 = rng.integers(2, cfg.vocab_size, SYSTEM_TOKENS).tolist()
(g1,) = engine.generate([turn1], NEW_TOKENS, return_logits=True)
print(f"turn 1: {len(turn1)} prompt tokens, restored {g1.plan.restored_tokens} -> {g1.tokens}")
assert g1.plan.restored_tokens == 0  # nothing cached yet

# %% [markdown]
# The second turn's prompt is the whole conversation so far (turn 1, the model's reply) plus the
# user's new message. Its first blocks were cached while turn 1 ran, so the engine restores them
# instead of recomputing them.

# %%
turn2 = turn1 + g1.tokens + rng.integers(2, cfg.vocab_size, 9).tolist()
(g2,) = engine.generate([turn2], NEW_TOKENS, return_logits=True)
p = g2.plan
print(f"turn 2: {len(turn2)} prompt tokens")
print(f"  hash hit {p.hash_hit_tokens}, after each stage {p.tokens_after_stage}")
print(f"  restored {p.restored_tokens} tokens, computed {p.recompute} -> {g2.tokens}")
assert p.restored_tokens > 0 and p.restored_tokens == p.hash_hit_tokens

# %% [markdown]
# ### Restored equals cold
#
# A second engine with the same layout (it shares the compiled steps: no new compilation) and an empty
# cache runs turn 2 cold. The tokens must be identical — a restored prefix is exact or absent — and so
# must, to float rounding, the logits each token was drawn from (`return_logits=True` brings them back).

# %%
cold_engine = serving_engine()
(cold,) = cold_engine.generate([turn2], NEW_TOKENS, return_logits=True)
print("cold:    ", cold.tokens, f"(restored {cold.plan.restored_tokens})")
print("restored:", g2.tokens)
assert cold.plan.restored_tokens == 0
delta = float(np.abs(cold.logits - g2.logits).max())
print(f"identical: {cold.tokens == g2.tokens}, max |Δ logits| = {delta:.2g}")
assert cold.tokens == g2.tokens and delta < 1e-4

# %% [markdown]
# The engine's stats show the saving: prefill tokens computed across both turns versus prompt tokens.

# %%
stats = engine.stats()
print(f"prompt tokens {len(turn1) + len(turn2)}, prefilled {stats['prefill_tokens']}")
assert stats["prefill_tokens"] == len(turn1) + len(turn2) - p.restored_tokens

# %% [markdown]
# **Next:** `05_your_jit_loop` runs the same model functions in your own `jax.jit` loop
# (`hkv.decode_loop`, `hkv.restore_prefix`, `hkv.record_prefix`).
