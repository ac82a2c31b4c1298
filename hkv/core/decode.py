"""Generation as pure functions of the cache, for the user's own `jax.jit` (and the engine's).

    graphdef, weights = nnx.split(model)

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
    def generate(layout, cache, weights, prompt, slots, n_valid):
        model = nnx.merge(graphdef, weights)
        cache, first, _, status = hkv.step_and_sample(model, layout, cache, prompt, slots, n_valid)
        cache, new, n_new, status = hkv.decode_loop(model, layout, cache, first, slots, steps=32)
        return cache, first, new, n_new, status

`step_and_sample` runs one chunk (a prompt, or a prompt's next chunk) and samples the token after
each row's last valid position; `decode_loop` then runs up to `steps` single-token steps in a
`lax.while_loop` whose carry is the cache: tokens are sampled on device (`hkv.core.sampling`), rows
that draw a stop id or use up their budget go idle, and a step that fails (`Status.NO_PAGES`, ...)
ends the loop with that status — the tokens before it stand, the cache is as after the last good
step, and no token is invented for the failed one. Nothing crosses to the host inside the loop.

Passing the weights as a jit argument (`nnx.split` / `nnx.merge`, as above) keeps them out of the
compiled program as constants; closing over the model also works but bakes them in.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels import index_math as im

from .layout import CacheLayout, Status
from .protocol import accepts_keyword, any_shard, lockstep_axes
from .sampling import SamplingBatch, SamplingParams, count_tokens, prompt_logprobs, sample, top_logprobs
from .state import HybridCache


@struct.dataclass
class DecodeOutput:
    """Everything `decode_steps` returns (a pytree).

    Attributes:
      cache: the cache after the last successful step.
      tokens: int32[B, steps] new tokens; row b's first `n_new[b]` entries are valid (rest 0).
      logprobs: float32[B, steps] log-probability of each new token under the model (0 past n_new).
      n_new: int32[B] tokens each row produced.
      stopped: bool[B] the row's last token is one of its stop ids.
      status: int32 `Status.OK`, or the status of the step that ended the loop early.
      logits: float32[B, steps, V] the logits each token was drawn from (only with keep_logits).
      top_ids, top_logprobs: int32 / float32[B, steps, N] the N most likely tokens at each step
        and their raw log-probabilities (only when the batch's `top_n` is N > 0).
    """

    cache: HybridCache
    tokens: jax.Array
    logprobs: jax.Array
    n_new: jax.Array
    stopped: jax.Array
    status: jax.Array
    logits: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


def stop_table(stop_token_ids: Sequence[int], batch: int) -> jax.Array:
    """int32[batch, max(1, len(ids))] the same stop ids for every row, -1 padded (never matches)."""
    ids = [int(t) for t in stop_token_ids] or [-1]
    return jnp.broadcast_to(jnp.asarray(ids, jnp.int32)[None], (batch, len(ids)))


def _oov(tokens: jax.Array, active: jax.Array, vocab_size: int) -> jax.Array:
    return jnp.any(active & ((tokens < 0) | (tokens >= vocab_size)))


def step_and_sample(
    model,
    layout: CacheLayout,
    cache: HybridCache,
    tokens: jax.Array,
    slots: jax.Array,
    n_valid: jax.Array,
    *,
    sampling: SamplingParams | SamplingBatch | None = None,
    key: jax.Array | None = None,
    check: bool = True,
    keep_logits: bool = False,
    snapshots=None,
    **step_options,
):
    """Run one chunk through `model.cached_step` and sample the token after each row's last valid one.

    Args:
      model: an `hkv.CachedModel`.
      layout, cache: the cache (layout static under jit).
      tokens: int32[B, C]; row b runs tokens[b, :n_valid[b]] as the next tokens of slot slots[b].
      slots: int32[B]; n_valid: int32[B] in [0, C] (0 = idle row).
      sampling: an `hkv.SamplingParams` for every row, or per-row `SamplingBatch`; None = greedy.
      key: draws per-row seeds when `sampling.seed` is None.
      check: refuse ids outside [0, model.vocab_size) in valid positions (status `BAD_TOKEN`, cache
        unchanged) instead of letting the embedding gather clamp them.
      keep_logits: also return the float32[B, V] logits each token was drawn from.
      snapshots: `hkv.InteriorSnapshots` passed to the model's cached_step when it takes that keyword
        (a model that does not prepares none; `record_many` then takes no snapshot inside the step).
      step_options: passed to `model.cached_step` (kernel_backend, interpret).

    Returns:
      (cache, next_tokens int32[B], logprobs float32[B], status) — then the logits when keep_logits,
      then (top_ids int32[B, N], top_logprobs float32[B, N]) when the batch's `top_n` is N > 0, then
      the chunk's prompt logprobs (`hkv.core.sampling.prompt_logprobs`) when the batch asks for them.
      Rows with n_valid 0, and every row when status is not OK, carry token 0 and logprob 0.
    """
    tokens, slots, n_valid = (jnp.asarray(a, jnp.int32) for a in (tokens, slots, n_valid))
    b, c = tokens.shape
    params = _params(sampling, b, key)
    valid = jnp.arange(c)[None, :] < n_valid[:, None]
    bad = _oov(tokens, valid, model.vocab_size) if check else jnp.bool_(False)
    n_run = jnp.where(bad, 0, n_valid)  # a refused step runs no row: the cache comes back unchanged
    rows = jnp.clip(n_valid - 1, 0, c - 1)[:, None]  # the row each token is drawn from
    # only that row's logits when the model can (`Step.head_rows`) and no prompt logprobs are asked
    only_rows = c > 1 and not params.prompt_next.shape[1] and accepts_keyword(model, "logit_rows")
    if only_rows:
        step_options = {**step_options, "logit_rows": rows}
    if snapshots is not None and accepts_keyword(model, "snapshots"):
        step_options = {**step_options, "snapshots": snapshots}
    cache, logits, status = model.cached_step(layout, cache, tokens, slots, n_run, **step_options)
    status = jnp.where(bad, jnp.int32(Status.BAD_TOKEN), status)
    last = logits[:, 0] if only_rows else im.take_rows(logits, rows)[:, 0]  # [B, V]
    tok, lp = sample(last, params, im.take(cache.lengths, slots), model.vocab_size)
    emit = (n_valid > 0) & (status == Status.OK)
    tok, lp = jnp.where(emit, tok, 0), jnp.where(emit, lp, 0.0)
    out = (cache, tok, lp, status)
    if keep_logits:
        out += (jnp.where(emit[:, None], last, 0.0),)
    if params.top_n:
        ids, lps = top_logprobs(last, params.top_n, model.vocab_size)
        out += (jnp.where(emit[:, None], ids, 0), jnp.where(emit[:, None], lps, 0.0))
    if params.prompt_next.shape[1]:
        out += prompt_logprobs(logits, tokens, jnp.where(status == Status.OK, n_valid, 0), params, model.vocab_size)
    return out


def _params(sampling, batch: int, key) -> SamplingBatch:
    if isinstance(sampling, SamplingBatch):
        if sampling.temperature.shape != (batch,):
            raise ValueError(f"SamplingBatch rows {sampling.temperature.shape} must be [{batch}]")
        return sampling
    return SamplingBatch.broadcast(sampling, batch, key)


# Platforms whose decode loop runs a count of iterations XLA knows (`steps`) instead of stopping when
# every row is done: on GPU a while loop's condition is copied to the host at every iteration, so the
# host waits for each step before it launches the next one; with a known trip count XLA runs the loop
# without reading anything back (the host launches ahead). Rows that finished (and every row after a
# failed step) idle through the remaining iterations: an idle row's step writes nothing, so the
# outputs are the early-stopping loop's. CPU and TPU test the condition on the device: they stop early.
COUNTED_LOOP_PLATFORMS: tuple[str, ...] = ("cuda", "rocm")


def decode_steps(
    model,
    layout: CacheLayout,
    cache: HybridCache,
    tokens: jax.Array,
    slots: jax.Array,
    params: SamplingBatch,
    budget: jax.Array,
    stop_ids: jax.Array,
    *,
    steps: int,
    check: bool = True,
    keep_logits: bool = False,
    **step_options,
) -> DecodeOutput:
    """The loop behind `decode_loop`, with per-row settings (what the engine calls).

    Args:
      tokens: int32[B] each row's last token, not yet in the cache (fed by the first step).
      slots: int32[B] the rows' slots (distinct among rows with budget > 0).
      params: `SamplingBatch` of B rows.
      budget: int32[B] most new tokens per row (0 = idle row); at most `steps`.
      stop_ids: int32[B, S] each row's stop ids (-1 = none); a row that draws one keeps it as its
        last token and goes idle.
      steps: static loop bound (the shape of the outputs).
      check, keep_logits, step_options: as in `step_and_sample`.

    Returns:
      a `DecodeOutput`.
    """
    tokens, slots, budget = (jnp.asarray(a, jnp.int32) for a in (tokens, slots, budget))
    b = tokens.shape[0]
    if tokens.ndim != 1 or slots.shape != (b,) or budget.shape != (b,) or stop_ids.shape[0] != b:
        raise ValueError(
            f"tokens{list(tokens.shape)}, slots{list(slots.shape)}, budget{list(budget.shape)}, "
            f"stop_ids{list(stop_ids.shape)} must be [B], [B], [B], [B, S]"
        )
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be an integer >= 1")
    vocab = model.vocab_size
    active = budget > 0
    status = jnp.where(check & _oov(tokens, active, vocab), jnp.int32(Status.BAD_TOKEN), jnp.int32(Status.OK))
    out = jnp.zeros((b, steps), jnp.int32)
    lps = jnp.zeros((b, steps), jnp.float32)
    kept = jnp.zeros((b, steps, vocab if keep_logits else 0), jnp.float32)
    n_top = params.top_n
    tops = (jnp.zeros((b, steps, n_top), jnp.int32), jnp.zeros((b, steps, n_top), jnp.float32))
    zero = jnp.zeros((b,), jnp.int32)
    carry = (jnp.int32(0), cache, params, tokens, out, lps, kept, tops, zero, active, jnp.zeros((b,), bool), status)

    def cond(carry):
        i, *_, active, _, status = carry
        return (i < steps) & jnp.any(active) & (status == Status.OK)

    def body(carry):
        i, cache, params, cur, out, lps, kept, tops, n_new, active, stopped, status = carry
        cache, logits, st = model.cached_step(
            layout, cache, cur[:, None], slots, active.astype(jnp.int32), **step_options
        )
        ok = st == Status.OK
        tok, lp = sample(logits[:, 0], params, im.take(cache.lengths, slots), vocab, made=n_new)
        emit = active & ok
        out = out.at[:, i].set(jnp.where(emit, tok, 0))
        lps = lps.at[:, i].set(jnp.where(emit, lp, 0.0))
        if keep_logits:
            kept = kept.at[:, i].set(jnp.where(emit[:, None], logits[:, 0, :vocab].astype(jnp.float32), 0.0))
        if n_top:
            ids, top = top_logprobs(logits[:, 0], n_top, vocab)
            tops = (tops[0].at[:, i].set(jnp.where(emit[:, None], ids, 0)),
                    tops[1].at[:, i].set(jnp.where(emit[:, None], top, 0.0)))  # fmt: skip
        params = count_tokens(params, tok, emit)
        n_new = n_new + emit
        hit = emit & jnp.any(tok[:, None] == stop_ids, axis=1)
        stopped = stopped | hit
        active = jnp.where(ok, emit & ~hit & (n_new < budget), active)
        cur = jnp.where(emit, tok, cur)
        return i + 1, cache, params, cur, out, lps, kept, tops, n_new, active, stopped, jnp.where(ok, status, st)

    def one(_, carry):  # one iteration; a row that finished, or every row after a failure, idles
        i, cache, *rest, active, stopped, status = carry
        ran = cond(carry)  # whether the early-stopping loop runs this iteration
        out = body((i, cache, *rest, active & (status == Status.OK), stopped, status))
        # an iteration the early loop would not run writes nothing but the cache's counters (of
        # transitions run): those keep their values
        counters = jax.tree.map(lambda new, old: jnp.where(ran, new, old), out[1].counters, cache.counters)
        return (out[0], out[1].replace(counters=counters), *out[2:])

    def counted(carry):  # `steps` iterations
        return jax.lax.fori_loop(0, steps, one, carry)

    def early(carry):
        return jax.lax.while_loop(cond, body, carry)

    axes = lockstep_axes(model)

    def lockstep(carry):  # every shard iterates while any shard's rows run (a finished one idles, as `counted`)
        def go(carry):
            return (carry[0] < steps) & any_shard(cond(carry), axes)

        return jax.lax.while_loop(go, lambda carry: one(carry[0], carry), carry)

    default = lockstep if axes else early
    carry = jax.lax.platform_dependent(carry, default=default, **dict.fromkeys(COUNTED_LOOP_PLATFORMS, counted))
    _, cache, _, _, out, lps, kept, tops, n_new, _, stopped, status = carry
    return DecodeOutput(
        cache=cache,
        tokens=out,
        logprobs=lps,
        n_new=n_new,
        stopped=stopped,
        status=status,
        logits=kept if keep_logits else None,
        top_ids=tops[0] if n_top else None,
        top_logprobs=tops[1] if n_top else None,
    )


def decode_loop(
    model,
    layout: CacheLayout,
    cache: HybridCache,
    tokens: jax.Array,
    slots: jax.Array,
    *,
    steps: int,
    sampling: SamplingParams | SamplingBatch | None = None,
    key: jax.Array | None = None,
    stop_token_ids: Sequence[int] = (),
    budget: jax.Array | None = None,
    check: bool = True,
    **step_options,
) -> tuple[HybridCache, jax.Array, jax.Array, jax.Array]:
    """Decode up to `steps` tokens for every row on device, the cache as the `lax.while_loop` carry.

    Works inside the caller's `jax.jit` (layout static, cache donated): one compilation per
    (batch, steps). Tokens equal `hkv.Engine.generate`'s for the same prompts and sampling.

    Args:
      model: an `hkv.CachedModel` (e.g. `nnx.merge(graphdef, weights)` inside the caller's jit).
      layout, cache: the cache; rows' slots must be claimed and hold their prompts.
      tokens: int32[B] each row's last token (the one the prompt's step sampled), not yet in the cache.
      slots: int32[B] distinct claimed slots.
      steps: most new tokens per row (static).
      sampling: an `hkv.SamplingParams` for every row or per-row `SamplingBatch`; None = greedy.
      key: a PRNG key drawing per-row seeds when `sampling.seed` is None.
      stop_token_ids: ids that end a row (the stop id is its last new token).
      budget: int32[B] per-row limits <= steps (default steps for every row; 0 = idle row).
      check: refuse out-of-vocabulary `tokens` (status `BAD_TOKEN`, nothing runs).
      step_options: passed to `model.cached_step` (kernel_backend, interpret).

    Returns:
      (cache, new_tokens int32[B, steps], n_new int32[B], status): row b's tokens are
      new_tokens[b, :n_new[b]]; status is `Status.OK` or the failure that ended the loop early
      (e.g. `NO_PAGES`: free pages, then continue from the last token produced).
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 1:
        raise ValueError(f"tokens.shape={tokens.shape} must be [B] (each row's last token)")
    b = tokens.shape[0]
    params = _params(sampling, b, key)
    budget = jnp.full((b,), steps, jnp.int32) if budget is None else jnp.minimum(jnp.asarray(budget, jnp.int32), steps)
    out = decode_steps(
        model,
        layout,
        cache,
        tokens,
        slots,
        params,
        budget,
        stop_table(stop_token_ids, b),
        steps=steps,
        check=check,
        **step_options,
    )
    return out.cache, out.tokens, out.n_new, out.status
