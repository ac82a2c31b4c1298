"""Block-scaled FP8 / FP4 weights as stored, on the host (numpy and ml_dtypes only).

A DeepSeek-V4 release stores its linear weights as FP8 e4m3 with a float32 scale per 128x128 block and
its routed experts as FP4 e2m1 packed two per byte with a ue8m0 (power of two) scale per 32 inputs.
`read_checkpoint(..., keep_quantized=True)` returns such weights as `QuantizedTensor`s; the model
keeps them quantized on the device (`models.deepseek_v4.quantized`).

Public API
    FP8, FP4                          the two formats
    FP4_E2M1_LUT                      float32[16]: the value of each e2m1 nibble (bit 3 = sign)
    QuantizedTensor                   data + scale grid + block; `dequantize()` -> float32
    KEPT_QUANTIZED                    which canonical weights the model keeps quantized
    stack(parts)                      like parts stacked on a new leading axis (a layer's experts)
    quantize_fp8(w, block)            float weight -> FP8 e4m3 with float32 scales per block (DeepSeek's)
    quantize_fp4(w, block)            float weight -> packed FP4 e2m1 with ue8m0 scales per `block` inputs
    host_dense(value)                 a checkpoint tensor as a plain float array (dequantized if needed)
"""

from __future__ import annotations

import dataclasses
import re

import ml_dtypes
import numpy as np

from models.lazy_arrays import LazyStack

__all__ = [
    "FP4",
    "FP4_E2M1_LUT",
    "FP8",
    "KEPT_QUANTIZED",
    "QuantizedTensor",
    "host_dense",
    "quantize_fp4",
    "quantize_fp8",
    "stack",
]

FP8 = "fp8"
FP4 = "fp4"

FP4_E2M1_LUT = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)
"""float32[16]: value of each e2m1 nibble (bit 3 = sign)."""

FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
SCALE_DTYPES = (
    np.dtype("<f4"),
    np.dtype("<f2"),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(ml_dtypes.float8_e8m0fnu),
)

# Canonical names of the weights a `DeepseekV4` keeps quantized: every linear layer (attention and its
# compressors and indexer, the router, the shared and routed experts, the head). Anything else stored
# quantized (an embedding, say) is dequantized on the host when the model is built.
KEPT_QUANTIZED = re.compile(
    r"^(layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|compressor\.(wkv|wgate)|indexer\.(wq_b|weights_proj|"
    r"compressor\.(wkv|wgate)))|ffn\.(gate|shared_experts\.w[123]|experts\.\d+\.w[123]))|head)\.weight$"
)


@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """A block-scaled quantized weight on the host, as stored (often memory-mapped).

    Attributes:
      data: FP8 (`float8_e4m3fn` / `float8_e5m2`) [..., R, C], or FP4 e2m1 packed two per byte, LOW
        nibble first, as uint8 [..., R, C // 2].
      scale: the scale grid [..., ceil(R / bm), ceil(C / bn)] in float32, bfloat16, float16 or
        float8_e8m0fnu (a power of two per block; the checkpoint's raw exponent bytes are read as it).
      fmt: `FP8` or `FP4`.
      block: (bm, bn), the rows and (logical) columns each scale covers; the last block of a row or
        column of blocks may be ragged (DeepSeek's quantizer pads to whole blocks).
    """

    data: np.ndarray
    scale: np.ndarray
    fmt: str
    block: tuple[int, int]

    def __post_init__(self):
        if self.fmt not in (FP8, FP4):
            raise ValueError(f"fmt={self.fmt!r} must be {FP8!r} or {FP4!r}")
        want = np.dtype(np.uint8) if self.fmt == FP4 else None
        if (want is not None and self.data.dtype != want) or (want is None and self.data.dtype not in FP8_DTYPES):
            allowed = "uint8 (packed e2m1)" if self.fmt == FP4 else "float8_e4m3fn, float8_e5m2"
            raise ValueError(f"{self.fmt} data dtype {self.data.dtype} must be {allowed}")
        if self.scale.dtype not in SCALE_DTYPES:
            raise ValueError(f"scale dtype {self.scale.dtype} must be one of {[str(d) for d in SCALE_DTYPES]}")
        if self.data.ndim < 2 or self.scale.ndim != self.data.ndim:
            raise ValueError(f"data {self.data.shape} and scale {self.scale.shape} must both be [..., R, C]")
        rows, cols = self.shape[-2:]
        bm, bn = self.block
        grid = (self.data.shape[:-2], -(-rows // bm), -(-cols // bn))
        if bm < 1 or bn < 1 or (self.scale.shape[:-2], *self.scale.shape[-2:]) != grid:
            raise ValueError(f"scale grid {self.scale.shape} does not cover {self.shape} in blocks of {self.block}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape [..., R, C]."""
        s = tuple(self.data.shape)
        return s[:-1] + (2 * s[-1],) if self.fmt == FP4 else s

    @property
    def nbytes(self) -> int:
        """Bytes held: the data and the scale grid."""
        return int(self.data.nbytes + self.scale.nbytes)

    def dequantize(self) -> np.ndarray:
        """float32 [..., R, C]: each stored value times its block's scale, one float32 product."""
        if self.fmt == FP4:
            u8 = np.asarray(self.data)
            q = np.stack([FP4_E2M1_LUT[u8 & 0xF], FP4_E2M1_LUT[u8 >> 4]], axis=-1).reshape(self.shape)
        else:
            q = np.asarray(self.data).astype(np.float32)
        rows, cols = self.shape[-2:]
        s = np.asarray(self.scale).astype(np.float32)
        full = np.repeat(np.repeat(s, self.block[0], axis=-2), self.block[1], axis=-1)[..., :rows, :cols]
        return q * full

    def part(self, index: int, rows: slice) -> QuantizedTensor | np.ndarray:
        """Leading index `index`, logical rows `rows` (e.g. one expert's gate half of a fused gate_up
        [E, 2I, D]): quantized when the rows start and stop on block boundaries, else dequantized."""
        start, stop, _ = rows.indices(self.shape[-2])
        bm = self.block[0]
        if start % bm or (stop % bm and stop != self.shape[-2]):
            return self.dequantize()[index, start:stop]
        return QuantizedTensor(
            self.data[index, start:stop], self.scale[index, start // bm : -(-stop // bm)], self.fmt, self.block
        )


def stack(parts: list[QuantizedTensor | np.ndarray]) -> QuantizedTensor | None:
    """One `QuantizedTensor` [len(parts), ...] (data and scale `LazyStack`s: read per slice) of quantized
    parts of one format, block, scale dtype and shape (the routed experts of a layer), or None when
    they are not all alike (the caller dequantizes)."""
    first = parts[0]
    if not isinstance(first, QuantizedTensor):
        return None
    key = (first.fmt, first.block, first.data.shape, first.data.dtype, first.scale.shape, first.scale.dtype)
    for p in parts:
        if (
            not isinstance(p, QuantizedTensor)
            or (
                p.fmt,
                p.block,
                p.data.shape,
                p.data.dtype,
                p.scale.shape,
                p.scale.dtype,
            )
            != key
        ):
            return None
    data, scale = LazyStack([p.data for p in parts]), LazyStack([p.scale for p in parts])
    return QuantizedTensor(data, scale, first.fmt, first.block)


def host_dense(value) -> np.ndarray:
    """A checkpoint tensor as a plain array: a `QuantizedTensor` dequantized to float32, else as given."""
    return value.dequantize() if isinstance(value, QuantizedTensor) else value


_E4M3_MAX = 448.0
_E2M1_MAX = 6.0


def quantize_fp8(w: np.ndarray, block: int = 128) -> QuantizedTensor:
    """A float weight [..., R, C] as FP8 e4m3 with one float32 scale per `block` x `block` block (the
    last row and column of blocks ragged), each scale max|block| / 448, as DeepSeek's quantizer does.
    The inverse is `QuantizedTensor.dequantize` (values within e4m3's precision)."""
    w = np.asarray(w, np.float32)
    if w.ndim < 2 or block < 1:
        raise ValueError(f"quantize_fp8 needs a weight of >= 2 dims and block >= 1, got {w.shape} and {block}")
    rows, cols = w.shape[-2:]
    gr, gc = -(-rows // block), -(-cols // block)
    padded = np.zeros(w.shape[:-2] + (gr * block, gc * block), np.float32)
    padded[..., :rows, :cols] = w
    blocks = padded.reshape(w.shape[:-2] + (gr, block, gc, block))
    scale = np.maximum(np.abs(blocks).max(axis=(-3, -1)) / _E4M3_MAX, np.float32(1e-12)).astype(np.float32)
    q = blocks / scale[..., :, None, :, None]
    q = q.reshape(padded.shape)[..., :rows, :cols].astype(ml_dtypes.float8_e4m3fn)
    return QuantizedTensor(q, scale, FP8, (block, block))


def quantize_fp4(w: np.ndarray, block: int = 32) -> QuantizedTensor:
    """A float weight [..., R, C] (C a multiple of `block`, which is even) as FP4 e2m1 packed two per
    byte (low nibble first) with one power-of-two scale (float8_e8m0fnu) per `block` inputs of a row,
    the smallest power of two at which the block's largest value fits e2m1's 6; values rounded to
    the nearest e2m1 value. The inverse is `QuantizedTensor.dequantize`."""
    w = np.asarray(w, np.float32)
    if w.ndim < 2 or block < 2 or block % 2 or w.shape[-1] % block:
        raise ValueError(f"quantize_fp4 needs [..., R, C] with C a multiple of an even block, got {w.shape}, {block}")
    cols = w.shape[-1]
    blocks = w.reshape(w.shape[:-1] + (cols // block, block))
    peak = np.maximum(np.abs(blocks).max(axis=-1), np.float32(2.0**-120))
    exp = np.clip(np.ceil(np.log2(peak / _E2M1_MAX)), -127, 127).astype(np.int32)
    scaled = blocks / np.exp2(exp.astype(np.float32))[..., None]
    magnitudes = FP4_E2M1_LUT[:8]
    code = np.argmin(np.abs(np.abs(scaled)[..., None] - magnitudes), axis=-1).astype(np.uint8)
    code = (code | np.where(scaled < 0, 8, 0).astype(np.uint8)).reshape(w.shape)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    scale = (exp + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
    return QuantizedTensor(packed, scale, FP4, (1, block))
