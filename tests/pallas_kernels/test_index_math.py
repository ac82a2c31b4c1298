"""`pallas_kernels.index_math`: floor division, remainder and row gathers on indices known to be >= 0,
equal to Python's `//`, `%` and `jnp.take_along_axis` there, in fewer HLO ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import index_math as im

DIVISORS = [1, 2, 3, 4, 7, 16, 128, 1000]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=16), st.sampled_from(DIVISORS))
def test_div_and_rem_equal_python_floor_division_on_nonnegative_ints(values, m):
    x = np.asarray(values, np.int32)
    np.testing.assert_array_equal(np.asarray(im.div(jnp.asarray(x), m)), x // m)
    np.testing.assert_array_equal(np.asarray(im.rem(jnp.asarray(x), m)), x % m)
    assert im.div(jnp.asarray(x), m).dtype == jnp.int32 and im.rem(jnp.asarray(x), m).dtype == jnp.int32


@pytest.mark.parametrize("m", [0, -4, 2.0, True])
def test_a_divisor_that_is_not_a_positive_int_is_refused(m):
    with pytest.raises(ValueError, match=r"divisor m=.* must be a Python int >= 1"):
        im.div(jnp.arange(4), m)
    with pytest.raises(ValueError, match=r"divisor m=.* must be a Python int >= 1"):
        im.rem(jnp.arange(4), m)


def test_a_power_of_two_divides_without_floor_division_sign_corrections():
    """What the module is for: a power of two is one shift / one mask, no sign or select ops."""
    for fn in (lambda x: im.div(x, 16), lambda x: im.rem(x, 16)):
        text = jax.jit(fn).lower(jnp.arange(8, dtype=jnp.int32)).as_text()
        assert "stablehlo.sign" not in text and "stablehlo.select" not in text
        assert ("shift_right_arithmetic" in text) or ("stablehlo.and" in text)
    floor = jax.jit(lambda x: x // 16).lower(jnp.arange(8, dtype=jnp.int32)).as_text()
    assert "stablehlo.sign" in floor  # jnp's // on signed ints: the correction index_math avoids


def test_take_rows_equals_take_along_axis_for_in_bounds_indices():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 9, 5)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, 9, size=(3, 4)), jnp.int32)
    want = jnp.take_along_axis(x, idx[..., None], axis=1)
    np.testing.assert_array_equal(np.asarray(im.take_rows(x, idx)), np.asarray(want))
    table = jnp.asarray(rng.integers(-1, 50, size=(3, 6)), jnp.int32)  # a page table: 2-D, any values
    logical = jnp.asarray(rng.integers(0, 6, size=(3, 7)), jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(im.take_rows(table, logical)), np.take_along_axis(np.asarray(table), np.asarray(logical), 1)
    )


def test_take_equals_indexing_for_in_bounds_indices_in_one_gather():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.integers(-1, 50, size=(7, 5)), jnp.int32)  # e.g. a page table [slots, M]
    idx = jnp.asarray(rng.integers(0, 7, size=(4,)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(im.take(x, idx)), np.asarray(x)[np.asarray(idx)])
    np.testing.assert_array_equal(np.asarray(im.take(x[:, 0], idx)), np.asarray(x)[np.asarray(idx), 0])
    text = jax.jit(im.take).lower(x, idx).as_text()
    assert text.count('"stablehlo.gather"(') == 1 and "stablehlo.select" not in text  # no wrap / fill masks
    wrapped = jax.jit(lambda a, i: a[i]).lower(x, idx).as_text()
    assert "stablehlo.select" in wrapped  # plain indexing: the negative-index wrap `take` avoids
