"""What the prefix cache costs decode (issue 47 item 2): decode ms/token of the side-by-side small
DeepSeek-V4 (`workload.py`'s SMALL dimensions, random weights) with the default prefix cache against
the same engine with `prefix_records=0`, at 4K, 8K and 32K tokens of context.

    python benchmarks/prefix_decode.py [--contexts 4096,8192,32768] [--new 32] [--rounds 3] [--model tiny]

Per context: two one-slot engines with the default cache sizing (`CacheConfig(slots=1, max_context=...)`), the
side-by-side tuned block 64 and prefill chunk 512, one with the prefix cache and one without,
each compiled first (`warmup()`). Each round prefills a fresh random prompt of the context's length
on both engines, in alternating order, and decodes `--new` tokens, timing every step that only
decoded (`benchmarks/_sidebyside.hkv_request`'s rule: the median of step seconds / tokens). By the
second round the prefix engine holds the previous prompts' records and pages (a cache in use, not an
empty one). Prints per context and round the two medians and their ratio, and the median ratio; exits
1 if the two engines' tokens differ (the prefix cache must never change output).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import _machine  # benchmarks/_machine.py (the script's folder is on sys.path)
import numpy as np
from workload import (
    build_model,
)  # benchmarks/workload.py (the script's folder is on sys.path); sets decode_while_building

import hkv

BLOCK, CHUNK = 64, 512  # the side-by-side tuned engine's block and chunk


@dataclasses.dataclass(frozen=True)
class DecodeRun:
    """One request's decode on one engine: median ms/token over the steps that only decoded, tokens."""

    ms: float
    tokens: tuple[int, ...]


def decode(engine: hkv.Engine, prompt: list[int], new: int) -> DecodeRun:
    """Run `prompt` for `new` tokens, stepping by hand so each decode step is timed alone."""
    h = engine.submit(prompt, new)
    per_token = _machine.step_until_done(engine, h)
    ms = 1e3 * float(np.median(per_token)) if per_token else float("nan")  # nan: no step only decoded
    return DecodeRun(ms, tuple(h.result().tokens))


def engines(model, ctx: int, new: int) -> dict[str, hkv.Engine]:
    """{"prefix": default sizing with the prefix cache, "off": the same with prefix_records=0}, warm."""
    config = hkv.CacheConfig(slots=1, max_context=-(-(ctx + new) // BLOCK) * BLOCK)
    out = {}
    for name, cfg in (("prefix", config), ("off", dataclasses.replace(config, prefix_records=0))):
        t0 = time.perf_counter()
        e = hkv.Engine(model, cfg, block_tokens=BLOCK, prefill_chunk=CHUNK)
        e.warmup()
        print(f"  {name}: {e.layout.config} warm in {time.perf_counter() - t0:.0f} s", flush=True)
        out[name] = e
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (`argv`: the command line's arguments); 0 when every round's tokens are equal."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="4096,8192,32768", help="comma-separated context lengths")
    ap.add_argument("--new", type=int, default=32, help="tokens decoded per request")
    ap.add_argument("--rounds", type=int, default=3, help="requests per engine and context")
    ap.add_argument("--model", choices=("small", "tiny"), default="small", help="workload.py's models")
    args = ap.parse_args(argv)
    model = build_model(args.model)
    rng = np.random.default_rng(0)
    print(
        f"{args.model} DeepSeek-V4, block {BLOCK}, chunk {CHUNK}, {args.new} new tokens, load {os.getloadavg()[0]:.1f}"
    )
    ok, rows = True, []
    for ctx in [int(c) for c in args.contexts.split(",") if c]:
        print(f"context {ctx}:", flush=True)
        es = engines(model, ctx, args.new)
        ratios = []
        for r in range(args.rounds):
            prompt = rng.integers(0, model.cfg.vocab_size, ctx).tolist()
            order = ("prefix", "off") if r % 2 == 0 else ("off", "prefix")
            got = {name: decode(es[name], prompt, args.new) for name in order}
            same = got["prefix"].tokens == got["off"].tokens
            ok &= same
            ratios.append(got["prefix"].ms / got["off"].ms)
            print(
                f"  round {r}: prefix cache {got['prefix'].ms:.2f} ms/token, off {got['off'].ms:.2f}, "
                f"ratio {ratios[-1]:.3f}, tokens {'equal' if same else 'DIFFER'} (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
        rows.append((ctx, statistics.median(ratios)))
        del es
    print("\ncontext | decode with the prefix cache / without (median over rounds)")
    for ctx, ratio in rows:
        print(f"{ctx:>7} | {ratio:.3f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
