"""FP8 cache rows (`hkv.KVQuant`, `hkv.core.kv_quant`): the row format's arithmetic, its validation, its
place in the ABI fingerprint and in the memory accounting (DeepSeek-V4-Flash at <= 4.1 KiB per token)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hkv
from hkv.core import kv_quant as kvq
from hkv.engine.offload import expected_objects
from models.deepseek_v4 import ConfigError, flash_config, tiny_config
from models.deepseek_v4.cache_spec import cache_spec
from pallas_kernels.common import compressed_rows_reference

Q = hkv.KVQuant(tile=16, rope_dims=8)


def rows(dtype, shape=(4, 3, 40), seed=0, span=20) -> jax.Array:
    """Rows whose tiles span very different magnitudes (scales 2**-span .. 2**span, and all-zero tiles)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-span, span + 1, shape[:-1] + (1,))
    x[0, 0, :16] = 0.0
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
def test_a_round_trip_changes_values_only_by_e4m3_rounding_and_keeps_rope_values(dtype):
    x = rows(dtype, span=6 if dtype == jnp.float16 else 20)
    packed = kvq.pack_rows(Q, x)
    assert packed.dtype == jnp.uint8 and packed.shape == (*x.shape[:-1], Q.row_bytes(40, jnp.dtype(dtype).itemsize))
    r = kvq.unpack_rows(Q, packed, 40, dtype)
    assert r.dtype == x.dtype
    xf, rf = np.asarray(x, np.float64), np.asarray(r, np.float64)
    assert np.array_equal(rf[..., 32:], xf[..., 32:])  # rope values untouched
    tiles = np.abs(xf[..., :32]).reshape(*x.shape[:-1], 2, 16)
    amax = tiles.max(-1, keepdims=True)
    e = np.asarray(kvq.pack_rows(Q, x)[..., 32:34], np.int64)[..., None] - 127  # the stored exponents
    live = amax > 0
    # the smallest power of two that fits the tile in e4m3's range
    assert np.all((amax * 2.0**-e <= 448)[live]) and np.all((amax * 2.0 ** -(e - 1) > 448)[live])
    err = np.abs(rf[..., :32] - xf[..., :32]).reshape(tiles.shape)
    bound = np.maximum(tiles * 2.0**-4, 2.0 ** (e - 10))  # half an e4m3 ulp: 3 mantissa bits; subnormal step 2**-9
    assert np.all(err <= bound)
    assert np.all(rf[0, 0, :16] == 0)


def test_rounding_is_idempotent_and_on_grid_values_survive_exactly():
    x = rows(jnp.bfloat16)
    r = kvq.round_rows(Q, x)
    assert np.array_equal(np.asarray(kvq.round_rows(Q, r)), np.asarray(r))
    grid = jnp.asarray(np.arange(-7, 9, dtype=np.float32).repeat(2)[None, :32] * 2.0**-3, jnp.bfloat16)
    grid = jnp.concatenate([grid, jnp.ones((1, 8), jnp.bfloat16)], axis=-1)
    assert np.array_equal(np.asarray(kvq.round_rows(Q, grid)), np.asarray(grid))
    assert kvq.round_rows(None, x) is x


def test_an_all_zero_packed_row_reads_as_zeros_and_rope_only_rows_are_stored_as_is():
    z = kvq.unpack_rows(Q, jnp.zeros((2, Q.row_bytes(40, 2)), jnp.uint8), 40, jnp.bfloat16)
    assert not np.asarray(z, np.float32).any()
    only = hkv.KVQuant(tile=16, rope_dims=32)
    x = rows(jnp.bfloat16, (1, 2, 32))
    assert kvq.pack_rows(only, x).shape == (1, 2, 64)
    assert np.array_equal(np.asarray(kvq.round_rows(only, x)), np.asarray(x))


def test_unpack_names_a_packed_width_that_does_not_fit():
    with pytest.raises(ValueError, match=r"uint8\[\.\.\., 50\] expected"):
        kvq.unpack_rows(Q, jnp.zeros((2, 49), jnp.uint8), 40, jnp.bfloat16)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(format="int8"), r"format='int8' must be one of \('fp8_e4m3',\)"),
        (dict(tile=0), r"tile=0 must be an integer >= 1"),
        (dict(rope_dims=-1), r"rope_dims=-1 must be an integer >= 0"),
    ],
)
def test_a_bad_kv_quant_is_named(kw, match):
    with pytest.raises(ValueError, match=match):
        hkv.KVQuant(**kw)


def test_a_spec_whose_rows_do_not_fit_the_tiles_is_refused_naming_the_layer():
    layer = hkv.LayerSpec(kv_dim=40, window=8)
    with pytest.raises(
        ValueError,
        match=r"layer 0 SWA: a row of 40 values keeps 8 rope values, and the other 32 must be a multiple of tile=64",
    ):
        hkv.CacheSpec((layer,), dtype="bfloat16", kv_quant=hkv.KVQuant(rope_dims=8))
    with pytest.raises(ValueError, match=r"kv_quant needs a float dtype"):
        hkv.CacheSpec((layer,), dtype="int32", kv_quant=Q)
    with pytest.raises(ConfigError, match=r"kv_quant_tile=64: head_dim: a row of 32 values"):
        tiny_config(kv_quant="fp8_e4m3")
    with pytest.raises(ConfigError, match=r"kv_quant='fp4' must be None or one of"):
        tiny_config(kv_quant="fp4")


def test_the_row_format_is_part_of_the_abi_and_unquantized_fingerprints_are_unchanged():
    spec = cache_spec(tiny_config(index_head_dim=32), dtype="bfloat16")
    fp8 = cache_spec(tiny_config(index_head_dim=32, kv_quant="fp8_e4m3", kv_quant_tile=16), dtype="bfloat16")
    assert "kv_quant" not in spec.abi_json()
    assert fp8.abi_json()["kv_quant"] == {"format": "fp8_e4m3", "tile": 16, "rope_dims": 16}
    assert fp8.fingerprint() != spec.fingerprint()
    assert dataclasses.replace(fp8, kv_quant=None).fingerprint() == spec.fingerprint()
    assert (fp8.row_dtype(), fp8.row_width(32), fp8.row_bytes(32)) == (jnp.uint8, 16 + 1 + 32, 49)
    assert (spec.row_dtype(), spec.row_width(32), spec.row_bytes(32)) == (jnp.bfloat16, 32, 64)


def test_pools_hold_packed_rows_and_the_accounting_counts_their_bytes():
    spec = cache_spec(tiny_config(index_head_dim=32, kv_quant="fp8_e4m3", kv_quant_tile=16), dtype="bfloat16")
    layout = hkv.CacheLayout(spec, hkv.CacheConfig(slots=2, max_context=64, page_size=8, prefix_records=4))
    shapes = jax.eval_shape(lambda: hkv.init_cache(layout))
    for g, grp in zip(shapes.groups, layout.groups, strict=True):
        assert g.pool.dtype == jnp.uint8 and g.pool.shape[-1] == spec.row_width(grp.dim)
    assert all(t.tail_kv.dtype == jnp.bfloat16 for t in shapes.tails)  # TAILs are never quantized
    got = hkv.core.memory.allocated_bytes(layout)
    pools = sum(int(np.prod(g.pool.shape)) for g in shapes.groups)
    assert got["SWA"] + got["COMPRESSED"] + got["INDEXER"] == pools


def test_deepseek_v4_flash_keeps_at_most_4_1_kib_per_token_on_every_tier_with_the_fp8_cache():
    """Issue 47's target: <= 4.1 KiB per token at 128K — the minimum, the device's allocation and the
    blocks the host and disk tiers store (averaged over one HCA window of 64-token blocks)."""
    ctx, bt = 128 * 1024, 64
    for kv_quant, lo, hi in ((None, 6000, 7000), ("fp8_e4m3", 3900, 4.1 * 1024)):
        spec = cache_spec(flash_config(kv_quant=kv_quant), dtype="bfloat16", block_tokens=bt)
        layout = hkv.CacheLayout(spec, hkv.CacheConfig(slots=1, max_context=ctx, page_size=bt, prefix_records=0))
        minimum = hkv.architectural_minimum(spec, ctx)["total"] / ctx
        device = hkv.core.memory.allocated_bytes(layout)["total"] / ctx
        ends = [ctx - i * bt for i in range(128 // bt)]
        stored = sum(int(np.prod(s)) * d.itemsize for e in ends for d, s in expected_objects(layout, e, False).values())
        tier = stored / (len(ends) * bt)
        assert lo < minimum <= device <= hi and lo < tier <= hi, (kv_quant, minimum, device, tier)


def test_a_sparse_decode_reads_only_its_picks_dequantized_in_their_order():
    """`dequantized_picks` gives the kernels the rows the original picks name, in the same order, and -1
    where a pick is none or not yet visible (a -1 in the middle, a pick past the visible entries)."""
    spec = hkv.CacheSpec((hkv.LayerSpec(kv_dim=40, window=8),), dtype="bfloat16", kv_quant=Q)
    pool = kvq.store(spec, rows(jnp.bfloat16, (2, 7, 4, 40), seed=4))  # [L, P, page_size, row_bytes]
    page_table = jnp.asarray([[3, 0, 5], [6, 2, -1]], jnp.int32)
    lengths = jnp.asarray([48, 30], jnp.int32)  # ratio 4: 12 and 7 entries visible
    n_comp = lengths // 4
    picks = jnp.asarray([[7, -1, 0, 11, 3], [2, 9, 6, -1, 1]], jnp.int32)  # 9 >= 7: not visible
    got_pool, got_table, got_picks = kvq.dequantized_picks(spec, pool, 1, page_table, picks, n_comp, 4, lengths, 40)
    assert got_picks.tolist() == [[0, -1, 1, 2, 3], [0, -1, 1, -1, 2]]
    want = kvq.load(spec, compressed_rows_reference(pool[1], page_table, picks, picks >= 0), 40)
    got = compressed_rows_reference(got_pool, got_table, got_picks, got_picks >= 0)
    ok = np.asarray(got_picks >= 0)
    assert np.array_equal(np.asarray(got)[ok], np.asarray(want)[ok])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_values_next_to_the_dtypes_largest_saturate_instead_of_becoming_inf(dtype):
    """e4m3 may round a tile's largest value up past the dtype's largest finite one (float16 65504 ->
    65536); the row then saturates there, as e4m3fn itself does, instead of reading back as inf."""
    big = float(jnp.finfo(dtype).max)
    x = jnp.asarray([[big, -big, 0.97 * big] + [1.0] * 29 + [2.0] * 8], dtype)
    r = np.asarray(kvq.round_rows(Q, x), np.float64)
    assert np.isfinite(r).all() and np.abs(r).max() <= big
    assert r[0, 0] == big and r[0, 1] == -big and np.array_equal(r[0, 32:], np.asarray(x, np.float64)[0, 32:])


def test_a_decode_view_converts_only_the_pages_below_the_rows_held_or_the_window():
    """`dequantized_pages` follows the context held, not the table's width (`max_context`): pages past
    the rows held stay zeros, and a sliding layer gets a ring of `window_pages` pages holding its window
    (a decode step converted every page up to max_context, found by review: 13x bf16's step at 16K)."""
    spec = hkv.CacheSpec((hkv.LayerSpec(kv_dim=40, window=8),), dtype="bfloat16", kv_quant=Q)
    pool = kvq.store(spec, rows(jnp.bfloat16, (1, 40, 4, 40), seed=7) + 1)  # no zero rows
    table = jnp.asarray([np.arange(3, 35), np.arange(35, 3, -1)], jnp.int32)  # [2, 32]: 128 rows each
    full = kvq.load(spec, pool[0], 40)
    view, vt = kvq.dequantized_pages(spec, pool, 0, table, 40, rows_held=jnp.asarray([9, 21], jnp.int32))
    got = np.asarray(view, np.float32).reshape(2, -1, 4, 40)
    assert np.array_equal(np.asarray(vt), np.arange(64).reshape(2, 32))  # page j of row b: b * 32 + j
    for b, held_pages in ((0, 3), (1, 6)):  # pages below max(held) = 21 rows: 6 pages, in passes of 8
        np.testing.assert_array_equal(
            got[b, :held_pages], np.asarray(full[np.asarray(table[b, :held_pages])], np.float32)
        )
        assert not got[b, 8:].any()  # past the first pass: never converted
    ring, rt = kvq.dequantized_pages(spec, pool, 0, table, 40, rows_held=jnp.asarray([9, 30], jnp.int32), window=8)
    assert rt.shape == (2, 3)  # window_pages(8, 4): the most pages a window of 8 rows overlaps
    for b, length in ((0, 9), (1, 30)):
        for pos in range(max(length - 8, 0), length):  # every row of the newest token's window
            entry = int(rt[b, (pos // 4) % 3])
            np.testing.assert_array_equal(
                np.asarray(ring[entry, pos % 4]), np.asarray(full[int(table[b, pos // 4]), pos % 4])
            )
