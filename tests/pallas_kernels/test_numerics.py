"""The batch-invariant building blocks (`pallas_kernels.numerics`): each gives the same bits for a row
whatever else the call holds. These are the measured properties of XLA:CPU the numerical contract
rests on; a jaxlib that breaks one fails here, by name, before any model test does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from hkv.core.layers import sequence_attention
from pallas_kernels import numerics as nm

DTYPES = [jnp.float32, jnp.bfloat16]
RNG = np.random.default_rng(0)


def _f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("k,n", [(64, 128), (256, 384), (512, 1024), (128, 8), (256, 1024), (1024, 256)])
def test_linear_rows_do_not_change_a_row(dtype, k, n):
    """A row of `linear` is the same bits for 1..100 rows, 3-D inputs and 1000 rows."""
    x = jnp.asarray(RNG.normal(0, 1, (1000, k)), dtype)
    w = jnp.asarray(RNG.normal(0, 0.05, (n, k)), dtype)
    f = nm.jit(nm.linear)
    full = _f32(f(x, w))
    for rows in (1, 2, 3, 7, 16, 33, 63, 64, 100):
        np.testing.assert_array_equal(_f32(f(x[:rows], w)), full[:rows], err_msg=f"{rows} rows")
    np.testing.assert_array_equal(_f32(f(x[:96].reshape(6, 16, k), w)).reshape(96, n), full[:96])


@pytest.mark.parametrize("k,n", [(256, 1024), (1024, 256), (64, 128)])
def test_matmul_rows_do_not_change_a_row_in_float32(k, n):
    """`matmul` (w [K, N], not transposed) keeps a row's bits for 1..1000 rows, where the row plan cuts
    large products into blocks (K=256, N=1024 at jaxlib 0.10.2: small-row kernels up to 50 rows)."""
    x = jnp.asarray(RNG.normal(0, 1, (1000, k)), jnp.float32)
    w = jnp.asarray(RNG.normal(0, 0.05, (k, n)), jnp.float32)
    f = nm.jit(nm.matmul)
    full = _f32(f(x, w))
    for rows in (1, 2, 5, 31, 32, 33, 64, 65, 300):
        np.testing.assert_array_equal(_f32(f(x[:rows], w)), full[:rows], err_msg=f"{rows} rows")


def test_row_plan_is_measured_per_shape_on_cpu_and_pads_elsewhere():
    """On CPU a float32 shape whose small-row kernels stop agreeing with larger counts gets a block of
    8..32 rows (or none when every count agrees); other backends pad to FALLBACK_ROWS."""
    from pallas_kernels import matmul_rows

    plan = matmul_rows.row_plan(256, 1024, "cpu")
    assert plan.floor == 2 and (plan.block is None or 8 <= plan.block <= 32)
    assert matmul_rows.row_plan(256, 1024, "cpu") is plan  # measured once per shape
    assert matmul_rows.row_plan(256, 1024, "gpu") == matmul_rows.RowPlan(None, matmul_rows.FALLBACK_ROWS)
    with pytest.raises(ValueError, match="k=0"):
        matmul_rows.row_plan(0, 8)


@pytest.mark.parametrize("k,n", [(256, 128), (128, 256), (256, 1024)])
def test_tile_rows_floor_keeps_a_row_from_one_row_to_a_tile_in_float32(k, n):
    """A batched float32 product given `tile_rows_floor` rows at least (the MoE's experts: one row per token
    in decode, 64-row tiles in prefill) keeps each row's bits for every count up to the tile; the floor is
    2 where the probe found one order (a decode row is not padded to a tile), 64 where it did not."""
    from pallas_kernels import matmul_rows

    floor = nm.tile_rows_floor(jnp.float32, k, n, 64)
    assert floor in (2, nm.F32_MIN_ROWS)
    assert nm.tile_rows_floor(jnp.bfloat16, k, n, 64) == nm.MIN_ROWS
    assert matmul_rows.batched_floor(k, n, 64, "gpu") == nm.F32_MIN_ROWS
    a = jnp.asarray(RNG.normal(0, 1, (4, 64, k)), jnp.float32)
    b = jnp.asarray(RNG.normal(0, 0.05, (4, k, n)), jnp.float32)
    f = nm.jit(lambda a, b: nm.batched_matmul(a, b, rows_floor=floor))
    tile = _f32(f(a, b))
    for rows in (1, 2, 3, 8, 31, 64):
        np.testing.assert_array_equal(_f32(f(a[:, :rows], b)), tile[:, :rows], err_msg=f"{rows} rows")
    with pytest.raises(ValueError, match="rows=1"):
        matmul_rows.batched_floor(k, n, 1)


def test_tile_rows_floor_without_a_row_bound_keeps_a_row_from_one_row_to_many():
    """Rows without a bound (the indexer's queries: one in decode, a chunk's in prefill): the floor holds
    from 1 row to past the probed 512; an empty product needs no probe."""
    k, n = 32, 272
    floor = nm.tile_rows_floor(jnp.float32, k, n)
    assert floor in (2, nm.F32_MIN_ROWS)
    assert nm.tile_rows_floor(jnp.float32, k, 0) == nm.MIN_ROWS
    a = jnp.asarray(RNG.normal(0, 1, (2, 700, k)), jnp.float32)
    b = jnp.asarray(RNG.normal(0, 0.05, (2, k, n)), jnp.float32)
    f = nm.jit(lambda a, b: nm.batched_matmul(a, b, rows_floor=floor))
    full = _f32(f(a, b))
    for rows in (1, 2, 5, 64, 512):
        np.testing.assert_array_equal(_f32(f(a[:, :rows], b)), full[:, :rows], err_msg=f"{rows} rows")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_indexer_scores_keep_their_bits_whatever_the_entry_and_query_counts(dtype):
    """A query's indexer score of an entry is the same bits whether the keys end at the entries it sees
    (a prefill chunk's read bucket) or run on to a cache's capacity (a decode step), and whether it is
    scored alone (decode) or among a chunk's queries (prefill): the entry axis is cut into tiles of
    `INDEXER_TILE`, so no product's shape follows either count."""
    h, d, tile = 16, 32, nm.INDEXER_TILE
    q = jnp.asarray(RNG.normal(0, 1, (1, 40, h, d)), dtype)
    w = jnp.asarray(RNG.random((1, 40, h)), jnp.float32)
    keys = jnp.asarray(RNG.normal(0, 1, (1, 3 * tile + 5, d)), dtype)
    f = nm.jit(lambda q, w, k: nm.indexer_scores(q, w, k, d**-0.5))
    full = _f32(f(q, w, keys))
    assert full.shape == (1, 40, 3 * tile + 5)
    for e in (1, tile - 1, tile, tile + 7, 2 * tile + 1):
        for rows in (slice(0, 1), slice(3, 4), slice(0, 40)):
            got = _f32(f(q[:, rows], w[:, rows], keys[:, :e]))
            np.testing.assert_array_equal(got, full[:, rows, :e], err_msg=f"{e} entries, queries {rows}")
    want = np.einsum("nqhd,ned->nqhe", np.asarray(q, np.float32), np.asarray(keys, np.float32))
    want = (np.maximum(want, 0) * np.asarray(w)[..., None]).sum(2) * d**-0.5
    np.testing.assert_allclose(full, want, rtol=2e-2 if dtype == jnp.bfloat16 else 1e-4, atol=1e-2)


def test_row_plan_is_available_while_a_program_is_traced():
    """A model's matmul asks for the plan inside jit: the probe runs as a program of its own."""
    x = jnp.asarray(RNG.normal(0, 1, (3, 192)), jnp.float32)
    w = jnp.asarray(RNG.normal(0, 0.05, (192, 700)), jnp.float32)
    got = jax.jit(lambda a, b: jax.jit(nm.matmul)(a, b))(x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_batched_matmul_batch_and_rows_do_not_change_a_product(dtype):
    a = jnp.asarray(RNG.normal(0, 1, (6, 48, 64)), dtype)
    b = jnp.asarray(RNG.normal(0, 1, (6, 64, 16)), dtype)
    f = nm.jit(nm.batched_matmul)
    full = _f32(f(a, b))
    for batch, rows in ((1, 1), (1, 2), (2, 5), (6, 48), (3, 17)):
        np.testing.assert_array_equal(_f32(f(a[:batch, :rows], b[:batch])), full[:batch, :rows])


@pytest.mark.parametrize(
    "name,fn",
    [
        ("exp", nm.exp),
        ("rsqrt", lambda x: nm.rsqrt(jnp.abs(x) + 0.1)),
        ("sigmoid", nm.sigmoid),
        ("silu", nm.silu),
        ("gelu_tanh", nm.gelu_tanh),
        ("tanh", jnp.tanh),
        ("cos", jnp.cos),
        ("softplus", jax.nn.softplus),
    ],
)
def test_elementwise_functions_do_not_depend_on_the_array_length(name, fn):
    """Vector bodies and scalar tails of XLA's loops give the same bits (lengths 1..40, offsets, 2-D)."""
    x = RNG.normal(0, 6, (300,)).astype(np.float32)
    f = nm.jit(fn)
    full = _f32(f(x))
    for n in range(1, 41):
        for off in (0, 3):
            np.testing.assert_array_equal(_f32(f(x[off : off + n])), full[off : off + n], err_msg=f"{name} {n}+{off}")
    np.testing.assert_array_equal(_f32(f(x[:91].reshape(7, 13))).ravel(), full[:91])


def test_fixed_sum_is_a_fixed_tree_and_ordered_sum_a_left_fold(monkeypatch):
    x = RNG.normal(0, 1, (37, 5, 11)).astype(np.float32)
    got = _f32(nm.jit(lambda v: nm.fixed_sum(v, axis=-1))(x))
    tree = np.pad(x, ((0, 0), (0, 0), (0, 5)))
    while tree.shape[-1] > 1:
        h = tree.shape[-1] // 2
        tree = tree[..., :h] + tree[..., h:]
    np.testing.assert_array_equal(got, tree[..., 0])
    fold = x[:, 0]
    for j in range(1, 5):
        fold = fold + x[:, j]
    np.testing.assert_array_equal(_f32(nm.jit(lambda v: nm.ordered_sum(v, axis=1))(x)), fold)
    many = RNG.normal(0, 1, (150, 3)).astype(np.float32)  # a chain cut into fusions of 64 terms
    fold = many[0]
    for j in range(1, 150):
        fold = fold + many[j]
    np.testing.assert_array_equal(_f32(nm.jit(nm.ordered_sum)(many)), fold)
    monkeypatch.setattr(nm, "ORDERED_SUM_UNROLLED", 100)  # past the unrolled length: a scan of chunks
    np.testing.assert_array_equal(_f32(nm.jit(nm.ordered_sum)(many)), fold)


def test_settle_keeps_a_product_out_of_a_fused_multiply_add():
    """`mul(a, b) + c` rounds the product first, as numpy does, wherever XLA:CPU would fuse an FMA."""
    a, b, c = (RNG.normal(0, 1, (4096,)).astype(np.float32) for _ in range(3))
    got = _f32(nm.jit(lambda a, b, c: nm.mul(a, b) + c)(a, b, c))
    np.testing.assert_array_equal(got, a * b + c)

    def in_loop(a, b, c):  # XLA sinks constants into loop bodies: the zero must stay opaque there too
        return jax.lax.fori_loop(0, 2, lambda i, acc: nm.mul(a, b) + c + 0 * acc, jnp.zeros_like(a))

    np.testing.assert_array_equal(_f32(nm.jit(in_loop)(a, b, c)), a * b + c)


def test_div_is_a_settled_reciprocal_product():
    a = RNG.uniform(0.1, 1, (64, 2, 2)).astype(np.float32)
    s = a.sum(-1, keepdims=True)
    got = _f32(nm.jit(nm.div)(a, s))
    np.testing.assert_array_equal(got, a * (np.float32(1) / s))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 2, 16), (4, 2, None), (4, 1, 8), (2, 2, 5)])
def test_attention_decode_reference_equals_the_stateless_attention(dtype, heads, kv_heads, window):
    """One query read from a paged pool (`gqa_decode_attention_reference`) gets the bits
    `sequence_attention` gives it among all the sequence's queries, at every length."""
    d, t = 16, 40
    q = jnp.asarray(RNG.normal(0, 1, (1, t, heads, d)), dtype)
    k = jnp.asarray(RNG.normal(0, 1, (1, t, kv_heads, d)), dtype)
    v = jnp.asarray(RNG.normal(0, 1, (1, t, kv_heads, d)), dtype)
    full = _f32(nm.jit(lambda q, k, v: sequence_attention(q, k, v, window=window, scale=d**-0.5))(q, k, v))[0]
    rows = jnp.concatenate([k.reshape(t, -1), v.reshape(t, -1)], -1)
    pool = jnp.zeros((8 * 16, rows.shape[-1]), dtype).at[:t].set(rows).reshape(8, 16, -1)
    table = jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)

    @nm.jit
    def decode(q1, lengths):
        return pk.gqa_decode_attention_reference(q1, pool, table, lengths, None, num_kv_heads=kv_heads,
                                                 window=window, scale=d**-0.5)  # fmt: skip

    for pos in (0, 7, 16, 33, 39):
        q1 = jnp.stack([q[0, pos], jnp.zeros_like(q[0, pos])])
        got = _f32(decode(q1, jnp.asarray([pos + 1, 0], jnp.int32)))[0]
        np.testing.assert_array_equal(got, full[pos], err_msg=f"position {pos}")


def test_attention_ignores_invisible_tiles_and_their_order_of_arrival():
    """Leading and trailing tiles of invisible keys change nothing: a path that reads more tiles (a
    prefill reading a whole read bucket) gets the bits of one that reads only the visible ones."""
    q = jnp.asarray(RNG.normal(0, 1, (2, 3, 1, 4, 8)), jnp.float32)
    keys = jnp.asarray(RNG.normal(0, 1, (2, 1, 1, nm.KEY_TILE, 1, 8)), jnp.float32)
    valid = jnp.asarray(RNG.uniform(size=(2, 3, 1, nm.KEY_TILE)) < 0.6)
    one = nm.jit(lambda q, k, m: nm.attend(q, [nm.KeyTiles(k, k, m)], scale=0.3))(q, keys, valid)
    pad = jnp.zeros_like(keys)
    more = jnp.concatenate([pad, keys, pad], axis=2)
    more_valid = jnp.concatenate([jnp.zeros_like(valid), valid, jnp.zeros_like(valid)], axis=2)
    three = nm.jit(lambda q, k, m: nm.attend(q, [nm.KeyTiles(k, k, m)], scale=0.3))(q, more, more_valid)
    np.testing.assert_array_equal(_f32(three), _f32(one))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shared", [True, False], ids=["shared-tiles", "per-query-tiles"])
def test_attention_in_blocks_of_tiles_gives_the_bits_of_attention_at_once(monkeypatch, dtype, shared):
    """`attend` walks the key tiles in blocks when the scores are large (two passes: the max, then the
    per-tile sums added in order): the same bits as all scores at once, with two sources, a sink and a
    soft cap, whatever the block size (here 1, 2 and 3 tiles over 7 + 2 tiles)."""
    n, nq, h, g, d = 2, 5, 2, 3, 8
    q = jnp.asarray(RNG.normal(0, 1, (n, nq, h, g, d)), dtype)
    qk = 1 if shared else nq

    def source(t):
        k = jnp.asarray(RNG.normal(0, 1, (n, qk, t, nm.KEY_TILE, h, d)), dtype)
        v = jnp.asarray(RNG.normal(0, 1, (n, qk, t, nm.KEY_TILE, h, d)), dtype)
        valid = jnp.asarray(RNG.uniform(size=(n, nq, t, nm.KEY_TILE)) < 0.5)
        return nm.KeyTiles(jnp.where(valid[:, :1, ..., None, None], k, 0) if shared else k, v, valid)

    sources = [source(7), source(2)]
    sinks = jnp.asarray(RNG.normal(0, 1, (h * g,)), jnp.float32)

    def run():
        f = nm.jit(lambda q, s: nm.attend(q, s, scale=0.4, sinks=sinks, softcap=5.0))
        return _f32(f(q, sources))

    at_once = run()
    monkeypatch.setattr(nm, "BLOCKED_SCORES", 0)
    per_tile = n * nq * h * g * nm.KEY_TILE
    for tiles in (1, 2, 3):
        monkeypatch.setattr(nm, "BLOCK_SCORES", tiles * per_tile)
        np.testing.assert_array_equal(run(), at_once, err_msg=f"blocks of {tiles} tiles")


def test_blocked_attention_walks_only_the_blocks_with_visible_keys_bit_for_bit(monkeypatch):
    """The blocked walk skips the blocks before the first and after the last visible key (a prefill
    chunk reading a bucket of keys larger than it sees; a sliding window's early tiles): the bits of
    attention at once, also for a source with no visible key at all (zeros from it)."""
    n, nq, h, g, d, t = 2, 5, 2, 3, 8, 9
    q = jnp.asarray(RNG.normal(0, 1, (n, nq, h, g, d)), jnp.float32)

    def source(lo, hi):
        k = jnp.asarray(RNG.normal(0, 1, (n, 1, t, nm.KEY_TILE, h, d)), jnp.float32)
        v = jnp.asarray(RNG.normal(0, 1, (n, 1, t, nm.KEY_TILE, h, d)), jnp.float32)
        tile = np.arange(t)[None, None, :, None]
        valid = jnp.asarray((RNG.uniform(size=(n, nq, t, nm.KEY_TILE)) < 0.5) & (tile >= lo) & (tile < hi))
        return nm.KeyTiles(k, v, valid)

    def run(sources):  # traced anew: the block sizes are read at trace time
        return _f32(nm.jit(lambda q, s: nm.attend(q, s, scale=0.4, softcap=5.0))(q, sources))

    for sources in ([source(3, 7)], [source(1, 3), source(7, 9)], [source(5, 6), source(0, 0)]):
        monkeypatch.setattr(nm, "BLOCKED_SCORES", 1 << 30)
        at_once = run(sources)
        monkeypatch.setattr(nm, "BLOCKED_SCORES", 0)
        for tiles in (1, 2, 4):
            monkeypatch.setattr(nm, "BLOCK_SCORES", tiles * n * nq * h * g * nm.KEY_TILE)
            np.testing.assert_array_equal(run(sources), at_once, err_msg=f"blocks of {tiles} tiles")
    np.testing.assert_array_equal(run([source(0, 0)]), np.zeros(q.shape, np.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("blocked", [False, True], ids=["at-once", "blocked"])
def test_shared_tiles_tile_major_give_the_bits_of_the_general_layout(monkeypatch, dtype, blocked):
    """Shared tiles (every path but a sparse layer's picks) are attended tile-major, in the layout the
    score products write (`TILE_MAJOR`): the same bits as the general layout that lays scores out per
    query (`PER_QUERY`, at once and blocked), with two sources, a sink, a soft cap and a query that
    sees nothing."""
    n, nq, h, g, d = 2, 6, 2, 3, 16
    q = jnp.asarray(RNG.normal(0, 1, (n, nq, h, g, d)), dtype)

    def source(t):
        valid = RNG.uniform(size=(n, nq, t, nm.KEY_TILE)) < 0.5
        valid[:, 0] = False
        k, v = (jnp.asarray(RNG.normal(0, 1, (n, 1, t, nm.KEY_TILE, h, d)), dtype) for _ in range(2))
        seen = jnp.asarray(valid.any(axis=1))[:, None, :, :, None, None]
        return nm.KeyTiles(jnp.where(seen, k, 0), jnp.where(seen, v, 0), jnp.asarray(valid))

    sources = [source(5), source(2)]
    sinks = jnp.asarray(RNG.normal(0, 1, (h * g,)), jnp.float32)
    if blocked:
        monkeypatch.setattr(nm, "BLOCKED_SCORES", 0)
        monkeypatch.setattr(nm, "BLOCK_SCORES", 2 * n * nq * h * g * nm.KEY_TILE)
    general = nm._attend_blocked if blocked else nm._attend_whole
    kw = {"scale": 0.4, "softcap": 5.0}
    tile_major = nm.jit(lambda q, s: nm.attend(q, s, sinks=sinks, **kw))(q, sources)
    per_query = nm.jit(lambda q, s: general(q, s, sink=sinks.reshape(h, g), **kw))(q, sources)
    np.testing.assert_array_equal(_f32(tile_major), _f32(per_query))
    assert not np.any(_f32(tile_major)[:, 0])


def test_compiler_options_are_for_cpu_only():
    assert nm.compiler_options("gpu") is None and nm.compiler_options("tpu") is None
    opts = nm.compiler_options("cpu")
    assert opts["xla_cpu_enable_platform_dependent_math"] is False
    assert opts["xla_cpu_experimental_ynn_fusion_type"] == "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"
