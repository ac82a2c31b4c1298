"""Lightning-indexer scores and top-k: kernels (interpreted) vs references vs a numpy oracle."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import testing
from pallas_kernels.indexer import (
    indexer_scores,
    indexer_scores_reference,
    indexer_topk,
    indexer_topk_reference,
    topk_from_scores,
)

N_HEADS, DIM, PAGE_SIZE, PAGES_PER_SEQ, NUM_PAGES, RATIO, K = 4, 16, 4, 5, 40, 4, 6  # capacity 20
# (length, index keys written): empty; before the first entry; fewer visible than K; written ahead
# of the causal limit (entries 3..6 must be masked); full capacity; count past the capacity.
CASES = [(0, 0), (3, 0), (13, 3), (14, 7), (80, 20), (90, 25)]
LENGTHS = np.array([c[0] for c in CASES], np.int32)
N_ENTRIES = np.array([c[1] for c in CASES], np.int32)
CAPACITY = PAGES_PER_SEQ * PAGE_SIZE
N_VISIBLE = np.minimum(np.minimum(N_ENTRIES, LENGTHS // RATIO), CAPACITY)
BACKENDS = list(testing.KERNEL_BACKENDS)
SCORE_TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=1e-5, atol=1e-4)}


def make_case(seed, dtype, keys=None, weights=None):
    """Random inputs; index keys of invisible entries are NaN and their pages unallocated."""
    dtype = jnp.dtype(dtype)
    rng = np.random.default_rng(seed)
    batch = len(LENGTHS)
    case = testing.entry_case(
        rng,
        dtype,
        [np.arange(n) for n in N_VISIBLE],
        np.minimum(N_ENTRIES, CAPACITY),
        dim=DIM,
        page_size=PAGE_SIZE,
        pages_per_seq=PAGES_PER_SEQ,
        num_pages=NUM_PAGES,
    )
    if keys is not None:  # overwrite the visible keys with given values, same pages
        for b in range(batch):
            for s in range(N_VISIBLE[b]):
                page = case["page_table"][b, s // PAGE_SIZE]
                case["pool"][page, s % PAGE_SIZE] = keys[s]
                case["dense"][b, s] = keys[s]
    q = rng.standard_normal((batch, N_HEADS, DIM)).astype(dtype)
    w = (rng.standard_normal((batch, N_HEADS)) if weights is None else weights).astype(dtype)
    args = tuple(jnp.asarray(a) for a in (q, w, case["pool"], case["page_table"], LENGTHS, N_ENTRIES))
    return args, case["dense"]


def oracle_scores(args, dense):
    q, w = np.asarray(args[0], np.float64), np.asarray(args[1], np.float64)
    scores = np.full((len(LENGTHS), CAPACITY), -np.inf)
    for b, n in enumerate(N_VISIBLE):
        logits = q[b] @ dense[b, :n].astype(np.float64).T  # [heads, n]
        scores[b, :n] = (w[b][:, None] * np.maximum(logits, 0)).sum(0) * DIM**-0.5
    return scores


def oracle_topk(scores, k):
    """Stable numpy selection: decreasing score, ties by increasing index, -inf picks -> -1."""
    out = np.full((scores.shape[0], k), -1, np.int32)
    for b, row in enumerate(scores):
        order = np.argsort(-row, kind="stable")[:k]
        order = np.where(np.isneginf(row[order]), -1, order)
        out[b, : len(order)] = order
    return out


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_reference_scores_match_oracle(dtype):
    args, dense = make_case(0, dtype)
    scores = np.asarray(indexer_scores_reference(*args, compress_ratio=RATIO))
    expected = oracle_scores(args, dense)
    np.testing.assert_array_equal(np.isneginf(scores), np.isneginf(expected))  # causal + count mask
    np.testing.assert_allclose(scores, expected, **SCORE_TOL[np.dtype(jnp.dtype(dtype)).name])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_kernel_scores_match_reference(backend, dtype):
    args, dense = make_case(1, dtype)
    scores = np.asarray(indexer_scores(*args, compress_ratio=RATIO, backend=backend, interpret=testing.INTERPRET))
    assert not np.isnan(scores).any()  # NaN keys of invisible entries were never read
    ref = np.asarray(indexer_scores_reference(*args, compress_ratio=RATIO))
    np.testing.assert_array_equal(np.isneginf(scores), np.isneginf(ref))
    np.testing.assert_allclose(scores, ref, **SCORE_TOL[np.dtype(jnp.dtype(dtype)).name])
    np.testing.assert_allclose(scores, oracle_scores(args, dense), **SCORE_TOL[np.dtype(jnp.dtype(dtype)).name])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [K, CAPACITY + 3])  # k past the capacity pads with -1
def test_kernel_topk_matches_reference_and_oracle(backend, k):
    args, dense = make_case(2, np.float32)
    picks = np.asarray(indexer_topk(*args, k=k, compress_ratio=RATIO, backend=backend, interpret=testing.INTERPRET))
    assert picks.shape == (len(LENGTHS), k) and picks.dtype == np.int32
    np.testing.assert_array_equal(picks, np.asarray(indexer_topk_reference(*args, k=k, compress_ratio=RATIO)))
    np.testing.assert_array_equal(picks, oracle_topk(oracle_scores(args, dense), k))
    # Causality: every pick is visible, and there are exactly min(k, visible) of them.
    for b in range(len(LENGTHS)):
        valid = picks[b][picks[b] >= 0]
        assert (valid < N_VISIBLE[b]).all() and len(valid) == min(k, N_VISIBLE[b])


@pytest.mark.parametrize("backend", [*testing.KERNEL_BACKENDS, "reference"])
def test_ties_are_broken_by_lowest_index(backend):
    # Keys repeat with period 3, so entries s, s+3, s+6, ... score exactly the same.
    rng = np.random.default_rng(3)
    base = rng.standard_normal((3, DIM)).astype(np.float32)
    keys = np.stack([base[s % 3] for s in range(CAPACITY)])
    args, dense = make_case(3, np.float32, keys=keys)
    picks = np.asarray(indexer_topk(*args, k=K, compress_ratio=RATIO, backend=backend, interpret=testing.INTERPRET))
    scores = oracle_scores(args, dense)
    np.testing.assert_array_equal(picks, oracle_topk(scores, K))
    b = int(np.argmax(N_VISIBLE))  # 20 visible entries: groups of 7, 7 and 6 equal scores
    best = int(np.argmax(scores[b, :3]))
    np.testing.assert_array_equal(picks[b], np.arange(best, best + 3 * K, 3))


@pytest.mark.parametrize("backend", [testing.KERNEL_BACKENDS[0], "reference"])
def test_all_zero_scores_pick_the_lowest_indices(backend):
    # Negative weights and keys the queries never align with: relu() is 0 and every score is
    # w * 0 = -0.0, one big tie.
    q = np.zeros((len(LENGTHS), N_HEADS, DIM), np.float32)
    q[:, :, 0] = 1.0
    keys = np.zeros((CAPACITY, DIM), np.float32)
    keys[:, 0] = -1.0
    args, _ = make_case(4, np.float32, keys=keys, weights=-np.ones((len(LENGTHS), N_HEADS)))
    args = (jnp.asarray(q),) + args[1:]
    picks = np.asarray(indexer_topk(*args, k=K, compress_ratio=RATIO, backend=backend, interpret=testing.INTERPRET))
    b = int(np.argmax(N_VISIBLE))
    np.testing.assert_array_equal(picks[b], np.arange(K))


def test_signed_zeros_are_ties():
    # lax.top_k alone ranks +0.0 above -0.0; topk_from_scores must treat them as one value.
    scores = jnp.asarray([[-0.0, 0.0, 1.0, 0.0, -0.0]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(topk_from_scores(scores, 5)), [[2, 0, 1, 3, 4]])


def test_topk_from_scores_masks_and_pads():
    scores = jnp.asarray([[1.0, -jnp.inf, 3.0], [-jnp.inf] * 3], jnp.float32)
    np.testing.assert_array_equal(np.asarray(topk_from_scores(scores, 5)), [[2, 0, -1, -1, -1], [-1] * 5])


def test_auto_backend_matches_oracle():  # the reference on CPU, the kernel on GPU/TPU
    args, dense = make_case(5, np.float32)
    np.testing.assert_array_equal(
        np.asarray(indexer_topk(*args, k=K, compress_ratio=RATIO)), oracle_topk(oracle_scores(args, dense), K)
    )


def _valid_args():
    return [
        jnp.zeros((2, 4, 16)),
        jnp.zeros((2, 4)),
        jnp.zeros((8, 4, 16)),
        jnp.zeros((2, 3), jnp.int32),
        jnp.zeros((2,), jnp.int32),
        jnp.zeros((2,), jnp.int32),
    ]


@pytest.mark.parametrize(
    "index, value, match",
    [
        (0, jnp.zeros((2, 16)), r"q_idx.shape=\(2, 16\) must have rank 3"),
        (1, jnp.zeros((2, 5)), r"weights.shape=\(2, 5\).*must be 4"),
        (2, jnp.zeros((8, 4, 8)), r"index_pool.shape=\(8, 4, 8\).*must be 16"),
        (2, jnp.zeros((8, 4, 16), jnp.bfloat16), r"index_pool.dtype=bfloat16 must equal q_idx.dtype"),
        (3, jnp.zeros((2, 3), jnp.float32), r"index_page_table.dtype=float32"),
        (5, jnp.zeros((3,), jnp.int32), r"n_entries.shape=\(3,\).*must be 2"),
    ],
)
def test_validation_errors(index, value, match):
    args = _valid_args()
    args[index] = value
    with pytest.raises(ValueError, match=match):
        indexer_topk(*args, k=4, compress_ratio=RATIO)


def test_k_must_be_positive():
    with pytest.raises(ValueError, match=r"k=0 must be in \[1, inf\]"):
        indexer_topk(*_valid_args(), k=0, compress_ratio=RATIO)
