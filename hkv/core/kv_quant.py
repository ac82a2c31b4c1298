"""FP8 cache rows (`hkv.KVQuant`): pack, unpack and round, the same bits on every path.

A row of `dim` values in the spec's dtype is stored as bytes
`[e4m3 values (n) | exponents (n / tile) | rope values (rope_dims, spec dtype)]`, n = dim - rope_dims:
each tile of `tile` values shares one power-of-two scale 2**e, the smallest with
max|x| * 2**-e <= 448 (e4m3's largest finite value), stored as the byte e + 127 (e in [-126, 126];
byte 0 marks an all-zero tile). Scaling by a power of two is exact, so `unpack(pack(x))` differs from x
only by e4m3's own rounding (round to nearest even; a value the rounding would carry past the dtype's
largest finite one saturates there), and `round_rows` — what a model's stateless forward applies to
its K/V — gives exactly the values a cached path reads back.

`to_pool` / `from_pool` convert between rows and a pool's elements where the two dtypes differ (a
bfloat16 pool held as uint16 bit patterns on CPU: `hkv.core.layout.CacheLayout.pool_bits`).

Everything here is pure jnp, jittable and elementwise per row (no reduction crosses rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import index_math as im
from pallas_kernels.common import compressed_rows_reference, visible_entries, window_pages

from .spec import CacheSpec, KVQuant

_BIAS = 127
_E4M3_MAX_EXP = 9  # 448 = 0.875 * 2**9


def _exponents(tiles: jax.Array) -> jax.Array:
    """float32[..., T, tile] -> int32[..., T]: e with max|x| * 2**-e <= 448 (smallest such), in
    [-126, 126]; -127 for an all-zero tile (the exponent byte 0: an all-zero packed row reads as zeros).
    Exact integer arithmetic on frexp's mantissa and exponent (no log, no division)."""
    amax = jnp.max(jnp.abs(tiles), axis=-1)
    m, ex = jnp.frexp(amax)  # amax = m * 2**ex, m in [0.5, 1) (0 for amax == 0)
    e = jnp.where(m <= 0.875, ex - _E4M3_MAX_EXP, ex - _E4M3_MAX_EXP + 1)
    return jnp.where(amax > 0, jnp.clip(e, 1 - _BIAS, _BIAS - 1), -_BIAS).astype(jnp.int32)


def _pow2(e: jax.Array) -> jax.Array:
    """int32 e in [-127, 127] -> float32 2**e built from its exponent bits (one multiply then scales a
    tile exactly; cheaper than `jnp.ldexp`). e = -127 gives 0.0 (the exponent byte of a zero tile)."""
    return jax.lax.bitcast_convert_type((e + _BIAS) << 23, jnp.float32)


def _split(quant: KVQuant, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    n = x.shape[-1] - quant.rope_dims
    quant.check_dim(x.shape[-1], "row")
    return x[..., :n], x[..., n:]


def pack_rows(quant: KVQuant, x: jax.Array) -> jax.Array:
    """Rows x[..., dim] (a float dtype) -> uint8[..., quant.row_bytes(dim, x.dtype.itemsize)]."""
    nope, rope = _split(quant, x)
    if not nope.shape[-1]:  # rope values only
        return _to_bytes(rope)
    tiles = nope.astype(jnp.float32).reshape(*nope.shape[:-1], -1, quant.tile)
    e = _exponents(tiles)
    q = (tiles * _pow2(-e)[..., None]).astype(jnp.float8_e4m3fn)
    q_bytes = jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(nope.shape)
    e_bytes = (e + _BIAS).astype(jnp.uint8)
    parts = [q_bytes, e_bytes]
    if quant.rope_dims:
        parts.append(_to_bytes(rope))
    return jnp.concatenate(parts, axis=-1)


def unpack_rows(quant: KVQuant, packed: jax.Array, dim: int, dtype) -> jax.Array:
    """uint8[..., row_bytes] -> rows [..., dim] in `dtype` (an all-zero row unpacks to zeros)."""
    dtype = jnp.dtype(dtype)
    n = dim - quant.rope_dims
    want = quant.row_bytes(dim, dtype.itemsize)
    if packed.dtype != jnp.uint8 or packed.shape[-1] != want:
        raise ValueError(f"packed rows are {packed.dtype}[..., {packed.shape[-1]}]; uint8[..., {want}] expected")
    if not n:  # rope values only
        return _from_bytes(packed, dtype, quant.rope_dims)
    q = jax.lax.bitcast_convert_type(packed[..., :n], jnp.float8_e4m3fn).astype(jnp.float32)
    e = packed[..., n : n + n // quant.tile].astype(jnp.int32) - _BIAS
    tiles = q.reshape(*q.shape[:-1], -1, quant.tile) * _pow2(e)[..., None]
    big = float(jnp.finfo(dtype).max)  # e4m3 may round a value next to the dtype's largest one past it:
    nope = jnp.clip(tiles.reshape(q.shape), -big, big).astype(dtype)  # saturate, as e4m3fn itself does
    if not quant.rope_dims:
        return nope
    rope = _from_bytes(packed[..., n + n // quant.tile :], dtype, quant.rope_dims)
    return jnp.concatenate([nope, rope], axis=-1)


def round_rows(quant: KVQuant | None, x: jax.Array) -> jax.Array:
    """x [..., dim] as the cache returns it after storing it: `unpack_rows(pack_rows(x))` (x itself
    without `quant`). A stateless forward applies this to its K/V rows, compressed entries and
    indexer keys so that it computes on the cache's values."""
    if quant is None:
        return x
    return unpack_rows(quant, pack_rows(quant, x), x.shape[-1], x.dtype)


def _to_bytes(x: jax.Array) -> jax.Array:
    if x.dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint8)
    b = jax.lax.bitcast_convert_type(x, jnp.uint8)  # [..., r, itemsize]
    return b.reshape(*x.shape[:-1], -1)


def _from_bytes(b: jax.Array, dtype, r: int) -> jax.Array:
    if dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(b, dtype)
    return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], r, dtype.itemsize), dtype)


# ------------------------------------------------------------------ the spec's view
def store(spec: CacheSpec, rows: jax.Array) -> jax.Array:
    """Rows [..., dim] in the spec's dtype -> what the pools hold (packed with `kv_quant`, else cast)."""
    if spec.kv_quant is None:
        return rows.astype(spec.storage_dtype)
    return pack_rows(spec.kv_quant, rows.astype(spec.storage_dtype))


def load(spec: CacheSpec, stored: jax.Array, dim: int) -> jax.Array:
    """What the pools hold [..., row_width] -> rows [..., dim] in the spec's dtype."""
    if spec.kv_quant is None:
        return stored
    return unpack_rows(spec.kv_quant, stored, dim, spec.storage_dtype)


# ------------------------------------------------------------------ the pools' elements
def to_pool(values: jax.Array, pool_dtype) -> jax.Array:
    """Stored rows (`store`'s result, or any float rows: cast to bfloat16 first) -> the elements of a
    pool of `pool_dtype` (`CacheLayout.pool_dtype`): their uint16 bit patterns for a uint16 pool of
    bfloat16 rows (`CacheLayout.pool_bits`), else cast to `pool_dtype`."""
    pool_dtype = jnp.dtype(pool_dtype)
    if pool_dtype == jnp.uint16 and jnp.issubdtype(values.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(values.astype(jnp.bfloat16), jnp.uint16)
    return values.astype(pool_dtype)


def from_pool(values: jax.Array, row_dtype) -> jax.Array:
    """Elements read from a pool (or the whole pool) -> rows of `row_dtype` (`CacheSpec.row_dtype`):
    a uint16 pool's bit patterns as the bfloat16 values they are, anything else unchanged. On XLA:CPU
    a view of the whole pool costs nothing where a gather reads it (the conversion fuses into it)."""
    if values.dtype == jnp.uint16 and jnp.dtype(row_dtype) == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(values, jnp.bfloat16)
    return values


PAGES_PER_PASS = 8  # pages `dequantized_pages` converts per loop iteration when it knows the rows held


def dequantized_pages(
    spec: CacheSpec,
    pool: jax.Array,
    layer,
    page_table: jax.Array,
    dim: int,
    rows_held: jax.Array,
    window: int | None = None,
):
    """The pages a decode kernel may read, dequantized: (pool [B * M', page_size, dim] in the spec's
    dtype, page_table int32[B, M']) for a stacked packed pool [L, P, page_size, row_bytes], the layer
    index `layer` (int or traced) and the step's page table int32[B, M]. Sequence b's logical page j is
    physical page b * M' + j of the new pool (-1 entries stay -1; M' >= M, the padding unmapped), so
    the kernels read the same rows by the same addressing.

    rows_held: int32[B] rows each sequence holds in this object (tokens for a full-attention layer,
    entries for compressed entries and indexer keys), its table addressed by row // page_size: only
    the pages below the batch's largest count are converted (a loop of `PAGES_PER_PASS` pages; the rest
    are zeros, which no kernel reads), so a step's cost follows the context held, not `max_context`.
    window: a sliding layer's window (rows_held = its tokens): only the `common.window_pages` pages that
    overlap the newest token's window are converted, into a ring table of that width (logical page i
    at entry i % width, as the window kernels address a short table)."""
    b, m = page_table.shape
    ps = pool.shape[2]
    if window is not None:
        return _window_ring(spec, pool[layer], page_table, dim, rows_held, window)
    k = min(PAGES_PER_PASS, m)
    mp = -(-m // k) * k
    table = jnp.pad(page_table, ((0, 0), (0, mp - m)), constant_values=-1)
    layer_pool = pool[layer]

    def one_pass(i, out):
        ids = jax.lax.dynamic_slice_in_dim(table, i * k, k, axis=1)  # [B, k]
        vals = load(spec, layer_pool[jnp.maximum(ids, 0)], dim)  # [B, k, page_size, dim]
        return jax.lax.dynamic_update_slice_in_dim(out, vals, i * k, axis=1)

    held_pages = -(-jnp.max(rows_held) // ps)
    out = jnp.zeros((b, mp, ps, dim), spec.storage_dtype)
    out = jax.lax.fori_loop(0, jnp.minimum(-(-held_pages // k), mp // k), one_pass, out)
    return out.reshape(b * mp, ps, dim), jnp.where(table >= 0, jnp.arange(b * mp, dtype=jnp.int32).reshape(b, mp), -1)


def _window_ring(spec: CacheSpec, layer_pool, page_table, dim: int, lengths, window: int):
    """`dequantized_pages` of a sliding layer: the window's pages in a ring table of `window_pages`."""
    b, m = page_table.shape
    ps = layer_pool.shape[1]
    w = window_pages(window, ps)
    first = jnp.maximum(lengths - window, 0) // ps  # logical page of the oldest row the window may hold
    logical = first[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]  # [B, w]
    ids = jnp.where(logical < m, im.take_rows(page_table, jnp.minimum(logical, m - 1)), -1)
    rows = load(spec, layer_pool[jnp.maximum(ids, 0)], dim).reshape(b * w, ps, dim)
    compact = jnp.where(ids >= 0, jnp.arange(b * w, dtype=jnp.int32).reshape(b, w), -1)
    ring = jnp.full((b, w), -1, jnp.int32).at[jnp.arange(b)[:, None], logical % w].set(compact)
    return rows, ring


def dequantized_picks(
    spec: CacheSpec,
    pool: jax.Array,
    layer,
    page_table: jax.Array,
    picks: jax.Array,
    n_compressed: jax.Array,
    ratio: int,
    lengths: jax.Array,
    dim: int,
):
    """Only the picked entries of a sparse (CSA) decode step, dequantized: the kernels' compressed
    operands (pool [B * Pk, page_size, dim], page_table int32[B, Pk], picks int32[B, K]) for a stacked
    packed pool [L, P, page_size, row_bytes], its layer `layer`, the step's page table int32[B, M], the
    indexer's picks int32[B, K] (-1 = none) and n_compressed int32[B].

    Dequantizing every page the table maps would convert the whole compressed history on every decode
    step (a CSA layer reads only K of its entries). Here the picks a kernel would read (>= 0 and below
    `pallas_kernels.common.visible_entries`) are gathered in their order and renumbered 0, 1, ... in
    that order, the others -1: the kernel then reads the same rows in the same order, so the same bits.
    """
    b, k = picks.shape
    ps = pool.shape[2]
    visible = visible_entries(lengths, n_compressed, ratio, page_table.shape[1] * ps)
    valid = (picks >= 0) & (picks < visible[:, None])
    rows = compressed_rows_reference(pool[layer], page_table, picks, valid)  # [B, K, row_bytes]
    rank = jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1
    pk_pages = -(-k // ps)
    dest = jnp.where(valid, rank, pk_pages * ps)  # invalid picks: dropped
    packed = jnp.zeros((b, pk_pages * ps, rows.shape[-1]), rows.dtype)
    packed = packed.at[jnp.arange(b)[:, None], dest].set(rows, mode="drop")
    table = jnp.arange(b * pk_pages, dtype=jnp.int32).reshape(b, pk_pages)
    return load(spec, packed, dim).reshape(b * pk_pages, ps, dim), table, jnp.where(valid, rank, -1)
