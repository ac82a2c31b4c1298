"""DeepSeek-V4's cache objects as an `hkv.CacheSpec` (which object each layer owns).

Every layer: an SWA window of `sliding_window` K=V rows (`head_dim`). CSA layers: an overlapping
compressor (ratio m, projections 2*head_dim) and an indexer (ratio m, keys `index_head_dim`,
projections 2*index_head_dim). HCA layers: a non-overlapping compressor (ratio m', projections head_dim).
"""

from __future__ import annotations

from hkv.core.spec import CacheSpec, CompressorSpec, LayerSpec

from .config import CSA, HCA, DeepseekV4Config


def cache_spec(
    cfg: DeepseekV4Config, dtype: str = "float32", block_tokens: int = 16, model_id: str = "unknown"
) -> CacheSpec:
    """The `CacheSpec` of a DeepSeek-V4 config; `model_id` is a display label (the engine adds the
    weights digest, which the ABI fingerprint covers)."""
    layers = []
    for t in cfg.layer_types:
        comp = idx = None
        if t == CSA:
            m = cfg.compress_rate_csa
            comp = CompressorSpec(ratio=m, entry_dim=cfg.head_dim, proj_width=2 * cfg.head_dim, overlap=True)
            idx = CompressorSpec(ratio=m, entry_dim=cfg.index_head_dim, proj_width=2 * cfg.index_head_dim, overlap=True)
        elif t == HCA:
            m = cfg.compress_rate_hca
            comp = CompressorSpec(ratio=m, entry_dim=cfg.head_dim, proj_width=cfg.head_dim, overlap=False)
        layers.append(LayerSpec(kv_dim=cfg.head_dim, window=cfg.sliding_window, compressor=comp, indexer=idx))
    return CacheSpec(
        layers=tuple(layers), dtype=dtype, block_tokens=block_tokens, model_id=model_id, kv_quant=cfg.kv_quant_spec()
    )
