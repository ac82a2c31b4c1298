"""Pools stacked over layers ([layers, pages, page_size, dim] + a layer index) read in place."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import testing

LAYERS, LAYER = 3, 1
BACKENDS = [*testing.KERNEL_BACKENDS, "reference"]


def stack(pool):
    """`pool` as layer LAYER of a stack whose other layers are NaN."""
    poison = np.full_like(pool, np.nan)
    return jnp.asarray(np.stack([pool if i == LAYER else poison for i in range(LAYERS)]))


def _csa_case(seed):
    rng = np.random.default_rng(seed)
    lengths = np.array([0, 9, 20], np.int32)
    win = testing.window_case(
        rng, np.float32, lengths, heads=4, head_dim=16, page_size=4, window=6, pages_per_seq=5, num_pages=20
    )
    picks = np.array([[-1, -1, -1], [0, -1, 2], [5, 1, 3]], np.int32)
    comp = testing.entry_case(
        rng,
        np.float32,
        [np.array([], int), np.array([0, 2]), np.array([1, 3, 5])],
        np.array([0, 4, 6]),
        dim=16,
        page_size=2,
        pages_per_seq=4,
        num_pages=16,
    )
    return win, comp, picks


@pytest.mark.parametrize("backend", BACKENDS)
def test_csa_and_swa_on_stacked_pools_equal_single_layer_pools(backend):
    win, comp, picks = _csa_case(0)
    kw = dict(backend=backend, interpret=testing.INTERPRET)
    common = (jnp.asarray(win["q"]),)
    flat = pk.csa_decode_attention(
        *common,
        jnp.asarray(win["window_pool"]),
        jnp.asarray(win["window_page_table"]),
        jnp.asarray(win["lengths"]),
        jnp.asarray(win["sinks"]),
        jnp.asarray(comp["pool"]),
        jnp.asarray(comp["page_table"]),
        jnp.asarray(comp["n_written"]),
        jnp.asarray(picks),
        window=6,
        compress_ratio=2,
        **kw,
    )

    @jax.jit
    def stacked(layer):  # a traced layer index, as in a scan over layers
        return pk.csa_decode_attention(
            *common,
            stack(win["window_pool"]),
            jnp.asarray(win["window_page_table"]),
            jnp.asarray(win["lengths"]),
            jnp.asarray(win["sinks"]),
            stack(comp["pool"]),
            jnp.asarray(comp["page_table"]),
            jnp.asarray(comp["n_written"]),
            jnp.asarray(picks),
            window=6,
            compress_ratio=2,
            window_layer=layer,
            compressed_layer=layer,
            **kw,
        )

    out = np.asarray(stacked(jnp.int32(LAYER)))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, np.asarray(flat), **testing.TOLERANCES["float32"])
    swa_flat = pk.swa_decode_attention(
        *common,
        jnp.asarray(win["window_pool"]),
        jnp.asarray(win["window_page_table"]),
        jnp.asarray(win["lengths"]),
        jnp.asarray(win["sinks"]),
        window=6,
        **kw,
    )
    swa_stacked = pk.swa_decode_attention(
        *common,
        stack(win["window_pool"]),
        jnp.asarray(win["window_page_table"]),
        jnp.asarray(win["lengths"]),
        jnp.asarray(win["sinks"]),
        window=6,
        window_layer=LAYER,
        **kw,
    )
    np.testing.assert_allclose(np.asarray(swa_stacked), np.asarray(swa_flat), **testing.TOLERANCES["float32"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_hca_gather_and_indexer_on_stacked_pools(backend):
    win, _, _ = _csa_case(1)
    kw = dict(backend=backend, interpret=testing.INTERPRET)
    full = testing.entry_case(
        np.random.default_rng(2),
        np.float32,
        [np.arange(n) for n in (0, 4, 6)],
        np.array([0, 4, 6]),
        dim=16,
        page_size=2,
        pages_per_seq=4,
        num_pages=16,
    )
    lengths = jnp.asarray(win["lengths"])
    args = (
        jnp.asarray(win["q"]),
        jnp.asarray(win["window_pool"]),
        jnp.asarray(win["window_page_table"]),
        lengths,
        jnp.asarray(win["sinks"]),
    )
    stacked_args = (args[0], stack(win["window_pool"])) + args[2:]
    hca = [
        pk.hca_decode_attention(
            *a,
            pool,
            jnp.asarray(full["page_table"]),
            jnp.asarray(full["n_written"]),
            window=6,
            compress_ratio=2,
            **layers,
            **kw,
        )
        for a, pool, layers in [
            (args, jnp.asarray(full["pool"]), {}),
            (stacked_args, stack(full["pool"]), dict(window_layer=LAYER, compressed_layer=LAYER)),
        ]
    ]
    np.testing.assert_allclose(np.asarray(hca[1]), np.asarray(hca[0]), **testing.TOLERANCES["float32"])

    gathered = [
        pk.paged_gather(pool, jnp.asarray(full["page_table"]), jnp.asarray(full["n_written"]), **layers, **kw)
        for pool, layers in [(jnp.asarray(full["pool"]), {}), (stack(full["pool"]), dict(layer=LAYER))]
    ]
    np.testing.assert_array_equal(np.asarray(gathered[1]), np.asarray(gathered[0]))

    q_idx = jnp.asarray(np.random.default_rng(3).standard_normal((3, 4, 16)), jnp.float32)
    w = jnp.ones((3, 4), jnp.float32)
    picks = [
        pk.indexer_topk(
            q_idx,
            w,
            pool,
            jnp.asarray(full["page_table"]),
            lengths,
            jnp.asarray(full["n_written"]),
            k=3,
            compress_ratio=2,
            **layers,
            **kw,
        )
        for pool, layers in [(jnp.asarray(full["pool"]), {}), (stack(full["pool"]), dict(index_layer=LAYER))]
    ]
    np.testing.assert_array_equal(np.asarray(picks[1]), np.asarray(picks[0]))


def test_layer_argument_validation():
    q, lengths, table = jnp.zeros((2, 4, 16)), jnp.zeros((2,), jnp.int32), jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match=r"window_layer=None: window_pool.shape=\(3, 8, 4, 16\) is stacked"):
        pk.swa_decode_attention(q, jnp.zeros((3, 8, 4, 16)), table, lengths, None, window=6)
    with pytest.raises(ValueError, match=r"window_layer=.* must be None: window_pool.shape=\(8, 4, 16\)"):
        pk.swa_decode_attention(q, jnp.zeros((8, 4, 16)), table, lengths, None, window=6, window_layer=0)
    with pytest.raises(ValueError, match=r"window_layer=.* must be a Python int or an integer scalar"):
        pk.swa_decode_attention(
            q, jnp.zeros((3, 8, 4, 16)), table, lengths, None, window=6, window_layer=jnp.zeros((2,), jnp.int32)
        )
    with pytest.raises(ValueError, match=r"pool.shape=\(8, 16\) must have rank 3 or 4"):
        pk.paged_gather(jnp.zeros((8, 16)), table, lengths)
