"""Gemma 3's cache objects as an `hkv.CacheSpec` (which object each layer owns).

Every layer keeps its keys and values (separate K and V, `num_key_value_heads` heads of `head_dim`)
in an SWA object: sliding layers a window of `cfg.window` tokens (the current one included, HF's
`sliding_window`), full-attention layers every row (window None). No compressors, no indexer.
"""

from __future__ import annotations

from hkv.core.spec import CacheSpec, LayerSpec

from .config import SLIDING, Gemma3Config


def cache_spec(
    cfg: Gemma3Config, dtype: str = "float32", block_tokens: int = 16, model_id: str = "unknown"
) -> CacheSpec:
    """The `CacheSpec` of a Gemma 3 config with storage dtype `dtype` (the model dtype's name);
    `model_id` is a display label (the engine adds the weights digest, which the ABI fingerprint covers)."""
    layers = tuple(
        LayerSpec.attention(cfg.head_dim, cfg.num_key_value_heads, cfg.window if t == SLIDING else None)
        for t in cfg.layer_types
    )
    return CacheSpec(
        layers=layers, dtype=dtype, block_tokens=block_tokens, model_id=model_id, kv_quant=cfg.kv_quant_spec()
    )
