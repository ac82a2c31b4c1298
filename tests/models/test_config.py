"""DeepSeek-V4 config parsing: transformers' layout, the original release's legacy keys, named errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from models.deepseek_v4.config import (
    CSA,
    HASH_MOE,
    HCA,
    MOE,
    SLIDING,
    ConfigError,
    DeepseekV4Config,
    RopeSpec,
    tiny_config,
)


def test_round_trip_through_hf_dict():
    cfg = tiny_config(
        rope_compress=RopeSpec(theta=1e5, rope_type="yarn", factor=8.0, original_max_position_embeddings=128)
    )
    again = DeepseekV4Config.from_dict(json.loads(json.dumps(cfg.to_hf_dict())))
    assert again == cfg


def test_legacy_keys_of_the_original_release():
    d = tiny_config().to_hf_dict()
    for k in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor", "rope_parameters"):
        d.pop(k)
    d.update(
        compress_ratios=[0, 4, 128, 4],
        num_hash_layers=1,
        qk_rope_head_dim=8,
        rope_scaling={
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    cfg = DeepseekV4Config.from_dict(d)
    assert cfg.layer_types == (SLIDING, CSA, HCA, CSA)
    assert cfg.mlp_layer_types == (HASH_MOE, MOE, MOE, MOE)
    assert cfg.qk_rope_head_dim == 8
    assert cfg.rope_main.rope_type == "default" and cfg.rope_main.theta == d["rope_theta"]
    assert cfg.rope_compress.rope_type == "yarn" and cfg.rope_compress.factor == 16
    assert cfg.rope_compress.theta == d["compress_rope_theta"]


def test_transformers_default_schedule():
    cfg = DeepseekV4Config()  # the transformers default: V4-Flash dimensions
    assert cfg.layer_types[:4] == (HCA, HCA, HCA, CSA) and len(cfg.layer_types) == 43
    assert cfg.mlp_layer_types[:4] == (HASH_MOE, HASH_MOE, HASH_MOE, MOE)


@pytest.mark.parametrize(
    "change, match",
    [
        (
            {"layer_types": [SLIDING, "full_attention", HCA, CSA]},
            r"layer_types has unknown entries \['full_attention'\]",
        ),
        ({"mlp_layer_types": [MOE, MOE, "dense", MOE]}, r"mlp_layer_types has unknown entries \['dense'\]"),
        ({"layer_types": [SLIDING, CSA]}, r"len\(layer_types\)=2 must equal num_hidden_layers=4"),
        ({"compress_ratios": [0, 4, 64, 4], "layer_types": None}, r"compress_ratios entry 64"),
        ({"model_type": "llama"}, r"model_type='llama'"),
        ({"num_key_value_heads": 8}, r"num_key_value_heads=8 must be 1"),
        ({"scoring_func": "relu"}, r"scoring_func='relu' must be one of"),
        ({"hidden_size": 0}, r"hidden_size=0 must be a positive integer"),
        ({"rope_parameters": {"rope_type": "longrope"}}, r"rope_type='longrope' is not supported"),
    ],
)
def test_bad_configs_raise_named_errors(change, match):
    d = tiny_config().to_hf_dict()
    d.update(change)
    if d.get("layer_types") is None:
        d.pop("layer_types")
    with pytest.raises(ConfigError, match=match):
        DeepseekV4Config.from_dict(d)


@pytest.mark.parametrize("rope_type", ["default", "yarn"])
def test_inverse_frequencies_equal_transformers(rope_type):
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV4Config as HFConfig
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    spec = RopeSpec(theta=160000.0, rope_type=rope_type, factor=16.0, original_max_position_embeddings=65536)
    cfg = tiny_config(
        head_dim=128,
        qk_rope_head_dim=64,
        index_head_dim=64,
        max_position_embeddings=1 << 20,
        rope_compress=spec if rope_type == "yarn" else RopeSpec(theta=160000.0),
    )
    hf = DeepseekV4RotaryEmbedding(HFConfig(**cfg.to_hf_dict()))
    for fam in ("main", "compress"):
        want = getattr(hf, f"{fam}_inv_freq").numpy()
        got = cfg.rope_for[fam].inv_freq(cfg.qk_rope_head_dim, cfg.max_position_embeddings)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
        assert getattr(hf, f"{fam}_attention_scaling") == cfg.rope_for[fam].attention_factor
    assert torch is not None
