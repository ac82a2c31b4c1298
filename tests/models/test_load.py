"""`models.deepseek_v4.load` end to end: sharded, bf16 and FP8/FP4-quantized checkpoints, named errors."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from models.deepseek_v4 import DeepseekV4, forward_fn, load, tiny_config
from models.deepseek_v4.checkpoint import CheckpointError, canonical_name, read_safetensors, write_safetensors
from models.deepseek_v4.quantized import weight

from .hf_reference import build_hf_model, save_hf_model

IDS = np.random.default_rng(3).integers(0, 128, (1, 80))


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_model(tiny_config(), seed=5)


@pytest.fixture(scope="module")
def reference(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("single")
    save_hf_model(hf_model, path)
    model = load(path, dtype=jnp.float32)
    return path, model, np.asarray(forward_fn(model)(IDS))


def test_sharded_checkpoint_loads_identically(hf_model, reference, tmp_path):
    save_hf_model(hf_model, tmp_path, max_shard_size="40KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 3
    got = np.asarray(forward_fn(load(tmp_path, dtype=jnp.float32))(IDS))
    np.testing.assert_array_equal(got, reference[2])


def test_bf16_checkpoint_runs_in_bf16_close_to_transformers_bf16(hf_model, reference, tmp_path):
    hf16 = build_hf_model(tiny_config(), seed=5).to(torch.bfloat16)
    save_hf_model(hf16, tmp_path)
    stored = read_safetensors(tmp_path / "model.safetensors")
    assert stored["model.layers.0.attn.wq_a.weight"].dtype == ml_dtypes.bfloat16
    model = load(tmp_path, dtype=jnp.bfloat16)
    assert model.layers[0].attn.wq_a.value.dtype == jnp.bfloat16
    assert model.layers[0].hc_attn.fn.value.dtype == jnp.float32  # kept in fp32 like transformers
    got = np.asarray(forward_fn(model)(IDS))
    with torch.no_grad():
        want = hf16(torch.tensor(IDS)).logits.float().numpy()
    # bf16 keeps ~3 significant digits and the two implementations round in different places (an
    # indexer top-k pick can flip), so compare in aggregate: mean error ~1% of the logit scale.
    scale = np.abs(want).max()
    assert np.mean(np.abs(got - want)) < 0.01 * scale
    assert np.mean(got.argmax(-1) == want.argmax(-1)) > 0.9


def _quantize_fp8(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """e4m3 weight + float32 block scales [ceil(R/b), ceil(C/b)] (DeepSeek's layout)."""
    r, c = w.shape
    gr, gc = -(-r // block), -(-c // block)
    scale = np.zeros((gr, gc), np.float32)
    q = np.zeros_like(w, dtype=ml_dtypes.float8_e4m3fn)
    for i in range(gr):
        for j in range(gc):
            blk = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            s = max(np.abs(blk).max() / 448.0, 1e-12)
            scale[i, j] = s
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (blk / s).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def _quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Packed e2m1 (low nibble first) + power-of-two scales per 32 columns as uint8 (2**(b-127))."""
    r, c = w.shape
    blocks = w.reshape(r, c // 32, 32)
    exp = np.ceil(np.log2(np.maximum(np.abs(blocks).max(-1), 1e-30) / 6.0)).astype(np.int32)
    scaled = blocks / np.exp2(exp)[..., None]
    mag = np.abs(scaled)[..., None]
    code = np.argmin(np.abs(mag - _E2M1), axis=-1).astype(np.uint8) | np.where(scaled < 0, 8, 0).astype(np.uint8)
    code = code.reshape(r, c)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, (exp + 127).astype(np.uint8)


def _fp4_reference(packed: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    """Decode packed e2m1 from its bits (independent of the loader's lookup table)."""
    u = packed.view(np.uint8)
    codes = np.stack([u & 0xF, u >> 4], axis=-1).reshape(u.shape[0], -1)
    vals = _E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0).astype(np.float32)
    return vals * np.repeat(np.exp2(scale_bytes.astype(np.float32) - 127), 32, axis=1)


def test_fp8_and_fp4_checkpoint_dequantized_on_load_or_kept_quantized(reference, tmp_path):
    path, model, logits = reference
    src = read_safetensors(path / "model.safetensors")
    out, dequantized = {}, {}
    for name, arr in src.items():
        a = np.asarray(arr)
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base and ".experts." in name and "shared" not in name:  # FP4 routed experts, [1, 32] blocks
            q, s = _quantize_fp4(a)
            out[name], out[base + ".scale"] = q, s
            dequantized[canonical_name(name)] = _fp4_reference(q, s)
        elif base and a.ndim == 2 and ("wq_" in name or "wo_" in name or name.endswith("attn.wkv.weight")):
            q, s = _quantize_fp8(a, 16)  # FP8 e4m3, 16x16 blocks
            out[name], out[base + ".scale"] = q, s
            up = np.repeat(np.repeat(s, 16, 0), 16, 1)[: a.shape[0], : a.shape[1]]
            dequantized[canonical_name(name)] = q.astype(np.float32) * up
        else:
            out[name] = a
    assert len(dequantized) > 40
    write_safetensors(tmp_path / "model.safetensors", out)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [16, 16],
        "expert_dtype": "fp4",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    qmodel = load(tmp_path, dtype=jnp.float32, dequantize=True)
    assert qmodel.cfg.quantization == "fp8"
    np.testing.assert_array_equal(
        np.asarray(qmodel.layers[0].attn.wq_a.value), dequantized["layers.0.attn.wq_a.weight"]
    )
    kept = load(tmp_path, dtype=jnp.float32)  # the default keeps them quantized, the same values
    np.testing.assert_array_equal(
        np.asarray(weight(kept.layers[0].attn.wq_a)), dequantized["layers.0.attn.wq_a.weight"]
    )
    # The whole model equals one built from independently dequantized weights.
    canonical = {canonical_name(k): np.asarray(v) for k, v in src.items()}
    canonical.update(dequantized)
    want = np.asarray(forward_fn(DeepseekV4(model.cfg, canonical, jnp.float32))(IDS))
    got = np.asarray(forward_fn(qmodel)(IDS))
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    assert not np.allclose(got, logits, atol=1e-3)  # the quantization really happened
    np.testing.assert_array_equal(np.asarray(forward_fn(kept)(IDS)), got)


def test_unknown_quantization_is_rejected_by_name(reference, tmp_path):
    path, _, _ = reference
    for f in os.listdir(path):
        (tmp_path / f).write_bytes((path / f).read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="gptq"):
        load(tmp_path)


def test_missing_and_misshaped_tensors_are_each_named(reference, tmp_path):
    path, _, _ = reference
    src = {k: np.asarray(v) for k, v in read_safetensors(path / "model.safetensors").items()}
    del src["model.layers.1.attn.indexer.wq_b.weight"]
    src["model.layers.2.attn.compressor.ape"] = np.zeros((3, 3), np.float32)
    src["model.layers.0.attn.bogus"] = np.zeros((2,), np.float32)
    write_safetensors(tmp_path / "model.safetensors", src)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError) as e:
        load(tmp_path)
    msg = str(e.value)
    assert "layers.1.attn.indexer.wq_b.weight" in msg and "missing" in msg
    assert "layers.2.attn.compressor.ape" in msg and "(16, 32)" in msg and "(3, 3)" in msg
    assert "layers.0.attn.bogus" in msg


def test_config_with_unknown_layer_type_is_rejected(reference, tmp_path):
    path, _, _ = reference
    cfg = json.loads((path / "config.json").read_text())
    cfg["layer_types"][2] = "linear_attention"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match=r"layer_types has unknown entries .'linear_attention'."):
        load(tmp_path)


def test_bad_token_ids_raise_before_running(reference):
    _, model, _ = reference
    with pytest.raises(ValueError, match=r"must lie in \[0, vocab_size=128\)"):
        forward_fn(model)(np.array([[1, 2, 128]]))
    with pytest.raises(ValueError, match=r"tokens.shape=\(3,\) must be \[batch, T\]"):
        forward_fn(model)(np.array([1, 2, 3]))
    assert isinstance(model, DeepseekV4)
