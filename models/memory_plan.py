"""A memory plan read off the model itself, for models and meshes larger than this machine.

The model is built with abstract weights (`models.placement.Abstract`: every weight a
`jax.ShapeDtypeStruct` carrying the sharding `hkv.Engine(model, config, mesh=mesh)` gives it, nothing
allocated), and its cache with `jax.eval_shape(init_cache)`. Per device that gives exactly:

* **weights**: each weight's shard (split over the mesh's "model" axis where the model's
  `tensor_parallel_dim` says and the axis divides it, replicated otherwise), in its storage dtype
  (FP8 / packed FP4 / bf16 for a release checkpoint kept quantized);
* **cache**: one data shard's `HybridCache` (the mesh engine splits the slots over "data"; within a
  shard every device holds the shard's cache);
* **temporaries** (optional, `compile_temporaries` / `compile_mesh_temporaries`): the decode step, or
  a prefill step of `chunk` tokens, lowered with those abstract weights and cache and compiled for
  this machine's backend (`memory_analysis().temp_size_in_bytes`): the CPU program's scratch when run
  here, not a GPU's or a TPU's.

`plan(...)` then finds the most slots per node whose weights + cache (+ temporaries when given) fit in
the platform's memory less `RESERVE_FRACTION`. `benchmarks/memory_plan.py` prints the tables of
docs/scaling.md from it.

Public API
    Platform, PLATFORMS, RESERVE_FRACTION
    MemoryPlan                      one (model, platform, mesh, context) answer
    abstract_model(build, mesh)     a model built with abstract weights on `mesh`
    per_device_bytes(tree)          bytes one device holds of a tree of sharded abstract arrays
    cache_bytes(spec, slots, context)   bytes of one cache of `slots` slots (abstract)
    compile_temporaries(model, spec, mesh, slots, context, chunk=None)
                                    temp bytes of the compiled decode (or prefill-chunk) step
    compile_mesh_temporaries(model, spec, mesh, split, slots, context, chunk=None)
                                    the same for the mesh engine's dispatch over every data shard
    plan(model, spec, name, platform, mesh_shape, context, temporaries=None)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from hkv import CacheConfig, CacheLayout
from hkv.core.sampling import GREEDY, SamplingBatch
from hkv.core.state import init_cache
from hkv.engine.sharded import sharded_steps
from models.placement import Abstract, placing

__all__ = [
    "PLATFORMS",
    "RESERVE_FRACTION",
    "MemoryPlan",
    "Platform",
    "abstract_mesh",
    "abstract_model",
    "cache_bytes",
    "compile_mesh_temporaries",
    "compile_temporaries",
    "layout_for",
    "per_device_bytes",
    "plan",
]

PAGE_SIZE = 64
BLOCK_TOKENS = 64
# Memory kept back for what the plan does not count (activations when temporaries are not compiled, XLA
# workspace, the runtime): 10%, as vLLM's default gpu_memory_utilization = 0.9. An assumption.
RESERVE_FRACTION = 0.10


@dataclasses.dataclass(frozen=True)
class Platform:
    """A node: `devices` accelerators of `hbm_bytes` each (`source` names where the figure is from)."""

    name: str
    devices: int
    hbm_bytes: int
    source: str


PLATFORMS = {
    "8xH200": Platform("8xH200", 8, 141 * 10**9, "NVIDIA H200 SXM datasheet: 141 GB HBM3e"),
    "v5p-16": Platform("v5p-16", 8, 95 * 2**30, "Cloud TPU v5p: 95 GiB HBM per chip; v5p-16 = 8 chips"),
    "v5e-8": Platform("v5e-8", 8, 16 * 2**30, "Cloud TPU v5e: 16 GiB HBM per chip; v5e-8 = 8 chips"),
}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per device bytes of one model on one platform's mesh at one context, and what fits.

    Attributes:
      mesh: (data, model) axis sizes. context: tokens per slot.
      weights_bytes: one device's weights. cache_per_slot_bytes / cache_fixed_bytes: one data shard's
        cache is fixed + slots x per-slot bytes (exact at `slots_per_shard`: `cache_bytes`).
      temp_bytes: the compiled decode step's temporaries at `slots_per_shard` (None: not compiled).
      usable_bytes: HBM less the reserve. slots_per_shard: the most slots a data shard fits (0: none).
    """

    model: str
    platform: str
    mesh: tuple[int, int]
    context: int
    weights_bytes: int
    cache_per_slot_bytes: int
    cache_fixed_bytes: int
    cache_bytes: int
    temp_bytes: int | None
    usable_bytes: int
    slots_per_shard: int

    @property
    def slots_per_node(self) -> int:
        """Contexts of `context` tokens the node holds at once (every data shard full)."""
        return self.slots_per_shard * self.mesh[0]

    @property
    def fits(self) -> bool:
        """Whether at least one slot fits."""
        return self.slots_per_shard > 0


def abstract_model(build: Callable[[], nnx.Module], mesh, model_axis: str | None = "model", dim_of=None, **experts):
    """`build()` (a model constructor call over abstract checkpoint tensors, e.g. `DeepseekV4(cfg,
    release.abstract_release_tensors(cfg), jnp.bfloat16)`) under the `Abstract` placement: a model whose
    weights are `jax.ShapeDtypeStruct`s sharded on `mesh` as the mesh engine shards them (`dim_of`:
    the model's `tensor_parallel_dim`, or None to replicate; `experts`: `expert_axes` and
    `expert_dim_of`, as `hkv.MeshEngine(..., expert_axes=)` splits the routed experts)."""
    with placing(Abstract(mesh, model_axis, dim_of, **experts)):
        return build()


def per_device_bytes(tree) -> int:
    """The most bytes any one device holds of a tree of abstract arrays with `NamedSharding`s."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += int(np.prod(shard)) * np.dtype(x.dtype).itemsize
    return total


def layout_for(spec, slots: int, context: int) -> CacheLayout:
    """The layout the plan counts: `slots` slots of `context` tokens, 64-row pages, no prefix records
    (the running sequences' own cache; a prefix cache is room on top of it)."""
    return CacheLayout(spec, CacheConfig(slots=slots, max_context=context, page_size=PAGE_SIZE, prefix_records=0))


def cache_bytes(spec, slots: int, context: int) -> int:
    """Bytes of one `HybridCache` of `slots` slots at `context` tokens (`jax.eval_shape`: none allocated)."""
    cache = jax.eval_shape(lambda: init_cache(layout_for(spec, slots, context)))
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(cache))


def compile_temporaries(model, spec, mesh: Mesh, slots: int, context: int, chunk: int | None = None) -> int:
    """Temporary bytes per device of the decode step (one token for each of `slots` slots) or, with
    `chunk`, of one prefill step (`chunk` tokens of one slot of a `slots`-slot cache), lowered with
    `model`'s abstract weights (sharded on `mesh`, a concrete (1, model) mesh of this machine's devices)
    and an abstract cache, compiled by this backend (`memory_analysis`)."""
    graphdef, weights = nnx.split(model)
    weights = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_on(mesh, x.sharding)), weights)
    layout = layout_for(spec, slots, context)
    replicated = NamedSharding(mesh, PartitionSpec())
    cache = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
        jax.eval_shape(lambda: init_cache(layout)),
    )

    def step(weights, cache, tokens, slots_, n_valid):
        return nnx.merge(graphdef, weights).cached_step(layout, cache, tokens, slots_, n_valid)

    rows, width = (slots, 1) if chunk is None else (1, chunk)
    ids = jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=replicated)
    which = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=replicated)
    with jax.set_mesh(mesh):  # as the mesh engine traces its steps: the MoE runs expert parallel
        compiled = jax.jit(step, donate_argnums=(1,)).lower(weights, cache, ids, which, which).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def compile_mesh_temporaries(model, spec, mesh: Mesh, split, slots: int, context: int, chunk: int | None = None) -> int:
    """Temporary bytes per device of `hkv.MeshEngine`'s decode dispatch (one token for each of `slots`
    slots of every data shard: `ShardedSteps.decode_all`, the program the engine runs) or, with
    `chunk`, of its prefill dispatch (`ShardedSteps.prefill_all`: one row of `chunk` tokens on every
    data shard), lowered with `model`'s abstract weights placed on `mesh` (a concrete (data, model)
    mesh of this machine's devices) by `split` (an `hkv.engine.weight_split.WeightSplit`, e.g. the
    experts over every device) and an abstract stacked cache, compiled by this backend
    (`memory_analysis`)."""
    graphdef, weights = nnx.split(model)
    weights = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_on(mesh, x.sharding)), weights)
    layout = layout_for(spec, slots, context)
    d = mesh.shape["data"]
    over_data = NamedSharding(mesh, PartitionSpec("data"))
    cache = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((d, *x.shape), x.dtype, sharding=over_data),
        jax.eval_shape(lambda: init_cache(layout)),
    )
    steps = sharded_steps(graphdef, None, layout, mesh, "data", split if split.splits_over("data") else None)
    rows = 1 if chunk is not None else slots
    params = SamplingBatch.stack([GREEDY] * rows)
    params = jax.tree.map(lambda x: np.stack([np.asarray(x)] * d), params)
    order = np.broadcast_to(np.arange(rows, dtype=np.int32), (d, rows)).copy()
    if chunk is not None:
        tokens = np.zeros((d, 1, chunk), np.int32)
        lowered = steps.prefill_all.lower(layout, cache, weights, tokens, order, order + chunk, params, False)
    else:
        zeros = np.zeros((d, slots), np.int32)
        stops = np.full((d, slots, 1), -1, np.int32)
        lowered = steps.decode_all.lower(layout, cache, weights, zeros, order, params, zeros + 1, stops, 1, False)
    return int(lowered.compile().memory_analysis().temp_size_in_bytes)


def _on(mesh: Mesh, sharding) -> NamedSharding:
    """The same PartitionSpec on a concrete mesh of the same axes."""
    spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
    return NamedSharding(mesh, spec)


def plan(
    model,
    spec,
    name: str,
    platform: Platform,
    mesh_shape: tuple[int, int],
    context: int,
    temporaries: Callable[[int], int] | None = None,
) -> MemoryPlan:
    """The most slots of `context` tokens one data shard of `mesh_shape` = (data, model) fits on
    `platform` with `model` (abstract weights sharded on an (data, model) mesh: `abstract_model`).

    Args:
      spec: the model's `hkv.CacheSpec` (`model.cache_spec(block_tokens=64)`).
      temporaries: slots -> temp bytes of the steps at that many slots (`compile_temporaries`: the
        decode step's, or the larger of it and a prefill step's), counted with the weights and cache;
        None: left to `RESERVE_FRACTION`.
    """
    data, mp = mesh_shape
    if data * mp != platform.devices:
        raise ValueError(f"mesh {mesh_shape} has {data * mp} devices; {platform.name} has {platform.devices}")
    weights = per_device_bytes(nnx.state(model))
    usable = int(platform.hbm_bytes * (1 - RESERVE_FRACTION))
    one, two = cache_bytes(spec, 1, context), cache_bytes(spec, 2, context)
    per_slot, fixed = two - one, 2 * one - two
    grow, base = per_slot, fixed
    if temporaries is not None:  # temporaries taken as linear in the slots from 1 and 8, then checked
        t1, t8 = temporaries(1), temporaries(8)
        grow, base = per_slot + max(0, (t8 - t1) // 7), fixed + t1 - max(0, (t8 - t1) // 7)
    slots = max(0, (usable - weights - base) // grow) if grow > 0 else 0
    temp = None
    while slots > 0:  # the exact bytes at the answer (and its temporaries), down until it fits
        cache = cache_bytes(spec, slots, context)
        temp = temporaries(slots) if temporaries is not None else None
        excess = weights + cache + (temp or 0) - usable
        if excess <= 0:
            break
        slots -= max(1, -(-excess // grow))
    cache = cache_bytes(spec, slots, context) if slots > 0 else 0
    return MemoryPlan(
        model=name,
        platform=platform.name,
        mesh=(data, mp),
        context=context,
        weights_bytes=weights,
        cache_per_slot_bytes=per_slot,
        cache_fixed_bytes=fixed,
        cache_bytes=cache,
        temp_bytes=temp,
        usable_bytes=usable,
        slots_per_shard=slots,
    )


def abstract_mesh(mesh_shape: tuple[int, int]) -> AbstractMesh:
    """An abstract (data, model) mesh of those sizes (no devices)."""
    return AbstractMesh(tuple(mesh_shape), ("data", "model"))
