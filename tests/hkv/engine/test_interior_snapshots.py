"""Snapshots at the block boundaries inside a prefill step (`hkv.InteriorSnapshots`).

A prefill chunk crosses several block boundaries. Each boundary the retention policy keeps gets its
SWA + TAIL snapshot from inside the step: the step writes every compressor's TAIL at that boundary
into a free snapshot slot and keeps the window's pages mapped, and the record step right after it
turns them into snapshots. A prefix is then restorable at every block boundary, whatever the chunk
width, with the cold path's logits bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hkv
from hkv.core import prefix as px
from hkv.engine.block_keys import chain_keys
from hkv.engine.page_budget import short_of_pages
from hkv.engine.prefix_tools import pack_records
from hkv.store.tier import DiskTier
from hkv.testing import force_route
from models import deepseek_v4, toy

BT = 16  # the engine's default block_tokens
CHUNK = 64
CFG = hkv.CacheConfig(slots=2, max_context=256, page_size=16, prefix_records=32)
PROMPT = np.random.default_rng(0).integers(1, 60, 100).tolist()


def _engine(model, **kw) -> hkv.Engine:
    return hkv.Engine(model, CFG, prefill_chunk=CHUNK, **kw)


def _cold(model) -> hkv.Engine:
    """The same engine without a prefix cache: every prompt runs cold."""
    return hkv.Engine(model, dataclasses.replace(CFG, prefix_records=0), prefill_chunk=CHUNK)


def _diverge(k: int, tail: int = 5) -> list[int]:
    """PROMPT's first k tokens, then `tail` tokens that differ from PROMPT at position k."""
    rest = [(PROMPT[k] + 1 + i) % 60 + 1 if k < len(PROMPT) else 7 for i in range(tail)]
    if k < len(PROMPT) and rest[0] == PROMPT[k]:
        rest[0] = rest[0] % 60 + 1
    return PROMPT[:k] + rest


@pytest.fixture(scope="module")
def toy_model():
    return toy.init(toy.ToyConfig(), seed=3)


@pytest.mark.slow  # make test: test_conformance's check_model restores DeepSeek-V4 inside 32-token chunks
def test_a_prefix_restores_at_a_boundary_inside_a_chunk_with_the_cold_logits():
    """A 100-token prompt runs as chunks [0, 64) and [64, 100); a prompt sharing its first 90 tokens
    restores 80 (a boundary inside the second chunk; before, only 64), with the logits of a cold run.
    DeepSeek-V4: sliding windows and the TAILs of overlapping (CSA) and long (HCA) compressors; the toy
    model's tests below cover full-attention layers."""
    model = deepseek_v4.init(deepseek_v4.tiny_config(), seed=0)
    engine = _engine(model)
    engine.generate([PROMPT], 2)
    (warm,) = engine.generate([_diverge(90)], 4, return_logits=True)
    assert warm.plan.restored_tokens == 80, warm.plan
    (cold,) = _cold(model).generate([_diverge(90)], 4, return_logits=True)
    assert warm.tokens == cold.tokens
    np.testing.assert_array_equal(warm.logits, cold.logits)
    hkv.check_invariants(engine.layout, engine.cache)


def test_every_boundary_of_every_chunk_is_restorable_with_the_cold_logits(toy_model):
    engine = _engine(toy_model)
    engine.generate([PROMPT], 2)
    ks = range(1, len(PROMPT) // BT + 1)
    prompts = [_diverge(k * BT + 3) for k in ks]
    warm = [engine.generate([p], 3, return_logits=True)[0] for p in prompts]
    assert [g.plan.restored_tokens for g in warm] == [k * BT for k in ks]
    cold = _cold(toy_model).generate(prompts, 3, return_logits=True)
    for w, c in zip(warm, cold, strict=True):
        assert w.tokens == c.tokens
        np.testing.assert_array_equal(w.logits, c.logits)
    hkv.check_invariants(engine.layout, engine.cache)


def test_an_interior_snapshot_comes_back_from_the_disk_tier(toy_model, tmp_path):
    engine = _engine(toy_model, disk=DiskTier(str(tmp_path / "store")))
    force_route(engine, "disk")
    engine.generate([PROMPT], 2)
    engine.evict_prefixes()  # every snapshot block goes to disk first
    engine.flush_disk()
    (warm,) = engine.generate([_diverge(90)], 4, return_logits=True)
    assert warm.plan.restored_tokens == 80 and warm.plan.disk_tokens == (0, 80), warm.plan
    (cold,) = _cold(toy_model).generate([_diverge(90)], 4, return_logits=True)
    assert warm.tokens == cold.tokens
    np.testing.assert_array_equal(warm.logits, cold.logits)


class _NoSnapshots(toy.ToyModel):
    """The toy model with a cached_step that does not take `snapshots` (as a model written before it)."""

    def cached_step(self, layout, cache, tokens, slots, n_valid, *, read_tokens=None, logit_rows=None):
        return super().cached_step(
            layout, cache, tokens, slots, n_valid, read_tokens=read_tokens, logit_rows=logit_rows
        )


def test_a_model_without_the_keyword_keeps_snapshots_at_step_ends_only(toy_model):
    model = toy.init(toy.ToyConfig(), seed=3)
    model.__class__ = _NoSnapshots
    engine = _engine(model)
    assert not engine.prefix_manager.interior
    engine.generate([PROMPT], 2)
    (warm,) = engine.generate([_diverge(90)], 4)
    assert warm.plan.restored_tokens == 64  # the first chunk's end: the second's boundaries keep none
    assert warm.tokens == _cold(toy_model).generate([_diverge(90)], 4)[0].tokens


def _stepped(model, snapshots, config=CFG, n=40):
    """A fresh toy cache after one n-token step of slot 0 (boundaries 16 and 32 inside it)."""
    layout = hkv.CacheLayout(model.cache_spec(), config)
    cache = hkv.init_cache(layout)
    cache, slot, _ = hkv.transitions.claim_slot(layout, cache)
    tokens = jnp.asarray([PROMPT[:n]], jnp.int32)
    cache, _, status = model.cached_step(
        layout, cache, tokens, jnp.asarray([slot]), jnp.asarray([n], jnp.int32), snapshots=snapshots
    )
    assert int(status) == hkv.Status.OK
    return layout, cache, int(slot)


def _record(layout, cache, slot, snap_slots):
    keys = chain_keys(PROMPT[:40], BT)
    blocks = [(keys[n], PROMPT[n * BT : (n + 1) * BT], (n + 1) * BT, True) for n in range(2)]
    packed = pack_records(blocks, BT)
    slots = np.full(packed[0].shape[:1], -1, np.int32)
    slots[:2] = snap_slots
    record_many = jax.jit(px.record_many, static_argnums=0)
    cache, recs, _, _ = record_many(layout, cache, slot, packed[0], jnp.int32(-1), *packed[1:], slots)
    return cache, np.asarray(recs[:2])


def test_a_record_takes_only_the_snapshot_slot_its_step_staged(toy_model):
    """Naming a snapshot slot the step did not stage keeps no snapshot (its TAIL would be stale)."""
    layout, cache, slot = _stepped(toy_model, None)
    cache, recs = _record(layout, cache, slot, [0, 1])
    p = jax.device_get(cache.prefix)
    assert list(p.tail_slot[recs]) == [-1, -1] and not p.swa_held[recs].any() and not p.snap_used.any()
    hkv.check_invariants(layout, cache)
    snaps = hkv.InteriorSnapshots(np.asarray([[16, 32, -1, -1, -1]]), np.asarray([[3, 5, -1, -1, -1]]))
    layout, cache, slot = _stepped(toy_model, snaps)
    assert np.asarray(cache.prefix.staged)[[3, 5]].tolist() == [[slot, 16], [slot, 32]]
    cache, recs = _record(layout, cache, slot, [3, 5])
    p = jax.device_get(cache.prefix)
    assert list(p.tail_slot[recs]) == [3, 5] and p.swa_held[recs].all()
    assert (np.asarray(p.staged) == -1).all()  # taken
    hkv.check_invariants(layout, cache)


def test_a_step_without_pages_for_the_held_windows_runs_without_interior_snapshots(toy_model):
    """Pools with exactly one slot's reservation (4 pages of 16 rows per windowed group): a 96-token
    step cannot keep the windows of 16 and 32 mapped (rows 13-95: 6 pages), so it runs as without
    snapshots (OK, nothing staged) instead of failing with NO_PAGES."""
    base = hkv.CacheLayout(toy_model.cache_spec(), dataclasses.replace(CFG, slots=1, prefix_records=0))
    pages = tuple(base.reserved_pages(g) for g in range(len(base.groups)))
    tight = hkv.CacheConfig(slots=1, max_context=256, page_size=16, pool_pages=pages, prefix_records=8)
    none = [-1] * 5
    snaps = hkv.InteriorSnapshots(np.asarray([[16, 32, *none]]), np.asarray([[0, 1, *none]]))
    layout, cache, slot = _stepped(toy_model, snaps, tight, n=96)
    assert (np.asarray(cache.prefix.staged) == -1).all()
    cache, recs = _record(layout, cache, slot, [0, 1])
    p = jax.device_get(cache.prefix)
    assert list(p.tail_slot[recs]) == [-1, -1] and not p.swa_held[recs].any()
    hkv.check_invariants(layout, cache)


def test_the_engine_counts_the_held_windows_when_it_makes_room(toy_model):
    """`short_of_pages` with holds: a 96-token step keeping the window at 16 needs pages for rows 13-95
    (6 of a windowed group's 4), without it rows 93-95 (1): the scheduler then evicts older snapshots
    for the step's own before it runs."""
    base = hkv.CacheLayout(toy_model.cache_spec(), dataclasses.replace(CFG, slots=1, prefix_records=0))
    pages = tuple(base.reserved_pages(g) for g in range(len(base.groups)))
    layout = hkv.CacheLayout(
        toy_model.cache_spec(),
        hkv.CacheConfig(slots=1, max_context=256, page_size=16, pool_pages=pages, prefix_records=8),
    )
    cache, slot, _ = hkv.transitions.claim_slot(layout, hkv.init_cache(layout))
    assert not short_of_pages(layout, cache, [int(slot)], [96])
    assert not short_of_pages(layout, cache, [int(slot)], [96], [None])
    assert short_of_pages(layout, cache, [int(slot)], [96], [16])
