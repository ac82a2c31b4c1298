"""The FP8 KV cache (`hkv.KVQuant`, issue 47 item 3): bytes per token on every tier for DeepSeek-V4-Flash,
and its accuracy against the bf16 cache on the side-by-side small DeepSeek-V4.

    python benchmarks/fp8_kv.py --bytes-only        # the table (instant, nothing allocated)
    python benchmarks/fp8_kv.py [--contexts 8192,16384,32768] [--new 64] [--no-f32]
                                                    # + accuracy (8K: ~12 min, 16K ~35 min here)

Bytes: DeepSeek-V4-Flash's `CacheSpec` (bf16, 64-token blocks and pages) with and without
`kv_quant="fp8_e4m3"` (tile 64, the 64 rotary values of each row kept in bf16), per token of context:
the architectural minimum and what hkv allocates on device (shapes only), and what one stored block
costs the host and disk tiers (`hkv.engine.offload.expected_objects`: the block's COMPRESSED / INDEXER
rows, the objects a manifest lists, averaged over one window of the largest compression ratio; the window
snapshot a block may add is per sequence, not per token).

Accuracy: the small DeepSeek-V4 (`workload.py`'s SMALL, random weights) built three times from the same
weights: bfloat16 with the bf16 cache, bfloat16 with the FP8 cache (`kv_quant_tile=32`: its K=V rows
have 32 values besides the rope ones), and float32 (model and cache: the calibration, how far bf16
itself is from exact). Per context, one random prompt of that length; each engine decodes `--new` greedy
tokens with their logits. Per pair: the first position where the greedy tokens differ, the share of
positions equal, and over the positions up to the first difference (same inputs on both) the largest
|logit difference|, the same relative to the reference logits' standard deviation, and the share of
steps whose reference top-1 margin is below that step's error (where a flip could happen). Random
weights give flat logits (small margins), so token agreement here is a pessimistic bound. Beside them,
each engine's median decode ms per token (steps timed one by one; compare them only from a run with
nothing else on the machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import _machine  # benchmarks/_machine.py (the script's folder is on sys.path)
import jax.numpy as jnp
import numpy as np
from workload import SMALL  # benchmarks/workload.py

import hkv
from hkv.core.memory import KINDS, allocated_bytes
from hkv.engine.offload import expected_objects
from models import deepseek_v4
from models.deepseek_v4 import flash_config
from models.deepseek_v4.cache_spec import cache_spec

BLOCK, CHUNK = 64, 512


@dataclasses.dataclass(frozen=True)
class TierBytes:
    """Bytes per token of context of one cache format at one context length."""

    minimum: dict[str, float]  # per object kind and "total"
    device: float  # what `init_cache` allocates for one sequence of that context, per token
    tier_block: float  # one stored block's objects (host and disk tiers), per token of the block


def flash_spec(kv_quant: str | None) -> hkv.CacheSpec:
    """DeepSeek-V4-Flash's spec, bf16, 64-token blocks; `kv_quant` None or "fp8_e4m3"."""
    return cache_spec(flash_config(kv_quant=kv_quant), dtype="bfloat16", block_tokens=BLOCK, model_id="v4-flash")


def tier_bytes(spec: hkv.CacheSpec, context: int) -> TierBytes:
    """Bytes per token of `spec` at `context` tokens (shapes only: nothing is allocated)."""
    layout = hkv.CacheLayout(spec, hkv.CacheConfig(slots=1, max_context=context, page_size=BLOCK, prefix_records=0))
    minimum = {k: v / context for k, v in hkv.architectural_minimum(spec, context).items()}
    # blocks differ by where the compressors' windows close: average over one period of the largest ratio
    period = max(1, max(g.unit for g in layout.groups) // spec.block_tokens)
    ends = [context - i * spec.block_tokens for i in range(period)]
    stored = sum(
        int(np.prod(shape)) * dt.itemsize for e in ends for dt, shape in expected_objects(layout, e, False).values()
    )
    return TierBytes(minimum, allocated_bytes(layout)["total"] / context, stored / (period * spec.block_tokens))


def bytes_table(contexts: list[int]) -> list[str]:
    """The markdown rows of the bytes table (bf16 vs FP8 at each context)."""
    rows = [
        "| context | cache | SWA | COMPRESSED | INDEXER | TAIL | minimum | device (allocated) "
        "| host / disk (per block) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n in contexts:
        for name, q in (("bf16", None), ("fp8_e4m3", "fp8_e4m3")):
            b = tier_bytes(flash_spec(q), n)
            kinds = " | ".join(f"{b.minimum[k]:,.0f}" for k in KINDS)
            rows.append(
                f"| {label(n)} | {name} | {kinds} | **{b.minimum['total']:,.0f}** | {b.device:,.0f} "
                f"| {b.tier_block:,.0f} |"
            )
    return rows


@dataclasses.dataclass(frozen=True)
class Agreement:
    """FP8 against bf16 over one prompt's greedy continuation."""

    first_diff: int | None  # first new-token index where the tokens differ (None: all equal)
    equal_share: float
    max_abs: float  # over the steps before first_diff
    rel_std: float  # max_abs / the bf16 logits' std
    risky_share: float  # steps whose bf16 top-1 margin < that step's |error| max


def agreement(ref_tokens, ref_logits, tokens, logits) -> Agreement:
    """Compare a continuation against the bf16 one (tokens lists, logits float32[n, vocab])."""
    ref_logits, logits = np.asarray(ref_logits, np.float64), np.asarray(logits, np.float64)
    diff = [i for i, (a, b) in enumerate(zip(ref_tokens, tokens, strict=True)) if a != b]
    first = diff[0] if diff else None
    same = slice(0, len(tokens) if first is None else first + 1)  # the first differing step saw the same inputs
    err = np.abs(ref_logits[same] - logits[same]).max(axis=1)
    top2 = np.sort(ref_logits[same], axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    return Agreement(
        first_diff=first,
        equal_share=1 - len(diff) / len(tokens),
        max_abs=float(err.max()),
        rel_std=float(err.max() / ref_logits[same].std()),
        risky_share=float(np.mean(margin < err)),
    )


@dataclasses.dataclass(frozen=True)
class Continuation:
    """One engine's greedy continuation of a prompt."""

    tokens: list[int]
    logits: np.ndarray  # float32[new, vocab]
    seconds: float  # the whole request (after `warmup()`)
    decode_ms: float  # median ms per token of the steps that only decoded (nan: none)


def continuation(model, prompt: list[int], new: int) -> Continuation:
    """`prompt`'s greedy continuation on a fresh one-slot engine, its decode steps timed one by one."""
    ctx = -(-(len(prompt) + new) // BLOCK) * BLOCK
    engine = hkv.Engine(model, hkv.CacheConfig(slots=1, max_context=ctx, prefix_records=0), block_tokens=BLOCK,
                        prefill_chunk=CHUNK)  # fmt: skip
    engine.warmup()  # compiled first: the steps below are timed alone
    t0 = time.perf_counter()
    h = engine.submit(prompt, new, return_logits=True)
    per_token = _machine.step_until_done(engine, h)
    dt = time.perf_counter() - t0
    g = h.result()
    engine.close()
    ms = 1e3 * float(np.median(per_token)) if per_token else float("nan")
    return Continuation(list(g.tokens), np.asarray(g.logits), dt, ms)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="8192,16384,32768", help="prompt lengths, comma-separated")
    ap.add_argument("--new", type=int, default=64, help="greedy tokens per prompt (>= 1)")
    ap.add_argument("--bytes-only", action="store_true", help="print the bytes table and stop")
    ap.add_argument("--no-f32", action="store_true", help="skip the float32 calibration engine (long contexts)")
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    if args.new < 1 or not contexts or min(contexts) < 1:
        ap.error(f"--new={args.new} must be >= 1 and --contexts={args.contexts!r} positive integers")
    print(f"# hkv {_machine.hkv_revision()}, {_machine.cores()} cores")
    print("\nDeepSeek-V4-Flash, bytes per token of context (bf16 values, 64-token blocks and pages):\n")
    print("\n".join(bytes_table([128 * 1024, 1024 * 1024])))
    if args.bytes_only:
        return
    cfg = dict(SMALL, max_position_embeddings=max(65536, max(contexts) + args.new))
    fp8 = dict(kv_quant="fp8_e4m3", kv_quant_tile=32)
    models = {  # the same weights (init draws them from the shapes, which kv_quant does not change)
        "bf16": deepseek_v4.init(deepseek_v4.DeepseekV4Config(**cfg), seed=0, dtype=jnp.bfloat16),
        "fp8": deepseek_v4.init(deepseek_v4.DeepseekV4Config(**cfg, **fp8), seed=0, dtype=jnp.bfloat16),
    }
    if not args.no_f32:
        models["f32"] = deepseek_v4.init(deepseek_v4.DeepseekV4Config(**cfg), seed=0)
    print(f"\nSmall DeepSeek-V4 (random weights), {args.new} greedy tokens; 'a vs b': b's continuation against a's")
    print("(bf16 and fp8: bfloat16 model; f32: float32 model and cache, the calibration of bf16's own error):\n")
    print("| context | pair | first differing token | tokens equal | max abs logit error | / logit std "
          "| steps with margin < error | decode ms/token (a / b) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for n in contexts:
        prompt = rng.integers(0, SMALL["vocab_size"], n).tolist()
        runs = {}
        for name, model in models.items():
            runs[name] = continuation(model, prompt, args.new)
            log(f"{n}: {name} in {runs[name].seconds:.1f} s, decode {runs[name].decode_ms:.2f} ms/token")
        for ref, got in (("bf16", "fp8"), ("f32", "bf16"), ("f32", "fp8"))[: 1 if args.no_f32 else 3]:
            a = agreement(runs[ref].tokens, runs[ref].logits, runs[got].tokens, runs[got].logits)
            first = "none" if a.first_diff is None else str(a.first_diff)
            print(f"| {label(n)} | {ref} vs {got} | {first} | {a.equal_share:.1%} | {a.max_abs:.4f} | "
                  f"{a.rel_std:.4f} | {a.risky_share:.1%} | {runs[ref].decode_ms:.2f} / {runs[got].decode_ms:.2f} |",
                  flush=True)  # fmt: skip


def label(n: int) -> str:
    """A context length as the tables write it: 8K, or 300."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
