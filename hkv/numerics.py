"""The numerical contract's building blocks, for models written against hkv (re-exported from
`pallas_kernels.numerics`, where the decode kernels' references use them too).

A model keeps hkv's contract — the logits of a token at a position bitwise the same on every path —
when every reduction it computes goes through these functions: `linear` / `matmul` for products,
`fixed_sum` / `fixed_mean` / `softmax` / `rms_scale` for sums, `exp` / `rsqrt` / `sigmoid` / `silu`
for the elementwise functions whose XLA versions are not the same bits everywhere, and
`hkv.core.layers.sequence_attention` (stateless) / `hkv.LayerCache.attend` (cached) for attention.
Programs must be compiled with `compiler_options()`; `hkv.numerics.jit` is `jax.jit` with them.
See docs/numerics.md.
"""

from pallas_kernels.numerics import (
    F32_MIN_ROWS,
    KEY_TILE,
    MIN_ROWS,
    KeyTiles,
    attend,
    batched_matmul,
    compiler_options,
    div,
    exp,
    fixed_mean,
    fixed_sum,
    gelu_tanh,
    indexer_scores,
    jit,
    linear,
    matmul,
    min_rows,
    mul,
    ordered_sum,
    rms_scale,
    rsqrt,
    settle,
    sigmoid,
    silu,
    softmax,
    tile_rows_floor,
)

__all__ = [
    "F32_MIN_ROWS",
    "KEY_TILE",
    "MIN_ROWS",
    "KeyTiles",
    "attend",
    "batched_matmul",
    "compiler_options",
    "div",
    "exp",
    "fixed_mean",
    "fixed_sum",
    "gelu_tanh",
    "indexer_scores",
    "jit",
    "linear",
    "matmul",
    "min_rows",
    "mul",
    "ordered_sum",
    "rms_scale",
    "rsqrt",
    "settle",
    "sigmoid",
    "silu",
    "softmax",
    "tile_rows_floor",
]
