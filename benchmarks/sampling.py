"""Sampling on device: the sort-free truncation (`hkv.core.sampling.truncate`) against the sorted
definition (`truncate_reference`), inside `hkv.core.sampling.sample`, in one run.

    python benchmarks/sampling.py            # vocabularies 128, 32,000 and 129,280 (DeepSeek-V4), batch 1 and 8

Every row samples (temperature 0.8, top_p 0.9, top_k 0 and 50, min_p 0), float32 normal logits (scale
3); both functions are jitted and run once untimed, then the median of `--repeats` runs of each,
interleaved. Both must draw the same tokens ("agree": the draw is the same Gumbel-max over the same
kept set). A greedy batch runs neither (`sample` takes the argmax under a `lax.cond`).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from hkv.core import sampling as S


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--vocab", type=int, nargs="+", default=[128, 32_000, 129_280])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; median of {args.repeats} runs each")
    for top_k in (0, 50):
        for v in args.vocab:
            for b in args.batch:
                rows = [S.SamplingParams(temperature=0.8, top_p=0.9, top_k=top_k, seed=i) for i in range(b)]
                params = S.SamplingBatch.stack(rows, list(range(b)))
                logits = 3.0 * jax.random.normal(jax.random.key(v + b), (b, v), jnp.float32)
                pos = jnp.arange(b, dtype=jnp.int32)
                fns = {}
                for name, trunc in (("sort-free", S.truncate), ("sorted", S.truncate_reference)):
                    saved = S.truncate
                    S.truncate = trunc
                    try:  # compiled now: `sample` reads the module's `truncate` when traced
                        fns[name] = jax.jit(lambda x, p, q: S.sample(x, p, q)[0]).lower(logits, params, pos).compile()
                    finally:
                        S.truncate = saved
                toks = {name: np.asarray(f(logits, params, pos)) for name, f in fns.items()}
                times = {name: [] for name in fns}
                for _ in range(args.repeats):
                    for name, f in fns.items():
                        t0 = time.perf_counter()
                        f(logits, params, pos).block_until_ready()
                        times[name].append(time.perf_counter() - t0)
                new, ref = (1e3 * float(np.median(times[n])) for n in ("sort-free", "sorted"))
                agree = bool(np.array_equal(toks["sort-free"], toks["sorted"]))
                print(
                    f"vocab {v:>7,} batch {b:>2} top_k {top_k:>2}: sort-free {new:8.2f} ms  sorted {ref:8.2f} ms  "
                    f"ratio {ref / new:6.1f}x  agree={agree}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
