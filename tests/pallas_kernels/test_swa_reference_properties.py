"""Property test of the sliding-window reference against the float64 oracle (needs hypothesis)."""

import jax.numpy as jnp
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")

from pallas_kernels import testing  # noqa: E402
from pallas_kernels.swa_decode import swa_decode_attention_reference  # noqa: E402

HEADS, HEAD_DIM, PAGE_SIZE, PAGES_PER_SEQ, NUM_PAGES = 4, 32, 4, 6, 40


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
    lengths=st.lists(st.integers(0, PAGES_PER_SEQ * PAGE_SIZE), min_size=4, max_size=4),
    window=st.sampled_from([1, 4, 7, 9]),
    seed=st.integers(0, 2**31 - 1),
    with_sinks=st.booleans(),
)
def test_reference_matches_oracle(lengths, window, seed, with_sinks):
    lengths = np.array(lengths, np.int32)
    case = testing.window_case(
        np.random.default_rng(seed),
        np.float32,
        lengths,
        heads=HEADS,
        head_dim=HEAD_DIM,
        page_size=PAGE_SIZE,
        window=window,
        pages_per_seq=PAGES_PER_SEQ,
        num_pages=NUM_PAGES,
        with_sinks=with_sinks,
    )
    oracle = testing.oracle_batch(case["q"], case["window_rows"], case["sinks"], HEAD_DIM**-0.5)
    args = [
        None if case[n] is None else jnp.asarray(case[n])
        for n in ("q", "window_pool", "window_page_table", "lengths", "sinks")
    ]
    out = swa_decode_attention_reference(*args, window=window)
    np.testing.assert_allclose(np.asarray(out), oracle, **testing.TOLERANCES["float32"])
