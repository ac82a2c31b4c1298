"""`make demo`: greedy generation with the built-in tiny DeepSeek-V4 (random weights, every layer type).

For now it re-runs the stateless forward for every new token (no KV cache) and says what that costs.
"""

from __future__ import annotations

import time

import numpy as np

from . import init, tiny_config
from .greedy import greedy_stateless


def main() -> None:
    cfg = tiny_config()
    print(f"tiny DeepSeek-V4: {cfg.num_hidden_layers} layers {list(cfg.layer_types)}, "
          f"window {cfg.sliding_window}, CSA m={cfg.compress_rate_csa} (indexer {cfg.index_n_heads} heads, "
          f"top-{cfg.index_topk}), HCA m={cfg.compress_rate_hca}, hc_mult {cfg.hc_mult}")
    model = init(cfg, seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (37, 90)]
    new = 24
    t0 = time.perf_counter()
    tokens, _ = greedy_stateless(model, prompts, new,
                                 on_token=lambda s, ids: print(f"  step {s + 1}/{new}: {ids}", flush=True))
    dt = time.perf_counter() - t0
    for p, t in zip(prompts, tokens):
        print(f"prompt of {len(p)} tokens -> {t}")
    total = max(len(p) for p in prompts) + new
    print(f"{new} tokens x {len(prompts)} prompts in {dt:.1f}s (incl. one compilation). Cost: no cache — every "
          f"step re-runs the whole forward over {total} padded positions, i.e. O(T) work per token and "
          f"O(T^2) attention; the hkv cache replaces this with a constant-cost decode step.")


if __name__ == "__main__":
    main()
