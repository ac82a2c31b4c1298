"""Tests of models/deepseek_v4/checkpoint.py: safetensors I/O, naming schemes, dequantization, validation."""

from __future__ import annotations

import itertools
import json
import math
import os

import ml_dtypes
import numpy as np
import pytest

from models.deepseek_v4 import checkpoint as ck
from models.deepseek_v4.checkpoint import CheckpointError
from models.deepseek_v4.config import tiny_config
from models.deepseek_v4.tensor_layout import expected_tensors

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
E5M2 = ml_dtypes.float8_e5m2
E8M0 = ml_dtypes.float8_e8m0fnu


# ------------------------------------------------------------------------------------------ helpers
def _bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def _all_dtype_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    f = rng.standard_normal((3, 5)).astype(np.float32)
    return {
        "f64": rng.standard_normal((2, 3)),
        "f32": f,
        "f16": f.astype(np.float16),
        "bf16": f.astype(BF16),
        "e4m3": f.astype(E4M3),
        "e5m2": f.astype(E5M2),
        "e8m0": np.exp2(rng.integers(-5, 5, (4,))).astype(np.float32).astype(E8M0),
        "i64": rng.integers(-(2**40), 2**40, (7,), dtype=np.int64),
        "i32": rng.integers(-(2**30), 2**30, (2, 2), dtype=np.int32),
        "i16": rng.integers(-300, 300, (3,), dtype=np.int16),
        "i8": rng.integers(-100, 100, (5,), dtype=np.int8),
        "u8": rng.integers(0, 255, (2, 3), dtype=np.uint8),
        "bool": np.array([True, False, True]),
        "scalar": np.array(3.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }


def _raw_file(path, header: dict, data: bytes, header_len: int | None = None) -> str:
    h = json.dumps(header).encode()
    n = len(h) if header_len is None else header_len
    with open(path, "wb") as f:
        f.write(n.to_bytes(8, "little") + h + data)
    return str(path)


def _e2m1_by_bits(nibble: int) -> float:
    """e2m1 decoded from its bits (sign | 2 exponent | 1 mantissa), independent of any lookup table."""
    sign = -1.0 if nibble & 0x8 else 1.0
    e, m = (nibble >> 1) & 0x3, nibble & 0x1
    return sign * (m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))


def _ref_dequant_fp8(q: np.ndarray, s: np.ndarray, bm: int, bn: int) -> np.ndarray:
    """Loop-per-block reference: block (i, j) covers rows [i*bm, (i+1)*bm) x cols [j*bn, (j+1)*bn)."""
    out = np.zeros(q.shape, np.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = q[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn].astype(np.float32)
            out[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = blk * np.float32(s[i, j])
    return out


def _ref_dequant_fp4(packed: np.ndarray, s: np.ndarray) -> np.ndarray:
    """packed uint8/int8 [R, C/2] with scales [R, C/32] -> float32 [R, C], element by element."""
    u8 = packed.view(np.uint8)
    rows, half = u8.shape
    out = np.zeros((rows, 2 * half), np.float32)
    for r in range(rows):
        for c in range(2 * half):
            byte = int(u8[r, c // 2])
            nib = byte & 0xF if c % 2 == 0 else byte >> 4
            out[r, c] = _e2m1_by_bits(nib) * float(s[r, c // 32])
    return out


def _quantize_fp8(w: np.ndarray, bm: int, bn: int) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-style block FP8: power-of-two (ue8m0) scale per (bm, bn) block, ceil grid."""
    rows, cols = w.shape
    sr, sc = -(-rows // bm), -(-cols // bn)
    s = np.zeros((sr, sc), np.float32)
    q = np.zeros(w.shape, E4M3)
    for i in range(sr):
        for j in range(sc):
            blk = w[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            amax = max(float(np.abs(blk).max()), 1e-30)
            s[i, j] = 2.0 ** math.ceil(math.log2(amax / 448.0))
            q[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = (blk / s[i, j]).astype(E4M3)
    return q, s


_E2M1_VALUES = np.array([_e2m1_by_bits(n) for n in range(16)], np.float32)


def _quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row, 32-column blocks; power-of-two scales; nearest e2m1 code; LOW nibble = even column."""
    rows, cols = w.shape
    s = np.zeros((rows, cols // 32), np.float32)
    codes = np.zeros(w.shape, np.uint8)
    for r in range(rows):
        for j in range(cols // 32):
            blk = w[r, j * 32 : (j + 1) * 32]
            s[r, j] = 2.0 ** math.ceil(math.log2(max(float(np.abs(blk).max()), 1e-30) / 6.0))
            codes[r, j * 32 : (j + 1) * 32] = np.abs((blk / s[r, j])[:, None] - _E2M1_VALUES[None, :]).argmin(-1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, s


# ---------------------------------------------------------------------------------- safetensors I/O
def test_roundtrip_every_dtype_is_bit_exact_and_memory_mapped(tmp_path):
    tensors = _all_dtype_tensors(np.random.default_rng(0))
    p = tmp_path / "t.safetensors"
    ck.write_safetensors(p, tensors, metadata={"format": "np", "note": "x"})
    back = ck.read_safetensors(p)
    assert set(back) == set(tensors)
    for k, a in tensors.items():
        assert back[k].dtype == a.dtype, k
        assert back[k].shape == a.shape, k
        assert _bytes(back[k]) == _bytes(a), k
    assert ck.read_safetensors_metadata(p) == {"format": "np", "note": "x"}
    # zero-copy: views of a read-only memmap, not arrays read into RAM
    base = back["f32"]
    while base.base is not None and not isinstance(base, np.memmap):
        base = base.base
    assert isinstance(base, np.memmap)
    assert not back["f32"].flags.writeable
    # layout: no gaps, header padded to 8, every tensor aligned to its itemsize
    n = int.from_bytes(p.read_bytes()[:8], "little")
    assert n % 8 == 0
    header = json.loads(p.read_bytes()[8 : 8 + n])
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and spans[-1][1] == p.stat().st_size - 8 - n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    for k, v in header.items():
        if k != "__metadata__":
            assert v["data_offsets"][0] % tensors[k].dtype.itemsize == 0, k


def test_write_is_atomic_and_rejects_unsupported_dtype(tmp_path, monkeypatch):
    p = tmp_path / "t.safetensors"
    ck.write_safetensors(p, {"a": np.ones(3, np.float32)})
    with pytest.raises(CheckpointError, match=r"'bad'.*complex64"):
        ck.write_safetensors(p, {"ok": np.ones(2, np.float32), "bad": np.ones(2, np.complex64)})

    def failing_replace(src, dst):
        assert os.path.getsize(src) > 0 and os.path.dirname(src) == str(tmp_path)  # fully written temp file
        raise OSError("disk full")

    monkeypatch.setattr(ck.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        ck.write_safetensors(p, {"b": np.ones(4, np.float32)})
    monkeypatch.undo()
    assert list(ck.read_safetensors(p)) == ["a"]  # the old file is intact
    assert sorted(os.listdir(tmp_path)) == ["t.safetensors"]  # no temp file left behind
    with pytest.raises(CheckpointError, match="metadata"):
        ck.write_safetensors(p, {"a": np.ones(1, np.float32)}, metadata={"k": 1})


def test_big_endian_input_is_stored_little_endian(tmp_path):
    a = np.arange(6, dtype=">i4").reshape(2, 3)
    p = tmp_path / "be.safetensors"
    ck.write_safetensors(p, {"a": a})
    back = ck.read_safetensors(p)["a"]
    assert back.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(back, a)


def _torch_interop_tensors(torch):
    g = torch.Generator().manual_seed(0)
    f = torch.randn(4, 6, generator=g)
    return {
        "f64": torch.randn(2, 3, generator=g, dtype=torch.float64),
        "f32": f,
        "f16": f.half(),
        "bf16": f.bfloat16(),
        "e4m3": f.to(torch.float8_e4m3fn),
        "e5m2": f.to(torch.float8_e5m2),
        "e8m0": torch.tensor([0.25, 1.0, 8.0]).to(torch.float8_e8m0fnu),
        "i64": torch.randint(-(2**40), 2**40, (5,), generator=g),
        "i32": torch.randint(-100, 100, (2, 2), generator=g, dtype=torch.int32),
        "i16": torch.randint(-100, 100, (3,), generator=g, dtype=torch.int16),
        "i8": torch.randint(-100, 100, (3,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (3,), generator=g, dtype=torch.uint8),
        "bool": torch.tensor([True, False]),
    }


def _torch_bytes(t) -> bytes:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_reads_files_written_by_the_safetensors_package(tmp_path):
    pytest.importorskip("safetensors")
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    tensors = _torch_interop_tensors(torch)
    p = tmp_path / "pkg.safetensors"
    save_file(tensors, str(p), metadata={"format": "pt"})
    back = ck.read_safetensors(p)
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].shape == tuple(t.shape), k
        assert back[k].dtype.itemsize == t.element_size(), k
        assert _bytes(back[k]) == _torch_bytes(t), k
    assert back["bf16"].dtype == BF16 and back["e4m3"].dtype == E4M3 and back["e8m0"].dtype == E8M0
    np.testing.assert_array_equal(back["f32"], tensors["f32"].numpy())
    np.testing.assert_array_equal(back["bf16"].astype(np.float32), tensors["bf16"].float().numpy())
    assert ck.read_safetensors_metadata(p) == {"format": "pt"}


def test_the_safetensors_package_reads_our_files(tmp_path):
    pytest.importorskip("safetensors")
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = _torch_interop_tensors(torch)
    ours = {}
    for k, t in tensors.items():  # byte-exact numpy copies with the matching numpy dtype
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        np_dtype = {
            "bf16": BF16,
            "e4m3": E4M3,
            "e5m2": E5M2,
            "e8m0": E8M0,
        }.get(k) or t.numpy().dtype
        ours[k] = raw.view(np_dtype).reshape(tuple(t.shape))
    p = tmp_path / "ours.safetensors"
    ck.write_safetensors(p, ours, metadata={"who": "hkv"})
    back = load_file(str(p))
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype, k
        assert _torch_bytes(back[k]) == _torch_bytes(t), k
    with safe_open(str(p), "pt") as f:
        assert f.metadata() == {"who": "hkv"}


_GOOD = {
    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    "b": {"dtype": "I32", "shape": [1], "data_offsets": [8, 12]},
}


@pytest.mark.parametrize(
    "header,data,header_len,pattern",
    [
        ({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8, None, r"'a'.*unknown dtype 'C64'"),
        (_GOOD, b"\0" * 12, 10**6, r"header length 1000000 overruns"),
        (_GOOD, b"\0" * 10, None, r"'b'.*out of range.*truncated"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            None,
            r"'a'.*'b'.*overlap",
        ),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, r"'a'.*needs 12"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, None, r"'a'.*begin <= end"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, None, r"'a'.*shape"),
    ],
    ids=["unknown-dtype", "header-overrun", "truncated", "overlap", "size-mismatch", "reversed-offsets", "bad-shape"],
)
def test_corrupt_files_raise_naming_file_and_tensor(tmp_path, header, data, header_len, pattern):
    p = _raw_file(tmp_path / "bad.safetensors", header, data, header_len)
    with pytest.raises(CheckpointError, match=pattern) as ei:
        ck.read_safetensors(p)
    assert "bad.safetensors" in str(ei.value)


def test_truncated_real_file_and_garbage(tmp_path):
    p = tmp_path / "t.safetensors"
    ck.write_safetensors(p, {"w": np.ones((4, 4), np.float32)})
    ck.read_safetensors(p)
    raw = p.read_bytes()
    p.write_bytes(raw[:-5])
    with pytest.raises(CheckpointError, match=r"t\.safetensors: tensor 'w'.*out of range"):
        ck.read_safetensors(p)
    p.write_bytes(raw[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        ck.read_safetensors(p)
    p.write_bytes((4).to_bytes(8, "little") + b"{{{{")
    with pytest.raises(CheckpointError, match="not valid UTF-8 JSON"):
        ck.read_safetensors(p)
    with pytest.raises(CheckpointError, match="cannot read"):
        ck.read_safetensors(tmp_path / "nope.safetensors")


# ----------------------------------------------------------------------------------------- names
@pytest.mark.parametrize(
    "name,canon",
    [
        # (a) original release
        ("layers.3.attn.compressor.ape", "layers.3.attn.compressor.ape"),
        ("layers.0.ffn.experts.5.w1.weight", "layers.0.ffn.experts.5.w1.weight"),
        ("layers.0.attn.wq_a.scale", "layers.0.attn.wq_a.scale"),
        ("layers.2.hc_attn_scale", "layers.2.hc_attn_scale"),
        ("hc_head_scale", "hc_head_scale"),
        ("head.weight", "head.weight"),
        # (b) save_pretrained
        ("model.embed_tokens.weight", "embed.weight"),
        ("model.hc_head.hc_fn", "hc_head_fn"),
        ("model.hc_head.hc_scale", "hc_head_scale"),
        ("lm_head.weight", "head.weight"),
        ("model.norm.weight", "norm.weight"),
        ("model.layers.1.attn.indexer.compressor.wkv.weight", "layers.1.attn.indexer.compressor.wkv.weight"),
        ("model.layers.1.ffn.experts.0.w2.weight_scale_inv", "layers.1.ffn.experts.0.w2.scale"),
        # (c) in-memory
        ("model.layers.1.self_attn.q_a_proj.weight", "layers.1.attn.wq_a.weight"),
        ("model.layers.1.self_attn.q_a_proj.weight_scale_inv", "layers.1.attn.wq_a.scale"),
        (
            "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight",
            "layers.1.attn.indexer.weights_proj.weight",
        ),
        ("model.layers.1.self_attn.compressor.indexer.position_bias", "layers.1.attn.indexer.compressor.ape"),
        ("model.layers.1.self_attn.compressor.indexer.kv_norm.weight", "layers.1.attn.indexer.compressor.norm.weight"),
        ("model.layers.1.self_attn.compressor.indexer.q_b_proj.weight", "layers.1.attn.indexer.wq_b.weight"),
        ("model.layers.1.self_attn.kv_norm.weight", "layers.1.attn.norm.weight"),
        ("model.layers.1.self_attn.sinks", "layers.1.attn.attn_sink"),
        ("model.layers.2.mlp.gate.e_score_correction_bias", "layers.2.ffn.gate.bias"),
        ("model.layers.2.mlp.shared_experts.up_proj.weight", "layers.2.ffn.shared_experts.w3.weight"),
        ("model.layers.2.mlp.experts.gate_up_proj", "layers.2.ffn.experts.gate_up_proj"),
        ("model.layers.2.mlp.experts.gate_up_proj_scale_inv", "layers.2.ffn.experts.gate_up_proj.scale"),
        ("model.layers.2.attn_hc.scale", "layers.2.hc_attn_scale"),
        ("model.layers.2.ffn_hc.fn", "layers.2.hc_ffn_fn"),
        ("model.layers.2.post_attention_layernorm.weight", "layers.2.ffn_norm.weight"),
        # ignored
        ("mtp.0.attn.wq_a.weight", None),
        ("model.mtp.1.ffn.gate.weight", None),
        ("model.rotary_emb.main_inv_freq", None),
        ("model.layers.1.self_attn.compressor.rotary_emb.compress_original_inv_freq", None),
        # unknown names pass through (then reported as unexpected)
        ("model.layers.0.self_attn.bogus.weight", "layers.0.self_attn.bogus.weight"),
    ],
)
def test_canonical_name(name, canon):
    assert ck.canonical_name(name) == canon


# --------------------------------------------------------------------- tiny transformers model
@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny transformers DeepseekV4ForCausalLM with every tensor randomised, saved with save_pretrained."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config()
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**cfg.to_hf_dict()))
    with torch.no_grad():
        for v in model.state_dict().values():
            if v.is_floating_point():
                v.copy_(torch.randn(v.shape))
            else:
                v.copy_(torch.randint(0, cfg.n_routed_experts, v.shape))
    d = tmp_path_factory.mktemp("hf")
    model.save_pretrained(str(d))
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return cfg, d, sd


def _scheme_a(saved: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The original DeepSeek names, derived from a save_pretrained file."""
    top = {
        "model.embed_tokens.weight": "embed.weight",
        "model.hc_head.hc_fn": "hc_head_fn",
        "model.hc_head.hc_base": "hc_head_base",
        "model.hc_head.hc_scale": "hc_head_scale",
    }
    out = {}
    for k, v in saved.items():
        k2 = top.get(k) or (k[len("model.") :] if k.startswith("model.") else k)
        out[k2] = np.array(v)
    return out


@pytest.fixture(scope="module")
def canon():
    """(tiny config, scheme-(a) tensors with random values): exactly `expected_tensors(cfg)`, numpy only."""
    cfg = tiny_config()
    rng = np.random.default_rng(7)
    a = {}
    for k, (shape, kind) in expected_tensors(cfg).items():
        if kind == "int":
            a[k] = rng.integers(0, cfg.n_routed_experts, shape, dtype=np.int64)
        else:
            a[k] = rng.standard_normal(shape).astype(np.float32)
    return cfg, a


def _write_config(directory, cfg, **extra) -> None:
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**cfg.to_hf_dict(), **extra}, f)


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_scheme_b_save_pretrained_maps_to_expected(hf):
    cfg, d, sd = hf
    saved = ck.read_safetensors(d / "model.safetensors")
    assert "model.embed_tokens.weight" in saved and "head.weight" in saved  # really scheme (b)
    out = ck.read_checkpoint(d, cfg)
    exp = expected_tensors(cfg)
    assert list(out) == list(exp)
    for k, (shape, kind) in exp.items():
        assert out[k].shape == shape, k
        assert (out[k].dtype.kind == "i") == (kind == "int"), k
    np.testing.assert_array_equal(out["embed.weight"], sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(out["head.weight"], sd["lm_head.weight"])
    np.testing.assert_array_equal(out["hc_head_fn"], sd["model.hc_head.hc_fn"])
    assert ck.read_config(d) == cfg


def test_scheme_a_original_names(hf, tmp_path):
    cfg, d, _ = hf
    a = _scheme_a(ck.read_safetensors(d / "model.safetensors"))
    assert set(a) == set(expected_tensors(cfg))  # (a) is exactly the canonical names
    ck.write_safetensors(tmp_path / "model.safetensors", a)
    _assert_same(ck.read_checkpoint(tmp_path, cfg), ck.read_checkpoint(d, cfg))


def test_scheme_c_in_memory_state_dict_with_fused_experts(hf, tmp_path):
    cfg, d, sd = hf
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd
    ck.write_safetensors(tmp_path / "model.safetensors", sd)
    out = ck.read_checkpoint(tmp_path, cfg)
    # transformers' own reverse conversion (save_pretrained) and our inverse table agree on every tensor
    _assert_same(out, ck.read_checkpoint(d, cfg))
    inter = cfg.moe_intermediate_size
    for layer in range(cfg.num_hidden_layers):
        gu = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        dn = sd[f"model.layers.{layer}.mlp.experts.down_proj"]
        assert gu.shape == (cfg.n_routed_experts, 2 * inter, cfg.hidden_size)
        for e in range(cfg.n_routed_experts):
            p = f"layers.{layer}.ffn.experts.{e}."
            np.testing.assert_array_equal(out[p + "w1.weight"], gu[e, :inter])
            np.testing.assert_array_equal(out[p + "w3.weight"], gu[e, inter:])
            np.testing.assert_array_equal(out[p + "w2.weight"], dn[e])
    np.testing.assert_array_equal(out["layers.0.ffn.gate.tid2eid"], sd["model.layers.0.mlp.gate.tid2eid"])
    np.testing.assert_array_equal(out["layers.1.ffn.gate.bias"], sd["model.layers.1.mlp.gate.e_score_correction_bias"])


def test_mtp_and_rope_buffers_are_ignored(canon, tmp_path):
    cfg, a = canon
    a = dict(a)
    a["mtp.0.attn.wq_a.weight"] = np.ones((3, 3), np.float32)
    a["model.rotary_emb.main_inv_freq"] = np.ones(4, np.float32)
    ck.write_safetensors(tmp_path / "model.safetensors", a)
    assert set(ck.read_checkpoint(tmp_path, cfg)) == set(expected_tensors(cfg))


# ------------------------------------------------------------------------------------- sharding
def _write_sharded(directory, tensors: dict[str, np.ndarray], n_shards: int) -> list[str]:
    names = sorted(tensors)
    shards = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    weight_map = {}
    for i, shard in enumerate(shards):
        part = names[i::n_shards]
        ck.write_safetensors(os.path.join(directory, shard), {k: tensors[k] for k in part})
        weight_map.update({k: shard for k in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return shards


def test_sharded_checkpoint_via_index(canon, tmp_path):
    cfg, a = canon
    a = dict(a)
    shards = _write_sharded(tmp_path, a, 3)
    seen: list[str] = []
    out = ck.read_checkpoint(tmp_path, cfg, progress=seen.append)
    _assert_same(out, a)
    assert len(seen) == 3 and all(s in " ".join(seen) for s in shards)

    os.remove(tmp_path / shards[1])
    with pytest.raises(CheckpointError, match=shards[1]) as ei:
        ck.read_checkpoint(tmp_path, cfg)
    assert shards[0] not in str(ei.value) and shards[2] not in str(ei.value)


def test_index_entry_absent_from_its_shard(canon, tmp_path):
    cfg, a = canon
    a = dict(a)
    shards = _write_sharded(tmp_path, a, 2)
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    idx["weight_map"]["norm.weight"] = shards[1 if idx["weight_map"]["norm.weight"] == shards[0] else 0]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"'norm\.weight'.*does not hold it"):
        ck.read_checkpoint(tmp_path, cfg)


def test_no_weights_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"neither model\.safetensors nor"):
        ck.read_checkpoint(tmp_path, tiny_config())


# -------------------------------------------------------------------------------------- validation
def test_every_problem_is_reported_in_one_error(canon, tmp_path):
    cfg, a = canon
    a = dict(a)
    del a["layers.2.attn.wkv.weight"]
    del a["layers.3.ffn.experts.1.w2.weight"]
    a["layers.0.attn.bogus.weight"] = np.zeros((2, 2), np.float32)
    a["layers.1.attn.compressor.ape"] = np.zeros((4, 63), np.float32)
    a["layers.0.ffn.gate.tid2eid"] = a["layers.0.ffn.gate.tid2eid"].astype(np.float32)
    ck.write_safetensors(tmp_path / "model.safetensors", a)
    with pytest.raises(CheckpointError) as ei:
        ck.read_checkpoint(tmp_path, cfg)
    msg = str(ei.value)
    assert "5 problem(s)" in msg
    assert "missing: 'layers.2.attn.wkv.weight' (expected shape (32, 64))" in msg
    assert "missing: 'layers.3.ffn.experts.1.w2.weight' (expected shape (64, 32))" in msg
    assert "unexpected: 'layers.0.attn.bogus.weight'" in msg
    assert "shape: 'layers.1.attn.compressor.ape'" in msg and "expected (4, 64), got (4, 63)" in msg
    assert "dtype: 'layers.0.ffn.gate.tid2eid'" in msg and "int32 or int64, got float32" in msg


def test_duplicate_names_and_int32_tid2eid(canon, tmp_path):
    cfg, a = canon
    a = dict(a)
    a["layers.0.ffn.gate.tid2eid"] = a["layers.0.ffn.gate.tid2eid"].astype(np.int32)
    ck.write_safetensors(tmp_path / "model.safetensors", a)
    assert ck.read_checkpoint(tmp_path, cfg)["layers.0.ffn.gate.tid2eid"].dtype == np.int32
    a["lm_head.weight"] = a["head.weight"]
    ck.write_safetensors(tmp_path / "model.safetensors", a)
    with pytest.raises(
        CheckpointError, match=r"duplicate: .*'(lm_)?head\.weight'.*'(lm_)?head\.weight'.*both map to 'head\.weight'"
    ):
        ck.read_checkpoint(tmp_path, cfg)


def test_tied_embeddings_drop_an_identical_head_only(canon, tmp_path):
    _, a = canon
    a = dict(a)
    tied = tiny_config(tie_word_embeddings=True)
    a["head.weight"] = a["embed.weight"].copy()
    ck.write_safetensors(tmp_path / "model.safetensors", a)
    assert "head.weight" not in ck.read_checkpoint(tmp_path, tied)
    a["head.weight"] = a["embed.weight"] + 1
    ck.write_safetensors(tmp_path / "model.safetensors", a)
    with pytest.raises(CheckpointError, match=r"unexpected: 'head\.weight'"):
        ck.read_checkpoint(tmp_path, tied)


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes", "mxfp4", "compressed-tensors"])
def test_unsupported_quant_method(canon, tmp_path, method):
    cfg, a = canon
    a = dict(a)
    ck.write_safetensors(tmp_path / "model.safetensors", a)
    _write_config(tmp_path, cfg, quantization_config={"quant_method": method, "bits": 4})
    with pytest.raises(CheckpointError, match=rf"quant_method '{method}' is not supported; supported: \['fp8'\]"):
        ck.read_checkpoint(tmp_path, cfg)


def test_read_config_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        ck.read_config(tmp_path / "absent")
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        ck.read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type='llama'"):
        ck.read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot parse"):
        ck.read_config(tmp_path)


# --------------------------------------------------------------------------------- dequantization
def test_fp4_nibble_order_and_table():
    packed = np.array([[0x21, 0x8F, 0x7A]], np.uint8)
    # 0x21: low 1 -> 0.5, high 2 -> 1.0; 0x8F: low F -> -6, high 8 -> -0; 0x7A: low A -> -1, high 7 -> 6
    np.testing.assert_array_equal(ck.unpack_fp4(packed), [[0.5, 1.0, -6.0, -0.0, -1.0, 6.0]])
    assert np.signbit(ck.unpack_fp4(packed)[0, 3])
    np.testing.assert_array_equal(ck.FP4_E2M1_LUT, _E2M1_VALUES)
    every = np.arange(256, dtype=np.uint8).reshape(4, 64)
    ref = np.array(
        [
            [_e2m1_by_bits(int(b) & 0xF if c % 2 == 0 else int(b) >> 4) for c, b in enumerate(np.repeat(r, 2))]
            for r in every
        ]
    )
    np.testing.assert_array_equal(ck.unpack_fp4(every.view(np.int8)), ref)


@pytest.mark.parametrize("scale_dtype", ["f32", "bf16", "e8m0", "u8"])
def test_fp8_dequant_matches_loop_reference(scale_dtype):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((48, 96)).astype(np.float32) * rng.uniform(0.01, 10, (48, 1)).astype(np.float32)
    q, s = _quantize_fp8(w, 16, 32)  # grid (3, 3)
    stored = {
        "f32": s,
        "bf16": s.astype(BF16),
        "e8m0": s.astype(E8M0),
        "u8": (np.log2(s) + 127).astype(np.uint8),
    }[scale_dtype]
    got = ck.dequantize(q, stored)
    assert got.dtype == np.float32 and got.shape == w.shape
    np.testing.assert_array_equal(got, _ref_dequant_fp8(q, s, 16, 32))
    np.testing.assert_allclose(got, w, rtol=2**-3, atol=0)  # e4m3 keeps 3 mantissa bits


def test_fp8_ragged_grid_uses_config_block_size():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((40, 24)).astype(np.float32)
    q, s = _quantize_fp8(w, 16, 16)  # grid (3, 2) = ceil(40/16), ceil(24/16): last blocks are ragged
    assert s.shape == (3, 2)
    with pytest.raises(CheckpointError, match=r"w: weight shape \(40, 24\) is not divisible by scale grid \(3, 2\)"):
        ck.dequantize(q, s, name="w")
    np.testing.assert_array_equal(ck.dequantize(q, s, block_size=(16, 16)), _ref_dequant_fp8(q, s, 16, 16))


def test_fp4_dequant_matches_element_reference():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 128)).astype(np.float32)
    packed, s = _quantize_fp4(w)
    assert packed.shape == (8, 64) and s.shape == (8, 4)
    ref = _ref_dequant_fp4(packed, s)
    for scale in (s, s.astype(E8M0), (np.log2(s) + 127).astype(np.uint8)):
        np.testing.assert_array_equal(ck.dequantize(packed, scale), ref)
        np.testing.assert_array_equal(ck.dequantize(packed.view(np.uint8), scale), ref)
    assert np.abs(ref - w).max() <= np.abs(w).max() / 2  # coarse, but really an approximation of w


def test_fused_3d_dequant_matches_per_expert():
    rng = np.random.default_rng(4)
    qs = [_quantize_fp8(rng.standard_normal((32, 64)).astype(np.float32), 16, 16) for _ in range(3)]
    q3, s3 = np.stack([q for q, _ in qs]), np.stack([s for _, s in qs])
    got = ck.dequantize(q3, s3)
    for e, (q, s) in enumerate(qs):
        np.testing.assert_array_equal(got[e], _ref_dequant_fp8(q, s, 16, 16))


def test_dequant_errors_name_the_tensor():
    q = np.zeros((32, 64), E4M3)
    with pytest.raises(
        CheckpointError, match=r"x\.weight: weight shape \(32, 64\) is not divisible by scale grid \(3, 4\)"
    ):
        ck.dequantize(q, np.ones((3, 4), np.float32), name="x.weight")
    with pytest.raises(CheckpointError, match=r"x\.weight: scale grid \(2, 4, 4\) does not match"):
        ck.dequantize(q, np.ones((2, 4, 4), np.float32), name="x.weight")
    with pytest.raises(CheckpointError, match=r"x\.weight: scale dtype int32"):
        ck.dequantize(q, np.ones((2, 4), np.int32), name="x.weight")
    with pytest.raises(CheckpointError, match=r"x\.weight: dtype float32 is not quantized"):
        ck.dequantize(np.zeros((32, 64), np.float32), np.ones((2, 4), np.float32), name="x.weight")
    np.testing.assert_array_equal(
        ck.dequantize(np.ones((4, 4), E4M3), np.array([0.5], np.float32)), np.full((4, 4), 0.5)
    )


def _fp8_dequant_reference(torch):
    pytest.importorskip("transformers")
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(hf_quantizer=None)


@pytest.mark.parametrize("scale_dtype", ["f32", "e8m0", "u8"])
def test_fp8_dequant_matches_transformers(scale_dtype):
    torch = pytest.importorskip("torch")
    ref_op = _fp8_dequant_reference(torch)
    rng = np.random.default_rng(5)
    w = rng.standard_normal((2, 64, 96)).astype(np.float32) * 7
    q = w.astype(E4M3)
    s = np.exp2(rng.integers(-6, 6, (2, 4, 3))).astype(np.float32)  # block (16, 32)
    stored = {"f32": s, "e8m0": s.astype(E8M0), "u8": (np.log2(s) + 127).astype(np.uint8)}[scale_dtype]
    tq = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
    ts = {
        "f32": lambda: torch.from_numpy(s),
        "e8m0": lambda: torch.from_numpy(stored.view(np.uint8)).view(torch.float8_e8m0fnu),
        "u8": lambda: torch.from_numpy(stored),
    }[scale_dtype]()
    want = ref_op._dequantize_one(tq, ts, output_dtype=torch.float32).numpy()
    np.testing.assert_array_equal(ck.dequantize(q, stored), want)


def test_fp4_dequant_matches_transformers():
    torch = pytest.importorskip("torch")
    ref_op = _fp8_dequant_reference(torch)
    rng = np.random.default_rng(6)
    packed = rng.integers(-128, 128, (16, 64), dtype=np.int8)  # logical [16, 128]
    s = np.exp2(rng.integers(-4, 4, (16, 4))).astype(np.float32)
    want = ref_op._dequantize_one(torch.from_numpy(packed), torch.from_numpy(s), output_dtype=torch.float32).numpy()
    np.testing.assert_array_equal(ck.dequantize(packed, s), want)
    np.testing.assert_array_equal(ck.dequantize(packed, s.astype(E8M0)), want)


# ------------------------------------------------------------------- a quantized V4-style checkpoint
_FP8_SUFFIXES = (
    "attn.wq_a.weight",
    "attn.wq_b.weight",
    "attn.wkv.weight",
    "attn.wo_a.weight",
    "attn.wo_b.weight",
    "compressor.wkv.weight",
    "compressor.wgate.weight",
    "indexer.wq_b.weight",
    "shared_experts.w1.weight",
    "shared_experts.w2.weight",
    "shared_experts.w3.weight",
)


def _quantize_checkpoint(
    a: dict[str, np.ndarray], scale_key: str
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(stored tensors, expected dequantized values): FP8 [16,16] dense weights, FP4 experts, bf16 norms."""
    stored, want = {}, {}
    for k, v in a.items():
        if k.endswith(_FP8_SUFFIXES):
            q, s = _quantize_fp8(v, 16, 16)
            stored[k], stored[k[: -len("weight")] + scale_key] = q, s.astype(E8M0)
            want[k] = _ref_dequant_fp8(q, s, 16, 16)
        elif ".experts." in k and "shared" not in k:
            packed, s = _quantize_fp4(v)
            stored[k], stored[k[: -len("weight")] + scale_key] = packed, s.astype(E8M0)
            want[k] = _ref_dequant_fp4(packed, s)
        elif k.endswith("norm.weight"):
            stored[k] = want[k] = v.astype(BF16)
        else:
            stored[k] = want[k] = v
    return stored, want


@pytest.mark.parametrize("scale_key", ["scale", "weight_scale_inv"])
def test_quantized_checkpoint_is_dequantized(canon, tmp_path, scale_key):
    cfg, a = canon
    a = dict(a)
    stored, want = _quantize_checkpoint(a, scale_key)
    if scale_key == "weight_scale_inv":  # transformers' save_pretrained spelling (scheme b)
        stored = {("model." + k if k.startswith("layers.") else k): v for k, v in stored.items()}
    _write_sharded(tmp_path, stored, 2)
    quant = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [16, 16],
        "activation_scheme": "dynamic",
        "expert_dtype": "fp4",
    }
    _write_config(tmp_path, cfg, quantization_config=quant)
    qcfg = ck.read_config(tmp_path)
    assert qcfg.quantization == "fp8"
    out = ck.read_checkpoint(tmp_path, qcfg)
    assert set(out) == set(expected_tensors(cfg))
    for k in out:
        assert out[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(out[k], want[k], err_msg=k)
    assert out["layers.0.attn.wq_a.weight"].dtype == np.float32
    assert out["layers.0.ffn.experts.0.w1.weight"].shape == (cfg.moe_intermediate_size, cfg.hidden_size)
    assert out["norm.weight"].dtype == BF16
    np.testing.assert_allclose(out["layers.1.attn.wkv.weight"], a["layers.1.attn.wkv.weight"], rtol=2**-3)


def test_quantized_weight_without_scale_and_bad_grid(canon, tmp_path):
    cfg, a = canon
    a = dict(a)
    stored, _ = _quantize_checkpoint(a, "scale")
    del stored["layers.0.attn.wq_a.scale"]
    del stored["layers.2.ffn.experts.3.w2.scale"]
    stored["layers.1.attn.wkv.scale"] = np.ones((3, 4), np.float32)  # (32, 64) weight: 3 does not divide 32
    stored["layers.1.attn.orphan.scale"] = np.ones((1, 1), np.float32)
    ck.write_safetensors(tmp_path / "model.safetensors", stored)
    with pytest.raises(CheckpointError) as ei:
        ck.read_checkpoint(tmp_path, cfg)
    msg = str(ei.value)
    assert "no scale: 'layers.0.attn.wq_a.weight'" in msg and "stored as float8_e4m3fn (32, 64)" in msg
    assert "no scale: 'layers.2.ffn.experts.3.w2.weight'" in msg and "stored as int8 (64, 16)" in msg
    assert "bad scale: layers.1.attn.wkv.weight: weight shape (32, 64) is not divisible by scale grid (3, 4)" in msg
    assert "unexpected: 'layers.1.attn.orphan.scale'" in msg
    assert "4 problem(s)" in msg, msg  # and no redundant "missing" / "shape" lines for the same tensors


def test_fused_quantized_experts_in_memory_names(hf, tmp_path):
    cfg, _, sd = hf
    sd = dict(sd)
    key = "model.layers.2.mlp.experts.gate_up_proj"
    per_expert = [_quantize_fp4(w) for w in sd[key]]
    sd[key] = np.stack([p for p, _ in per_expert])  # [E, 2I, D/2] int8
    sd[key + "_scale_inv"] = np.stack([s for _, s in per_expert]).astype(E8M0)  # [E, 2I, D/32]
    ck.write_safetensors(tmp_path / "model.safetensors", sd)
    out = ck.read_checkpoint(tmp_path, cfg)
    inter = cfg.moe_intermediate_size
    for e, (packed, s) in enumerate(per_expert):
        ref = _ref_dequant_fp4(packed, s)
        np.testing.assert_array_equal(out[f"layers.2.ffn.experts.{e}.w1.weight"], ref[:inter])
        np.testing.assert_array_equal(out[f"layers.2.ffn.experts.{e}.w3.weight"], ref[inter:])
    del sd[key + "_scale_inv"]
    ck.write_safetensors(tmp_path / "model.safetensors", sd)
    with pytest.raises(CheckpointError) as ei:
        ck.read_checkpoint(tmp_path, cfg)
    msg = str(ei.value)
    assert "1 problem(s)" in msg and "no scale: 'layers.2.ffn.experts.gate_up_proj'" in msg, msg
    sd[key] = np.zeros((cfg.n_routed_experts, 2 * inter + 1, cfg.hidden_size), np.float32)
    ck.write_safetensors(tmp_path / "model.safetensors", sd)
    with pytest.raises(CheckpointError) as ei:
        ck.read_checkpoint(tmp_path, cfg)
    msg = str(ei.value)
    assert "1 problem(s)" in msg and "shape: 'layers.2.ffn.experts.gate_up_proj'" in msg and "(4, 65, 64)" in msg, msg
