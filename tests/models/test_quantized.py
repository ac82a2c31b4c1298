"""FP8 / FP4 weights kept quantized on the device (issue 45, item 1).

A release-format checkpoint (`write_release_checkpoint`: block-scaled FP8 attention and shared experts,
packed FP4 routed experts with ue8m0 scales) loads with its weights in their storage dtypes, a fraction
of the dequantized model's bytes, and computes bitwise the logits and tokens of `load(dequantize=True)`:
stateless, through `hkv.Engine`, and through `hkv.MeshEngine` on a (2, 4) mesh of the 8 host devices
with the routed experts split over 4 of them (`slow`, with the bfloat16 logits).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import hkv
from models.deepseek_v4 import forward_fn, load, random_tensors, tiny_config
from models.deepseek_v4.checkpoint import read_checkpoint, read_config
from models.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING
from models.deepseek_v4.quant_format import FP4, FP8, QuantizedTensor, quantize_fp4, quantize_fp8
from models.deepseek_v4.quantized import QuantizedLinear, dequantize_device, weight, weight_bytes
from models.deepseek_v4.release import write_release_checkpoint

CFG = tiny_config()
IDS = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 40))
CONF = hkv.CacheConfig(slots=8, max_context=160, page_size=8, prefix_records=32)
OPTS = {"block_tokens": 16, "prefill_chunk": 32}
_rng = np.random.default_rng(1)
PROMPTS = [_rng.integers(0, CFG.vocab_size, n).tolist() for n in (40, 57, 33, 70)]


def bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    path = tmp_path_factory.mktemp("release")
    write_release_checkpoint(path, CFG, random_tensors(CFG, seed=4), fp8_block=16)
    return path


@pytest.fixture(scope="module")
def models(release):
    return load(release, dtype=jnp.float32), load(release, dtype=jnp.float32, dequantize=True)


@pytest.fixture(scope="module")
def reference_tokens(models):
    return [g.tokens for g in hkv.Engine(models[1], CONF, **OPTS).generate(PROMPTS, 6)]


# ------------------------------------------------------------------------------------- the formats
@pytest.mark.parametrize(
    "make",
    [
        lambda w: quantize_fp8(w, 16),  # ragged last blocks: 40 rows, 72 columns
        lambda w: quantize_fp8(w, 128),  # one block, smaller than 128 x 128
        lambda w: quantize_fp4(w[..., :64], 32),
        lambda w: QuantizedTensor(  # bfloat16 scales, blocks that divide the weight
            w.astype(ml_dtypes.float8_e5m2), np.full((3, 5, 9), 0.5, ml_dtypes.bfloat16), FP8, (8, 8)
        ),
    ],
    ids=["fp8-ragged", "fp8-one-block", "fp4", "e5m2-bf16-scales"],
)
def test_device_dequantization_is_the_host_bits_and_close_to_the_weight(make):
    w = np.random.default_rng(2).normal(0, 0.02, (3, 40, 72)).astype(np.float32)
    q = make(w)
    host = q.dequantize()
    assert host.shape == q.shape and host.dtype == np.float32
    device = dequantize_device(jnp.asarray(q.data), jnp.asarray(q.scale), q.fmt, q.block)
    np.testing.assert_array_equal(bits(device), bits(host))
    if q.scale.dtype != ml_dtypes.bfloat16:  # a quantizer's output: within the format's precision
        ref = w[..., : q.shape[-1]]
        tolerance = 0.07 if q.fmt == FP8 else 0.2  # e4m3 keeps 3 mantissa bits, e2m1 one
        assert np.abs(host - ref).max() <= tolerance * np.abs(ref).max()


def test_fp4_packs_two_values_per_byte_with_power_of_two_scales():
    w = np.array([[0.5, -1.0, 6.0, -6.0] + [0.0] * 28, [3.0] * 32], np.float32) * 4.0  # scale 4 = 2**2
    q = quantize_fp4(w)
    assert q.data.dtype == np.uint8 and q.data.shape == (2, 16)
    assert q.scale.dtype == ml_dtypes.float8_e8m0fnu and q.scale.shape == (2, 1)
    np.testing.assert_array_equal(q.scale.astype(np.float32), [[4.0], [2.0]])  # 12/6 = 2: the smallest fit
    np.testing.assert_array_equal(q.data[0, :2], [0xA << 4 | 0x1, 0xF << 4 | 0x7])  # low nibble first
    np.testing.assert_array_equal(q.dequantize(), w)


def test_a_bad_quantized_tensor_is_refused_by_name():
    f8 = np.zeros((4, 8), ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"fmt='int4' must be 'fp8' or 'fp4'"):
        QuantizedTensor(f8, np.ones((1, 1), np.float32), "int4", (4, 8))
    with pytest.raises(ValueError, match=r"fp4 data dtype float8_e4m3fn must be uint8"):
        QuantizedTensor(f8, np.ones((4, 1), np.float32), FP4, (1, 16))
    with pytest.raises(ValueError, match=r"scale grid \(2, 2\) does not cover \(4, 8\) in blocks of \(4, 8\)"):
        QuantizedTensor(f8, np.ones((2, 2), np.float32), FP8, (4, 8))
    with pytest.raises(ValueError, match=r"scale dtype int32"):
        QuantizedTensor(f8, np.ones((1, 1), np.int32), FP8, (4, 8))
    with pytest.raises(ValueError, match=r"C a multiple of an even block"):
        quantize_fp4(np.zeros((2, 48), np.float32), 32)


def test_a_fused_expert_split_stays_quantized_on_block_rows():
    fused = quantize_fp8(np.random.default_rng(3).normal(size=(2, 64, 32)).astype(np.float32), 16)  # [E, 2I, D]
    gate, up = fused.part(1, slice(0, 32)), fused.part(1, slice(32, None))
    assert isinstance(gate, QuantizedTensor) and isinstance(up, QuantizedTensor)
    np.testing.assert_array_equal(gate.dequantize(), fused.dequantize()[1, :32])
    np.testing.assert_array_equal(up.dequantize(), fused.dequantize()[1, 32:])
    odd = fused.part(0, slice(0, 24))  # not on a block boundary: dequantized
    assert isinstance(odd, np.ndarray)
    np.testing.assert_array_equal(odd, fused.dequantize()[0, :24])


# ---------------------------------------------------------------------------------- the checkpoint
def test_the_release_checkpoint_keeps_its_formats(release):
    assert json.loads((release / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    tensors = read_checkpoint(release, read_config(release), keep_quantized=True)
    wq = tensors["layers.1.attn.wq_b.weight"]
    assert isinstance(wq, QuantizedTensor) and (wq.fmt, wq.data.dtype, wq.block) == (
        FP8,
        np.dtype("float8_e4m3fn"),
        (16, 16),
    )
    expert = tensors["layers.2.ffn.experts.3.w2.weight"]
    assert isinstance(expert, QuantizedTensor) and expert.fmt == FP4
    assert expert.scale.dtype == ml_dtypes.float8_e8m0fnu
    assert expert.shape == (CFG.hidden_size, CFG.moe_intermediate_size)
    assert isinstance(tensors["head.weight"], np.ndarray) and isinstance(
        tensors["layers.0.ffn.gate.weight"], np.ndarray
    )
    plain = read_checkpoint(release, read_config(release))  # the default dequantizes, the same values
    np.testing.assert_array_equal(plain["layers.2.ffn.experts.3.w2.weight"], expert.dequantize())


def test_weights_stay_quantized_on_the_device_in_a_fraction_of_the_bytes(models):
    quantized, dequantized = models
    layer = quantized.layers[1]
    assert isinstance(layer.attn.wq_b, QuantizedLinear) and layer.attn.wq_b.data.value.dtype == jnp.float8_e4m3fn
    assert isinstance(layer.attn.compressor.wkv, QuantizedLinear)
    assert isinstance(layer.attn.indexer.wq_b, QuantizedLinear)
    assert isinstance(layer.ffn.shared_w2, QuantizedLinear) and layer.ffn.shared_w2.fmt == FP8
    experts = layer.ffn.w_down
    assert experts.fmt == FP4 and experts.data.value.dtype == jnp.uint8
    assert experts.scale.value.dtype == jnp.float8_e8m0fnu
    assert experts.shape == (CFG.n_routed_experts, CFG.hidden_size, CFG.moe_intermediate_size)  # [E, out, in]
    q_bytes, d_bytes = sum(weight_bytes(quantized).values()), sum(weight_bytes(dequantized).values())
    assert q_bytes < 0.35 * d_bytes, (weight_bytes(quantized), weight_bytes(dequantized))
    np.testing.assert_array_equal(
        np.asarray(weight(quantized.layers[3].attn.wo_a)), np.asarray(dequantized.layers[3].attn.wo_a.value)
    )


@pytest.mark.parametrize(
    "dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)], ids=["float32", "bfloat16"]
)
def test_logits_are_bitwise_those_of_the_dequantized_model(release, models, dtype):
    if dtype == jnp.float32:
        quantized, dequantized = models
    else:
        quantized, dequantized = load(release, dtype=dtype), load(release, dtype=dtype, dequantize=True)
    np.testing.assert_array_equal(bits(forward_fn(quantized)(IDS)), bits(forward_fn(dequantized)(IDS)))


def test_a_sharded_release_checkpoint_loads_the_same_model(release, models, tmp_path):
    files = write_release_checkpoint(tmp_path, CFG, random_tensors(CFG, seed=4), fp8_block=16, max_shard_bytes=20_000)
    assert len([f for f in files if f.endswith(".safetensors")]) > 5
    np.testing.assert_array_equal(
        bits(forward_fn(load(tmp_path, dtype=jnp.float32))(IDS)), bits(forward_fn(models[0])(IDS))
    )


# ----------------------------------------------------------------------------------------- engines
def test_the_engine_serves_the_quantized_model_with_the_dequantized_tokens(models, reference_tokens):
    engine = hkv.Engine(models[0], CONF, **OPTS)
    assert [g.tokens for g in engine.generate(PROMPTS, 6)] == reference_tokens
    again = engine.generate([PROMPTS[1] + reference_tokens[1] + [5, 6]], 3)[0]  # a prefix restored
    assert again.plan.restored_tokens >= 48
    want = hkv.Engine(models[1], CONF, **OPTS).generate([PROMPTS[1] + reference_tokens[1] + [5, 6]], 3)[0]
    assert again.tokens == want.tokens


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 4), (8, 1), (4, 2), (1, 8)], ids=str)
def test_the_mesh_engine_splits_the_quantized_experts_and_keeps_the_tokens(release, reference_tokens, shape):
    """The issue's check: `load(..., mesh=)` streams the release checkpoint onto the mesh, FP8 and FP4
    stay, the experts are split over the model-axis devices (where that axis divides the 4 experts),
    and `hkv.Engine(model, config, mesh=mesh)` gives the dequantized single-device engine's greedy
    tokens."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), ("data", "model"))
    engine = hkv.Engine(load(release, dtype=jnp.float32, mesh=mesh), CONF, mesh=mesh, **OPTS)
    assert isinstance(engine, hkv.MeshEngine)
    assert [g.tokens for g in engine.generate(PROMPTS, 6)] == reference_tokens
    leaves = dict(nnx.to_flat_state(engine._weights))
    fp8 = [k for k, v in leaves.items() if v.value.dtype == jnp.float8_e4m3fn]
    assert fp8, "no FP8 weight on the devices"
    experts = [
        v.value for k, v in leaves.items() if k[-3:] == ("w_gate", "data", "value") or k[-2:] == ("w_gate", "data")
    ]
    assert experts
    split = shape[1] if CFG.n_routed_experts % shape[1] == 0 else 1  # (1, 8): 4 experts stay whole
    for data in experts:  # each model-axis device holds its share of the experts
        assert data.dtype == jnp.uint8
        shard = data.addressable_shards[0].data
        assert shard.shape[-3] * split == data.shape[-3], (shard.shape, data.shape)


@pytest.mark.slow
def test_dp_attention_with_the_experts_over_every_device_keeps_the_tokens(tmp_path):
    """The 8 x H200 layout on 8 host devices: `load(..., mesh=(2, 4), expert_axes=("data", "model"))`
    streams an 8-expert release checkpoint with each device holding one FP4 expert (no replica), and
    `hkv.Engine(model, config, mesh=mesh, expert_axes=...)` gives the dequantized single-device
    engine's greedy tokens."""
    cfg = tiny_config(n_routed_experts=8)
    write_release_checkpoint(tmp_path, cfg, random_tensors(cfg, seed=4), fp8_block=16)
    prompts = [p[:50] for p in PROMPTS]
    want = [
        g.tokens
        for g in hkv.Engine(load(tmp_path, dtype=jnp.float32, dequantize=True), CONF, **OPTS).generate(prompts, 6)
    ]
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    axes = ("data", "model")
    model = load(tmp_path, dtype=jnp.float32, mesh=mesh, expert_axes=axes)
    leaves = dict(nnx.to_flat_state(nnx.state(model)))
    stacks = [v.get_value() for k, v in leaves.items() if k[-2:] == ("w_gate", "data")]
    assert stacks and all(a.dtype == jnp.uint8 for a in stacks)
    for a in stacks:  # one expert per device, no two devices the same
        assert {s.data.shape[-3] for s in a.addressable_shards} == {1}
        assert len({s.index[-3].start for s in a.addressable_shards}) == 8
    engine = hkv.Engine(model, CONF, mesh=mesh, expert_axes=axes, **OPTS)
    assert isinstance(engine, hkv.MeshEngine)
    assert [g.tokens for g in engine.generate(prompts, 6)] == want


# ------------------------------------------------------------------------- a scanned quantized run
# layer 0 unrolled, then (CSA, HCA) x 3 held stacked and run under one scan (3 repetitions: no stacked
# shape is mistaken for a product's batch padded to 2)
REPEATING = tiny_config(num_hidden_layers=7, layer_types=(SLIDING,) + (CSA, HCA) * 3,
                        mlp_layer_types=(HASH_MOE,) + (MOE,) * 6)  # fmt: skip


def test_a_scanned_run_of_quantized_layers_is_converted_one_layer_at_a_time(tmp_path):
    """XLA:CPU has no arithmetic in float8 / float8_e8m0fnu and converts an operand of one to a wider
    type first. A scan over a stacked run's quantized weights had every layer of the run converted
    at once, outside the loop (f16 / f32 copies of the stacked weights and scale grids: 8 of the 10
    GB of temporaries per device of DeepSeek-V4-Flash's decode step at (1, 8)). The run's one-byte
    floats enter the scan as bytes (`models.layer_stack`): the compiled cached step holds no wider
    array of a stacked one-byte weight's shape, and the logits stay the dequantized model's bits."""
    write_release_checkpoint(tmp_path, REPEATING, random_tensors(REPEATING, seed=5), fp8_block=16)
    quantized, dense = load(tmp_path, dtype=jnp.float32), load(tmp_path, dtype=jnp.float32, dequantize=True)
    layers = quantized.layers
    runs = [layers.groups[g] for g, r in enumerate(layers.runs) if r.count > 1]
    stacked = [x for run in runs for x in jax.tree.leaves(nnx.state(run))]
    one_byte = [x for x in stacked if x.dtype.itemsize == 1 and jnp.issubdtype(x.dtype, jnp.floating)]
    assert {x.dtype.name for x in one_byte} >= {"float8_e4m3fn", "float8_e8m0fnu"}
    ids = jnp.asarray(IDS[:, :24], jnp.int32)
    np.testing.assert_array_equal(bits(forward_fn(quantized)(ids)), bits(forward_fn(dense)(ids)))

    config = hkv.CacheConfig(slots=1, max_context=32, page_size=4, prefix_records=0)
    layout = hkv.CacheLayout(quantized.cache_spec(), config)
    graphdef, state = nnx.split(quantized)
    one = jnp.ones((1,), jnp.int32)

    def step(state, cache):
        return nnx.merge(graphdef, state).cached_step(layout, cache, jnp.zeros((1, 1), jnp.int32), one * 0, one)

    hlo = jax.jit(step).lower(state, hkv.init_cache(layout)).compile().as_text()
    wide = [f"{t}[{','.join(map(str, x.shape))}]" for x in one_byte for t in ("f16", "bf16", "f32")]
    assert not [w for w in wide if w in hlo]
