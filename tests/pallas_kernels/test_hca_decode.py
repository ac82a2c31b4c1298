"""HCA decode attention (window + all visible compressed entries, one softmax with sinks)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import testing
from pallas_kernels.hca_decode import hca_decode_attention, hca_decode_attention_reference

HEADS, HEAD_DIM, PAGE_SIZE, WINDOW, PAGES_PER_SEQ, NUM_PAGES = 4, 32, 4, 6, 8, 48
RATIO, C_PAGE_SIZE, C_PAGES_PER_SEQ, C_NUM_PAGES = 3, 2, 4, 40  # capacity 8 entries
# Per sequence: (length, entries written). Empty slot; first token; before the first entry; count
# equal to the causal limit; count ahead of the causal limit (must be clamped to length // m);
# count behind it (entries not written yet); count past the capacity (clamped to 8).
CASES = [(0, 0), (1, 0), (2, 0), (9, 3), (10, 5), (17, 2), (32, 12)]
LENGTHS = np.array([c[0] for c in CASES], np.int32)
N_COMPRESSED = np.array([c[1] for c in CASES], np.int32)
BACKENDS = list(testing.KERNEL_BACKENDS)
DTYPES = [np.float32, "bfloat16"]


def make_case(seed, dtype, *, with_sinks=True):
    dtype = jnp.dtype(dtype)
    rng = np.random.default_rng(seed)
    win = testing.window_case(
        rng,
        dtype,
        LENGTHS,
        heads=HEADS,
        head_dim=HEAD_DIM,
        page_size=PAGE_SIZE,
        window=WINDOW,
        pages_per_seq=PAGES_PER_SEQ,
        num_pages=NUM_PAGES,
        with_sinks=with_sinks,
    )
    capacity = C_PAGES_PER_SEQ * C_PAGE_SIZE
    n_visible = np.minimum(np.minimum(N_COMPRESSED, LENGTHS // RATIO), capacity)
    comp = testing.entry_case(
        rng,
        dtype,
        [np.arange(n) for n in n_visible],
        np.minimum(N_COMPRESSED, capacity),
        dim=HEAD_DIM,
        page_size=C_PAGE_SIZE,
        pages_per_seq=C_PAGES_PER_SEQ,
        num_pages=C_NUM_PAGES,
    )
    rows = [np.concatenate([win["window_rows"][b], comp["dense"][b, : n_visible[b]]]) for b in range(len(LENGTHS))]
    oracle = testing.oracle_batch(win["q"], rows, win["sinks"], HEAD_DIM**-0.5)
    arrays = (
        win["q"],
        win["window_pool"],
        win["window_page_table"],
        LENGTHS,
        win["sinks"],
        comp["pool"],
        comp["page_table"],
        N_COMPRESSED,
    )
    args = tuple(None if a is None else jnp.asarray(a) for a in arrays)
    return args, oracle


def _run(args, **kw):
    return hca_decode_attention(*args, window=WINDOW, compress_ratio=RATIO, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_oracle(dtype):
    args, oracle = make_case(0, dtype)
    out = hca_decode_attention_reference(*args, window=WINDOW, compress_ratio=RATIO)
    testing.assert_reference_output(out, oracle, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [1, 2])
def test_kernel_matches_reference_and_reads_only_visible_rows(backend, dtype, seed):
    # Out-of-window rows, entries past the visible count and unallocated (-1) pages are all poison.
    args, oracle = make_case(seed, dtype)
    out = _run(args, backend=backend, interpret=testing.INTERPRET)
    ref = hca_decode_attention_reference(*args, window=WINDOW, compress_ratio=RATIO)
    testing.assert_kernel_output(out, ref, oracle, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_sinks(backend):
    args, oracle = make_case(3, np.float32, with_sinks=False)
    out = np.asarray(_run(args, backend=backend, interpret=testing.INTERPRET))
    np.testing.assert_allclose(out, oracle, **testing.tolerance(np.float32))
    np.testing.assert_array_equal(out[LENGTHS == 0], 0.0)


def test_compressed_entries_join_the_same_softmax():
    # With the compressed entries dropped (count 0) the answer must differ for rows that have them:
    # guards against a kernel that ignores the compressed pool.
    args, _ = make_case(4, np.float32)
    with_entries = np.asarray(_run(args, backend=BACKENDS[0], interpret=testing.INTERPRET))
    without = np.asarray(_run(args[:7] + (jnp.zeros_like(args[7]),), backend=BACKENDS[0], interpret=testing.INTERPRET))
    has_entries = np.minimum(N_COMPRESSED, LENGTHS // RATIO) > 0
    assert np.abs(with_entries - without)[has_entries].max(axis=(1, 2)).min() > 1e-3
    np.testing.assert_array_equal(with_entries[~has_entries], without[~has_entries])


def test_auto_backend_matches_oracle():  # the reference on CPU, the kernel on GPU/TPU
    args, oracle = make_case(5, np.float32)
    np.testing.assert_allclose(np.asarray(_run(args)), oracle, **testing.tolerance(np.float32))


@pytest.mark.parametrize(
    "index, value, match",
    [
        (5, jnp.zeros((8, 2, 32), jnp.bfloat16), r"compressed_pool.dtype=bfloat16 must equal q.dtype"),
        (5, jnp.zeros((8, 2, 16)), r"compressed_pool.shape=\(8, 2, 16\).*must be 32"),
        (6, jnp.zeros((3, 4), jnp.int32), r"compressed_page_table.shape=\(3, 4\).*must be 2"),
        (7, jnp.zeros((2, 1), jnp.int32), r"n_compressed.shape=\(2, 1\) must have rank 1"),
        (7, jnp.zeros((2,), jnp.float32), r"n_compressed.dtype=float32"),
    ],
)
def test_validation_errors(index, value, match):
    args = testing.compressed_decode_args()
    args[index] = value
    with pytest.raises(ValueError, match=match):
        hca_decode_attention(*args, window=6, compress_ratio=RATIO)


def test_compress_ratio_must_be_positive():
    with pytest.raises(ValueError, match=r"compress_ratio=0 must be in \[1, inf\]"):
        hca_decode_attention(*testing.compressed_decode_args(), window=6, compress_ratio=0)
