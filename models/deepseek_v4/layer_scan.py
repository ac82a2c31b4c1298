"""Decoder layers held stacked and run under `jax.lax.scan`, so compile time does not grow with depth.

DeepSeek-V4's layers are not all alike: sliding, CSA (compressor + indexer) and HCA (compressor)
attention, hash-routed or top-k MoE. `LayerStack` keys each layer by its structure (the NNX graph
with its static attributes and the shapes and dtypes of its weights) and splits the stack into runs
of a repeating period (`hkv.core.layers.plan_layer_runs`): real V4 has a few leading layers (HCA,
hash routing) and then CSA/HCA alternating, so its 43 layers are held as a run of period 1 over the
leading HCA layers and a run of period 2 (CSA, HCA) over the rest; layers that nothing repeats
around are held one module each, as before.

Weights: `models.layer_stack.LayerStack` holds each repeating run stacked (one module per period
position, a leading axis per repetition, stacked once when the model is built); a scan takes those
weights as they are, so a traced step holds one period of layers whatever the depth (measured in
`benchmarks/compile_depth.py`) and no call copies weights: a real checkpoint scans too, with the
weight traffic of the Python loop. `model.layers[i]` of a stacked layer is a `LayerView` (reads and
writes its slice); see `models.layer_stack` for views, parameter paths and `scan_layers`.

Exactness: the scan body runs the same ops on the same values as the loop (the cached ops address
each layer's pool by a traced index: `hkv.core.layers.scan_layers`), so logits are equal
(tests/models/test_scan_layers.py checks scanned against unrolled, cached and stateless).
"""

from __future__ import annotations

from models.layer_stack import (  # noqa: F401 (re-exported: the DeepSeek-V4 names of the shared pieces)
    SCAN_LAYERS,
    LayerStack,
    LayerView,
    VariableView,
    layer_key,
    layer_runs,
    run_layers,
    use_scan,
)


def stateless_layers(model, streams, tokens, positions, rope, scan_layers: bool | None = None):
    """The stateless forward's decoder layers: streams [B, T, N, hidden] -> streams after the last layer.

    tokens int32[B, T], positions int32[B, T], rope {family: (cos, sin)} (see `DeepseekV4.__call__`).
    """
    freqs = model.freqs
    return run_layers(model, streams, lambda layer, s: layer(s, tokens, positions, rope, freqs), scan_layers)
