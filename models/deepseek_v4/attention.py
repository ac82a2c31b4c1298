"""DeepSeek-V4 attention block: low-rank queries, shared K=V single-head MQA, partial interleaved RoPE,
per-head sinks, a sliding-window branch on every layer, compressed entries on CSA/HCA layers (all
causal entries for HCA, indexer top-k for CSA), inverse RoPE on the output, grouped low-rank output.

Stateless (`Attention.__call__`) computes everything from the whole sequence. The projection pieces
(`queries`, `shared_kv`, `project_output`) are separate so that a cached path reuses them exactly.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from hkv import numerics
from hkv.core.kv_quant import round_rows
from hkv.core.layers import causal_entry_limit, indexer_topk, sequence_attention
from models.placement import put

from .compressor import Indexer, compressor_from_tensors
from .config import CSA, HCA, SLIDING, DeepseekV4Config
from .norms import linear, rms_norm, unweighted_rms_norm
from .quantized import quantized_or_param, weight
from .rope import apply_rope


def sliding_window_bias(q_positions: jnp.ndarray, k_positions: jnp.ndarray, window: int) -> jnp.ndarray:
    """0 where key position p satisfies t - window < p <= t, else -inf. [..., Tq] x [..., Tk] -> [..., Tq, Tk]."""
    t = q_positions[..., :, None]
    p = k_positions[..., None, :]
    return jnp.where((p <= t) & (p > t - window), 0.0, -jnp.inf).astype(jnp.float32)


class Attention(nnx.Module):
    """One DeepSeek-V4 attention block (weights under `layers.N.attn.`)."""

    def __init__(self, cfg: DeepseekV4Config, layer: int, tensors: dict, dtype):
        p = f"layers.{layer}.attn."
        f32 = jnp.float32
        self.layer_type = cfg.layer_types[layer]
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.window = cfg.sliding_window
        self.o_groups = cfg.o_groups
        self.o_lora_rank = cfg.o_lora_rank
        self.eps = cfg.rms_norm_eps
        self.rope_family = "main" if self.layer_type == SLIDING else "compress"
        self.kv_quant = cfg.kv_quant_spec()  # the cache's row format: K=V rows, entries, keys rounded to it
        self.wq_a = quantized_or_param(tensors[p + "wq_a.weight"], dtype, p + "wq_a")
        self.q_norm = nnx.Param(put(tensors[p + "q_norm.weight"], f32))
        self.wq_b = quantized_or_param(tensors[p + "wq_b.weight"], dtype, p + "wq_b")
        self.wkv = quantized_or_param(tensors[p + "wkv.weight"], dtype, p + "wkv")
        self.norm = nnx.Param(put(tensors[p + "norm.weight"], f32))
        self.wo_a = quantized_or_param(tensors[p + "wo_a.weight"], dtype, p + "wo_a")
        self.wo_b = quantized_or_param(tensors[p + "wo_b.weight"], dtype, p + "wo_b")
        self.attn_sink = nnx.Param(put(tensors[p + "attn_sink"], f32, p + "attn_sink"))
        compressor = indexer = None
        if self.layer_type in (CSA, HCA):
            self.ratio = cfg.compress_rate(layer)
            compressor = compressor_from_tensors(
                tensors,
                p + "compressor.",
                cfg,
                ratio=self.ratio,
                head_dim=cfg.head_dim,
                overlap=self.layer_type == CSA,
                dtype=dtype,
            )
        if self.layer_type == CSA:
            index_compressor = compressor_from_tensors(
                tensors,
                p + "indexer.compressor.",
                cfg,
                ratio=self.ratio,
                head_dim=cfg.index_head_dim,
                overlap=True,
                dtype=dtype,
            )
            indexer = Indexer(
                index_compressor,
                quantized_or_param(tensors[p + "indexer.wq_b.weight"], dtype, p + "indexer.wq_b"),
                quantized_or_param(tensors[p + "indexer.weights_proj.weight"], dtype, p + "indexer.weights_proj"),
                n_heads=cfg.index_n_heads,
                head_dim=cfg.index_head_dim,
                topk=cfg.index_topk,
            )
        self.compressor = nnx.data(compressor)
        self.indexer = nnx.data(indexer)

    # ----------------------------------------------------------------- pieces
    def queries(self, x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        """x [B, T, hidden] -> (q [B, T, H, head_dim] roped, q_residual [B, T, q_lora_rank])."""
        b, t, _ = x.shape
        q_residual = rms_norm(linear(x, weight(self.wq_a)), self.q_norm.value, self.eps)
        q = linear(q_residual, weight(self.wq_b)).reshape(b, t, self.num_heads, self.head_dim)
        q = unweighted_rms_norm(q, self.eps)
        return apply_rope(q, cos[:, :, None], sin[:, :, None]), q_residual

    def shared_kv(self, x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
        """x [B, T, hidden] -> roped K=V rows [B, T, head_dim] (the SWA object's content)."""
        kv = rms_norm(linear(x, weight(self.wkv)), self.norm.value, self.eps)
        return apply_rope(kv, cos, sin)

    def project_output(self, o: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
        """o [B, T, H, head_dim] -> [B, T, hidden]: inverse RoPE at the query position, grouped o_a, o_b."""
        b, t = o.shape[:2]
        o = apply_rope(o, cos[:, :, None], -sin[:, :, None])
        g = self.o_groups
        grouped = o.reshape(b * t, g, -1).transpose(1, 0, 2)  # [g, rows, in]: groups a batch dimension
        w = weight(self.wo_a).astype(o.dtype).reshape(g, self.o_lora_rank, -1).transpose(0, 2, 1)  # [g, in, rank]
        floor = numerics.tile_rows_floor(o.dtype, w.shape[1], w.shape[2])  # rows: one per token
        mixed = numerics.batched_matmul(grouped, w, floor).astype(o.dtype)  # [g, rows, rank]
        mixed = mixed.transpose(1, 0, 2).reshape(b, t, g * self.o_lora_rank)
        return linear(mixed, weight(self.wo_b))

    # --------------------------------------------------------------- stateless
    def __call__(self, x: jnp.ndarray, positions: jnp.ndarray, rope: dict, freqs: dict[str, np.ndarray]) -> jnp.ndarray:
        """Stateless attention over the whole sequence. x [B, T, hidden] (already normed),
        positions int32[B, T] (0..T-1), rope[family] = (cos, sin) float32[B, T, rope_dim // 2]."""
        cos, sin = rope[self.rope_family]
        q, q_residual = self.queries(x, cos, sin)
        kv = round_rows(self.kv_quant, self.shared_kv(x, cos, sin))
        entries = limit = picks = None
        if self.compressor is not None:
            entries = round_rows(self.kv_quant, self.compressor.compress_prefix(x, freqs["compress"], self.eps))
            limit = causal_entry_limit(positions, self.ratio)  # [B, T]
            if self.indexer is not None:  # CSA: the indexer's top-k among causal entries
                ccos, csin = rope["compress"]
                iq = self.indexer.queries(q_residual, ccos, csin)
                ikeys = round_rows(
                    self.kv_quant, self.indexer.compressor.compress_prefix(x, freqs["compress"], self.eps)
                )
                picks = indexer_topk(iq, self.indexer.head_weights(x), ikeys, limit, self.indexer.topk)
        k = kv[:, :, None, :]  # one shared K=V head
        o = sequence_attention(q, k, k, window=self.window, scale=self.head_dim**-0.5, sinks=self.attn_sink.value,
                               entries=entries, entry_limit=limit, picks=picks)  # fmt: skip
        return self.project_output(o, cos, sin)
