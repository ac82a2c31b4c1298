"""Sampling on device, reproducible from (seed, position).

`SamplingParams` is one request's settings (a frozen host dataclass, validated on construction);
`SamplingBatch` is a batch of them as device arrays (one row per sequence), so changing a request's
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
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

SEED_RANGE = 2**32
MAX_LOGPROBS = 20  # most top logprobs per token a request may ask for (OpenAI's and vLLM's default cap)
PENALTY_RANGE = 2.0  # presence / frequency penalties lie in [-2, 2] (the OpenAI API's range)
BIAS_RANGE = 100.0  # logit_bias values lie in [-100, 100] (the OpenAI API's range)


def _number(name: str, value, lo: float, hi: float, *, lo_open: bool = False, what: str = "") -> float:
    """float(value) after checking it is a finite real number in [lo, hi] ((lo, hi] when lo_open)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"SamplingParams.{name}={value!r} must be a number")
    v = float(value)
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        if hi == math.inf:
            rng = f"> {lo:g}" if lo_open else f">= {lo:g}"
        else:
            rng = f"in ({lo:g}, {hi:g}]" if lo_open else f"in [{lo:g}, {hi:g}]"
        raise ValueError(f"SamplingParams.{name}={value!r} must be a finite number {rng}{what}")
    return v


def _integer(name: str, value, lo: int, hi: float = math.inf, *, none: bool = False) -> int | None:
    """int(value) after checking it is an integer (not a bool) in [lo, hi]; None passes when `none`."""
    if value is None and none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
        rng = f"[{lo}, {hi}]" if hi != math.inf else f">= {lo}"
        raise ValueError(f"SamplingParams.{name}={value!r} must be {'None or ' if none else ''}an integer {rng}")
    return int(value)


def _flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"SamplingParams.{name}={value!r} must be a bool")
    return bool(value)


def _stop_strings(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (Sequence, set, frozenset)) or isinstance(value, bytes):
        raise ValueError(f"SamplingParams.stop={value!r} must be a string or a list of non-empty strings")
    for i, s in enumerate(value):
        if not isinstance(s, str) or not s:
            raise ValueError(f"SamplingParams.stop[{i}]={s!r} must be a non-empty string")
    return tuple(dict.fromkeys(value))


def _token_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, set, frozenset, np.ndarray)):
        raise ValueError(f"SamplingParams.stop_token_ids={value!r} must be a list of token ids")
    return tuple(dict.fromkeys(_integer(f"stop_token_ids[{i}]", t, 0) for i, t in enumerate(value)))


def _bias(value) -> dict[int, float]:
    """logit_bias as {token id: bias}; keys may be strings of digits (JSON objects' keys are)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"SamplingParams.logit_bias={value!r} must be a mapping {{token id: bias}}")
    out = {}
    for k, v in value.items():
        key = int(k) if isinstance(k, str) and k.strip().isdigit() else k
        key = _integer(f"logit_bias key {k!r}", key, 0)
        out[key] = _number(f"logit_bias[{k!r}]", v, -BIAS_RANGE, BIAS_RANGE)
    return out


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens: keywords only, with vLLM's names (`hkv.SamplingParams(
    temperature=0.7, top_p=0.9, seed=1)`). Validated on construction: a bad value raises `ValueError`
    naming the field and its allowed range. Unlike vLLM, the default temperature is 0 (greedy: the
    argmax, exact against the stateless forward).

    Attributes:
      n: how many completions of the prompt to generate (`Engine.generate` returns n `Generation`s
        per prompt; `Engine.submit_choices` one handle per choice). Choice i of a seeded request
        draws with seed + i; the choices after the first restore the first one's prompt from the
        prefix cache instead of prefilling it again.
      temperature: 0.0 is greedy; > 0 divides the logits before drawing.
      top_k: keep the k most likely tokens (0 or -1: no limit).
      top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1.0: all).
      min_p: drop tokens less likely than min_p times the most likely one (0.0: none).
      seed: an integer in [0, 2**32); the token at position t is drawn with a key derived from
        (seed, t) only. None: the engine picks one per request (reported in `Generation.seed`).
      presence_penalty: in [-2, 2]; subtracted from the logit of every token already generated.
      frequency_penalty: in [-2, 2]; subtracted once per earlier occurrence in the generated tokens.
      repetition_penalty: > 0 (1.0: off); the logits of tokens in the prompt or the generated tokens
        are divided by it when positive and multiplied by it when negative (CTRL's rule, as vLLM).
      logit_bias: {token id: bias in [-100, 100]} added to those logits (ids must lie in the
        model's vocabulary; JSON-style string keys are accepted).
      min_tokens: stop ids (and end-of-sequence ids) cannot be drawn before this many new tokens.
      ignore_eos: do not stop at the tokenizer's end-of-sequence ids (text requests; explicit
        `stop_token_ids` still stop).
      stop: strings that end a text request when they appear in its output (needs a tokenizer);
        the text ends before the stop string unless `include_stop_str_in_output`.
      stop_token_ids: ids that end the request (the stop id is its last token).
      include_stop_str_in_output: keep the stop string at the end of the text.
      logprobs: None, or how many of the most likely tokens to report with their log-probabilities
        for each generated token, in [0, 20] (`Generation.top_logprobs`; the chosen token's own
        logprob is always in `Generation.logprobs`).
      prompt_logprobs: None, or how many of the most likely tokens to report at each prompt position,
        in [0, 20]: `Generation.prompt_logprobs` holds each prompt token's log-probability given the
        tokens before it (None for the first), `Generation.prompt_top_logprobs` the top N. Such a
        request computes its whole prompt (a cached prefix would skip the positions it needs).
      max_tokens: the request's new-token budget when the call gives none (None: the call's).
      skip_special_tokens: leave special tokens out of decoded text.

    Penalties, logit bias and min_tokens shape the distribution tokens are drawn from (and the
    argmax of a greedy request); logprobs stay those of the model's raw distribution, as the OpenAI
    API and vLLM report them.
    """

    n: int = 1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | Sequence[str] | None = ()
    stop_token_ids: Sequence[int] | None = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    max_tokens: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self):
        put = lambda name, value: object.__setattr__(self, name, value)
        put("n", _integer("n", self.n, 1, 1024))
        put("temperature", _number("temperature", self.temperature, 0.0, math.inf, what=" (0 = greedy)"))
        top_k = -1 if isinstance(self.top_k, (int, np.integer)) and self.top_k == -1 else self.top_k
        put("top_k", max(0, _integer("top_k", top_k, -1)))
        put("top_p", _number("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        put("min_p", _number("min_p", self.min_p, 0.0, 1.0))
        put("seed", _integer("seed", self.seed, 0, SEED_RANGE - 1, none=True))
        put("presence_penalty", _number("presence_penalty", self.presence_penalty, -PENALTY_RANGE, PENALTY_RANGE))
        put("frequency_penalty", _number("frequency_penalty", self.frequency_penalty, -PENALTY_RANGE, PENALTY_RANGE))
        put("repetition_penalty", _number("repetition_penalty", self.repetition_penalty, 0.0, math.inf, lo_open=True))
        put("logit_bias", _bias(self.logit_bias))
        put("min_tokens", _integer("min_tokens", self.min_tokens, 0))
        put("ignore_eos", _flag("ignore_eos", self.ignore_eos))
        put("stop", _stop_strings(self.stop))
        put("stop_token_ids", _token_ids(self.stop_token_ids))
        put("include_stop_str_in_output", _flag("include_stop_str_in_output", self.include_stop_str_in_output))
        put("logprobs", _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS, none=True))
        put("prompt_logprobs", _integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, none=True))
        put("max_tokens", _integer("max_tokens", self.max_tokens, 0, none=True))
        put("skip_special_tokens", _flag("skip_special_tokens", self.skip_special_tokens))

    def __hash__(self) -> int:
        return hash(tuple((k, tuple(sorted(v.items())) if isinstance(v, dict) else v) for k, v in vars(self).items()))

    @property
    def greedy(self) -> bool:
        """True when tokens are the argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """True when a presence, frequency or repetition penalty is on (the engine then passes the
        request's token counts to the sampler)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


GREEDY = SamplingParams()


def width(n: int) -> int:
    """The column count of a per-row table holding up to n entries: 0, or the next power of two
    (so a batch compiles once per bucket, not once per count)."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class RowHistory:
    """What the sampler needs to know of one row's request beyond its settings (host side).

    Attributes:
      prompt: the prompt's token ids (repetition penalty).
      output: the tokens generated so far (penalties; `made` is its length).
      banned: the ids `min_tokens` holds back (its stop ids and end-of-sequence ids).
    """

    prompt: Sequence[int] = ()
    output: Sequence[int] = ()
    banned: Sequence[int] = ()


@struct.dataclass
class SamplingBatch:
    """Per-row sampling settings on device (a pytree; values are data, never static, except the
    widths of the optional tables and `top_n`, which pick the compiled variant).

    Attributes:
      temperature: float32[B] (0 = greedy).
      top_k: int32[B] (0 = no limit).
      top_p: float32[B] in (0, 1].
      min_p: float32[B] in [0, 1].
      seed: uint32[B].
      presence, frequency, repetition: float32[B] the penalties (0, 0, 1: off).
      min_left: int32[B] new tokens still to draw before `ban_ids` are allowed.
      ban_ids: int32[B, S] the ids min_tokens holds back (-1 = none); S = 0 when no row has one.
      bias_ids, bias_vals: int32[B, NB] / float32[B, NB] logit bias entries (id -1 = none).
      counts: int32[B, P] each token's count among the generated tokens; P = vocab when a row is
        penalized, else 0.
      seen: bool[B, P] the tokens of each row's prompt.
      prompt_next: int32[B, 1] the prompt token after each row's chunk (-1: none) when a row asks
        for prompt logprobs, else int32[B, 0] (a prefill step then skips them).
      top_n: static, how many top logprobs to report per token (0: none).
      prompt_top: static, how many top logprobs to report per prompt position.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seed: jax.Array
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    min_left: jax.Array
    ban_ids: jax.Array
    bias_ids: jax.Array
    bias_vals: jax.Array
    counts: jax.Array
    seen: jax.Array
    prompt_next: jax.Array
    top_n: int = struct.field(pytree_node=False, default=0)
    prompt_top: int = struct.field(pytree_node=False, default=0)

    @property
    def variant(self) -> str:
        """The compiled variant these tables select, as a step-name suffix ("" for plain sampling;
        e.g. "+pen+bias4+ban2+top4")."""
        v = "+pen" if self.counts.shape[1] else ""
        v += f"+bias{self.bias_ids.shape[1]}" if self.bias_ids.shape[1] else ""
        v += f"+ban{self.ban_ids.shape[1]}" if self.ban_ids.shape[1] else ""
        v += f"+top{self.top_n}" if self.top_n else ""
        return v + (f"+prompt{self.prompt_top}" if self.prompt_next.shape[1] else "")

    @classmethod
    def stack(
        cls,
        rows: Sequence[SamplingParams],
        seeds: Sequence[int] | None = None,
        histories: Sequence[RowHistory] | None = None,
        vocab_size: int | None = None,
        prompt_next: Sequence[int] | None = None,
    ) -> SamplingBatch:
        """One row per `SamplingParams` (host arrays; jit moves them).

        Args:
          rows: each row's settings.
          seeds: per-row seeds overriding the rows' own (the engine passes each request's resolved
            seed); a row without either gets 0.
          histories: each row's `RowHistory` (needed when a row is penalized or has min_tokens).
          vocab_size: the model's vocabulary (needed when a row is penalized).
          prompt_next: each row's prompt token after its chunk (-1: none), for rows that ask for
            prompt logprobs (a prefill step's; None: no prompt logprobs).
        """
        seeds = [s.seed if s.seed is not None else 0 for s in rows] if seeds is None else list(seeds)
        if len(seeds) != len(rows):
            raise ValueError(f"{len(seeds)} seeds for {len(rows)} sampling rows")
        b = len(rows)
        hist = list(histories) if histories is not None else [RowHistory()] * b
        if len(hist) != b:
            raise ValueError(f"{len(hist)} histories for {b} sampling rows")
        f32 = lambda name: np.asarray([getattr(s, name) for s in rows], np.float32)
        min_left = np.asarray([max(0, s.min_tokens - len(h.output)) for s, h in zip(rows, hist, strict=True)], np.int32)
        ban = [list(h.banned) if m > 0 else [] for h, m in zip(hist, min_left, strict=True)]
        ban_ids = np.full((b, width(max(map(len, ban), default=0))), -1, np.int32)
        bias_ids = np.full((b, width(max((len(s.logit_bias) for s in rows), default=0))), -1, np.int32)
        bias_vals = np.zeros(bias_ids.shape, np.float32)
        for j, (s, banned) in enumerate(zip(rows, ban, strict=True)):
            ban_ids[j, : len(banned)] = banned
            bias_ids[j, : len(s.logit_bias)] = list(s.logit_bias)
            bias_vals[j, : len(s.logit_bias)] = list(s.logit_bias.values())
        p = 0
        if any(s.penalized for s in rows):
            if vocab_size is None or histories is None:
                raise ValueError("penalized sampling rows need histories= and vocab_size= (the tokens to count)")
            p = vocab_size
        counts, seen = np.zeros((b, p), np.int32), np.zeros((b, p), bool)
        for j, (s, h) in enumerate(zip(rows, hist, strict=True)):
            if p and s.penalized:
                np.add.at(counts[j], np.asarray(h.output, np.int64), 1)
                seen[j, np.asarray(h.prompt, np.int64)] = True
        return cls(
            temperature=f32("temperature"),
            top_k=np.asarray([s.top_k for s in rows], np.int32),
            top_p=f32("top_p"),
            min_p=f32("min_p"),
            seed=np.asarray(seeds, np.uint32),
            presence=f32("presence_penalty"),
            frequency=f32("frequency_penalty"),
            repetition=f32("repetition_penalty"),
            min_left=min_left,
            ban_ids=ban_ids,
            bias_ids=bias_ids,
            bias_vals=bias_vals,
            counts=counts,
            seen=seen,
            prompt_next=np.asarray([] if prompt_next is None else prompt_next, np.int32).reshape(b, -1),
            top_n=width(max((s.logprobs or 0 for s in rows), default=0)),
            prompt_top=0 if prompt_next is None else width(max((s.prompt_logprobs or 0 for s in rows), default=0)),
        )

    @staticmethod
    def widen_all(batches: Sequence[SamplingBatch]) -> list[SamplingBatch]:
        """The batches with their optional tables padded to the widest among them (padding is
        neutral: id -1, zero counts, top_n the largest), so they share one compiled variant."""
        ban = max(b.ban_ids.shape[1] for b in batches)
        nb = max(b.bias_ids.shape[1] for b in batches)
        p = max(b.counts.shape[1] for b in batches)
        top = max(b.top_n for b in batches)
        pn, ptop = max(b.prompt_next.shape[1] for b in batches), max(b.prompt_top for b in batches)

        def pad(x, n, value):
            x = np.asarray(x)
            return np.pad(x, ((0, 0), (0, n - x.shape[1])), constant_values=value)

        return [
            b.replace(
                ban_ids=pad(b.ban_ids, ban, -1),
                bias_ids=pad(b.bias_ids, nb, -1),
                bias_vals=pad(b.bias_vals, nb, 0.0),
                counts=pad(b.counts, p, 0),
                seen=pad(b.seen, p, False),
                prompt_next=pad(b.prompt_next, pn, -1),
                top_n=top,
                prompt_top=ptop,
            )
            for b in batches
        ]

    @classmethod
    def broadcast(cls, sampling: SamplingParams | None, batch: int, key: jax.Array | None = None) -> SamplingBatch:
        """`sampling` (default greedy) for every one of `batch` rows. When its seed is None the rows'
        seeds are drawn from `key` (one per row; 0 when key is None too); traceable when `key` is.
        Penalties and min_tokens need each row's tokens: build those batches with `stack`."""
        s = GREEDY if sampling is None else sampling
        if not isinstance(s, SamplingParams):
            raise ValueError(f"sampling={sampling!r} must be an hkv.SamplingParams or None")
        if s.penalized or s.min_tokens:
            raise ValueError(
                f"sampling={s!r} has penalties or min_tokens, which need each row's tokens: build the batch "
                "with SamplingBatch.stack(rows, seeds, histories, vocab_size) (or let hkv.Engine do it)"
            )
        if s.seed is not None:
            seed = jnp.full((batch,), s.seed, jnp.uint32)
        elif key is not None:
            seed = jax.random.bits(key, (batch,), jnp.uint32)
        else:
            seed = jnp.zeros((batch,), jnp.uint32)
        full = lambda v, dt: jnp.full((batch,), v, dt)
        nb = width(len(s.logit_bias))
        bias_ids = np.full((nb,), -1, np.int32)
        bias_vals = np.zeros((nb,), np.float32)
        bias_ids[: len(s.logit_bias)], bias_vals[: len(s.logit_bias)] = list(s.logit_bias), list(s.logit_bias.values())
        return cls(
            temperature=full(s.temperature, jnp.float32),
            top_k=full(s.top_k, jnp.int32),
            top_p=full(s.top_p, jnp.float32),
            min_p=full(s.min_p, jnp.float32),
            seed=seed,
            presence=full(0.0, jnp.float32),
            frequency=full(0.0, jnp.float32),
            repetition=full(1.0, jnp.float32),
            min_left=full(0, jnp.int32),
            ban_ids=jnp.zeros((batch, 0), jnp.int32),
            bias_ids=jnp.broadcast_to(jnp.asarray(bias_ids), (batch, nb)),
            bias_vals=jnp.broadcast_to(jnp.asarray(bias_vals), (batch, nb)),
            counts=jnp.zeros((batch, 0), jnp.int32),
            seen=jnp.zeros((batch, 0), bool),
            prompt_next=jnp.zeros((batch, 0), jnp.int32),
            top_n=width(s.logprobs or 0),
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


def _scatter(shape: tuple[int, int], ids: jax.Array, values: jax.Array) -> jax.Array:
    """values[b, j] added at [b, ids[b, j]] of a zero float32[shape] (ids < 0 or >= shape[1] dropped)."""
    b, v = shape
    ids = jnp.where((ids >= 0) & (ids < v), ids, v)  # out of range: dropped by the scatter
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], ids.shape)
    return jnp.zeros(shape, jnp.float32).at[rows, ids].add(values, mode="drop")


def process_logits(logits: jax.Array, params: SamplingBatch, made: jax.Array | None = None) -> jax.Array:
    """The logits tokens are drawn from: float32[B, V] raw logits -> the same after min_tokens (the
    banned ids at -inf while fewer than `min_left` tokens were made in this dispatch), logit bias,
    and the repetition, frequency and presence penalties (vLLM's order and rules).

    A row whose settings are neutral comes out bitwise equal to its input (x / 1, x * 1, x - 0 and
    x + 0 are exact), so its tokens never depend on what its batch companions ask for.

    Args:
      logits: float32[B, V]; params: the batch (its optional tables may be 0 wide: skipped).
      made: int32[B] tokens each row made earlier in this dispatch (None: 0).
    """
    b, v = logits.shape
    if params.ban_ids.shape[1]:
        made = jnp.zeros((b,), jnp.int32) if made is None else made
        held = (made < params.min_left)[:, None]
        banned = _scatter((b, v), params.ban_ids, jnp.where(held, 1.0, 0.0)) > 0
        logits = jnp.where(banned, -jnp.inf, logits)
    if params.bias_ids.shape[1]:
        logits = logits + _scatter((b, v), params.bias_ids, params.bias_vals)
    if params.counts.shape[1]:
        counts, r = params.counts[:, :v], params.repetition[:, None]
        rep = params.seen[:, :v] | (counts > 0)
        logits = jnp.where(rep, jnp.where(logits > 0, logits / r, logits * r), logits)
        logits = logits - params.frequency[:, None] * counts.astype(jnp.float32)
        logits = logits - params.presence[:, None] * (counts > 0).astype(jnp.float32)
    return logits


def count_tokens(params: SamplingBatch, tokens: jax.Array, emit: jax.Array) -> SamplingBatch:
    """`params` with each emitting row's new token counted (a no-op when no row is penalized)."""
    if not params.counts.shape[1]:
        return params
    b = tokens.shape[0]
    counts = jnp.asarray(params.counts).at[jnp.arange(b), tokens].add(emit.astype(jnp.int32), mode="drop")
    return params.replace(counts=counts)


def top_logprobs(logits: jax.Array, n: int, vocab_size: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The n most likely tokens of each row under the raw distribution: float[B, V] ->
    (ids int32[B, n], logprobs float32[B, n]), most likely first (ties: lower id first)."""
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    if vocab_size is not None and vocab_size < v:
        logits = jnp.where(jnp.arange(v) < vocab_size, logits, -jnp.inf)
    lps = jax.nn.log_softmax(logits, axis=-1)
    vals, ids = jax.lax.top_k(lps, n)
    return ids.astype(jnp.int32), vals


def prompt_logprobs(
    logits: jax.Array, tokens: jax.Array, n_valid: jax.Array, params: SamplingBatch, vocab_size: int | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each chunk position's log-probability of the prompt token that follows it, and the top N.

    Args:
      logits: float[B, C, V] the chunk's logits; tokens: int32[B, C] the chunk (row b's first
        n_valid[b] are real); params: the batch (`prompt_next`: the token after each row's chunk).
    Returns:
      (logprobs float32[B, C]: position t's logprob of token t + 1 of the prompt (0 where none follows),
      top ids int32[B, C, N], top logprobs float32[B, C, N]) with N = params.prompt_top.
    """
    logits = logits.astype(jnp.float32)
    b, c, v = logits.shape
    if vocab_size is not None and vocab_size < v:
        logits = jnp.where(jnp.arange(v) < vocab_size, logits, -jnp.inf)
    lps = jax.nn.log_softmax(logits, axis=-1)
    t = jnp.arange(c)[None, :]
    shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)
    nxt = jnp.where(t + 1 < n_valid[:, None], shifted, params.prompt_next[:, :1])
    nxt = jnp.where(t < n_valid[:, None], nxt, -1)
    got = jnp.take_along_axis(lps, jnp.clip(nxt, 0, v - 1)[..., None], axis=-1)[..., 0]
    got = jnp.where(nxt >= 0, got, 0.0)
    top_lps, top_ids = jax.lax.top_k(lps, params.prompt_top) if params.prompt_top else (
        jnp.zeros((b, c, 0), jnp.float32), jnp.zeros((b, c, 0), jnp.int32))  # fmt: skip
    return got, top_ids.astype(jnp.int32), top_lps


def sample(
    logits: jax.Array,
    params: SamplingBatch,
    positions: jax.Array,
    vocab_size: int | None = None,
    made: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pick one token per row.

    Args:
      logits: float[B, V] the model's logits for the next token of each row.
      params: `SamplingBatch` of B rows.
      positions: int32[B] the sequence index the chosen token will have (its key's position).
      vocab_size: ids >= vocab_size are never chosen (a model whose logits are padded past its
        vocabulary); None: V.
      made: int32[B] tokens each row made earlier in this dispatch (min_tokens; None: 0).

    Returns:
      (tokens int32[B], logprobs float32[B]): the chosen ids and their log-probabilities under the
      model's raw distribution (before penalties, bias, temperature and truncation).
    """
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    if vocab_size is not None and vocab_size < v:
        logits = jnp.where(jnp.arange(v) < vocab_size, logits, -jnp.inf)
    shaped = process_logits(logits, params, made)
    greedy_tok = jnp.argmax(shaped, axis=-1).astype(jnp.int32)

    def draw(_):
        def row(lg, t, k, p, m, seed, pos):
            scaled = truncate(lg / jnp.maximum(t, 1e-6), k, p, m)
            return jax.random.categorical(token_key(seed, pos), scaled).astype(jnp.int32)

        drawn = jax.vmap(row)(
            shaped, params.temperature, params.top_k, params.top_p, params.min_p, params.seed, positions
        )
        return jnp.where(params.temperature > 0, drawn, greedy_tok)

    # the sort and the draw run only when some row samples (greedy batches pay an argmax)
    tokens = jax.lax.cond(jnp.any(params.temperature > 0), draw, lambda _: greedy_tok, None)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
