"""How a float32 matmul is cut into rows so that every row count sums in one order (XLA:CPU).

XLA:CPU hands a dot to YNNPACK, which picks a kernel by shape. In float32 (with
`numerics.compiler_options()`) a product of [M, K] x [K, N] takes one kernel for small M and
another, which sums each element's K products in another order, for large M; where the switch lies
depends on K and N (at K=256, N=1024 rows 2..50 share one order and 51+ another; at K=1024, N=256
every count >= 2 agrees). A decode step multiplies one row per sequence, a prefill chunk hundreds,
the stateless forward thousands: for their logits to be the same bits, all of them must use one
order per element.

`row_plan(k, n)` measures where the small-row order holds for a product of that shape, once per shape
and process: it compiles a small probe program (every operand layout XLA may hand the kernel:
either side transposed) and compares, bit for bit, products of 2 rows with products of 3 .. 512.
The plan it returns is what `numerics.matmul` / `numerics.linear` do:

* one order for every count >= 2 (`block=None`): rows are padded to 2 (a single row takes XLA's
  matrix-vector emitter, another order) and multiplied in one product;
* one order for counts 2..R only (`block=R`, R >= 8): at most R rows are multiplied in one product
  (padded to 2), more rows R at a time. A decode step of one row then costs a 2-row product, not a
  64-row one (the padding this replaces; 4-5x the arithmetic of the weights' read at batch 1);
* neither (`floor=FALLBACK_ROWS`, block None): the small-row kernels do not agree with each other;
  rows are padded to `FALLBACK_ROWS`, from where one kernel was measured to serve every count.

Only float32 on the CPU backend is probed; other dtypes (bfloat16 products agree for any count >= 2)
and other backends use one product padded to 2 rows, or to `FALLBACK_ROWS` rows in float32.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.xla_options import compiler_options

# Rows padded to when the small-row kernels disagree (and for float32 off the CPU backend): the
# large-row kernel that XLA:CPU picks from ~50 rows on serves every count from there.
FALLBACK_ROWS = 64
# Row counts the probe compares against 2-row products (the block candidates are those >= 8).
_COUNTS = (3, 7, 8, 16, 32)
# Larger counts that, if they agree too, mean one order for every count.
_LARGE = (64, 512)
_PROBE_ROWS = 512


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """How float32 products of one (K, N) shape are cut into rows (see the module docstring).

    block: None (any row count in one product) or R (at most R rows per product).
    floor: the fewest rows a product is given (padded with zeros): 2, or `FALLBACK_ROWS`.
    """

    block: int | None
    floor: int


def product(x: jax.Array, w: jax.Array, rhs_transposed: bool) -> jax.Array:
    """x [M, K] @ w -> float32 [M, N]; w is [K, N], or [N, K] with rhs_transposed (contracted on its
    second axis, as a PyTorch-layout weight is): one dot, no padding."""
    dims = (((1,), (1 if rhs_transposed else 0,)), ((), ()))
    return lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)


def _probe_outputs(x, xt, w, wt):
    """Every product the probe compares, for the four operand layouts (x or xt.T, w or wt.T)."""
    outs = []
    for lhs in (x, xt.T):
        for rhs, transposed in ((w, False), (wt, True)):
            pairs = jnp.concatenate([product(lhs[i : i + 2], rhs, transposed) for i in range(0, 32, 2)])
            outs.append(pairs)
            outs.extend(product(lhs[:m], rhs, transposed) for m in _COUNTS + _LARGE)
    return outs


def _plan_of(outs: list[np.ndarray]) -> RowPlan:
    per = 1 + len(_COUNTS) + len(_LARGE)
    block: int | None = None
    for f in range(0, len(outs), per):
        pairs = outs[f]
        counts = zip(_COUNTS + _LARGE, outs[f + 1 : f + per], strict=True)
        same = {m: np.array_equal(o[: min(m, 32)], pairs[: min(m, 32)]) for m, o in counts}
        if not (same[3] and same[7]):
            return RowPlan(block=None, floor=FALLBACK_ROWS)
        if all(same[m] for m in _COUNTS + _LARGE):
            continue  # this layout: one order for every count
        good = [m for m in _COUNTS if m >= 8 and all(same[c] for c in _COUNTS if c <= m)]
        if not good:
            return RowPlan(block=None, floor=FALLBACK_ROWS)
        block = good[-1] if block is None else min(block, good[-1])
    return RowPlan(block=block, floor=2)


@functools.cache
def _probe(k: int, n: int) -> RowPlan:
    rng = np.random.default_rng(k * 100003 + n)
    cpu = jax.local_devices(backend="cpu")[0]  # (with several processes, one of this process)
    x = rng.standard_normal((_PROBE_ROWS, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)

    def run() -> RowPlan:
        args = [jax.device_put(a, cpu) for a in (x, np.ascontiguousarray(x.T), w, np.ascontiguousarray(w.T))]
        outs = jax.jit(_probe_outputs, compiler_options=compiler_options("cpu"))(*args)
        return _plan_of([np.asarray(o) for o in outs])

    return _apart(run)


def _apart(run):
    """run() on a thread of its own: a trace in progress (the caller's jit) is per thread, so a probe
    runs as a program of its own even when a model's matmul asks for its plan while being traced."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hkv-row-probe") as pool:
        return pool.submit(run).result()


def row_plan(k: int, n: int, platform: str | None = None) -> RowPlan:
    """The `RowPlan` of a float32 product [M, k] x [k, n] on `platform` ("cpu", "gpu", "tpu"; None:
    `jax.default_backend()`). On CPU measured once per shape and process (a probe program compiled
    and run on the CPU device, also from inside a trace); elsewhere `RowPlan(None, FALLBACK_ROWS)`."""
    if k < 1 or n < 1:
        raise ValueError(f"k={k}, n={n} must be >= 1")
    platform = platform or jax.default_backend()
    if platform != "cpu":
        return RowPlan(block=None, floor=FALLBACK_ROWS)
    return _probe(int(k), int(n))


# `batched_floor`'s `rows` for products whose row count has no bound (a prefill chunk's queries, the
# stateless forward's): agreement from 2 to this many rows is taken for every count, as `row_plan` does.
ANY_ROWS = _PROBE_ROWS


def batched_floor(k: int, n: int, rows: int = ANY_ROWS, platform: str | None = None) -> int:
    """The fewest rows to give a batched float32 product [G, M, k] x [G, k, n] whose row count M varies
    between paths up to `rows` (a tile's; `ANY_ROWS` when unbounded): 2 when, on the CPU, products of 2
    rows and of every probed count up to `rows` agree bit for bit in two batch sizes (measured once per
    shape and process, like `row_plan`), else `FALLBACK_ROWS` (also off the CPU). With 2, a decode
    step's few rows are not padded to `FALLBACK_ROWS`."""
    if k < 1 or n < 1 or not 2 <= rows <= _PROBE_ROWS:
        raise ValueError(f"k={k}, n={n} must be >= 1 and rows={rows} in [2, {_PROBE_ROWS}]")
    platform = platform or jax.default_backend()
    if platform != "cpu":
        return FALLBACK_ROWS
    return _batched_probe(int(k), int(n), int(rows))


def _counts_to(rows: int) -> tuple[int, ...]:
    return tuple(sorted({m for m in _COUNTS if m <= rows} | {rows}))


def _batched_outputs(x, w):
    """Per batch size (4, 2): 2-row products over x's first rows (up to 32), then one product of each
    probed count (their first rows are compared with the pairs, as `row_plan`'s probe does)."""
    dims = (((2,), (1,)), ((0,), (0,)))
    first = min(32, x.shape[1] - x.shape[1] % 2)
    outs = []
    for g in (4, 2):
        xs, ws = x[:g], w[:g]
        pairs = [
            lax.dot_general(xs[:, i : i + 2], ws, dims, preferred_element_type=jnp.float32) for i in range(0, first, 2)
        ]
        outs.append(jnp.concatenate(pairs, axis=1))
        outs.extend(
            lax.dot_general(xs[:, :m], ws, dims, preferred_element_type=jnp.float32) for m in _counts_to(x.shape[1])
        )
    return outs


@functools.cache
def _batched_probe(k: int, n: int, rows: int) -> int:
    rng = np.random.default_rng(k * 100019 + n * 7 + rows)
    cpu = jax.local_devices(backend="cpu")[0]
    x = rng.standard_normal((4, rows, k)).astype(np.float32)
    w = (rng.standard_normal((4, k, n)) / np.sqrt(k)).astype(np.float32)

    def run() -> int:
        args = [jax.device_put(a, cpu) for a in (x, w)]
        outs = [np.asarray(o) for o in jax.jit(_batched_outputs, compiler_options=compiler_options("cpu"))(*args)]
        per = 1 + len(_counts_to(rows))
        same = np.array_equal(outs[per], outs[0][:2])  # the batch size changes nothing
        for f in (0, per):
            pairs = outs[f]
            for o in outs[f + 1 : f + per]:
                m = min(o.shape[1], pairs.shape[1])
                same = same and np.array_equal(o[:, :m], pairs[:, :m])
        return 2 if same else FALLBACK_ROWS

    return _apart(run)


# Products of more than a block's rows: up to this many blocks are written out as separate dots
# (XLA runs them side by side; a 512-row prefill chunk in 32-row blocks is 16), more run under a
# `lax.map` (one dot in a loop, ~1.5x slower than the separate dots).
_UNROLL_BLOCKS = 16


def rows_product(x: jax.Array, w: jax.Array, rhs_transposed: bool, plan: RowPlan) -> jax.Array:
    """x [M, K] @ w -> float32 [M, N] cut into rows as `plan` says (padding rows are zeros, dropped)."""
    rows, k = x.shape
    if plan.block is None or rows <= plan.block:
        padded = max(rows, plan.floor)
        xp = jnp.pad(x, ((0, padded - rows), (0, 0))) if padded > rows else x
        return product(xp, w, rhs_transposed)[:rows]
    r = plan.block
    g = -(-rows // r)
    xp = jnp.pad(x, ((0, g * r - rows), (0, 0))) if g * r > rows else x
    if g <= _UNROLL_BLOCKS:
        y = jnp.concatenate([product(xp[i * r : (i + 1) * r], w, rhs_transposed) for i in range(g)])
    else:
        y = lax.map(lambda xb: product(xb, w, rhs_transposed), xp.reshape(g, r, k))
        y = y.reshape(g * r, -1)
    return y[:rows]
