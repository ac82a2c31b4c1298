"""Read Gemma 3 HF checkpoints (config.json + safetensors, sharded or not) into a `Gemma3`, without torch.

Accepted layouts (tensor names map to the canonical names of `model.expected_tensors`):
    Gemma3ForCausalLM (`gemma3_text`)          model.layers.N...., model.embed_tokens.weight, model.norm.weight,
                                               lm_head.weight (absent when tied)
    Gemma3ForConditionalGeneration (`gemma3`)  model.language_model.layers.N.... (transformers 5 save), or the
                                               Hub's older language_model.model.layers.N....; the vision tower
                                               and multimodal projector are skipped; lm_head.weight /
                                               language_model.lm_head.weight when present
A plain `Gemma3TextModel` save (no prefix: layers.N...., embed_tokens.weight) is accepted too.

safetensors files are parsed directly (8-byte header length, JSON header, raw little-endian data) into
`np.memmap` views, because the `safetensors` package's numpy backend cannot represent bfloat16; bf16 and
f16 use `ml_dtypes`/numpy. Missing, unknown or mis-shaped tensors raise `CheckpointError` naming each one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from models.placement import OnMesh, placing

from .config import ConfigError, Gemma3Config
from .model import Gemma3, expected_tensors

__all__ = ["CheckpointError", "canonical_name", "load", "read_checkpoint", "read_config", "read_safetensors"]

SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}

# Prefixes before the text model's own names, most specific first. None: a tensor to skip.
_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "")
_SKIP_PREFIXES = (
    "model.vision_tower.",
    "vision_tower.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
)
_HEADS = ("lm_head.weight", "language_model.lm_head.weight")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match its config. The message names each offending tensor."""


def canonical_name(name: str) -> str | None:
    """Checkpoint tensor name -> canonical name (`layers.3.mlp.up_proj.weight`, `lm_head.weight`), or None for
    a tensor that is not part of the text model (vision tower, projector). Unknown names come back as they are
    (minus a known prefix) so the caller reports them as unexpected."""
    if name.startswith(_SKIP_PREFIXES):
        return None
    if name in _HEADS:
        return "lm_head.weight"
    for prefix in _PREFIXES:
        if prefix and name.startswith(prefix):
            return name[len(prefix) :]
    return name


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """{name: array} of one .safetensors file: read-only views of an `np.memmap` (bf16 as ml_dtypes.bfloat16)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            n = int.from_bytes(raw, "little")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors header: {e}") from None
    header.pop("__metadata__", None)
    size = os.path.getsize(path)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n, shape=(size - 8 - n,)) if size > 8 + n else None
    out = {}
    for name, info in header.items():
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        shape = tuple(info["shape"])
        start, end = info["data_offsets"]
        count = int(np.prod(shape, dtype=np.int64))
        if end - start != count * np.dtype(dtype).itemsize or (data is None and count):
            raise CheckpointError(f"{path}: tensor {name!r} byte range {start}:{end} does not fit shape {shape}")
        buf = data[start:end] if count else np.zeros(0, np.uint8)
        out[name] = buf.view(dtype).reshape(shape)
    return out


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index}: cannot read the shard index: {e}") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
        if missing:
            raise CheckpointError(f"{path}: shards named in model.safetensors.index.json are missing: {missing}")
        return [os.path.join(path, f) for f in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (and no model.safetensors.index.json)")
    return [os.path.join(path, f) for f in files]


def read_config(path: str | os.PathLike) -> Gemma3Config:
    """The `Gemma3Config` of a checkpoint directory (its config.json); `ConfigError` if unusable."""
    return Gemma3Config.from_json(path)


def check_tensors(tensors: Mapping[str, np.ndarray], cfg: Gemma3Config) -> None:
    """Raise `CheckpointError` listing missing, unexpected and mis-shaped tensors (canonical names)."""
    want = expected_tensors(cfg)
    problems = []
    missing = sorted(set(want) - set(tensors))
    if missing:
        problems.append(f"missing tensors {missing}")
    extra = sorted(set(tensors) - set(want))
    if extra:
        hint = " (tie_word_embeddings=True but the checkpoint has lm_head.weight)" if "lm_head.weight" in extra else ""
        problems.append(f"unknown tensors {extra}{hint}")
    for name in sorted(set(want) & set(tensors)):
        got = tuple(tensors[name].shape)
        if got != want[name]:
            problems.append(f"tensor {name!r} has shape {got}, expected {want[name]}")
    if problems:
        raise CheckpointError("checkpoint does not match its config: " + "; ".join(problems))


def read_checkpoint(path: str | os.PathLike, cfg: Gemma3Config) -> dict[str, np.ndarray]:
    """{canonical name: array} of a checkpoint directory, checked against `cfg` (names and shapes)."""
    path = os.fspath(path)
    tensors: dict[str, np.ndarray] = {}
    source: dict[str, str] = {}
    for file in _weight_files(path):
        for name, arr in read_safetensors(file).items():
            canon = canonical_name(name)
            if canon is None:
                continue
            if canon in tensors:
                raise CheckpointError(f"tensor {canon!r} appears twice: as {source[canon]!r} and as {name!r}")
            tensors[canon] = arr
            source[canon] = name
    # A tied model saved with an explicit lm_head equal to the embedding is harmless: drop the copy.
    head, emb = tensors.get("lm_head.weight"), tensors.get("embed_tokens.weight")
    tied_copy = head is not None and emb is not None and head.shape == emb.shape and np.array_equal(head, emb)
    if cfg.tie_word_embeddings and tied_copy:
        del tensors["lm_head.weight"]
    check_tensors(tensors, cfg)
    return tensors


def load(
    path: str | os.PathLike, dtype="float32", *, mesh: Mesh | None = None, progress_bars: bool | None = None
) -> Gemma3:
    """Load an HF Gemma 3 checkpoint directory as a `Gemma3` whose weights are cast to `dtype`
    ("float32", "bfloat16", or a jnp dtype). Raises `ConfigError` / `CheckpointError` (both ValueErrors).

    mesh: None: the weights on the default device. A `jax.sharding.Mesh`: each weight put on every
    device of the mesh (Gemma 3 is replicated; `hkv.Engine(model, config, mesh=mesh)` splits the
    cache over its data axis), one weight at a time from the memory-mapped checkpoint
    (`models.placement.OnMesh`), never the whole model on one device first; a bar over the bytes
    placed (`progress_bars`, None: when interactive)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a directory")
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype={dtype!r} is not a dtype") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype={dtype} must be a floating dtype")
    cfg = read_config(path)
    tensors = read_checkpoint(path, cfg)
    if mesh is None:
        return Gemma3(cfg, tensors, dtype)
    with placing(OnMesh.for_checkpoint(tensors, mesh, None, progress_bars=progress_bars)):
        return Gemma3(cfg, tensors, dtype)


__all__ += ["SAFETENSORS_DTYPES", "ConfigError", "check_tensors"]
