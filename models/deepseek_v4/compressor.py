"""KV compressors of CSA and HCA layers, and the lightning indexer of CSA layers.

A compressor turns every `m` source tokens into one compressed entry (the article's COMPRESSED
object): per window, a softmax over the window's gate logits (+ a learned position bias `ape`)
weights the projected rows, the weighted sum is RMS-normed and roped at the window's first
absolute position.

* HCA (`overlap=False`): non-overlapping windows of m tokens, projection width `head_dim`.
* CSA (`overlap=True`): projection width `2 * head_dim` holding two series Ca | Cb. Entry w pools
  window w-1's Ca slice together with window w's Cb slice (width 2m, stride m). Window 0's Ca half
  comes from the previous call's last window (`prior`), or is empty (gate -inf) at the start.

The functions here are pure; `compress_windows` is what both the stateless forward and hkv's
cached path call, so the two cannot drift apart.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from hkv import numerics
from hkv.core.layers import causal_entry_limit, indexer_scores, select_topk  # noqa: F401 (re-exported)
from models.placement import put

from .config import DeepseekV4Config
from .norms import linear, rms_norm
from .quantized import as_weight, quantized_or_param, weight
from .rope import apply_rope, cos_sin


def compress_windows(
    kv: jnp.ndarray,
    gate: jnp.ndarray,
    ape: jnp.ndarray,
    norm_weight: jnp.ndarray,
    first_position: jnp.ndarray | int,
    *,
    ratio: int,
    head_dim: int,
    overlap: bool,
    freqs: np.ndarray,
    eps: float,
    prior_kv: jnp.ndarray | None = None,
    prior_gate: jnp.ndarray | None = None,
) -> jnp.ndarray:
    """Pool complete windows into compressed entries.

    kv, gate: [B, n_windows * ratio, width] projected rows of whole windows (width = 2*head_dim
      when `overlap` else head_dim). ape: float32[ratio, width]. norm_weight: float32[head_dim].
    first_position: absolute position of the first row (a multiple of `ratio`), scalar or int[B].
    prior_kv / prior_gate: [B, ratio, head_dim] Ca slice (gate already biased by ape) of the
      window just before `kv` — only for `overlap`; None means "no earlier window" (weight 0).
    Returns [B, n_windows, head_dim] in kv.dtype, roped at positions first_position + w*ratio.
    """
    b, rows, width = kv.shape
    nw = rows // ratio
    chunk_kv = kv.reshape(b, nw, ratio, width)
    chunk_gate = gate.reshape(b, nw, ratio, width) + ape  # promotes to float32 like torch
    if overlap:
        ca_kv, cb_kv = chunk_kv[..., :head_dim], chunk_kv[..., head_dim:]
        ca_gate, cb_gate = chunk_gate[..., :head_dim], chunk_gate[..., head_dim:]
        if prior_kv is None:
            prior_kv = jnp.zeros((b, ratio, head_dim), chunk_kv.dtype)
            prior_gate = jnp.full((b, ratio, head_dim), -jnp.inf, chunk_gate.dtype)
        prev_kv = jnp.concatenate([prior_kv[:, None].astype(chunk_kv.dtype), ca_kv[:, :-1]], axis=1)
        prev_gate = jnp.concatenate([prior_gate[:, None].astype(chunk_gate.dtype), ca_gate[:, :-1]], axis=1)
        chunk_kv = jnp.concatenate([prev_kv, cb_kv], axis=2)  # [B, nw, 2*ratio, head_dim]
        chunk_gate = jnp.concatenate([prev_gate, cb_gate], axis=2)
    weights = numerics.softmax(chunk_gate, axis=2).astype(chunk_kv.dtype)
    pooled = numerics.fixed_sum((chunk_kv * weights).astype(jnp.float32), axis=2).astype(chunk_kv.dtype)
    compressed = rms_norm(pooled, norm_weight, eps)
    first = jnp.asarray(first_position, jnp.int32).reshape(-1, 1)  # [B or 1, 1]
    positions = first + jnp.arange(nw, dtype=jnp.int32)[None, :] * ratio
    cos, sin = cos_sin(positions, freqs)
    return apply_rope(compressed, cos, sin)


class Compressor(nnx.Module):
    """Weights of one compressor (`attn.compressor.*` or `attn.indexer.compressor.*`).

    wkv, wgate: [width, hidden]; ape: float32[ratio, width]; norm: float32[head_dim].
    """

    def __init__(self, wkv, wgate, ape, norm, *, ratio: int, head_dim: int, overlap: bool):
        self.wkv = as_weight(wkv)
        self.wgate = as_weight(wgate)
        self.ape = nnx.Param(ape)
        self.norm = nnx.Param(norm)
        self.ratio = ratio
        self.head_dim = head_dim
        self.overlap = overlap

    def project(self, x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        """x [B, T, hidden] -> (kv, gate), each [B, T, width]."""
        return linear(x, weight(self.wkv)), linear(x, weight(self.wgate))

    def compress_prefix(self, x: jnp.ndarray, freqs: np.ndarray, eps: float) -> jnp.ndarray:
        """Stateless: compress every complete window of x [B, T, hidden] -> [B, T // ratio, head_dim]."""
        kv, gate = self.project(x)
        usable = (x.shape[1] // self.ratio) * self.ratio
        if usable == 0:  # fewer tokens than one window: no entry yet
            return jnp.zeros((x.shape[0], 0, self.head_dim), x.dtype)
        return compress_windows(
            kv[:, :usable],
            gate[:, :usable],
            self.ape.value,
            self.norm.value,
            0,
            ratio=self.ratio,
            head_dim=self.head_dim,
            overlap=self.overlap,
            freqs=freqs,
            eps=eps,
        )


class Indexer(nnx.Module):
    """Lightning indexer of a CSA layer: its own overlapping compressor at `index_head_dim`, a query
    projection from the attention's q low-rank residual, and ReLU-weighted head scores.

    wq_b: [n_heads * index_head_dim, q_lora_rank]; weights_proj: [n_heads, hidden].
    """

    def __init__(self, compressor: Compressor, wq_b, weights_proj, *, n_heads: int, head_dim: int, topk: int):
        self.compressor = compressor
        self.wq_b = as_weight(wq_b)
        self.weights_proj = as_weight(weights_proj)
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.topk = topk

    def queries(self, q_residual: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
        """q_residual [B, S, q_lora_rank] -> roped indexer queries [B, S, n_heads, index_head_dim].
        cos/sin: [B, S, rope_dim // 2] of the `compress` family at the query positions."""
        b, s, _ = q_residual.shape
        q = linear(q_residual, weight(self.wq_b)).reshape(b, s, self.n_heads, self.head_dim)
        return apply_rope(q, cos[:, :, None], sin[:, :, None])

    def head_weights(self, x: jnp.ndarray) -> jnp.ndarray:
        """x [B, S, hidden] -> float32[B, S, n_heads] per-head score weights (already scaled)."""
        return numerics.mul(linear(x, weight(self.weights_proj)).astype(jnp.float32), jnp.float32(self.n_heads**-0.5))


def compressor_from_tensors(
    tensors: dict, prefix: str, cfg: DeepseekV4Config, *, ratio: int, head_dim: int, overlap: bool, dtype
) -> Compressor:
    """Build a `Compressor` from canonical tensors under `prefix` (e.g. "layers.1.attn.compressor.")."""
    return Compressor(
        quantized_or_param(tensors[prefix + "wkv.weight"], dtype, prefix + "wkv"),
        quantized_or_param(tensors[prefix + "wgate.weight"], dtype, prefix + "wgate"),
        put(tensors[prefix + "ape"], jnp.float32),
        put(tensors[prefix + "norm.weight"], jnp.float32),
        ratio=ratio,
        head_dim=head_dim,
        overlap=overlap,
    )
