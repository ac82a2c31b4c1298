"""A prefill chunk whose pools are held by cached prefixes makes room before it runs, not after a
failed step (`hkv.engine.page_budget`): every chunk runs once, no step fails with NO_PAGES."""

from __future__ import annotations

import numpy as np

import hkv
from models import gemma3
from models.stateless import greedy_stateless


def test_chunks_under_full_pools_make_room_first_and_run_once():
    model = gemma3.init(gemma3.tiny_config(), seed=2)
    base = hkv.CacheConfig(slots=1, max_context=256, page_size=16, prefix_records=64)
    layout = hkv.CacheLayout(model.cache_spec(), base)
    pools = tuple(layout.reserved_pages(g) * 3 // 2 + 2 for g in range(len(layout.groups)))  # 1.5 histories
    config = hkv.CacheConfig(slots=1, max_context=256, page_size=16, pool_pages=pools, prefix_records=64)
    engine = hkv.Engine(model, config, prefill_chunk=32)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, model.vocab_size, 200).tolist() for _ in range(3)]
    for i, p in enumerate(prompts):
        (g,) = engine.generate([p], 4)
        assert g.tokens == greedy_stateless(model, [p], 4)[0][0], f"prompt {i}"
    stats = engine.stats()
    assert stats["cache"]["failed_no_pages"] == 0  # before: 11 chunks ran twice, failing the first time
    assert stats["cache"]["evicted_swa_snapshots"] > 0  # room was made
    assert stats["prefill_steps"] == 3 * -(-200 // 32)
    hkv.check_invariants(engine.layout, engine.cache)


def _run_full_pools(monkeypatch, one_pass: bool) -> tuple[hkv.Engine, list[int], list]:
    """Three 200-token prompts through pools of 1.5 histories (Gemma 3: window and full groups):
    the engine, each chunk-room call's `pages` argument, and the tokens. one_pass: every call makes
    one pass of the policy and one step (the loop then asks again), as before `pages` existed."""
    from hkv.engine.prefix_manager import PrefixManager

    calls = []
    make_room = PrefixManager.make_room

    def counted(self, *args, pages=None, **kw):
        calls.append(pages)
        return make_room(self, *args, pages=None if one_pass else pages, **kw)

    monkeypatch.setattr(PrefixManager, "make_room", counted)
    model = gemma3.init(gemma3.tiny_config(), seed=2)
    base = hkv.CacheConfig(slots=1, max_context=256, page_size=16, prefix_records=64)
    layout = hkv.CacheLayout(model.cache_spec(), base)
    pools = tuple(layout.reserved_pages(g) * 3 // 2 + 2 for g in range(len(layout.groups)))
    config = hkv.CacheConfig(slots=1, max_context=256, page_size=16, pool_pages=pools, prefix_records=64)
    engine = hkv.Engine(model, config, prefill_chunk=32, retention=hkv.RetentionPolicy(every_n_blocks=1))
    rng = np.random.default_rng(4)
    tokens = [engine.generate([rng.integers(0, model.vocab_size, 200).tolist()], 4)[0].tokens for _ in range(3)]
    return engine, [c for c in calls if c is not None], tokens


def test_a_chunk_makes_its_room_in_one_eviction_step(monkeypatch):
    """A chunk short of pages evicts, in one step, what one pass per step would have evicted over
    several round trips: the same objects (counters and prefix index equal), the same tokens."""
    engine, calls, tokens = _run_full_pools(monkeypatch, one_pass=False)
    monkeypatch.undo()
    before, before_calls, before_tokens = _run_full_pools(monkeypatch, one_pass=True)
    assert tokens == before_tokens
    now, then = engine.stats()["cache"], before.stats()["cache"]
    for k in ("evicted_swa_snapshots", "evicted_tail_snapshots", "evicted_records", "pages_released"):
        assert now[k] == then[k], k
    a, b = engine.cache.prefix, before.cache.prefix
    np.testing.assert_array_equal(np.asarray(a.state), np.asarray(b.state))
    np.testing.assert_array_equal(np.asarray(a.swa_held), np.asarray(b.swa_held))
    assert now["failed_no_pages"] == 0
    assert len(before_calls) > 2 * len(calls) > 0, (len(before_calls), len(calls))
    hkv.check_invariants(engine.layout, engine.cache)
