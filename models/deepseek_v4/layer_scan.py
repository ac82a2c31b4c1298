"""Decoder layers held stacked and run under `jax.lax.scan`, so compile time does not grow with depth.

DeepSeek-V4's layers are not all alike: sliding, CSA (compressor + indexer) and HCA (compressor)
attention, hash-routed or top-k MoE. `LayerStack` keys each layer by its structure (the NNX graph
with its static attributes and the shapes and dtypes of its weights) and splits the stack into runs
of a repeating period (`hkv.core.layers.plan_layer_runs`): real V4 has a few leading layers (HCA,
hash routing) and then CSA/HCA alternating, so its 43 layers are held as a run of period 1 over the
leading HCA layers and a run of period 2 (CSA, HCA) over the rest; layers that nothing repeats
around are held one module each, as before.

Weights: a repeating run keeps, per position of its period, ONE module whose weights carry a leading
axis of the run's repetitions (stacked once, when the model is built). A scan takes those weights as
they are, so a traced step holds one period of layers whatever the depth (measured in
`benchmarks/compile_depth.py`), and no call copies or re-stacks weights: a real checkpoint scans
too, with the weight traffic of the Python loop.

`model.layers` stays a sequence of layers: `len(model.layers)`, `model.layers[i]`, iteration.
Layer i of a repeating run is a `LayerView`: reading `model.layers[i].attn.wq_a.value` gives that
layer's slice, assigning `.value` writes the slice back into the stacked weight (the next
`nnx.split(model)` sees it), calling it runs the layer. Parameter paths are those of the stacked
modules (`layers.groups.G.J.attn.wq_a`, leading axis = repetition), which `hkv.weights_digest` and
the tensor-parallel rules (`tensor_parallel_dim`, negative dims) see.

`scan_layers` (every `scan_layers=None` argument defers to `SCAN_LAYERS`, default True) only chooses
how a step runs the stacked runs: under a scan, or one layer at a time (`scan_layers=False`: the
Python loop, each layer's weights sliced out of the stack inside jit).

Exactness: the scan body runs the same ops on the same values as the loop (the cached ops address
each layer's pool by a traced index: `hkv.core.layers.scan_layers`), so logits are equal
(tests/models/test_scan_layers.py checks scanned against unrolled, cached and stateless).
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from hkv.core.layers import LayerRun, plan_layer_runs

SCAN_LAYERS: bool = True  # the default of every `scan_layers=None`: False runs the layers one at a time


def use_scan(scan_layers: bool | None) -> bool:
    """Whether repeating layers run under a scan: scan_layers True / False decide, None defers to
    `SCAN_LAYERS`."""
    return bool(SCAN_LAYERS if scan_layers is None else scan_layers)


def layer_key(layer: nnx.Module, layer_spec=None) -> tuple:
    """A hashable structure key of one layer: equal keys run the same code on same-shaped weights."""
    graphdef, state = nnx.split(layer)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    shapes = tuple((jax.tree_util.keystr(p), tuple(x.shape), str(x.dtype)) for p, x in leaves)
    return graphdef, shapes, layer_spec


class VariableView:
    """Repetition `r` of a stacked weight (`LayerView`): `.value` reads the slice, assigning `.value`
    writes it back into the stacked variable (same shape; cast to its dtype)."""

    __slots__ = ("_r", "_var")

    def __init__(self, var: nnx.Variable, r: int):
        self._var, self._r = var, r

    @property
    def value(self) -> jax.Array:
        return self._var.get_value()[self._r]

    @value.setter
    def value(self, new) -> None:
        stacked = self._var.get_value()
        new = jnp.asarray(new)
        if new.shape != stacked.shape[1:]:
            raise ValueError(f"value.shape={new.shape} must be the layer's weight shape {stacked.shape[1:]}")
        self._var.set_value(stacked.at[self._r].set(new.astype(stacked.dtype)))

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

    Attribute access mirrors the module: sub-modules come back as `LayerView`s, weights as
    `VariableView`s (read and write the layer's slice), static attributes as they are. Calling the
    view runs the layer on its sliced weights (`module()`)."""

    __slots__ = ("_r", "_stacked")

    def __init__(self, stacked: nnx.Module, r: int):
        object.__setattr__(self, "_stacked", stacked)
        object.__setattr__(self, "_r", r)

    def __getattr__(self, name: str):
        value = getattr(self._stacked, name)
        if isinstance(value, nnx.Variable):
            return VariableView(value, self._r)
        if isinstance(value, nnx.Module):
            return LayerView(value, self._r)
        return value

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(
            f"cannot set {name!r} on a stacked layer's view: assign a weight's `.value` instead (it writes the slice back)"
        )

    def module(self) -> nnx.Module:
        """A module of this layer's weights (sliced copies; works inside jit)."""
        graphdef, state = nnx.split(self._stacked)
        return nnx.merge(graphdef, jax.tree.map(lambda x: x[self._r], state))

    def __call__(self, *args, **kwargs):
        return self.module()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"LayerView({type(self._stacked).__name__}, repetition={self._r})"


class LayerStack(nnx.Module):
    """The decoder layers of a model, repeating runs held stacked (see the module docstring).

    Attributes:
      runs: the `LayerRun`s covering every layer in order (count > 1: held stacked).
      groups: one `nnx.List` per run: its `period` modules; a stacked run's weights have a leading
        axis [run.count] (repetition r of position j is layer run.start + r * run.period + j).
    """

    def __init__(self, layers: list[nnx.Module], *, stack: bool = True):
        """Args:
        layers: the decoder layers in order. A list is consumed: each stacked module's entries are set
          to None once stacked, so their weights are freed as stacking proceeds (peak memory: the
          layers plus one period position's stacked copy).
        stack: False holds every layer as its own module (nothing scans).
        """
        if not isinstance(layers, list):
            layers = list(layers)
        n = len(layers)
        runs = plan_layer_runs([layer_key(m) for m in layers]) if stack else tuple(LayerRun(i, 1, 1) for i in range(n))
        groups = []
        for run in runs:
            if run.count == 1:
                groups.append(nnx.List([layers[i] for i in range(run.start, run.stop)]))
                continue
            mods = []
            for j in range(run.period):
                parts = [nnx.split(layers[i]) for i in run.layers(j)]
                mods.append(nnx.merge(parts[0][0], jax.tree.map(lambda *xs: jnp.stack(xs), *[s for _, s in parts])))
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

    def __getitem__(self, i: int):
        """Layer i: its module, or a `LayerView` when its run is held stacked."""
        if not isinstance(i, int) or isinstance(i, bool):
            raise TypeError(f"layer index must be an int, got {type(i).__name__}")
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
      model: a `DeepseekV4` (its `LayerStack`).
      scan_layers: False: every layer on its own (the Python loop); None: `SCAN_LAYERS`.
      spec: the cache's `CacheSpec` or None (stateless). A stacked run whose repetitions hold
        different cache objects at a position (never for DeepSeek-V4: the cache follows the layer's
        structure) runs one layer at a time.
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


def stateless_layers(model, streams, tokens, positions, rope, scan_layers: bool | None = None):
    """The stateless forward's decoder layers: streams [B, T, N, hidden] -> streams after the last layer.

    tokens int32[B, T], positions int32[B, T], rope {family: (cos, sin)} (see `DeepseekV4.__call__`).
    """
    freqs = model.freqs
    for g, run in layer_runs(model, scan_layers):
        if g is None:
            streams = model.layers.module(run.start)(streams, tokens, positions, rope, freqs)
            continue
        graphdefs, states = model.layers.stacked(g)

        def body(streams, x, graphdefs=graphdefs):
            for gd, st in zip(graphdefs, x):
                streams = nnx.merge(gd, st)(streams, tokens, positions, rope, freqs)
            return streams, None

        streams, _ = jax.lax.scan(body, streams, states)
    return streams
