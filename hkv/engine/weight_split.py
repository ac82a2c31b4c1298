"""How a mesh splits a model's weights: tensor parallel over the model axis, the routed experts over
the model axis or over several axes (expert parallel across the data axis too).

`WeightSplit` is the one rule `hkv.MeshEngine` (its weights' shardings and the specs its per-shard
programs take them with) and `models.placement.OnMesh` (the streamed loader, the memory plan) share,
so a model loaded onto a mesh already lies where the engine wants it.

- A weight whose `expert_dim_of(path, shape)` is a dimension (a stack of routed experts [E, ...]) is
  split over `expert_axes` (e.g. ("data", "model"): E / (D x M) experts per device) when those axes'
  sizes divide it; `ValueError` names the weight otherwise.
- Any other weight is split over `model_axis` on `dim_of(path, shape)` where the axis divides it,
  replicated otherwise (query heads, output projections, vocabulary rows, ...).

Within a per-data-shard program (`jax.shard_map` over the data axis), a weight split over the data
axis enters as its shard's piece (`in_spec`); every other weight enters whole (replicated over data,
split over "model" automatically).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

DimOf = Callable[[str, tuple[int, ...]], "int | None"]


def leaf_name(path) -> str:
    """A weight's canonical dotted path ("layers.groups.1.0.attn.wq_b") from a pytree key path."""
    name = ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
    return name.removesuffix(".value")


@dataclasses.dataclass(frozen=True)
class WeightSplit:
    """The sharding rule of a model's weights on `mesh` (see the module docstring).

    Attributes:
      mesh: a `jax.sharding.Mesh` or `AbstractMesh`.
      model_axis: the tensor-parallel axis (None or an axis the mesh lacks: nothing split over it).
      dim_of: (path, shape) -> the dimension split over `model_axis`, or None (e.g.
        `models.deepseek_v4.tensor_parallel_dim`); None: replicate every weight.
      expert_axes: the axes the routed experts are split over, major first (() : as `dim_of` says).
      expert_dim_of: (path, shape) -> the expert dimension of a routed-expert stack, else None (e.g.
        `models.deepseek_v4.expert_parallel_dim`); needed with `expert_axes`.
    """

    mesh: object
    model_axis: str | None = "model"
    dim_of: DimOf | None = None
    expert_axes: tuple[str, ...] = ()
    expert_dim_of: DimOf | None = None

    def __post_init__(self):
        names = tuple(self.mesh.axis_names)
        if self.model_axis is not None and self.model_axis not in names:
            object.__setattr__(self, "model_axis", None)
        axes = tuple(self.expert_axes or ())
        object.__setattr__(self, "expert_axes", axes)
        bad = [a for a in axes if a not in names]
        if bad or len(set(axes)) != len(axes):
            raise ValueError(f"expert_axes={axes!r} must be distinct axes of the mesh {names}")
        if axes and self.expert_dim_of is None:
            raise ValueError(
                f"expert_axes={axes!r} needs a model that names its routed experts (expert_parallel_dim); "
                f"this one has none"
            )

    @property
    def expert_devices(self) -> int:
        """How many ways `expert_axes` split a stack of experts (1 without them)."""
        return math.prod(self.mesh.shape[a] for a in self.expert_axes)

    def spec(self, name: str | None, shape: tuple[int, ...]) -> P:
        """The PartitionSpec of weight `name` of `shape` on the mesh.

        Raises:
          ValueError: `name` is a routed-expert stack whose expert count `expert_axes` do not divide.
        """
        if name is None or not shape:
            return P()
        if self.expert_axes:
            dim = self.expert_dim_of(name, shape)
            if dim is not None:
                n = self.expert_devices
                if shape[dim] % n:
                    raise ValueError(
                        f"expert_axes={self.expert_axes!r} split the experts {n} ways, which does not divide "
                        f"the {shape[dim]} experts of {name} {shape}"
                    )
                parts: list = [None] * len(shape)
                parts[dim % len(shape)] = self.expert_axes if len(self.expert_axes) > 1 else self.expert_axes[0]
                return P(*parts)
        m = self.mesh.shape[self.model_axis] if self.model_axis is not None else 1
        if m == 1 or self.dim_of is None:
            return P()
        dim = self.dim_of(name, shape)
        if dim is None or shape[dim] % m:
            return P()
        parts = [None] * len(shape)
        parts[dim % len(shape)] = self.model_axis
        return P(*parts)

    def shardings(self, weights):
        """A `NamedSharding` per leaf of `weights` (an `nnx.State` or any pytree of arrays)."""
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf: NamedSharding(self.mesh, self.spec(leaf_name(path), tuple(leaf.shape))), weights
        )

    def splits_over(self, axis: str) -> bool:
        """Whether some weights are split over `axis` (the data axis: then a per-shard program takes
        them by `in_specs`)."""
        return axis in self.expert_axes

    def in_specs(self, weights, axis: str):
        """The `jax.shard_map` in_specs of `weights` for a program manual over `axis` alone: each
        leaf's spec kept to `axis` (a weight split over it enters as its shard's piece), P() for the
        rest."""

        def one(path, leaf) -> P:
            spec = self.spec(leaf_name(path), tuple(leaf.shape))
            parts = []
            for p in spec:
                names = p if isinstance(p, tuple) else (p,)
                parts.append(axis if axis in names else None)
            return P(*parts) if axis in parts else P()

        return jax.tree_util.tree_map_with_path(one, weights)
