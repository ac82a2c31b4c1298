"""Write a DeepSeek-V4 checkpoint in the release's format: block-scaled FP8 linear weights, packed FP4
routed experts, everything else as given.

`write_release_checkpoint(path, cfg, tensors)` is how tests, benchmarks and notebooks make a
checkpoint that `load(path)` reads the way it reads the real DeepSeek-V4-Flash: canonical names (the
original release's), each quantized weight `X.weight` with its scale grid `X.scale`, a `config.json`
whose `quantization_config` says `quant_method = "fp8"`, one file or many shards with an index. Nothing
is fetched; the weights are whatever `tensors` holds (e.g. `random_tensors(cfg)`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping

import numpy as np

from .checkpoint import CheckpointError, write_safetensors
from .config import DeepseekV4Config
from .quant_format import KEPT_QUANTIZED, QuantizedTensor, quantize_fp4, quantize_fp8
from .tensor_layout import expected_tensors

__all__ = ["abstract_release_tensors", "release_format", "write_release_checkpoint"]

INDEX = "model.safetensors.index.json"


def release_format(name: str, shape: tuple[int, ...], fp4_block: int = 32) -> str | None:
    """How the release stores canonical tensor `name` of `shape`: "fp4" (routed experts whose input
    dim is a multiple of `fp4_block`), "fp8" (the other linear weights but the router and the head,
    which the release keeps in bf16), or None (as given)."""
    if not KEPT_QUANTIZED.match(name) or name == "head.weight" or name.endswith(".ffn.gate.weight"):
        return None
    if ".ffn.experts." in name and shape[-1] % fp4_block == 0:
        return "fp4"
    return "fp8"


def write_release_checkpoint(
    path: str | os.PathLike,
    cfg: DeepseekV4Config,
    tensors: Mapping[str, np.ndarray],
    *,
    fp8_block: int = 128,
    fp4_block: int = 32,
    max_shard_bytes: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[str]:
    """Write `tensors` (canonical name -> float array, `expected_tensors(cfg)`) into directory `path`
    as the release stores them (`release_format`): FP8 e4m3 with a float32 scale per `fp8_block`
    square block, FP4 e2m1 packed two per byte with a ue8m0 scale per `fp4_block` inputs.

    Args:
      path: a directory (created if missing).
      max_shard_bytes: None: one `model.safetensors`; else shards of at most this many bytes (a tensor
        larger than it gets a shard of its own) and `model.safetensors.index.json`.
      progress: called with a message per shard written.
    Returns:
      the file names written, config.json first.
    """
    expected = expected_tensors(cfg)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"write_release_checkpoint: {len(missing)} tensor(s) missing, e.g. {missing[:3]}")
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be >= 1 (or None for one file)")
    os.makedirs(path, exist_ok=True)
    stored: dict[str, np.ndarray] = {}
    for name in expected:
        a = np.asarray(tensors[name])
        fmt = release_format(name, a.shape, fp4_block)
        if fmt is None:
            stored[name] = a
            continue
        q: QuantizedTensor = quantize_fp4(a, fp4_block) if fmt == "fp4" else quantize_fp8(a, fp8_block)
        base = name[: -len(".weight")]
        stored[name], stored[base + ".scale"] = q.data, q.scale
    config = cfg.to_hf_dict()
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [fp8_block, fp8_block],
        "expert_dtype": "fp4",
    }
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    shards = _shards(stored, max_shard_bytes)
    files = ["config.json"]
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if max_shard_bytes else "model.safetensors"
        write_safetensors(os.path.join(path, fname), {n: stored[n] for n in names})
        files.append(fname)
        if progress is not None:
            progress(f"wrote {fname} ({len(names)} tensors)")
    if max_shard_bytes is not None:
        weight_map = {n: files[1 + i] for i, names in enumerate(shards) for n in names}
        total = sum(int(a.nbytes) for a in stored.values())
        with open(os.path.join(path, INDEX), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        files.append(INDEX)
    return files


def _shards(stored: Mapping[str, np.ndarray], max_bytes: int | None) -> list[list[str]]:
    """Tensor names in order, cut into runs of at most `max_bytes` (one run when None)."""
    if max_bytes is None:
        return [list(stored)]
    out: list[list[str]] = [[]]
    size = 0
    for name, a in stored.items():
        if out[-1] and size + a.nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += int(a.nbytes)
    return out


def abstract_release_tensors(
    cfg: DeepseekV4Config, *, fp8_block: int = 128, fp4_block: int = 32, quantized: bool = True
) -> dict:
    """What `read_checkpoint(keep_quantized=True)` returns for a release checkpoint of `cfg`, without
    one: `jax.ShapeDtypeStruct`s (and `QuantizedTensor`s of them) of the release's formats
    (`release_format`; 2-D plain tensors bf16, the rest float32, `tid2eid` int64), for
    `models.memory_plan`. quantized=False: every weight bf16 (as `load(dequantize=True)` in bf16 holds it)."""
    import jax
    import ml_dtypes

    from .tensor_layout import INT

    out = {}
    for name, (shape, kind) in expected_tensors(cfg).items():
        fmt = release_format(name, shape, fp4_block) if quantized else None
        if kind == INT:
            out[name] = jax.ShapeDtypeStruct(shape, np.int64)
        elif fmt == "fp8":
            rows, cols = shape[-2:]
            grid = shape[:-2] + (-(-rows // fp8_block), -(-cols // fp8_block))
            data = jax.ShapeDtypeStruct(shape, ml_dtypes.float8_e4m3fn)
            out[name] = QuantizedTensor(data, jax.ShapeDtypeStruct(grid, np.float32), "fp8", (fp8_block, fp8_block))
        elif fmt == "fp4":
            data = jax.ShapeDtypeStruct(shape[:-1] + (shape[-1] // 2,), np.uint8)
            scale = jax.ShapeDtypeStruct(shape[:-1] + (shape[-1] // fp4_block,), ml_dtypes.float8_e8m0fnu)
            out[name] = QuantizedTensor(data, scale, "fp4", (1, fp4_block))
        else:
            out[name] = jax.ShapeDtypeStruct(shape, ml_dtypes.bfloat16 if len(shape) == 2 else np.float32)
    return out
