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
