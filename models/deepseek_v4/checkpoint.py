"""Read DeepSeek-V4 checkpoints (safetensors) into canonical-named numpy arrays.

Public API
    CheckpointError                       every loader failure (a `ValueError`)
    read_safetensors(path)                {name: np.ndarray}, zero-copy views of an `np.memmap`
    read_safetensors_metadata(path)       the optional `__metadata__` {str: str} of a file
    write_safetensors(path, tensors, metadata=None)   atomic writer of the same format
    canonical_name(name)                  checkpoint name -> canonical name (None = ignore)
    unpack_fp4(packed)                    int8/uint8 [..., K/2] -> float32 [..., K] (e2m1, low nibble first)
    dequantize(weight, scale, ...)        block-scaled FP8 / FP4 weight -> float32
    quantized_tensor(weight, scale, ...)  the same weight kept quantized (`QuantizedTensor`)
    read_checkpoint(path, cfg, progress=None, keep_quantized=False)   {canonical_name: array} == `expected_tensors(cfg)`
    read_config(path)                     `DeepseekV4Config` of a checkpoint directory

Runtime dependencies: numpy and ml_dtypes only (no torch, no `safetensors` package).

Canonical names are the original DeepSeek release names listed by `tensor_layout.expected_tensors`
(`embed.weight`, `layers.3.attn.compressor.ape`, `layers.0.ffn.experts.5.w1.weight`, ...). Three
naming schemes are accepted by `canonical_name`:
  (a) the original DeepSeek release: canonical names; FP8/FP4 weights `X.weight` carry block scales `X.scale`;
  (b) transformers' `save_pretrained` for `deepseek_v4`: (a) with a `model.` prefix, plus
      `model.embed_tokens.weight`, `model.hc_head.hc_{fn,base,scale}`, `lm_head.weight`;
      quantized weights carry `X.weight_scale_inv`;
  (c) transformers' in-memory module names (`model.layers.N.self_attn.q_a_proj.weight`, ...), with the
      routed experts fused as `mlp.experts.gate_up_proj` [E, 2I, D] and `mlp.experts.down_proj` [E, D, I].
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from .config import ConfigError, DeepseekV4Config
from .quant_format import FP4, FP4_E2M1_LUT, FP8, QuantizedTensor, host_dense
from .tensor_layout import FLOAT, INT, expected_tensors

__all__ = [
    "FP4_E2M1_LUT",
    "SAFETENSORS_DTYPES",
    "SUPPORTED_QUANT_METHODS",
    "CheckpointError",
    "canonical_name",
    "dequantize",
    "quantized_tensor",
    "read_checkpoint",
    "read_config",
    "read_safetensors",
    "read_safetensors_metadata",
    "unpack_fp4",
    "write_safetensors",
]


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match the config. The message names each offending tensor."""


# ----------------------------------------------------------------------------------------- safetensors
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
"""safetensors dtype tag -> numpy dtype (little-endian; 8-bit floats from ml_dtypes)."""

_DTYPE_TO_TAG: dict[np.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}

_MAX_HEADER = 100 * 1024 * 1024  # the safetensors package refuses headers above 100 MB too


def _tag_of(name: str, a: np.ndarray) -> str:
    dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
    tag = _DTYPE_TO_TAG.get(dt)
    if tag is None:
        raise CheckpointError(
            f"tensor {name!r}: dtype {a.dtype} cannot be stored in safetensors; allowed: "
            f"{sorted(str(d) for d in SAFETENSORS_DTYPES.values())}"
        )
    return tag


def _read_header(path: str) -> tuple[dict[str, Any], int, int]:
    """(header dict, byte offset of the data buffer, file size). Raises CheckpointError naming the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes < the 8-byte header length)")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise CheckpointError(
                    f"{path}: header length {n} overruns the file "
                    f"(file has {size} bytes, at most {size - 8} for the header)"
                )
            if n > _MAX_HEADER:
                raise CheckpointError(f"{path}: header length {n} exceeds the {_MAX_HEADER}-byte limit")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read safetensors file: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid UTF-8 JSON: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    return header, 8 + n, size


def read_safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The `__metadata__` {str: str} of a safetensors file ({} when absent)."""
    path = os.fspath(path)
    header, _, _ = _read_header(path)
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError(f"{path}: __metadata__ must map str to str, got {meta!r}")
    return dict(meta)


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only numpy view of one `np.memmap` (zero-copy).

    Returns {name: array of the stored shape and dtype (see `SAFETENSORS_DTYPES`)}; nothing is read
    into RAM until an array is used. Raises `CheckpointError` naming the file (and tensor) for an
    unknown dtype, a header that overruns the file, offsets out of range or overlapping, a size that
    does not match dtype x shape, or a truncated data buffer.
    """
    path = os.fspath(path)
    header, start, size = _read_header(path)
    data_len = size - start
    specs: list[tuple[int, int, str, np.dtype, tuple[int, ...]]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where}: header entry must be an object, got {info!r}")
        tag = info.get("dtype")
        if tag not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{where}: unknown dtype {tag!r}; supported: {sorted(SAFETENSORS_DTYPES)}")
        shape = info.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise CheckpointError(f"{where}: shape {shape!r} must be a list of non-negative integers")
        offs = info.get("data_offsets")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
        ):
            raise CheckpointError(f"{where}: data_offsets {offs!r} must be [begin, end] integers")
        b, e = offs
        if not 0 <= b <= e:
            raise CheckpointError(f"{where}: data_offsets [{b}, {e}] must satisfy 0 <= begin <= end")
        if e > data_len:
            raise CheckpointError(
                f"{where}: data_offsets [{b}, {e}] out of range: the data buffer has {data_len} bytes "
                f"(file truncated or corrupt)"
            )
        dt = SAFETENSORS_DTYPES[tag]
        nbytes = math.prod(shape) * dt.itemsize
        if e - b != nbytes:
            raise CheckpointError(
                f"{where}: {e - b} bytes at data_offsets [{b}, {e}] "
                f"but dtype {tag} x shape {tuple(shape)} needs {nbytes}"
            )
        specs.append((b, e, name, dt, tuple(shape)))
    ordered = sorted(specs, key=lambda s: (s[0], s[1]))
    for prev, cur in itertools.pairwise(ordered):
        if cur[0] < prev[1] and cur[1] > cur[0] and prev[1] > prev[0]:
            raise CheckpointError(
                f"{path}: tensors {prev[2]!r} [{prev[0]}, {prev[1]}] and {cur[2]!r} [{cur[0]}, {cur[1]}] overlap"
            )
    out: dict[str, np.ndarray] = {}
    if not specs:
        return out
    mm = np.memmap(path, dtype=np.uint8, mode="r") if size > 0 else np.zeros(0, np.uint8)
    for b, e, name, dt, shape in specs:
        raw = mm[start + b : start + e]
        out[name] = raw.view(dt).reshape(shape)
    return out


def write_safetensors(
    path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Write `tensors` {name: array of any shape, dtype in `SAFETENSORS_DTYPES`} as one safetensors file.

    Atomic: written to a temp file in the same directory, then `os.replace`d. Tensors are laid out
    by decreasing itemsize (then name) so every tensor is aligned to its itemsize, the header is
    space-padded to a multiple of 8 bytes, and the data buffer has no gaps (as the `safetensors`
    package writes and requires). `metadata` becomes `__metadata__` and must map str to str.
    """
    path = os.fspath(path)
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(f"{path}: metadata must map str to str, got {dict(metadata)!r}")
    arrays: list[tuple[str, str, np.ndarray]] = []
    for name, a in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise CheckpointError(f"{path}: tensor name {name!r} must be a str other than '__metadata__'")
        a = np.asarray(a)
        tag = _tag_of(name, a)
        a = np.asarray(a, dtype=SAFETENSORS_DTYPES[tag], order="C")  # little-endian, C order (0-d stays 0-d)
        arrays.append((name, tag, a))
    arrays.sort(key=lambda t: (-t[2].dtype.itemsize, t[0]))
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, tag, a in arrays:
        header[name] = {"dtype": tag, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * (-len(hbytes) % 8)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(len(hbytes).to_bytes(8, "little"))
            f.write(hbytes)
            for _, _, a in arrays:
                if a.size:
                    f.write(a.reshape(-1).view(np.uint8).data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ---------------------------------------------------------------------------------------------- names
_TOP_LEVEL = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}

# transformers in-memory suffix (after `layers.N.`) -> canonical suffix: the inverse of the
# "deepseek_v4" entry of transformers' conversion_mapping.py.
_HF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    # fused routed experts: pseudo-canonical names, split per expert by `read_checkpoint`
    "mlp.experts.gate_up_proj": "ffn.experts.gate_up_proj",
    "mlp.experts.down_proj": "ffn.experts.down_proj",
}

_FUSED = ("ffn.experts.gate_up_proj", "ffn.experts.down_proj")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_MTP_RE = re.compile(r"(^|\.)mtp\.")
_ROPE_BUFFER_RE = re.compile(r"(^|\.)rotary_emb\.\w*inv_freq$")


def _canonical_base(name: str) -> str:
    """Canonical name of a non-scale tensor (prefix `model.` already stripped)."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    m = _LAYER_RE.match(name)
    if m:
        rest = _HF_LAYER.get(m.group(2))
        if rest is not None:
            return f"layers.{m.group(1)}.{rest}"
    return name


def canonical_name(name: str) -> str | None:
    """Map a tensor name of any accepted checkpoint scheme to its canonical name; None = ignore it.

    Ignored: multi-token-prediction layers (`mtp.*`, `model.mtp.*`), transformers' RoPE buffers
    (`*.rotary_emb.*inv_freq`) and static activation scales (`*.activation_scale`, unused once
    weights are dequantized). Block scales map to `<canonical module>.scale` whichever way they are
    spelled (`X.scale`, `X.weight_scale_inv`, fused `..._scale_inv`), e.g.
    `model.layers.0.self_attn.q_a_proj.weight_scale_inv` -> `layers.0.attn.wq_a.scale`.
    transformers' fused experts map to the pseudo-canonical `layers.N.ffn.experts.gate_up_proj`
    ([E, 2I, D]) and `layers.N.ffn.experts.down_proj` ([E, D, I]); `read_checkpoint` splits them
    into `layers.N.ffn.experts.E.w1|w3|w2.weight`. Unknown names come back unchanged (minus a
    `model.` prefix) so that `read_checkpoint` reports them as unexpected.
    """
    if _MTP_RE.search(name) or _ROPE_BUFFER_RE.search(name) or name.endswith(".activation_scale"):
        return None
    n = name[len("model.") :] if name.startswith("model.") else name
    if n in _TOP_LEVEL:
        return _TOP_LEVEL[n]
    m = _LAYER_RE.match(n)
    if m and m.group(2) in _HF_LAYER:  # e.g. attn_hc.scale is a parameter, not a block scale
        return _canonical_base(n)
    for suffix, weight_suffix in ((".weight_scale_inv", ".weight"), (".scale", ".weight"), ("_scale_inv", "")):
        if n.endswith(suffix):
            base = _canonical_base(n[: -len(suffix)] + weight_suffix)
            if weight_suffix and base.endswith(weight_suffix):
                base = base[: -len(weight_suffix)]
            return base + ".scale"
    return _canonical_base(n)


# ------------------------------------------------------------------------------------- dequantization
SUPPORTED_QUANT_METHODS = ("fp8",)
"""`quantization_config.quant_method` values `read_checkpoint` can dequantize."""

_FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
_FP4_DTYPES = (np.dtype(np.int8), np.dtype(np.uint8))
_PLAIN_FLOATS = (np.dtype("<f4"), np.dtype("<f2"), np.dtype(ml_dtypes.bfloat16))
_INT_DTYPES = (np.dtype("<i4"), np.dtype("<i8"))


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """int8/uint8 [..., K/2] (two e2m1 values per byte, LOW nibble first) -> float32 [..., K]."""
    packed = np.asarray(packed)
    if packed.dtype not in _FP4_DTYPES:
        raise CheckpointError(f"unpack_fp4: dtype {packed.dtype} must be int8 or uint8")
    if packed.ndim == 0:
        raise CheckpointError("unpack_fp4: a packed FP4 tensor needs at least 1 dimension, got a scalar")
    u8 = packed.view(np.uint8)
    out = np.empty(packed.shape[:-1] + (packed.shape[-1], 2), np.float32)
    out[..., 0] = FP4_E2M1_LUT[u8 & 0xF]
    out[..., 1] = FP4_E2M1_LUT[u8 >> 4]
    return out.reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


def _scale_as_stored(scale: np.ndarray, name: str) -> np.ndarray:
    """A scale grid in a dtype that converts to float32 exactly: raw E8M0 exponent bytes (uint8) are
    read as float8_e8m0fnu (2**(byte-127)), float64 is narrowed to float32, the others kept."""
    if scale.dtype == np.uint8:  # raw E8M0 exponent bytes
        return scale.view(ml_dtypes.float8_e8m0fnu)
    if scale.dtype == np.dtype("<f8"):
        return scale.astype(np.float32)
    if scale.dtype in _PLAIN_FLOATS + (np.dtype(ml_dtypes.float8_e8m0fnu),):
        return scale
    raise CheckpointError(
        f"{name}: scale dtype {scale.dtype} not supported; allowed: float32, bfloat16, float16, float8_e8m0fnu, uint8"
    )


def quantized_tensor(
    weight: np.ndarray,
    scale: np.ndarray,
    *,
    block_size: tuple[int, int] | None = None,
    name: str = "weight",
) -> QuantizedTensor | np.ndarray:
    """A block-scaled quantized weight as a `QuantizedTensor` (kept quantized), or, for a weight of
    fewer than 2 dims, dequantized to float32. Arguments and grid rules as `dequantize`."""
    weight, scale = np.asanyarray(weight), np.asanyarray(scale)  # memory-mapped views stay so
    if weight.dtype in _FP4_DTYPES:
        if weight.ndim == 0:
            raise CheckpointError(f"{name}: a packed FP4 tensor needs at least 1 dimension, got a scalar")
        data, fmt = weight.view(np.uint8), FP4
        rows_cols = weight.shape[:-1] + (2 * weight.shape[-1],)
    elif weight.dtype in _FP8_DTYPES:
        data, fmt, rows_cols = weight, FP8, weight.shape
    else:
        raise CheckpointError(
            f"{name}: dtype {weight.dtype} is not quantized (expected float8_e4m3fn, float8_e5m2, int8/uint8 FP4)"
        )
    s = _scale_as_stored(scale, name)
    if len(rows_cols) < 2:
        if s.size != 1:
            raise CheckpointError(
                f"{name}: a {len(rows_cols)}-D quantized weight needs a single-element scale, got {tuple(scale.shape)}"
            )
        q = unpack_fp4(weight) if fmt == FP4 else weight.astype(np.float32)
        return q * s.astype(np.float32).reshape(())
    lead, (rows, cols) = rows_cols[:-2], rows_cols[-2:]
    if s.size == 1:
        grid = np.broadcast_to(s.reshape((1,) * len(rows_cols)), lead + (1, 1))
        return QuantizedTensor(data, grid, fmt, (rows, cols))
    if s.ndim != len(rows_cols) or s.shape[:-2] != lead:
        raise CheckpointError(
            f"{name}: scale grid {tuple(scale.shape)} does not match weight {tuple(rows_cols)} "
            f"(need the same leading dims and a 2-D block grid)"
        )
    sr, sc = s.shape[-2:]
    if sr == 0 or sc == 0:
        raise CheckpointError(f"{name}: empty scale grid {tuple(scale.shape)} for weight {tuple(rows_cols)}")
    if fmt == FP8 and block_size is not None:
        bm, bn = block_size
        if (sr, sc) == (-(-rows // bm), -(-cols // bn)):
            return QuantizedTensor(data, s, fmt, (bm, bn))
    if rows % sr or cols % sc:
        raise CheckpointError(
            f"{name}: weight shape ({rows}, {cols}) is not divisible by scale grid ({sr}, {sc})"
            + (f" and the grid is not ceil-divided by weight_block_size {tuple(block_size)}" if block_size else "")
        )
    return QuantizedTensor(data, s, fmt, (rows // sr, cols // sc))


def dequantize(
    weight: np.ndarray,
    scale: np.ndarray,
    *,
    block_size: tuple[int, int] | None = None,
    name: str = "weight",
) -> np.ndarray:
    """Block-scaled quantized weight -> float32 of the logical shape.

    weight: FP8 (float8_e4m3fn / float8_e5m2) [..., R, C], or packed FP4 e2m1 (int8/uint8)
        [..., R, C/2] with two values per byte, low nibble first.
    scale: [..., r, c] (float32, bfloat16, float16, float8_e8m0fnu, or uint8 meaning 2**(byte-127)),
        leading dims equal to the weight's; a single-element scale is per-tensor.
    The block is derived from the grid as transformers' `Fp8Dequantize._dequantize_one` does:
    (R/r, C/c) when r | R and c | C. For FP8 only, when `block_size=(bm, bn)` (the config's
    `weight_block_size`) is given and (r, c) == (ceil(R/bm), ceil(C/bn)), blocks are (bm, bn) with
    ragged last blocks (DeepSeek's own quantizer layout); this wins over the divisibility rule.
    Anything else raises `CheckpointError` naming `name`. Each value is its stored value times its
    block's scale, both exactly in float32, one float32 product (`QuantizedTensor.dequantize`).
    """
    return host_dense(quantized_tensor(weight, scale, block_size=block_size, name=name))


# -------------------------------------------------------------------------------------------- loading
def read_config(path: str | os.PathLike) -> DeepseekV4Config:
    """`DeepseekV4Config` from `<path>/config.json`; CheckpointError if the directory or file is missing/bad."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path!r} does not exist or is not a directory")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path!r} has no config.json (found: {sorted(os.listdir(path))[:20]})")
    try:
        return DeepseekV4Config.from_json_file(cfg_path)
    except ConfigError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{cfg_path}: cannot parse: {type(e).__name__}: {e}") from e


def _quant_config(directory: str, cfg: DeepseekV4Config) -> tuple[str | None, tuple[int, int] | None]:
    """(quant_method or None, weight_block_size or None); CheckpointError for unsupported methods."""
    qc: Any = None
    cfg_path = os.path.join(directory, "config.json")
    if os.path.isfile(cfg_path):
        try:
            with open(cfg_path, encoding="utf-8") as f:
                qc = json.load(f).get("quantization_config")
        except (OSError, json.JSONDecodeError, AttributeError) as e:
            raise CheckpointError(f"{cfg_path}: cannot parse: {e}") from e
    methods = []
    if isinstance(qc, dict):
        methods.append(qc.get("quant_method"))
    elif qc is not None:
        raise CheckpointError(f"{cfg_path}: quantization_config must be an object, got {qc!r}")
    if cfg.quantization is not None:
        methods.append(cfg.quantization)
    for m in methods:
        if m not in SUPPORTED_QUANT_METHODS:
            raise CheckpointError(
                f"quant_method {m!r} is not supported; supported: {list(SUPPORTED_QUANT_METHODS)} "
                f"(block-scaled FP8 with optional FP4 experts)"
            )
    block = None
    if isinstance(qc, dict) and qc.get("weight_block_size") is not None:
        wbs = qc["weight_block_size"]
        if not (isinstance(wbs, list) and len(wbs) == 2 and all(isinstance(v, int) and v >= 1 for v in wbs)):
            raise CheckpointError(f"{cfg_path}: weight_block_size={wbs!r} must be two positive integers")
        block = (wbs[0], wbs[1])
    return (methods[0] if methods else None), block


def _shard_plan(path: str) -> list[tuple[str, list[str] | None]]:
    """[(shard file, tensor names to take from it or None = all)]."""
    if os.path.isfile(path):
        return [(path, None)]
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint path {path!r} does not exist")
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map must be an object")
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index (needs a 'weight_map' object): {e}") from e
        by_shard: dict[str, list[str]] = {}
        for tname, shard in weight_map.items():
            by_shard.setdefault(shard, []).append(tname)
        missing = sorted(s for s in by_shard if not os.path.isfile(os.path.join(path, s)))
        if missing:
            raise CheckpointError(
                f"{index} lists shard(s) missing from {path}: "
                + ", ".join(f"{s} ({len(by_shard[s])} tensors, e.g. {by_shard[s][0]!r})" for s in missing)
            )
        return [(os.path.join(path, s), names) for s, names in sorted(by_shard.items())]
    if os.path.isfile(single):
        return [(single, None)]
    raise CheckpointError(
        f"{path!r} has neither model.safetensors nor model.safetensors.index.json "
        f"(found: {sorted(os.listdir(path))[:20]})"
    )


def _rows(a: np.ndarray | QuantizedTensor, index: int, rows: slice) -> np.ndarray | QuantizedTensor:
    """a[index, rows] of a fused expert tensor, kept quantized where `QuantizedTensor.part` can."""
    return a.part(index, rows) if isinstance(a, QuantizedTensor) else a[index, rows]


def _fmt_shape(s: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(int(v)) for v in s) + ")"


def read_checkpoint(
    path: str | os.PathLike,
    cfg: DeepseekV4Config,
    *,
    progress: Callable[[str], None] | None = None,
    keep_quantized: bool = False,
) -> dict[str, np.ndarray | QuantizedTensor]:
    """Load a DeepSeek-V4 checkpoint as {canonical name: array} matching `expected_tensors(cfg)` exactly.

    path: a directory with `model.safetensors` or `model.safetensors.index.json` + shards (its
        `config.json`, if any, supplies `quantization_config`), or one `.safetensors` file.
    Names of schemes (a)/(b)/(c) are mapped with `canonical_name`; fused experts are split into
    `layers.N.ffn.experts.E.w1|w3` (first|last I rows of gate_up [E, 2I, D]) and `.w2` (down [E, D, I]).
    Quantized weights (FP8, or int8/uint8 packed FP4 where a float is expected) are dequantized to
    float32 with their `.scale` / `.weight_scale_inv`; with `keep_quantized` they are returned as
    `QuantizedTensor`s (data and scale grid as stored, memory-mapped) whose `.shape` is the logical
    one (a fused expert tensor is split per expert, quantized where the split falls on block rows).
    Plain float tensors keep their stored dtype
    (float32/bfloat16/float16) and stay memory-mapped; int tensors (`gate.tid2eid`) are int32/int64.
    With `cfg.tie_word_embeddings`, a `head.weight` equal to `embed.weight` is dropped.
    All problems (name collisions, missing / unexpected / mis-shaped / wrongly-typed tensors,
    quantized weights without a scale, bad scale grids) are collected and raised as ONE
    `CheckpointError` that lists each offending tensor. `progress(msg)` is called once per shard.
    """
    path = os.fspath(path)
    plan = _shard_plan(path)
    directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    _, block = _quant_config(directory, cfg)

    problems: list[str] = []
    raw: dict[str, tuple[str, np.ndarray]] = {}  # canonical -> (source name @ file, array)
    for i, (shard, names) in enumerate(plan):
        if progress is not None:
            progress(f"reading {os.path.basename(shard)} ({i + 1}/{len(plan)})")
        tensors = read_safetensors(shard)
        if names is None:
            names = list(tensors)
        for src in names:
            if src not in tensors:
                problems.append(f"index lists {src!r} in {os.path.basename(shard)} but that shard does not hold it")
                continue
            canon = canonical_name(src)
            if canon is None:
                continue
            origin = f"{src!r} in {os.path.basename(shard)}"
            if canon in raw:
                problems.append(f"duplicate: {raw[canon][0]} and {origin} both map to {canon!r}")
                continue
            raw[canon] = (origin, tensors[src])

    # pair block scales with their weights and dequantize
    expected = expected_tensors(cfg)
    values: dict[str, np.ndarray] = {}
    origins: dict[str, str] = {}
    failed: set[str] = set()  # reported already: not also "missing"
    failed_fused: list[tuple[str, tuple[str, ...]]] = []  # (experts prefix, (".w1.weight", ...))
    scales = {k: v for k, v in raw.items() if k.endswith(".scale")}
    for k, (origin, a) in raw.items():
        if k.endswith(".scale"):
            continue
        base = k[: -len(".weight")] if k.endswith(".weight") else k
        sc = scales.pop(base + ".scale", None)
        problem = None
        if sc is not None:
            try:
                a = quantized_tensor(a, sc[1], block_size=block, name=k)
                if not keep_quantized:
                    a = host_dense(a)
            except CheckpointError as e:
                problem = f"bad scale: {e} (scale from {sc[0]})"
        elif a.dtype in _FP8_DTYPES or (
            a.dtype in _FP4_DTYPES and (expected.get(k, (None, FLOAT))[1] == FLOAT or k.endswith(_FUSED))
        ):
            problem = (
                f"no scale: {k!r} (from {origin}) is stored as {a.dtype} {_fmt_shape(a.shape)}, a quantized "
                f"weight without its .scale / .weight_scale_inv"
            )
        if problem is not None:
            problems.append(problem)
            if k.endswith(_FUSED):
                gate_up = k.endswith("gate_up_proj")
                ws = (".w1.weight", ".w3.weight") if gate_up else (".w2.weight",)
                failed_fused.append((k[: -len("gate_up_proj" if gate_up else "down_proj")], ws))
            failed.add(k)
            continue
        values[k], origins[k] = a, origin
    for k, (origin, _) in scales.items():
        problems.append(f"unexpected: {k!r} (from {origin}) is a block scale without a weight")

    # split fused experts
    for k in [k for k in values if k.endswith(_FUSED)]:
        a, origin = values.pop(k), origins.pop(k)
        gate_up = k.endswith("gate_up_proj")
        prefix = k[: -len("gate_up_proj")] if gate_up else k[: -len("down_proj")]
        if len(a.shape) != 3 or (gate_up and a.shape[1] % 2):
            problems.append(
                f"shape: {k!r} (from {origin}) must be [E, 2I, D] (gate_up) or [E, D, I] (down), "
                f"got {_fmt_shape(a.shape)}"
            )
            failed_fused.append((prefix, (".w1.weight", ".w3.weight") if gate_up else (".w2.weight",)))
            continue
        for e in range(a.shape[0]):
            if gate_up:
                half = a.shape[1] // 2
                parts = {"w1": _rows(a, e, slice(0, half)), "w3": _rows(a, e, slice(half, None))}
            else:
                parts = {"w2": _rows(a, e, slice(None))}
            for w, v in parts.items():
                name = f"{prefix}{e}.{w}.weight"
                if name in values:
                    problems.append(f"duplicate: {origins[name]} and {origin} both map to {name!r}")
                    continue
                values[name], origins[name] = v, f"{origin}[{e}]"

    if (
        cfg.tie_word_embeddings
        and isinstance(values.get("head.weight"), np.ndarray)
        and isinstance(values.get("embed.weight"), np.ndarray)
        and values["head.weight"].shape == values["embed.weight"].shape
        and np.array_equal(values["head.weight"], values["embed.weight"])
    ):
        del values["head.weight"]
    for k, (shape, kind) in expected.items():
        if k not in values:
            if k in failed or any(k.startswith(p) and k.endswith(ws) for p, ws in failed_fused):
                continue
            problems.append(f"missing: {k!r} (expected shape {_fmt_shape(shape)})")
            continue
        a = values[k]
        if tuple(a.shape) != tuple(shape):
            problems.append(f"shape: {k!r} (from {origins[k]}) expected {_fmt_shape(shape)}, got {_fmt_shape(a.shape)}")
        if kind == INT and a.dtype not in _INT_DTYPES:
            problems.append(f"dtype: {k!r} (from {origins[k]}) must be int32 or int64, got {a.dtype}")
        elif kind == FLOAT and not isinstance(a, QuantizedTensor) and a.dtype not in _PLAIN_FLOATS:
            problems.append(
                f"dtype: {k!r} (from {origins[k]}) must be float32, bfloat16, float16 or block-quantized, got {a.dtype}"
            )
    for k in sorted(set(values) - set(expected)):
        problems.append(f"unexpected: {k!r} (from {origins[k]}, shape {_fmt_shape(values[k].shape)})")
    if problems:
        raise CheckpointError(
            f"checkpoint {path} does not match the config ({len(problems)} problem(s)):\n  " + "\n  ".join(problems)
        )
    return {k: values[k] for k in expected}
