"""Greedy generation by re-running the stateless forward (no cache): the oracle for cached decoding.

Each new token costs one forward over the whole (padded) sequence, O(T) layers' work per token and
O(T^2) attention per step — correct by construction and deliberately naive. The sequence is padded
to a fixed length so the forward compiles once: causality makes padding invisible to earlier positions.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from .model import DeepseekV4, forward_fn


def greedy_stateless(
    model: DeepseekV4,
    prompts: list[list[int]],
    max_new_tokens: int,
    on_token: Callable[[int, list[int]], None] | None = None,
    pad_to: int | None = None,
) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy continuation of each prompt.

    prompts: B lists of token ids (lengths may differ, each >= 1). Returns (tokens, logits): per
    prompt the `max_new_tokens` new ids and float32[max_new_tokens, vocab] logits that chose them.
    `on_token(step, ids)` is called after every step (progress output). `pad_to`: pad the sequence
    buffer to this length (>= longest prompt + max_new_tokens) so calls of different lengths share
    one compilation.
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
    fwd = forward_fn(model)
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
    return new_tokens, [np.stack(x) if x else np.zeros((0, model.cfg.vocab_size), np.float32) for x in new_logits]
