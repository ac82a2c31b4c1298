"""Memory of hkv's cache vs the architectural minimum and vs a uniform paged full-KV cache, for
DeepSeek-V4-Flash and Gemma-3-27B dimensions at 128K and 1M tokens (one sequence, bf16 storage).

    python benchmarks/memory.py [--page-size 64] [--contexts 131072 1048576] [--models deepseek gemma3]

Nothing is allocated: hkv's allocation is computed from the shapes `init_cache` would create.
"""

from __future__ import annotations

import argparse

from hkv import CacheConfig, CacheLayout, CacheSpec, architectural_minimum, uniform_full_kv_bytes
from hkv.core.memory import KINDS, allocated_bytes
from models.deepseek_v4 import flash_config
from models.deepseek_v4.cache_spec import cache_spec as deepseek_spec
from models.gemma3 import gemma3_27b_config
from models.gemma3.cache_spec import cache_spec as gemma3_spec


def deepseek() -> tuple[str, CacheSpec]:
    cfg = flash_config()  # transformers' default config: the DeepSeek-V4-Flash dimensions
    n_csa = sum(t == "compressed_sparse_attention" for t in cfg.layer_types)
    title = (
        f"DeepSeek-V4-Flash: {cfg.num_hidden_layers} layers ({n_csa} CSA m={cfg.compress_rate_csa}, "
        f"{cfg.num_hidden_layers - n_csa} HCA m={cfg.compress_rate_hca}), shared K=V head_dim {cfg.head_dim}, "
        f"index_head_dim {cfg.index_head_dim}, window {cfg.sliding_window}"
    )
    return title, deepseek_spec(cfg, dtype="bfloat16", block_tokens=64, model_id="deepseek-v4-flash")


def gemma3() -> tuple[str, CacheSpec]:
    cfg = gemma3_27b_config()
    n_full = sum(t == "full_attention" for t in cfg.layer_types)
    title = (
        f"Gemma-3-27B: {cfg.num_hidden_layers} layers ({cfg.num_hidden_layers - n_full} sliding, window "
        f"{cfg.sliding_window}; {n_full} full), {cfg.num_key_value_heads} KV heads x {cfg.head_dim} (K and V)"
    )
    return title, gemma3_spec(cfg, dtype="bfloat16", block_tokens=64, model_id="gemma-3-27b")


MODELS = {"deepseek": deepseek, "gemma3": gemma3}


def report(title: str, spec: CacheSpec, contexts: list[int], page_size: int) -> None:
    print(f"{title}; bf16; page_size {page_size}")
    for n in contexts:
        layout = CacheLayout(spec, CacheConfig(slots=1, max_context=n, page_size=page_size, prefix_records=0))
        alloc = allocated_bytes(layout)
        minimum = architectural_minimum(spec, n)
        full = uniform_full_kv_bytes(spec, n, page_size=page_size)
        print(f"\ncontext {n:>9,} tokens")
        print(f"  {'object':<11}{'hkv allocates':>16}{'minimum':>16}{'ratio':>8}")
        for k in KINDS + ("total",):
            if not (alloc[k] or minimum[k]):
                continue
            ratio = alloc[k] / minimum[k] if minimum[k] else float("nan")
            print(f"  {k:<11}{alloc[k] / 2**20:>13.2f} MiB{minimum[k] / 2**20:>12.2f} MiB{ratio:>8.3f}")
        print(
            f"  uniform paged full-KV cache: {full / 2**20:,.1f} MiB = {full / alloc['total']:.1f}x hkv's "
            f"allocation ({full / minimum['total']:.1f}x the minimum)"
        )
        print(f"  hkv allocation / architectural minimum = {alloc['total'] / minimum['total']:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128 * 1024, 1024 * 1024])
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["deepseek", "gemma3"])
    args = ap.parse_args()
    for i, name in enumerate(args.models):
        if i:
            print("\n" + "=" * 100 + "\n")
        report(*MODELS[name](), args.contexts, args.page_size)


if __name__ == "__main__":
    main()
