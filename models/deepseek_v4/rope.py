"""Interleaved partial RoPE of DeepSeek-V4.

Each head is laid out `[nope | rope]`: only the trailing `rope_dim` channels rotate, and they rotate
in consecutive pairs (x[2i], x[2i+1]) by angle `position * inv_freq[i]`. Two RoPE families exist:
`main` (sliding-only layers) and `compress` (CSA/HCA layers, their compressors and the indexer).
Math in float32, result cast back to the input dtype (as transformers does).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from hkv import numerics

from .config import DeepseekV4Config


def inv_freq(cfg: DeepseekV4Config, family: str) -> np.ndarray:
    """float32[rope_dim // 2] inverse frequencies of RoPE family `family` ("main" or "compress")."""
    if family not in ("main", "compress"):
        raise ValueError(f"{family=} must be 'main' or 'compress'")
    return cfg.rope_for[family].inv_freq(cfg.qk_rope_head_dim, cfg.max_position_embeddings)


def cos_sin(positions: jnp.ndarray, freqs: np.ndarray, scale: float = 1.0) -> tuple[jnp.ndarray, jnp.ndarray]:
    """positions int[...] -> (cos, sin), each float32[..., rope_dim // 2]."""
    angles = numerics.mul(positions.astype(jnp.float32)[..., None], jnp.asarray(freqs, jnp.float32))
    return numerics.mul(jnp.cos(angles), jnp.float32(scale)), numerics.mul(jnp.sin(angles), jnp.float32(scale))


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate the trailing `2 * cos.shape[-1]` channels of x[..., dim] pairwise.

    `cos`/`sin` broadcast against x[..., :-1] (e.g. x [B, T, H, D] with cos [B, T, 1, R/2]).
    Cast cos/sin to x.dtype first, then rotate in float32 (transformers' order of roundings).
    """
    half = cos.shape[-1]
    rope_dim = 2 * half
    cos = cos.astype(x.dtype).astype(jnp.float32)
    sin = sin.astype(x.dtype).astype(jnp.float32)
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    r = rope.astype(jnp.float32).reshape(*rope.shape[:-1], half, 2)
    even, odd = r[..., 0], r[..., 1]
    out_even = numerics.mul(even, cos) - numerics.mul(odd, sin)
    out_odd = numerics.mul(odd, cos) + numerics.mul(even, sin)
    rotated = jnp.stack([out_even, out_odd], axis=-1).reshape(rope.shape).astype(x.dtype)
    return jnp.concatenate([nope, rotated], axis=-1)
