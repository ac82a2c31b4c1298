"""Compile time against depth: DeepSeek-V4-shaped tiny models at 4 and 43 layers, layers unrolled vs scanned.

The configs keep V4's layer pattern (transformers' default: HCA bootstrap layers, then CSA/HCA
interleaved; hash-routed MoE on the first 3 layers) and its structure (hyper-connections, shared
K=V MQA, overlapping CSA compressor, a 16-head lightning indexer) at tiny widths, so that compile
time, not arithmetic, dominates. For each depth and each mode (`scan_layers=False`: the Python loop
over layers; `True`: repeating layers under `jax.lax.scan`, see `models.deepseek_v4.layer_scan`) it
prints the seconds of the first call (trace + compile + one run) of:

* `prefill`: the jitted `cached_step` on a chunk of 16 tokens for 2 slots,
* `decode`:  the jitted `cached_step` on one token for 2 slots,
* `forward`: the jitted stateless forward on [2, 32] tokens,

and the ratio 43 layers / 4 layers per mode. Each (depth, mode) runs in a fresh Python process, so
that no figure depends on what compiled before it in the same process (JAX's in-memory caches, the
allocator, a process grown by the loop's 43-layer programs); JAX's persistent compilation cache is turned off.
Per program it also prints where the first call went: trace + lower (Python: tracing the model,
emitting StableHLO) vs XLA compile. The model holds repeating layers' weights stacked
(`layer_scan.LayerStack`), so `scan` mode passes them to the scan as they are (no copy per call,
whatever the weights' size) and `loop` mode slices each layer out of its stack.

    python benchmarks/compile_depth.py                       # both depths, both modes (~15 min on 2 CPU cores)
    python benchmarks/compile_depth.py --depths 4 43 --modes scan
    python benchmarks/compile_depth.py --family gemma3          # Gemma 3 (5 sliding : 1 full) at 6 and 62 layers
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hkv.core import transitions as tr
from hkv.core.layout import CacheConfig, CacheLayout
from hkv.core.state import init_cache
from models.deepseek_v4.config import tiny_config
from models.deepseek_v4.layer_scan import layer_runs
from models.deepseek_v4.model import init


def v4_shaped(layers: int):
    """A tiny-width config with DeepSeek-V4's default layer and MoE pattern at `layers` layers."""
    return tiny_config(num_hidden_layers=layers, layer_types=(), mlp_layer_types=(), index_n_heads=16)


def build(family: str, layers: int):
    """A random model of `family` at `layers` layers, tiny widths: DeepSeek-V4's default pattern, or
    Gemma 3's 5 sliding : 1 full (Gemma-3-27B has 62 layers)."""
    if family == "gemma3":
        from models import gemma3

        return gemma3.init(gemma3.tiny_config(num_hidden_layers=layers), seed=0)
    return init(v4_shaped(layers), seed=0)


def first_call_seconds(fn, *args) -> tuple[float, float, float]:
    """(total, trace + lower, compile) seconds of the first call fn(*args) of a jitted fn: trace and
    lower, compile, run once (blocks on the result)."""
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - t0, t1 - t0, t2 - t1


def measure(layers: int, scan: bool, family: str = "deepseek_v4") -> dict[str, float]:
    """{"prefill" | "decode" | "forward": first-call seconds} for one depth and mode (in this process)."""
    model = build(family, layers)
    layout = CacheLayout(model.cache_spec(), CacheConfig(slots=2, max_context=128, page_size=16, prefix_records=0))
    graphdef, weights = nnx.split(model)

    def step(cache, weights, tokens, slots, n_valid):
        return nnx.merge(graphdef, weights).cached_step(layout, cache, tokens, slots, n_valid, scan_layers=scan)

    def forward(weights, tokens):
        return nnx.merge(graphdef, weights)(tokens, scan_layers=scan)

    cache = init_cache(layout)
    for _ in range(2):
        cache, _, _ = tr.claim_slot(layout, cache)
    rng = np.random.default_rng(0)
    slots = jnp.array([0, 1], jnp.int32)
    chunk = jnp.asarray(rng.integers(0, model.cfg.vocab_size, (2, 16)), jnp.int32)
    one = chunk[:, :1]
    parts = {}
    parts["prefill"] = first_call_seconds(jax.jit(step), cache, weights, chunk, slots, jnp.array([16, 16], jnp.int32))
    parts["decode"] = first_call_seconds(jax.jit(step), cache, weights, one, slots, jnp.array([1, 1], jnp.int32))
    parts["forward"] = first_call_seconds(jax.jit(forward), weights, jnp.concatenate([chunk, chunk], axis=1))
    runs = layer_runs(model, scan, layout.spec)
    traced = sum(r.period for _, r in runs)
    print(f"layers={layers:3d} mode={'scan' if scan else 'loop'}  traced layer bodies={traced:3d}  "
          + "  ".join(f"{k} {v[0]:7.2f} s" for k, v in parts.items())
          + "   (trace+lower / compile: " + "  ".join(f"{k} {v[1]:.1f}/{v[2]:.1f}" for k, v in parts.items()) + ")",
          flush=True)  # fmt: skip
    return {k: v[0] for k, v in parts.items()}


def measure_fresh(layers: int, mode: str, family: str) -> dict[str, float]:
    """`measure` in a fresh Python process (prints its line; returns its figures)."""
    cmd = [sys.executable, __file__, "--one", str(layers), mode, "--family", family]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    lines = out.splitlines()
    for line in lines[:-1]:
        print(line, flush=True)
    return json.loads(lines[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=["deepseek_v4", "gemma3"], default="deepseek_v4")
    ap.add_argument("--depths", type=int, nargs="+", help="default: 4 43 (DeepSeek-V4), 6 62 (Gemma 3)")
    ap.add_argument("--modes", nargs="+", choices=["loop", "scan"], default=["loop", "scan"])
    ap.add_argument("--one", nargs=2, metavar=("DEPTH", "MODE"), help=argparse.SUPPRESS)  # a child process
    args = ap.parse_args(argv)
    if args.one:
        jax.config.update("jax_enable_compilation_cache", False)
        print(json.dumps(measure(int(args.one[0]), args.one[1] == "scan", args.family)))
        return
    args.depths = args.depths or ([6, 62] if args.family == "gemma3" else [4, 43])
    print(
        f"{args.family}, jax {jax.__version__}, backend {jax.default_backend()}, {jax.devices()[0].device_kind}",
        flush=True,
    )
    results = {}
    for mode in args.modes:
        for depth in args.depths:
            results[mode, depth] = measure_fresh(depth, mode, args.family)
    lo, hi = min(args.depths), max(args.depths)
    if lo != hi:
        for mode in args.modes:
            ratios = "  ".join(f"{k} {results[mode, hi][k] / results[mode, lo][k]:5.2f}x" for k in results[mode, hi])
            print(f"ratio {hi}/{lo} layers, {mode}: {ratios}")


if __name__ == "__main__":
    main()
