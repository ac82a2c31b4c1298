"""The stateless forward of any model in `models/`, jitted, and greedy generation by re-running it.

Greedy generation here has no cache: each new token costs one forward over the whole (padded)
sequence — correct by construction and deliberately naive, the oracle that cached decoding must
reproduce. The buffer is padded to a fixed length so the forward compiles once (causality makes the
padding invisible to earlier positions). A model provides `__call__(tokens)`, `vocab_size` and
`check_tokens(tokens)` (host-side validation of ids and shape).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from hkv import numerics


@functools.partial(numerics.jit, static_argnums=0)
def _forward(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)


def forward_fn(model) -> Callable[[jnp.ndarray], jnp.ndarray]:
    """A jitted stateless forward `tokens int32[B, T] -> float32[B, T, vocab]` closed over `model`'s weights
    (one compilation per input shape). Token ids are validated on the host first.

    Every forward of models with the same structure (`nnx.split`'s graph definition) shares one jitted
    function: a second `forward_fn` (each `greedy_stateless` call without `fwd` makes one) of such a model
    neither traces nor compiles again for a shape the first ran. (A jitted closure per call traced and
    lowered the whole model every time.)"""
    graphdef, state = nnx.split(model)

    def call(tokens):
        model.check_tokens(tokens)
        return _forward(graphdef, state, jnp.asarray(tokens, jnp.int32))

    return call


def greedy_stateless(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    on_token: Callable[[int, list[int]], None] | None = None,
    pad_to: int | None = None,
    fwd: Callable | None = None,
) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy continuation of each prompt.

    Args:
      prompts: B lists of token ids (lengths may differ, each >= 1).
      max_new_tokens: new tokens per prompt (>= 0).
      on_token: `on_token(step, ids)` after every step (progress output).
      pad_to: pad the buffer to this length (>= longest prompt + max_new_tokens) so calls of different
        lengths share one compilation.
      fwd: a `forward_fn(model)` to reuse (its compilation too).

    Returns:
      (tokens, logits): per prompt the new ids and the float32[max_new_tokens, vocab] logits that chose them.
    """
    if max_new_tokens < 0:
        raise ValueError(f"{max_new_tokens=} must be >= 0")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError(f"every prompt needs >= 1 token; got lengths {[len(p) for p in prompts]}")
    lengths = np.array([len(p) for p in prompts])
    total = int(lengths.max()) + max_new_tokens
    if pad_to is not None:
        if pad_to < total:
            raise ValueError(f"{pad_to=} must be >= longest prompt + max_new_tokens = {total}")
        total = pad_to
    buf = np.zeros((len(prompts), total), np.int32)
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = p
    model.check_tokens(buf)
    fwd = fwd or forward_fn(model)
    new_tokens: list[list[int]] = [[] for _ in prompts]
    new_logits: list[list[np.ndarray]] = [[] for _ in prompts]
    cur = lengths.copy()
    rows = np.arange(len(prompts))
    for step in range(max_new_tokens):
        logits = np.asarray(fwd(jnp.asarray(buf)))[rows, cur - 1]  # [B, vocab]
        ids = logits.argmax(-1)
        for i in rows:
            new_tokens[i].append(int(ids[i]))
            new_logits[i].append(logits[i])
        buf[rows, cur] = ids
        cur += 1
        if on_token is not None:
            on_token(step, [int(x) for x in ids])
    vocab = model.vocab_size
    return new_tokens, [np.stack(x) if x else np.zeros((0, vocab), np.float32) for x in new_logits]
