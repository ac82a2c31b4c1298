"""The indexer's top-k: causal masking, -1 for invalid picks, and documented tie-breaking."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from models.deepseek_v4.compressor import causal_entry_limit, select_topk
from models.deepseek_v4.moe import score


def test_ties_break_by_lowest_index_first():
    scores = jnp.array([[[1.0, 3.0, 3.0, 0.0, 3.0, 3.0]]])
    picks = select_topk(scores, jnp.array([[6]]), 3)
    assert picks.tolist() == [[[1, 2, 4]]]


def test_all_zero_scores_pick_the_first_entries():
    # With ReLU head scores many entries tie at exactly 0: the pick is the lowest indices, deterministically.
    picks = select_topk(jnp.zeros((1, 1, 10)), jnp.array([[10]]), 4)
    assert picks.tolist() == [[[0, 1, 2, 3]]]


def test_causal_mask_and_padding_are_minus_one():
    scores = jnp.array([[[5.0, 4.0, 9.0, 8.0], [5.0, 4.0, 9.0, 8.0]]])
    limit = causal_entry_limit(jnp.array([[7, 11]]), 4)  # positions 7 and 11 see 2 and 3 entries
    assert limit.tolist() == [[2, 3]]
    picks = select_topk(scores, limit, 6)
    assert picks.tolist() == [[[0, 1, -1, -1, -1, -1], [2, 0, 1, -1, -1, -1]]]


def test_no_entries_yet_gives_all_minus_one():
    picks = select_topk(jnp.zeros((2, 3, 0)), jnp.zeros((2, 3), jnp.int32), 4)
    assert picks.shape == (2, 3, 4) and np.all(np.asarray(picks) == -1)


def test_router_scoring_functions():
    logits = jnp.array([[0.5, -1.0, 2.0]])
    np.testing.assert_allclose(score(logits, "sqrtsoftplus"), np.sqrt(np.log1p(np.exp(np.asarray(logits)))), rtol=1e-6)
    np.testing.assert_allclose(score(logits, "sigmoid"), 1 / (1 + np.exp(-np.asarray(logits))), rtol=1e-6)
    sm = np.exp(np.asarray(logits)) / np.exp(np.asarray(logits)).sum()
    np.testing.assert_allclose(score(logits, "softmax"), sm, rtol=1e-6)
