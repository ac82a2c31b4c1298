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
# # Your own `jax.jit` loop: `hkv.decode_loop` with prefix restore and record
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/hkv-project/hkv/blob/main/colab/05_your_jit_loop.ipynb)
#
# **What you will see.** No `hkv.Engine`: a tiny random DeepSeek-V4 is served by two functions you
# jit yourself — `hkv.step_and_sample` (one prompt chunk, then sample the next token) and
# `hkv.decode_loop` (a `lax.while_loop` on device with the cache as its carry) — plus the prefix
# pieces `hkv.PrefixQuery`, `hkv.restore_prefix` and `hkv.record_prefix`. A second turn restores the
# first turn's prefix and produces exactly the tokens of a cold run. Then a plot of the time per decode
# step against the context length: the cache's pools have a fixed shape, so one compiled program serves
# every length and the time per token stays flat. On a GPU or TPU runtime the plot also compares the
# Pallas decode kernels with the jnp reference.
#
# Runs on a CPU runtime (reference kernels only; the kernel comparison needs an accelerator runtime).

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
MAX_CONTEXT = 512 if SMALL else 4096  # tokens per sequence (fixes the cache's shapes)
CHUNK = 64 if SMALL else 256  # prefill chunk (one compiled shape)
STEPS = 8 if SMALL else 32  # tokens per decode_loop call (one compiled shape)
REPEATS = 2 if SMALL else 5  # timed decode_loop calls per context length (the fastest counts)
CONTEXTS = (32, 192, 448) if SMALL else (256, 1024, 2048, 3072, 3840)  # context lengths to time
PROMPT_TOKENS = 40 if SMALL else 300  # first turn of the conversation

# %%
import dataclasses
import functools
import time

import jax
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

import hkv
from models import deepseek_v4
from pallas_kernels.dispatch import describe_backend, resolve_backend

print(f"JAX {jax.__version__} on {jax.default_backend()}: {jax.devices()}")
# JAX's persistent compilation cache (what hkv.Engine turns on by itself): a second run of this notebook
# loads the compiled prefill and decode programs instead of compiling them ($HKV_COMPILATION_CACHE=0: off).
print("compilation cache:", hkv.enable_compilation_cache())
kernels = resolve_backend(None, False)  # "gpu" / "tpu": the Pallas kernels; "reference": jnp
print("decode attention runs as", describe_backend())

# %% [markdown]
# ## The model and the cache layout
#
# The layout fixes every shape up front: slots (concurrent sequences), the longest context, the page
# size, and how many prefix records to keep. Its spec comes from the model; setting its
# `weights_digest` makes the weights part of the ABI fingerprint a restore checks, so a prefix cached
# under other weights is refused rather than misused (an `hkv.Engine` does this itself).

# %%
full = deepseek_v4.tiny_config()  # sliding, CSA, HCA, CSA; small mode keeps the first three (one of each)
n = 3 if SMALL else full.num_hidden_layers
cfg = deepseek_v4.tiny_config(
    num_hidden_layers=n, layer_types=full.layer_types[:n], mlp_layer_types=full.mlp_layer_types[:n]
)
model = deepseek_v4.init(cfg, seed=0)
graphdef, weights = nnx.split(model)  # the weights travel as a jit argument, not baked-in constants
BLOCK = 16
spec = dataclasses.replace(model.cache_spec(block_tokens=BLOCK), weights_digest=hkv.weights_digest(weights))
layout = hkv.CacheLayout(spec, hkv.CacheConfig(slots=2, max_context=MAX_CONTEXT, page_size=16, prefix_records=32))
print(f"{cfg.num_hidden_layers} layers {list(cfg.layer_types)}; {BLOCK}-token blocks, {MAX_CONTEXT} tokens per slot")

# %% [markdown]
# ## Two jitted functions
#
# `prefill` runs one chunk of a prompt (padded to `CHUNK`; the first `n_valid` tokens are real) and
# samples the token after it; `decode` runs `hkv.decode_loop` for `STEPS` tokens without leaving the
# device. Both take the layout as a static argument and donate the cache (updated in place), so each
# compiles once. `kernel_backend` is passed through to the model's cached step: `None` picks the Pallas
# kernels on GPU/TPU and the reference on CPU; `"reference"` forces the jnp reference.
# `hkv.numerics.jit` is `jax.jit` with the compiler options of hkv's numerical contract (on CPU: the
# same logits, bit for bit, as the engine and the stateless forward; docs/numerics.md).


# %%
@functools.partial(hkv.numerics.jit, static_argnums=0, donate_argnums=1)
def prefill(layout, cache, weights, chunk, slot, n_valid):
    m = nnx.merge(graphdef, weights)
    return hkv.step_and_sample(m, layout, cache, chunk[None], slot[None], n_valid[None])


@functools.partial(hkv.numerics.jit, static_argnums=(0, 5), donate_argnums=1)
def decode(layout, cache, weights, first, slot, kernel_backend):
    m = nnx.merge(graphdef, weights)
    return hkv.decode_loop(m, layout, cache, first, slot[None], steps=STEPS, kernel_backend=kernel_backend)


restore = jax.jit(hkv.restore_prefix, static_argnums=0, donate_argnums=1)


def run(cache, ids, slot):
    """Prefill `ids` into `slot` chunk by chunk; returns the cache and the token sampled after them."""
    first = None
    for i in range(0, len(ids), CHUNK):
        part = ids[i : i + CHUNK]
        buf = np.zeros(CHUNK, np.int32)
        buf[: len(part)] = part
        cache, first, _, status = prefill(layout, cache, weights, buf, slot, np.int32(len(part)))
        assert int(status) == hkv.Status.OK, hkv.Status(int(status))
    return cache, first


# %% [markdown]
# ## Serving a prompt with prefix reuse
#
# `serve` is what an engine does for one request, written out:
# 1. `PrefixQuery.of(prompt, layout)` computes the prompt's chained block keys on the host;
# 2. `restore_prefix` looks them up and validates the hit in four stages (hash, lifecycle, ABI,
#    intersection of the SWA window, compressor TAIL and indexer keys) and claims only what passes;
#    `query.plan(...)` turns the result into an `hkv.RestorePlan`;
# 3. the rest of the prompt runs up to its last block boundary, where `record_prefix` records the blocks
#    (the SWA + TAIL snapshot is taken where the slot's length ends, so we stop exactly there);
# 4. the prompt's last tokens run, then `decode` produces the answer on device, and the slot is freed.


# %%
def serve(cache, prompt):
    query = hkv.PrefixQuery.of(prompt, layout)
    cache, slot, _ = hkv.transitions.claim_slot(layout, cache)
    cache, device_plan = restore(layout, cache, slot, *query.args)
    plan = query.plan(device_plan)  # what was restored, and why not more
    edge = (len(prompt) - 1) // BLOCK * BLOCK  # the last block boundary before the prompt's end
    if plan.restored_tokens < edge:
        cache, _ = run(cache, prompt[plan.restored_tokens : edge], slot)
        cache, last = hkv.record_prefix(layout, cache, slot, prompt[:edge])
        assert last >= 0, "no record slot or page left for the prefix"
    cache, first = run(cache, prompt[max(edge, plan.restored_tokens) :], slot)
    cache, new, n_new, status = decode(layout, cache, weights, first, slot, None)  # None: the default kernels
    assert int(status) == hkv.Status.OK, hkv.Status(int(status))
    cache, _ = hkv.transitions.release_slot(layout, cache, slot)
    return cache, plan, [int(first[0]), *np.asarray(new[0, : int(n_new[0])]).tolist()]


rng = np.random.default_rng(0)
turn1 = rng.integers(2, cfg.vocab_size, PROMPT_TOKENS).tolist()
cache = hkv.init_cache(layout)
cache, plan1, reply = serve(cache, turn1)
print(f"turn 1: {len(turn1)} prompt tokens, restored {plan1.restored_tokens} -> {reply}")
assert plan1.restored_tokens == 0 and len(reply) == STEPS + 1

# %% [markdown]
# The second turn is the conversation so far plus a new message. Its first blocks were recorded by
# turn 1, so `restore_prefix` brings them back instead of recomputing them.

# %%
turn2 = turn1 + reply + rng.integers(2, cfg.vocab_size, 7).tolist()
cache, plan2, reply2 = serve(cache, turn2)
edge1 = (len(turn1) - 1) // BLOCK * BLOCK
print(
    f"turn 2: {len(turn2)} prompt tokens; hash hit {plan2.hash_hit_tokens}, after each stage {plan2.tokens_after_stage}"
)
print(f"  restored {plan2.restored_tokens} tokens -> {reply2}")
assert plan2.restored_tokens == edge1 > 0

# %% [markdown]
# ### Restored equals cold
# The same functions on a fresh, empty cache run turn 2 from scratch (no new compilation: same shapes).
# The tokens must be identical.

# %%
_, cold_plan, cold_reply = serve(hkv.init_cache(layout), turn2)
print("cold:    ", cold_reply)
print("restored:", reply2)
assert cold_plan.restored_tokens == 0 and cold_reply == reply2
hkv.check_invariants(layout, cache)  # declared state == actual state after both turns
print("identical: True; invariants hold")

# %% [markdown]
# ## Time per decode step vs context length
#
# For each context length: claim a slot, prefill that many tokens, call `decode` once to warm up (the
# first call also compiles), wait for it (`block_until_ready`), then time `REPEATS` more calls of
# `STEPS` tokens and keep the fastest. The cache's shapes do not depend on the context, so one program
# serves every length; the goal is a flat line. On a GPU/TPU runtime the same loop also runs with
# `kernel_backend="reference"` to compare the Pallas kernels with the jnp reference.

# %%
if kernels == "reference":  # CPU: None already means the reference (and reuses the compiled decode)
    backends = {"reference (jnp)": None}
else:
    backends = {f"Pallas ({kernels})": None, "reference (jnp)": "reference"}
if kernels == "reference":
    print("CPU runtime: timing the jnp reference only; the Pallas vs reference comparison needs a GPU or TPU runtime")


def ms_per_token(cache, context, backend):
    cache, slot, _ = hkv.transitions.claim_slot(layout, cache)
    cache, first = run(cache, rng.integers(2, cfg.vocab_size, context).tolist(), slot)
    out = decode(layout, cache, weights, first, slot, backend)  # warm-up (and compilation)
    jax.block_until_ready(out)
    cache, new, n_new, status = out
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        cache, new, n_new, status = jax.block_until_ready(decode(layout, cache, weights, new[:, -1], slot, backend))
        best = min(best, time.perf_counter() - t0)
        assert int(status) == hkv.Status.OK and int(n_new[0]) == STEPS
    cache, _ = hkv.transitions.release_slot(layout, cache, slot)
    return cache, 1e3 * best / STEPS


assert max(CONTEXTS) + (REPEATS + 1) * STEPS <= MAX_CONTEXT
timings = {name: [] for name in backends}
for name, backend in backends.items():
    for context in tqdm(CONTEXTS, desc=name):
        cache, ms = ms_per_token(cache, context, backend)
        timings[name].append(ms)
for name, values in timings.items():
    print(f"{name:<18}" + "  ".join(f"{c:>5} tok: {v:6.2f} ms" for c, v in zip(CONTEXTS, values, strict=True)))

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for name, values in timings.items():
    ax.plot(CONTEXTS, values, "o-", label=name)
ax.set(xlabel="context length (tokens)", ylabel="ms per decode step", ylim=(0, None))
ax.set_title(f"Tiny DeepSeek-V4, one sequence, {STEPS}-step decode_loop on {jax.default_backend()}")
ax.grid(True, alpha=0.3)
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# Up to timing noise the line is flat: one compiled program serves every context length (the cache's
# shapes are fixed by the layout), and no step waits on the host. On CPU the jnp reference reads every
# row the layout can hold, masked, so its time is set by `max_context`, not by the context. The Pallas
# kernels read only a sequence's live pages — the sliding window's rows and the compressed entries (one
# per *m* tokens; a CSA layer attends only to the indexer's top-k) — so on an accelerator their line
# stays low and grows only with the compressed entries. (The random tiny model is far too small to show
# the kernels' full advantage.)
#
# **Next:** `03_bring_your_own_model` writes a model of your own against the same cache API.
