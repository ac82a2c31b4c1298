"""Gemma 3 (text) configuration, parsed from an HF `config.json` (`gemma3_text`, or `gemma3` via its `text_config`).

`Gemma3Config` is a frozen dataclass (hashable, so it can be a static argument of `jax.jit`). Field names
and defaults follow transformers 5.24 `Gemma3TextConfig`; a key missing from the json takes transformers'
default. Accepted RoPE formats: transformers 5 `rope_parameters` keyed by layer type
(`{"sliding_attention": {...}, "full_attention": {...}}`), and the older flat keys `rope_theta` (full
layers), `rope_local_base_freq` (sliding layers) and `rope_scaling` (applied to full layers only).

Sliding-window semantics (transformers `sliding_window_overlay`: key j is visible to query i iff
`i - sliding_window < j <= i`): a sliding layer attends to exactly `sliding_window` tokens INCLUDING the
current one (the current token plus `sliding_window - 1` previous ones; transformers' sliding cache keeps
`sliding_window - 1` past tokens). `Gemma3Config.window` is that count, i.e. equal to `sliding_window`.

`attn_logit_softcapping` is parsed and kept but NOT applied: transformers 5.24 `Gemma3Attention` never
passes it to its attention function (Gemma 3 dropped Gemma 2's attention softcap), and transformers is the
reference. `final_logit_softcapping` is applied.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from hkv.core.spec import KV_QUANT_FORMATS, KVQuant

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
ROPE_TYPES = ("default", "linear")
ACTIVATIONS = ("gelu_pytorch_tanh",)
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}  # transformers' Gemma3TextConfig.default_theta


class ConfigError(ValueError):
    """A `config.json` that does not describe a Gemma 3 text model this package can run."""


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """RoPE of one layer type: `rope_type` "default" or "linear" (positions divided by `factor`)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """float32[head_dim // 2], as transformers computes it (float32 throughout, then / factor)."""
        exponents = (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)).astype(
            np.float32
        )
        inv = (np.float32(1.0) / (np.float32(self.theta) ** exponents)).astype(np.float32)
        if self.rope_type == "linear":
            inv = (inv / np.float32(self.factor)).astype(np.float32)
        return inv

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.theta}
        if self.rope_type == "linear":
            out["factor"] = self.factor
        return out


@dataclasses.dataclass(frozen=True)
class Gemma3Config:
    """Hyper-parameters of a Gemma 3 text model (names as in transformers' `Gemma3TextConfig`).

    `layer_types[i]` is "sliding_attention" or "full_attention"; `rope[type]` its `RopeSpec`
    (`rope_parameters` is the transformers-5 dict view of the same).
    """

    vocab_size: int = 262_208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    layer_types: tuple[str, ...] | None = None  # None: derived from sliding_window_pattern (6)
    sliding_window: int | None = 4096
    rope_sliding: RopeSpec = RopeSpec(DEFAULT_THETA[SLIDING])
    rope_full: RopeSpec = RopeSpec(DEFAULT_THETA[FULL])
    query_pre_attn_scalar: float = 256
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # kept, never applied (see module docstring)
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 131_072
    sliding_window_pattern: int = 6
    # hkv's own: the KV cache's row format. None: K and V in the model's dtype; "fp8_e4m3": e4m3 with a
    # power-of-two scale per `kv_quant_tile` values of each K and V head (`hkv.KVQuant`, no values kept
    # unquantized); the stateless forward rounds its K and V the same way.
    kv_quant: str | None = None
    kv_quant_tile: int = 64

    def __post_init__(self) -> None:
        if self.layer_types is None:
            object.__setattr__(
                self, "layer_types", layer_types_from_pattern(self.num_hidden_layers, self.sliding_window_pattern)
            )
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self.validate()

    # ------------------------------------------------------------ derived values
    @property
    def window(self) -> int:
        """Tokens a sliding layer attends to, the current one included (== `sliding_window`)."""
        return self.sliding_window

    @property
    def scaling(self) -> float:
        """Attention score scale `query_pre_attn_scalar ** -0.5`."""
        return float(self.query_pre_attn_scalar) ** -0.5

    def kv_quant_spec(self) -> KVQuant | None:
        """The cache's `hkv.KVQuant` for `kv_quant` (None: K and V stored in the model's dtype)."""
        return None if self.kv_quant is None else KVQuant(self.kv_quant, tile=int(self.kv_quant_tile))

    @property
    def rope(self) -> dict[str, RopeSpec]:
        return {SLIDING: self.rope_sliding, FULL: self.rope_full}

    @property
    def rope_parameters(self) -> dict[str, dict[str, Any]]:
        return {t: r.to_hf() for t, r in self.rope.items()}

    # ---------------------------------------------------------------- checks
    def validate(self) -> None:
        """Raise `ConfigError` naming the first bad field and what it must be."""
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "sliding_window_pattern",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ConfigError(f"{name}={v!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even (RoPE rotates channel halves)")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"len(layer_types)={len(self.layer_types)} must equal num_hidden_layers={self.num_hidden_layers}"
            )
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ConfigError(f"layer_types has unknown entries {bad}; allowed: {LAYER_TYPES}")
        if SLIDING in self.layer_types:
            w = self.sliding_window
            if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w <= 0:
                raise ConfigError(f"sliding_window={w!r} must be a positive integer (the model has sliding layers)")
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise ConfigError(f"rms_norm_eps={self.rms_norm_eps!r} must be a positive number")
        if not (isinstance(self.query_pre_attn_scalar, (int, float)) and self.query_pre_attn_scalar > 0):
            raise ConfigError(f"query_pre_attn_scalar={self.query_pre_attn_scalar!r} must be a positive number")
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
                raise ConfigError(f"{name}={v!r} must be None or a positive number")
        if self.kv_quant is not None:
            if self.kv_quant not in KV_QUANT_FORMATS:
                raise ConfigError(f"kv_quant={self.kv_quant!r} must be None or one of {KV_QUANT_FORMATS}")
            t = self.kv_quant_tile
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 1 or self.head_dim % t:
                raise ConfigError(f"kv_quant_tile={t!r} must be a positive divisor of head_dim={self.head_dim}")
        if self.hidden_activation not in ACTIVATIONS:
            raise ConfigError(f"hidden_activation={self.hidden_activation!r} must be one of {ACTIVATIONS}")
        for label, r in self.rope.items():
            if r.rope_type not in ROPE_TYPES:
                raise ConfigError(f"rope_parameters[{label!r}]: rope_type={r.rope_type!r} must be one of {ROPE_TYPES}")
            if not (isinstance(r.theta, (int, float)) and r.theta > 0):
                raise ConfigError(f"rope_parameters[{label!r}]: rope_theta={r.theta!r} must be a positive number")
            if not (isinstance(r.factor, (int, float)) and r.factor > 0):
                raise ConfigError(f"rope_parameters[{label!r}]: factor={r.factor!r} must be a positive number")

    # ----------------------------------------------------------------- HF I/O
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Gemma3Config:
        """Parse an HF config dict: `model_type` "gemma3_text", or "gemma3" (its `text_config` is used)."""
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a dict, got {type(d).__name__}")
        model_type = d.get("model_type", "gemma3_text")
        if model_type == "gemma3":
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("model_type='gemma3' config has no text_config dict")
            d = {"model_type": "gemma3_text", **text}
            model_type = d["model_type"]
        if model_type != "gemma3_text":
            raise ConfigError(f"model_type={model_type!r}; this loader reads only 'gemma3_text' or 'gemma3'")
        if d.get("use_bidirectional_attention"):
            raise ConfigError("use_bidirectional_attention=True is not supported (causal decoding only)")
        if d.get("attention_bias"):
            raise ConfigError("attention_bias=True is not part of Gemma 3")
        if "sliding_window_pattern" not in d and "_sliding_window_pattern" in d:  # what transformers 5 saves
            d = {**d, "sliding_window_pattern": d["_sliding_window_pattern"]}
        if "hidden_act" in d and "hidden_activation" not in d:
            d = {**d, "hidden_activation": d["hidden_act"]}
        default = cls.__dataclass_fields__
        kw: dict[str, Any] = {}
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "sliding_window",
            "query_pre_attn_scalar",
            "final_logit_softcapping",
            "attn_logit_softcapping",
            "hidden_activation",
            "tie_word_embeddings",
            "max_position_embeddings",
            "sliding_window_pattern",
        ):
            kw[name] = d[name] if name in d else default[name].default
        layer_types = d.get("layer_types")
        kw["layer_types"] = tuple(layer_types) if layer_types is not None else None
        kw["rope_sliding"], kw["rope_full"] = _parse_rope(d)
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> Gemma3Config:
        """Read `path` (a config.json, or a directory holding one)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf(d)

    def to_hf(self) -> dict[str, Any]:
        """The transformers-5 `gemma3_text` config dict (`Gemma3TextConfig(**cfg.to_hf())` rebuilds it)."""
        return {
            "model_type": "gemma3_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "rope_parameters": self.rope_parameters,
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "final_logit_softcapping": self.final_logit_softcapping,
            "attn_logit_softcapping": self.attn_logit_softcapping,
            "hidden_activation": self.hidden_activation,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
        }


def layer_types_from_pattern(num_layers: int, pattern: int) -> tuple[str, ...]:
    """transformers' derivation: layer i is full iff (i + 1) % pattern == 0 (pattern 6: 5 sliding then 1 full)."""
    if isinstance(pattern, bool) or not isinstance(pattern, (int, np.integer)) or pattern <= 0:
        raise ConfigError(f"sliding_window_pattern={pattern!r} must be a positive integer")
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


def _rope_spec(r: Any, label: str, default_theta: float) -> RopeSpec:
    if not isinstance(r, dict):
        raise ConfigError(f"rope_parameters[{label!r}]={r!r} must be a dict")
    rope_type = r.get("rope_type", r.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope_parameters[{label!r}]: rope_type={rope_type!r} must be one of {ROPE_TYPES}")
    theta = r.get("rope_theta", default_theta)
    if rope_type == "linear":
        if r.get("factor") is None:
            raise ConfigError(f"rope_parameters[{label!r}]: linear rope needs a 'factor'")
        return RopeSpec(float(theta), "linear", float(r["factor"]))
    return RopeSpec(float(theta))


def _parse_rope(d: dict[str, Any]) -> tuple[RopeSpec, RopeSpec]:
    """(sliding, full) RopeSpecs from transformers-5 `rope_parameters` or the older flat keys."""
    params = d.get("rope_parameters")
    full: dict[str, Any] = {"rope_type": "default"}
    sliding: dict[str, Any] = {"rope_type": "default"}
    if isinstance(params, dict) and (SLIDING in params or FULL in params):
        bad = sorted(set(params) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"rope_parameters has unknown layer types {bad}; allowed: {LAYER_TYPES}")
        full = dict(params.get(FULL) or full)
        sliding = dict(params.get(SLIDING) or sliding)
    elif params is not None:  # a flat dict describes the full-attention rope, like rope_scaling
        if not isinstance(params, dict):
            raise ConfigError(f"rope_parameters={params!r} must be a dict")
        full.update(params)
    if d.get("rope_scaling") is not None:
        if not isinstance(d["rope_scaling"], dict):
            raise ConfigError(f"rope_scaling={d['rope_scaling']!r} must be a dict or null")
        full.update(d["rope_scaling"])
    full.setdefault("rope_theta", d.get("rope_theta") or DEFAULT_THETA[FULL])
    sliding.setdefault("rope_theta", d.get("rope_local_base_freq") or DEFAULT_THETA[SLIDING])
    return _rope_spec(sliding, SLIDING, DEFAULT_THETA[SLIDING]), _rope_spec(full, FULL, DEFAULT_THETA[FULL])


def tiny_config(**overrides: Any) -> Gemma3Config:
    """A small Gemma 3 for tests: hidden 64, 4 heads / 2 kv heads of dim 16, 6 layers (5 sliding : 1 full),
    window 16, vocab 512. `overrides` replace any field (e.g. `layer_types=...`, `rope_full=RopeSpec(...)`)."""
    base: dict[str, Any] = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "layer_types": None,
        "sliding_window": 16,
        "rope_sliding": RopeSpec(10_000.0),
        "rope_full": RopeSpec(1_000_000.0),
        "query_pre_attn_scalar": 16,
        "max_position_embeddings": 2048,
        "sliding_window_pattern": 6,
    }
    base.update(overrides)
    return Gemma3Config(**base)


# Gemma-3-27B (google/gemma-3-27b-it text_config): 62 layers, 5 sliding (window 1024) : 1 full,
# 32 query heads over 16 KV heads of 128, linear RoPE x8 on full layers.
GEMMA3_27B_HF: dict[str, Any] = {
    "model_type": "gemma3_text",
    "vocab_size": 262_208,
    "hidden_size": 5376,
    "intermediate_size": 21_504,
    "num_hidden_layers": 62,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "sliding_window": 1024,
    "query_pre_attn_scalar": 168,
    "sliding_window_pattern": 6,
    "max_position_embeddings": 131_072,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
}


def gemma3_27b_config() -> Gemma3Config:
    """The Gemma-3-27B text model's dimensions (`GEMMA3_27B_HF`, from google/gemma-3-27b-it's
    config.json): for memory planning and reports; no weights are involved."""
    return Gemma3Config.from_hf(GEMMA3_27B_HF)
