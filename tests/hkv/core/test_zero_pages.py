"""`transitions.zero_pages`: the pages `reserve` maps are cleared in every layer, nothing else is touched."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hkv.core import transitions as tr


def test_zero_pages_clears_exactly_the_needed_pages_in_every_layer():
    rng = np.random.default_rng(0)
    pool = jnp.asarray(rng.normal(size=(3, 10, 4, 5)) + 2.0, jnp.float32)  # no zero anywhere
    pages = jnp.asarray([7, -1, 2, 9, 4, 3], jnp.int32)
    need = jnp.asarray([True, False, True, False, False, True])
    out = np.asarray(jax.jit(tr.zero_pages)(pool, pages, need))
    want = np.asarray(pool).copy()
    want[:, [7, 2, 3]] = 0
    np.testing.assert_array_equal(out, want)


def test_zero_pages_with_nothing_needed_returns_the_pool_unchanged():
    pool = jnp.arange(2 * 6 * 2 * 3, dtype=jnp.float32).reshape(2, 6, 2, 3) + 1
    out = jax.jit(tr.zero_pages)(pool, jnp.asarray([0, 1, 2], jnp.int32), jnp.zeros((3,), bool))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(pool))
