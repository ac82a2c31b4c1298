"""Memory of hkv's cache for DeepSeek-V4-Flash dimensions vs the architectural minimum and vs a
uniform paged full-KV cache, at 128K and 1M tokens (one sequence, bf16 storage).

    python benchmarks/memory.py [--page-size 64] [--contexts 131072 1048576]

Nothing is allocated: hkv's allocation is computed from the shapes `init_cache` would create.
"""

from __future__ import annotations

import argparse

from hkv import CacheConfig, CacheLayout, architectural_minimum, uniform_full_kv_bytes
from hkv.core.memory import KINDS, allocated_bytes
from models.deepseek_v4 import DeepseekV4Config
from models.deepseek_v4.cache_spec import cache_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128 * 1024, 1024 * 1024])
    args = ap.parse_args()
    cfg = DeepseekV4Config()  # transformers' default config: the DeepSeek-V4-Flash dimensions
    spec = cache_spec(cfg, dtype="bfloat16", block_tokens=64, model_id="deepseek-v4-flash")
    n_csa = sum(t == "compressed_sparse_attention" for t in cfg.layer_types)
    print(
        f"DeepSeek-V4-Flash: {cfg.num_hidden_layers} layers ({n_csa} CSA m={cfg.compress_rate_csa}, "
        f"{cfg.num_hidden_layers - n_csa} HCA m={cfg.compress_rate_hca}), head_dim {cfg.head_dim}, "
        f"index_head_dim {cfg.index_head_dim}, window {cfg.sliding_window}; bf16; page_size {args.page_size}"
    )
    for n in args.contexts:
        layout = CacheLayout(spec, CacheConfig(slots=1, max_context=n, page_size=args.page_size))
        alloc = allocated_bytes(layout)
        minimum = architectural_minimum(spec, n)
        full = uniform_full_kv_bytes(spec, n, page_size=args.page_size)
        print(f"\ncontext {n:>9,} tokens")
        print(f"  {'object':<11}{'hkv allocates':>16}{'minimum':>16}{'ratio':>8}")
        for k in KINDS + ("total",):
            ratio = alloc[k] / minimum[k] if minimum[k] else float("nan")
            print(f"  {k:<11}{alloc[k] / 2**20:>13.2f} MiB{minimum[k] / 2**20:>12.2f} MiB{ratio:>8.3f}")
        print(
            f"  uniform paged full-KV cache: {full / 2**20:,.1f} MiB = {full / alloc['total']:.1f}x hkv's "
            f"allocation ({full / minimum['total']:.1f}x the minimum)"
        )
        print(f"  hkv allocation / architectural minimum = {alloc['total'] / minimum['total']:.4f}")


if __name__ == "__main__":
    main()
