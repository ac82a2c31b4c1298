"""Decoder layers held stacked (`LayerStack`), so that a step runs repeating layers under one scan.

Shared by the model families (`models.deepseek_v4`, `models.gemma3`). A model builds its decoder
layers one module each, then hands them to `LayerStack`, which keys each layer by its structure (the
NNX graph with its static attributes and the shapes and dtypes of its weights) and splits the stack
into runs of a repeating period (`hkv.core.layers.plan_layer_runs`). A repeating run keeps, per
position of its period, ONE module whose weights carry a leading axis of the run's repetitions
(stacked once, when the model is built); layers nothing repeats around stay one module each.

A step (`layer_runs`) scans a stacked run's weights as they are: the traced program holds one
period of layers whatever the depth, and no call copies or re-stacks weights, whatever their size.

`model.layers` stays a sequence of layers: `len(model.layers)`, `model.layers[i]`, iteration. Layer
i of a repeating run is a `LayerView`: reading `model.layers[i].attn.wq_a.value` gives that layer's
slice, assigning `.value` writes the slice back into the stacked weight (the next `nnx.split(model)`
sees it), calling it runs the layer. Parameter paths are those of the stacked modules
(`layers.groups.G.J.<name>`, leading axis = repetition), which `hkv.weights_digest` and tensor
parallel rules (negative dims) see.

Whether a model is held stacked at all is `LayerStack(stack=)` / `STACK_LAYERS`, by default
`stack_by_default`: deep models (compile time) and models of small layers are stacked; a shallow model
of large layers is held one module per layer, so that its decode steps read each weight where it lies
instead of copying it out of a stack at every step.

`scan_layers` (every `scan_layers=None` argument defers to `SCAN_LAYERS`, default True) only chooses
how a step runs the stacked runs: under a scan, or one layer at a time (`scan_layers=False`: the
Python loop, each layer's weights sliced out of its stack inside jit).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hkv.core.layers import LayerCache, LayerRun, Step, plan_layer_runs
from hkv.core.layers import scan_layers as scan_cached_layers
from hkv.core.state import HybridCache

__all__ = [
    "SCAN_LAYERS",
    "STACK_DEPTH",
    "STACK_LAYERS",
    "STACK_SMALL_BYTES",
    "LayerStack",
    "LayerView",
    "VariableView",
    "layer_key",
    "layer_runs",
    "run_cached_layers",
    "run_layers",
    "stack_by_default",
    "use_scan",
]

SCAN_LAYERS: bool = True  # the default of every `scan_layers=None`: False runs the layers one at a time

# Whether `LayerStack` holds repeating runs stacked: True / False for every model built after it is set,
# None (default) for `stack_by_default`'s rule.
STACK_LAYERS: bool | None = None
# `stack_by_default`: stack when a model has more layers than this ...
STACK_DEPTH = 16
# ... or when one layer's weights are smaller than this many bytes.
STACK_SMALL_BYTES = 1 << 20


def stack_by_default(n_layers: int, layer_bytes: int) -> bool:
    """Whether a model of `n_layers` decoder layers of `layer_bytes` bytes of weights each is held
    stacked when neither `LayerStack(stack=)` nor `STACK_LAYERS` says.

    Stacking buys compile time: a step's program holds one period of layers however deep the model.
    It costs at every step a copy of each layer's weights out of its stack (XLA:CPU hands a dot its
    operands as buffers of their own; a slice of a stacked weight is copied first): at batch 1 a decode
    token then moves each weight three times instead of reading it once (on the issue-48 small Gemma 3,
    8 layers of 4.4 MB, 3.8 ms per token stacked against 2.5 unstacked at 1K). So a model is stacked
    when it is deep (more than `STACK_DEPTH` layers: compile time grows with the unrolled depth) or its
    layers are small (under `STACK_SMALL_BYTES` each: nothing measurable to copy), else held one module
    per layer."""
    return n_layers > STACK_DEPTH or layer_bytes < STACK_SMALL_BYTES


def use_scan(scan_layers: bool | None) -> bool:
    """Whether repeating layers run under a scan: scan_layers True / False decide, None defers to
    `SCAN_LAYERS`."""
    return bool(SCAN_LAYERS if scan_layers is None else scan_layers)


def layer_key(layer: nnx.Module) -> tuple:
    """A hashable structure key of one layer: equal keys run the same code on same-shaped weights."""
    graphdef, state = nnx.split(layer)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    return graphdef, tuple((jax.tree_util.keystr(p), tuple(x.shape), str(x.dtype)) for p, x in leaves)


def _wrap(value, r: int):
    """What attribute or item access on a stacked module returns through a view of repetition r."""
    if isinstance(value, nnx.Variable):
        return VariableView(value, r)
    if isinstance(value, nnx.Module):
        return LayerView(value, r)
    return value


class VariableView:
    """Repetition `r` of a stacked weight (`LayerView`), with the reading and writing half of the NNX
    Variable API: `.value`, `get_value()`, `view[...]` and `jnp.asarray(view)` read the layer's slice
    ([...] of the stacked array minus its leading axis); assigning `.value`, `set_value(x)` or
    `view[index] = x` writes into that slice of the stacked variable (the next `nnx.split(model)`
    sees it).

    A write keeps the stacked weight's shape and dtype: a value of another shape, or one that only an
    unsafe cast would store (e.g. floats into an integer table), is a ValueError. Each write builds a
    new stacked array (`.at[r].set`: transiently twice that weight's memory; the old array stays valid
    for whoever holds it, e.g. an `Engine` built before the write)."""

    __slots__ = ("_r", "_var")

    def __init__(self, var: nnx.Variable, r: int):
        self._var, self._r = var, r

    def get_value(self) -> jax.Array:
        """The layer's slice of the stacked weight."""
        return self._var.get_value()[self._r]

    def set_value(self, new) -> None:
        """Write `new` (the layer's weight shape) into the layer's slice."""
        self[...] = new

    value = property(get_value, set_value)

    def __getitem__(self, index):
        return self.get_value()[index]

    def __setitem__(self, index, new) -> None:
        stacked = self._var.get_value()
        new = jnp.asarray(new)
        want = jax.eval_shape(lambda x: x[self._r][index], jax.ShapeDtypeStruct(stacked.shape, stacked.dtype)).shape
        if new.shape != want:
            raise ValueError(f"value.shape={new.shape} must be {want}, the shape of the layer's weight[{index!r}]")
        if not jnp.can_cast(new.dtype, stacked.dtype, casting="same_kind"):
            raise ValueError(
                f"value.dtype={new.dtype} cannot be stored in the stacked weight's dtype {stacked.dtype} "
                "without an unsafe cast; cast it first"
            )
        at = (self._r, *index) if isinstance(index, tuple) else (self._r, index)
        self._var.set_value(stacked.at[at].set(new.astype(stacked.dtype)))

    def __jax_array__(self) -> jax.Array:
        return self.get_value()

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.get_value(), dtype=dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._var.get_value().shape[1:])

    @property
    def dtype(self):
        return self._var.get_value().dtype

    def __repr__(self) -> str:
        return f"VariableView({type(self._var).__name__}, repetition={self._r}, shape={self.shape}, dtype={self.dtype})"


class LayerView:
    """Layer `r` of a stacked module (one layer of a repeating run, or one of its sub-modules).

    Attribute and item access mirror the module: sub-modules come back as `LayerView`s, weights as
    `VariableView`s (read and write the layer's slice), static attributes as they are, and methods
    bound to the layer's own weights (`module()`), so `view.ffn_block(x, ids)` and `view(...)` run
    the layer. `module()` (also `copy.deepcopy(view)`) is a module of the layer's weights: a copy,
    the thing to hand to NNX or JAX transforms (`nnx.split`, `nnx.jit`, `jax.grad`), which take
    modules and arrays, not views. Views cannot be pickled (pickle the model, or `module()`)."""

    __slots__ = ("_r", "_stacked")

    def __init__(self, stacked: nnx.Module, r: int):
        object.__setattr__(self, "_stacked", stacked)
        object.__setattr__(self, "_r", r)

    def __getattr__(self, name: str):
        if name.startswith("_"):  # private and special names (copy, pickle, vars) are not the layer's
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        value = getattr(self._stacked, name)
        if inspect.ismethod(value) and value.__self__ is self._stacked:
            return getattr(self.module(), name)
        return _wrap(value, self._r)

    def __getitem__(self, index):
        return _wrap(self._stacked[index], self._r)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(
            f"cannot set {name!r} on a stacked layer's view: "
            "assign a weight's `.value` instead (it writes the slice back)"
        )

    def module(self) -> nnx.Module:
        """A module of this layer's weights (sliced copies; works inside jit)."""
        graphdef, state = nnx.split(self._stacked)
        return nnx.merge(graphdef, jax.tree.map(lambda x: x[self._r], state))

    def __call__(self, *args, **kwargs):
        return self.module()(*args, **kwargs)

    def __copy__(self) -> LayerView:
        return LayerView(self._stacked, self._r)

    def __deepcopy__(self, memo) -> nnx.Module:
        return self.module()

    def __reduce__(self):
        raise TypeError("a LayerView cannot be pickled: pickle the model, or the layer's `module()` (a copy)")

    def __eq__(self, other) -> bool:
        return isinstance(other, LayerView) and other._stacked is self._stacked and other._r == self._r

    def __hash__(self) -> int:
        return hash((id(self._stacked), self._r))

    def __repr__(self) -> str:
        return f"LayerView({type(self._stacked).__name__}, repetition={self._r})"


def _not_a_pytree(view: LayerView):
    raise TypeError(
        f"{view!r} is a view of one layer of a stacked run, not a module or a pytree: pass "
        "`view.module()` (a module of the layer's weights, a copy) to nnx.split / nnx.state / nnx.jit / "
        "jax transforms, or the whole model"
    )


# A view is registered as a pytree only to refuse flattening by name: unregistered, nnx.split(view)
# returned a state whose one leaf was the view itself (silently not the layer's weights) and
# nnx.state(view) failed with an IndexError.
jax.tree_util.register_pytree_node(LayerView, _not_a_pytree, lambda aux, children: _not_a_pytree(aux))


def _stack(*xs):
    """`jnp.stack(xs)`; of abstract weights (`jax.ShapeDtypeStruct`, a model built for a memory plan),
    the stacked abstract weight, its sharding given a leading unsplit axis."""
    x = xs[0]
    if not isinstance(x, jax.ShapeDtypeStruct):
        return jnp.stack(xs)
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
    return jax.ShapeDtypeStruct((len(xs), *x.shape), x.dtype, sharding=sharding)


class LayerStack(nnx.Module):
    """The decoder layers of a model, repeating runs held stacked (see the module docstring).

    Attributes:
      runs: the `LayerRun`s covering every layer in order (count > 1: held stacked).
      groups: one `nnx.List` per run: its `period` modules; a stacked run's weights have a leading
        axis [run.count] (repetition r of position j is layer run.start + r * run.period + j).
    """

    def __init__(self, layers: list[nnx.Module], stack: bool | None = None):
        """Args:
        layers: the decoder layers in order. A list is consumed: each stacked module's entries are set
          to None once stacked, so their weights are freed as stacking proceeds (peak memory: the
          layers plus one period position's stacked copy).
        stack: hold repeating runs stacked (True) or every layer as its own module (False); None:
          `STACK_LAYERS`, and when that is None too `stack_by_default` (depth and layer size).
        """
        if not isinstance(layers, list):
            layers = list(layers)
        if stack is None:
            stack = STACK_LAYERS
        if stack is None:
            first = nnx.state(layers[0]) if layers else {}
            size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(first))
            stack = stack_by_default(len(layers), size)
        if stack:
            runs = plan_layer_runs([layer_key(m) for m in layers])
        else:
            runs = tuple(LayerRun(i, 1, 1) for i in range(len(layers)))
        groups = []
        for run in runs:
            if run.count == 1:
                groups.append(nnx.List([layers[i] for i in range(run.start, run.stop)]))
                continue
            mods = []
            for j in range(run.period):
                parts = [nnx.split(layers[i]) for i in run.layers(j)]
                mods.append(nnx.merge(parts[0][0], jax.tree.map(_stack, *[s for _, s in parts])))
                for i in run.layers(j):
                    layers[i] = None
                del parts
            groups.append(nnx.List(mods))
        self.runs = runs
        self.groups = nnx.List(groups)

    def __len__(self) -> int:
        return self.runs[-1].stop if self.runs else 0

    def locate(self, i: int) -> tuple[int, int, int | None]:
        """Layer i -> (run index g, period position j, repetition r; None when the run is not stacked)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"layer index {i} must be in [{-n}, {n})")
        i %= n
        for g, run in enumerate(self.runs):
            if i < run.stop:
                r, j = divmod(i - run.start, run.period)
                return (g, j, r) if run.count > 1 else (g, i - run.start, None)
        raise AssertionError("runs cover every layer")

    def __getitem__(self, i):
        """Layer i (an int, numpy integers too): its module, or a `LayerView` when its run is held
        stacked; a slice gives a list of those."""
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if isinstance(i, bool):
            raise TypeError("layer index must be an int, got bool")
        try:
            i = operator.index(i)
        except TypeError:
            raise TypeError(f"layer index must be an int or a slice, got {type(i).__name__}") from None
        g, j, r = self.locate(i)
        return self.groups[g][j] if r is None else LayerView(self.groups[g][j], r)

    def __iter__(self) -> Iterator:
        return (self[i] for i in range(len(self)))

    def module(self, i: int) -> nnx.Module:
        """Layer i as a module (a stacked layer's weights sliced out: a copy; inside jit, a slice)."""
        layer = self[i]
        return layer.module() if isinstance(layer, LayerView) else layer

    def stacked(self, g: int) -> tuple[list, list]:
        """Run g held stacked: per period position j, (graphdefs, states) with leaves [count, ...]."""
        parts = [nnx.split(m) for m in self.groups[g]]
        return [gd for gd, _ in parts], [st for _, st in parts]


def layer_runs(model, scan_layers: bool | None = None, spec=None) -> tuple[tuple[int | None, LayerRun], ...]:
    """The runs a step executes `model.layers` in: (g, run) with g the stacked run of `model.layers`
    a scan takes its weights from, or (None, run) for a single layer (run.count == 1).

    Args:
      model: a model whose `layers` is a `LayerStack` (`DeepseekV4`, `Gemma3`).
      scan_layers: False: every layer on its own (the Python loop); None: `SCAN_LAYERS`.
      spec: the cache's `CacheSpec` or None (stateless). A stacked run whose repetitions hold
        different cache objects at a position (never for DeepSeek-V4 or Gemma 3: the cache follows
        the layer's structure) runs one layer at a time.
    Returns:
      pairs covering every layer in order.
    """
    stack = model.layers
    out: list[tuple[int | None, LayerRun]] = []
    for g, run in enumerate(stack.runs):
        scanned = run.count > 1 and use_scan(scan_layers)
        if scanned and spec is not None:
            scanned = all(
                spec.layers[i] == spec.layers[run.start + j] for j in range(run.period) for i in run.layers(j)
            )
        if scanned:
            out.append((g, run))
        else:
            out.extend((None, LayerRun(i, 1, 1)) for i in range(run.start, run.stop))
    return tuple(out)


def _byte_floats(tree):
    """On the CPU backend, `tree` with every one-byte float leaf (float8 weights, float8_e8m0fnu
    scales of a quantized model) bitcast to uint8, and the dtypes to restore (`_restore_floats`;
    elsewhere `tree` as it is and None). XLA:CPU has no arithmetic in these types and converts an
    operand of one to a wider type first: a scan's stacked operand whole, every layer of the run at
    once, outside the loop (f16 / f32 copies of each stacked weight and scale grid: 8 of the 10 GB of
    temporaries per device of DeepSeek-V4-Flash's decode step at (1, 8)). A scan over bytes converts
    inside the body only the layer being run (XLA:CPU still copies the bitcast bytes once, one byte
    per element)."""
    if jax.default_backend() != "cpu":
        return tree, None
    dtypes = jax.tree.map(lambda x: jnp.dtype(x.dtype), tree)

    def to_bytes(x):
        dt = jnp.dtype(x.dtype)
        one_byte_float = dt.itemsize == 1 and jnp.issubdtype(dt, jnp.floating)
        return jax.lax.bitcast_convert_type(x, jnp.uint8) if one_byte_float else x

    return jax.tree.map(to_bytes, tree), dtypes


def _restore_floats(tree, dtypes):
    """`_byte_floats`' inverse on a scan body's slice."""
    if dtypes is None:
        return tree
    return jax.tree.map(lambda x, dt: x if x.dtype == dt else jax.lax.bitcast_convert_type(x, dt), tree, dtypes)


def run_layers(model, carry, one, scan_layers: bool | None = None):
    """A stateless forward's decoder layers: `one(layer, carry) -> carry` for every layer of
    `model.layers` in order, each stacked run under one `jax.lax.scan` over its weights as held (or
    every layer on its own with scan_layers=False). Returns the carry after the last layer."""
    for g, run in layer_runs(model, scan_layers):
        if g is None:
            carry = one(model.layers.module(run.start), carry)
            continue
        graphdefs, states = model.layers.stacked(g)
        states, dtypes = _byte_floats(states)

        def body(carry, xs, graphdefs=graphdefs, dtypes=dtypes):
            for gd, st in zip(graphdefs, _restore_floats(xs, dtypes), strict=True):
                carry = one(nnx.merge(gd, st), carry)
            return carry, None

        carry, _ = jax.lax.scan(body, carry, states)
    return carry


def run_cached_layers(model, step: Step, cache: HybridCache, carry, one, scan_layers: bool | None = None):
    """A cached step's decoder layers: `one(layer, view, cache, carry) -> (cache, carry)` for every
    layer of `model.layers` in order, `view` its `LayerCache`; each stacked run under one
    `hkv.core.layers.scan_layers` over its weights as held (or one layer at a time with
    scan_layers=False). Returns (cache, carry) after the last layer."""
    for g, run in layer_runs(model, scan_layers, step.layout.spec):
        if g is None:
            cache, carry = one(model.layers.module(run.start), LayerCache(step, run.start), cache, carry)
            continue
        graphdefs, states = model.layers.stacked(g)
        states, dtypes = _byte_floats(states)

        def body(cache, carry, views, xs, graphdefs=graphdefs, dtypes=dtypes):
            for gd, st, view in zip(graphdefs, _restore_floats(xs, dtypes), views, strict=True):
                cache, carry = one(nnx.merge(gd, st), view, cache, carry)
            return cache, carry

        cache, carry = scan_cached_layers(step, cache, run, body, carry, states)
    return cache, carry
