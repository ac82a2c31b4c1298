"""Sampling on device, reproducible from (seed, position).

`Sampling` is one request's settings (a frozen host dataclass, validated on construction);
`SamplingParams` is a batch of them as device arrays (one row per sequence), so changing a request's
temperature or seed never recompiles anything. `sample(logits, params, positions)` picks one token
per row: greedy rows (temperature 0) take the argmax; sampled rows apply temperature, top-k, top-p
and min-p (`truncate`: without sorting the vocabulary), then draw from a key derived from (seed,
position) alone. A row's token therefore never depends on which other rows share its batch, how its
prompt was chunked, whether it was preempted and recomputed, or whether its prefix was restored
from the cache: the same seed and the same logits at the same position give the same token.

Logprobs are those of the chosen token under the model's own distribution (`log_softmax` of the raw
logits, before temperature and truncation), as vLLM and the OpenAI API report them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

SEED_RANGE = 2**32


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How one request picks its tokens.

    Attributes:
      temperature: 0.0 is greedy (the argmax; exact against the stateless forward); > 0 divides the
        logits before drawing.
      top_k: keep the k most likely tokens (0: no limit).
      top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1.0: all).
      min_p: drop tokens less likely than min_p times the most likely one (0.0: none).
      seed: an integer in [0, 2**32); the token at position t is drawn with a key derived from
        (seed, t) only. None: the engine picks one per request (recorded on the request, so a
        preempted request still continues identically).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        def number(name, value):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise ValueError(f"Sampling.{name}={value!r} must be a number")
            if not math.isfinite(float(value)):
                raise ValueError(f"Sampling.{name}={value!r} must be finite")
            return float(value)

        t = number("temperature", self.temperature)
        if t < 0:
            raise ValueError(f"Sampling.temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if isinstance(self.top_k, (bool, np.bool_)) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValueError(f"Sampling.top_k={self.top_k!r} must be an integer >= 0 (0 = no limit)")
        p = number("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"Sampling.top_p={self.top_p!r} must lie in (0, 1]")
        m = number("min_p", self.min_p)
        if not 0.0 <= m <= 1.0:
            raise ValueError(f"Sampling.min_p={self.min_p!r} must lie in [0, 1]")
        if self.seed is not None and (
            isinstance(self.seed, (bool, np.bool_))
            or not isinstance(self.seed, (int, np.integer))
            or not 0 <= self.seed < SEED_RANGE
        ):
            raise ValueError(f"Sampling.seed={self.seed!r} must be None or an integer in [0, 2**32)")
        object.__setattr__(self, "temperature", t)
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "top_p", p)
        object.__setattr__(self, "min_p", m)
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))

    @property
    def greedy(self) -> bool:
        """True when tokens are the argmax (temperature 0)."""
        return self.temperature == 0.0


GREEDY = Sampling()


@struct.dataclass
class SamplingParams:
    """Per-row sampling settings on device (a pytree; values are data, never static).

    Attributes:
      temperature: float32[B] (0 = greedy).
      top_k: int32[B] (0 = no limit).
      top_p: float32[B] in (0, 1].
      min_p: float32[B] in [0, 1].
      seed: uint32[B].
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seed: jax.Array

    @classmethod
    def stack(cls, rows: Sequence[Sampling], seeds: Sequence[int] | None = None) -> SamplingParams:
        """One row per `Sampling` (host arrays; jit moves them). seeds: per-row seeds overriding the
        rows' own (the engine passes each request's resolved seed); a row without either gets 0."""
        seeds = [s.seed if s.seed is not None else 0 for s in rows] if seeds is None else list(seeds)
        if len(seeds) != len(rows):
            raise ValueError(f"{len(seeds)} seeds for {len(rows)} sampling rows")
        return cls(
            temperature=np.asarray([s.temperature for s in rows], np.float32),
            top_k=np.asarray([s.top_k for s in rows], np.int32),
            top_p=np.asarray([s.top_p for s in rows], np.float32),
            min_p=np.asarray([s.min_p for s in rows], np.float32),
            seed=np.asarray(seeds, np.uint32),
        )

    @classmethod
    def broadcast(cls, sampling: Sampling | None, batch: int, key: jax.Array | None = None) -> SamplingParams:
        """`sampling` (default greedy) for every one of `batch` rows. When its seed is None the rows'
        seeds are drawn from `key` (one per row; 0 when key is None too); traceable when `key` is."""
        s = GREEDY if sampling is None else sampling
        if not isinstance(s, Sampling):
            raise ValueError(f"sampling={sampling!r} must be an hkv.Sampling or None")
        if s.seed is not None:
            seed = jnp.full((batch,), s.seed, jnp.uint32)
        elif key is not None:
            seed = jax.random.bits(key, (batch,), jnp.uint32)
        else:
            seed = jnp.zeros((batch,), jnp.uint32)
        return cls(
            temperature=jnp.full((batch,), s.temperature, jnp.float32),
            top_k=jnp.full((batch,), s.top_k, jnp.int32),
            top_p=jnp.full((batch,), s.top_p, jnp.float32),
            min_p=jnp.full((batch,), s.min_p, jnp.float32),
            seed=seed,
        )


def token_key(seed: jax.Array, position: jax.Array) -> jax.Array:
    """The PRNG key of the token at sequence index `position` of a request seeded `seed` (scalars)."""
    return jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), position.astype(jnp.uint32))


def truncate_reference(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """The definition `truncate` computes without a sort: float32[V] scaled logits -> the same with
    tokens outside top-k / top-p / min-p set to -inf, by sorting the vocabulary. The most likely token
    always survives; ties at the cut-off are all kept (deterministic). (Used by the tests and
    benchmarks/sampling.py.)"""
    v = logits.shape[-1]
    order = jnp.sort(logits)[::-1]  # descending
    probs = jax.nn.softmax(order)
    rank = jnp.arange(v)
    keep = jnp.where(top_k > 0, rank < top_k, True)
    keep &= (jnp.cumsum(probs) - probs) < top_p  # mass before this token is still short of top_p
    keep &= probs >= min_p * probs[0]
    keep = keep.at[0].set(True)
    cut = jnp.min(jnp.where(keep, order, jnp.inf))
    return jnp.where(logits >= cut, logits, -jnp.inf)


def _order_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 in the same order (a < b iff key(a) < key(b); -0.0 and 0.0 are one key; no NaN)."""
    i = jax.lax.bitcast_convert_type(x + 0.0, jnp.int32)  # (-0.0 + 0.0 is 0.0)
    i = jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)  # negative floats order backwards as ints
    return jax.lax.bitcast_convert_type(i, jnp.uint32) ^ jnp.uint32(0x80000000)


def truncate(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """float32[V] scaled logits -> the same with tokens outside top-k / top-p / min-p set to -inf.

    The most likely token always survives and ties at the cut-off are all kept, as in
    `truncate_reference`, but without sorting the vocabulary (a sort of DeepSeek-V4's 129,280 logits
    per sampled row is slow on CPU and on accelerators; see benchmarks/sampling.py). Each rule keeps the
    tokens at or above a cut-off value. The top-k / top-p cut-off is the smallest value t such that
    fewer than top_k tokens, holding less than top_p of the probability, lie strictly above t: both
    counts fall as t rises, so 32 halvings of the float32 order (`_order_key`) find it, each one pass
    over the vocabulary. min-p keeps exp(x - max) >= min_p.
    The kept set equals the reference's except where float rounding of a probability sum decides a
    top-p tie (the sums add the same probabilities in another order). top_p >= 1 keeps every token."""
    key = _order_key(logits)
    e = jnp.exp(logits - jnp.max(logits))  # unnormalized probabilities (0 at -inf)
    probs = e / jnp.sum(e)
    k = jnp.where(top_k > 0, top_k, logits.shape[-1])

    def halve(_, bounds):
        lo, hi = bounds  # few enough above hi (true at the start: nothing is above the max), not above lo
        mid = lo + (hi - lo) // 2
        above = key > mid
        ok = (jnp.sum(above) < k) & ((top_p >= 1.0) | (jnp.sum(jnp.where(above, probs, 0.0)) < top_p))
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    _, cut = jax.lax.fori_loop(0, 32, halve, (jnp.uint32(0), jnp.max(key)))
    return jnp.where((key >= cut) & (e >= min_p), logits, -jnp.inf)


def sample(
    logits: jax.Array, params: SamplingParams, positions: jax.Array, vocab_size: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Pick one token per row.

    Args:
      logits: float[B, V] the model's logits for the next token of each row.
      params: `SamplingParams` of B rows.
      positions: int32[B] the sequence index the chosen token will have (its key's position).
      vocab_size: ids >= vocab_size are never chosen (a model whose logits are padded past its
        vocabulary); None: V.

    Returns:
      (tokens int32[B], logprobs float32[B]): the chosen ids and their log-probabilities under the
      model's raw distribution.
    """
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    if vocab_size is not None and vocab_size < v:
        logits = jnp.where(jnp.arange(v) < vocab_size, logits, -jnp.inf)
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        def row(lg, t, k, p, m, seed, pos):
            scaled = truncate(lg / jnp.maximum(t, 1e-6), k, p, m)
            return jax.random.categorical(token_key(seed, pos), scaled).astype(jnp.int32)

        drawn = jax.vmap(row)(
            logits, params.temperature, params.top_k, params.top_p, params.min_p, params.seed, positions
        )
        return jnp.where(params.temperature > 0, drawn, greedy_tok)

    # the sort and the draw run only when some row samples (greedy batches pay an argmax)
    tokens = jax.lax.cond(jnp.any(params.temperature > 0), draw, lambda _: greedy_tok, None)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
