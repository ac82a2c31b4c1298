"""The stateless greedy oracle compiled once per test module.

`greedy_stateless(model, prompts, n)` builds a fresh `jax.jit` per call and compiles one program per
(batch, padded length): ~3-12 s each on CPU, paid again by every test that checks its outputs.
`Oracle(model)` keeps one jitted forward and calls it at a fixed shape (prompts in groups of `batch`,
the last group padded with copies of its first prompt; every buffer padded to `pad_to`), so a module
compiles the stateless forward once. Causality keeps the padding invisible to the real positions:
the same tokens and logits as `greedy_stateless(model, prompts, n)`.
"""

from __future__ import annotations

from models.stateless import forward_fn, greedy_stateless


class Oracle:
    def __init__(self, model, *, pad_to: int, batch: int = 4):
        self.model, self.pad_to, self.batch = model, pad_to, batch
        self.fwd = forward_fn(model)

    def __call__(self, prompts, max_new_tokens: int):
        """(tokens, logits) per prompt, as `greedy_stateless(model, prompts, max_new_tokens)`."""
        prompts = [list(p) for p in prompts]
        tokens, logits = [], []
        for i in range(0, len(prompts), self.batch):
            group = prompts[i : i + self.batch]
            padded = group + [group[0]] * (self.batch - len(group))
            t, lg = greedy_stateless(self.model, padded, max_new_tokens, pad_to=self.pad_to, fwd=self.fwd)
            tokens += t[: len(group)]
            logits += lg[: len(group)]
        return tokens, logits


_SHARED: dict = {}


def oracle_for(model, *, pad_to: int, batch: int = 4) -> Oracle:
    """One `Oracle` per (model object, pad_to, batch), kept for the process (it holds the model)."""
    key = (id(model), pad_to, batch)
    if key not in _SHARED or _SHARED[key].model is not model:
        _SHARED[key] = Oracle(model, pad_to=pad_to, batch=batch)
    return _SHARED[key]
