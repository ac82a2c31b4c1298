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
    Abstract               no bytes at all: each weight a `jax.ShapeDtypeStruct` with its sharding (a
                           memory plan of a model too large for this machine, `models.memory_plan`)
    LazyStack              parts stacked on a new leading axis, read per slice (`models.lazy_arrays`)
    placing(placement)     context manager: the placement `put` uses while a model is built
    put(value, dtype, name)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from hkv.engine.progress import Bars
from hkv.engine.weight_split import WeightSplit
from models.lazy_arrays import LazyStack, Readahead, read, source_file

__all__ = [
    "PARALLEL_BYTES",
    "READAHEAD_WINDOW",
    "READ_THREADS",
    "Abstract",
    "LazyStack",
    "OnDevice",
    "OnMesh",
    "Placement",
    "placing",
    "put",
]

READ_THREADS = 4  # threads reading one weight's slices
READAHEAD_WINDOW = 1 << 30  # how far `OnMesh(readahead=)` reads ahead of the weights placed
PARALLEL_BYTES = 1 << 20  # a weight of at least this many bytes has its slices read by those threads


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
      expert_axes, expert_dim_of: the routed experts split over these axes (`hkv.engine.weight_split.
        WeightSplit`, the rule `hkv.MeshEngine(..., expert_axes=)` places them by); () : by `dim_of`.
      total_bytes: the checkpoint bytes the weights will read (the progress bar's total), or None.
      progress_bars: True / False / None (None: when the session is interactive, `hkv.engine.progress`).
      readahead: the checkpoint's files in the order the model reads them: read ahead into the OS page
        cache on a background thread (`lazy_arrays.Readahead`, at most `READAHEAD_WINDOW` bytes ahead)
        so the disk streams while weights are converted and placed. Only worth it when this process
        reads (nearly) every byte, i.e. one process; () for none.
    """

    def __init__(
        self,
        mesh: Mesh,
        model_axis: str | None = "model",
        dim_of: Callable[[str, tuple[int, ...]], int | None] | None = None,
        *,
        total_bytes: int | None = None,
        progress_bars: bool | None = None,
        readahead: Sequence[str] = (),
        expert_axes: Sequence[str] = (),
        expert_dim_of: Callable[[str, tuple[int, ...]], int | None] | None = None,
    ):
        if not isinstance(mesh, Mesh):
            raise ValueError(f"mesh={mesh!r} must be a jax.sharding.Mesh")
        self.mesh = mesh
        self.split = WeightSplit(mesh, model_axis, dim_of, tuple(expert_axes), expert_dim_of)
        self.placed = 0  # weights placed so far
        self.bytes_placed = 0  # their global bytes (replicas counted once)
        self.peak_staging_bytes = 0  # the most host bytes one weight's slices took (what the host holds at once)
        self._bar = Bars(progress_bars).bytes(total_bytes or 0, "hkv: placing weights")
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._readahead = Readahead(readahead, READAHEAD_WINDOW) if readahead else None

    @classmethod
    def for_checkpoint(
        cls,
        tensors: dict,
        mesh: Mesh,
        model_axis: str | None = "model",
        dim_of: Callable[[str, tuple[int, ...]], int | None] | None = None,
        progress_bars: bool | None = None,
        **experts,
    ) -> OnMesh:
        """The placement of a checkpoint's tensors (canonical name -> memory-mapped array, `LazyStack`,
        quantized tensor): the bar over their bytes, and, with one process (which reads every byte),
        their files read ahead in the order the tensors come. `experts`: expert_axes, expert_dim_of."""
        total = sum(int(v.nbytes) for v in tensors.values())
        files = list(dict.fromkeys(f for f in map(source_file, tensors.values()) if f))
        ahead = files if jax.process_count() == 1 else ()
        return cls(mesh, model_axis, dim_of, total_bytes=total, progress_bars=progress_bars, readahead=ahead, **experts)

    def spec(self, name: str | None, shape: tuple[int, ...]) -> PartitionSpec:
        """The PartitionSpec of weight `name` of `shape` on this mesh (`WeightSplit.spec`)."""
        return self.split.spec(name, shape)

    def put(self, value, dtype, name: str | None) -> jax.Array:
        shape = tuple(int(d) for d in value.shape)
        dt = np.dtype(value.dtype if dtype is None else jnp.dtype(dtype))
        sharding = NamedSharding(self.mesh, self.spec(name, shape))
        # the distinct slices this process's devices hold (replicas read once), read by a few threads
        # (`lazy_arrays.read` preads without the GIL; numpy's copies release it too)
        wanted = {repr(i): i for i in sharding.addressable_devices_indices_map(shape).values()}

        def read_one(key: str) -> tuple[str, np.ndarray]:
            return key, read(value, wanted[key]).astype(dt, copy=False)

        if len(wanted) > 1 and int(value.nbytes) >= PARALLEL_BYTES:
            slices = dict(self._threads().map(read_one, wanted))
        else:
            slices = dict(map(read_one, wanted))
        out = jax.make_array_from_callback(shape, sharding, lambda index: slices[repr(index)])
        self.peak_staging_bytes = max(self.peak_staging_bytes, sum(int(a.nbytes) for a in slices.values()))
        slices.clear()
        self.placed += 1
        self.bytes_placed += int(np.prod(shape)) * dt.itemsize
        if self._readahead is not None:
            self._readahead.advance(int(value.nbytes))
        if self._bar is not None:
            self._bar.update(int(value.nbytes))
        return out

    def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="hkv-load")
        return self._pool

    def close(self) -> None:
        """Close the progress bar and the reading threads."""
        if self._readahead is not None:
            self._readahead.close()
            self._readahead = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class Abstract(OnMesh):
    """Each weight as a `jax.ShapeDtypeStruct` of its shape and dtype, with the sharding `OnMesh` would
    give it; nothing is read. `mesh` may be a `jax.sharding.AbstractMesh` (no devices needed).
    Checkpoint values need only `.shape` and `.dtype` (e.g. `jax.ShapeDtypeStruct`s)."""

    def __init__(
        self,
        mesh,
        model_axis: str | None = "model",
        dim_of: Callable[[str, tuple[int, ...]], int | None] | None = None,
        *,
        expert_axes: Sequence[str] = (),
        expert_dim_of: Callable[[str, tuple[int, ...]], int | None] | None = None,
    ):
        if not isinstance(mesh, Mesh | AbstractMesh):
            raise ValueError(f"mesh={mesh!r} must be a jax.sharding.Mesh or AbstractMesh")
        self.mesh = mesh
        self.split = WeightSplit(mesh, model_axis, dim_of, tuple(expert_axes), expert_dim_of)
        self.placed = 0
        self.bytes_placed = 0
        self.peak_staging_bytes = 0
        self._bar = self._pool = self._readahead = None

    def put(self, value, dtype, name: str | None) -> jax.ShapeDtypeStruct:
        shape = tuple(int(d) for d in value.shape)
        dt = np.dtype(value.dtype if dtype is None else jnp.dtype(dtype))
        self.placed += 1
        self.bytes_placed += int(np.prod(shape)) * dt.itemsize
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(self.mesh, self.spec(name, shape)))


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
