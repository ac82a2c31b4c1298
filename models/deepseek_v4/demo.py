"""`make demo`: generation with the built-in tiny DeepSeek-V4 through the hkv cache.

A tiny random DeepSeek-V4 (every layer type: sliding, CSA with lightning indexer, HCA) generates for a
batch of prompts of different lengths with `hkv.Engine` (chunked prefill, batched decode in an on-device
loop), then checks every token and logit against the stateless forward (no cache, O(T) per token).
A second conversation turn then restores the first turn's prefix from the cache (a verified
restoration plan) and is checked against the stateless forward too. Finally the device prefix cache
is evicted to the on-disk tier (a temporary directory) and a third turn restores its prefix from
disk, verified before use, and is checked the same way. Last, a sampled continuation is streamed
token by token (`Engine.submit`) and reproduced from its seed.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np

import hkv
from models.stateless import greedy_stateless

from . import init, tiny_config


def _checked_turn(engine: hkv.Engine, model, prompt: list[int], label: str):
    """One more conversation turn through the engine, checked token for token against the stateless forward."""
    t0 = time.perf_counter()
    (g,) = engine.generate([prompt], 8, return_logits=True)
    plan = g.plan
    print(
        f"{label} ({len(prompt)} tokens) in {time.perf_counter() - t0:.2f}s: hash hit {plan.hash_hit_tokens} "
        f"tokens, restored {plan.restored_tokens} after the four validation stages {plan.tokens_after_stage}"
        f"{f', {plan.disk_tokens} from disk' if plan.disk_tokens else ''}, recomputed {plan.recompute}"
    )
    (want,), _ = greedy_stateless(model, [prompt], 8)
    print(f"{label} tokens identical to the stateless forward = {g.tokens == want}")
    if g.tokens != want:
        raise SystemExit(f"{label}: the restored prefix changed the output")
    return g


def main() -> None:
    cfg = tiny_config()
    print(
        f"tiny DeepSeek-V4: {cfg.num_hidden_layers} layers {list(cfg.layer_types)}, window {cfg.sliding_window}, "
        f"CSA m={cfg.compress_rate_csa} (indexer {cfg.index_n_heads} heads, top-{cfg.index_topk}), "
        f"HCA m={cfg.compress_rate_hca}, hc_mult {cfg.hc_mult}"
    )
    model = init(cfg, seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (300, 37, 129)]
    new = 24
    base = hkv.CacheLayout(
        model.cache_spec(), hkv.CacheConfig(slots=2, max_context=512, page_size=16, prefix_records=0)
    )
    pools = tuple(3 * base.pool_pages(g) for g in range(len(base.groups)))  # room for cached prefixes
    store = tempfile.TemporaryDirectory(prefix="hkv-demo-store-")
    engine = hkv.Engine(
        model,
        hkv.CacheConfig(slots=2, max_context=512, page_size=16, pool_pages=pools, prefix_records=128),
        prefill_chunk=32,
        progress=lambda m: print("  " + m, flush=True),
        disk=hkv.DiskTier(store.name),
    )
    t0 = time.perf_counter()
    gens = engine.generate(prompts, new, return_logits=True)
    dt = time.perf_counter() - t0
    for p, g in zip(prompts, gens, strict=True):
        print(f"prompt of {len(p):>3} tokens -> {g.tokens}")
    st = engine.stats()
    print(
        f"hkv engine: {len(prompts)} prompts x {new} tokens in {dt:.1f}s, 2 slots; {st['prefill_steps']} prefill "
        f"chunks, {st['decode_steps']} batched decode steps ({st['decode_dispatches']} dispatches of the decode step, "
        f"{st['decode_via_prefill']} prefill steps while it was not built); "
        f"compilations {st['compilations']}"
    )
    mem = engine.memory_report()["allocated"]
    print("cache allocation (bytes): " + ", ".join(f"{k} {v:,}" for k, v in mem.items()))
    hkv.check_invariants(engine.layout, engine.cache)
    print("checking against the stateless forward (no cache: re-runs all positions for every token)...", flush=True)
    t0 = time.perf_counter()
    tokens, logits = greedy_stateless(model, prompts, new)
    exact = all(g.tokens == t for g, t in zip(gens, tokens, strict=True))
    err = max(float(np.abs(g.logits - lg).max()) for g, lg in zip(gens, logits, strict=True))
    print(
        f"stateless oracle took {time.perf_counter() - t0:.1f}s: tokens identical = {exact}, "
        f"max |logit diff| = {err:.2e}"
    )
    if not exact or err > 1e-4:
        raise SystemExit("cached generation disagrees with the stateless forward")
    # a second turn: the first conversation's history plus a new message reuses the cached prefix
    turn2 = prompts[0] + gens[0].tokens + rng.integers(2, cfg.vocab_size, 20).tolist()
    g2 = _checked_turn(engine, model, turn2, "second turn")
    # a third turn after the device forgot every cached prefix: it comes back from the disk tier
    n = engine.evict_prefixes()
    engine.flush_disk()
    print(f"evicted {n} cached prefix records from device memory to the disk tier")
    turn3 = turn2 + g2.tokens + rng.integers(2, cfg.vocab_size, 12).tolist()
    g3 = _checked_turn(engine, model, turn3, "third turn")
    if not g3.plan.disk_tokens:
        raise SystemExit("the third turn's prefix did not come from the disk tier")
    print(f"disk tier: {engine.disk.stats()['stored_bytes']:,} bytes stored")
    # sampling, streamed token by token as the engine produces them; the same seed reproduces it
    hot = hkv.SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    print(f"sampled continuation of prompt 1 ({hot}), streamed:\n  ", end="", flush=True)
    engine.progress = None  # keep the stream on one line
    handle = engine.submit(prompts[1], 16, sampling=hot, return_logits=True)  # the compiled steps above
    for token in handle:  # iterating drives the engine
        print(token, end=" ", flush=True)
    again = engine.generate([prompts[1]], 16, sampling=hot, return_logits=True)[0]
    same = again.tokens == handle.result().tokens
    print(f"\nsame seed, second run (its prefix now restored from the cache): identical tokens = {same}")
    if not same:
        raise SystemExit("seeded sampling is not reproducible")
    print("prefix metrics (Prometheus):")
    print("\n".join("  " + line for line in engine.metrics_text().splitlines() if not line.startswith("#"))[:1500])
    store.cleanup()


if __name__ == "__main__":
    main()
