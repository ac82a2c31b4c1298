"""paged_gather: Pallas kernels (GPU/Triton and TPU/Mosaic, interpreted) against the jnp reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import testing
from pallas_kernels.gather import paged_gather, paged_gather_reference

PAGE_SIZE, DIM, PAGES_PER_SEQ, NUM_PAGES = 4, 16, 5, 24
LENGTHS = np.array([0, 1, 4, 9, 20], np.int32)  # empty, one row, one full page, straddling, full


def _case(seed, dtype):
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((len(LENGTHS), PAGES_PER_SEQ * PAGE_SIZE, DIM)).astype(dtype)
    pool, page_table = testing.page_rows(
        dense, LENGTHS, page_size=PAGE_SIZE, pages_per_seq=PAGES_PER_SEQ, num_pages=NUM_PAGES, rng=rng
    )
    expected = np.where(np.arange(dense.shape[1])[None, :, None] < LENGTHS[:, None, None], dense, 0)
    return jnp.asarray(pool), jnp.asarray(page_table), jnp.asarray(LENGTHS), expected


def test_reference_matches_dense_rows():
    pool, page_table, lengths, expected = _case(0, np.float32)
    out = paged_gather_reference(pool, page_table, lengths)
    np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.parametrize("backend", testing.KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("seed", [1, 2])
def test_kernel_matches_reference_exactly(backend, dtype, seed):
    # Free pages and the tail rows of last pages are NaN, and unallocated page-table entries are -1:
    # a copy that read anything past the length would put NaN (or fail, in the TPU interpreter).
    pool, page_table, lengths, expected = _case(seed, dtype)
    out = paged_gather(pool, page_table, lengths, backend=backend, interpret=testing.INTERPRET)
    assert out.dtype == pool.dtype and out.shape == expected.shape
    np.testing.assert_array_equal(np.asarray(out), expected)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(paged_gather_reference(pool, page_table, lengths)))


def test_auto_backend_matches_oracle():  # the reference on CPU, the kernel on GPU/TPU
    pool, page_table, lengths, expected = _case(3, np.float32)
    np.testing.assert_array_equal(np.asarray(paged_gather(pool, page_table, lengths)), expected)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(pool=jnp.zeros((4, 16))), r"pool.shape=\(4, 16\) must have rank 3"),
        (dict(pool=jnp.zeros((4, 4, 16), jnp.int32)), r"pool.dtype=int32 must be one of"),
        (dict(page_table=jnp.zeros((5, 2), jnp.float32)), r"page_table.dtype=float32"),
        (dict(page_table=jnp.zeros((3, 2), jnp.int32)), r"page_table.shape=\(3, 2\).*must be 5"),
        (dict(lengths=jnp.zeros((5, 1), jnp.int32)), r"lengths.shape=\(5, 1\) must have rank 1"),
        (dict(backend="cuda"), r"backend='cuda' must be one of"),
    ],
)
def test_validation_errors(bad, match):
    args = dict(pool=jnp.zeros((4, 4, 16)), page_table=jnp.zeros((5, 2), jnp.int32), lengths=jnp.zeros((5,), jnp.int32))
    backend = bad.pop("backend", None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        paged_gather(args["pool"], args["page_table"], args["lengths"], backend=backend)


def test_gpu_backend_rejects_non_power_of_two_rows():
    with pytest.raises(ValueError, match=r"dim=12 must be a power of two"):
        paged_gather(
            jnp.zeros((4, 4, 12)),
            jnp.zeros((2, 2), jnp.int32),
            jnp.zeros((2,), jnp.int32),
            backend="gpu",
            interpret=True,
        )
