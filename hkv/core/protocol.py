"""`CachedModel`: everything an `hkv.Engine` (and `hkv.testing.check_model`) calls on a model.

A model is a Flax NNX module (the engine splits it with `nnx.split` into a graph and weights, and
hashes the weights into the ABI fingerprint) that implements:

    vocab_size: int
    cache_spec(block_tokens=16, model_id="unknown") -> hkv.CacheSpec
    cached_step(layout, cache, tokens, slots, n_valid, *, seal=True, kernel_backend=None,
                interpret=False) -> (cache, float32[B, C, vocab] logits, status int32)
    __call__(tokens int32[B, T]) -> float32[B, T, vocab]      # the stateless forward (check_model)

Optional: a `cached_step` that also takes `read_tokens=None` and passes it to `hkv.run_step` lets the
engine run prefill steps in read-size buckets (a chunk reads compressed entries and full-attention
rows for the tokens held, not for `max_context`); `hkv.engine.options.accepts_read_tokens(model)`
tells which. One that also takes `logit_rows=None`, passes it to `hkv.run_step` and applies
`step.head_rows(x)` before its final norm and head computes the logits of the rows the engine
samples from only (a prefill chunk: one row, not the chunk's C); `accepts_keyword(model,
"logit_rows")` tells which (without it the engine asks for every row's logits). One that also
takes `snapshots=None` and passes it to `hkv.run_step` prepares the SWA + TAIL snapshots of the block
boundaries inside a prefill chunk (`hkv.InteriorSnapshots`), so a prefix restores at every block
boundary whatever the chunk (without it, only where a step ended).

Optional: `lockstep_axes() -> tuple[str, ...]`, the manual mesh axes (the data axis of a per-shard
program, `hkv.MeshEngine`) across which the model's step exchanges data (DeepSeek-V4's experts split
over the data axis: each step all-gathers every shard's tokens). Traced with such axes, every shard
must run the model the same number of times: the decode loop iterates while any shard has work
(a shard that finished idles) and a conditional step runs on every shard when any needs it
(`lockstep_axes(model)`).

`cached_step` is written against the model-facing API (`hkv.run_step`, `hkv.LayerCache`); see
`hkv.core.layers` and docs/bring-your-own-model.md.
"""

from __future__ import annotations

import inspect
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from .layout import CacheLayout
from .spec import CacheSpec
from .state import HybridCache


@runtime_checkable
class CachedModel(Protocol):
    """The methods and attribute the engine uses; see the module docstring for shapes."""

    vocab_size: int

    def cache_spec(self, block_tokens: int = 16, model_id: str = "unknown") -> CacheSpec:
        """The cache objects of every layer (`hkv.CacheSpec`) with `block_tokens` tokens per block.
        `model_id` is a display label; the engine adds the weights' digest itself."""
        ...

    def cached_step(
        self,
        layout: CacheLayout,
        cache: HybridCache,
        tokens: jax.Array,
        slots: jax.Array,
        n_valid: jax.Array,
        *,
        seal: bool = True,
        kernel_backend: str | None = None,
        interpret: bool = False,
    ) -> tuple[HybridCache, jax.Array, jax.Array]:
        """Run tokens[b, :n_valid[b]] (int32[B, C]) as the next tokens of slot slots[b] (int32[B]) as
        one pure transition (`hkv.run_step`). The engine calls it with C = prefill chunk (prefill),
        C = 1 (decode), and with seal=False to rebuild a restored prefix's SWA window and TAIL
        without sealing entries again. `kernel_backend` / `interpret` pick the `pallas_kernels`
        implementation of the decode ops. Returns (cache, float32[B, C, vocab], status int32): on a
        status other than OK the cache is unchanged."""
        ...

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Stateless forward: int32[B, T] -> float32[B, T, vocab] (position t sees tokens [0, t])."""
        ...


def accepts_keyword(model, name: str) -> bool:
    """Whether `model.cached_step` takes the optional keyword `name` (`read_tokens`, `logit_rows`):
    named in its signature, or collected by a `**options` it passes on."""
    try:
        params = inspect.signature(model.cached_step).parameters
    except (TypeError, ValueError, AttributeError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def lockstep_axes(model) -> tuple[str, ...]:
    """`model.lockstep_axes()` where the model has it (in the trace being built), else (): the manual
    mesh axes whose shards must run the model's step in lockstep."""
    fn = getattr(model, "lockstep_axes", None)
    return tuple(fn()) if fn is not None else ()


def any_shard(flag: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """bool scalar: `flag` on any shard of the manual mesh `axes` (itself without axes)."""
    if not axes:
        return flag
    return jax.lax.psum(flag.astype(jnp.int32), axes) > 0


def check_protocol(model) -> None:
    """Raise TypeError naming what `model` lacks of `CachedModel` (an NNX module with all members)."""
    from flax import nnx

    missing = [n for n in ("vocab_size", "cache_spec", "cached_step", "__call__") if not hasattr(model, n)]
    if missing or not isinstance(model, nnx.Module):
        what = f"lacks {missing}" if missing else "is not a flax.nnx.Module"
        raise TypeError(f"{type(model).__name__} {what}: an hkv model implements hkv.CachedModel (see its docstring)")


__all__ = ["CachedModel", "accepts_keyword", "check_protocol"]
