"""`MeshEngine`: one engine over a `jax.sharding.Mesh` — data-parallel attention, tensor-parallel model.

The mesh has a data axis (default "data", size D) and optionally a model axis (default "model",
size M). The cache is split along the data axis into D shards, each a complete `HybridCache` for
`config.slots / D` slots with `1/D` of every pool, of the prefix index and of the snapshot slots:
every leaf of `MeshEngine.cache` is that shard layout's leaf with a leading [D] axis, sharded
`PartitionSpec(data)` — a sequence's pages, page tables, state-table rows and prefix records live on
its shard's devices only, and no cache byte ever crosses the data axis. Within a shard the model runs
tensor/expert-parallel over the model axis (GSPMD): query heads, the grouped output projection,
the indexer's heads and the MoE experts are sharded (`models.deepseek_v4.tensor_parallel_dim`),
DeepSeek-V4's single shared K=V head — and so the cache — is replicated within the shard.

Every transition is the single-device one (`hkv.core`), run per shard under `jax.shard_map` over the
data axis (the model axis stays automatic), so one program per bucket serves every shard:
- prefill and decode take every shard's rows at once ([D, rows, ...]); a shard with nothing to do
  runs idle rows (zero budget / zero valid tokens), which change nothing. The engine's step decodes
  every shard's requests in one dispatch; prefill chunks run one dispatch per shard with work.
- the small transitions (claim, release, restore, record, evict, disk install, ...) take a shard
  index and run under `lax.cond` on that shard only; the others return their cache unchanged.

Host side, each shard has its own scheduler and prefix bookkeeping (`MeshEngine.shards`, each an
`Engine` bound to its shard), and `MeshEngine.route` sends a request to the shard holding the longest
cached prefix for it (its block keys against each shard's prefix index), else to the least loaded
shard; `Generation.plan.shard` says which shard served it.

`MeshEngine.save` / `MeshEngine.restore` (also `hkv.Engine.restore(path, model, mesh=...)`) write and
read a warm-restart checkpoint of the stacked cache (`hkv.engine.checkpoint.save_mesh_engine`): it
restores onto a mesh with the same number of data shards, each shard's prefixes on that shard.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import numerics as nm

from ..core import prefix as px
from ..core.layout import CacheConfig, CacheLayout
from ..core.sampling import SEED_RANGE, SamplingBatch, SamplingParams
from ..core.state import HybridCache, init_cache
from ..core.weights import weights_digest
from .checkpoint import EngineCheckpointError, restore_mesh_engine, save_mesh_engine
from .compiled import (
    CompiledSteps,
    compiled_steps,
    counting_into,
    enable_compilation_cache,
    step_name,
    unpack_decode,
)
from .engine import Engine
from .intake import Intake, link_choices
from .interrupts import DeferredInterrupt
from .prefix_tools import PrefixQuery
from .requests import EngineBusyError, Generation, LiveRequest, RequestHandle, check_prompts
from .text_api import TextMethods
from .weight_split import WeightSplit

# the CompiledSteps transitions that run on one shard (under lax.cond); prefill and decode run on all
ONE_SHARD = (
    "claim",
    "release",
    "restore",
    "count_plan",
    "record_many",
    "evict",
    "swap_in",
    "mark_on_disk",
    "restore_window",
)


def shard_config(config: CacheConfig, shards: int) -> CacheConfig:
    """The `CacheConfig` of one data shard: `slots`, `pool_pages`, `prefix_records` and
    `tail_snapshots` divided by `shards` (each must divide evenly; `ValueError` names the one that
    does not); `memory_bytes` divided by `shards` (rounded down); None stays None (each shard sizes
    its own)."""
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards={shards!r} must be a positive integer")

    def split(name: str, v: int) -> int:
        if v % shards:
            raise ValueError(
                f"CacheConfig.{name}={v} must be a multiple of the mesh's data axis size {shards} "
                f"(each data shard owns an equal part)"
            )
        return v // shards

    pools = None
    if config.pool_pages is not None:
        pools = tuple(split(f"pool_pages[{g}]", p) for g, p in enumerate(config.pool_pages))
    return dataclasses.replace(
        config,
        slots=split("slots", config.slots),
        pool_pages=pools,
        prefix_records=None if config.prefix_records is None else split("prefix_records", config.prefix_records),
        tail_snapshots=None if config.tail_snapshots is None else split("tail_snapshots", config.tail_snapshots),
        memory_bytes=None if config.memory_bytes is None else config.memory_bytes // shards,
    )


def weight_shardings(weights, mesh: Mesh, model_axis: str | None, dim_of: Callable | None, **experts):
    """A `NamedSharding` per weight leaf: dimension `dim_of(path, shape)` split over `model_axis`
    when it divides evenly, replicated otherwise (and every leaf when there is no model axis); with
    `expert_axes=` / `expert_dim_of=`, the routed experts over those axes (`WeightSplit`).

    Args:
      weights: an `nnx.State` (or any pytree of arrays).
      dim_of: (path "layers.groups.1.0.attn.wq_b", shape) -> the dimension to split (may be negative) or None.
    """
    return WeightSplit(mesh, model_axis, dim_of, **experts).shardings(weights)


def _squeeze(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _unsqueeze(tree):
    return jax.tree.map(lambda x: x[None], tree)


def local_shard(x: jax.Array, d: int) -> jax.Array:
    """Shard d of a [D, ...] array split along its first axis, as a one-device array [...] (no
    copy across devices: the piece already lives on shard d's first device)."""
    for s in x.addressable_shards:
        first = s.index[0] if s.index else slice(None)
        lo = first.start or 0
        hi = first.stop if first.stop is not None else x.shape[0]
        if lo <= d < hi:
            piece = s.data
            return piece[d - lo] if hi - lo > 1 else piece.reshape(piece.shape[1:])
    raise ValueError(f"shard {d} of an array of shape {x.shape} is not addressable from this process")


class ShardedSteps:
    """The compiled transitions of one shard layout on a stacked cache (one program per bucket for
    every shard). Built by `sharded_steps`; `traces` counts compilations per step name.

    Attributes:
      prefill_all(layout, cache, weights, tokens[D,b,c], slots[D,b], n_valid[D,b], params[D,b], keep,
                  read, snaps: InteriorSnapshots with [D,b,K] fields or None)
      decode_all(layout, cache, weights, tokens[D,S], slots[D,S], params[D,S], budget[D,S],
                 stop_ids[D,S,n], steps, keep, read)
      one[name](layout, cache, shard, *args): the transition `name` (`ONE_SHARD`) on one shard.
    """

    def __init__(self, base: CompiledSteps, mesh: Mesh, data_axis: str, split: WeightSplit | None = None):
        # Its own count: its programs trace `base`'s steps inside `shard_map`, and a single-device
        # engine of the same shard layout shares `base` (its traces are other programs). Counted
        # in `base.traces`, a mesh engine beside such an engine reported 2 compilations per step.
        self.traces: collections.Counter = collections.Counter()
        self.mesh, self.data_axis = mesh, data_axis
        self.shards = mesh.shape[data_axis]
        d = P(data_axis)
        # experts split over the data axis (`WeightSplit.expert_axes`): the weights enter each shard's
        # program as its pieces, and every program that runs the model runs on every shard (its MoE
        # exchanges tokens across the data axis: no shard may sit one out under a `lax.cond`)
        over_data = split is not None and split.splits_over(data_axis)

        def wspec(weights):
            return split.in_specs(weights, data_axis) if over_data else P()

        def shmap(fn, in_specs):
            sharded = jax.shard_map(
                fn, mesh=mesh, in_specs=in_specs, out_specs=d, axis_names={data_axis}, check_vma=False
            )

            def traced(*args):
                with counting_into(self.traces):
                    return sharded(*args)

            return traced

        def prefill_all(layout, cache, weights, tokens, slots, n_valid, params, keep, read=None, snaps=None):
            def local(cache, weights, tokens, slots, n_valid, params, *snaps):
                rows = _squeeze((tokens, slots, n_valid, params))
                return _unsqueeze(
                    base.prefill(layout, *_squeeze((cache,)), weights, *rows, keep, read, *_squeeze(snaps))
                )

            extra = () if snaps is None else (snaps,)
            return shmap(local, (d, wspec(weights), d, d, d, d) + (d,) * len(extra))(
                cache, weights, tokens, slots, n_valid, params, *extra
            )

        def decode_all(layout, cache, weights, tokens, slots, params, budget, stop_ids, steps, keep, read=None):
            def local(cache, weights, tokens, slots, params, budget, stop_ids):
                c, tokens, slots, params, budget, stop_ids = _squeeze((cache, tokens, slots, params, budget, stop_ids))
                out = base.decode(layout, c, weights, tokens, slots, params, budget, stop_ids, steps, keep, read)
                return _unsqueeze(out)

            return shmap(local, (d, wspec(weights), d, d, d, d, d))(
                cache, weights, tokens, slots, params, budget, stop_ids
            )

        self.prefill_all = nm.jit(prefill_all, static_argnums=(0, 7, 8), donate_argnums=1)
        self.decode_all = nm.jit(decode_all, static_argnums=(0, 8, 9, 10), donate_argnums=1)

        def on_one_shard(fn):
            """fn on shard `shard` only (a `lax.cond`: the other shards return their cache unchanged)."""

            def outer(layout, cache, shard, *args):
                def local(cache, shard, *args):
                    c = _squeeze(cache)

                    def run(c):
                        return fn(layout, c, *args)

                    shapes = jax.eval_shape(run, c)

                    def skip(c):
                        if not isinstance(shapes, tuple):
                            return c
                        return (c, *jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[1:]))

                    mine = jax.lax.axis_index(data_axis) == shard
                    return _unsqueeze(jax.lax.cond(mine, run, skip, c))

                return shmap(local, (d, P()) + (P(),) * len(args))(cache, shard, *args)

            return nm.jit(outer, static_argnums=0, donate_argnums=1)

        def window_on_every_shard(layout, cache, shard, weights, slot, keys, toks, n_blocks, ids, force):
            """`restore_window` with the experts split over the data axis: its model step exchanges
            tokens across the shards, so every shard runs the program (not a `lax.cond`). The others
            run it on an unknown slot (`layout.slots`), not forced: their restore claims nothing and
            their step has no valid token, so it writes nothing, and no shard selects between two
            caches (which would keep a second copy of the pools)."""

            def local(cache, shard, weights, slot, keys, toks, n_blocks, ids, force):
                mine = jax.lax.axis_index(data_axis) == shard
                slot = jnp.where(mine, slot, layout.slots)
                out = base.restore_window(
                    layout, _squeeze(cache), weights, slot, keys, toks, n_blocks, ids, force & mine
                )
                return _unsqueeze(out)

            args = (cache, shard, weights, slot, keys, toks, n_blocks, ids, force)
            return shmap(local, (d, P(), wspec(weights)) + (P(),) * 6)(*args)

        self.one = {name: on_one_shard(getattr(base, name)) for name in ONE_SHARD}
        if over_data:
            self.one["restore_window"] = nm.jit(window_on_every_shard, static_argnums=0, donate_argnums=1)


_LOCK = threading.Lock()
_SHARED: dict = {}


def sharded_steps(
    graphdef,
    kernel_options: dict | None,
    layout: CacheLayout,
    mesh: Mesh,
    data_axis: str,
    split: WeightSplit | None = None,
):
    """The shared `ShardedSteps` for this model structure, kernel options, shard layout, mesh and
    weight split."""
    base = compiled_steps(graphdef, kernel_options, layout)
    key = (id(base), mesh, data_axis, split)
    with _LOCK:
        hit = _SHARED.get(key)
        if hit is None or hit[0] is not base:
            hit = (base, ShardedSteps(base, mesh, data_axis, split))
            _SHARED.clear()  # the newest only: older entries' programs are freed with their base
            _SHARED[key] = hit
        return hit[1]


class _Bound:
    """A `CompiledSteps`-style callable `(layout, cache, *args)` for shard d: pads `args` into the
    all-shard (or one-shard) program's inputs and returns the cache plus shard d's outputs."""

    def __init__(self, fn, d: int, pad: Callable, pick: bool = True):
        self.fn, self.d, self.pad, self.pick = fn, d, pad, pick

    def __call__(self, layout, cache, *args):
        out = self.fn(layout, cache, *self.pad(*args))
        if not isinstance(out, tuple):
            return out
        return (out[0], *jax.tree.map(lambda x: local_shard(x, self.d), out[1:]))

    def lower(self, layout, cache, *args):
        return self.fn.lower(layout, cache, *self.pad(*args))


class _ShardStepsView:
    """`CompiledSteps`' names for data shard d of a `ShardedSteps` (what a shard's `Engine` calls)."""

    def __init__(self, steps: ShardedSteps, d: int):
        self.traces = steps.traces
        n = steps.shards
        shard = np.int32(d)

        def stack(x, idle):
            """[n, ...] with x at row d and `idle` elsewhere."""
            x = np.asarray(x)
            out = np.broadcast_to(np.asarray(idle, x.dtype), (n, *x.shape)).copy()
            out[d] = x
            return out

        def same(tree):
            return jax.tree.map(lambda x: np.stack([np.asarray(x)] * n), tree)

        def pad_prefill(weights, tokens, slots, n_valid, params, keep, read=None, snaps=None):
            rows = (stack(tokens, 0), stack(slots, 0), stack(n_valid, 0), same(params))
            extra = () if snaps is None else (jax.tree.map(lambda a: stack(a, -1), snaps),)
            return weights, *rows, keep, read, *extra

        def pad_decode(weights, tokens, slots, params, budget, stop_ids, steps_, keep, read=None):
            idle_slots = np.arange(np.shape(slots)[0], dtype=np.int32)
            s = np.broadcast_to(idle_slots, (n, len(idle_slots))).copy()
            s[d] = np.asarray(slots)
            rows = (stack(tokens, 0), s, same(params), stack(budget, 0), stack(stop_ids, -1))
            return weights, *rows, steps_, keep, read

        self.prefill = _Bound(steps.prefill_all, d, pad_prefill)
        self.decode = _Bound(steps.decode_all, d, pad_decode)
        for name in ONE_SHARD:
            setattr(self, name, _Bound(steps.one[name], d, lambda *a: (shard, *a)))


class _LocalView:
    """Shard d of a stacked `HybridCache`, for host reads: each top-level field is built on first
    access from the shard's own pieces (`local_shard`), so reading the prefix index copies nothing
    across devices and never touches the pools."""

    def __init__(self, stacked: HybridCache, d: int):
        self._stacked, self._d, self._fields = stacked, d, {}

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        fields = self.__dict__["_fields"]
        if name not in fields:
            value = getattr(self._stacked, name)
            fields[name] = jax.tree.map(lambda x: local_shard(x, self._d), value)
        return fields[name]

    def as_cache(self) -> HybridCache:
        """The whole shard as a `HybridCache` (e.g. for `hkv.check_invariants(shard_layout, ...)`)."""
        return jax.tree.map(lambda x: local_shard(x, self._d), self._stacked)


class _ShardEngine(Engine):
    """An `Engine` whose cache is data shard `shard` of its `MeshEngine`'s stacked cache: its own
    scheduler and prefix bookkeeping, the mesh's shared programs and weights."""

    def __init__(self, group: MeshEngine, shard: int, model, config: CacheConfig, **kwargs):
        self._group, self.shard = group, shard
        super().__init__(model, config, **kwargs)
        self.compile_plan.compact = False  # the mesh's decode runs every shard's slots at once

    def _bind_model(self, model, block_tokens: int, model_id: str) -> None:
        g = self._group
        self._graphdef, self._weights = g._graphdef, g._weights
        self.spec = dataclasses.replace(
            model.cache_spec(block_tokens=block_tokens, model_id=model_id), weights_digest=g._digest
        )

    @property
    def cache(self) -> HybridCache:
        return self._group.cache

    @cache.setter
    def cache(self, value) -> None:
        self._group.cache = value

    def _new_cache(self):
        return self._group._ensure_cache(self.layout)

    def _make_steps(self, kernel_options):
        return _ShardStepsView(self._group._sharded(self.layout), self.shard)

    @property
    def _view(self):
        return _LocalView(self._group.cache, self.shard)

    def _reset_cache(self) -> None:
        self._group._reset_cache()

    def save(self, path, *, overwrite: bool = False) -> None:
        raise EngineCheckpointError(
            f"data shard {self.shard} of a MeshEngine cannot be saved alone (the shards' cache is one stacked "
            f"value); save the MeshEngine itself (mesh_engine.save(path)), every shard at once"
        )


class MeshEngine(TextMethods):
    """Generation over a `jax.sharding.Mesh`: data-parallel attention over `data_axis`, the model
    tensor/expert-parallel over `model_axis` (see the module docstring).

    Args:
      model, config: as for `hkv.Engine`; `config` is the whole mesh's capacity: `slots`,
        `pool_pages`, `prefix_records` and `tail_snapshots` are split evenly over the data shards
        (`shard_config`).
      mesh: a `jax.sharding.Mesh` with `data_axis` and, optionally, `model_axis` (any other axis is
        a `ValueError`).
      tensor_parallel: (weight path, shape) -> the dimension split over `model_axis`, or None to
        replicate; default `model.tensor_parallel_dim` when the model has one, else replicate all.
      route: "prefix" (default: the shard with the longest cached prefix, else the least loaded) or
        "balance" (least loaded only, ignoring cached prefixes).
      expert_axes: None (default): the routed experts split as `tensor_parallel` says (over
        `model_axis` only). A tuple of mesh axes, data axis first: the routed experts split over all
        of them, e.g. `(data_axis, model_axis)`: attention data-parallel and every device holding
        E / (D x M) experts ("DP attention + EP"); each step's MoE all-gathers the data shards'
        tokens and reduce-scatters the pair outputs back (`models.deepseek_v4.moe`). Needs a model
        with `expert_parallel_dim`; `ValueError` when the axes do not divide its experts.
      engine_kwargs: every other `hkv.Engine` keyword (block_tokens, prefill_chunk, decode_steps,
        retention, disk, seed, ...). A `disk` tier is shared by every shard.

    Attributes:
      shards: one `hkv.Engine` per data shard (its own scheduler and prefix index), in data order.
      layout: the layout of one shard (every shard has the same).
      cache: the stacked `HybridCache`: every leaf [D, ...] sharded over `data_axis`.

    `save(path)` / `MeshEngine.restore(path, model, mesh=...)`: a warm restart (see `save`).
    """

    def __init__(
        self,
        model,
        config: CacheConfig,
        *,
        mesh: Mesh,
        data_axis: str = "data",
        model_axis: str | None = "model",
        tensor_parallel: Callable | None = None,
        route: str = "prefix",
        expert_axes: Sequence[str] | None = None,
        **engine_kwargs,
    ):
        if not isinstance(mesh, Mesh):
            raise ValueError(f"mesh={mesh!r} must be a jax.sharding.Mesh")
        if data_axis not in mesh.axis_names:
            raise ValueError(f"data_axis={data_axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
        if model_axis is not None and model_axis not in mesh.axis_names:
            model_axis = None
        extra = [a for a in mesh.axis_names if a not in (data_axis, model_axis)]
        if extra:
            raise ValueError(f"mesh axes {extra} are neither data_axis={data_axis!r} nor model_axis={model_axis!r}")
        if route not in ("prefix", "balance"):
            raise ValueError(f"route={route!r} must be 'prefix' or 'balance'")
        if expert_axes is not None:
            expert_axes = tuple(expert_axes)
            if not expert_axes or (data_axis in expert_axes and expert_axes[0] != data_axis):
                raise ValueError(
                    f"expert_axes={expert_axes!r} must be a non-empty tuple of mesh axes with data_axis="
                    f"{data_axis!r}, if present, first (each data shard's experts on its own devices)"
                )
        warm = engine_kwargs.pop("warmup", False)
        self._seed_set = engine_kwargs.get("seed") is not None
        self._tensor_parallel_set = tensor_parallel is not None
        self.mesh, self.data_axis, self.model_axis, self.routing = mesh, data_axis, model_axis, route
        self.config = config
        n = mesh.shape[data_axis]
        local = shard_config(config, n)
        self.compilation_cache = enable_compilation_cache(engine_kwargs.pop("compilation_cache", None))
        self._graphdef, weights = nnx.split(model)
        weights = jax.tree.map(lambda x: x, weights)
        self._digest = weights_digest(weights)
        dim_of = tensor_parallel if tensor_parallel is not None else getattr(model, "tensor_parallel_dim", None)
        self._expert_axes_set = expert_axes is not None
        self.weight_split = WeightSplit(
            mesh, model_axis, dim_of, expert_axes or (), getattr(model, "expert_parallel_dim", None)
        )
        self.weight_shardings = self.weight_split.shardings(weights)
        self._weights = jax.device_put(weights, self.weight_shardings)
        self._kernel_options = engine_kwargs.get("kernel_options")
        self.cache: HybridCache | None = None
        self._steps: ShardedSteps | None = None
        self._drive_lock = threading.Lock()
        self._interrupt: DeferredInterrupt | None = None  # set while `_drive` runs (`_decode_all` delivers it)
        self._seeds = np.random.default_rng(engine_kwargs.pop("seed", None))
        self.shards: list[Engine] = [
            _ShardEngine(self, d, model, local, compilation_cache=False, **engine_kwargs) for d in range(n)
        ]
        self.layout = self.shards[0].layout
        self.model = model
        if warm:
            self.warmup()

    # ------------------------------------------------------------------ device state (shards call these)
    def _sharded(self, layout: CacheLayout) -> ShardedSteps:
        if self._steps is None:
            split = self.weight_split if self.weight_split.splits_over(self.data_axis) else None
            self._steps = sharded_steps(self._graphdef, self._kernel_options, layout, self.mesh, self.data_axis, split)
        return self._steps

    def _ensure_cache(self, layout: CacheLayout) -> HybridCache:
        if self.cache is None:
            self.cache = self._fresh(layout)
        return self.cache

    def _fresh(self, layout: CacheLayout) -> HybridCache:
        n = self.mesh.shape[self.data_axis]
        sharding = NamedSharding(self.mesh, P(self.data_axis))
        build = jax.jit(
            lambda: jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), init_cache(layout)),
            out_shardings=sharding,
        )
        return build()

    def _reset_cache(self) -> None:
        """The stacked cache was lost (an interrupted transition): every shard starts from an empty
        cache, and every shard's running requests are re-queued."""
        self.cache = self._fresh(self.layout)
        for e in self.shards:
            e.prefix_manager.forget()

    def cache_shardings(self) -> dict[str, NamedSharding]:
        """{leaf path: its sharding} for every leaf of `cache` (all `PartitionSpec(data_axis)`)."""
        return {jax.tree_util.keystr(p): x.sharding for p, x in jax.tree_util.tree_leaves_with_path(self.cache)}

    def shard_cache(self, d: int) -> HybridCache:
        """Data shard d's `HybridCache` (one-device arrays), e.g. for
        `hkv.check_invariants(engine.layout, engine.shard_cache(d))`."""
        return _LocalView(self.cache, d).as_cache()

    # ---------------------------------------------------------------------------------- routing
    def route(self, prompt: Sequence[int]) -> int:
        """The data shard a request for `prompt` goes to. With route="prefix": the shard whose prefix
        index holds the longest chain of the prompt's block keys (`cached_blocks`); on a tie (no
        shard holds any), the least loaded one (requests queued or holding a slot), then the one
        with the fewest cached records (room for the new chain), then the lowest index. With
        route="balance": load, then cached records, then index."""
        loads = [e.pending for e in self.shards]
        if self.shards[0].prefix_enabled:
            hits, held = self._prefix_hits(prompt)
        else:
            hits, held = [0] * len(self.shards), [0] * len(self.shards)
        if self.routing != "prefix":
            hits = [0] * len(self.shards)
        return min(range(len(self.shards)), key=lambda d: (-hits[d], loads[d], held[d], d))

    def cached_blocks(self, prompt: Sequence[int]) -> list[int]:
        """Per shard, the leading blocks of `prompt` whose block keys its prefix index holds (alive
        records; a host-side check of keys only: the restore itself still validates everything)."""
        return self._prefix_hits(prompt)[0]

    def _prefix_hits(self, prompt: Sequence[int]) -> tuple[list[int], list[int]]:
        """(leading blocks of `prompt` cached per shard, alive records per shard)."""
        e0 = self.shards[0]
        q = PrefixQuery.of(list(prompt), e0.layout, e0.cache_salt)
        want = [k.tobytes() for k in np.asarray(q.keys, np.uint32)[: int(q.n_blocks)]]
        hits, held = [], []
        for d in range(len(self.shards)):
            p = _LocalView(self.cache, d).prefix
            keys, state = jax.device_get((p.key, p.state))
            alive = np.asarray(state) == px.RecordState.ALIVE
            have = {k.tobytes() for k in np.asarray(keys, np.uint32)[alive]}
            n = 0
            while n < len(want) and want[n] in have:
                n += 1
            hits.append(n)
            held.append(int(alive.sum()))
        return hits, held

    # ---------------------------------------------------------------------------------- generation
    def generate(
        self,
        prompts,
        max_new_tokens: int | None = None,
        *,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        stop_token_ids: Sequence[int] = (),
        return_logits: bool = False,
    ) -> list[Generation]:
        """As `hkv.Engine.generate`; each prompt runs on the shard `route` picks (in order, so
        prompts of one call spread over the shards; a prompt's choices share its shard), and its
        `plan.shard` says which."""
        specs = self._intake().requests(prompts, max_new_tokens, sampling, stop_token_ids, return_logits)
        return self._generate(specs)

    def _intake(self) -> Intake:
        """The mesh's `Intake`: a sampled request without a seed gets one from the mesh engine's
        generator (as `Engine` draws them), so a `MeshEngine(seed=s)` samples what an `Engine(seed=s)` does."""
        draw = lambda s: 0 if s.greedy else int(self._seeds.integers(0, SEED_RANGE))
        cap, vocab = self.layout.config.max_context, self.model.vocab_size
        return Intake(max_context=cap, vocab_size=vocab, tokenizer=self.shards[0].tokenizer, draw_seed=draw,
                      engine="hkv.MeshEngine")  # fmt: skip

    def _generate(self, specs) -> list[Generation]:
        """Queue each request on the shard `route` picks for its prompt, in order, and run them all."""
        intake, shard_of = self._intake(), {}
        with self._drive():
            seqs = []
            for i, spec in enumerate(specs):
                if spec.source not in shard_of:
                    shard_of[spec.source] = self.shards[self.route(spec.prompt)]
                e = shard_of[spec.source]
                seq = intake.live(spec, i, shard=e.shard)
                e.scheduler.queue.append(seq)
                seqs.append(seq)
            link_choices(specs, seqs)
            self._run(seqs)
        return [s.generation(self.model.vocab_size) for s in seqs]

    def submit(
        self,
        prompt,
        max_new_tokens: int | None = None,
        *,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] = (),
        return_logits: bool = False,
    ) -> RequestHandle:
        """As `hkv.Engine.submit` (thread-safe): routed now, run by `step` / `run_until_idle`."""
        e = self._route_one(prompt)
        return e.submit(prompt, max_new_tokens, sampling=self._seeded(sampling), stop_token_ids=stop_token_ids,
                        return_logits=return_logits)  # fmt: skip

    def submit_choices(
        self,
        prompt,
        max_new_tokens: int | None = None,
        *,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] = (),
        return_logits: bool = False,
    ) -> list[RequestHandle]:
        """As `hkv.Engine.submit_choices`: the prompt's `sampling.n` choices on the shard `route` picks
        (the later ones restore the first one's prefill there)."""
        e = self._route_one(prompt)
        return e.submit_choices(prompt, max_new_tokens, sampling=self._seeded(sampling),
                                stop_token_ids=stop_token_ids, return_logits=return_logits)  # fmt: skip

    def _route_one(self, prompt) -> Engine:
        """The shard a submitted prompt (ids, or text with a tokenizer) runs on."""
        ids = self._intake().encode([prompt])[0] if isinstance(prompt, str) else prompt
        cap, vocab = self.layout.config.max_context, self.model.vocab_size
        (ids,), _ = check_prompts([ids], 0, max_context=cap, vocab_size=vocab)
        return self.shards[self.route(ids)]

    @property
    def tokenizer(self):
        """The shards' `TextCodec` (`tokenizer=`), or None."""
        return self.shards[0].tokenizer

    @property
    def chat_template(self):
        """The shards' `ChatTemplate` (`chat_template=`, or the tokenizer folder's), or None."""
        return self.shards[0].chat_template

    def step(self) -> bool:
        """As `hkv.Engine.step`, for every shard: admissions and prefill chunks per shard, then one
        decode dispatch for every shard's decoding requests. True while requests remain."""
        with self._drive():
            return self._step()

    def run_until_idle(self) -> None:
        """Call `step` until no shard has a request queued or running."""
        with self._drive():
            while self._step():
                pass

    @property
    def pending(self) -> int:
        """Requests submitted or queued and not yet finished, over every shard."""
        return sum(e.pending for e in self.shards)

    def _seeded(self, sampling: SamplingParams | None) -> SamplingParams | None:
        """A sampled request without a seed gets one from the mesh engine's generator (as `Engine`
        draws them), so a `MeshEngine(seed=s)` samples what an `Engine(seed=s)` does."""
        if sampling is None or sampling.greedy or sampling.seed is not None:
            return sampling
        return dataclasses.replace(sampling, seed=int(self._seeds.integers(0, SEED_RANGE)))

    def _run(self, seqs: list[LiveRequest], after_step: Callable[[], None] | None = None) -> None:
        try:
            while not all(s.over for s in seqs):
                self._step()
                for s in seqs:
                    if s.error is not None:
                        raise s.error
                if after_step is not None:
                    after_step()
            for e in self.shards:
                e.scheduler.reap()
        except BaseException:
            for s in seqs:
                s.cancelled = True
            raise

    def _step(self) -> bool:
        for e in self.shards:
            e.prefix_manager.poll_disk()
            e.scheduler.take_inbox()
            e.scheduler.admit_and_prefill()
        self._decode_all()
        for e in self.shards:
            e.scheduler.reap()
        return any(e.scheduler.busy() for e in self.shards)

    def _decode_all(self) -> None:
        """One decode dispatch for every shard with decoding requests (the others run idle rows)."""
        todo = {e.shard: (e, *e.scheduler.decode_inputs()) for e in self.shards if e.scheduler.running}
        if not todo:
            return
        n = len(self.shards)
        s = self.layout.slots
        width = max(args[5].shape[1] for _, _, args, _ in todo.values())
        keep = any(args[7] for _, _, args, _ in todo.values())
        k = self.shards[0].decode_steps
        tokens = np.zeros((n, s), np.int32)
        slots = np.broadcast_to(np.arange(s, dtype=np.int32), (n, s)).copy()
        budget = np.zeros((n, s), np.int32)
        stop_ids = np.full((n, s, width), -1, np.int32)
        params = []
        for d in range(n):
            if d in todo:
                _, _, args, _ = todo[d]
                _, tok, _, prm, bud, stp = args[:6]
                tokens[d], budget[d] = tok, bud
                stop_ids[d, :, : stp.shape[1]] = stp
                params.append(prm)
            else:
                params.append(next(iter(todo.values()))[2][3])
        params = SamplingBatch.widen_all(params)  # one compiled variant for every shard
        variant, top_n = params[0].variant, params[0].top_n
        params = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *params)
        reads = [args[8] for _, _, args, _ in todo.values()]  # each shard's read bound (None: max_context)
        read = None if None in reads else max(reads)
        name = step_name("decode", str(k), stops=width, logits=keep, read=read, variant=variant)
        steps = self._sharded(self.layout)
        fresh = steps.traces[name] == 0
        for e, _, _, _ in todo.values():
            e.compile_plan.names.add(name)
        t0 = time.perf_counter()
        out = steps.decode_all(
            self.layout, self.cache, self._weights, tokens, slots, params, budget, stop_ids, k, keep, read
        )
        self.cache = out[0]
        host = jax.device_get(out[1])  # [D, S, 2k + 3]: `pack_decode` per shard
        dt = time.perf_counter() - t0
        for d, (e, rows, _, _) in todo.items():
            if fresh:
                e.compile_plan.compile_seconds += dt
            lg = local_shard(out[2], d) if keep else None
            e.scheduler.decode_outputs(rows, unpack_decode(host[d], k, top_n), lg, dt, fresh)
        if self._interrupt is not None:  # a point between two transitions of the mesh's cache
            self._interrupt.deliver()

    @contextlib.contextmanager
    def _drive(self):
        """One driving thread at a time (`EngineBusyError`; `EngineClosedError` after `close()`), a
        SIGINT deferred to the next point between two transitions, and on any exception every
        shard's in-flight requests released (each shard's `Engine.held`) before it propagates."""
        deferred = DeferredInterrupt()
        with self._exclusive(deferred):
            self._interrupt = deferred
            try:
                with deferred:
                    yield
            finally:
                self._interrupt = None

    # ---------------------------------------------------------------------------------- the rest
    def warmup(self, **kwargs) -> dict[str, float]:
        """Compile every step once (`hkv.Engine.warmup` on shard 0: the programs are every shard's)."""
        if not self._drive_lock.acquire(blocking=False):
            raise EngineBusyError("another thread is driving this MeshEngine; drive it from one thread")
        try:
            times = self.shards[0].warmup(**kwargs)
        finally:
            self._drive_lock.release()
        for e in self.shards[1:]:
            e.compile_plan.names.update(self.shards[0].compile_plan.names)
        return times

    @property
    def compilations(self) -> dict[str, int]:
        """Compilations per step name over every shard (one per bucket: the shards share programs)."""
        names = set().union(*(e.compile_plan.names for e in self.shards))
        traces = self.shards[0].steps.traces
        return {n: traces[n] for n in sorted(names)}

    def stats(self) -> dict[str, Any]:
        """{"shards": each shard's `Engine.stats()`, plus the sums of their request and token counts}."""
        per = [e.stats() for e in self.shards]
        total = {
            k: sum(p[k] for p in per)
            for k in ("prompts", "prefill_tokens", "generated_tokens", "preemptions", "active_slots", "disk_restores")
        }
        return {**total, "shards": per, "compilations": self.compilations}

    def memory_report(self) -> list[dict[str, dict[str, int]]]:
        """`hkv.Engine.memory_report` per data shard (bytes on each shard's devices)."""
        return [e.memory_report() for e in self.shards]

    def evict_prefixes(self) -> int:
        """`hkv.Engine.evict_prefixes` on every shard; returns the records evicted."""
        return sum(e.evict_prefixes() for e in self.shards)

    def flush_disk(self) -> None:
        """Wait for every shard's disk writes (`hkv.Engine.flush_disk`)."""
        for e in self.shards:
            e.flush_disk()

    def close(self) -> None:
        """Finish pending disk writes and retire every shard (`hkv.Engine.close`: later calls raise
        `hkv.EngineClosedError`)."""
        for e in self.shards:
            e.close()

    def save(self, path, *, overwrite: bool = False) -> None:
        """Warm-restart checkpoint of the whole mesh engine: its stacked cache (every data shard's) and
        its settings, in `hkv.Engine.save`'s format with a `mesh` section, written atomically
        (`hkv.engine.checkpoint.save_mesh_engine`). Every shard's pending disk-tier writes are finished
        first. Only between calls: requests cancelled since the last step are dropped first, and
        `EngineCheckpointError` (naming the shard) while any shard runs or holds requests;
        `EngineBusyError` if another thread drives the engine or one of its shards."""
        with self._exclusive():
            for e in self.shards:
                e.prefix_manager.flush_disk()
            save_mesh_engine(self, path, overwrite=overwrite)

    @classmethod
    def restore(cls, path, model, *, mesh: Mesh, **engine_kwargs) -> MeshEngine:
        """A mesh engine rebuilt from `save(path)` on `mesh`, its stacked cache verified as
        `hkv.Engine.restore` verifies one (per-array checksums, ABI fingerprint, `check_invariants` on
        every shard) before use; each request is then routed to the shard holding its prefix, as
        before the restart. `mesh`'s data axis must have the saved number of data shards
        (`EngineCheckpointError` naming both counts otherwise); its model axis may have any size.
        engine_kwargs override the saved settings (data_axis, model_axis and route included) or add
        runtime ones (`disk=`, `tokenizer=`, `tensor_parallel=`, `seed=`, ...).
        `hkv.Engine.restore(path, model, mesh=mesh)` calls this."""
        return restore_mesh_engine(cls, path, model, mesh=mesh, split=shard_config, **engine_kwargs)

    def unsaved_settings(self) -> dict[str, bool]:
        """Which settings a checkpoint cannot hold are set (`hkv.Engine.unsaved_settings`, plus a
        `tensor_parallel` function and `expert_axes`); `restore` warns, naming those not given to it again."""
        mine = {
            "seed": self._seed_set,
            "tensor_parallel": self._tensor_parallel_set,
            "expert_axes": self._expert_axes_set,
        }
        return {**self.shards[0].unsaved_settings(), **mine}

    @contextlib.contextmanager
    def _exclusive(self, deferred: DeferredInterrupt | None = None):
        """One thread at a time: this engine's lock and every shard's `Engine.held(deferred)`
        (`EngineBusyError`, `EngineClosedError` after `close()`). Without `deferred`: a call between
        steps (save), each shard's requests cancelled since the last step dropped first."""
        if not self._drive_lock.acquire(blocking=False):
            raise EngineBusyError("another thread is driving this MeshEngine; drive it from one thread")
        try:
            with contextlib.ExitStack() as held:
                for e in self.shards:
                    held.enter_context(e.held(deferred))
                yield
        finally:
            self._drive_lock.release()


Engine.mesh_class = MeshEngine  # `hkv.Engine(model, config, mesh=...)` builds one
