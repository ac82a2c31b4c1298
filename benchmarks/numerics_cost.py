"""What the numerical contract costs: the same measurements on this tree and on a baseline revision
(before the contract), alternated in fresh processes, ratios printed in one run.

    python benchmarks/numerics_cost.py                      # 1K and 8K prefill, decode batch 1 and 8 (8K prompts: long)
    python benchmarks/numerics_cost.py --quick              # 1K prefill, decode at 1K context (~10 min per model)
    python benchmarks/numerics_cost.py --baseline 3c21334 --rounds 3

Models (random weights, float32 unless --dtype): the small DeepSeek-V4 of `benchmarks/e2e.py` (8
layers, hidden 256, 8 heads x 64, window 128, CSA m=4 / HCA m=128, indexer 16 x 32 top-k 128, 8
experts top-2) and a small Gemma 3 (8 layers, 5 sliding : 1 full, window 128, hidden 256, 8 query / 2
KV heads of 64). Per model, in a fresh process per (tree, round):

* prefill: cold time to first token of an L-token prompt (`Engine(block_tokens=64, prefill_chunk=512)`,
  one slot, `warmup()` first, the prefix cache emptied before each request), L in --contexts;
* decode: ms per token of `decode_steps=8` dispatches at batch 1 and 8 (prompts of --decode-context
  tokens prefilled together, 48 new tokens; the median over the steps that only decoded).

The baseline tree is a `git worktree` of --baseline (default: the commit before the contract) in a
temporary folder; both trees run this file's worker code with their own `hkv` and `models` (the
engine API it uses is the same in both). Each figure is the best of --rounds rounds; a ratio above 1
means the contract costs time. The contract's own check (tokens equal) is printed per model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = "3c21334"  # the last commit before the numerical contract


def v4_model(dtype):
    from models import deepseek_v4

    sl, csa, hca = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
    cfg = deepseek_v4.tiny_config(
        vocab_size=4096, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=8, num_attention_heads=8,
        head_dim=64, q_lora_rank=128, qk_rope_head_dim=32, num_experts_per_tok=2, n_routed_experts=8,
        layer_types=(sl, csa, hca, csa, hca, csa, hca, csa), mlp_layer_types=("hash_moe",) + ("moe",) * 7,
        compress_rate_csa=4, compress_rate_hca=128, hc_mult=2, sliding_window=128, o_groups=2, o_lora_rank=64,
        index_n_heads=16, index_head_dim=32, index_topk=128, max_position_embeddings=65536,
    )  # fmt: skip
    return deepseek_v4.init(cfg, seed=0, dtype=dtype)


def gemma_model(dtype):
    from models import gemma3

    cfg = gemma3.tiny_config(
        num_hidden_layers=8, hidden_size=256, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, sliding_window=128, vocab_size=4096, max_position_embeddings=65536,
    )  # fmt: skip
    return gemma3.init(cfg, seed=0, dtype=dtype)


def worker(args) -> dict:
    """Runs inside one tree: prefill and decode figures of one model."""
    import jax.numpy as jnp
    import numpy as np

    import hkv

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    model = (v4_model if args.model == "v4" else gemma_model)(dtype)
    rng = np.random.default_rng(1)
    out = {"prefill": {}, "decode": {}, "tokens": {}}
    top = max(args.contexts)
    cfg = hkv.CacheConfig(slots=1, max_context=top + 64, prefix_records=0)
    eng = hkv.Engine(model, cfg, block_tokens=64, prefill_chunk=512, compilation_cache=False)
    eng.decode_while_building = False
    for ctx in args.contexts:
        prompt = rng.integers(0, 4096, ctx).tolist()
        eng.generate([prompt], 1)  # compiles this context's read size
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            g = eng.generate([prompt], 1)[0]
            best = min(best, time.perf_counter() - t0)
        out["prefill"][str(ctx)] = best
        out["tokens"][f"prefill{ctx}"] = g.tokens
    for batch in (1, 8):
        cfg = hkv.CacheConfig(slots=batch, max_context=args.decode_context + 64, prefix_records=0)
        eng = hkv.Engine(model, cfg, block_tokens=64, prefill_chunk=512, prefill_batch=batch, compilation_cache=False)
        eng.decode_while_building = False
        prompts = [rng.integers(0, 4096, args.decode_context).tolist() for _ in range(batch)]
        eng.generate(prompts, 9)  # compiles prefill and decode
        per_token = []
        handles = [eng.submit(p, 48) for p in prompts]
        while not all(h.done for h in handles):
            before = [len(h.tokens) for h in handles]
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            after = [len(h.tokens) for h in handles]
            # a step that only decoded: every request had its first token before it and gained one
            if (
                all(before)
                and all(a > b for a, b in zip(after, before, strict=True))
                and not any(h.done for h in handles)
            ):
                per_token.append(dt / (min(a - b for a, b in zip(after, before, strict=True))))
        out["decode"][str(batch)] = 1e3 * float(np.median(per_token))
        out["tokens"][f"decode{batch}"] = [list(h.result().tokens) for h in handles]
    return out


def run_tree(tree: str, model: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--dtype", args.dtype,
           "--contexts", ",".join(map(str, args.contexts)), "--decode-context", str(args.decode_context)]  # fmt: skip
    res = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"worker failed in {tree}:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default=BASELINE, help="revision without the contract (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="alternated rounds per tree (best of)")
    ap.add_argument("--quick", action="store_true", help="1K prefill only")
    ap.add_argument("--contexts", default="1024,8192", help="prefill contexts")
    ap.add_argument("--decode-context", type=int, default=1024, help="prompt tokens before decoding")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--models", default="v4,gemma")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="v4", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.contexts = [1024] if args.quick else [int(c) for c in args.contexts.split(",")]
    if args.worker:
        print(json.dumps(worker(args)))
        return
    with tempfile.TemporaryDirectory(prefix="hkv-baseline-") as tmp:
        base = os.path.join(tmp, "tree")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", base, args.baseline], check=True,
                       capture_output=True)  # fmt: skip
        try:
            for model in args.models.split(","):
                runs = {"baseline": [], "contract": []}
                for r in range(args.rounds):
                    for name, tree in (("baseline", base), ("contract", ROOT)):
                        print(f"[{model} round {r + 1}] {name} ...", file=sys.stderr, flush=True)
                        runs[name].append(run_tree(tree, model, args))
                report(model, runs, args)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base], check=False)


def report(model: str, runs: dict, args) -> None:
    def best(name, part, key):
        return min(r[part][key] for r in runs[name])

    print(f"\n{model} ({args.dtype}), best of {args.rounds} alternated rounds; baseline {args.baseline}")
    print("| figure | baseline | contract | contract / baseline |")
    print("|---|---|---|---|")
    for ctx in args.contexts:
        b, c = best("baseline", "prefill", str(ctx)), best("contract", "prefill", str(ctx))
        print(f"| prefill {ctx} (s) | {b:.3f} | {c:.3f} | {c / b:.2f}x |")
    for batch in (1, 8):
        b, c = best("baseline", "decode", str(batch)), best("contract", "decode", str(batch))
        print(f"| decode batch {batch} (ms/token) | {b:.2f} | {c:.2f} | {c / b:.2f}x |")
    same = all(r["tokens"] == runs["contract"][0]["tokens"] for r in runs["contract"])
    print(f"contract tokens identical across rounds: {same}")


if __name__ == "__main__":
    main()
