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
# # hkv prefix reuse: a multi-turn chat under memory pressure
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/hkv-project/hkv/blob/main/colab/02_prefix_reuse.ipynb)
#
# **What you will see.** Several users chat with a tiny DeepSeek-V4, some of them sharing one system
# prompt, through an `hkv.Engine` whose cache is deliberately too small to keep every conversation.
# Each turn's prompt is the whole history so far, so most of it was computed before: the engine looks
# it up in its prefix cache and returns a `RestorePlan` — how many tokens the block hash matched, how
# many survived each validation stage, how many were really restored, and why a plan was cut short.
# Per turn you see that plan, a plot of hash-hit vs restored tokens, and a plot of the time to first
# token (TTFT) with the prefix cache vs the same prompt on a cold cache — with every warm turn's
# tokens checked equal to the cold run's. Halfway through, the retention policy (where the engine
# keeps the sliding-window snapshots that make a restore complete) is changed live, and the end shows
# the engine's Prometheus metrics.
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
USERS = 3 if SMALL else 4  # users taking turns (round robin)
SHARED_USERS = 2 if SMALL else 3  # the first SHARED_USERS users start with the same system prompt
SYSTEM_TOKENS = 192 if SMALL else 512  # system prompt length
MESSAGE_TOKENS = (16, 40) if SMALL else (32, 96)  # each new user message: uniform in [lo, hi] tokens
REPLY_TOKENS = 4 if SMALL else 8  # tokens the model answers per turn (greedy)
ROUNDS = 4 if SMALL else 6  # turns per user
HISTORY_CAPACITY = 0.7  # the prefix cache holds about this share of all final conversations
SNAPSHOT_SLOTS = 4  # sliding-window + TAIL snapshots the cache can hold at once

# %%
import jax
import matplotlib.pyplot as plt
import numpy as np
from tqdm.auto import tqdm

import hkv
from models import deepseek_v4
from pallas_kernels.dispatch import describe_backend

print(f"JAX {jax.__version__} on {jax.default_backend()}: {jax.devices()}")
print("decode attention runs as", describe_backend())

# %% [markdown]
# ## The model and the conversations
#
# The tiny random DeepSeek-V4 of `01_quickstart` (every attention type of the real model, seconds on a
# CPU). Each user's first prompt is a system prompt plus a first message; every later prompt is the
# previous prompt + the model's reply + a new message, so a prompt always extends the one before it.
# The messages are drawn up front; the replies are whatever the model generates.

# %%
cfg = deepseek_v4.tiny_config()
model = deepseek_v4.init(cfg, seed=0)
rng = np.random.default_rng(0)


def tokens(n):
    return rng.integers(2, cfg.vocab_size, n).tolist()


shared_system = tokens(SYSTEM_TOKENS)
systems = [shared_system if u < SHARED_USERS else tokens(SYSTEM_TOKENS) for u in range(USERS)]
messages = [
    [tokens(int(rng.integers(MESSAGE_TOKENS[0], MESSAGE_TOKENS[1] + 1))) for _ in range(ROUNDS)] for _ in systems
]
final_lengths = [SYSTEM_TOKENS + sum(len(m) for m in ms) + ROUNDS * REPLY_TOKENS for ms in messages]
print(f"{USERS} users ({SHARED_USERS} share a {SYSTEM_TOKENS}-token system prompt), {ROUNDS} turns each")
print("final conversation lengths:", final_lengths, "tokens")

# %% [markdown]
# ## A cache too small for every conversation
#
# `hkv.CacheConfig` fixes every capacity up front. The pools hold the pages of the one running request
# plus pages for about `HISTORY_CAPACITY` of all the users' final conversations; `prefix_records`
# (cached block boundaries, one per `block_tokens` = 16 tokens) is sized the same way, and only
# `SNAPSHOT_SLOTS` sliding-window (SWA) + compressor-TAIL snapshots fit. So the engine must evict: the
# cheapest objects to rebuild first (snapshots), then whole leaf records.
#
# A restore is *complete* at a block boundary only with the SWA window and TAIL there; without them
# the engine either stops at an earlier boundary that has them, or restores the compressed entries and
# re-runs the last `layers x (window - 1)` tokens to rebuild the window (`window_recomputed` in the
# plan) — whichever its measured costs say is faster.

# %%
BLOCK = 16
max_context = -(-(max(final_lengths) + REPLY_TOKENS) // 64) * 64
base = hkv.CacheLayout(
    model.cache_spec(block_tokens=BLOCK), hkv.CacheConfig(slots=1, max_context=max_context, prefix_records=0)
)
history_tokens = sum(final_lengths) - (SHARED_USERS - 1) * SYSTEM_TOKENS  # distinct tokens of all histories
pool_pages = []
for g, group in enumerate(base.groups):
    if group.kind == hkv.ObjectKind.SWA:  # one snapshot's window spans up to 2 pages
        extra = 2 * SNAPSHOT_SLOTS
    else:  # rows of `group.unit` tokens, 16 rows a page
        extra = int(HISTORY_CAPACITY * history_tokens / group.unit / base.page_size) + 1
    pool_pages.append(base.pool_pages(g) + extra)
config = hkv.CacheConfig(
    slots=1,
    max_context=max_context,
    pool_pages=tuple(pool_pages),
    prefix_records=int(HISTORY_CAPACITY * history_tokens / BLOCK),
    tail_snapshots=SNAPSHOT_SLOTS,
)
print(config)
print(f"the histories have {history_tokens // BLOCK} distinct blocks; the prefix index holds {config.prefix_records}")

# %% [markdown]
# ## Two engines, one compilation
#
# `chat` is the engine under test. `cold` has the same configuration — so it shares `chat`'s compiled
# steps — and forgets every cached prefix before each request (`evict_prefixes`), giving the cold TTFT
# of the same prompt and the reference tokens. `warmup()` compiles every step up front and runs each
# once (the window rebuild's model step included: its first run costs several times a later one), and
# a short throw-away conversation on a scratch engine runs the remaining first-use paths, so no
# compilation or first run lands inside a measured turn.

# %%
settings = {"block_tokens": BLOCK, "prefill_chunk": 32, "seed": 0}
scratch = hkv.Engine(model, config, **settings)
seconds = scratch.warmup()
for prompt in ([5] * 70, [5] * 70 + [6] * 40, [5] * 40 + [7] * 60):  # a miss, then two hits
    scratch.generate([prompt], REPLY_TOKENS)
scratch.evict_prefixes()
scratch.generate([[5] * 70], REPLY_TOKENS)
chat = hkv.Engine(model, config, **settings)
cold = hkv.Engine(model, config, **settings)
print(f"compiled {len(seconds)} steps in {sum(seconds.values()):.1f} s:", ", ".join(sorted(seconds)))

# %% [markdown]
# ## The chat
#
# Users take turns round robin; each turn is one `generate` call. `g.plan` is the turn's `RestorePlan`:
#
# * `hash_hit_tokens` — what the chained block hash matched (what a naive "hash hit = reuse" cache would reuse);
# * `tokens_after_stage` — tokens surviving each validation stage: *lifecycle* (record alive, token ids
#   equal, pages not reused), *abi* (same weights, dtypes, layout), *intersection* (SWA window, TAIL and
#   indexer keys present at the boundary), *byte* (snapshot checksum);
# * `restored_tokens` — what was really restored; `reason` — an `hkv.Reason` saying why the plan stopped.
#
# After half the rounds the retention policy is switched from a snapshot at every block
# (`RetentionPolicy(every_n_blocks=1)`, the default) to `branch_points_only=True`: snapshots only where
# a request ends or a prompt diverges. Assigning `chat.retention` takes effect from the next step.

# %%
histories = [systems[u] + messages[u][0] for u in range(USERS)]
turns = []
SWITCH = ROUNDS // 2
for step in tqdm(range(ROUNDS * USERS), desc="chat turns"):
    rnd, user = divmod(step, USERS)
    if step == SWITCH * USERS:
        chat.retention = hkv.RetentionPolicy(branch_points_only=True)
    prompt = histories[user]
    before = chat.stats()["cache"]
    (g,) = chat.generate([prompt], REPLY_TOKENS)
    after = chat.stats()
    cold.evict_prefixes()  # the reference: the same prompt with nothing to reuse
    (c,) = cold.generate([prompt], REPLY_TOKENS)
    assert g.tokens == c.tokens, f"turn {step}: restored output {g.tokens} != cold output {c.tokens}"
    assert c.plan.restored_tokens == 0
    turns.append(
        {
            "turn": step,
            "user": user,
            "policy": "every block" if rnd < SWITCH else "branch points",
            "plan": g.plan,
            "warm_ttft": after["ttft_seconds"][-1],
            "cold_ttft": cold.stats()["ttft_seconds"][-1],
            "snapshots_taken": after["cache"]["snapshots_taken"] - before["snapshots_taken"],
            "snapshots_evicted": after["cache"]["evicted_swa_snapshots"] - before["evicted_swa_snapshots"],
            "records_evicted": after["cache"]["evicted_records"] - before["evicted_records"],
        }
    )
    if rnd + 1 < ROUNDS:
        histories[user] = prompt + g.tokens + messages[user][rnd + 1]
print(f"{len(turns)} turns: every warm turn produced exactly the cold run's tokens")

# %% [markdown]
# ## The plan of every turn
#
# One row per turn: the prompt length, the hash hit, the tokens left after each of the four stages,
# what was restored, the tokens re-run to rebuild a missing window, why the plan stopped, the snapshots
# the turn took (`snaps`), the snapshots and records it evicted (`-snap`, `-rec`), and the time to first
# token with the prefix cache (`warm`) and without (`cold`, see below). `no_hash_match` is not a rejection:
# the prompt simply goes on past what was ever cached (the new message). Other reasons show memory
# pressure: `swa_missing` / `tail_missing` (the snapshot at that boundary was evicted or never kept),
# `freed` (a record was evicted), `page_reused` (a page the record referenced now belongs to another
# sequence).

# %%
print(
    f"{'turn':>4} {'user':>4} {'prompt':>6} {'hash':>5} {'life':>5} {'abi':>5} {'inter':>5} {'byte':>5} "
    f"{'rest.':>5} {'rebuilt':>10} {'reason':<14} {'snaps':>5} {'-snap':>5} {'-rec':>5} {'warm':>6} {'cold':>6}  policy"
)
for t in turns:
    p = t["plan"]
    s = p.tokens_after_stage
    rebuilt = f"[{p.window_recomputed[0]},{p.window_recomputed[1]})" if p.window_recomputed else "-"
    print(
        f"{t['turn']:>4} {t['user']:>4} {p.prompt_tokens:>6} {p.hash_hit_tokens:>5} {s['lifecycle']:>5} "
        f"{s['abi']:>5} {s['intersection']:>5} {s['byte']:>5} {p.restored_tokens:>5} {rebuilt:>10} "
        f"{p.reason or '-':<14} {t['snapshots_taken']:>5} {t['snapshots_evicted']:>5} {t['records_evicted']:>5} "
        f"{t['warm_ttft'] * 1e3:>4.0f}ms {t['cold_ttft'] * 1e3:>4.0f}ms  {t['policy']}"
    )
shortened = [t for t in turns if t["plan"].reason not in (None, hkv.Reason.NO_HASH_MATCH)]
print(
    f"\n{len(shortened)} of {len(turns)} plans were cut by a validation stage: "
    + ", ".join(sorted({f"{t['plan'].reason} ({t['plan'].reason.stage})" for t in shortened}))
)
stats = chat.stats()["prefix"]
print(f"evictions: {stats['evictions']}")
assert sum(stats["evictions"].values()) > 0, "the cache was not under memory pressure"
assert shortened, "no plan was cut short: the pools are not small enough to show memory pressure"

# %% [markdown]
# ## Hash hit vs complete restoration
#
# The gap between the two bars is what a cache that trusts its hash would have got wrong: tokens whose
# key matched but whose state was no longer (completely) there. hkv restores only what it verified and
# computes the rest, so its output stays exact.

# %%
x = np.arange(len(turns))
hash_hit = np.array([t["plan"].hash_hit_tokens for t in turns])
restored = np.array([t["plan"].restored_tokens for t in turns])
prompt_len = np.array([t["plan"].prompt_tokens for t in turns])
fig, ax = plt.subplots(figsize=(11, 4))
ax.bar(x - 0.2, hash_hit, 0.4, label="hash hit")
ax.bar(x + 0.2, restored, 0.4, label="restored (all four stages passed)")
ax.plot(x, prompt_len, "k.", label="prompt length")
for i, t in enumerate(turns):
    if t["plan"].reason not in (None, hkv.Reason.NO_HASH_MATCH):
        ax.annotate(str(t["plan"].reason), (i, hash_hit[i]), rotation=60, fontsize=8, ha="left", va="bottom")
ax.axvline(SWITCH * USERS - 0.5, color="gray", ls="--")
ax.text(SWITCH * USERS - 0.4, prompt_len.max(), " retention: branch points only", va="top", color="gray")
ax.set(xlabel="turn", ylabel="tokens", title="Prefix cache per turn: hash hit vs complete restoration")
ax.set_xticks(x, [f"{t['turn']}\nu{t['user']}" for t in turns], fontsize=8)
ax.legend(loc="upper left")
plt.tight_layout()
plt.show()
print(
    f"restored {restored.sum()} of {hash_hit.sum()} hash-hit tokens ({restored.sum() / hash_hit.sum():.0%}); "
    f"engine counters: {stats['restored_tokens']} / {stats['hash_hit_tokens']}"
)
assert stats["restored_tokens"] == restored.sum() and stats["hash_hit_tokens"] == hash_hit.sum()

# %% [markdown]
# ## Warm vs cold time to first token
#
# TTFT is the engine's own measurement (`stats()["ttft_seconds"]`: from admission to the first token's
# logits). Warm: `chat` with its prefix cache; cold: the same prompt on `cold`, which recomputes it
# all. Warm TTFT also pays for the restore itself, any window rebuild and the evictions the turn
# triggers (choosing victims, recording the new blocks). A turn that restores nothing (`no_hash_match`)
# does the cold run's work plus a lookup of about a millisecond, so its two TTFTs differ by timing noise
# (either may come out ahead); every turn that restores a prefix should be faster warm — the last
# line below names any turn that was not. The gap grows with the prompt (run with
# `HKV_NOTEBOOK_SMALL=0` for longer conversations: 24 of 24 turns faster warm on a 2-core CPU).

# %%
warm_ms = np.array([t["warm_ttft"] for t in turns]) * 1e3
cold_ms = np.array([t["cold_ttft"] for t in turns]) * 1e3
fig, ax = plt.subplots(figsize=(8, 4))
ax.plot(prompt_len, cold_ms, "s", label="cold (no reuse)")
ax.plot(prompt_len, warm_ms, "o", label="warm (restored prefix)")
for i in range(len(turns)):
    ax.plot([prompt_len[i]] * 2, [warm_ms[i], cold_ms[i]], color="lightgray", zorder=0)
ax.set(xlabel="prompt length (tokens)", ylabel="TTFT (ms)", title="Time to first token, same prompts and tokens")
ax.legend()
plt.tight_layout()
plt.show()
reused = restored > 0
print(
    f"turns with a restored prefix: median warm TTFT {np.median(warm_ms[reused]):.0f} ms vs cold "
    f"{np.median(cold_ms[reused]):.0f} ms ({np.median(cold_ms[reused] / warm_ms[reused]):.1f}x)"
)
slower = [t["turn"] for t, w, c in zip(turns, warm_ms, cold_ms, strict=True) if w > c]
print(
    f"warm TTFT <= cold on {len(turns) - len(slower)} of {len(turns)} turns; slower on turns {slower} (restored",
    [int(restored[i]) for i in slower],
    "tokens)",
)

# %% [markdown]
# ## The retention policy, changed live
#
# With a snapshot at every block, each prefill chunk end takes one — and with only `SNAPSHOT_SLOTS`
# slots, almost every one evicts another. With `branch_points_only=True` the engine keeps snapshots
# only at request ends and divergence points: far fewer snapshots are taken (and evicted), while the
# restores that need a window at another boundary rebuild it (`window_recomputed`) or stop earlier.

# %%
for policy in ("every block", "branch points"):
    sel = [t for t in turns if t["policy"] == policy]
    rest = sum(t["plan"].restored_tokens for t in sel)
    hit = sum(t["plan"].hash_hit_tokens for t in sel)
    print(
        f"{policy:>14}: {len(sel)} turns, snapshots taken {np.mean([t['snapshots_taken'] for t in sel]):.1f}/turn, "
        f"evicted {np.mean([t['snapshots_evicted'] for t in sel]):.1f} snapshots and "
        f"{np.mean([t['records_evicted'] for t in sel]):.1f} records/turn, windows rebuilt in "
        f"{sum(t['plan'].window_recomputed is not None for t in sel)} turns, restored {rest}/{hit} hash-hit tokens"
    )
taken = {
    p: np.mean([t["snapshots_taken"] for t in turns if t["policy"] == p]) for p in ("every block", "branch points")
}
assert taken["branch points"] < taken["every block"], taken

# %% [markdown]
# ## The metrics an operator sees
#
# `metrics_text()` is a Prometheus text exposition: hash-hit vs restored tokens, rejections by stage and
# reason, records and snapshots held, evictions by kind, pages per pool.

# %%
metrics = chat.metrics_text()
print("\n".join(line for line in metrics.splitlines() if line.startswith(("hkv_prefix", "hkv_evictions"))))

# %% [markdown]
# Every turn's output equalled the cold run's token for token, however much of its prefix the cache
# still held: a hash hit is only a candidate, and the plan restores what passed every check.
#
# **Next:** `04_disk_tier` — evicted prefixes written to disk, verified and restored from there.
