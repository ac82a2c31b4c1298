"""`hkv.core.layout.set_tail_row`: the conditional TAIL row copy shared by `record`, `restore` (slot <->
snapshot) and `swap_in` (host rows -> slot)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hkv.core.layout import TailState, set_tail_row


def _tails(n: int, ov: int, fill: float) -> TailState:
    return TailState(
        tail_kv=jnp.full((n, 4, 3), fill, jnp.bfloat16),
        tail_gate=jnp.full((n, 4, 3), fill, jnp.bfloat16),
        overlap_kv=jnp.full((n, ov, 2), fill, jnp.bfloat16),
        overlap_gate=jnp.full((n, ov, 2), fill, jnp.float32),
    )


def test_writes_the_row_where_cond_and_keeps_it_otherwise():
    dst, src = _tails(3, 4, 0.0), _tails(2, 4, 1.0)
    src = jax.tree.map(lambda a: a.astype(jnp.float32) * jnp.arange(1, 3).reshape(2, 1, 1), src)  # rows 1, 2
    out = set_tail_row(dst, jnp.int32(2), jnp.bool_(True), src, jnp.int32(1))
    for d, o in zip(jax.tree.leaves(dst), jax.tree.leaves(out), strict=True):
        assert o.dtype == d.dtype and o.shape == d.shape  # cast to dst's dtypes
        np.testing.assert_array_equal(np.asarray(o[2], np.float32), 2.0)
        np.testing.assert_array_equal(np.asarray(o[:2], np.float32), 0.0)
    kept = set_tail_row(dst, jnp.int32(2), jnp.bool_(False), src, jnp.int32(1))
    for d, k in zip(jax.tree.leaves(dst), jax.tree.leaves(kept), strict=True):
        np.testing.assert_array_equal(np.asarray(k, np.float32), np.asarray(d, np.float32))


def test_whole_source_rows_and_skipped_fields():
    dst = _tails(2, 0, 0.0)  # a compressor without overlap: overlap fields have no rows
    src = jax.tree.map(lambda a: a[0], _tails(1, 0, 3.0))  # host rows: no leading dimension
    out = set_tail_row(dst, jnp.int32(1), jnp.bool_(True), src, skip_empty=True)
    np.testing.assert_array_equal(np.asarray(out.tail_kv[1], np.float32), 3.0)
    assert out.overlap_kv is dst.overlap_kv and out.overlap_gate is dst.overlap_gate  # no write traced
    none = _tails(0, 4, 0.0)  # no snapshot slots (tail_snapshots=0): nothing to index
    out = set_tail_row(none, jnp.int32(0), jnp.bool_(True), _tails(2, 4, 1.0), jnp.int32(0))
    assert all(o is n for o, n in zip(jax.tree.leaves(out), jax.tree.leaves(none), strict=True))
    out = set_tail_row(_tails(2, 4, 0.0), jnp.int32(0), jnp.bool_(True), none, jnp.int32(0))
    np.testing.assert_array_equal(np.asarray(out.tail_kv, np.float32), 0.0)
