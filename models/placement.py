"""Where a model's weights go while it is built: one device (the default), or each device's slice
straight from the checkpoint onto that device (`OnMesh`), never the whole model on one device or in
host memory.

A model constructor makes every weight with `put(value, dtype, name)`; `value` is whatever the
checkpoint reader returned (a memory-mapped numpy view, a `LazyStack` of such views, ...), `name` the
weight's canonical path (e.g. "layers.3.attn.wq_b", "layers.3.ffn.w_gate.data"). Under
`with placing(OnMesh(mesh, dim_of=model.tensor_parallel_dim)):` each weight becomes a global
`jax.Array` sharded as `hkv.MeshEngine` shards it (`dim_of(name, shape)` split over the mesh's model
axis when it divides, replicated otherwise), built by `jax.make_array_from_callback`: the reader is
asked only for the slices this process's devices hold, one weight at a time, so host memory peaks at
about one weight's slices (tests/models/test_streamed_load.py measures it), and with several processes
(`jax.distributed`) each reads only its own devices' slices.

Public API
    Placement              what a placement does (`put`)
    OnDevice               jnp.asarray on the default device (what `put` does outside `placing`)
    OnMesh                 each device's slice onto it, with a progress bar
    LazyStack              parts stacked on a new leading axis, read per slice (`models.lazy_arrays`)
    placing(placement)     context manager: the placement `put` uses while a model is built
    put(value, dtype, name)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hkv.engine.progress import Bars
from models.lazy_arrays import LazyStack

__all__ = ["LazyStack", "OnDevice", "OnMesh", "Placement", "placing", "put"]


class Placement:
    """Makes a model's weights: `put(value, dtype, name) -> jax.Array`."""

    def put(self, value, dtype, name: str | None) -> jax.Array:
        raise NotImplementedError


class OnDevice(Placement):
    """Every weight whole on the default device (`jnp.asarray`)."""

    def put(self, value, dtype, name: str | None) -> jax.Array:
        if not isinstance(value, np.ndarray | jax.Array):
            value = np.asarray(value)
        return jnp.asarray(value, dtype)


class OnMesh(Placement):
    """Each weight sharded over `mesh` as `hkv.MeshEngine` shards it, each device's slice read from the
    checkpoint and put on it (`jax.make_array_from_callback`).

    Args:
      mesh: the devices.
      model_axis: the mesh axis weights are split over (None or an axis the mesh lacks: replicate all).
      dim_of: (name, shape) -> the dim to split or None (e.g. `models.deepseek_v4.tensor_parallel_dim`);
        a dim the axis does not divide is replicated, as `hkv.engine.sharded.weight_shardings` does.
      total_bytes: the checkpoint bytes the weights will read (the progress bar's total), or None.
      progress_bars: True / False / None (None: when the session is interactive, `hkv.engine.progress`).
    """

    def __init__(
        self,
        mesh: Mesh,
        model_axis: str | None = "model",
        dim_of: Callable[[str, tuple[int, ...]], int | None] | None = None,
        *,
        total_bytes: int | None = None,
        progress_bars: bool | None = None,
    ):
        if not isinstance(mesh, Mesh):
            raise ValueError(f"mesh={mesh!r} must be a jax.sharding.Mesh")
        self.mesh = mesh
        self.model_axis = model_axis if model_axis in mesh.axis_names else None
        self.dim_of = dim_of
        self.placed = 0  # weights placed so far
        self.bytes_placed = 0  # their global bytes (replicas counted once)
        self.peak_staging_bytes = 0  # the most host bytes one weight's slices took (what the host holds at once)
        self._bar = Bars(progress_bars).bytes(total_bytes or 0, "hkv: placing weights")

    def spec(self, name: str | None, shape: tuple[int, ...]) -> PartitionSpec:
        """The PartitionSpec of weight `name` of `shape` on this mesh."""
        m = self.mesh.shape[self.model_axis] if self.model_axis is not None else 1
        if m == 1 or self.dim_of is None or name is None or not shape:
            return PartitionSpec()
        dim = self.dim_of(name, shape)
        if dim is None or shape[dim] % m:
            return PartitionSpec()
        parts: list[str | None] = [None] * len(shape)
        parts[dim % len(shape)] = self.model_axis
        return PartitionSpec(*parts)

    def put(self, value, dtype, name: str | None) -> jax.Array:
        shape = tuple(int(d) for d in value.shape)
        dt = np.dtype(value.dtype if dtype is None else jnp.dtype(dtype))
        sharding = NamedSharding(self.mesh, self.spec(name, shape))
        read: dict[str, np.ndarray] = {}  # replicas of one slice are read once

        def slice_of(index: tuple) -> np.ndarray:
            key = repr(index)
            if key not in read:
                read[key] = np.asarray(value[index]).astype(dt, copy=False)
            return read[key]

        out = jax.make_array_from_callback(shape, sharding, slice_of)
        self.peak_staging_bytes = max(self.peak_staging_bytes, sum(int(a.nbytes) for a in read.values()))
        read.clear()
        self.placed += 1
        self.bytes_placed += int(np.prod(shape)) * dt.itemsize
        if self._bar is not None:
            self._bar.update(int(value.nbytes))
        return out

    def close(self) -> None:
        """Close the progress bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


_ON_DEVICE = OnDevice()
_PLACEMENT: contextvars.ContextVar[Placement | None] = contextvars.ContextVar("hkv_placement", default=None)


@contextlib.contextmanager
def placing(placement: Placement) -> Iterator[Placement]:
    """Within the block, `put` (every model constructor's weights) uses `placement`."""
    token = _PLACEMENT.set(placement)
    try:
        yield placement
    finally:
        _PLACEMENT.reset(token)
        if isinstance(placement, OnMesh):
            placement.close()


def put(value, dtype=None, name: str | None = None) -> jax.Array:
    """A weight from checkpoint `value` in `dtype` (None: as stored), placed by the current placement.

    Args:
      value: a numpy array (memory-mapped), a `LazyStack`, a jax array, or anything numpy converts.
      name: the weight's canonical path ("layers.3.attn.wq_b"; ".data" / ".scale" for a quantized
        weight's parts), which decides its sharding on a mesh; None: replicated.
    """
    return (_PLACEMENT.get() or _ON_DEVICE).put(value, dtype, name)
