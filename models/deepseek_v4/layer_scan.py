"""Decoder layers of the same structure run under `jax.lax.scan`, so compile time does not grow with depth.

DeepSeek-V4's layers are not all alike: sliding, CSA (compressor + indexer) and HCA (compressor)
attention, hash-routed or top-k MoE. `layer_runs` keys each layer by its structure (the NNX graph
with its static attributes, the shapes and dtypes of its weights, and its cache objects) and splits
the stack into runs of a repeating period (`hkv.core.layers.plan_layer_runs`): real V4 has a few
leading layers (HCA, hash routing) and then CSA/HCA alternating, so its 43 layers trace as a scan of
period 1 over the leading HCA layers and a scan of period 2 (CSA, HCA) over the rest; layers that
nothing repeats around run unrolled, as before.

Weights: the model keeps one module per layer (`model.layers[i]`), which checkpoint loading, the
weights digest (parameter paths `layers.N....`) and code that edits `model.layers[i]` rely on. A
scan needs each period position's weights stacked on a leading axis; they are stacked at trace time
(`nnx.split` of each layer, `jnp.stack` leaf by leaf) and merged back into a module inside the scan
body (`nnx.merge`). The traced program then holds one period of layers whatever the depth
(measured in `benchmarks/compile_depth.py`). The price is one copy of the scanned layers' weights
per call (inside jit, the stack is a concatenation): negligible for the tiny models the tests run,
but a real model's decode step is bound by reading its weights, so a serving engine should hold the
weights stacked (split once, outside jit) — or pass `scan_layers=False` to keep the Python loop.

Exactness: the scan body runs the same ops on the same values as the loop (the cached ops address
each layer's pool by a traced index: `hkv.core.layers.scan_layers`), so logits are equal
(tests/models/test_scan_layers.py checks scanned against unrolled, cached and stateless).

`SCAN_LAYERS` is the default of every `scan_layers=None` argument (True / False force the scan / the
loop); its own default None scans only models whose layers' weights total at most `SCAN_MAX_BYTES`
(1 GiB), so a real checkpoint keeps the loop until its weights are held stacked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hkv.core.layers import LayerRun, plan_layer_runs

SCAN_LAYERS: bool | None = None  # None: scan when the layers' weights are small (`SCAN_MAX_BYTES`)
SCAN_MAX_BYTES = 1 << 30  # the per-call stacking copy is cheap below this; a real checkpoint is far above it


def layer_weight_bytes(model) -> int:
    """Bytes of every decoder layer's weights (what a scan stacks on each call)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model.layers)))


def use_scan(scan_layers: bool | None, model=None) -> bool:
    """Whether repeating layers run under a scan.

    scan_layers True / False decide; None defers to `SCAN_LAYERS`, and when that is None too, scans
    only if the layers' weights total at most `SCAN_MAX_BYTES`: the scan stacks them inside jit on
    every call (a copy), which costs nothing next to a small model's compile time but would double a
    real checkpoint's weight traffic and memory per step (the weights are not held stacked yet).
    """
    choice = SCAN_LAYERS if scan_layers is None else scan_layers
    if choice is None:
        return model is None or layer_weight_bytes(model) <= SCAN_MAX_BYTES
    return bool(choice)


def layer_key(layer: nnx.Module, layer_spec=None) -> tuple:
    """A hashable structure key of one layer: equal keys run the same code on same-shaped weights."""
    graphdef, state = nnx.split(layer)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    shapes = tuple((jax.tree_util.keystr(p), tuple(x.shape), str(x.dtype)) for p, x in leaves)
    return graphdef, shapes, layer_spec


def layer_runs(model, scan_layers: bool | None = None, spec=None) -> tuple[LayerRun, ...]:
    """The runs `model.layers` execute in: repeating periods scanned, the rest one layer at a time.

    Args:
      model: a `DeepseekV4` (its `layers`).
      scan_layers: False: every layer its own run (the Python loop); None: `SCAN_LAYERS`.
      spec: the cache's `CacheSpec` (its layer specs join the keys) or None (stateless).
    Returns:
      `LayerRun`s covering every layer in order.
    """
    n = len(model.layers)
    if not use_scan(scan_layers, model):
        return tuple(LayerRun(i, 1, 1) for i in range(n))
    keys = [layer_key(layer, None if spec is None else spec.layers[i]) for i, layer in enumerate(model.layers)]
    return plan_layer_runs(keys)


def stacked_layers(model, run: LayerRun) -> tuple[list, list]:
    """Per period position j: the graphdef of layer run.start + j and the layers' state stacked over the
    repetitions (leaves [run.count, ...]). Returns (graphdefs, states)."""
    graphdefs, states = [], []
    for j in range(run.period):
        parts = [nnx.split(model.layers[i]) for i in run.layers(j)]
        graphdefs.append(parts[0][0])
        states.append(jax.tree.map(lambda *xs: jnp.stack(xs), *[s for _, s in parts]))
    return graphdefs, states


def stateless_layers(model, streams, tokens, positions, rope, scan_layers: bool | None = None):
    """The stateless forward's decoder layers: streams [B, T, N, hidden] -> streams after the last layer.

    tokens int32[B, T], positions int32[B, T], rope {family: (cos, sin)} (see `DeepseekV4.__call__`).
    """
    freqs = model.freqs
    for run in layer_runs(model, scan_layers):
        if run.count == 1:
            for i in range(run.start, run.stop):
                streams = model.layers[i](streams, tokens, positions, rope, freqs)
            continue
        graphdefs, states = stacked_layers(model, run)

        def body(streams, x, graphdefs=graphdefs):
            for gd, st in zip(graphdefs, x):
                streams = nnx.merge(gd, st)(streams, tokens, positions, rope, freqs)
            return streams, None

        streams, _ = jax.lax.scan(body, streams, states)
    return streams
