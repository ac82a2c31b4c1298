"""bfloat16 pools on CPU: held as uint16 bit patterns (`CacheLayout.pool_bits`, the CPU default) against
held as bfloat16 (the GPU / TPU layout), ratios measured in one run.

    python benchmarks/bf16_pools.py                   # small Gemma 3 and DeepSeek-V4, pools for 8 x 16K tokens
    python benchmarks/bf16_pools.py --slots 2 --max-context 4096 --rounds 1

XLA:CPU widens a bfloat16 array to float32 around every in-place write into it, so each row a step writes
into a bfloat16 pool converts the whole pool; uint16 pools are written in place. Per model (the small
models of `benchmarks/numerics_cost.py`, random weights, bfloat16) and layout, one engine
(`Engine(CacheConfig(slots, max_context), block_tokens=64, prefill_chunk=512)`, one untimed request of
the same shape first to compile, the prefix cache emptied before each request): cold time to first
token of a --prompt-tokens prompt and decode ms/token (`decode_steps=8` dispatches of one request, the
median over --new tokens), the best of --rounds
rounds alternated between the layouts; tokens must be equal (the bits are the same by construction).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _engine(model, pool_bits: bool, args):
    import hkv
    from hkv.core import layout

    default = layout.default_pool_bits
    layout.default_pool_bits = lambda: pool_bits  # the layout the engine builds
    try:
        engine = hkv.Engine(
            model, hkv.CacheConfig(slots=args.slots, max_context=args.max_context), block_tokens=64, prefill_chunk=512
        )
    finally:
        layout.default_pool_bits = default
    assert engine.layout.pool_bits is pool_bits
    engine.decode_while_building = False
    return engine


def _measure(engine, prompt, new: int) -> tuple[float, float, list[int]]:
    """(cold TTFT s, decode ms/token, tokens) of one request with the prefix cache emptied first."""
    engine.evict_prefixes()
    t0 = time.perf_counter()
    handle = engine.submit(prompt, new)
    while not handle.tokens:
        engine.step()
    ttft = time.perf_counter() - t0
    per_token = []
    while not handle.done:
        before, t1 = len(handle.tokens), time.perf_counter()
        engine.step()
        if len(handle.tokens) > before:
            per_token.append((time.perf_counter() - t1) / (len(handle.tokens) - before))
    return ttft, 1e3 * sorted(per_token)[len(per_token) // 2], list(handle.result().tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=16384)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--models", default="gemma3,deepseek_v4")
    args = ap.parse_args(argv)

    import jax.numpy as jnp
    import numpy as np
    from numerics_cost import gemma_model, v4_model

    builders = {"gemma3": gemma_model, "deepseek_v4": v4_model}
    print(f"pools for {args.slots} slots x {args.max_context} tokens; prompt {args.prompt_tokens} tokens; "
          f"best of {args.rounds} alternated rounds", flush=True)  # fmt: skip
    print("| model | pools | cold TTFT (s) | decode (ms/token) | tokens |\n|---|---|---|---|---|")
    failed = False
    for name in args.models.split(","):
        model = builders[name](jnp.bfloat16)
        prompt = np.random.default_rng(0).integers(0, model.vocab_size, args.prompt_tokens).tolist()
        engines = {bits: _engine(model, bits, args) for bits in (True, False)}
        for bits, engine in engines.items():  # compiles what the request needs (warmup() runs every bucket:
            t0 = time.perf_counter()  # minutes with bfloat16 pools)
            _measure(engine, prompt, args.new)
            print(f"  {name}, {'uint16' if bits else 'bfloat16'} pools: first request (compiles) "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
        best = {bits: [float("inf"), float("inf")] for bits in engines}
        toks = {}
        for _ in range(args.rounds):
            for bits, engine in engines.items():
                ttft, dec, toks[bits] = _measure(engine, prompt, args.new)
                print(f"  {name}, {'uint16' if bits else 'bfloat16'} pools: {ttft:.2f} s, {dec:.2f} ms/token",
                      file=sys.stderr, flush=True)  # fmt: skip
                best[bits] = [min(best[bits][0], ttft), min(best[bits][1], dec)]
        same = toks[True] == toks[False]
        failed |= not same
        for bits in (True, False):
            label = "uint16 bit patterns" if bits else "bfloat16"
            print(f"| {name} | {label} | {best[bits][0]:.2f} | {best[bits][1]:.2f} | {'equal' if same else 'DIFFER'} |")
        print(f"| {name} | bfloat16 / uint16 | **{best[False][0] / best[True][0]:.1f}x** | "
              f"**{best[False][1] / best[True][1]:.1f}x** | |", flush=True)  # fmt: skip
        del engines
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
