"""Random toy hybrid specs (windowed, full and compressed layers; windows 2..12, ratios 2/4, blocks 4/8/16,
1-2 KV heads): a restore by every route the spec allows equals the cold run, and a spec with a
full-attention layer never takes the window-rebuild route (`hkv.testing.check_model`)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from hkv.testing import check_model
from models import toy

window = st.integers(2, 12)
layer = st.one_of(
    st.builds(toy.Attn, window=window, num_kv_heads=st.sampled_from([1, 2])),
    st.builds(toy.Attn, window=st.none(), num_kv_heads=st.sampled_from([1, 2])),
    st.builds(toy.Compressed, ratio=st.sampled_from([2, 4]), window=window, topk=st.sampled_from([None, 1, 2])),
)
specs = st.tuples(st.lists(layer, min_size=1, max_size=3), st.sampled_from([4, 8, 16]))


def _check(layers, block_tokens):
    model = toy.init(toy.ToyConfig(layers=tuple(layers), hidden=16, head_dim=4), seed=1)
    report = check_model(model, block_tokens=block_tokens, chunk_sizes=(block_tokens,), new_tokens=2)
    has_full = any(isinstance(k, toy.Attn) and k.window is None for k in layers)
    assert ("window" in report.routes) is (not has_full)  # rebuilt exactly when every layer is windowed
    assert ("window_refused" in report.routes) is has_full
    assert "snapshot" in report.routes and "disk" in report.routes


COMMON = dict(
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
    database=None,
    phases=(Phase.explicit, Phase.generate),
)  # no shrinking: each example compiles engines


# `make test` runs random specs through tests/hkv/test_numerical_contract.py (in both dtypes, with the
# same route checks); these 25, with blocks of 4 and 8 tokens too, run in `make test-slow`.
@pytest.mark.slow
@settings(max_examples=25, **COMMON)
@given(specs)
def test_random_specs_restore_exactly_many(spec):
    _check(*spec)
