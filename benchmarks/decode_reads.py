"""What a decode step reads: a short conversation in a large cache (issue 48 item 1, "decode that
costs what it reads").

    python benchmarks/decode_reads.py [--prompt 1000] [--new 33] [--caches 4096:1,16384:1,16384:8]

The issue-48 small Gemma 3 (`e2e_gemma3.SMALL`, float32 random weights). For each cache
(`max_context:slots`), two engines with the default sizing (`CacheConfig(slots=, max_context=,
prefix_records=0)`), each compiled first (`warmup()`): one with the default read sizes
(`read_buckets`: prefill and decode read the rows of the tokens held, rounded up to a power of two)
and one with `read_buckets=()` (every step reads `max_context`'s rows: what decode did before read
sizes reached it). Each runs the same `--prompt`-token request for `--new` tokens, alternating, three
rounds; prints the median decode ms/token of each (the steps that only decoded, as `e2e.py` times
them) and their ratio, and exits 1 if the two engines' tokens differ (a read bound must never change
output).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import _machine  # benchmarks/_machine.py (the script's folder is on sys.path)
import jax.numpy as jnp
import numpy as np
from e2e_gemma3 import SMALL

import hkv
from models import gemma3

T0 = time.perf_counter()


def decode_ms(engine: hkv.Engine, prompt: list[int], new: int) -> tuple[float, tuple[int, ...]]:
    """(median ms/token of the steps that only decoded, the tokens) of one request."""
    h = engine.submit(prompt, new)
    per_token = _machine.step_until_done(engine, h)
    return 1e3 * float(np.median(per_token)), tuple(h.result().tokens)


def caches(text: str) -> list[tuple[int, int]]:
    """'4096:1,16384:8' -> [(4096, 1), (16384, 8)] (max_context, slots)."""
    out = []
    for part in text.split(","):
        ctx, _, slots = part.partition(":")
        out.append((int(ctx), int(slots or 1)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=1000, help="prompt tokens (default 1000)")
    ap.add_argument("--new", type=int, default=33, help="new tokens per request (default 33)")
    ap.add_argument("--caches", type=caches, default=caches("4096:1,16384:1,16384:8"),
                    help="max_context:slots pairs (default 4096:1,16384:1,16384:8)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    for ctx, slots in args.caches:
        if not (slots >= 1 and args.prompt + args.new <= ctx):
            ap.error(f"cache {ctx}:{slots} must hold --prompt + --new = {args.prompt + args.new} tokens in >= 1 slot")
    print(f"hkv at {_machine.hkv_revision()}, {_machine.cores()} cores; small Gemma 3, float32, prompt "
          f"{args.prompt}, {args.new} new tokens, {args.rounds} rounds\n")  # fmt: skip
    print("| max_context | slots | read sizes | decode ms/token | read_buckets=() ms/token | x |")
    print("|---|---|---|---|---|---|")
    model = gemma3.init(gemma3.tiny_config(**SMALL), 0, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    same = True
    for ctx, slots in args.caches:
        config = hkv.CacheConfig(slots=slots, max_context=ctx, prefix_records=0)
        bounded, full = (hkv.Engine(model, config, compilation_cache=False, **kw) for kw in ({}, {"read_buckets": ()}))
        for e in (bounded, full):
            e.warmup()
        times: dict[str, list[float]] = {"bounded": [], "full": []}
        for r in range(args.rounds):
            prompt = [int(t) for t in rng.integers(1, SMALL["vocab_size"], args.prompt)]
            order = (("bounded", bounded), ("full", full)) if r % 2 == 0 else (("full", full), ("bounded", bounded))
            toks = {}
            for name, e in order:
                ms, toks[name] = decode_ms(e, prompt, args.new)
                times[name].append(ms)
            same = same and toks["bounded"] == toks["full"]
        b, f = statistics.median(times["bounded"]), statistics.median(times["full"])
        print(f"| {ctx} | {slots} | {bounded.read_sizes} | {b:.1f} | {f:.1f} | {f / b:.1f} |", flush=True)
    print(f"\ntokens equal: {same} ({time.perf_counter() - T0:.0f} s)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
