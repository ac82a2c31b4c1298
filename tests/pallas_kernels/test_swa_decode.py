"""Sliding-window decode attention: kernels (interpreted) vs the jnp reference vs a float64 oracle."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import testing
from pallas_kernels.swa_decode import swa_decode_attention, swa_decode_attention_reference

HEADS, HEAD_DIM, PAGE_SIZE, WINDOW, PAGES_PER_SEQ, NUM_PAGES = 4, 32, 4, 7, 6, 40
# Empty slot, first token, shorter than the window, exactly the window, window straddling two and
# three pages, full capacity.
LENGTHS = np.array([0, 1, 5, 7, 10, 13, 24], np.int32)
BACKENDS = list(testing.KERNEL_BACKENDS)
DTYPES = [np.float32, jnp.bfloat16]


def make_case(seed, dtype, lengths=LENGTHS, *, poison_outside_window=False, with_sinks=True):
    """Random q, sinks and a randomly paged window pool; returns jnp inputs and the f64 oracle."""
    case = testing.window_case(
        np.random.default_rng(seed),
        dtype,
        lengths,
        heads=HEADS,
        head_dim=HEAD_DIM,
        page_size=PAGE_SIZE,
        window=WINDOW,
        pages_per_seq=PAGES_PER_SEQ,
        num_pages=NUM_PAGES,
        poison_outside_window=poison_outside_window,
        with_sinks=with_sinks,
    )
    oracle = testing.oracle_batch(case["q"], case["window_rows"], case["sinks"], HEAD_DIM**-0.5)
    args = tuple(
        None if case[n] is None else jnp.asarray(case[n])
        for n in ("q", "window_pool", "window_page_table", "lengths", "sinks")
    )
    return args, oracle


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_oracle_per_dtype(dtype):
    args, oracle = make_case(0, dtype)
    out = swa_decode_attention_reference(*args, window=WINDOW)
    testing.assert_reference_output(out, oracle, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [1, 2])
def test_kernel_matches_reference(backend, dtype, seed):
    args, oracle = make_case(seed, dtype)
    out = swa_decode_attention(*args, window=WINDOW, backend=backend, interpret=testing.INTERPRET)
    ref = swa_decode_attention_reference(*args, window=WINDOW)
    testing.assert_kernel_output(out, ref, oracle, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_and_pages_outside_the_window_are_never_read(backend):
    args, oracle = make_case(3, np.float32, poison_outside_window=True)
    assert np.isnan(np.asarray(args[1])).any()  # the poison is really there
    out = np.asarray(swa_decode_attention(*args, window=WINDOW, backend=backend, interpret=testing.INTERPRET))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, oracle, **testing.tolerance(np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_page_table_equals_full_page_table(backend):
    args, oracle = make_case(4, np.float32)
    q, pool, page_table, lengths, sinks = args
    ring = -(-(WINDOW - 1) // PAGE_SIZE) + 1  # the minimum the public function accepts
    ring_table = testing.ring_page_table(np.asarray(page_table), LENGTHS, page_size=PAGE_SIZE, ring=ring)
    out = swa_decode_attention(
        q, pool, jnp.asarray(ring_table), lengths, sinks, window=WINDOW, backend=backend, interpret=testing.INTERPRET
    )
    np.testing.assert_allclose(np.asarray(out), oracle, **testing.tolerance(np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_sinks_and_empty_slots(backend):
    args, oracle = make_case(5, np.float32, with_sinks=False)
    out = np.asarray(swa_decode_attention(*args, window=WINDOW, backend=backend, interpret=testing.INTERPRET))
    np.testing.assert_allclose(out, oracle, **testing.tolerance(np.float32))
    np.testing.assert_array_equal(out[LENGTHS == 0], 0.0)  # an empty slot gets zeros, not NaN


def test_sinks_change_the_result():
    # Guards against a kernel that ignores sinks: a large sink takes most of the probability mass.
    args, _ = make_case(6, np.float32)
    q, pool, page_table, lengths, sinks = args
    without = swa_decode_attention(
        q, pool, page_table, lengths, None, window=WINDOW, backend=BACKENDS[0], interpret=testing.INTERPRET
    )
    with_big = swa_decode_attention(
        q, pool, page_table, lengths, sinks + 30.0, window=WINDOW, backend=BACKENDS[0], interpret=testing.INTERPRET
    )
    live = LENGTHS > 0
    assert np.abs(np.asarray(with_big)[live]).max() < 1e-6 * np.abs(np.asarray(without)[live]).max()


def test_auto_backend_matches_oracle():  # the reference on CPU, the kernel on GPU/TPU
    args, oracle = make_case(7, np.float32)
    np.testing.assert_allclose(
        np.asarray(swa_decode_attention(*args, window=WINDOW)), oracle, **testing.tolerance(np.float32)
    )


def _valid_args():
    return dict(
        q=jnp.zeros((2, 4, 32)),
        window_pool=jnp.zeros((8, 4, 32)),
        window_page_table=jnp.zeros((2, 3), jnp.int32),
        lengths=jnp.zeros((2,), jnp.int32),
        sinks=jnp.zeros((4,), jnp.float32),
    )


@pytest.mark.parametrize(
    "bad, window, match",
    [
        (dict(q=jnp.zeros((2, 32))), 7, r"q.shape=\(2, 32\) must have rank 3"),
        (
            dict(window_pool=jnp.zeros((8, 4, 32), jnp.bfloat16)),
            7,
            r"window_pool.dtype=bfloat16 must equal q.dtype=float32",
        ),
        (dict(window_pool=jnp.zeros((8, 4, 16))), 7, r"window_pool.shape=\(8, 4, 16\).*must be 32"),
        (dict(lengths=jnp.zeros((3,), jnp.int32)), 7, r"lengths.shape=\(3,\).*must be 2"),
        (dict(lengths=jnp.zeros((2,), jnp.float32)), 7, r"lengths.dtype=float32"),
        (dict(sinks=jnp.zeros((5,), jnp.float32)), 7, r"sinks.shape=\(5,\).*must be 4"),
        (dict(sinks=jnp.zeros((4,), jnp.bfloat16)), 7, r"sinks.dtype=bfloat16"),
        (dict(), 0, r"window=0 must be in \[1, inf\]"),
        (dict(), 10, r"window_page_table.shape=\(2, 3\) must have at least 4 pages"),
    ],
)
def test_validation_errors(bad, window, match):
    args = _valid_args()
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        swa_decode_attention(*args.values(), window=window)


def test_scale_must_be_positive():
    with pytest.raises(ValueError, match=r"scale=-1.0 must be None"):
        swa_decode_attention(*_valid_args().values(), window=7, scale=-1.0)
