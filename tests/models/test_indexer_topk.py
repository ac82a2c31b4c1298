"""The indexer's top-k: causal masking, -1 for invalid picks, and documented tie-breaking."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from hkv.core.layers import indexer_scores, indexer_topk, sequence_attention
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


def test_indexer_scores_are_the_weighted_sum_of_relu_dot_products():
    """score[b, s, n] = sum_h w[b, s, h] * relu(q[b, s, h] . k[b, n]) / sqrt(d), in float64 (the head sum
    runs as a contraction: a relu after the weighted sum, or a missing scale, would fail this)."""
    rng = np.random.default_rng(1)
    b, s, h, dh, n = 2, 5, 16, 8, 11
    q, w, keys = rng.standard_normal((b, s, h, dh)), rng.standard_normal((b, s, h)), rng.standard_normal((b, n, dh))
    want = np.einsum("bsh,bshn->bsn", w, np.maximum(np.einsum("bshd,bnd->bshn", q, keys), 0)) / np.sqrt(dh)
    got = indexer_scores(*(jnp.asarray(x, jnp.float32) for x in (q, w, keys)), dh)
    assert got.dtype == jnp.float32 and got.shape == (b, s, n)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_blocked_scoring_picks_what_scoring_everything_at_once_picks():
    """`indexer_topk` in blocks of queries (the last one padded) equals `select_topk` over all scores."""
    rng = np.random.default_rng(0)
    b, s, h, dh, n, k = 2, 37, 4, 8, 19, 5
    q = jnp.asarray(rng.standard_normal((b, s, h, dh)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((b, s, h)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((b, n, dh)), jnp.float32)
    limit = causal_entry_limit(jnp.broadcast_to(jnp.arange(s)[None] * 2, (b, s)), 4)
    want = np.asarray(select_topk(indexer_scores(q, w, keys, dh), limit, k))
    assert (want == -1).any() and (want >= 0).any()
    for block in (1, 8, 36, 37, None):
        np.testing.assert_array_equal(np.asarray(indexer_topk(q, w, keys, limit, k, block=block)), want)


def test_sequence_attention_with_picks_is_one_softmax_over_window_picks_and_sinks():
    """`sequence_attention(..., picks=)` (the stateless CSA attention) equals a float64 softmax over the
    visible window rows and each query's picked entries, with a per-head sink in the denominator."""
    rng = np.random.default_rng(1)
    b, t, h, d, n, k, window = 2, 9, 4, 8, 5, 3, 4
    f32 = jnp.float32
    q = rng.standard_normal((b, t, h, d))
    kv = rng.standard_normal((b, t, 1, d))
    entries = rng.standard_normal((b, n, d))
    picks = np.stack([[rng.permutation(n)[:k] for _ in range(t)] for _ in range(b)]).astype(np.int32)
    picks[0, 2, 1:] = -1  # a query with fewer picks than k
    sinks = rng.standard_normal(h)
    got = sequence_attention(jnp.asarray(q, f32), jnp.asarray(kv, f32), jnp.asarray(kv, f32), window=window,
                             scale=d**-0.5, sinks=jnp.asarray(sinks, f32), entries=jnp.asarray(entries, f32),
                             picks=jnp.asarray(picks))  # fmt: skip
    want = np.zeros((b, t, h, d))
    for bi in range(b):
        for ti in range(t):
            rows = [kv[bi, p, 0] for p in range(max(0, ti - window + 1), ti + 1)]
            rows += [entries[bi, e] for e in picks[bi, ti] if e >= 0]
            rows = np.stack(rows)
            for hi in range(h):
                logits = rows @ q[bi, ti, hi] * d**-0.5
                m = max(logits.max(), sinks[hi])
                e = np.exp(logits - m)
                want[bi, ti, hi] = e @ rows / (e.sum() + np.exp(sinks[hi] - m))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
