"""The byte stage of a restore plan (stage 4): a snapshot whose window rows changed after it was
recorded is refused (`Reason.CHECKSUM`), whatever single element changed and whatever its dtype."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hkv.core import prefix as px
from hkv.core import transitions as tr
from hkv.core.layout import CacheConfig, CacheLayout, Status
from hkv.core.reasons import Reason
from hkv.core.spec import CacheSpec, LayerSpec
from tests.hkv.core.chains import record_chain
from tests.hkv.core.test_state_machine import Harness

BT = 8
BLOCKS = 3


def _snapshotted_chain(dtype: str):
    """A released slot's BLOCKS blocks recorded with snapshots (window-6 layers of 4 dims in `dtype`).
    Returns (layout, cache, keys, tokens, the last block's record)."""
    spec = CacheSpec(layers=tuple(LayerSpec(4, 6) for _ in range(2)), block_tokens=BT, dtype=dtype, model_id="csum")
    layout = CacheLayout(spec, CacheConfig(slots=2, max_context=48, page_size=4, prefix_records=8))
    h = Harness(layout)
    s = h.claim()
    assert h.append([(s, BLOCKS * BT)]) == Status.OK
    cache, keys, toks, last = record_chain(layout, h.cache, s, BLOCKS, retain=True)
    cache, _ = tr.release_slot(layout, cache, jnp.int32(s))
    return layout, cache, keys, toks, last


def _flip_low_bit(pool: jnp.ndarray, layer: int, page: int, row: int, col: int) -> jnp.ndarray:
    """pool with the lowest bit of one element flipped (the smallest change its dtype can hold)."""
    a = np.array(pool)
    word = a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])
    word[layer, page, row, col] ^= 1
    return jnp.asarray(a)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_changed_window_element_fails_the_byte_stage(dtype):
    layout, cache, keys, toks, last = _snapshotted_chain(dtype)
    cache, slot, st = tr.claim_slot(layout, cache)
    assert int(st) == Status.OK
    _, plan = px.restore(layout, cache, slot, jnp.asarray(keys), jnp.asarray(toks), jnp.int32(BLOCKS))
    v = plan.host()
    assert (v.status, v.byte_blocks, v.reason) == (Status.OK, BLOCKS, 0)
    # the newest row of the longest boundary's window: only that boundary's snapshot covers it
    length = int(cache.prefix.length[last])
    hi = length // layout.groups[0].unit
    first = int(px.record_first_page(layout, 0, length, np))  # the record's entries start at its window
    page = int(cache.prefix.pages[0][last][(hi - 1) // layout.page_size - first])
    for col in (0, layout.groups[0].dim - 1):
        pool = _flip_low_bit(cache.groups[0].pool, 1, page, (hi - 1) % layout.page_size, col)
        bad = cache.replace(groups=(cache.groups[0].replace(pool=pool),) + tuple(cache.groups[1:]))
        _, plan = px.restore(layout, bad, slot, jnp.asarray(keys), jnp.asarray(toks), jnp.int32(BLOCKS))
        v = plan.host()
        assert v.reason == Reason.CHECKSUM.code and v.first_failed_stage == 4, (col, v)
        assert v.byte_blocks < BLOCKS
