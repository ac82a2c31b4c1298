"""Batch-invariant numerics: every reduction has one order, whatever the batch, chunk or path.

The numerical contract of hkv (docs/numerics.md): the logits of a token at a position are bitwise
the same whichever path computed them — the stateless forward, prefill in any chunk and batch, the
decode step, a restored prefix. A floating-point sum depends on its order, so every sum a model
computes must have an order that does not depend on how many rows, queries or keys a call holds.
This module is the set of pieces that guarantee it; models, hkv's layer API and the decode-kernel
references are written with them and nothing else that reduces:

* `linear` / `matmul`: products accumulate in float32 in a kernel whose per-element order does not
  depend on the row count (see "Matmuls" below), rounded once to the input dtype.
* `fixed_sum` / `fixed_mean` / `softmax`: reductions as a fixed pairwise tree over the axis (exact
  elementwise adds in an order set by the axis length only), never a library reduction.
* `exp` / `rsqrt`: elementwise functions built from exactly rounded operations, because XLA:CPU's own
  `exp` and `rsqrt` round differently in the vector body and the scalar tail of a loop.
* `attend`: attention over keys cut into tiles of `KEY_TILE` at absolute positions. Scores per tile,
  one max over everything visible (exact in any order), per-tile sums and value products, then the
  tiles added in their order (`ordered_sum`). A path that reads fewer keys (a decode step reading
  only the window) adds exact zeros fewer times, which changes nothing.

Matmuls (measured on XLA:CPU, jaxlib 0.10.2; `tests/pallas_kernels/test_numerics.py` keeps checking):
XLA hands dots to YNNPACK, which picks a kernel by shape; different kernels sum in different orders.
With `compiler_options()` (YNNPACK's consistent-arithmetic mode, dots only), a bfloat16 x bfloat16
-> float32 product is the same for any row count >= 2, and a batched product (attention) is the same
for any batch count and any row count >= 2. A float32 x float32 non-batched product still changes
kernel with the row count (at K=256, N=1024: one order for 2..50 rows, another from 51), so float32
`matmul` / `linear` follow `matmul_rows.row_plan`, measured per shape: at most a block of rows (<= 32)
per product, more rows a block at a time, and a single row padded to 2 (a decode step multiplies 2
rows, not 64). Batched float32 products whose row count varies between paths (DeepSeek-V4's expert
tiles, its indexer's queries, its grouped output projection) are padded to `tile_rows_floor`: 2 rows
where `matmul_rows.batched_floor` measured one order for every count of the shape, else
`F32_MIN_ROWS`. Programs that call these
functions must be compiled with `compiler_options()` (the engine, the stateless forward and
`hkv.jit` do); a program compiled without them still runs, without the contract.

On GPU and TPU the same code runs (the options apply to the CPU backend only); there, matmul
kernels are chosen by the backend's own libraries, and the contract holds only as far as they keep
one order per element (not yet measured: no accelerator has been available).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import matmul_rows
from pallas_kernels.xla_options import compiler_options

# Keys per attention tile. Tiles sit at absolute positions (tile j holds positions [64 j, 64 j + 64)),
# so every path cuts the same keys into the same tiles.
KEY_TILE = 64

# Rows a float32 batched product whose row count varies is padded to (YNNPACK's small-row kernels sum in
# another order), and a float32 matmul where `matmul_rows` finds no block.
F32_MIN_ROWS = matmul_rows.FALLBACK_ROWS
# Rows any matmul is padded to (a single row takes XLA's matrix-vector emitter, another order).
MIN_ROWS = 2


def jit(fun=None, **kwargs):
    """`jax.jit` with `compiler_options()` added: use it for your own jitted loop around hkv's steps
    (e.g. `hkv.decode_loop`) so that it keeps the numerical contract. Usable as `@jit` or `jit(f, ...)`."""
    if fun is None:
        return functools.partial(jit, **kwargs)
    options = compiler_options()
    if options:
        kwargs["compiler_options"] = {**options, **(kwargs.get("compiler_options") or {})}
    return jax.jit(fun, **kwargs)


def settle(x):
    """`x` rounded as its dtype stores it before anything adds to it: x + 0, with a zero XLA cannot see
    through. XLA:CPU lets LLVM fuse a * b + c into one multiply-add (one rounding instead of two)
    wherever both ops land in one kernel, and which ops share a kernel differs between programs (a
    value computed for a program's output, or fused into its consumer): the same float32 arithmetic
    then gives different bits. `a * b + 0` is exactly round(a * b) whether LLVM fuses it or not, and
    what follows adds a sum, not a product, so nothing can fuse across. Settle every product that is
    added to something (this module's reductions settle their inputs). Works on pytrees."""
    return jax.tree.map(_settle, x)


def _settle(v: jax.Array) -> jax.Array:
    # v + 0 * min(|v|, 1): a zero computed from v itself, which XLA cannot fold away (a constant zero
    # it can, inside while loops), finite for any finite or infinite v (NaN stays NaN)
    v = jnp.asarray(v)
    return v + jnp.asarray(0, v.dtype) * jnp.minimum(jnp.abs(v), jnp.asarray(1, v.dtype))


def mul(a: jax.Array, b: jax.Array) -> jax.Array:
    """`settle(a * b)`: a product that may then be added."""
    return settle(a * b)


def div(a: jax.Array, b: jax.Array) -> jax.Array:
    """a / b with b broadcast against a, as `a * (1 / b)` with the reciprocal taken at b's shape (settled).
    XLA rewrites a division by a broadcast value into that form in some programs and not in others
    (the bits differ); written out, every program computes the same thing."""
    b = jnp.asarray(b)
    return mul(a, (1 / b).astype(b.dtype))


# ----------------------------------------------------------------------------------- elementwise
def exp(x: jax.Array) -> jax.Array:
    """float32 e**x (XLA's exp; with `compiler_options()` its classic CPU emitter gives the same bits in
    vector and scalar code, and XLA computes an exp once instead of duplicating it into every consumer).
    exp(-inf) = 0."""
    return jnp.exp(jnp.asarray(x, jnp.float32))


def rsqrt(x: jax.Array) -> jax.Array:
    """1 / sqrt(x) in float32 from a correctly rounded sqrt and division (XLA's rsqrt is approximate and
    rounds differently in vectorized and scalar code)."""
    x = jnp.asarray(x, jnp.float32)
    return 1.0 / jnp.sqrt(x)


def tanh(x: jax.Array) -> jax.Array:
    """float32 tanh as sign(x) (1 - e) / (1 + e) with e = `exp`(-2 |x|): the same bits in any program
    (XLA's own tanh rounds differently inside a loop body than outside one at low optimization levels,
    which a blocked attention's soft cap would see)."""
    x = jnp.asarray(x, jnp.float32)
    e = exp(-2.0 * jnp.abs(x))
    return jnp.sign(x) * div(1.0 - e, 1.0 + e)


def sigmoid(x: jax.Array) -> jax.Array:
    """1 / (1 + e**-x) in float32 through `exp`."""
    return 1.0 / (1.0 + exp(-jnp.asarray(x, jnp.float32)))


def silu(x: jax.Array) -> jax.Array:
    """x * sigmoid(x), computed in float32, returned in x.dtype."""
    x32 = jnp.asarray(x).astype(jnp.float32)
    return settle(x32 * sigmoid(x32)).astype(jnp.asarray(x).dtype)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x**3))), every product
    settled (`settle`); in x.dtype."""
    c = jnp.asarray(0.7978845608028654, x.dtype)
    inner = mul(c, x + mul(jnp.asarray(0.044715, x.dtype), mul(mul(x, x), x)))
    return mul(mul(jnp.asarray(0.5, x.dtype), x), 1 + jnp.tanh(inner))


# ------------------------------------------------------------------------------------ reductions
def fixed_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """Sum over `axis` as a fixed pairwise tree (the axis zero-padded to a power of two, then halved:
    x[:h] + x[h:] until one element is left). The order depends only on the axis length, so a row's
    sum is the same whatever else the array holds. Same dtype as x."""
    x = settle(jnp.moveaxis(jnp.asarray(x), axis, -1))  # a product feeding the tree is rounded first
    n = x.shape[-1]
    if n == 0:
        out = jnp.zeros(x.shape[:-1], x.dtype)
    else:
        width = 1 << (n - 1).bit_length()
        if width != n:
            x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
        while x.shape[-1] > 1:
            h = x.shape[-1] // 2
            x = x[..., :h] + x[..., h:]
        out = x[..., 0]
    if keepdims:
        out = jnp.expand_dims(out, axis if axis >= 0 else out.ndim + 1 + axis)
    return out


def fixed_mean(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """`fixed_sum(x) * (1 / n)`."""
    x = jnp.asarray(x)
    n = x.shape[axis]
    return mul(fixed_sum(x, axis, keepdims), jnp.asarray(1 / n, x.dtype))


# Terms up to which `ordered_sum` is a straight chain of adds (beyond: a loop over groups of terms,
# which compiles in constant time; decode attention at 128K context sums 2049 tiles).
ORDERED_SUM_UNROLLED = 4096


def ordered_sum(x: jax.Array, axis: int = 0) -> jax.Array:
    """Sum over `axis` strictly in index order: ((x0 + x1) + x2) + ... Leading or trailing exact zeros
    change nothing, so a path that holds more (all-zero) terms gets the same bits."""
    x = settle(jnp.moveaxis(jnp.asarray(x), axis, 0))
    n = x.shape[0]
    if n == 0:
        return jnp.zeros(x.shape[1:], x.dtype)
    unroll = 64
    if n <= ORDERED_SUM_UNROLLED:
        # A straight chain, cut every `unroll` terms into fusions of their own (`materialized`): XLA:CPU
        # runs a fusion of a few hundred terms, or a loop over groups of terms, several times slower.
        acc = x[0]
        for j in range(1, n):
            acc = acc + x[j]
            if j % unroll == unroll - 1 and j < n - 1 and acc.size:
                acc = materialized(acc)
        return acc
    groups = -(-n // unroll)
    x = jnp.pad(x, [(0, groups * unroll - n)] + [(0, 0)] * (x.ndim - 1))  # trailing zeros: no effect

    def group(acc, chunk):
        for j in range(unroll):
            acc = acc + chunk[j]
        return acc, None

    acc, _ = lax.scan(group, jnp.zeros(x.shape[1:], x.dtype), x.reshape((groups, unroll) + x.shape[1:]))
    return acc


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """float32 softmax over `axis` with `exp` and `fixed_sum`; a slice that is all -inf gives zeros."""
    x = jnp.asarray(x, jnp.float32)
    m = jnp.max(x, axis=axis, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = exp(x - m)
    s = fixed_sum(e, axis, keepdims=True)
    return jnp.where(s > 0, div(e, jnp.where(s > 0, s, 1.0)), 0.0)


def rms_scale(x: jax.Array, eps: float) -> jax.Array:
    """float32 1 / sqrt(mean(x**2) + eps) over the last axis, keepdims (the core of every RMSNorm)."""
    x32 = jnp.asarray(x).astype(jnp.float32)
    return rsqrt(fixed_mean(x32 * x32, -1, keepdims=True) + eps)


# -------------------------------------------------------------------------------------- matmuls
def min_rows(*dtypes) -> int:
    """The fewest rows a product of operands of `dtypes` may have and keep its per-element order:
    `F32_MIN_ROWS` when any operand is float32, else `MIN_ROWS`. Pass it as `batched_matmul`'s
    `rows_floor` where the row count of a product differs between paths."""
    return F32_MIN_ROWS if any(jnp.dtype(d) == jnp.float32 for d in dtypes) else MIN_ROWS


def tile_rows_floor(dtype, k: int, n: int, rows: int | None = None) -> int:
    """`batched_matmul`'s `rows_floor` for [G, M, k] x [G, k, n] products of `dtype` whose row count M
    differs between paths: up to `rows` (a tile's), or without bound (None). `MIN_ROWS` where products
    of 2 rows and more share one order (every dtype but float32; float32 where
    `matmul_rows.batched_floor` measured it), else `F32_MIN_ROWS`. A decode step's one row then costs a
    2-row product, not a 64-row one."""
    if jnp.dtype(dtype) != jnp.float32 or k < 1 or n < 1:  # (an empty product: nothing to order)
        return MIN_ROWS
    return matmul_rows.batched_floor(k, n, matmul_rows.ANY_ROWS if rows is None else rows)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N] -> float32 [..., N], accumulated in float32 by a kernel whose per-element
    order does not depend on the number of rows (`matmul_rows`: rows padded to `MIN_ROWS`; a float32
    product cut into row blocks where the backend's kernels change order with the row count). The
    operands must share a dtype."""
    return _rows_matmul(x, w, rhs_transposed=False)


def linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """y = x @ weight.T with a PyTorch-layout weight [out, in]; x [..., in] -> [..., out] in x.dtype
    (float32 accumulation, one rounding; see `matmul`)."""
    return _rows_matmul(x, weight.astype(x.dtype), rhs_transposed=True).astype(x.dtype)


def _rows_matmul(x: jax.Array, w: jax.Array, rhs_transposed: bool) -> jax.Array:
    lead, k = x.shape[:-1], x.shape[-1]
    rows = 1
    for d in lead:
        rows *= d
    n = w.shape[0] if rhs_transposed else w.shape[1]
    if min_rows(x.dtype, w.dtype) == F32_MIN_ROWS:
        plan = matmul_rows.row_plan(k, n)
    else:
        plan = matmul_rows.RowPlan(block=None, floor=MIN_ROWS)
    y = matmul_rows.rows_product(x.reshape(rows, k), w, rhs_transposed, plan)
    return y.reshape(*lead, n)


# ------------------------------------------------------------------------------------ attention
class KeyTiles(NamedTuple):
    """One source of keys for `attend`, cut into tiles of `KEY_TILE` keys.

    k, v: [N, Qk, T, KEY_TILE, Hkv, D] (Qk = 1: the tiles are shared by all Q queries of row n; Qk = Q:
      each query has its own tiles, e.g. a sparse layer's picked entries). v may be k (K = V rows).
    valid: bool[N, Q, T, KEY_TILE]: key s of tile t is attended by query q of row n. Invalid keys must
      hold finite values (zeros), so that they contribute exact zeros.
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array


def tiles_from_rows(rows: jax.Array, first: jax.Array, total: int) -> jax.Array:
    """Aligned tiles over a run of consecutive rows. rows [N, R, ...] hold positions first[n] + i;
    returns [N, T, KEY_TILE, ...] covering positions [base, base + T * KEY_TILE) with base = the tile
    boundary at or below first[n] and T = tiles needed for `total` positions from any alignment
    (`tile_count(total)`). Positions outside the run hold zeros."""
    n, r = rows.shape[:2]
    t = tile_count(total)
    first = jnp.asarray(first, jnp.int32).reshape(-1)
    base = (first // KEY_TILE) * KEY_TILE
    idx = (base - first)[:, None] + jnp.arange(t * KEY_TILE, dtype=jnp.int32)[None, :]  # [N, T*KT]
    ok = (idx >= 0) & (idx < r)
    got = jnp.take_along_axis(rows, jnp.clip(idx, 0, r - 1).reshape((n, t * KEY_TILE) + (1,) * (rows.ndim - 2)), axis=1)
    got = jnp.where(ok.reshape(ok.shape + (1,) * (rows.ndim - 2)), got, jnp.zeros((), rows.dtype))
    return got.reshape((n, t, KEY_TILE) + rows.shape[2:])


def tile_count(total: int) -> int:
    """Tiles that cover `total` consecutive positions starting anywhere (one more than the exact cover
    when they do not start on a tile boundary)."""
    return -(-max(total, 1) // KEY_TILE) + 1


def tile_positions(first: jax.Array, tiles: int) -> jax.Array:
    """int32[N, tiles, KEY_TILE] absolute positions of the tiles `tiles_from_rows` builds from `first`."""
    base = (jnp.asarray(first, jnp.int32).reshape(-1) // KEY_TILE) * KEY_TILE
    return base[:, None, None] + jnp.arange(tiles * KEY_TILE, dtype=jnp.int32).reshape(1, tiles, KEY_TILE)


def pad_tiles(x: jax.Array, axis: int, tile: int = KEY_TILE, min_tiles: int = 1) -> jax.Array:
    """Zero-pad `axis` to a multiple of `tile` (at least `min_tiles` tiles) and split it into [T, tile]
    (index order kept)."""
    axis = axis % x.ndim
    n = x.shape[axis]
    t = max(min_tiles, -(-n // tile))
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, t * tile - n)
    x = jnp.pad(x, pad)
    return x.reshape(x.shape[:axis] + (t, tile) + x.shape[axis + 1 :])


def batched_matmul(a: jax.Array, b: jax.Array, rows_floor: int | None = None) -> jax.Array:
    """a [..., M, K] @ b [..., K, N] -> float32 [..., M, N] over the shared leading (batch) dimensions:
    independent products that XLA hands to one kernel each (a batch of one, or fewer than
    `rows_floor` rows (default `MIN_ROWS`), is padded: either would take another kernel). Each
    product's elements are the same bits whatever the batch is. The batch dimensions stay separate
    (not merged by a reshape), so a mesh that splits one of them (attention heads) splits the products
    without moving data. Pass `rows_floor=tile_rows_floor(...)` for products whose row count varies
    between paths (float32 kernels may change with it; attention's tiles are small enough not to)."""
    lead = a.shape[:-2]
    m = a.shape[-2]
    one = all(d == 1 for d in lead)
    if one:  # a batch of one drops out of the product: pad the first batch dimension to two
        a = jnp.pad(a, [(0, 1)] + [(0, 0)] * (a.ndim - 1)) if lead else a[None].repeat(2, 0)
        b = jnp.pad(b, [(0, 1)] + [(0, 0)] * (b.ndim - 1)) if lead else b[None].repeat(2, 0)
    floor = MIN_ROWS if rows_floor is None else rows_floor
    if m < floor:
        a = jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, floor - m), (0, 0)])
    nb = a.ndim - 2
    dims = (((nb + 1,), (nb,)), (tuple(range(nb)), tuple(range(nb))))
    out = lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)[..., :m, :]
    if one:
        out = out[:1] if lead else out[0]
    return out


def materialized(x: jax.Array) -> jax.Array:
    """x, computed once into a buffer of its own. XLA fuses an array's elementwise producers into its
    consumers, duplicating them; into a broadcast over T tiles that recomputes them T times (the
    query norm and rotary of a decode step at 8K context: 131 times, more time than the rest of
    its attention). XLA:CPU drops `optimization_barrier` before fusion, so the value passes through
    a `lax.cond` on a predicate XLA cannot fold (its value is always true), which it does not fuse
    across. Bits unchanged."""
    first = x.ravel()[0].astype(jnp.float32)
    always = jnp.isfinite(first) | jnp.isnan(first) | jnp.isinf(first)  # true for every float
    return lax.cond(always, lambda v: v, jnp.zeros_like, x)


def _scores(q: jax.Array, src: KeyTiles) -> jax.Array:
    """float32 q . k per tile: q [N, Q, H, G, D] -> [N, Q, T, H, G, KT], as products of KEY_TILE columns
    batched over (row, tile, head) (the tile is a batch dimension: the column count never changes)."""
    n, nq, h, g, d = q.shape
    t = src.k.shape[2]
    if src.k.shape[1] == 1:  # shared tiles: one product of the Q * G query rows per (row, tile, head)
        return _products_tm(_query_rows(q, t), src, q.shape).transpose(0, 3, 1, 2, 4, 5)
    q = materialized(q)
    qm = jnp.broadcast_to(q[:, :, None], (n, nq, t, h, g, d))
    km = src.k.transpose(0, 1, 2, 4, 5, 3)  # [N, Q, T, H, D, KT]
    return batched_matmul(qm, km)


def _values(p: jax.Array, src: KeyTiles) -> jax.Array:
    """Per-tile value products: p [N, Q, T, H, G, KT] (v.dtype) -> float32 [N, Q, T, H, G, D]."""
    if src.v.shape[1] == 1:
        return _values_tm(p.transpose(0, 2, 3, 1, 4, 5), src).transpose(0, 3, 1, 2, 4, 5)
    vm = src.v.transpose(0, 1, 2, 4, 3, 5)  # [N, Q, T, H, KT, D]
    return batched_matmul(p, vm)


def attend(
    q: jax.Array,
    sources: Sequence[KeyTiles],
    *,
    scale: float,
    sinks: jax.Array | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Softmax attention of q over the tiles of `sources` (in order), one softmax over all of them.

    q: [N, Q, Hkv, G, D] (G query heads per KV head); sources: `KeyTiles` with matching N, Q, Hkv, D;
    scale: logit scale; sinks: float32[Hkv * G] per-head logits that join the denominator only, or
    None; softcap: logits -> softcap * tanh(logits / softcap), or None.
    Returns [N, Q, Hkv, G, D] in q.dtype; a query that sees nothing (and no sink) gets zeros.

    The order is the contract: scores per tile; the max over every visible score and the sink (exact);
    p = exp(s - max) (`exp`); per tile the sum of p (`fixed_sum`) and p (in v's dtype) times the tile's
    values (float32); the tiles added in order (`ordered_sum`), sources one after the other, the sink's
    term last; out = o / l. Any path that presents the same visible keys in the same tiles gets the
    same bits, however many other (invisible) tiles it holds.
    """
    _, _, h, g, _ = q.shape
    sink = None if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(h, g)
    shared = all(src.k.shape[1] == 1 and src.v.shape[1] == 1 for src in sources)
    layout = TILE_MAJOR if shared else PER_QUERY
    walk = _attend_blocked if sum(_score_elements(q, src) for src in sources) > BLOCKED_SCORES else _attend_whole
    return walk(q, sources, scale=scale, sink=sink, softcap=softcap, layout=layout)


# Scores ([N, Q, T, H, G, KEY_TILE] float32 elements) above which `attend` walks the key tiles in blocks
# instead of materializing every score at once (a 512-query prefill chunk at 8K context: 35M scores,
# several passes over ~140 MB each). The bits are the same either way.
BLOCKED_SCORES = 1 << 22
# Scores per block of the blocked walk (a block holds at least one tile).
BLOCK_SCORES = 1 << 21


def _score_elements(q: jax.Array, src: KeyTiles) -> int:
    n, nq, h, g, _ = q.shape
    return n * nq * h * g * src.k.shape[2] * src.k.shape[3]


def _masked_scores(q: jax.Array, src: KeyTiles, scale: float, softcap: float | None) -> jax.Array:
    """Scaled (and soft-capped) scores [N, Q, T, H, G, KT], -inf where a key is not visible."""
    return _masked(_scores(q, src), src.valid[:, :, :, None, None, :], scale, softcap)


def _masked(s: jax.Array, valid: jax.Array, scale: float, softcap: float | None) -> jax.Array:
    s = mul(s, jnp.float32(scale))
    if softcap is not None:
        s = mul(jnp.float32(softcap), tanh(s / jnp.float32(softcap)))
    return jnp.where(valid, s, -jnp.inf)


def _normalized(q: jax.Array, l: jax.Array, o: jax.Array, shift: jax.Array, sink: jax.Array | None) -> jax.Array:
    if sink is not None:
        l = l + exp(sink - shift)
    out = jnp.where(l[..., None] > 0, div(o, jnp.where(l > 0, l, 1.0)[..., None]), 0.0)
    return out.astype(q.dtype)


def _tile_blocks(src: KeyTiles, per: int):
    """src's T tiles in blocks of `per` (the last padded with invisible zero tiles, which add exact
    zeros): block(i) -> KeyTiles of tiles [i * per, (i + 1) * per)."""
    t = src.k.shape[2]
    pad = -(-t // per) * per - t

    def padded(x):
        return jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3)) if pad else x

    k, valid = padded(src.k), padded(src.valid)
    v = k if src.v is src.k else padded(src.v)

    def block(i):
        take = functools.partial(lax.dynamic_slice_in_dim, start_index=i * per, slice_size=per, axis=2)
        kb = take(k)
        return KeyTiles(kb, kb if v is k else take(v), take(valid))

    return block


def _tile_max(s: jax.Array, tile_axis: int = 2) -> jax.Array:
    """max of scores [N, Q, T, H, G, KT] over T and KT, as halvings of elementwise maxima (one loop
    fusion; XLA:CPU lowers the two-axis `jnp.max` to a slow reduce-window). Exact in any order.
    tile_axis=1: scores laid out tile-major, [N, T, H, Q, G, KT] -> [N, H, Q, G]."""
    for axis in (5, tile_axis):
        while s.shape[axis] > 1:
            n = s.shape[axis]
            h = n // 2
            lo = lax.slice_in_dim(s, 0, h, axis=axis)
            hi = lax.slice_in_dim(s, h, 2 * h, axis=axis)
            top = jnp.maximum(lo, hi)
            if n % 2:
                top = jnp.concatenate([top, lax.slice_in_dim(s, 2 * h, n, axis=axis)], axis=axis)
            s = top
    return s.reshape(s.shape[:tile_axis] + s.shape[tile_axis + 1 : 5])


def _live_blocks(valid: jax.Array, per: int) -> tuple[jax.Array, jax.Array]:
    """The blocks of `per` tiles (of valid [N, Q, T, KT]) that hold a visible key: int32 (first, end),
    first == end when none does. Blocks outside hold invisible keys only, whose terms are exact zeros
    (and -inf to the max), so walking [first, end) gives the bits of walking every block."""
    t = valid.shape[2]
    seen = jnp.any(valid, axis=(0, 1, 3))  # [T]
    any_seen = jnp.any(seen)
    first_tile = jnp.argmax(seen).astype(jnp.int32)
    end_tile = (t - jnp.argmax(seen[::-1])).astype(jnp.int32)
    first = jnp.where(any_seen, first_tile // per, 0)
    end = jnp.where(any_seen, (end_tile + per - 1) // per, 0)
    return first, end


# ---------------------------------------------------------------------------- the scores' layouts
# `attend`'s walks (at once, or over blocks of tiles) run in one of two layouts of the scores, with the
# same arithmetic element for element: the same products, the same exact maxima, the same sums in the
# same order; only where values lie differs. PER_QUERY lays scores out [N, Q, T, H, G, KT] and serves
# any sources (a sparse layer's picks: tiles per query). TILE_MAJOR, for sources whose tiles every query
# of a row shares (every other path), keeps them [N, T, H, Q, G, KT] as the score products write them:
# the exp, the per-tile sums and the value products read them there and only the [N, H, Q, G(, D)]
# totals are transposed back; the query rows a tile's product multiplies are broadcast once per call (a
# blocked walk: once, not once per block and pass).
class _ScoreLayout(NamedTuple):
    tile_axis: int  # of the scores, and of the per-tile sums and value products
    source: Callable  # KeyTiles -> KeyTiles as the layout's `scores` takes them
    query_rows: Callable  # (q, tiles) -> what `scores` multiplies
    scores: Callable  # (rows, src, q.shape, scale, softcap) -> masked scores
    values: Callable  # (p in v.dtype, src) -> float32 value products
    totals: Callable  # q.shape -> the shape of the running max and sum
    shift: Callable  # (max, sink) -> (shift [N, Q, H, G], the same broadcast against the scores)
    finish: Callable  # (q, l, o, shift, sink) -> out [N, Q, H, G, D]


def _shift(m: jax.Array, sink: jax.Array | None) -> jax.Array:
    """The running max [N, Q, H, G] (and the sink) -> the exp's shift: the max, 0 where nothing is seen."""
    if sink is not None:
        m = jnp.maximum(m, sink)
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _query_rows(q: jax.Array, tiles: int) -> jax.Array:
    """q [N, Q, H, G, D] -> [N, tiles, H, Q * G, D]: a score product's rows, one copy per tile."""
    n, nq, h, g, d = q.shape
    qm = materialized(q).transpose(0, 2, 1, 3, 4).reshape(n, 1, h, nq * g, d)
    return jnp.broadcast_to(qm, (n, tiles, h, nq * g, d))


def _products_tm(qm, src: KeyTiles, q_shape) -> jax.Array:
    """float32 q . k of shared tiles, tile-major: qm from `_query_rows` -> [N, T, H, Q, G, KT]."""
    n, nq, h, g, _ = q_shape
    t, kt = src.k.shape[2:4]
    km = src.k[:, 0].transpose(0, 1, 3, 4, 2)  # [N, T, H, D, KT]
    return batched_matmul(qm, km).reshape(n, t, h, nq, g, kt)


def _scores_tm(qm, src: KeyTiles, q_shape, scale: float, softcap: float | None) -> jax.Array:
    """Masked scores tile-major: qm from `_query_rows`, src.valid [N, 1, T, Q, KT] -> [N, T, H, Q, G, KT]."""
    return _masked(_products_tm(qm, src, q_shape), src.valid[:, 0][:, :, None, :, None, :], scale, softcap)


def _values_tm(p: jax.Array, src: KeyTiles) -> jax.Array:
    """`_values` tile-major: p [N, T, H, Q, G, KT] (v.dtype) -> float32 [N, T, H, Q, G, D]."""
    n, t, h, nq, g, kt = p.shape
    vm = src.v[:, 0].transpose(0, 1, 3, 2, 4)  # [N, T, H, KT, D]
    return batched_matmul(p.reshape(n, t, h, nq * g, kt), vm).reshape(n, t, h, nq, g, -1)


def _shift_pq(m: jax.Array, sink: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    shift = _shift(m, sink)
    return shift, shift[:, :, None, :, :, None]


def _shift_tm(m_tm: jax.Array, sink: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    shift = _shift(m_tm.transpose(0, 2, 1, 3), sink)
    return shift, shift.transpose(0, 2, 1, 3)[:, None, :, :, :, None]


PER_QUERY = _ScoreLayout(
    tile_axis=2,
    source=lambda src: src,
    query_rows=lambda q, tiles: q,
    scores=lambda q, src, q_shape, scale, softcap: _masked_scores(q, src, scale, softcap),
    values=_values,
    totals=lambda q_shape: q_shape[:4],
    shift=_shift_pq,
    finish=_normalized,
)
TILE_MAJOR = _ScoreLayout(
    tile_axis=1,
    source=lambda src: KeyTiles(src.k, src.v, src.valid.transpose(0, 2, 1, 3)[:, None]),  # T on axis 2
    query_rows=_query_rows,
    scores=_scores_tm,
    values=_values_tm,
    totals=lambda q_shape: (q_shape[0], q_shape[2], q_shape[1], q_shape[3]),
    shift=_shift_tm,
    finish=lambda q, l, o, shift, sink: _normalized(q, l.swapaxes(1, 2), o.swapaxes(1, 2), shift, sink),
)


def _attend_whole(q, sources, *, scale, sink, softcap, layout: _ScoreLayout = PER_QUERY):
    """`attend` with every score at once."""
    ax = layout.tile_axis
    srcs = [layout.source(src) for src in sources]
    scores = [layout.scores(layout.query_rows(q, src.k.shape[2]), src, q.shape, scale, softcap) for src in srcs]
    shift, shift_b = layout.shift(functools.reduce(jnp.maximum, [_tile_max(s, ax) for s in scores]), sink)
    l_parts, o_parts = [], []
    for s, src in zip(scores, srcs, strict=True):
        p = exp(s - shift_b)  # masked: exp(-inf) = 0
        l_parts.append(fixed_sum(p, axis=-1))  # per tile
        o_parts.append(layout.values(p.astype(src.v.dtype), src))
    l = ordered_sum(jnp.concatenate(l_parts, axis=ax), axis=ax)
    o = ordered_sum(jnp.concatenate(o_parts, axis=ax), axis=ax)
    return layout.finish(q, l, o, shift, sink)


def _attend_blocked(q, sources, *, scale, sink, softcap, layout: _ScoreLayout = PER_QUERY):
    """`attend` over blocks of key tiles, two passes (bit for bit the same result): the max over every
    visible score, block by block (exact in any order); then per block p = exp(s - max) and each tile's
    sum and value product, added to running totals tile after tile — the `ordered_sum` order. Only the
    blocks holding a visible key are walked (`_live_blocks`): a prefill chunk that reads a bucket of
    8192 keys of which it sees 4608 scores 4608."""
    n, nq, h, g, d = q.shape
    ax = layout.tile_axis
    walks = []
    for src in sources:
        per = max(1, min(src.k.shape[2], BLOCK_SCORES // max(1, n * nq * h * g * src.k.shape[3])))
        first, end = _live_blocks(src.valid, per)
        rows = materialized(layout.query_rows(q, per))  # broadcast once for both passes
        walks.append((_tile_blocks(layout.source(src), per), first, end, rows))
    m = jnp.full(layout.totals(q.shape), -jnp.inf, jnp.float32)
    for block, first, end, rows in walks:

        def top(i, m, block=block, rows=rows):
            return jnp.maximum(m, _tile_max(layout.scores(rows, block(i), q.shape, scale, softcap), ax))

        m = lax.fori_loop(first, end, top, m)
    shift, shift_b = layout.shift(m, sink)
    totals = (jnp.zeros(m.shape, jnp.float32), jnp.zeros((*m.shape, d), jnp.float32))
    for block, first, end, rows in walks:

        def add(i, totals, block=block, rows=rows):
            blk = block(i)
            p = exp(layout.scores(rows, blk, q.shape, scale, softcap) - shift_b)
            lt = settle(fixed_sum(p, axis=-1))  # per tile
            ot = settle(layout.values(p.astype(blk.v.dtype), blk))
            l, o = totals
            for j in range(lt.shape[ax]):
                l, o = l + lax.index_in_dim(lt, j, ax, False), o + lax.index_in_dim(ot, j, ax, False)
            return l, o

        totals = lax.fori_loop(first, end, add, totals)
    return layout.finish(q, *totals, shift, sink)


def paged_rows(
    page_table: jax.Array, lengths: jax.Array, span: int, page_size: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where the tiles of each sequence's last `span` positions lie in a paged pool (see `paged_tiles`):
    int32 (pages, rows) and bool valid, each [B, T, KEY_TILE]; invalid positions point at row 0 of page 0."""
    pages_per_seq = page_table.shape[1]
    first = lengths - span
    positions = tile_positions(first, tile_count(span))  # [B, T, KT]
    valid = (positions >= jnp.maximum(first, 0)[:, None, None]) & (positions < lengths[:, None, None])
    safe = jnp.where(valid, positions, 0)
    logical = (safe // page_size) % pages_per_seq
    pages = jnp.where(
        valid,
        jnp.take_along_axis(page_table, logical.reshape(page_table.shape[0], -1), axis=1).reshape(logical.shape),
        0,
    )
    return pages, safe % page_size, valid


def paged_tiles(pool: jax.Array, page_table: jax.Array, lengths: jax.Array, span: int) -> tuple[jax.Array, jax.Array]:
    """The tiles holding each sequence's last `span` positions, read from a paged pool by absolute position.

    pool: [num_pages, page_size, row]; page_table: int32[B, pages_per_seq] (position p at row p %
    page_size of page `page_table[b, (p // page_size) % pages_per_seq]`, a ring if short); lengths:
    int32[B] tokens per sequence (the newest at t = lengths - 1). Returns (rows [B, T, KEY_TILE, row],
    valid bool[B, T, KEY_TILE]) over T = `tile_count(span)` tiles from the tile boundary at or below
    t + 1 - span: valid where t + 1 - span <= p <= t and p >= 0; invalid rows are zeros."""
    pages, rows, valid = paged_rows(page_table, lengths, span, pool.shape[1])
    got = pool[pages, rows]
    return jnp.where(valid[..., None], got, jnp.zeros((), got.dtype)), valid


def paged_head_tiles(
    pool: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    span: int,
    head_dim: int,
    heads: Sequence[tuple[int, int]],
) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """`paged_tiles` read head by head: pool rows [row] hold heads of `head_dim` ([K heads | V heads]);
    `heads` are (start, count) pairs of head indices to read. Returns (one [B, T, count, KEY_TILE,
    head_dim] array per pair, head-major: a head's keys are contiguous, as the value product reads
    them, with no transpose of the gathered tiles; invalid rows zero, valid bool[B, T, KEY_TILE]).
    The values are those of `paged_tiles`; only their arrangement differs."""
    pages, rows, valid = paged_rows(page_table, lengths, span, pool.shape[1])
    by_head = pool.reshape(pool.shape[0], pool.shape[1], -1, head_dim)
    out = []
    for start, count in heads:
        h = start + jnp.arange(count, dtype=jnp.int32)[None, None, :, None]
        got = by_head[pages[:, :, None, :], rows[:, :, None, :], h]  # [B, T, count, KT, D]
        out.append(jnp.where(valid[:, :, None, :, None], got, jnp.zeros((), got.dtype)))
    return tuple(out), valid


def entry_tiles(rows: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """rows [B, E, ...] and valid bool[B, E] (entries in index order) -> ([B, T, KEY_TILE, ...], bool[B, T,
    KEY_TILE]) with invalid rows zeroed (entry e in tile e // KEY_TILE)."""
    rows = jnp.where(valid.reshape(valid.shape + (1,) * (rows.ndim - 2)), rows, jnp.zeros((), rows.dtype))
    return pad_tiles(rows, 1), pad_tiles(valid, 1)


def _two_rows(x: jax.Array) -> jax.Array:
    """Pad a leading axis of 1 to 2 (a batch of one drops out of a product: another kernel)."""
    return jnp.pad(x, [(0, 1)] + [(0, 0)] * (x.ndim - 1)) if x.shape[0] == 1 else x


# Entries per indexer product: the entry axis is cut into tiles of this many columns (a batch dimension
# beyond), so every product has one shape whatever the entry count (a decode step scores the cache's
# capacity, a prefill chunk its read bucket: the kernel's order may change with the column count).
INDEXER_TILE = 256


def indexer_scores(q: jax.Array, weights: jax.Array, keys: jax.Array, scale: float) -> jax.Array:
    """Lightning-indexer scores  scale * sum_h w[h] * relu(q_h . k_e), in this module's order.

    q: [N, Q, H, Dh] (keys' dtype); weights: [N, Q, H] (float32); keys: [N, E, Dh] shared by the Q
    queries and H heads of a row. The dot products accumulate in float32: per row, one product of the
    H * Q (head, query) rows (heads major) with each tile of `INDEXER_TILE` keys (tiles batched; the
    keys are not copied per head), rows padded to `tile_rows_floor`; the head sum is a `fixed_sum`.
    Returns float32[N, Q, E]."""
    n, nq, h, d = q.shape
    e = keys.shape[1]
    # >= 2 tiles: with one, XLA hands bfloat16 another kernel
    km = pad_tiles(keys.astype(q.dtype), 1, INDEXER_TILE, min_tiles=2).transpose(0, 1, 3, 2)  # [N, T, Dh, tile]
    t = km.shape[1]
    rows = materialized(q.transpose(0, 2, 1, 3).reshape(n, 1, h * nq, d))  # heads major: a mesh splits them
    floor = tile_rows_floor(q.dtype, d, INDEXER_TILE)  # rows: H in decode, H x a chunk's queries in prefill
    dots = batched_matmul(jnp.broadcast_to(rows, (n, t, h * nq, d)), km, floor)  # [N, T, H * Q, tile]
    dots = dots.reshape(n, t, h, nq, INDEXER_TILE).transpose(0, 3, 2, 1, 4).reshape(n, nq, h, t * INDEXER_TILE)
    dots = dots[..., :e]  # [N, Q, H, E]
    w = weights.astype(jnp.float32)[..., None]
    return fixed_sum(jnp.maximum(dots, 0.0) * w, axis=2) * jnp.float32(scale)
