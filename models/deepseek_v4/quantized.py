"""Block-scaled FP8 / FP4 weights kept in their storage dtypes on the device.

`load(path)` keeps a release checkpoint's quantized weights quantized: each is a `QuantizedLinear` (its
data in `float8_e4m3fn` / `float8_e5m2` or packed `uint8`, its scale grid in the stored dtype; see
`quant_format.QuantizedTensor`), dequantized inside the step where the weight is used, so the weight
bytes on the device are the checkpoint's.

Exactness: a weight is dequantized as `load(dequantize=True)` dequantizes it on the host (the data
and the block's scale converted to float32 exactly, multiplied once in float32, then cast to the
model's dtype), so a quantized model computes bitwise the same logits as the dequantized one
(tests/models/test_quantized.py). This is the jnp reference on every backend; XLA may fuse the
dequantization into the product, but no FP8 dot is used (its accumulation would differ).

Public API
    QuantizedLinear                   an nnx module holding one weight; `dense()` -> the model's dtype
    dequantize_device(data, scale, fmt, block)   `QuantizedTensor.dequantize` in jnp
    as_weight(w)                      an array as an `nnx.Param`; a weight as it is
    quantized_or_param(value, dtype)  a checkpoint tensor as a `QuantizedLinear` or an `nnx.Param`
    weight(w)                         the dense weight of a `QuantizedLinear` or an `nnx.Param`
    weight_bytes(model)               parameter bytes by storage dtype
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.layer_stack import LayerView, VariableView
from models.placement import put

from .quant_format import FP4, FP4_E2M1_LUT, QuantizedTensor

__all__ = [
    "QuantizedLinear",
    "as_weight",
    "dequantize_device",
    "quantized_or_param",
    "weight",
    "weight_bytes",
]


def dequantize_device(data: jax.Array, scale: jax.Array, fmt: str, block: tuple[int, int]) -> jax.Array:
    """`QuantizedTensor.dequantize` in jnp: data [..., R, C or C // 2], scale [..., gr, gc] -> float32
    [..., R, C], the same bits."""
    if fmt == FP4:
        lut = jnp.asarray(FP4_E2M1_LUT)
        q = jnp.stack([lut[data & 0xF], lut[data >> 4]], axis=-1)
        q = q.reshape(*data.shape[:-1], 2 * data.shape[-1])
    else:
        q = data.astype(jnp.float32)
    rows, cols = q.shape[-2:]
    s = scale.astype(jnp.float32)
    s = jnp.repeat(s, block[0], axis=-2, total_repeat_length=s.shape[-2] * block[0])[..., :rows, :]
    s = jnp.repeat(s, block[1], axis=-1, total_repeat_length=s.shape[-1] * block[1])[..., :cols]
    return q * s


class QuantizedLinear(nnx.Module):
    """A block-scaled FP8 / FP4 weight kept quantized on the device (see `QuantizedTensor`).

    Attributes:
      data: nnx.Param of the stored values (float8 [..., R, C] or packed uint8 [..., R, C // 2]).
      scale: nnx.Param of the scale grid [..., ceil(R / bm), ceil(C / bn)] in its stored dtype.
      fmt, block, dtype: static: the format, the block and the dtype `dense()` returns.
    """

    def __init__(self, q: QuantizedTensor, dtype, name: str | None = None):
        """q: the weight as stored; dtype: what `dense()` returns; name: its canonical path, which places
        its data and scale (`models.placement.put`: `name.data`, `name.scale`)."""
        self.data = nnx.Param(put(q.data, None, None if name is None else name + ".data"))
        self.scale = nnx.Param(put(q.scale, None, None if name is None else name + ".scale"))
        self.fmt = q.fmt
        self.block = tuple(q.block)
        self.dtype = jnp.dtype(dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape [..., R, C] (of the first repetition's slice when held stacked)."""
        s = tuple(self.data.value.shape)
        return s[:-1] + (2 * s[-1],) if self.fmt == FP4 else s

    def dense(self) -> jax.Array:
        """The weight [..., R, C] in `dtype`: dequantized in float32, then cast once."""
        return dequantize_device(self.data.value, self.scale.value, self.fmt, self.block).astype(self.dtype)

    def take(self, index: jax.Array) -> jax.Array:
        """`dense()[index]` along the leading axis (routed experts), reading only those entries' bytes."""
        q = dequantize_device(self.data.value[index], self.scale.value[index], self.fmt, self.block)
        return q.astype(self.dtype)


def quantized_or_param(value, dtype, name: str | None = None) -> QuantizedLinear | nnx.Param:
    """A checkpoint tensor as a model weight: a `QuantizedTensor` stays quantized (`QuantizedLinear`
    whose `dense()` is in `dtype`); an array becomes an `nnx.Param` cast to `dtype`. Placed by
    `models.placement.put` under `name` (the weight's path, e.g. "layers.3.attn.wq_b")."""
    if isinstance(value, QuantizedTensor):
        return QuantizedLinear(value, dtype, name)
    return nnx.Param(put(value, dtype, name))


def as_weight(w) -> QuantizedLinear | nnx.Param:
    """`w` as a model weight: a `QuantizedLinear` or `nnx.Param` as it is, an array as an `nnx.Param`."""
    return w if isinstance(w, QuantizedLinear | nnx.Param) else nnx.Param(w)


def weight(w: QuantizedLinear | nnx.Param | LayerView | VariableView) -> jax.Array:
    """The dense weight: `w.dense()` of a `QuantizedLinear`, `w.value` of a parameter; a stacked layer's
    view of either (`model.layers[i].attn.wq_a`) gives that layer's."""
    if isinstance(w, LayerView):
        w = w.module()
    return w.dense() if isinstance(w, QuantizedLinear) else w.value


def weight_bytes(model: nnx.Module) -> dict[str, int]:
    """Bytes of a model's parameters by storage dtype name, e.g. {"float8_e4m3fn": ..., "float32": ...}."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        name = jnp.dtype(leaf.dtype).name
        out[name] = out.get(name, 0) + int(leaf.size) * jnp.dtype(leaf.dtype).itemsize
    return out
