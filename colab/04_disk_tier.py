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
# # hkv disk tier: evicted prefixes on disk, verified before use
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/hkv-project/hkv/blob/main/colab/04_disk_tier.ipynb)
#
# **What you will see.** An `hkv.Engine` with an `hkv.DiskTier` evicts its cached prefixes from device
# memory to a store on disk, and the next turn of the conversation restores them from there — the
# `RestorePlan` says which tokens came from disk. Then one byte of the store is flipped: the next plan
# stops at the last block that still verifies (reason `disk_checksum`), the engine recomputes the rest
# and the output stays token-for-token exact. `hkv store verify` finds the damage from the command line,
# and finally the engine is saved and restarted warm with `engine.save` / `hkv.Engine.restore`, its
# cached prefixes intact. Every output is checked against a cold run of the same prompt.
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
FIRST_TOKENS = 64 if SMALL else 512  # the conversation's first prompt
MESSAGE_TOKENS = 56 if SMALL else 128  # each later user message
NEW_TOKENS = 4 if SMALL else 16  # tokens the model answers per turn
MAX_CONTEXT = 256 if SMALL else 1024

# %%
import pathlib
import tempfile

import jax
import numpy as np

import hkv
from models import deepseek_v4
from pallas_kernels.dispatch import describe_backend

print(f"JAX {jax.__version__} on {jax.default_backend()}: {jax.devices()}")
print("decode attention runs as", describe_backend())

# %% [markdown]
# ## An engine with a disk tier
#
# `hkv.DiskTier(path)` opens (or creates) a store in a directory; the engine writes the prefix blocks its
# eviction policy takes out of device memory there (in a background thread, never waited on by a step)
# and looks a prompt up there when the device prefix cache ends before the prompt does. A second engine
# with the same configuration (`cold`, no disk tier) shares the compiled steps and gives the reference
# output: it forgets every cached prefix before each request, so it recomputes every prompt in full.

# %%
cfg = deepseek_v4.tiny_config()
model = deepseek_v4.init(cfg, seed=0)
workdir = tempfile.TemporaryDirectory(prefix="hkv-notebook-")
store_path = os.path.join(workdir.name, "store")

base = hkv.CacheLayout(model.cache_spec(), hkv.CacheConfig(slots=1, max_context=MAX_CONTEXT, prefix_records=0))
config = hkv.CacheConfig(
    slots=1,
    max_context=MAX_CONTEXT,
    pool_pages=tuple(3 * base.pool_pages(g) for g in range(len(base.groups))),  # room for cached prefixes
    prefix_records=64,
)
store = hkv.DiskTier(store_path)
# restore_choice="longest": restore every token the store can give. The default ("cheapest") times
# disk reads and prefill as the engine runs and takes the faster route; for this tiny model on a busy
# CPU, recomputing a block can beat reading it, and the turns below would then skip the disk.
engine = hkv.Engine(model, config, prefill_chunk=32, disk=store, warmup=True, restore_choice="longest")
cold = hkv.Engine(model, config, prefill_chunk=32)

# `warmup=True` compiled every step up front, the disk install included (one program per row bucket),
# so no request waits on a compilation (and the engine's timings of disk reads and prefill, which the
# default restore choice weighs, never include one).
print("compiled:", ", ".join(engine.compilations))


def reference(prompt):
    """The cold run: nothing to reuse, every token computed."""
    cold.evict_prefixes()
    (c,) = cold.generate([prompt], NEW_TOKENS)
    assert c.plan.restored_tokens == 0
    return c.tokens


def show(plan):
    s = plan.tokens_after_stage
    print(
        f"prompt {plan.prompt_tokens} tokens: hash hit {plan.hash_hit_tokens}, after the stages lifecycle "
        f"{s['lifecycle']} / abi {s['abi']} / intersection {s['intersection']} / byte {s['byte']}, "
        f"restored {plan.restored_tokens}, from disk {plan.disk_tokens}, reason {plan.reason} "
        f"(stage {plan.first_failed_stage})"
    )


rng = np.random.default_rng(0)


def message(n):
    return rng.integers(2, cfg.vocab_size, n).tolist()


# %% [markdown]
# ## Turn 1, then evict to disk
#
# The first turn computes its prompt and caches its blocks (16 tokens each) on device.
# `evict_prefixes()` then drops every cached prefix from device memory — the blocks the store lacks are
# written first — and `flush_disk()` waits until they are published (the same happens on its own when
# the eviction policy needs room). The store now holds one *segment*: data shards plus a manifest with
# every object's dtype, shape, offset and checksum (a large eviction may be split into several segments).

# %%
turn1 = message(FIRST_TOKENS)
(g1,) = engine.generate([turn1], NEW_TOKENS)
assert g1.tokens == reference(turn1)
show(g1.plan)
print(f"evicted {engine.evict_prefixes()} cached block records from device memory")
engine.flush_disk()
first_segments = set(pathlib.Path(store_path, "manifests").rglob("*.json"))
print({k: store.stats()[k] for k in ("segments", "stored_bytes")})
for f in sorted(pathlib.Path(store_path).rglob("*")):
    if f.is_file():
        print(f"  {f.relative_to(store_path)}  ({f.stat().st_size:,} bytes)")

# %% [markdown]
# ## Turn 2 restores its prefix from disk
#
# The next prompt is the whole history plus a new message. Its blocks are no longer on device, so the
# engine finds the chain in the store, reads and verifies every block (ABI fingerprint, dtype, shape,
# checksums) and installs them in one all-or-nothing step: `plan.disk_tokens` is the `[start, end)` token
# range that came from disk. The output equals the cold run's.

# %%
turn2 = turn1 + g1.tokens + message(MESSAGE_TOKENS)
(g2,) = engine.generate([turn2], NEW_TOKENS)
show(g2.plan)
assert g2.plan.disk_tokens == (0, g2.plan.restored_tokens) and g2.plan.restored_tokens >= len(turn1) // 16 * 16
assert g2.tokens == reference(turn2)
print("turn 2 output identical to the cold run: True")

# %% [markdown]
# ## A flipped byte shrinks the plan, not the correctness
#
# Evict again: the blocks turn 2 added go to disk as new segment(s). Then flip one byte in the first new
# segment's first data shard (`data/<abi fingerprint>/<segment>/c/0`), as a failing disk or a stray
# write would. Turn 3's hash lookup still finds every stored block, but the damaged ones fail their
# checksum when read: the plan stops at the last verified block with reason `disk_checksum` (only the
# blocks before the damage are installed), and the engine recomputes from there. The output is still
# exact.

# %%
engine.evict_prefixes()
engine.flush_disk()
manifests = sorted(pathlib.Path(store_path, "manifests").rglob("*.json"))  # named by time: the oldest first
new = [m for m in manifests if m not in first_segments]
print(f"{len(manifests)} segments on disk, {len(new)} written by this eviction")
assert new
second = new[0]  # the first segment this eviction wrote: it holds the first blocks turn 2 added
shard = pathlib.Path(store_path, "data", second.parent.name, second.stem, "c", "0")
data = bytearray(shard.read_bytes())
data[len(data) // 3] ^= 0x10
shard.write_bytes(bytes(data))
print(f"flipped one bit of byte {len(data) // 3:,} in {shard.relative_to(store_path)}")

turn3 = turn2 + g2.tokens + message(MESSAGE_TOKENS)
(g3,) = engine.generate([turn3], NEW_TOKENS)
show(g3.plan)
assert g3.plan.reason == hkv.Reason.DISK_CHECKSUM and g3.plan.first_failed_stage == "byte"
assert g3.plan.restored_tokens < g3.plan.hash_hit_tokens
assert g3.plan.disk_tokens == (0, g3.plan.restored_tokens) and g3.plan.restored_tokens >= g2.plan.restored_tokens
assert g3.tokens == reference(turn3)
print("turn 3 output identical to the cold run: True")
print("disk rejections counted by the engine:", engine.stats()["prefix"]["rejections"])

# %% [markdown]
# ## `hkv store verify`
#
# The command line checks a store without an engine: every manifest, and every object's bytes against
# its checksum. It reports each problem and exits 1 when any published block is bad (0 when all are
# intact, 2 for a usage error). `hkv store stats` prints sizes, segments, blocks and restore hits.

# %%
verify = subprocess.run(
    [sys.executable, "-m", "hkv", "store", "verify", store_path], capture_output=True, text=True, check=False
)
print(verify.stdout + verify.stderr)
print("exit code", verify.returncode)
assert verify.returncode == 1 and "disk_checksum" in verify.stdout
report = store.verify()  # the same check from Python: the first segment's blocks are intact
assert report["blocks_ok"] >= g2.plan.restored_tokens // 16 and report["disk_checksum"] > 0
stats = subprocess.run(
    [sys.executable, "-m", "hkv", "store", "stats", store_path], capture_output=True, text=True, check=True
)
print(stats.stdout)

# %% [markdown]
# ## Warm restart
#
# `engine.save(path)` writes the whole device cache (with its prefix index) and the engine's settings,
# after finishing pending disk writes. `hkv.Engine.restore(path, model, disk=...)` rebuilds the engine,
# verifying every array's checksum, the ABI fingerprint and the cache invariants before use — a process
# restart that keeps every cached prefix. The next turn restores most of its history from the restored
# device cache (nothing from disk this time; where the sliding-window snapshot at the last boundary is
# missing, the plan stops at an earlier boundary with reason `swa_missing` or rebuilds the window), and
# its output is again exact.

# %%
checkpoint = os.path.join(workdir.name, "checkpoint")
engine.save(checkpoint)
restarted = hkv.Engine.restore(checkpoint, model, disk=hkv.DiskTier(store_path))
print("restored engine:", restarted.stats()["prefix"]["occupancy"]["records"], "cached block records on device")
turn4 = turn3 + g3.tokens + message(MESSAGE_TOKENS)
(g4,) = restarted.generate([turn4], NEW_TOKENS)
show(g4.plan)
assert g4.plan.restored_tokens > g3.plan.restored_tokens and g4.plan.disk_tokens is None  # from device memory
assert g4.tokens == reference(turn4)
print("turn 4 (after the restart) output identical to the cold run: True")

# %% [markdown]
# The restarted engine's metrics: the cache counters (lookups, hash-hit, restored and disk-restored
# tokens, rejections by stage and reason) travelled with the checkpoint; the disk I/O counters belong to
# its newly opened `DiskTier`. Closing the tiers finishes their writes before the folder is removed.

# %%
print("\n".join(line for line in restarted.metrics_text().splitlines() if line.startswith(("hkv_prefix", "hkv_disk"))))
for tier in (store, restarted.disk):
    tier.close()
workdir.cleanup()

# %% [markdown]
# A block restored from disk is verified before use, and a block that fails is not used: damage only
# makes the plan shorter, with its reason counted in `stats()`, `metrics_text()` and `hkv store verify`.
#
# **Next:** `05_your_jit_loop` — the cache as a pytree inside your own `jax.jit` decode loop.
