"""CSA decode attention (window + top-k selected compressed entries, one softmax with sinks)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import testing
from pallas_kernels.csa_decode import csa_decode_attention, csa_decode_attention_reference

HEADS, HEAD_DIM, PAGE_SIZE, WINDOW, PAGES_PER_SEQ, NUM_PAGES = 4, 32, 4, 6, 8, 48
RATIO, C_PAGE_SIZE, C_PAGES_PER_SEQ, C_NUM_PAGES = 2, 2, 8, 64  # capacity 16 entries
K = 5  # not a multiple of any kernel block: exercises the -1 padding
LENGTHS = np.array([0, 1, 7, 12, 20, 32], np.int32)
N_COMPRESSED = np.array([0, 0, 3, 9, 10, 16], np.int32)  # 9 > 12 // 2: entries 6..8 not visible
BACKENDS = list(testing.KERNEL_BACKENDS)
DTYPES = [np.float32, "bfloat16"]


def make_indices(rng):
    """Random picks per sequence: distinct visible entries, -1s, and invisible (stale) indices."""
    n_visible = np.minimum(N_COMPRESSED, LENGTHS // RATIO)
    indices = np.full((len(LENGTHS), K), -1, np.int32)
    for b, n in enumerate(n_visible):
        picks = list(rng.permutation(n)[: rng.integers(0, min(n, K) + 1)])
        if b == 3:  # written but causally invisible: must be skipped like -1
            picks = picks[: K - 2] + [7, 100]
        indices[b, : len(picks)] = picks
        indices[b] = rng.permutation(indices[b])
    return indices, n_visible


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
    indices, n_visible = make_indices(rng)
    picked = [indices[b][(indices[b] >= 0) & (indices[b] < n_visible[b])] for b in range(len(LENGTHS))]
    comp = testing.entry_case(
        rng,
        dtype,
        picked,
        N_COMPRESSED,
        dim=HEAD_DIM,
        page_size=C_PAGE_SIZE,
        pages_per_seq=C_PAGES_PER_SEQ,
        num_pages=C_NUM_PAGES,
    )
    rows = [np.concatenate([win["window_rows"][b], comp["dense"][b, picked[b]]]) for b in range(len(LENGTHS))]
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
        indices,
    )
    args = tuple(None if a is None else jnp.asarray(a) for a in arrays)
    return args, oracle


def _run(args, **kw):
    return csa_decode_attention(*args, window=WINDOW, compress_ratio=RATIO, **kw)


def test_case_has_invalid_picks():
    args, _ = make_case(0, np.float32)
    indices = np.asarray(args[8])
    assert (indices == -1).any() and (indices >= 100).any() and (indices >= 0).sum() > 5


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_oracle(dtype):
    args, oracle = make_case(0, dtype)
    out = csa_decode_attention_reference(*args, window=WINDOW, compress_ratio=RATIO)
    testing.assert_reference_output(out, oracle, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [1, 2])
def test_kernel_matches_reference_and_reads_only_selected_entries(backend, dtype, seed):
    # Every compressed entry that is not a valid pick is NaN and pages without picks are unallocated
    # (-1): reading a -1 pick, a stale pick or any unselected entry would show up as NaN or an error.
    args, oracle = make_case(seed, dtype)
    out = _run(args, backend=backend, interpret=testing.INTERPRET)
    ref = csa_decode_attention_reference(*args, window=WINDOW, compress_ratio=RATIO)
    testing.assert_kernel_output(out, ref, oracle, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_invalid_picks_equal_window_only_attention(backend):
    from pallas_kernels.swa_decode import swa_decode_attention_reference

    args, _ = make_case(3, np.float32)
    args = args[:8] + (jnp.full_like(args[8], -1),)
    out = _run(args, backend=backend, interpret=testing.INTERPRET)
    swa = swa_decode_attention_reference(*args[:5], window=WINDOW)
    np.testing.assert_allclose(np.asarray(out), np.asarray(swa), **testing.tolerance(np.float32))


def test_no_sinks_on_gpu_kernel():
    args, oracle = make_case(4, np.float32, with_sinks=False)
    out = np.asarray(_run(args, backend=BACKENDS[0], interpret=testing.INTERPRET))
    np.testing.assert_allclose(out, oracle, **testing.tolerance(np.float32))


def test_auto_backend_matches_oracle():  # the reference on CPU, the kernel on GPU/TPU
    args, oracle = make_case(5, np.float32)
    np.testing.assert_allclose(np.asarray(_run(args)), oracle, **testing.tolerance(np.float32))


@pytest.mark.parametrize(
    "value, match",
    [
        (jnp.zeros((2, 5), jnp.float32), r"topk_indices.dtype=float32"),
        (jnp.zeros((5,), jnp.int32), r"topk_indices.shape=\(5,\) must have rank 2"),
        (jnp.zeros((3, 5), jnp.int32), r"topk_indices.shape=\(3, 5\).*must be 2"),
    ],
)
def test_validation_errors(value, match):
    with pytest.raises(ValueError, match=match):
        csa_decode_attention(*testing.compressed_decode_args(), value, window=6, compress_ratio=RATIO)
