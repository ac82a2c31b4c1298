"""`hkv.testing.check_model` passes on DeepSeek-V4 (tiny), Gemma 3 (tiny) and the toy hybrid model, and fails,
naming the check, on a toy model whose cached path attends one token too far."""

from __future__ import annotations

import dataclasses

import pytest
from flax import nnx

import hkv
from hkv.testing import check_model, force_route
from models import deepseek_v4, gemma3, toy

MIX = toy.ToyConfig(
    layers=(toy.Attn(window=5, num_kv_heads=2), toy.Attn(window=None), toy.Compressed(ratio=4, window=4, topk=2))
)


def test_deepseek_v4_conforms():
    model = deepseek_v4.init(deepseek_v4.tiny_config(), seed=3)
    # chunks of 2 blocks: half the restored boundaries lie inside a chunk (snapshots the step prepared)
    report = check_model(model, chunk_sizes=(32,), new_tokens=2)
    assert report.engine_options["prefill_chunk"] == 32
    assert report.window_rebuild_tokens > 0  # every DeepSeek-V4 layer is windowed: all three routes
    assert set(report.routes) == {"snapshot", "disk", "window"}
    assert report.max_abs_diff < 1e-4
    # the checked model served with the engine the check ran: its compiled programs, nothing new
    engine = hkv.Engine(model, report.engine_config, **report.engine_options)
    engine.generate([list(range(3, 40)), list(range(5, 30))], 4)
    assert engine.compilations and set(engine.compilations.values()) == {1}


def test_gemma3_conforms(tmp_path):
    # 2:1 sliding:full with GQA (tiny_config: 4 query heads on 2 KV heads); the full layer refuses the window rebuild
    model = gemma3.init(
        gemma3.tiny_config(num_hidden_layers=3, layer_types=("sliding_attention",) * 2 + ("full_attention",)), 0
    )
    report = check_model(model, chunk_sizes=(32,), new_tokens=2, disk_dir=str(tmp_path / "disk"))
    assert report.engine_options["prefill_chunk"] == 32  # boundaries inside a chunk restored too
    assert report.window_rebuild_tokens == 0
    assert set(report.routes) == {"snapshot", "disk", "window_refused"}
    assert report.max_abs_diff < 1e-4


def test_toy_hybrid_with_full_attention_conforms(tmp_path):
    model = toy.init(MIX, seed=0)
    assert isinstance(model, hkv.CachedModel)
    report = check_model(model, disk_dir=str(tmp_path / "disk"))
    assert report.window_rebuild_tokens == 0  # a full-attention layer: the window rebuild is refused
    assert set(report.routes) == {"snapshot", "disk", "window_refused"}
    assert "compilations" in report.checks and report.max_abs_diff < 1e-4


def test_toy_hybrid_conforms_in_bfloat16_bit_for_bit():
    """The toy model in bfloat16 (weights, activations and cache): its embedding computed in float32,
    so every engine call failed on a cache of another dtype than its K/V rows."""
    model = toy.init(dataclasses.replace(MIX, dtype="bfloat16"), seed=0)
    report = check_model(model, chunk_sizes=(16,), new_tokens=2)
    assert set(report.routes) == {"snapshot", "disk", "window_refused"}
    assert report.max_abs_diff == 0.0


class TooFar(toy.ToyModel):
    """Broken on purpose: its cache spec (so its cached path) attends one token further than its forward."""

    def cache_spec(self, block_tokens: int = 16, model_id: str = "toy"):
        spec = super().cache_spec(block_tokens, model_id)
        wider = [dataclasses.replace(s, window=s.window + 1) if s.window else s for s in spec.layers]
        return dataclasses.replace(spec, layers=tuple(wider))


def test_check_model_fails_on_a_model_that_attends_one_token_too_far():
    model = TooFar(toy.ToyConfig(layers=(toy.Attn(window=3), toy.Attn(window=4))), nnx.Rngs(0))
    with pytest.raises(AssertionError, match=r"check_model: stateless\[chunk=32\].*max \|Δ logits\|"):
        check_model(model, chunk_sizes=(32,), new_tokens=1)


def test_check_model_fails_on_something_that_is_not_a_cached_model():
    with pytest.raises(AssertionError, match="check_model: protocol"):
        check_model(object())


def test_force_route_names_an_unknown_route_and_changes_nothing():
    class Untouched:  # force_route must refuse before it reaches the engine
        @property
        def prefix_manager(self):
            raise AssertionError("force_route touched the engine before checking the route")

    with pytest.raises(ValueError, match=r"route='disc' must be None or one of \('shrink', 'window', 'disk'\)"):
        force_route(Untouched(), "disc")
