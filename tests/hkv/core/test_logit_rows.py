"""`run_step(logit_rows=...)`: a step returns (and a model that applies `Step.head_rows` computes) the
logits of the rows asked for only — the same bits as those rows of the full logits — and refuses a
bad `logit_rows` by name."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import hkv
from hkv.core import transitions as tr
from hkv.core.decode import step_and_sample
from hkv.core.protocol import accepts_keyword
from models import gemma3, toy

TOKENS = np.array([[5, 17, 42, 9, 11, 3], [7, 1, 8, 2, 0, 0]], np.int32)
N_VALID = np.array([6, 4], np.int32)


def _cache(model, slots=2):
    layout = hkv.CacheLayout(
        model.cache_spec(block_tokens=4), hkv.CacheConfig(slots=slots, max_context=32, page_size=4)
    )
    cache = hkv.init_cache(layout)
    for _ in range(slots):
        cache, _, _ = tr.claim_slot(layout, cache)
    return layout, cache


def _run(model, logit_rows, **kw):
    layout, cache = _cache(model)
    f = hkv.numerics.jit(lambda c, r: model.cached_step(layout, c, TOKENS, jnp.arange(2), N_VALID, logit_rows=r, **kw))
    cache, logits, status = f(cache, logit_rows)
    assert int(status) == hkv.Status.OK
    return np.asarray(logits)


@pytest.mark.parametrize(
    "make",
    [lambda: toy.init(toy.ToyConfig(), seed=0), lambda: gemma3.init(gemma3.tiny_config(), seed=0)],
    ids=["toy", "gemma3"],
)
def test_the_rows_asked_for_are_those_of_the_full_logits_bit_for_bit(make):
    model = make()
    full = _run(model, None)
    rows = np.array([[5, 0], [3, 3]], np.int32)
    picked = _run(model, jnp.asarray(rows))
    assert picked.shape == (2, 2, full.shape[-1])
    np.testing.assert_array_equal(picked, np.take_along_axis(full, rows[:, :, None], axis=1))


class _AllRows(toy.ToyModel):
    """A model whose forward ignores `Step.head_rows`: it computes every row's logits."""

    def cached_step(self, layout, cache, tokens, slots, n_valid, *, logit_rows=None, **options):
        def forward(cache, step):
            _, logits, _ = super(_AllRows, self).cached_step(layout, cache, step.tokens, step.slots, step.n_valid)
            return cache, logits

        return hkv.run_step(layout, cache, jnp.asarray(tokens), jnp.asarray(slots), jnp.asarray(n_valid), forward,
                            logit_rows=logit_rows, **options)  # fmt: skip


def test_a_forward_that_computes_every_row_still_returns_the_rows_asked_for():
    from flax import nnx

    model = _AllRows(toy.ToyConfig(), nnx.Rngs(0))
    full = _run(model, None)
    rows = np.array([[2], [0]], np.int32)
    np.testing.assert_array_equal(_run(model, jnp.asarray(rows)), np.take_along_axis(full, rows[:, :, None], axis=1))


@pytest.mark.parametrize("rows", [np.zeros((2,), np.int32), np.zeros((3, 1), np.int32), np.zeros((2, 6), np.int32)])
def test_bad_logit_rows_are_refused_by_name(rows):
    model = toy.init(toy.ToyConfig(), seed=0)
    with pytest.raises(ValueError, match="logit_rows"):
        _run(model, jnp.asarray(rows))


def test_step_and_sample_asks_a_model_that_can_for_the_sampled_row_only():
    model = toy.init(toy.ToyConfig(), seed=0)
    assert accepts_keyword(model, "logit_rows")
    seen = []
    real = type(model).cached_step

    def spy(self, *a, **kw):
        seen.append(kw.get("logit_rows"))
        return real(self, *a, **kw)

    layout, cache = _cache(model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(model), "cached_step", spy)
        out = hkv.numerics.jit(lambda c: step_and_sample(model, layout, c, TOKENS, jnp.arange(2), N_VALID))(cache)
    assert seen[-1] is not None and seen[-1].shape == (2, 1)
    full = _run(model, None)
    want = np.argmax(full[np.arange(2), N_VALID - 1], axis=-1)
    np.testing.assert_array_equal(np.asarray(out[1]), want)
