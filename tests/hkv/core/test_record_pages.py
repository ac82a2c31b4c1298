"""A prefix record keeps only its own block's pages (issue 47 item 2).

A record used to keep, per group, a row of max_context's logical pages (int32[NR, M_g] page ids
and generations: ~64 KB per record for DeepSeek-V4-Flash at 128K). It now keeps the few pages its
block's rows overlap (a sliding window's pages with its snapshot); a restore assembles the page
table from the chain's records (`hkv.core.prefix.chain_page_row`), taking each page from the last
block that wrote it — which matters when the chain's blocks were written by different sequences,
one restored from the other with a copy-on-write of a partly filled page.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hkv.core import prefix as px
from hkv.core import transitions as tr
from hkv.core.invariants import check_invariants
from hkv.core.layout import CacheConfig, CacheLayout, Status
from hkv.core.prefix_index import init_prefix
from hkv.engine.block_keys import ROOT, key_words, next_key
from models.deepseek_v4 import flash_config
from models.deepseek_v4.cache_spec import cache_spec as v4_cache_spec
from tests.hkv.core.test_state_machine import Harness, deepseek_like_spec, gemma_like_spec

BT = 8


def _bookkeeping_bytes(layout: CacheLayout) -> int:
    """Bytes of one record's page ids and generations, every group."""
    shapes = jax.eval_shape(lambda: init_prefix(layout))
    return sum(int(np.prod(a.shape[1:])) * a.dtype.itemsize for a in (*shapes.pages, *shapes.gens))


def test_a_records_bookkeeping_does_not_grow_with_the_context():
    """V4-Flash's cache spec: the same few entries per group at 32K and 128K, a few hundred bytes."""
    spec = v4_cache_spec(flash_config(), dtype="bfloat16", block_tokens=64)
    small, large = (
        CacheLayout(spec, CacheConfig(slots=1, max_context=n, page_size=64, prefix_records=4, tail_snapshots=1))
        for n in (32768, 131072)
    )
    assert [large.record_pages(g) for g in range(len(large.groups))] == [
        small.record_pages(g) for g in range(len(small.groups))
    ]
    assert _bookkeeping_bytes(large) == _bookkeeping_bytes(small) <= 256
    # what a row of every logical page cost (the layout before): grows with the context
    whole_rows = sum(8 * large.logical_pages(g) for g in range(len(large.groups)))
    assert whole_rows > 100 * _bookkeeping_bytes(large)


def _record(layout, cache, slot, n, key, parent, retain):
    """Record block n (1-based: boundary n * BT, tokens arange(BT) + 10 n) of `slot`'s chain."""
    toks = np.arange(BT, dtype=np.int32) + 10 * n
    key = next_key(key, toks.tolist())
    cache, r, st = px.record(
        layout, cache, jnp.int32(slot), jnp.asarray(key_words(key)), jnp.int32(parent), jnp.asarray(toks),
        jnp.bool_(retain), jnp.int32(n * BT),
    )  # fmt: skip
    assert int(st) == Status.OK
    return cache, int(r), key, toks


def _rows(layout, cache, slot, gi, hi) -> np.ndarray:
    """Rows [0, hi) of group gi that `slot`'s page table maps: [layers, hi, dim]."""
    g, ps = cache.groups[gi], layout.page_size
    table = np.asarray(g.page_table)[slot]
    pool = np.asarray(g.pool)
    rows = np.arange(hi)
    assert (table[rows // ps] >= 0).all()
    return pool[:, table[rows // ps], rows % ps]


@pytest.mark.parametrize("spec", [gemma_like_spec(), deepseek_like_spec()], ids=["full-attention", "compressed"])
def test_a_restore_takes_each_page_from_the_last_block_that_wrote_it(spec):
    layout = CacheLayout(spec, CacheConfig(slots=3, max_context=64, page_size=16, prefix_records=8))
    h = Harness(layout)
    a = h.claim()
    assert h.append([(a, BT)]) == Status.OK
    h.cache, r1, key1, toks1 = _record(layout, h.cache, a, 1, ROOT, -1, retain=True)
    assert h.append([(a, BT)]) == Status.OK  # A goes on writing into its (half-filled) first pages
    # B restores block 1 while A still maps its pages: the partly filled last pages are copied
    b = h.claim()
    keys = np.zeros((layout.num_blocks, 4), np.uint32)
    toks = np.zeros((layout.num_blocks, BT), np.int32)
    keys[0], toks[0] = key_words(key1), toks1
    h.cache, plan = px.restore(layout, h.cache, jnp.int32(b), jnp.asarray(keys), jnp.asarray(toks), jnp.int32(1))
    assert plan.host().byte_blocks == 1
    h.length[b] = BT
    assert h.append([(b, BT)]) == Status.OK  # B's own block 2, other values than A's rows there
    h.cache, r2, key2, toks2 = _record(layout, h.cache, b, 2, key1, r1, retain=True)
    keys[1], toks[1] = key_words(key2), toks2
    check_invariants(layout, h.cache)
    # C restores both blocks: block 1 recorded by A, block 2 by B
    h.cache, c, st = tr.claim_slot(layout, h.cache)
    assert int(st) == Status.OK
    h.cache, plan = px.restore(layout, h.cache, c, jnp.asarray(keys), jnp.asarray(toks), jnp.int32(2))
    v = plan.host()
    assert (v.status, v.byte_blocks, v.record) == (Status.OK, 2, r2)
    check_invariants(layout, h.cache)
    compared = 0
    for gi, grp in enumerate(layout.groups):
        if grp.keep is not None:
            continue
        hi = 2 * BT // grp.unit
        if hi == 0:
            continue
        got, want = _rows(layout, h.cache, int(c), gi, hi), _rows(layout, h.cache, b, gi, hi)
        np.testing.assert_array_equal(got, want)  # block 2's rows are B's, block 1's (copied) A's
        mine = slice(BT // grp.unit, hi)
        assert not np.array_equal(want[:, mine], _rows(layout, h.cache, a, gi, hi)[:, mine])
        compared += 1
    assert compared
