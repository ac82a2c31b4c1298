"""DeepSeek-V4 configuration: the architecture's hyper-parameters, parsed from an HF `config.json`.

`DeepseekV4Config` is a frozen dataclass (hashable, so it can be a static argument of `jax.jit`).
`from_dict` accepts what transformers' `save_pretrained` writes for `deepseek_v4` and the legacy
keys of the original DeepSeek release (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`,
`compress_rate_csa` / `compress_rate_hca`, a flat `rope_scaling` / `rope_parameters` with YaRN).
Semantics follow transformers 5.24's `configuration_deepseek_v4.py`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

from hkv.core.spec import KV_QUANT_FORMATS, KVQuant

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"
MLP_LAYER_TYPES = (HASH_MOE, MOE)
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
_COMPRESS_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


class ConfigError(ValueError):
    """A `config.json` that does not describe a DeepSeek-V4 model this package can run."""


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """One RoPE family (`main` for sliding layers, `compress` for CSA/HCA layers and their compressors).

    `rope_type` is "default" or "yarn"; the YaRN fields are ignored for "default".
    """

    theta: float
    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0

    def inv_freq(self, rope_dim: int, max_position_embeddings: int) -> np.ndarray:
        """float32[rope_dim // 2]: one inverse frequency per interleaved channel pair."""
        pos_freqs = self.theta ** (np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim))
        pos_freqs = pos_freqs.astype(np.float32)
        extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
        if self.rope_type == "default":
            return extrapolation
        factor = self.factor
        orig = self.original_max_position_embeddings
        if factor is None:
            factor = max_position_embeddings / orig
        interpolation = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)

        def correction_dim(num_rotations: float) -> float:
            return (rope_dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
        extrapolation_factor = (np.float32(1.0) - ramp).astype(np.float32)
        return (interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class DeepseekV4Config:
    """Hyper-parameters of a DeepSeek-V4 model (names as in transformers' `DeepseekV4Config`).

    Per layer `i`: `layer_types[i]` in {sliding_attention, compressed_sparse_attention (CSA),
    heavily_compressed_attention (HCA)} and `mlp_layer_types[i]` in {hash_moe, moe}.
    `compress_rates` maps CSA/HCA to their compression ratio m. `qk_rope_head_dim` is the trailing
    slice of each head that carries interleaved RoPE.
    """

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 1024
    qk_rope_head_dim: int = 64
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_main: RopeSpec = RopeSpec(theta=10000.0)
    rope_compress: RopeSpec = RopeSpec(theta=160000.0)
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1.0e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rms_norm_eps: float = 1.0e-6
    tie_word_embeddings: bool = False
    quantization: str | None = None  # e.g. "fp8" (block-scaled), recorded from `quantization_config`
    # hkv's own: the KV cache's row format. None: rows in the model's dtype; "fp8_e4m3": DeepSeek's FP8
    # KV layout (`hkv.KVQuant`: e4m3 with a power-of-two scale per `kv_quant_tile` values, the trailing
    # `qk_rope_head_dim` rotary values kept in the model's dtype). The stateless forward rounds its K=V
    # rows, compressed entries and indexer keys the same way, so cached and stateless stay exact.
    kv_quant: str | None = None
    kv_quant_tile: int = 64

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if not self.layer_types:  # transformers' default: 2x HCA bootstrap, then CSA/HCA interleaved
            inter = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            object.__setattr__(self, "layer_types", tuple([HCA] * min(n, 2) + inter))
        if not self.mlp_layer_types:  # transformers' default: 3 hash-routed MoE layers, then top-k MoE
            object.__setattr__(self, "mlp_layer_types", tuple([HASH_MOE] * min(n, 3) + [MOE] * max(0, n - 3)))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        self.validate()

    # ------------------------------------------------------------------ derived
    def compress_rate(self, layer: int) -> int:
        """Compression ratio m of layer `layer` (0 for a sliding-only layer)."""
        t = self.layer_types[layer]
        return {SLIDING: 0, CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}[t]

    def kv_quant_spec(self) -> KVQuant | None:
        """The cache's `hkv.KVQuant` for `kv_quant` (None: rows stored in the model's dtype)."""
        if self.kv_quant is None:
            return None
        return KVQuant(self.kv_quant, tile=self.kv_quant_tile, rope_dims=self.qk_rope_head_dim)

    @property
    def rope_for(self) -> dict[str, RopeSpec]:
        return {"main": self.rope_main, "compress": self.rope_compress}

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise `ConfigError` naming the first bad field and its allowed range."""
        n = self.num_hidden_layers
        positive = (
            "vocab_size",
            "hidden_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "q_lora_rank",
            "num_experts_per_tok",
            "n_routed_experts",
            "hc_mult",
            "hc_sinkhorn_iters",
            "sliding_window",
            "o_groups",
            "o_lora_rank",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "compress_rate_csa",
            "compress_rate_hca",
            "max_position_embeddings",
        )
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ConfigError(f"{name}={v!r} must be a positive integer")
        if len(self.layer_types) != n:
            raise ConfigError(f"len(layer_types)={len(self.layer_types)} must equal num_hidden_layers={n}")
        if len(self.mlp_layer_types) != n:
            raise ConfigError(f"len(mlp_layer_types)={len(self.mlp_layer_types)} must equal num_hidden_layers={n}")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ConfigError(f"layer_types has unknown entries {bad}; allowed: {LAYER_TYPES}")
        bad = [t for t in self.mlp_layer_types if t not in MLP_LAYER_TYPES]
        if bad:
            raise ConfigError(f"mlp_layer_types has unknown entries {bad}; allowed: {MLP_LAYER_TYPES}")
        if self.kv_quant is not None:
            if self.kv_quant not in KV_QUANT_FORMATS:
                raise ConfigError(f"kv_quant={self.kv_quant!r} must be None or one of {KV_QUANT_FORMATS}")
            try:
                q = self.kv_quant_spec()
                q.check_dim(self.head_dim, "head_dim")
                q.check_dim(self.index_head_dim, "index_head_dim")
            except ValueError as e:
                raise ConfigError(f"kv_quant={self.kv_quant!r}, kv_quant_tile={self.kv_quant_tile!r}: {e}") from None
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(f"scoring_func={self.scoring_func!r} must be one of {SCORING_FUNCS}")
        if not (0 < self.qk_rope_head_dim <= self.head_dim and self.qk_rope_head_dim % 2 == 0):
            raise ConfigError(
                f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and in [2, head_dim={self.head_dim}]"
            )
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError(
                f"qk_rope_head_dim={self.qk_rope_head_dim} must be <= index_head_dim={self.index_head_dim}"
            )
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ConfigError(
                f"o_groups={self.o_groups} must divide num_attention_heads*head_dim="
                f"{self.num_attention_heads * self.head_dim}"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be <= n_routed_experts={self.n_routed_experts}"
            )
        for label, rope in self.rope_for.items():
            if rope.rope_type not in ("default", "yarn"):
                raise ConfigError(f"rope {label}: rope_type={rope.rope_type!r} must be 'default' or 'yarn'")
            if rope.rope_type == "yarn" and rope.original_max_position_embeddings is None:
                raise ConfigError(f"rope {label}: yarn needs original_max_position_embeddings")

    # ------------------------------------------------------------- (de)serialise
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeepseekV4Config:
        """Parse an HF `config.json` dict (transformers 5.24 layout or the original DeepSeek release)."""
        d = dict(d)
        model_type = d.get("model_type", "deepseek_v4")
        if model_type not in ("deepseek_v4",):
            raise ConfigError(f"model_type={model_type!r}; this loader reads only 'deepseek_v4'")
        n = int(d.get("num_hidden_layers", cls.num_hidden_layers))
        if d.get("num_key_value_heads", 1) != 1:
            raise ConfigError(f"num_key_value_heads={d['num_key_value_heads']} must be 1 (shared K=V MQA)")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={d['hidden_act']!r}; DeepSeek-V4 uses 'silu'")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                raise ConfigError(f"{flag}=True is not part of DeepSeek-V4")

        rates = dict(d.get("compress_rates") or {})
        if d.get("compress_rate_csa") is not None:
            rates[CSA] = d["compress_rate_csa"]
        if d.get("compress_rate_hca") is not None:
            rates[HCA] = d["compress_rate_hca"]
        layer_types = d.get("layer_types")
        if layer_types is None and d.get("compress_ratios") is not None:
            try:
                layer_types = [_COMPRESS_RATIO_TO_LAYER_TYPE[int(r)] for r in d["compress_ratios"]]
            except KeyError as e:
                raise ConfigError(
                    f"compress_ratios entry {e} must be one of {sorted(_COMPRESS_RATIO_TO_LAYER_TYPE)}"
                ) from e
        if layer_types is None:
            inter = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            layer_types = [HCA] * min(n, 2) + inter
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = d.get("num_hash_layers", 3)
            mlp_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)

        head_dim = int(d.get("head_dim", cls.head_dim))
        if d.get("qk_rope_head_dim") is not None:
            rope_dim = int(d["qk_rope_head_dim"])
        else:
            prf = d.get("partial_rotary_factor")
            rope_dim = int(head_dim * prf) if prf is not None else int(head_dim * 64 / 512)

        rope_main, rope_compress = _parse_rope(d)
        quant = d.get("quantization_config")
        quantization = None
        if isinstance(quant, dict):
            quantization = str(quant.get("quant_method", "unknown"))
        return cls(
            vocab_size=int(d.get("vocab_size", cls.vocab_size)),
            hidden_size=int(d.get("hidden_size", cls.hidden_size)),
            moe_intermediate_size=int(d.get("moe_intermediate_size", cls.moe_intermediate_size)),
            num_hidden_layers=n,
            num_attention_heads=int(d.get("num_attention_heads", cls.num_attention_heads)),
            head_dim=head_dim,
            q_lora_rank=int(d.get("q_lora_rank", cls.q_lora_rank)),
            qk_rope_head_dim=rope_dim,
            num_experts_per_tok=int(d.get("num_experts_per_tok", cls.num_experts_per_tok)),
            n_routed_experts=int(d.get("n_routed_experts", cls.n_routed_experts)),
            scoring_func=str(d.get("scoring_func", cls.scoring_func)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", cls.routed_scaling_factor)),
            max_position_embeddings=int(d.get("max_position_embeddings", cls.max_position_embeddings)),
            rope_main=rope_main,
            rope_compress=rope_compress,
            layer_types=tuple(layer_types[:n]),
            mlp_layer_types=tuple(mlp_types[:n]),
            compress_rate_csa=int(rates.get(CSA, 4)),
            compress_rate_hca=int(rates.get(HCA, 128)),
            hc_mult=int(d.get("hc_mult", cls.hc_mult)),
            hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", cls.hc_sinkhorn_iters)),
            hc_eps=float(d.get("hc_eps", cls.hc_eps)),
            swiglu_limit=float(d.get("swiglu_limit", cls.swiglu_limit)),
            sliding_window=int(d.get("sliding_window", cls.sliding_window)),
            o_groups=int(d.get("o_groups", cls.o_groups)),
            o_lora_rank=int(d.get("o_lora_rank", cls.o_lora_rank)),
            index_n_heads=int(d.get("index_n_heads", cls.index_n_heads)),
            index_head_dim=int(d.get("index_head_dim", cls.index_head_dim)),
            index_topk=int(d.get("index_topk", cls.index_topk)),
            rms_norm_eps=float(d.get("rms_norm_eps", cls.rms_norm_eps)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            quantization=quantization,
        )

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> DeepseekV4Config:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_hf_dict(self) -> dict[str, Any]:
        """The config as transformers 5.24's `DeepseekV4Config` keyword arguments."""

        def rope(r: RopeSpec) -> dict[str, Any]:
            out: dict[str, Any] = {
                "rope_type": r.rope_type,
                "rope_theta": r.theta,
                "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim,
            }
            if r.rope_type == "yarn":
                out.update(
                    factor=r.factor,
                    original_max_position_embeddings=r.original_max_position_embeddings,
                    beta_fast=r.beta_fast,
                    beta_slow=r.beta_slow,
                    attention_factor=r.attention_factor,
                )
            return out

        return {
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "q_lora_rank": self.q_lora_rank,
            "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_routed_experts": self.n_routed_experts,
            "scoring_func": self.scoring_func,
            "routed_scaling_factor": self.routed_scaling_factor,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_main.theta,
            "compress_rope_theta": self.rope_compress.theta,
            "rope_parameters": {"main": rope(self.rope_main), "compress": rope(self.rope_compress)},
            "layer_types": list(self.layer_types),
            "mlp_layer_types": list(self.mlp_layer_types),
            "compress_rates": {CSA: self.compress_rate_csa, HCA: self.compress_rate_hca},
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "swiglu_limit": self.swiglu_limit,
            "sliding_window": self.sliding_window,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
        }


def _parse_rope(d: dict[str, Any]) -> tuple[RopeSpec, RopeSpec]:
    """(main, compress) RoPE specs. YaRN, when configured, applies to `compress` only (as transformers)."""
    main_theta = float(d.get("rope_theta", 10000.0))
    compress_theta = float(d.get("compress_rope_theta", 160000.0))
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main_d, comp_d = rp["main"], rp["compress"]
    else:
        main_d = {"rope_type": "default", "rope_theta": main_theta}
        comp_d = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        comp_d["rope_theta"] = compress_theta  # as transformers: compress_rope_theta always wins
    return _rope_spec(main_d, main_theta), _rope_spec(comp_d, compress_theta)


def _rope_spec(r: dict[str, Any], default_theta: float) -> RopeSpec:
    rope_type = r.get("rope_type", r.get("type", "default"))
    theta = float(r.get("rope_theta", default_theta))
    if rope_type == "default":
        return RopeSpec(theta=theta)
    if rope_type != "yarn":
        raise ConfigError(f"rope_type={rope_type!r} is not supported; DeepSeek-V4 uses 'default' or 'yarn'")
    orig = r.get("original_max_position_embeddings")
    return RopeSpec(
        theta=theta,
        rope_type="yarn",
        factor=None if r.get("factor") is None else float(r["factor"]),
        original_max_position_embeddings=None if orig is None else int(orig),
        beta_fast=float(r.get("beta_fast") or 32.0),
        beta_slow=float(r.get("beta_slow") or 1.0),
        # transformers forces attention_factor=1.0 for V4's compress rope: cos/sin are not rescaled.
        attention_factor=float(r.get("attention_factor", 1.0)),
    )


def tiny_config(**overrides: Any) -> DeepseekV4Config:
    """A DeepSeek-V4 small enough to run in seconds on CPU that still has every layer type.

    Layers: sliding, CSA (m=4, overlapping windows, lightning indexer with 16 heads), HCA (m=16),
    CSA; hash-routed MoE first, top-k MoE after; hc_mult=2; window 8. Override any field by keyword.
    """
    base: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        num_experts_per_tok=2,
        n_routed_experts=4,
        max_position_embeddings=4096,
        layer_types=(SLIDING, CSA, HCA, CSA),
        mlp_layer_types=(HASH_MOE, MOE, MOE, MOE),
        compress_rate_csa=4,
        compress_rate_hca=16,
        hc_mult=2,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=16,
        index_head_dim=16,
        index_topk=8,
    )
    base.update(overrides)
    return DeepseekV4Config(**base)


def flash_config(**overrides: Any) -> DeepseekV4Config:
    """DeepSeek-V4-Flash's dimensions (the defaults of `DeepseekV4Config`, as in transformers'
    `DeepseekV4Config()`): 43 layers of CSA m=4 / HCA m=128, window 128. For memory planning and
    reports; `overrides` replace any field."""
    return DeepseekV4Config(**overrides)
