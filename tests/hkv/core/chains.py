"""A chain of recorded blocks, for tests of the prefix index's restore plans."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from hkv.core import prefix as px
from hkv.core.layout import CacheLayout, Status
from hkv.engine.block_keys import ROOT, key_words, next_key


def record_chain(layout: CacheLayout, cache, slot: int, blocks: int, *, retain: bool):
    """Record the first `blocks` block boundaries of `slot` (filled with at least that many blocks),
    block n's tokens `arange(block_tokens) + 10 n`, each record the previous one's child; `retain`
    asks each boundary for a snapshot. Returns (cache, keys uint32[num_blocks, 4], tokens
    int32[num_blocks, block_tokens], the last record)."""
    bt = layout.spec.block_tokens
    keys = np.zeros((layout.num_blocks, 4), np.uint32)
    toks = np.zeros((layout.num_blocks, bt), np.int32)
    parent, key = -1, ROOT
    for n in range(1, blocks + 1):
        toks[n - 1] = np.arange(bt) + 10 * n
        key = next_key(key, toks[n - 1].tolist())
        keys[n - 1] = key_words(key)
        cache, r, st = px.record(
            layout, cache, jnp.int32(slot), jnp.asarray(keys[n - 1]), jnp.int32(parent), jnp.asarray(toks[n - 1]),
            jnp.bool_(retain), jnp.int32(n * bt),
        )  # fmt: skip
        assert int(st) == Status.OK
        parent = int(r)
    return cache, keys, toks, parent
