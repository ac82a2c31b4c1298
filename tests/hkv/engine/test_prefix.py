"""Prefix reuse as a verified restoration plan (hkv.core.prefix + Engine): exact reuse at every block
boundary, and each failure mode shrinking the plan with its named reason while output stays exact."""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hkv
import hkv.engine.engine
from hkv.core import prefix as px
from hkv.core.policy import RetentionPolicy
from hkv.engine.offload import record_page_row
from models.deepseek_v4 import init, tiny_config
from models.deepseek_v4.model import DeepseekV4

from ...oracle import oracle_for

CFG = tiny_config()
BT = 16
RNG = np.random.default_rng(21)
BASE = RNG.integers(0, CFG.vocab_size, 307).tolist()
NEW = 2


@pytest.fixture(scope="module")
def model():
    return init(CFG, seed=3)


def make_engine(model, *, scale=4, records=96, retention=None, **kw):
    config = hkv.CacheConfig(slots=2, max_context=352, page_size=8)
    layout = hkv.CacheLayout(model.cache_spec(block_tokens=BT), config)
    pages = tuple(layout.reserved_pages(g) * scale for g in range(len(layout.groups)))
    return hkv.Engine(
        model,
        hkv.CacheConfig(slots=2, max_context=352, page_size=8, pool_pages=pages, prefix_records=records),
        block_tokens=BT,
        prefill_chunk=BT,
        retention=retention,
        **kw,
    )


def diverge(k_tokens: int, tail: int = 9, seed: int = 0) -> list[int]:
    """BASE's first k tokens, then `tail` tokens that differ from BASE right at position k."""
    rng = np.random.default_rng(100 + seed)
    rest = rng.integers(0, CFG.vocab_size, tail).tolist()
    if k_tokens < len(BASE) and rest[0] == BASE[k_tokens]:
        rest[0] = (rest[0] + 1) % CFG.vocab_size
    return BASE[:k_tokens] + rest


def assert_exact(model, prompts, gens):
    """The generations equal the stateless greedy oracle (its forward compiled once per model and
    shared by every test: `tests.oracle`)."""
    tokens, logits = oracle_for(model, pad_to=352)(prompts, NEW)
    for g, t, lg in zip(gens, tokens, logits, strict=True):
        assert g.tokens == t
        assert np.abs(g.logits - lg).max() < 1e-4


def record_of(engine, boundary: int) -> int:
    p = jax.device_get(engine.cache.prefix)
    hit = np.nonzero((np.asarray(p.length) == boundary) & (np.asarray(p.state) == px.RecordState.ALIVE))[0]
    assert len(hit) == 1, f"expected one alive record at {boundary}, found {hit}"
    return int(hit[0])


def masks(engine, idx=(), kind="swa"):
    nr = engine.layout.config.prefix_records
    m = {k: np.zeros(nr, bool) for k in ("swa", "tail", "record")}
    m[kind][list(idx)] = True
    return jnp.asarray(m["swa"]), jnp.asarray(m["tail"]), jnp.asarray(m["record"])


@pytest.fixture
def warm(model):
    engine = make_engine(model)
    engine.generate([BASE], NEW, return_logits=True)
    hkv.check_invariants(engine.layout, engine.cache)
    return engine


def test_a_call_that_records_builds_the_prefix_lookup_ahead(model):
    """A first call never looks a prefix up (nothing is cached); once it has recorded blocks it
    ends by building the lookup's restore step on a background thread, so the next call that shares
    the prefix finds it built instead of compiling it on its path."""
    from hkv.engine import compiled

    compiled.clear()  # as in a new process: no step traced yet
    fresh = make_engine(model)
    traces = fresh._steps.traces
    fresh.generate([BASE[: 4 * BT + 1]], NEW)
    compiled.wait_for_ahead()
    assert traces["restore"] == 1
    prompt = diverge(4 * BT, seed=31)
    (g,) = fresh.generate([prompt], NEW, return_logits=True)
    assert g.plan.restored_tokens == 4 * BT
    assert traces["restore"] == 1  # used, not built again
    assert_exact(model, [prompt], [g])


def test_reuse_at_every_block_boundary_is_exact(model, warm):
    ks = list(range(0, len(BASE) // BT + 1))
    prompts = [diverge(k * BT, seed=k) for k in ks] + [diverge(5 * BT + 7, seed=99)]  # last: diverges mid-block
    gens = warm.generate(prompts, NEW, return_logits=True)
    for k, g in zip(ks, gens, strict=False):  # gens[-1], the mid-block prompt: below
        assert g.plan.hash_hit_tokens == g.plan.restored_tokens == k * BT, (k, g.plan)
        assert g.plan.first_failed_stage in ("hash", None)
        assert g.plan.recompute == (k * BT, len(prompts[k]))
    assert gens[-1].plan.restored_tokens == 5 * BT  # everything before the block it diverged in
    assert_exact(model, prompts, gens)
    st = warm.stats()["prefix"]
    assert st["restored_tokens"] == st["hash_hit_tokens"] > 0
    hkv.check_invariants(warm.layout, warm.cache)


def test_a_prompt_no_cached_chain_starts_with_is_not_looked_up_on_device(model):
    """When no record is a chain root with the prompt's first block key (an empty index, a new
    conversation), admission builds the miss plan on the host instead of running (and, in a fresh
    process, compiling) the device lookup; the plan is the one that lookup returns, and a prompt
    that shares a cached root is looked up on device as before."""
    from hkv.core import transitions as tr
    from hkv.core.plan import DevicePlan

    engine = make_engine(model)
    layout = engine.layout
    nb = layout.config.max_context // BT
    keys, toks = jnp.zeros((nb, 4), jnp.uint32), jnp.zeros((nb, BT), jnp.int32)
    lookup = jax.jit(px.restore, static_argnums=0)
    for n in (0, 1, nb):
        cache, slot, _ = tr.claim_slot(layout, hkv.init_cache(layout))
        _, vec = lookup(layout, cache, slot, keys, toks, jnp.int32(n))
        assert vec.host() == DevicePlan.miss(n), n
    with pytest.raises(ValueError, match="n_blocks=-1"):
        DevicePlan.miss(-1)

    calls = []
    device_lookup = engine.prefix_manager.steps.restore
    engine.prefix_manager.steps.restore = lambda *a: calls.append(1) or device_lookup(*a)
    prompt, other = BASE[: 3 * BT + 5], diverge(0, tail=2 * BT + 3, seed=5)
    (g,) = engine.generate([prompt], NEW, return_logits=True)  # an empty index
    assert calls == []
    assert (g.plan.hash_hit_tokens, g.plan.restored_tokens, g.plan.recompute) == (0, 0, (0, len(prompt)))
    assert (g.plan.first_failed_stage, g.plan.reason) == ("hash", hkv.Reason.NO_HASH_MATCH)
    (o,) = engine.generate([other], NEW, return_logits=True)  # records exist, none starts `other`
    assert calls == [] and o.plan.reason == hkv.Reason.NO_HASH_MATCH
    (again,) = engine.generate([prompt], NEW, return_logits=True)
    assert calls == [1] and again.plan.restored_tokens == 3 * BT
    assert engine.stats()["prefix"]["lookups"] == 3
    assert engine.stats()["prefix"]["lookups_ending_in_hash_miss"] == 2
    assert_exact(model, [prompt, other, prompt], [g, o, again])
    hkv.check_invariants(layout, engine.cache)


@pytest.mark.parametrize("kind, reason", [("swa", "swa_missing"), ("tail", "tail_missing")])
def test_evicted_window_or_tail_shrinks_to_the_previous_complete_boundary(model, warm, kind, reason):
    r = record_of(warm, 160)
    warm.cache = px.evict(warm.layout, warm.cache, *masks(warm, [r], kind))
    hkv.check_invariants(warm.layout, warm.cache)
    prompt = diverge(160 + 5)
    (g,) = warm.generate([prompt], NEW, return_logits=True)
    assert g.plan.hash_hit_tokens == 160 and g.plan.tokens_after_stage["abi"] == 160
    assert g.plan.tokens_after_stage["intersection"] == g.plan.restored_tokens == 144
    assert (g.plan.first_failed_stage, g.plan.reason) == ("intersection", reason)
    assert_exact(model, [prompt], [g])
    assert warm.stats()["prefix"]["rejections"]["intersection"][reason] == 1


def test_indexer_version_bump_invalidates_every_record(model, warm):
    warm.cache = px.bump_indexer_version(warm.cache)
    prompt = diverge(200)
    (g,) = warm.generate([prompt], NEW, return_logits=True)
    assert g.plan.hash_hit_tokens == 192 and g.plan.restored_tokens == 0
    assert (g.plan.first_failed_stage, g.plan.reason) == ("intersection", "indexer_version")
    assert_exact(model, [prompt], [g])


def test_abi_mismatch_stops_at_the_foreign_block(model, warm):
    r = record_of(warm, 160)
    p = warm.cache.prefix
    warm.cache = warm.cache.replace(prefix=p.replace(abi=p.abi.at[r].set(p.abi[r] ^ jnp.uint32(1))))
    prompt = diverge(200)
    (g,) = warm.generate([prompt], NEW, return_logits=True)
    assert g.plan.tokens_after_stage["lifecycle"] == 192
    assert g.plan.tokens_after_stage["abi"] == g.plan.restored_tokens == 144
    assert (g.plan.first_failed_stage, g.plan.reason) == ("abi", "abi_mismatch")
    assert_exact(model, [prompt], [g])


def _evict_from(engine, boundary):
    p = jax.device_get(engine.cache.prefix)
    doomed = np.nonzero((np.asarray(p.length) >= boundary) & (np.asarray(p.state) == px.RecordState.ALIVE))[0]
    engine.cache = px.evict(engine.layout, engine.cache, *masks(engine, doomed, "record"))
    hkv.check_invariants(engine.layout, engine.cache)


def test_freed_block_is_rejected_at_lifecycle(model, warm):
    _evict_from(warm, 160)  # leaves first: the records of 160.. and all their descendants
    prompt = diverge(200)
    (g,) = warm.generate([prompt], NEW, return_logits=True)
    assert g.plan.hash_hit_tokens == 192 and g.plan.restored_tokens == 144
    assert (g.plan.first_failed_stage, g.plan.reason) == ("lifecycle", "freed")
    assert_exact(model, [prompt], [g])
    # recomputing re-recorded those blocks: the next request restores them, alive records winning
    (g2,) = warm.generate([diverge(200, seed=1)], NEW, return_logits=True)
    assert g2.plan.restored_tokens == 192


def test_freed_block_whose_page_was_reused_by_another_sequence(model, warm):
    _evict_from(warm, 160)
    # another sequence takes the freed pages (lowest free ids first): the tombstones' pages are reused
    warm.generate([np.random.default_rng(5).integers(0, CFG.vocab_size, 300).tolist()], 1, return_logits=True)
    prompt = diverge(200)
    (g,) = warm.generate([prompt], NEW, return_logits=True)
    assert g.plan.hash_hit_tokens == 192 and g.plan.restored_tokens == 144
    assert (g.plan.first_failed_stage, g.plan.reason) == ("lifecycle", "page_reused")
    assert_exact(model, [prompt], [g])
    hkv.check_invariants(warm.layout, warm.cache)


def test_forced_hash_collision_is_rejected(model, monkeypatch):
    def weak_chain(
        tokens, block_tokens, extra=b"", parent=bytes(16)
    ):  # collides whenever a block's first token matches
        out, key = [], parent
        for i in range(len(tokens) // block_tokens):
            key = hashlib.blake2b(key + int(tokens[i * block_tokens]).to_bytes(8, "little"), digest_size=16).digest()
            out.append(key)
        return out

    monkeypatch.setattr(hkv.engine.block_keys, "chain_keys", weak_chain)  # every key the engine makes
    engine = make_engine(model)
    engine.generate([BASE], NEW, return_logits=True)
    prompt = list(BASE[:200])
    prompt[5 * BT + 3] = (prompt[5 * BT + 3] + 1) % CFG.vocab_size  # same first token, other content
    (g,) = engine.generate([prompt], NEW, return_logits=True)
    assert g.plan.hash_hit_tokens == 192  # the naive hash says "hit"
    assert g.plan.restored_tokens == 5 * BT
    assert (g.plan.first_failed_stage, g.plan.reason) == ("lifecycle", "collision")
    assert_exact(model, [prompt], [g])


def test_retention_every_n_blocks_and_request_end(model):
    engine = make_engine(model, retention=RetentionPolicy(every_n_blocks=4))
    engine.generate([BASE], NEW, return_logits=True)
    p = jax.device_get(engine.cache.prefix)
    alive = np.asarray(p.state) == px.RecordState.ALIVE
    with_snap = sorted(np.asarray(p.length)[alive & np.asarray(p.swa_held)].tolist())
    final = (len(BASE) + NEW - 1) // BT * BT
    assert with_snap == sorted({b for b in range(64, final + 1, 64)} | {final})
    assert sorted(np.asarray(p.length)[alive].tolist()) == list(range(BT, final + 1, BT))
    prompt = diverge(5 * BT + 3)  # the gap to the last snapshot (16) is below R (28): shrink
    (g,) = engine.generate([prompt], NEW, return_logits=True)
    assert g.plan.hash_hit_tokens == 5 * BT and g.plan.restored_tokens == 4 * BT
    assert g.plan.reason == "swa_missing" and g.plan.window_recomputed is None
    assert_exact(model, [prompt], [g])


def test_pressure_evicts_cached_prefixes_by_cost_and_stays_exact(model):
    engine = make_engine(model, scale=1, records=24)  # pools sized for live sequences only
    prompts = [BASE, diverge(100, tail=150, seed=3), diverge(250, tail=40, seed=4)]
    gens = engine.generate(prompts, NEW, return_logits=True)
    ev = engine.stats()["prefix"]["evictions"]
    assert ev["swa_snapshots"] > 0 and ev["records"] > 0
    assert_exact(model, prompts, gens)
    hkv.check_invariants(engine.layout, engine.cache)


def test_metrics_text_and_stats(model, warm):
    warm.generate([diverge(64)], NEW, return_logits=True)
    text = warm.metrics_text()
    assert "# TYPE hkv_prefix_lookups_total counter" in text
    assert "hkv_prefix_lookups_total 2" in text
    assert 'hkv_pages{kind="SWA",state="used"}' in text
    st = warm.stats()["prefix"]
    assert st["lookups"] == 2 and st["hash_hit_tokens"] == st["restored_tokens"] == 64
    assert st["complete_restoration_ratio"] == 1.0


def test_prefix_chunk_must_align_with_blocks(model):
    with pytest.raises(ValueError, match=r"prefill_chunk=24 must be a multiple of block_tokens=16"):
        hkv.Engine(model, hkv.CacheConfig(slots=1, max_context=64, prefix_records=4), block_tokens=16, prefill_chunk=24)


def test_missing_window_is_recomputed_when_cheaper_than_the_gap(model):
    # Snapshots only every 4 blocks (64 tokens): a hit at 7 blocks would shrink by 48 tokens, while
    # rebuilding the window costs R = layers x (window - 1) = 4 x 7 = 28 tokens, so the engine claims
    # the compressed entries at 112 and re-runs [84, 112) to rebuild SWA and TAIL.
    engine = make_engine(model, retention=RetentionPolicy(every_n_blocks=4))
    assert engine.window_recompute_tokens == CFG.num_hidden_layers * (CFG.sliding_window - 1)
    engine.generate([BASE], NEW, return_logits=True)
    prompt = diverge(7 * BT + 3)
    (g,) = engine.generate([prompt], NEW, return_logits=True)
    r = engine.window_recompute_tokens
    assert g.plan.hash_hit_tokens == 7 * BT and g.plan.restored_tokens == 7 * BT
    assert g.plan.window_recomputed == (7 * BT - r, 7 * BT)
    assert g.plan.reason == "swa_missing" and engine.stats()["window_recomputes"] == 1
    assert_exact(model, [prompt], [g])
    hkv.check_invariants(engine.layout, engine.cache)


window_runs: list[int] = []  # `WindowRuns`' notes


class WindowRuns(DeepseekV4):
    """DeepSeek-V4 noting in `window_runs`, when it runs (not when traced), each model step that
    rebuilds a window (`seal=False`, only `hkv.core.prefix.restore_window` asks for it): its valid
    token count."""

    def cached_step(self, layout, cache, tokens, slots, n_valid, **options):
        if options.get("seal") is False:
            jax.debug.callback(lambda n: window_runs.append(int(n)), n_valid[0])
        return super().cached_step(layout, cache, tokens, slots, n_valid, **options)


def test_warmup_runs_the_window_rebuild_step_once_and_writes_nothing():
    """The first run of the window rebuild's model step (inside a `lax.cond` branch) cost ~45 ms more
    than later ones on this CPU, and `warmup` ran `restore_window` only with nothing to restore, so
    the branch never ran: colab/02_prefix_reuse's turn with the first rebuild was slower than its cold
    run. Now warmup forces the branch with no valid token: the step runs, the cache is unchanged; a
    request's rebuild then runs the same branch with R tokens and stays exact."""
    counting = init(CFG, seed=3)
    counting.__class__ = WindowRuns  # the same weights; the engine's steps rebuild this class
    window_runs.clear()
    engine = make_engine(counting, retention=RetentionPolicy(every_n_blocks=4))
    before = jax.device_get(engine.cache)
    engine.warmup()
    jax.effects_barrier()
    assert window_runs == [0]
    after = jax.device_get(engine.cache)
    for name in ("groups", "lengths", "active", "counters"):  # (the prefix index's clock moves)
        for a, b in zip(jax.tree.leaves(getattr(before, name)), jax.tree.leaves(getattr(after, name)), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)
    engine.generate([BASE], NEW)
    (g,) = engine.generate([diverge(7 * BT + 3)], NEW, return_logits=True)
    jax.effects_barrier()
    assert g.plan.window_recomputed == (7 * BT - engine.window_recompute_tokens, 7 * BT)
    assert window_runs == [0, engine.window_recompute_tokens]
    assert_exact(counting, [diverge(7 * BT + 3)], [g])


def test_a_chain_cut_by_an_evicted_record_rebuilds_the_window_at_the_cut(model):
    """Records to 7 blocks are intact, the 8th and later were evicted (tombstones: the hash still
    matches 9 blocks, the plan stops at lifecycle, `freed`), and the last snapshot is at 4 blocks.
    Rebuilding the window at 7 blocks (28 tokens) is cheaper than recomputing [64, 112): the engine
    takes it, as it does for `swa_missing` (before, only intersection reasons could rebuild, so this
    prompt restored 64 of its 112 verified tokens)."""
    engine = make_engine(model, retention=RetentionPolicy(every_n_blocks=4))
    engine.generate([BASE], NEW, return_logits=True)
    p = jax.device_get(engine.cache.prefix)
    alive = np.asarray(p.state) == px.RecordState.ALIVE
    doomed = np.nonzero(alive & (np.asarray(p.length) >= 8 * BT))[0]  # the 8th block and all after it
    engine.cache = px.evict(engine.layout, engine.cache, *masks(engine, doomed, "record"))
    prompt = diverge(9 * BT + 3)
    (g,) = engine.generate([prompt], NEW, return_logits=True)
    r = engine.window_recompute_tokens
    assert g.plan.hash_hit_tokens == 9 * BT and g.plan.reason == "freed"
    assert g.plan.restored_tokens == 7 * BT
    assert g.plan.window_recomputed == (7 * BT - r, 7 * BT)
    assert_exact(model, [prompt], [g])
    hkv.check_invariants(engine.layout, engine.cache)


def test_boundaries_the_retention_policy_skips_are_recorded_without_snapshots(model):
    # Chunks of 4 blocks, a snapshot every 4 blocks: boundaries 16, 32, 48 inside the first chunk get
    # COMPRESSED/INDEXER-only records; 64 gets the snapshot. A hit at 6 blocks of a 129-token prompt
    # then rebuilds the window (one 28-token step + 1 chunk for [96, 129)) instead of shrinking to 64
    # (2 chunks for [64, 129)): the engine picks the cheaper by its measured chunk cost. (With the
    # default policy every boundary inside a chunk keeps its snapshot: test_interior_snapshots.py.)
    config = hkv.CacheConfig(slots=2, max_context=352, page_size=8)
    layout = hkv.CacheLayout(model.cache_spec(block_tokens=BT), config)
    pages = tuple(layout.reserved_pages(g) * 4 for g in range(len(layout.groups)))
    engine = hkv.Engine(
        model,
        hkv.CacheConfig(slots=2, max_context=352, page_size=8, pool_pages=pages, prefix_records=96),
        block_tokens=BT,
        prefill_chunk=4 * BT,
        retention=hkv.RetentionPolicy(every_n_blocks=4),
    )
    engine.generate([BASE], NEW, return_logits=True)
    p = jax.device_get(engine.cache.prefix)
    alive = np.asarray(p.state) == px.RecordState.ALIVE
    assert sorted(np.asarray(p.length)[alive].tolist())[:4] == [16, 32, 48, 64]
    assert not np.asarray(p.swa_held)[alive & (np.asarray(p.length) == 48)].any()
    assert np.asarray(p.swa_held)[alive & (np.asarray(p.length) == 64)].all()
    prompt = diverge(6 * BT + 3, tail=30)
    (g,) = engine.generate([prompt], NEW, return_logits=True)
    assert g.plan.hash_hit_tokens == g.plan.restored_tokens == 6 * BT
    assert g.plan.window_recomputed == (6 * BT - engine.window_recompute_tokens, 6 * BT)
    # with the gap [64, 96) and the rest [96, 108) inside one chunk each, shrinking is cheaper
    (g2,) = engine.generate([diverge(6 * BT + 3, seed=5)], NEW, return_logits=True)
    assert g2.plan.restored_tokens == 4 * BT and g2.plan.window_recomputed is None
    assert_exact(model, [prompt], [g])
    hkv.check_invariants(engine.layout, engine.cache)


def test_the_prompt_being_prefilled_keeps_its_chain_under_record_pressure(model):
    """6 records; A caches 4 blocks, then B (8 blocks) must evict. B's own chain is pinned while it
    is prefilled, so A's records go and B keeps one unbroken chain of its first 6 blocks (before the
    fix it evicted its own parent records and kept one block, the rest refused as orphans)."""
    config = hkv.CacheConfig(slots=1, max_context=256, page_size=8)
    layout = hkv.CacheLayout(model.cache_spec(block_tokens=BT), config)
    pages = tuple(layout.reserved_pages(g) * 4 for g in range(len(layout.groups)))
    engine = hkv.Engine(
        model,
        hkv.CacheConfig(slots=1, max_context=256, page_size=8, pool_pages=pages, prefix_records=6),
        block_tokens=BT,
        prefill_chunk=BT,
    )
    rng = np.random.default_rng(0)
    a = rng.integers(0, CFG.vocab_size, 4 * BT + 1).tolist()
    b = rng.integers(0, CFG.vocab_size, 8 * BT + 1).tolist()
    engine.generate([a], 1, return_logits=True)
    engine.generate([b], 1, return_logits=True)
    p = jax.device_get(engine.cache.prefix)
    alive = np.asarray(p.state) == px.RecordState.ALIVE
    lengths, parents = np.asarray(p.length), np.asarray(p.parent)
    assert sorted(lengths[alive].tolist()) == [k * BT for k in range(1, 7)]
    for r in np.nonzero(alive)[0]:
        assert (parents[r] < 0) if lengths[r] == BT else (lengths[parents[r]] == lengths[r] - BT)
    (g,) = engine.generate([b[: 7 * BT + 3]], 1, return_logits=True)
    assert g.plan.restored_tokens == 6 * BT
    hkv.check_invariants(engine.layout, engine.cache)


def test_batched_recording_equals_one_record_per_boundary(model, monkeypatch):
    """`record_many` records a prefill chunk's 4 boundaries in one transition. Under record pressure
    (6 records) a batch stops at the boundary that finds no free record, the engine evicts (with
    admission control: for every boundary left in the batch at once, in one eviction step) and
    retries from there: the outputs, every counter and the prefix index's records (each by its key:
    its content, not which index slot it landed in) come out identical to recording, and evicting
    for, one boundary per transition."""
    config = hkv.CacheConfig(slots=1, max_context=256, page_size=8)
    layout = hkv.CacheLayout(model.cache_spec(block_tokens=BT), config)
    pages = tuple(layout.reserved_pages(g) * 4 for g in range(len(layout.groups)))
    rng = np.random.default_rng(4)
    a = rng.integers(0, CFG.vocab_size, 4 * BT + 1).tolist()
    b = rng.integers(0, CFG.vocab_size, 8 * BT + 5).tolist()
    prompts = [a, b, b[: 7 * BT + 3], a[: 3 * BT] + b[:40]]

    def run(batch: int):
        monkeypatch.setattr(hkv.engine.prefix_manager, "RECORD_BATCH", batch)
        engine = hkv.Engine(
            model,
            hkv.CacheConfig(slots=1, max_context=256, page_size=8, pool_pages=pages, prefix_records=6),
            block_tokens=BT,
            prefill_chunk=4 * BT,
        )
        evictions = []
        step = engine.prefix_manager.steps.evict
        engine.prefix_manager.steps.evict = lambda *a: evictions.append(1) or step(*a)
        gens = [engine.generate([p], NEW, return_logits=True)[0] for p in prompts]
        hkv.check_invariants(engine.layout, engine.cache)
        engine.eviction_steps = len(evictions)
        return engine, gens

    batched, gb = run(hkv.engine.prefix_manager.RECORD_BATCH)
    single, gs = run(1)
    # a batch that met a full index evicted what its remaining boundaries need in ONE step
    assert batched.eviction_steps < single.eviction_steps
    assert [g.tokens for g in gb] == [g.tokens for g in gs]
    assert [g.plan.restored_tokens for g in gb] == [g.plan.restored_tokens for g in gs]
    assert gb[2].plan.restored_tokens >= 4 * BT  # the workload reused a prefix recorded in a batch
    assert batched.stats()["prefix"]["evictions"]["records"] > 0  # and a batch met a full index
    pb, ps = jax.device_get((batched.cache.prefix, single.cache.prefix))

    def content(p, state):
        """Records in `state` by key: what they hold, wherever their index slot is."""
        out = {}
        for r in np.nonzero(np.asarray(p.state) == state)[0]:
            par = int(p.parent[r])
            out[bytes(np.asarray(p.key[r]))] = (
                bytes(np.asarray(p.key[par])) if par >= 0 else None,
                int(p.length[r]), tuple(np.asarray(p.tokens[r])), int(p.last_used[r]), int(p.hits[r]),
                bool(p.swa_held[r]), int(p.tail_slot[r]) >= 0,
                int(p.checksum[r]) if p.swa_held[r] or p.tail_slot[r] >= 0 else None,  # else unused
                tuple(tuple(np.asarray(g[r])) for g in p.pages),
            )  # fmt: skip
        return out

    assert content(pb, px.RecordState.ALIVE) == content(ps, px.RecordState.ALIVE)
    assert set(content(pb, px.RecordState.TOMBSTONE)) == set(content(ps, px.RecordState.TOMBSTONE))
    assert jax.device_get(batched.cache.counters) == jax.device_get(single.cache.counters)


def test_a_refused_record_leaves_the_cache_unchanged(model):
    """record gates every write by its outcome (no select over whole arrays): NO_PAGES (index full),
    ORPHAN_BLOCK (parent gone) and a disabled call (record_many's padding) change no leaf."""
    config = hkv.CacheConfig(slots=1, max_context=256, page_size=8)
    layout = hkv.CacheLayout(model.cache_spec(block_tokens=BT), config)
    pages = tuple(layout.reserved_pages(g) * 4 for g in range(len(layout.groups)))
    engine = hkv.Engine(
        model,
        hkv.CacheConfig(slots=1, max_context=256, page_size=8, pool_pages=pages, prefix_records=4),
        block_tokens=BT,
        prefill_chunk=2 * BT,
    )
    rng = np.random.default_rng(6)
    engine.generate(
        [rng.integers(0, CFG.vocab_size, 4 * BT + 1).tolist()], 1, return_logits=True
    )  # 4 records: index full
    captured, real = {}, engine.prefix_manager.steps.record_many

    def spy(layout, cache, slot, *args):
        if not captured:  # the slot is active and prefilled to 2 blocks; nothing recorded yet
            captured.update(cache=jax.tree.map(jnp.copy, cache), slot=slot)
        return real(layout, cache, slot, *args)

    engine.prefix_manager.steps.record_many = spy
    engine.generate([rng.integers(0, CFG.vocab_size, 3 * BT).tolist()], 1, return_logits=True)
    cache, slot = captured["cache"], captured["slot"]
    assert bool(np.all(np.asarray(cache.prefix.state) == px.RecordState.ALIVE))
    key, toks = jnp.arange(4, dtype=jnp.uint32), jnp.zeros((BT,), jnp.int32)
    cases = {
        "NO_PAGES": (jnp.int32(-1), jnp.int32(BT), None),
        "ORPHAN_BLOCK": (jnp.int32(-1), jnp.int32(2 * BT), None),  # a second block without its parent
        "disabled": (jnp.int32(-1), jnp.int32(BT), jnp.bool_(False)),
    }
    for want, (parent, length, enabled) in cases.items():
        out, r, status = px.record(engine.layout, cache, slot, key, parent, toks, jnp.bool_(True), length, enabled)
        assert int(r) == -1 and (want == "disabled" or hkv.Status(int(status)).name == want)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(cache), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_record_and_restore_refuse_a_slot_outside_the_layout(model):
    """A slot index outside [0, slots) is UNKNOWN_SLOT for `record`, `record_many` and `restore`,
    with the cache unchanged. JAX wraps a negative index and clamps a large one, so slot -1 once
    recorded the last slot's rows under the caller's keys (the engine passed -1 for a request
    released while its decode ran ahead: wrong tokens on a later hit)."""
    engine = hkv.Engine(
        model, hkv.CacheConfig(slots=1, max_context=256, page_size=8, prefix_records=16), block_tokens=BT,
        prefill_chunk=2 * BT,
    )  # fmt: skip
    captured, real = {}, engine.prefix_manager.steps.record_many

    def spy(layout, cache, slot, *args):
        if not captured:  # slot 0 (the last slot) is active and prefilled to 2 blocks
            captured.update(cache=jax.tree.map(jnp.copy, cache), slot=int(slot))
        return real(layout, cache, slot, *args)

    engine.prefix_manager.steps.record_many = spy
    prompt = np.random.default_rng(8).integers(0, CFG.vocab_size, 3 * BT).tolist()
    engine.generate([prompt], 1)
    cache, layout = captured["cache"], engine.layout
    assert captured["slot"] == 0 and int(cache.lengths[0]) == 2 * BT
    toks = jnp.asarray(prompt[:BT], jnp.int32)
    key = jnp.arange(4, dtype=jnp.uint32)

    def unchanged(out, counters=True):
        for a, b in zip(jax.tree.leaves(out if counters else out.replace(counters=cache.counters)),
                        jax.tree.leaves(cache), strict=True):  # fmt: skip
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    record = jax.jit(px.record, static_argnums=0)  # one compilation each (eager: one per op)
    record_many = jax.jit(px.record_many, static_argnums=0)
    restore = jax.jit(px.restore, static_argnums=0)
    _, r, status = record(layout, cache, jnp.int32(0), key, jnp.int32(-1), toks, jnp.bool_(True), jnp.int32(BT))
    assert int(status) == hkv.Status.OK and int(r) >= 0  # the same call on the real slot records
    for bad in (-1, 1, 7):
        out, r, status = record(layout, cache, jnp.int32(bad), key, jnp.int32(-1), toks, jnp.bool_(True), jnp.int32(BT))
        assert (int(status), int(r)) == (hkv.Status.UNKNOWN_SLOT, -1), bad
        unchanged(out)
        keys, blocks = jnp.stack([key, key + 4]), jnp.stack([toks, toks])
        one = jnp.array([True, False])
        out, recs, statuses, _ = record_many(
            layout, cache, jnp.int32(bad), keys, jnp.int32(-1), blocks, one, jnp.array([BT, 2 * BT], jnp.int32), one
        )
        assert int(statuses[0]) == hkv.Status.UNKNOWN_SLOT and int(recs[0]) == -1, bad
        unchanged(out)
        nb = layout.config.max_context // BT
        out, plan = restore(
            layout, cache, jnp.int32(bad), jnp.zeros((nb, 4), jnp.uint32), jnp.zeros((nb, BT), jnp.int32), jnp.int32(1)
        )
        assert int(plan.status) == hkv.Status.UNKNOWN_SLOT and int(plan.byte_blocks) == 0, bad
        unchanged(out, counters=False)  # (the lookup is counted)


def _first_pages(engine, boundary: int) -> set[tuple[int, ...]]:
    """Per alive record at `boundary`: the physical pages holding token 47's rows in every COMPRESSED /
    INDEXER group (CSA m=4, HCA m=16, indexer m=4: pages of 8 rows span 32, 128 and 32 tokens, so
    logical pages 1, 0 and 1; at 48 tokens each is partly filled)."""
    p = jax.device_get(engine.cache.prefix)
    alive = (np.asarray(p.state) == px.RecordState.ALIVE) & (np.asarray(p.length) == boundary)
    where = ((1, 1), (2, 0), (3, 1))  # (group, logical page)
    out = set()
    for r in np.nonzero(alive)[0]:
        chain = [int(r)]  # a record holds its own block's pages: the page table comes from its chain
        while int(p.parent[chain[-1]]) >= 0:
            chain.append(int(p.parent[chain[-1]]))
        rec = np.asarray(chain[::-1], np.int32)
        out.add(tuple(int(record_page_row(engine.layout, g, p, rec)[lp]) for g, lp in where))
    return out


def test_a_restore_inside_a_page_writes_on_in_place_unless_a_record_or_slot_needs_the_rest(model):
    """Two next turns of a conversation restore at 48 tokens, inside each compressed group's last
    page, side by side. No record reaches past 48 there, so the first shares that page and writes on
    (its records at 64 hold the same pages as those at 48) instead of copying it — a copy per turn
    and group is what made a conversation hold a page per turn where its blocks fill one. The second
    must copy: the first slot writes there. A later continuation from 48 copies too (records now need
    the rows after 48). Every continuation is exact, and the first still restores exactly after the
    others wrote."""
    engine = make_engine(model)
    first = BASE[:56]
    (g1,) = engine.generate([first], NEW, return_logits=True)
    turns = [first + g1.tokens + RNG.integers(0, CFG.vocab_size, 20).tolist() for _ in range(2)]
    g2 = engine.generate(turns, NEW, return_logits=True)
    assert [g.plan.restored_tokens for g in g2] == [48, 48]
    (at48,) = _first_pages(engine, 48)
    shared, (copy,) = {at48}, _first_pages(engine, 64) - {at48}
    assert _first_pages(engine, 64) == shared | {copy} and all(a != b for a, b in zip(copy, at48, strict=True))
    other = diverge(48, tail=30, seed=7)
    (g3,) = engine.generate([other], NEW, return_logits=True)
    assert g3.plan.restored_tokens == 48 and _first_pages(engine, 48) == {at48}
    assert len(_first_pages(engine, 64) - {at48, copy}) == 1
    again = engine.generate([t + [5] for t in turns], NEW, return_logits=True)  # their rows, intact
    assert [g.plan.restored_tokens for g in again] == [64, 64]
    prompts = [first, *turns, other] + [t + [5] for t in turns]
    assert_exact(model, prompts, [g1, *g2, g3, *again])
    hkv.check_invariants(engine.layout, engine.cache)


def test_content_two_requests_computed_side_by_side_counts_as_reused_under_admission_control(model):
    """A and B share 5 blocks and are prefilled side by side: B records them second, which counts as a
    use of A's records (hits), so the chains through them are not never-reused content. A new prompt
    C that finds the record slots full may then displace neither (admission control lets a request
    with no previous use evict only never-reused chains): it is refused, and A's next turn restores
    all of A. Before, the shared blocks stayed at 0 hits and C evicted A's and B's tails."""
    engine = make_engine(model, records=10)
    a, b = diverge(80, tail=40, seed=11), diverge(80, tail=40, seed=12)
    ga, gb = engine.generate([a, b], NEW, return_logits=True)
    p = jax.device_get(engine.cache.prefix)
    alive = np.asarray(p.state) == px.RecordState.ALIVE
    shared = alive & (np.asarray(p.length) <= 80)
    assert shared.sum() == 5 and (np.asarray(p.hits)[shared] == 1).all()
    assert (np.asarray(p.hits)[alive & ~shared] == 0).all()
    fresh = np.random.default_rng(5).integers(0, CFG.vocab_size, 100).tolist()
    (gc,) = engine.generate([fresh], NEW, return_logits=True)
    nxt = a + ga.tokens + [3, 1, 4]
    (gn,) = engine.generate([nxt], NEW, return_logits=True)
    assert gn.plan.restored_tokens == 7 * BT
    assert_exact(model, [a, b, fresh, nxt], [ga, gb, gc, gn])
    hkv.check_invariants(engine.layout, engine.cache)
