"""Builders of paged test data: dense per-sequence rows scattered into a pool through a random page table.

Used by the tests and benchmarks of this package, and usable by the cache's own tests. numpy only;
nothing here runs on device.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


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


def ring_page_table(page_table: np.ndarray, lengths: np.ndarray, *, page_size: int,
                    ring: int) -> np.ndarray:
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


def softmax_with_sinks_np(q: np.ndarray, rows: np.ndarray, sinks: np.ndarray | None,
                          scale: float) -> np.ndarray:
  """float64 oracle: q [heads, D] over rows [n, D] (K = V) and per-head sink logits."""
  q = q.astype(np.float64)
  rows = rows.astype(np.float64)
  logits = q @ rows.T * scale  # [heads, n]
  sink = (np.full((q.shape[0], 1), -np.inf) if sinks is None
          else sinks.astype(np.float64)[:, None])
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
