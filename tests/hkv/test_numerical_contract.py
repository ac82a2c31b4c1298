"""The numerical contract (docs/numerics.md): the logits of a token at a position are the same bits on
every path — the stateless forward, prefill in any chunk and batch, decode (through the decode step or
through the prefill step while it builds), repeated calls, any batch order, restored prefixes — in
float32 and bfloat16, so greedy tokens equal `greedy_stateless`'s in the same dtype."""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hkv
from hkv.testing import check_model
from models import deepseek_v4, gemma3, toy
from models.stateless import forward_fn, greedy_stateless

NEW = 10


def _reference(model, prompts, new):
    """Greedy tokens and the logits that chose them, from the stateless forward (one compilation)."""
    pad = max(len(p) for p in prompts) + new
    fwd = forward_fn(model)
    out = {}
    for p in prompts:
        toks, logits = greedy_stateless(model, [p], new, pad_to=pad, fwd=fwd)
        out[tuple(p)] = (toks[0], logits[0])
    return out


def _assert_bitwise(gens, prompts, ref, what: str) -> None:
    for g, p in zip(gens, prompts, strict=True):
        want_t, want_l = ref[tuple(p)]
        got = np.asarray(g.logits)
        diff = np.argwhere(got != want_l)
        where = "" if not len(diff) else f" first at new token {diff[0][0]}, logit {diff[0][1]}"
        assert g.tokens == want_t and not len(diff), (
            f"{what}: prompt of {len(p)} tokens differs from the stateless forward{where}"
        )


FAMILIES = {
    "gemma3": lambda: gemma3.init(gemma3.tiny_config(), seed=11, dtype=jnp.bfloat16),
    "deepseek_v4": lambda: deepseek_v4.init(deepseek_v4.tiny_config(), seed=11, dtype=jnp.bfloat16),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bfloat16_logits_are_the_same_bits_on_every_path(family):
    """bfloat16, the production dtype: first calls (decoding through the prefill step while the decode
    step builds), repeated calls with the prefix cache emptied in between, one prompt and two in either
    order, chunks 16 and 32, and a warm request that restores its prefix — all equal the stateless forward."""
    model = FAMILIES[family]()
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, model.vocab_size, n).tolist() for n in (29, 45)]
    warm = prompts[1] + rng.integers(0, model.vocab_size, 7).tolist()
    ref = _reference(model, [*prompts, warm], NEW)
    for chunk in (16, 32):
        cfg = hkv.CacheConfig(slots=2, max_context=128, page_size=16, prefix_records=32)
        engine = hkv.Engine(model, cfg, prefill_chunk=chunk)
        for call in range(3):  # the report: calls 3-5 (decode step built) flipped a token
            engine.evict_prefixes()
            _assert_bitwise(engine.generate([prompts[0]], NEW, return_logits=True), prompts[:1], ref, f"call {call}")
            if call == 0:
                time.sleep(0.5)  # let the decode step finish building: later calls decode through it
        _assert_bitwise(engine.generate(prompts, NEW, return_logits=True), prompts, ref, f"batch, chunk {chunk}")
        rev = prompts[::-1]
        _assert_bitwise(engine.generate(rev, NEW, return_logits=True), rev, ref, f"reversed batch, chunk {chunk}")
        (g,) = engine.generate([warm], NEW, return_logits=True)
        assert g.plan.restored_tokens >= 32, g.plan  # the shared prefix came from the device cache
        _assert_bitwise([g], [warm], ref, f"warm restore, chunk {chunk}")


def test_decoding_through_the_prefill_step_gives_the_decode_steps_bits():
    """`decode_while_building=False` (every token from the decode step) and the default (the first
    tokens through the prefill step) give the same logits in bfloat16."""
    model = FAMILIES["gemma3"]()
    prompt = [5, 17, 42, 9, 11]  # the repro prompt
    cfg = hkv.CacheConfig(slots=2, max_context=256, page_size=16, prefix_records=32)
    runs = []
    for while_building in (True, False):
        engine = hkv.Engine(model, cfg, prefill_chunk=32)
        engine.decode_while_building = while_building
        runs.append(engine.generate([prompt], 12, return_logits=True)[0])
    np.testing.assert_array_equal(np.asarray(runs[0].logits), np.asarray(runs[1].logits))
    toks, _ = greedy_stateless(model, [prompt], 12)
    assert runs[0].tokens == runs[1].tokens == toks[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_attention_walked_in_blocks_of_tiles_keeps_the_bits(monkeypatch, family):
    """Large scores make `attend` walk the key tiles in blocks (a long prefill chunk): forced here on
    every attention of the engine's steps (blocks of 1 tile), its logits equal the stateless forward
    computed with every score at once, in float32."""
    from pallas_kernels import numerics as nm

    build = {"gemma3": gemma3, "deepseek_v4": deepseek_v4}[family]
    model = build.init(build.tiny_config(), seed=11)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, model.vocab_size, n).tolist() for n in (70, 45)]
    ref = _reference(model, prompts, NEW)
    monkeypatch.setattr(nm, "BLOCKED_SCORES", 0)
    monkeypatch.setattr(nm, "BLOCK_SCORES", 1)
    engine = hkv.Engine(model, hkv.CacheConfig(slots=2, max_context=128, page_size=16), prefill_chunk=32)
    engine.decode_while_building = False
    _assert_bitwise(engine.generate(prompts, NEW, return_logits=True), prompts, ref, "blocked attention")


@pytest.mark.parametrize(
    "dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow), jnp.bfloat16], ids=["float32", "bfloat16"]
)  # float32: make test-slow
def test_sliding_window_chunks_attend_only_their_band_with_the_same_bits(dtype):
    """Chunks of 64 and 128 queries on Gemma 3's sliding layers (window 16) attend, per block of 64
    queries, only the tiles their windows reach (`layers._attend_banded`): the logits equal the
    stateless forward's, from a fresh prompt and from a restored prefix."""
    model = gemma3.init(gemma3.tiny_config(), seed=5, dtype=dtype)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, model.vocab_size, n).tolist() for n in (150, 201)]
    warm = prompts[1][:192] + rng.integers(0, model.vocab_size, 20).tolist()
    ref = _reference(model, [*prompts, warm], NEW)
    for chunk in (64, 128):
        cfg = hkv.CacheConfig(slots=2, max_context=256, page_size=16, prefix_records=64)
        engine = hkv.Engine(model, cfg, prefill_chunk=chunk)
        engine.decode_while_building = False
        _assert_bitwise(engine.generate(prompts, NEW, return_logits=True), prompts, ref, f"chunk {chunk}")
        (g,) = engine.generate([warm], NEW, return_logits=True)
        assert g.plan.restored_tokens >= 64, g.plan
        _assert_bitwise([g], [warm], ref, f"warm, chunk {chunk}")


@pytest.mark.parametrize("window", [16, 128])
def test_a_chunk_on_a_tile_boundary_attends_a_band_one_tile_narrower_with_the_same_bits(monkeypatch, window):
    """A sliding layer's chunk whose rows all start on a tile boundary attends, per block of 64
    queries, one tile fewer (3 at window 128, 2 at window 16; `layers._band_fits`); a batch with an
    unaligned row keeps the wider band. Either way the bits are those of attending every tile."""
    from hkv.core import layers
    from pallas_kernels import numerics as nm

    monkeypatch.setattr(layers, "NARROW_BAND_QUERIES", 128)  # (512 in use: a chunk of 128 compiles one band)

    rng = np.random.default_rng(window)
    keep, c, hkv_heads, g, d = window - 1, 128, 2, 2, 16
    kw = {"scale": 0.3, "sinks": None, "softcap": None}
    for starts in ([0, 64], [128, 320], [64, 65], [13, 192]):
        start = jnp.asarray(starts, jnp.int32)
        first = start - keep
        rows = jnp.asarray(rng.normal(0, 1, (2, keep + c, hkv_heads, d)), jnp.float32)
        tiles = nm.tiles_from_rows(rows, first, keep + c)
        pos = nm.tile_positions(first, tiles.shape[1])[:, None]
        t = (start[:, None] + jnp.arange(c))[:, :, None, None]
        valid = (pos >= 0) & (pos <= t) & (pos > t - window)
        q = jnp.asarray(rng.normal(0, 1, (2, c, hkv_heads * g, d)), jnp.float32)
        banded = nm.jit(lambda q, k, m, f: layers._attend_banded(q, k, k, m, window, f, **kw))(q, tiles, valid, first)
        every = nm.jit(lambda q, k, m: layers._attend_tiles(q, k, k, m, None, **kw))(q, tiles, valid)
        np.testing.assert_array_equal(np.asarray(banded), np.asarray(every), err_msg=f"starts {starts}")
        band = -(-(64 + window - 1) // 64) + 1
        aligned = all(s % 64 == 0 for s in starts)
        assert bool(layers._band_fits(first, window, band - 1)) == aligned, starts


def _toy_layer(kind: str, window: int | None, kv_heads: int):
    if kind == "attn":
        return toy.Attn(window=window, num_kv_heads=kv_heads)
    return toy.Compressed(ratio=4, window=window or 4, topk=2 if kind == "sparse" else None)


@settings(max_examples=2, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    layers=st.lists(
        st.tuples(st.sampled_from(["attn", "hca", "sparse"]), st.sampled_from([None, 4, 8]), st.sampled_from([1, 2])),
        min_size=1,
        max_size=3,
    ),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    seed=st.integers(0, 1000),
)
def test_random_specs_keep_the_contract_by_every_path_and_route(layers, dtype, seed):
    """Random hybrid specs (windowed, full, compressed and sparse layers) in either dtype: `check_model`
    (cold prefill in chunks 16 and 32, a prefill batch, decode, restores from device snapshots, the disk
    tier and window rebuilds) finds every logit bitwise equal to the stateless forward, and a spec with
    a full-attention layer never takes the window-rebuild route (tests/hkv/core/test_random_specs.py
    runs more specs, with other block sizes, in `make test-slow`)."""
    cfg = toy.ToyConfig(layers=tuple(_toy_layer(*spec) for spec in layers), dtype=dtype)
    model = toy.init(cfg, seed=seed)
    report = check_model(model, chunk_sizes=(16, 32), new_tokens=2)
    assert report.max_abs_diff == 0.0
    has_full = any(kind == "attn" and window is None for kind, window, _ in layers)
    assert ("window" in report.routes) is (not has_full)  # rebuilt exactly when every layer is windowed
    assert ("window_refused" in report.routes) is has_full
    assert "snapshot" in report.routes and "disk" in report.routes


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_sparse_attention_in_query_blocks_keeps_the_bits(monkeypatch, dtype):
    """A prefill chunk whose picked compressed rows exceed `PICKED_ELEMENTS` runs its sparse (CSA)
    attention a block of queries at a time: forced here to one query per block, the engine's logits
    equal the stateless forward's (every query at once) bit for bit."""
    from hkv.core import layers

    model = deepseek_v4.init(deepseek_v4.tiny_config(), seed=11, dtype=dtype)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, model.vocab_size, n).tolist() for n in (70, 45)]
    ref = _reference(model, prompts, NEW)
    monkeypatch.setattr(layers, "PICKED_ELEMENTS", 1)
    # a layout no other test builds: its programs are traced afresh, with the blocks
    engine = hkv.Engine(model, hkv.CacheConfig(slots=2, max_context=144, page_size=16), prefill_chunk=32)
    engine.decode_while_building = False
    _assert_bitwise(engine.generate(prompts, NEW, return_logits=True), prompts, ref, "sparse attention in blocks")
