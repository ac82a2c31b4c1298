"""Builders of paged test data: dense per-sequence rows scattered into a pool through a random page table.

Used by the tests and benchmarks of this package, and usable by the cache's own tests. numpy only;
nothing here runs on device.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import ml_dtypes  # noqa: F401  (registers "bfloat16" with numpy)
import numpy as np

# The kernel backends the tests run, and whether through the Pallas interpreter. Default: both
# kernels, interpreted, on CPU. On a GPU machine the device check sets
# PALLAS_KERNELS_TEST_BACKENDS=gpu PALLAS_KERNELS_TEST_INTERPRET=0 to run the compiled kernels.
KERNEL_BACKENDS = tuple(os.environ.get("PALLAS_KERNELS_TEST_BACKENDS", "gpu,tpu").split(","))
INTERPRET = os.environ.get("PALLAS_KERNELS_TEST_INTERPRET", "1") != "0"


def page_rows(
    dense: np.ndarray,
    counts: np.ndarray,
    *,
    page_size: int,
    pages_per_seq: int,
    num_pages: int,
    rng: np.random.Generator,
    keep: Callable[[int, int], bool] | None = None,
    poison: float = np.nan,
    unallocated: int = -1,
) -> tuple[np.ndarray, np.ndarray]:
    """Scatters `dense[b, :counts[b]]` into a pool of randomly chosen physical pages.

    Args:
      dense: [batch, rows, dim] logical rows of each sequence (row p = position / entry p).
      counts: int[batch] rows that exist per sequence.
      page_size, pages_per_seq, num_pages: pool geometry.
      rng: source of the random physical page assignment.
      keep: keep(b, logical_page) -> whether that page is allocated (default: every page that holds
        a row below counts[b]). Logical pages not kept get `unallocated` in the page table.
      poison: value of every pool row that holds no kept row (free pages, the tail of a last page).
      unallocated: page-table value of pages that are not allocated.

    Returns:
      (pool [num_pages, page_size, dim] in dense.dtype, page_table int32[batch, pages_per_seq]).
    """
    batch, _, dim = dense.shape
    pool = np.full((num_pages, page_size, dim), poison, dtype=dense.dtype)
    page_table = np.full((batch, pages_per_seq), unallocated, dtype=np.int32)
    free = list(rng.permutation(num_pages))
    for b in range(batch):
        count = int(counts[b])
        for lp in range(min(-(-count // page_size), pages_per_seq)):
            if keep is not None and not keep(b, lp):
                continue
            if not free:
                raise ValueError(f"{num_pages=} is too small for this layout")
            page = int(free.pop())
            page_table[b, lp] = page
            lo, hi = lp * page_size, min((lp + 1) * page_size, count)
            pool[page, : hi - lo] = dense[b, lo:hi]
    return pool, page_table


def ring_page_table(page_table: np.ndarray, lengths: np.ndarray, *, page_size: int, ring: int) -> np.ndarray:
    """The ring form of a window page table: logical page i of sequence b at entry i % ring.

    Keeps, per sequence, the last `ring` logical pages up to the page of position lengths[b] - 1,
    which is what a cache that recycles its window pages holds; other entries are -1.
    """
    batch, _ = page_table.shape
    ring_table = np.full((batch, ring), -1, dtype=np.int32)
    for b in range(batch):
        if lengths[b] <= 0:
            continue
        last = (int(lengths[b]) - 1) // page_size
        for i in range(max(0, last - ring + 1), last + 1):
            ring_table[b, i % ring] = page_table[b, i]
    return ring_table


def softmax_with_sinks_np(q: np.ndarray, rows: np.ndarray, sinks: np.ndarray | None, scale: float) -> np.ndarray:
    """float64 oracle: q [heads, D] over rows [n, D] (K = V) and per-head sink logits."""
    q = q.astype(np.float64)
    rows = rows.astype(np.float64)
    logits = q @ rows.T * scale  # [heads, n]
    sink = np.full((q.shape[0], 1), -np.inf) if sinks is None else sinks.astype(np.float64)[:, None]
    all_logits = np.concatenate([logits, sink], axis=1)
    m = np.max(all_logits, axis=1, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(all_logits - m)
    denom = e.sum(axis=1, keepdims=True)
    denom = np.where(denom == 0.0, 1.0, denom)
    return (e[:, :-1] / denom) @ rows


# Tolerances of a kernel against its reference, and of a reference against the float64 oracle.
# f32: both sides accumulate in f32 with true-f32 products; only summation order differs.
# bf16: inputs are bf16 (exact in f32), the kernel feeds softmax weights to the value matmul in bf16
# (~2**-8 relative each) and the output is rounded to bf16 (2**-8 relative).
TOLERANCES = {
    "float32": dict(atol=1e-5, rtol=1e-5),
    "bfloat16": dict(atol=2e-2, rtol=2e-2),
}


def tolerance(dtype) -> dict:
    """`TOLERANCES` for `dtype` (a dtype, a scalar type such as jnp.bfloat16, or a name)."""
    return TOLERANCES[np.dtype(dtype).name]


def oracle_batch(q: np.ndarray, rows: list[np.ndarray], sinks: np.ndarray | None, scale: float) -> np.ndarray:
    """`softmax_with_sinks_np` per sequence: q [batch, heads, D], rows[b] [n_b, D] (the K = V rows
    sequence b attends, in any order) -> float64 [batch, heads, D]."""
    return np.stack([softmax_with_sinks_np(q[b], rows_b, sinks, scale) for b, rows_b in enumerate(rows)])


def assert_reference_output(out, oracle: np.ndarray, dtype) -> None:
    """A reference's output: in `dtype`, close to the float64 oracle (in float32, at `tolerance(dtype)`)."""
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_allclose(np.asarray(out).astype(np.float32), oracle, **tolerance(dtype))


def assert_kernel_output(out, reference, oracle: np.ndarray, dtype) -> None:
    """A kernel's output against its reference (same shape and dtype, close) and the float64 oracle
    (close), all finite; compared in float32 at `tolerance(dtype)`."""
    assert out.shape == reference.shape and out.dtype == reference.dtype
    out = np.asarray(out).astype(np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, np.asarray(reference).astype(np.float32), **tolerance(dtype))
    np.testing.assert_allclose(out, oracle, **tolerance(dtype))


def window_case(
    rng: np.random.Generator,
    dtype,
    lengths: np.ndarray,
    *,
    heads: int,
    head_dim: int,
    page_size: int,
    window: int,
    pages_per_seq: int,
    num_pages: int,
    poison_outside_window: bool = True,
    with_sinks: bool = True,
) -> dict:
    """Random decode inputs for a sliding-window layer.

    Rows before each window are NaN and pages wholly before it unallocated (-1) when
    `poison_outside_window`, so a kernel that reads outside the window produces NaN (or, in the TPU
    interpreter, an out-of-bounds error). Returns numpy arrays: q, window_pool, window_page_table,
    lengths, sinks (None without sinks) and window_rows (per-sequence list of attended rows).
    """
    batch = len(lengths)
    dense = rng.standard_normal((batch, pages_per_seq * page_size, head_dim)).astype(dtype)
    starts = np.maximum(lengths - window, 0)
    window_rows = [dense[b, starts[b] : lengths[b]].copy() for b in range(batch)]
    keep = None
    if poison_outside_window:
        for b in range(batch):
            dense[b, : starts[b]] = np.nan
        keep = lambda b, lp: (lp + 1) * page_size > starts[b]
    pool, page_table = page_rows(
        dense, lengths, page_size=page_size, pages_per_seq=pages_per_seq, num_pages=num_pages, rng=rng, keep=keep
    )
    return dict(
        q=rng.standard_normal((batch, heads, head_dim)).astype(dtype),
        window_pool=pool,
        window_page_table=page_table,
        lengths=np.asarray(lengths, np.int32),
        sinks=(rng.standard_normal(heads) * 2).astype(np.float32) if with_sinks else None,
        window_rows=window_rows,
    )


def entry_case(
    rng: np.random.Generator,
    dtype,
    used: list[np.ndarray],
    n_written: np.ndarray,
    *,
    dim: int,
    page_size: int,
    pages_per_seq: int,
    num_pages: int,
) -> dict:
    """A randomly paged pool of per-sequence entries (compressed K=V rows or index keys).

    Only the entries listed in `used[b]` hold finite values: every other written entry is NaN, and
    pages holding no used entry are unallocated (-1), so reading anything else shows up. Returns
    numpy arrays pool, page_table, n_written and dense ([batch, capacity, dim], entry values).
    """
    batch = len(used)
    capacity = pages_per_seq * page_size
    values = rng.standard_normal((batch, capacity, dim)).astype(dtype)
    dense = np.full_like(values, np.nan)
    for b in range(batch):
        dense[b, used[b]] = values[b, used[b]]
    used_pages = [set(int(e) // page_size for e in used[b]) for b in range(batch)]
    pool, page_table = page_rows(
        dense,
        n_written,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        num_pages=num_pages,
        rng=rng,
        keep=lambda b, lp: lp in used_pages[b],
    )
    return dict(pool=pool, page_table=page_table, n_written=np.asarray(n_written, np.int32), dense=dense)


def compressed_decode_args() -> list:
    """Valid small arguments of `hca_decode_attention` (float32 q [2, 4, 32], a window pool of 8 pages of
    4 rows with a 3-page table, no sinks, a compressed pool of 8 pages of 2 entries with a 4-page
    table; any window <= 9 fits), as numpy arrays in argument order: a validation test breaks one of
    them (CSA's tests append the picks)."""
    return [
        np.zeros((2, 4, 32), np.float32),
        np.zeros((8, 4, 32), np.float32),
        np.zeros((2, 3), np.int32),
        np.zeros((2,), np.int32),
        None,
        np.zeros((8, 2, 32), np.float32),
        np.zeros((2, 4), np.int32),
        np.zeros((2,), np.int32),
    ]
