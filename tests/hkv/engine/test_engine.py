"""hkv.Engine with DeepSeek-V4: cached generation equals the stateless forward (and transformers),
decode compiles once, bad input raises named errors with the cache unchanged, preemption is exact."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hkv
from hkv.core import transitions as tr
from hkv.core.layout import Status
from hkv.core.state import check_layout
from models.deepseek_v4 import init, tiny_config
from models.stateless import greedy_stateless

from .decode_building import DecodeStillBuilding

CFG = tiny_config()
PROMPTS = [np.random.default_rng(1).integers(0, CFG.vocab_size, n).tolist() for n in (301, 57)]
NEW = 6


@pytest.fixture(scope="module")
def model():
    return init(CFG, seed=3)


@pytest.fixture(scope="module")
def oracle(model):
    return greedy_stateless(model, PROMPTS, NEW)


def _snapshot(cache):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(cache))]


def _assert_oracle(gens, oracle):
    """Generations of PROMPTS equal the stateless forward's tokens, logits within 1e-4."""
    for g, toks, lg in zip(gens, *oracle, strict=True):
        assert g.tokens == toks and np.abs(g.logits - lg).max() < 1e-4


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


# chunk sizes: 1, 7, the window (8), the block (16) and larger (64)
@pytest.mark.parametrize("chunk", [1, 7, CFG.sliding_window, 16, 64])
def test_cached_generation_equals_stateless_forward(model, oracle, chunk):
    engine = hkv.Engine(
        model,
        hkv.CacheConfig(slots=2, max_context=320, page_size=8, prefix_records=0),
        prefill_chunk=chunk,
        block_tokens=16,
    )
    gens = engine.generate(PROMPTS, NEW, return_logits=True)
    for g, toks, lg in zip(gens, *oracle, strict=True):
        assert g.tokens == toks
        assert g.logits.shape == (NEW, CFG.vocab_size) and g.logits.dtype == np.float32
        assert np.abs(g.logits - lg).max() < 1e-4
    # one compilation of the decode step across every length, window and compression boundary
    assert set(engine.compilations.values()) == {1} and len(engine.compilations) == 2
    hkv.check_invariants(engine.layout, engine.cache)
    st = engine.stats()
    assert st["generated_tokens"] == NEW * len(PROMPTS) and st["active_slots"] == 0
    assert st["cache"]["pages_allocated"] == st["cache"]["pages_released"] > 0


def test_prefill_buckets_finish_a_prompt_in_the_narrowest_width_and_stay_exact(model, oracle):
    """prefill_chunk 64 with buckets 16 and 32: 301 = 4 x 64 + 45 and 57 finish in 64-wide steps (45 and
    57 > 32); the same 301-token prompt again restores 288 tokens and finishes its 13-token rest in one
    16-wide step. Tokens and logits equal the stateless forward either way."""
    config = hkv.CacheConfig(slots=2, max_context=320, page_size=8, prefix_records=64)
    engine = hkv.Engine(model, config, prefill_chunk=64, prefill_buckets=(32, 16), block_tokens=16)
    assert engine.prefill_widths == (16, 32, 64)
    _assert_oracle(engine.generate(PROMPTS, NEW, return_logits=True), oracle)
    assert {n for n in engine.compilations if n.startswith("prefill")} == {"prefill[1x64]+logits"}
    # the same prompt again: restored up to its last block boundary (288), a 13-token rest -> 16 wide
    again = engine.generate([PROMPTS[0]], NEW, return_logits=True)[0]
    assert again.plan.restored_tokens == 288 and again.tokens == oracle[0][0]
    assert np.abs(again.logits - oracle[1][0]).max() < 1e-4
    assert "prefill[1x16]+logits" in engine.compilations
    for bad in ((64,), (0, 16), 16, (True,)):
        with pytest.raises(ValueError, match=r"prefill_buckets=.* must be a sequence of integers in \[1, 64\)"):
            hkv.Engine(model, config, prefill_chunk=64, prefill_buckets=bad, block_tokens=16)


def test_read_buckets_bound_prefill_reads_and_stay_exact(model, oracle):
    """read_buckets 64 and 128 under max_context 320: the 301-token prompt's 64-wide chunks read
    compressed entries for 64, 128, then 320 tokens (the step's rows hold at most that many after it);
    the 57-token one reads 64. Tokens and logits equal the stateless forward."""
    config = hkv.CacheConfig(slots=2, max_context=320, page_size=8, prefix_records=0)
    engine = hkv.Engine(model, config, prefill_chunk=64, read_buckets=(128, 64), block_tokens=16)
    assert engine.read_sizes == (64, 128, 320)
    _assert_oracle(engine.generate(PROMPTS, NEW, return_logits=True), oracle)
    assert {n for n in engine.compilations if n.startswith("prefill")} == {
        "prefill[1x64@64]+logits",
        "prefill[1x64@128]+logits",
        "prefill[1x64]+logits",
    }
    # defaults: powers of two from 1024 to 3/4 of max_context (none for this small cache)
    assert hkv.Engine(model, config, prefill_chunk=64, block_tokens=16).read_sizes == (320,)
    assert hkv.default_read_buckets(8224) == (1024, 2048, 4096) and hkv.default_read_buckets(1024) == ()
    assert hkv.default_read_buckets(65536) == (1024, 2048, 4096, 8192, 16384, 32768)
    # decode too: the 57-token prompt alone decodes reading 64 tokens' entries (decode[1xk@64]: one row)
    alone = hkv.Engine(model, config, prefill_chunk=64, read_buckets=(128, 64), block_tokens=16)
    _assert_oracle(alone.generate(PROMPTS[1:], NEW, return_logits=True), [o[1:] for o in oracle])
    assert {n for n in alone.compilations if n.startswith("decode")} == {f"decode[1x{alone.decode_steps}@64]+logits"}
    for bad in ((0,), (321,), 64, (True,), (64.0,)):
        with pytest.raises(ValueError, match=r"read_buckets=.* must be a sequence of integers in \[1, 320\]"):
            hkv.Engine(model, config, prefill_chunk=64, read_buckets=bad, block_tokens=16)


def test_a_decode_dispatch_runs_only_the_rows_its_requests_need(model, oracle):
    """Four slots: one request decodes in a 1-row step, then two together in a 2-row one (the running
    slots first, idle rows on free slots), each with the stateless forward's tokens and logits."""
    config = hkv.CacheConfig(slots=4, max_context=320, page_size=8, prefix_records=0)
    engine = hkv.Engine(model, config, prefill_chunk=64, block_tokens=16)
    k = engine.decode_steps
    _assert_oracle(engine.generate(PROMPTS[1:], NEW, return_logits=True), [o[1:] for o in oracle])
    two = [PROMPTS[1], PROMPTS[1][3:]]  # 20 tokens: the first still decodes once the second joins
    _assert_oracle(engine.generate(two, 20, return_logits=True), greedy_stateless(model, two, 20))
    assert {n for n in engine.compilations if n.startswith("decode")} == {
        f"decode[1x{k}]+logits",
        f"decode[2x{k}]+logits",
    }


@pytest.mark.slow  # warms up every decode row count (1, 2, 4) with and without logits
def test_after_warmup_every_decode_row_count_is_built(model, oracle):
    """warmup() builds the decode step for every row count (1, 2 and all 4 slots): a request after it
    decodes in the 1-row step, exact, and compiles nothing."""
    config = hkv.CacheConfig(slots=4, max_context=320, page_size=8, prefix_records=0)
    k = 8
    warm = hkv.Engine(model, config, prefill_chunk=64, block_tokens=16, decode_steps=k)
    warm.warmup(logits=True)
    before = dict(warm.compilations)
    assert {n for n in before if n.startswith("decode[")} >= {f"decode[1x{k}]", f"decode[2x{k}]", f"decode[{k}]"}
    _assert_oracle(warm.generate(PROMPTS[1:], NEW, return_logits=True), [o[1:] for o in oracle])
    assert warm.compilations == before


def test_a_step_past_its_read_bound_is_refused_with_the_cache_unchanged(model):
    """cached_step(read_tokens=R) with a row that would hold more than R tokens: BAD_REQUEST, no page
    taken, nothing written (a truncated read would give wrong tokens); bad R values are named."""
    layout = hkv.CacheLayout(model.cache_spec(), hkv.CacheConfig(slots=2, max_context=320, page_size=8))
    cache = hkv.init_cache(layout)
    cache, slot, _ = tr.claim_slot(layout, cache)
    toks = jnp.asarray([PROMPTS[1][:40]], jnp.int32)
    before = _snapshot(cache)
    step = jax.jit(model.cached_step, static_argnums=0, static_argnames="read_tokens")
    out, logits, status = step(layout, cache, toks, slot[None], jnp.asarray([40]), read_tokens=32)
    assert int(status) == Status.BAD_REQUEST and not np.asarray(logits).any()
    _assert_same(before, _snapshot(out))
    for unknown in (-1, layout.slots):  # named as an unknown slot, not as a read past the bound
        _, _, st = step(layout, out, toks, jnp.asarray([unknown], jnp.int32), jnp.asarray([40]), read_tokens=32)
        assert int(st) == Status.UNKNOWN_SLOT, (unknown, Status(int(st)).name)
    # within the bound: the same logits as an unbounded step
    a = step(layout, out, toks, slot[None], jnp.asarray([40]), read_tokens=64)
    b = step(layout, out, toks, slot[None], jnp.asarray([40]))
    assert int(a[2]) == int(b[2]) == Status.OK and np.abs(np.asarray(a[1]) - np.asarray(b[1])).max() < 1e-5

    # and the bound is what the step reads: fewer flops than a step reading max_context's entries
    def flops(**kw):
        return step.lower(layout, out, toks, slot[None], jnp.asarray([40]), **kw).cost_analysis()["flops"]

    assert flops(read_tokens=64) < flops()  # 25.6M vs 28.9M: equal if the bound were ignored
    for bad in (0, 321, True, 32.0):
        with pytest.raises(ValueError, match=r"read_tokens=.* must be None or an int in \[1, 320\]"):
            model.cached_step(layout, out, toks, slot[None], jnp.asarray([40]), read_tokens=bad)


def test_a_decode_step_reads_its_read_bound_with_the_same_bits(model):
    """A decode step (one token per row) with read_tokens=R reads the compressed entries and indexer
    keys of R tokens, not max_context's: fewer flops, and logits and cache bit for bit those of the
    unbounded step (the pages it does not read hold nothing a query may see)."""
    layout = hkv.CacheLayout(model.cache_spec(), hkv.CacheConfig(slots=2, max_context=320, page_size=8))
    cache = hkv.init_cache(layout)
    cache, slot, _ = tr.claim_slot(layout, cache)
    step = jax.jit(model.cached_step, static_argnums=0, static_argnames="read_tokens")
    cache, _, status = step(layout, cache, jnp.asarray([PROMPTS[1][:40]], jnp.int32), slot[None], jnp.asarray([40]))
    assert int(status) == Status.OK
    tok, n = jnp.asarray([[PROMPTS[1][40]]], jnp.int32), jnp.asarray([1])
    bounded = step(layout, cache, tok, slot[None], n, read_tokens=64)
    full = step(layout, cache, tok, slot[None], n)
    assert int(bounded[2]) == int(full[2]) == Status.OK
    np.testing.assert_array_equal(np.asarray(bounded[1]), np.asarray(full[1]))
    _assert_same(_snapshot(bounded[0]), _snapshot(full[0]))

    def flops(**kw):
        return step.lower(layout, cache, tok, slot[None], n, **kw).cost_analysis()["flops"]

    assert flops(read_tokens=64) < flops()  # equal if the decode kernels read max_context's pages


def test_preemption_under_page_pressure_keeps_outputs_exact(model, oracle, monkeypatch):
    # 64 + 100 tokens, then 301 + 6: the long prompt takes 10 pages of the CSA compressed pool (8
    # entries = 32 tokens per page) as it prefills, one chunk per step, while the short one decodes 8
    # tokens per step and grows from 2 pages to 6; the 12-page pool runs out, so the younger request
    # (the long one) is preempted, waits, and is recomputed from its tokens. Greedy and seeded
    # sampling both come out as if nothing had happened; so they do when every token is decoded
    # through the prefill step while the decode step builds (`Engine.decode_while_building`).
    short = np.random.default_rng(2).integers(0, CFG.vocab_size, 64).tolist()
    config = hkv.CacheConfig(slots=2, max_context=320, page_size=8, prefix_records=0)
    layout = hkv.CacheLayout(model.cache_spec(), config)
    pages = [2 * layout.reserved_pages(g) for g in range(len(layout.groups))]
    csa = [g for g, grp in enumerate(layout.groups) if grp.kind == hkv.ObjectKind.COMPRESSED and grp.unit == 4]
    pages[csa[0]] = 12
    pressed = hkv.CacheConfig(slots=2, max_context=320, page_size=8, pool_pages=tuple(pages), prefix_records=0)
    # the long prompt's oracle is the module's (PROMPTS[0], NEW tokens): no second stateless run for it
    want = [greedy_stateless(model, [short], 100), ([oracle[0][0]], [oracle[1][0]])]
    hot = hkv.SamplingParams(temperature=1.0, top_k=20, seed=3)
    roomy = hkv.Engine(model, config, prefill_chunk=32)
    hot_want = [
        g.tokens for g in roomy.generate([short], 100, sampling=hot) + roomy.generate([PROMPTS[0]], NEW, sampling=hot)
    ]
    for via_prefill in (False, True):
        engine = hkv.Engine(model, pressed, prefill_chunk=32)
        if via_prefill:
            monkeypatch.setattr(engine, "decode_while_building", True)
            DecodeStillBuilding(engine)
        hs = engine.submit(short, 100, return_logits=True)
        hl = engine.submit(PROMPTS[0], NEW, return_logits=True)
        engine.run_until_idle()
        assert engine.stats()["preemptions"] >= 1
        assert engine.stats()["cache"]["failed_no_pages"] >= 1
        for h, ((toks,), (lg,)) in zip((hs, hl), want, strict=True):
            assert h.result().tokens == toks
            assert np.abs(h.result().logits - lg).max() < 1e-4
        hkv.check_invariants(engine.layout, engine.cache)
        # seeded sampling under the same pressure equals the same request run alone on a roomy engine
        before = engine.stats()["preemptions"]
        hs, hl = engine.submit(short, 100, sampling=hot), engine.submit(PROMPTS[0], NEW, sampling=hot)
        engine.run_until_idle()
        assert engine.stats()["preemptions"] > before
        assert [h.result().tokens for h in (hs, hl)] == hot_want
        assert (engine.stats()["decode_via_prefill"] > 0) == via_prefill
        assert (engine.stats()["decode_dispatches"] > 0) == (not via_prefill)


def test_request_larger_than_the_pools_is_a_named_error(model):
    layout = hkv.CacheLayout(
        model.cache_spec(), hkv.CacheConfig(slots=1, max_context=320, page_size=8, prefix_records=0)
    )
    pages = tuple(2 for _ in layout.groups)
    engine = hkv.Engine(
        model, hkv.CacheConfig(slots=1, max_context=320, page_size=8, pool_pages=pages, prefix_records=0)
    )
    with pytest.raises(hkv.CacheCapacityError, match="does not fit in the cache's pools even alone"):
        engine.generate([PROMPTS[0]], 2, return_logits=True)
    hkv.check_invariants(engine.layout, engine.cache)


def test_matches_transformers_generate(tmp_path):
    torch = pytest.importorskip("torch")
    from models.deepseek_v4 import load
    from models.stateless import greedy_stateless

    from ...models.hf_reference import build_hf_model, reproducible_torch, save_hf_model

    hf = build_hf_model(CFG, seed=9)
    save_hf_model(hf, tmp_path)
    ours = load(tmp_path, dtype=jnp.float32)
    engine = hkv.Engine(
        ours, hkv.CacheConfig(slots=2, max_context=320, page_size=8, prefix_records=0), prefill_chunk=32
    )
    gens = engine.generate(PROMPTS, 8, return_logits=True)
    _, oracles = greedy_stateless(ours, PROMPTS, 8)  # both prompts in one stateless run (one compilation)
    for prompt, g, oracle in zip(PROMPTS, gens, oracles, strict=True):
        ids = torch.tensor([prompt])
        with reproducible_torch(), torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=8,
                do_sample=False,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        want = torch.stack(out.logits, dim=1)[0].float().numpy()
        # which side moved: hkv against its own stateless forward (bitwise, the contract) and against
        # transformers (float32 rounding of another library)
        sides = (
            f"hkv vs stateless: max |Δ| = {np.abs(g.logits - oracle).max():.3g}; "
            f"hkv vs transformers: max |Δ| = {np.abs(g.logits - want).max():.3g}"
        )
        np.testing.assert_array_equal(g.logits, oracle, err_msg=sides)
        assert out.sequences[0, len(prompt) :].tolist() == g.tokens, sides
        assert np.abs(g.logits - want).max() < 1e-4, sides


@pytest.mark.parametrize(
    "prompts, new, match",
    [
        ([[1, 2, CFG.vocab_size]], 2, r"prompt 0: token ids range \[1, 128\] must lie in \[0, vocab_size=128\)"),
        ([[1, 2], [-1]], 2, r"prompt 1: token ids range \[-1, -1\]"),
        ([[1] * 300], 30, r"prompt 0: 300 tokens \+ max_new_tokens=30 = 330 exceeds max_context=320"),
        ([[1], []], 2, r"prompt 1 is empty"),
        ([[1]], -1, r"max_new_tokens=-1 must be an integer >= 0"),
        ([], 1, r"prompts must be a non-empty list"),
    ],
)
def test_bad_input_raises_named_error_and_leaves_cache_unchanged(model, prompts, new, match):
    engine = hkv.Engine(model, hkv.CacheConfig(slots=2, max_context=320, page_size=8, prefix_records=0))
    engine.generate([[5, 6, 7]], 1, return_logits=True)  # some history in the counters
    before = _snapshot(engine.cache)
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, new, return_logits=True)
    _assert_same(before, _snapshot(engine.cache))


def test_unknown_or_inactive_slot_is_a_status_with_cache_unchanged(model):
    layout = hkv.CacheLayout(
        model.cache_spec(), hkv.CacheConfig(slots=2, max_context=64, page_size=8, prefix_records=0)
    )
    cache = hkv.init_cache(layout)
    cache, _, _ = tr.claim_slot(layout, cache)
    before = _snapshot(cache)
    for bad, want in ((7, Status.UNKNOWN_SLOT), (-1, Status.UNKNOWN_SLOT), (1, Status.SLOT_INACTIVE)):
        out, st = tr.release_slot(layout, cache, jnp.int32(bad))
        assert int(st) == want
        _assert_same(before, _snapshot(out))
        out, st = tr.reserve(layout, cache, jnp.array([bad]), jnp.array([5]), jnp.array([True]))
        assert int(st) == want
        _assert_same(before, _snapshot(out))
    step = jax.jit(lambda c, t, s, n: model.cached_step(layout, c, t, s, n))
    out, _, st = step(cache, jnp.ones((1, 4), jnp.int32), jnp.array([9]), jnp.array([4]))
    assert int(st) == Status.UNKNOWN_SLOT
    _assert_same(before, _snapshot(out))


def test_cache_of_another_spec_is_rejected(model):
    config = hkv.CacheConfig(slots=2, max_context=64, page_size=8, prefix_records=0)
    layout = hkv.CacheLayout(model.cache_spec(), config)
    other_window = init(tiny_config(sliding_window=12), seed=0)
    foreign = hkv.init_cache(hkv.CacheLayout(other_window.cache_spec(), config))  # its own pool sizes
    with pytest.raises(ValueError, match=r"but the layout needs"):
        model.cached_step(layout, foreign, jnp.ones((1, 2), jnp.int32), jnp.array([0]), jnp.array([2]))
    other_weights = dataclasses.replace(model.cache_spec(), weights_digest="0" * 32)  # same dims, other weights
    same_shapes = hkv.init_cache(hkv.CacheLayout(other_weights, layout.config))
    with pytest.raises(ValueError, match=r"ABI fingerprint differs"):
        check_layout(layout, same_shapes)
    check_layout(layout, hkv.init_cache(layout))


def test_decode_through_the_pallas_kernels_in_the_interpreter(model):
    # The decode step's attention and indexer top-k are pallas_kernels ops; force their Pallas GPU
    # (Triton-style) kernels in the interpreter on CPU and require the same tokens and logits.
    prompts = [PROMPTS[1][:45], PROMPTS[0][:23]]
    engine = hkv.Engine(
        model,
        hkv.CacheConfig(slots=2, max_context=128, page_size=8, prefix_records=0),
        prefill_chunk=32,
        kernel_options={"kernel_backend": "gpu", "interpret": True},
    )
    gens = engine.generate(prompts, 4, return_logits=True)
    tokens, logits = greedy_stateless(model, prompts, 4)
    for g, toks, lg in zip(gens, tokens, logits, strict=True):
        assert g.tokens == toks
        assert np.abs(g.logits - lg).max() < 1e-4


def test_reserve_rejects_a_slot_twice_or_a_shrinking_length(model):
    layout = hkv.CacheLayout(
        model.cache_spec(), hkv.CacheConfig(slots=2, max_context=64, page_size=8, prefix_records=0)
    )
    cache = hkv.init_cache(layout)
    cache, _, _ = tr.claim_slot(layout, cache)
    cache, st = tr.reserve(layout, cache, jnp.array([0]), jnp.array([9]), jnp.array([True]))
    cache = tr.advance(layout, cache, jnp.array([0]), jnp.array([9]), jnp.array([True]))
    cache = tr.slide(layout, cache, jnp.array([0]), jnp.array([True]))
    before = _snapshot(cache)
    for slots, lengths in (([0, 0], [12, 13]), ([0], [5])):
        out, st = tr.reserve(layout, cache, jnp.array(slots), jnp.array(lengths), jnp.ones(len(slots), bool))
        assert int(st) == Status.BAD_REQUEST
        _assert_same(before, _snapshot(out))


@pytest.mark.slow  # ~55 s on a cold cache; tests/models/test_scan_layers.py keeps stacked == unrolled in `make test`
def test_a_model_holding_stacked_layers_generates_restores_and_fingerprints_exactly():
    """A model whose repeating layers are held stacked (layers 1-4: (CSA, HCA) x 2, scanned): the
    engine's tokens equal the stateless forward's, a second turn restores its prefix exactly, and a
    weight edited through `model.layers[i]` (a view into the stack) reaches the engine's fingerprint."""
    from flax import nnx

    from models.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING
    from models.deepseek_v4.layer_scan import LayerView

    cfg = tiny_config(num_hidden_layers=5, layer_types=(SLIDING, CSA, HCA, CSA, HCA),
                      mlp_layer_types=(HASH_MOE, MOE, MOE, MOE, MOE))  # fmt: skip
    model = init(cfg, seed=3)
    assert [r.count for r in model.layers.runs] == [1, 2] and isinstance(model.layers[4], LayerView)
    prompts = [np.random.default_rng(7).integers(0, cfg.vocab_size, n).tolist() for n in (45, 58)]
    conf = hkv.CacheConfig(slots=2, max_context=160, page_size=8, prefix_records=16)
    engine = hkv.Engine(model, conf, block_tokens=16, prefill_chunk=32)
    assert engine.spec.weights_digest == hkv.weights_digest(nnx.state(model))
    _assert_oracle(engine.generate(prompts, 4, return_logits=True), greedy_stateless(model, prompts, 4))
    turn2 = [prompts[0] + [3, 1, 4, 1, 5, 9, 2]]
    (g,) = engine.generate(turn2, 3, return_logits=True)
    assert g.plan.restored_tokens >= 32, g.plan
    _assert_oracle([g], greedy_stateless(model, turn2, 3))
    hkv.check_invariants(engine.layout, engine.cache)
    w = model.layers[4].attn.wq_a
    w.value = w.value + 1e-3
    assert hkv.Engine(model, conf, block_tokens=16).spec.weights_digest != engine.spec.weights_digest
