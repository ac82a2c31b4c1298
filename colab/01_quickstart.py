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
# # hkv quick start: generate with DeepSeek-V4's hybrid KV cache
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/hkv-project/hkv/blob/main/colab/01_quickstart.ipynb)
#
# **What you will see.** A tiny random DeepSeek-V4 — every attention type of the real model: sliding
# window (SWA), compressed sparse attention with its learned indexer (CSA) and heavily compressed
# attention (HCA) — generates text through `hkv.Engine`: greedy, sampled with a seed (the same seed gives
# the same tokens) and streamed token by token. Then `memory_report()` shows what the cache holds per
# object kind, and a plot compares, for the real DeepSeek-V4-Flash and Gemma-3-27B dimensions from 4K to
# 1M tokens of context, the memory hkv allocates with the architectural minimum (what any exact cache
# must keep) and with a uniform full-KV cache (what a cache that ignores the architecture keeps).
#
# Runs on a CPU runtime; on a GPU or TPU runtime the Pallas decode kernels run (the next cells say which).

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
NEW_TOKENS = 8 if SMALL else 32  # tokens generated per prompt
PROMPT_LENGTHS = (40, 13) if SMALL else (300, 37, 129)
CONTEXTS = [4096 * 4**i for i in range(5)]  # 4K, 16K, 64K, 256K, 1M tokens (memory is computed from shapes: instant)

# %%
import jax
import matplotlib.pyplot as plt
import numpy as np

import hkv
from models import deepseek_v4, gemma3
from models.deepseek_v4.cache_spec import cache_spec as deepseek_cache_spec
from models.gemma3.cache_spec import cache_spec as gemma3_cache_spec
from pallas_kernels.dispatch import describe_backend

print(f"JAX {jax.__version__} on {jax.default_backend()}: {jax.devices()}")
print("decode attention runs as", describe_backend())

# %% [markdown]
# ## A tiny DeepSeek-V4
#
# `tiny_config()` keeps every structural feature of DeepSeek-V4 (the four layer kinds, the indexer with
# 16 heads, hash-routed and top-k MoE, hyper-connections) at a size that runs in seconds on a CPU.
# The weights are random, so the tokens are meaningless — but every token is exactly what the model
# computes, which is what a cache must guarantee.

# %%
cfg = deepseek_v4.tiny_config()
model = deepseek_v4.init(cfg, seed=0)
print(f"{cfg.num_hidden_layers} layers: {list(cfg.layer_types)}")
print(f"sliding window {cfg.sliding_window}; CSA ratio m={cfg.compress_rate_csa}, HCA ratio m={cfg.compress_rate_hca}")

# %% [markdown]
# ## The engine
#
# `hkv.CacheConfig` fixes the capacities up front (slots = concurrent sequences, the longest context,
# the page size, how many prefixes to keep for reuse); the engine compiles its steps once (a progress
# bar shows the compilations) and then schedules requests with continuous batching.

# %%
engine = hkv.Engine(
    model,
    hkv.CacheConfig(slots=2, max_context=512, page_size=16, prefix_records=64),
    prefill_chunk=32,
    seed=0,
)
rng = np.random.default_rng(0)
prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in PROMPT_LENGTHS]

# %% [markdown]
# ### Greedy
# `generate` takes token ids and returns one `hkv.Generation` per prompt: the new tokens, their
# log-probabilities, why generation stopped, and the prefix-restoration plan.

# %%
greedy = engine.generate(prompts, NEW_TOKENS)
for p, g in zip(prompts, greedy, strict=True):
    print(f"prompt of {len(p):>3} tokens -> {g.tokens}  ({g.finish_reason})")

# %% [markdown]
# ### Sampled, reproducibly
# `hkv.SamplingParams` sets temperature / top-k / top-p / min-p and a seed. The random key of the token at
# position *t* is derived from the seed and *t* alone, so the same seed gives the same tokens whatever
# else is in the batch.

# %%
hot = hkv.SamplingParams(temperature=0.8, top_p=0.9, seed=7)
a = engine.generate([prompts[0]], NEW_TOKENS, sampling=hot)[0]
b = engine.generate(prompts[::-1], NEW_TOKENS, sampling=hot)[-1]  # the same prompt, in another batch
print("sampled:        ", a.tokens)
print("again, batched: ", b.tokens)
print("identical:", a.tokens == b.tokens)
assert a.tokens == b.tokens

# %% [markdown]
# ### Streamed
# `submit` returns a `RequestHandle`; iterating it yields tokens as the engine produces them (and drives
# the engine when no other thread does).

# %%
handle = engine.submit(prompts[-1], NEW_TOKENS, sampling=hkv.SamplingParams(temperature=1.0, seed=3))
for token in handle:
    print(token, end=" ", flush=True)
print(f"\nfinished: {handle.result().finish_reason}")

# %% [markdown]
# ## What the cache holds
# `memory_report()` splits device memory by object kind: SWA rows (the sliding window), COMPRESSED
# entries (CSA and HCA), INDEXER keys and the compressors' TAIL (the open window not yet compressed).
# *allocated* is reserved up front; *live* is what sequences and cached prefixes reference now.

# %%
report = engine.memory_report()
print(f"{'kind':<12}{'allocated':>14}{'live':>14}")
for kind in report["allocated"]:
    print(f"{kind:<12}{report['allocated'][kind]:>14,}{report['live'][kind]:>14,}")
print(engine.stats()["compilations"], "compilations")

# %% [markdown]
# ## Memory at real scale
# Nothing is allocated here: `hkv.allocated_bytes(layout)` computes what `init_cache` would reserve
# from shapes alone, so a 1M-token layout of the full-size models costs nothing to evaluate.
# The cache stores bf16; pages hold 64 tokens; one sequence.

# %%
specs = {
    "DeepSeek-V4-Flash": deepseek_cache_spec(deepseek_v4.flash_config(), dtype="bfloat16", block_tokens=64),
    "Gemma-3-27B": gemma3_cache_spec(gemma3.gemma3_27b_config(), dtype="bfloat16", block_tokens=64),
}
GiB = 2**30
rows = {}
for name, spec in specs.items():
    rows[name] = [
        (
            hkv.allocated_bytes(
                hkv.CacheLayout(spec, hkv.CacheConfig(slots=1, max_context=n, page_size=64, prefix_records=0))
            )["total"]
            / GiB,
            hkv.architectural_minimum(spec, n)["total"] / GiB,
            hkv.uniform_full_kv_bytes(spec, n, page_size=64) / GiB,
        )
        for n in CONTEXTS
    ]
    alloc, minimum, uniform = rows[name][-1]
    print(
        f"{name} at {CONTEXTS[-1]:,} tokens: hkv {alloc:.2f} GiB, minimum {minimum:.2f} GiB "
        f"({alloc / minimum:.3f}x), uniform full-KV {uniform:.1f} GiB ({uniform / alloc:.1f}x hkv)"
    )

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
for ax, (name, values) in zip(axes, rows.items(), strict=True):
    alloc, minimum, uniform = np.array(values).T
    ax.plot(CONTEXTS, uniform, "s--", label="uniform full-KV cache")
    ax.plot(CONTEXTS, alloc, "o-", label="hkv allocates")
    ax.plot(CONTEXTS, minimum, "k:", label="architectural minimum")
    ax.set(xscale="log", yscale="log", title=name, xlabel="context (tokens)")
    ax.set_xticks(CONTEXTS, [f"{n // 1024}K" if n < 2**20 else f"{n // 2**20}M" for n in CONTEXTS])
    ax.grid(True, which="major", alpha=0.3)
axes[0].set_ylabel("KV cache memory, one sequence (GiB)")
axes[0].legend()
fig.suptitle("Cache memory vs context length (bf16, 64-token pages)")
plt.tight_layout()
plt.show()

# %% [markdown]
# hkv's allocation tracks the architectural minimum (the gap is page rounding and the sliding
# window's spare page), while a full-KV cache grows with every layer's every token.
#
# **Next:** `02_prefix_reuse` (multi-turn chat and restoration plans), `03_bring_your_own_model`,
# `04_disk_tier`, `05_your_jit_loop`.
