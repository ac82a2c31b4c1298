"""hkv's cold prefill of the small DeepSeek-V4 against this machine's matmul floor, measured in one run
(issue 45, item 6: within 2x of the floor).

    python benchmarks/roofline.py                       # 8K, 3 cold prompts (~6 min on 2 cores)
    python benchmarks/roofline.py --context 1024 --rounds 1 --json

1. **FLOPs**: `models.deepseek_v4.flops.prefill_flops`, the arithmetic the prefill cannot avoid, read off
   the model (every token through each linear weight once and its top-k experts, attention over the
   keys each query attends, the CSA indexer over every compressed entry).
2. **This machine's matmul throughput** at the model's own shapes, float32 as the model runs: each
   distinct weight product at a prefill chunk's rows (a routed expert at its share of them: chunk x
   top-k / experts), attention's batched products (heads x chunk x head_dim against a 512-key tile) and
   the indexer's (chunk x index heads rows against 512 entries); best of `--repeats`.
3. **The floor**: each kind's FLOPs at the throughput of its own shapes, summed.
4. **hkv**: `e2e.py`'s tuned engine (block 64, chunk 512, `warmup()` first) on the same model shapes
   (random weights: the FLOPs and the programs do not depend on the values), the cold TTFT of
   `--rounds` random prompts of `--context` tokens, median.

Prints the FLOPs by kind, the throughputs, the floor, hkv's time and hkv / floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import _machine  # benchmarks/_machine.py
import _sidebyside as sbs  # the tuned engine of e2e.py
import jax
import jax.numpy as jnp
import numpy as np

from models.deepseek_v4 import init, tiny_config
from models.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING
from models.deepseek_v4.flops import PrefillFlops, WeightProduct, prefill_flops, weight_products

# e2e.py's model (its HF_CONFIG) in hkv's names
SMALL = dict(
    vocab_size=4096, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=8, num_attention_heads=8,
    head_dim=64, q_lora_rank=128, num_experts_per_tok=2, n_routed_experts=8,
    layer_types=(SLIDING, CSA, HCA, CSA, HCA, CSA, HCA, CSA), compress_rate_csa=4, compress_rate_hca=128,
    hc_mult=2, sliding_window=128, o_groups=2, o_lora_rank=64, index_n_heads=16, index_head_dim=32,
    index_topk=128, max_position_embeddings=65536, mlp_layer_types=(HASH_MOE,) + (MOE,) * 7,
)  # fmt: skip
KEY_TILE = 512  # keys per attention / indexer product measured


@dataclasses.dataclass(frozen=True)
class Rate:
    """A float32 product measured on this machine: [batch, rows, k] x [batch, k, n], GFLOP/s."""

    batch: int
    rows: int
    k: int
    n: int
    gflops: float


def measure(batch: int, rows: int, k: int, n: int, repeats: int) -> Rate:
    """GFLOP/s of one jitted float32 product [batch, rows, k] x [batch, k, n] (best of `repeats`,
    each timing enough calls for ~20 ms)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((batch, rows, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((batch, k, n)), jnp.float32)
    fn = jax.jit(lambda x, w: jnp.einsum("brk,bkn->brn", x, w))
    fn(x, w).block_until_ready()
    t = time.perf_counter()
    fn(x, w).block_until_ready()
    calls = max(1, int(0.02 / max(time.perf_counter() - t, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            out = fn(x, w)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - t) / calls)
    return Rate(batch, rows, k, n, 2 * batch * rows * k * n / best / 1e9)


def floor_seconds(model, flops: PrefillFlops, chunk: int, repeats: int) -> tuple[float, dict]:
    """The prefill's matmul floor: each kind's FLOPs at the measured throughput of its own shapes.
    Returns (seconds, {"weights": [...], "attention": Rate, "indexer": Rate, per-kind seconds})."""
    cfg = model.cfg
    products: list[WeightProduct] = [p for p in weight_products(model) if p.rows_per_token > 0]
    rates: dict[tuple[int, int, int], Rate] = {}
    seconds_weights = 0.0
    for p in products:
        rows = max(1, round(chunk * p.rows_per_token))
        key = (rows, p.k_in, p.n_out)
        if key not in rates:
            rates[key] = measure(1, rows, p.k_in, p.n_out, repeats)
        seconds_weights += 2 * flops.tokens * p.macs_per_token / (rates[key].gflops * 1e9)
    head_flops = flops.weights - 2 * flops.tokens * sum(p.macs_per_token for p in products)
    seconds_weights += head_flops / (max(r.gflops for r in rates.values()) * 1e9)
    attention = measure(cfg.num_attention_heads, chunk, cfg.head_dim, KEY_TILE, repeats)
    indexer = measure(1, chunk * cfg.index_n_heads, cfg.index_head_dim, KEY_TILE, repeats)
    parts = {
        "weights": seconds_weights,
        "attention": flops.attention / (attention.gflops * 1e9),
        "indexer": flops.indexer / (indexer.gflops * 1e9),
    }
    detail = {"weight_rates": list(rates.values()), "attention_rate": attention, "indexer_rate": indexer, **parts}
    return sum(parts.values()), detail


def hkv_cold_prefill(model, context: int, rounds: int, seed: int) -> list[float]:
    """The tuned engine's cold TTFT (seconds) of `rounds` random prompts of `context` tokens."""
    engine, _ = sbs.hkv_engine(model, sbs.tuned_config(model, context + 8), "roofline", **sbs.tuned_engine_options())
    rng = np.random.default_rng(seed)
    out = []
    for r in range(rounds):
        prompt = rng.integers(0, model.cfg.vocab_size, context).tolist()
        out.append(sbs.hkv_request(engine, prompt, 1)["ttft"])
        sbs.log(f"  round {r + 1}: cold TTFT {out[-1]:.2f} s")
    engine.close()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="timings per product shape (best kept)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    model = init(tiny_config(**SMALL), seed=args.seed)
    flops = prefill_flops(model, args.context)
    floor, detail = floor_seconds(model, flops, sbs.CHUNK, args.repeats)
    times = hkv_cold_prefill(model, args.context, args.rounds, args.seed)
    hkv_s = float(np.median(times))
    result = {
        "machine": f"{_machine.cores()} cores, jax {jax.__version__}, hkv {_machine.hkv_revision()}",
        "context": args.context,
        "gflop": {"weights": flops.weights / 1e9, "attention": flops.attention / 1e9, "indexer": flops.indexer / 1e9},
        "floor_seconds": {k: detail[k] for k in ("weights", "attention", "indexer")} | {"total": floor},
        "rates_gflops": {
            "weights": [f"{r.rows}x{r.k}x{r.n}: {r.gflops:.0f}" for r in detail["weight_rates"]],
            "attention": round(detail["attention_rate"].gflops, 1),
            "indexer": round(detail["indexer_rate"].gflops, 1),
        },
        "hkv_seconds": times,
        "hkv_over_floor": hkv_s / floor,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return result
    print(f"machine: {result['machine']}; small DeepSeek-V4 (e2e.py's shapes), {args.context} tokens cold\n")
    print("| kind | GFLOP | throughput at its shapes (GFLOP/s) | floor |")
    print("|---|---|---|---|")
    w = [r.gflops for r in detail["weight_rates"]]
    rates = f"{min(w):.0f}-{max(w):.0f} ({len(w)} shapes)"
    print(f"| weights | {flops.weights / 1e9:.1f} | {rates} | {detail['weights']:.2f} s |")
    for kind in ("attention", "indexer"):
        r = detail[f"{kind}_rate"]
        shape = f"[{r.batch}, {r.rows}, {r.k}] x [{r.k}, {r.n}]"
        print(f"| {kind} | {getattr(flops, kind) / 1e9:.1f} | {r.gflops:.0f} ({shape}) | {detail[kind]:.2f} s |")
    print(f"| **total** | **{flops.total / 1e9:.1f}** | | **{floor:.2f} s** |")
    print(f"\nhkv cold TTFT: {hkv_s:.2f} s (rounds {', '.join(f'{t:.2f}' for t in times)}) = "
          f"**{hkv_s / floor:.1f}x the floor** (target <= 2x)")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
