"""Picks which implementation of a kernel runs: Pallas on GPU, Pallas on TPU, or the jnp reference.

Every public op in `pallas_kernels` takes `backend: str | None = None` and `interpret: bool = False`
and resolves them here, at trace time:

| backend        | what runs                                                                      |
|----------------|--------------------------------------------------------------------------------|
| `None` (auto)  | `"gpu"` on a GPU, `"tpu"` on a TPU; on CPU the reference, unless `interpret`   |
|                | is set, in which case the GPU (Triton-style) kernel runs in the interpreter    |
| `"gpu"`        | the Pallas kernel lowered with Triton (`interpret=True`: Pallas interpreter)   |
| `"tpu"`        | the Pallas Mosaic kernel (`interpret=True`: the TPU interpreter, which        |
|                | simulates HBM/VMEM/SMEM and DMAs on CPU; ~100x slower, tiny shapes only)        |
| `"reference"`  | the plain-jnp reference (XLA), on any device; `interpret` is ignored            |
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental.pallas import tpu as pltpu

BACKENDS = ("gpu", "tpu", "reference")


def resolve_backend(backend: str | None, interpret: bool) -> str:
    """Returns one of `BACKENDS` for the requested `backend` (None = pick from `jax.default_backend()`)."""
    if backend is None:
        platform = jax.default_backend()
        if platform in ("gpu", "cuda", "rocm"):
            return "gpu"
        if platform == "tpu":
            return "tpu"
        return "gpu" if interpret else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"{backend=} must be one of {BACKENDS} or None (auto)")
    return backend


def describe_backend(backend: str | None = None, interpret: bool = False) -> str:
    """What runs for `backend` / `interpret` (resolved as `resolve_backend` does), in words: e.g.
    "Pallas kernels (Triton) on gpu" or "the jnp reference (XLA) on cpu"."""
    what = {"gpu": "Pallas kernels (Triton)", "tpu": "Pallas kernels (Mosaic)", "reference": "the jnp reference (XLA)"}
    resolved = resolve_backend(backend, interpret)
    where = " in the Pallas interpreter" if interpret and resolved != "reference" else ""
    return f"{what[resolved]}{where} on {jax.default_backend()}"


def pallas_interpret_arg(backend: str, interpret: bool) -> Any:
    """The value to pass as `pl.pallas_call(..., interpret=...)` for a kernel backend."""
    if not interpret:
        return False
    if backend == "tpu":
        # The TPU interpreter; out-of-bounds reads raise, uninitialized VMEM reads as NaN.
        return pltpu.InterpretParams()
    return True
