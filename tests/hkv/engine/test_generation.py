"""Generation that users drive (DESIGN §10): sampling, stop ids, logprobs, `submit`/`step`/streaming,
`decode_loop` in the user's own jit with prefix reuse, thread safety and interrupt safety.

Every engine here has the same model and layout, so they share one set of compiled steps."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hkv
from hkv.core.layout import Status
from hkv.engine.compiled import wait_for_ahead
from models.deepseek_v4 import init, tiny_config
from models.stateless import greedy_stateless

from .decode_building import DecodeStillBuilding

CFG = tiny_config()
BT = 16
RNG = np.random.default_rng(7)
A = RNG.integers(0, CFG.vocab_size, 70).tolist()
B = RNG.integers(0, CFG.vocab_size, 41).tolist()
C = RNG.integers(0, CFG.vocab_size, 100).tolist()
CONFIG = hkv.CacheConfig(slots=2, max_context=160, page_size=8, prefix_records=32)
HOT = hkv.SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=1234)


@pytest.fixture(scope="module")
def model():
    return init(CFG, seed=5)


@pytest.fixture(scope="module")
def truth(model):
    """Greedy continuations (8 tokens) and their logits from the stateless forward."""
    toks, logits = greedy_stateless(model, [A, B, C], 8)
    return {tuple(p): (t, lg) for p, t, lg in zip([A, B, C], toks, logits, strict=True)}


def _engine(model, **kw):
    kw.setdefault("decode_steps", 4)
    kw.setdefault("block_tokens", BT)
    return hkv.Engine(model, CONFIG, prefill_chunk=16, **kw)


def _idle_ok(engine):
    hkv.check_invariants(engine.layout, engine.cache)
    assert int(np.asarray(engine.cache.active).sum()) == 0
    assert not engine.scheduler.running and not engine.scheduler.prefilling and engine.pending == 0


# ------------------------------------------------------------------------- greedy, logprobs, stop
def test_greedy_is_exact_with_logprobs_of_the_chosen_tokens(model, truth):
    engine = _engine(model)
    gens = engine.generate([A, B], 8)
    for g, p in zip(gens, [A, B], strict=True):
        toks, lg = truth[tuple(p)]
        assert g.tokens == toks and g.finish_reason == "length" and g.logits is None and g.seed is None
        want = jax.nn.log_softmax(jnp.asarray(lg), axis=-1)[np.arange(8), toks]
        np.testing.assert_allclose(g.logprobs, want, atol=1e-4)
    # one compilation per bucket; a second engine on the same model and layout compiles nothing
    assert set(engine.compilations.values()) == {1}
    other = _engine(model)
    assert [g.tokens for g in other.generate([B], 8)] == [truth[tuple(B)][0]]
    assert set(other.compilations.values()) == {1}
    _idle_ok(engine)


def test_stop_ids_end_a_request_with_the_stop_token_last(model, truth):
    toks, _ = truth[tuple(A)]
    stop = toks[3]
    first = toks.index(stop)
    engine = _engine(model)
    ga, gb = engine.generate([A, B], 8, stop_token_ids=[stop])
    assert ga.tokens == toks[: first + 1] and ga.finish_reason == "stop"
    want_b = truth[tuple(B)][0]
    cut = want_b.index(stop) + 1 if stop in want_b else 8
    assert gb.tokens == want_b[:cut]
    _idle_ok(engine)


# ------------------------------------------------------------------------------------ sampling
def test_seeded_sampling_is_reproducible_whatever_the_batch(model):
    engine = _engine(model)
    alone = engine.generate([A], 10, sampling=HOT)[0]
    with_b = engine.generate([B, A], 10, sampling=HOT)[1]
    later = engine.generate([C, A], 10, sampling=HOT)[1]  # A restored from the prefix cache this time
    assert later.plan.restored_tokens > 0
    assert alone.tokens == with_b.tokens == later.tokens and alone.seed == 1234
    greedy = engine.generate([A], 10)[0]
    assert alone.tokens != greedy.tokens  # temperature 1.3 over 128 ids: a greedy match is vanishingly rare
    other_seed = engine.generate([A], 10, sampling=hkv.SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=1))[0]
    assert other_seed.tokens != alone.tokens
    np.testing.assert_allclose(alone.logprobs, with_b.logprobs, atol=1e-5)


def test_unseeded_requests_get_a_seed_that_reproduces_them(model):
    engine = _engine(model, seed=0)
    g = engine.generate([B], 6, sampling=hkv.SamplingParams(temperature=1.0))[0]
    assert g.seed is not None
    again = engine.generate([B], 6, sampling=hkv.SamplingParams(temperature=1.0, seed=g.seed))[0]
    assert again.tokens == g.tokens


def test_sample_truncation_rules():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 512, jnp.float32))
    pos = jnp.arange(512, dtype=jnp.int32)

    def draw(**kw):
        params = hkv.SamplingBatch.broadcast(hkv.SamplingParams(temperature=1.0, seed=3, **kw), 512)
        return set(np.asarray(hkv.core.sampling.sample(logits, params, pos)[0]).tolist())

    assert draw(top_k=1) == {0}
    assert draw(top_k=2) == {0, 1}
    assert draw(top_p=0.6) == {0, 1}  # 0.5 < 0.6: the second token is needed to reach it
    assert draw(min_p=0.5) == {0, 1}  # 0.15 < 0.5 * 0.5
    assert draw() == {0, 1, 2, 3}
    toks, lps = hkv.core.sampling.sample(logits, hkv.SamplingBatch.broadcast(None, 512), pos, vocab_size=3)
    assert set(np.asarray(toks).tolist()) == {0}
    np.testing.assert_allclose(lps, np.log(0.5 / 0.95), rtol=1e-5)  # vocab_size=3: the 4th id is padding


def test_truncation_without_a_sort_keeps_what_the_sorted_definition_keeps():
    """`truncate` (32 halvings of the float order, no sort) against `truncate_reference` (a sort of
    the vocabulary) on random logits: small and DeepSeek-V4-sized vocabularies, ties, -inf padding,
    every rule alone and together. The kept sets are equal wherever no top-p partial sum lies
    within 1e-4 of top_p (there float rounding of the sums, added in another order, may decide)."""
    from hkv.core.sampling import truncate, truncate_reference

    rng = np.random.default_rng(11)
    both = jax.jit(lambda x, k, p, m: (truncate(x, k, p, m), truncate_reference(x, k, p, m)))
    checked = 0
    for v in (4, 128, 129_280):
        for case in range(16):
            x = rng.normal(0, rng.choice([0.5, 2.0, 6.0]), v).astype(np.float32)
            if case % 3 == 1:
                x = np.round(x * 2) / 2  # many ties
            if case % 4 == 2:
                x[rng.random(v) < 0.3] = -np.inf  # padding ids
                x[0] = 1.0
            k = int(rng.choice([0, 1, 2, 5, 40]))
            p = float(rng.choice([1.0, 0.3, 0.9, 0.95]))
            m = float(rng.choice([0.0, 0.05, 0.5]))
            got, want = both(x, np.int32(k), np.float32(p), np.float32(m))
            order = np.sort(x)[::-1]
            probs = np.exp(order - order[0]) / np.sum(np.exp(order - order[0]))
            before = np.cumsum(probs) - probs
            if p < 1.0 and np.min(np.abs(before - p)) < 1e-4:
                continue  # a sum within rounding of top_p: either answer is right
            np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=f"v={v} k={k} p={p} m={m}")
            checked += 1
    assert checked >= 30


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(seed=2**32), "seed"),
        (dict(temperature=float("nan")), "finite"),
    ],
)
def test_sampling_rejects_bad_values_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        hkv.SamplingParams(**kw)


# ----------------------------------------------------------------- submit, step, streaming
def test_submit_streams_tokens_in_order_and_results_match_generate(model, truth):
    engine = _engine(model)
    ha = engine.submit(A, 8)
    hb = engine.submit(np.asarray(B, np.int64), np.int64(8), sampling=HOT)
    streamed = list(ha)  # drives the engine (no other thread does)
    assert streamed == truth[tuple(A)][0] == ha.result().tokens
    gb = hb.result()
    assert gb.tokens == engine.generate([B], 8, sampling=HOT)[0].tokens
    assert ha.done and hb.done
    _idle_ok(engine)


def test_a_long_prompt_does_not_stall_decoding(model, truth):
    engine = _engine(model)
    short = engine.submit(B, 8)
    while not short.tokens:
        engine.step()
    long = engine.submit(C, 8)  # 100 tokens: 7 chunks of 16
    engine.step()  # admits it and runs its first chunk; the short request decodes in the same step
    assert len(engine.scheduler.prefilling) == 1 and len(short.tokens) > 1
    engine.run_until_idle()
    assert short.result().tokens == truth[tuple(B)][0] and long.result().tokens == truth[tuple(C)][0]
    _idle_ok(engine)


def _ahead_scenario(model, truth, pipeline: bool):
    """Requests that stop on a stop id, sample, arrive while others decode and get cancelled, one
    engine; returns what a user sees and what the cache keeps."""
    engine = _engine(model)
    engine.scheduler.pipeline = pipeline
    a = truth[tuple(A)][0]
    stop = next(t for i, t in enumerate(a) if i >= 3 and t not in a[:i])  # A's first new id from its 4th token on
    h1 = engine.submit(A, 12, stop_token_ids=(stop,))
    h2 = engine.submit(B, 100, sampling=HOT)
    for _ in range(12):
        engine.step()
    h3 = engine.submit(C, 9)  # waits for a slot (A's, when it stops)
    for _ in range(6):
        engine.step()
    h2.cancel()
    engine.run_until_idle()
    with pytest.raises(hkv.RequestCancelledError):
        h2.result()
    g1, g3 = h1.result(), h3.result()
    assert g1.finish_reason == "stop" and g1.tokens[-1] == stop and g1.tokens == a[: len(g1.tokens)]
    assert g3.tokens[:8] == truth[tuple(C)][0] and len(g3.tokens) == 9 and g3.finish_reason == "length"
    later = engine.generate([A, B], 8)  # restores both prefixes; decodes with nothing else to do
    _idle_ok(engine)
    p = jax.device_get(engine.cache.prefix)
    records = sorted(
        (bytes(np.asarray(p.key[r])), int(p.length[r]), int(p.state[r])) for r in range(len(p.state)) if p.state[r]
    )

    def shown(g):
        return list(g.tokens), np.asarray(g.logprobs).tolist(), g.finish_reason

    seen = [shown(g1), list(h2.tokens), shown(g3), [shown(g) for g in later]]
    return seen, records, engine.compilations, engine.stats()["decode_dispatched_ahead"]


def test_a_decode_dispatched_ahead_changes_nothing_a_user_sees(model, truth):
    """While only decoding happens the engine sends the next decode before handing the last one's
    tokens over (`Scheduler._dispatch_ahead`): tokens, logprobs, finish reasons, a cancelled request's
    streamed tokens, the cached prefixes and the compiled programs equal one dispatch at a time."""
    seen, records, compiled, ahead = _ahead_scenario(model, truth, pipeline=True)
    seen1, records1, compiled1, ahead1 = _ahead_scenario(model, truth, pipeline=False)
    assert ahead > 0 and ahead1 == 0
    assert seen == seen1 and records == records1 and compiled == compiled1
    assert [t for t, _, _ in seen[3]] == [truth[tuple(A)][0], truth[tuple(B)][0]]
    # with no request arriving or cancelled, the cache's transitions are the same ones in the same
    # order: the whole cache (pools, page tables, records and their snapshots) is bit for bit equal
    caches = []
    for pipeline in (True, False):
        engine = _engine(model)
        engine.scheduler.pipeline = pipeline
        engine.submit(A, 13)  # ends first: its slot is released before the next decode
        engine.submit(C, 24)
        engine.run_until_idle()
        caches.append(jax.device_get(engine.cache))
        assert (engine.stats()["decode_dispatched_ahead"] > 0) == pipeline
    for x, y in zip(jax.tree.leaves(caches[0]), jax.tree.leaves(caches[1]), strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_stop_string_hit_while_a_decode_is_dispatched_ahead_caches_only_what_its_slot_computed(model, tmp_path):
    """`generate_text`'s stop string cancels a request between two steps while the decode dispatched
    ahead (`Scheduler._dispatch_ahead`) still runs it. Its results are dropped as a cancelled handle's
    are. They once reached the request after its slot was released: its tokens were counted twice
    and its next block was recorded from slot -1, another request's rows, so a later prompt that
    restored that chain got wrong tokens."""
    from hkv.engine.text import tiny_tokenizer

    codec = tiny_tokenizer(CFG.vocab_size)
    codec.save(tmp_path)
    texts = ["quick e a p over o brown g f n lazy", "h n over j o quick and g brown d g j o"]

    def run(pipeline):
        engine = _engine(model, tokenizer=tmp_path)
        engine.scheduler.pipeline = pipeline
        full = engine.generate(codec.encode(texts), 50)
        stop = codec.decode(full[0].tokens)[4:6]  # the first text stops early, the second runs on
        out = engine.generate_text(texts, 50, stop=[stop], stop_token_ids=[])
        return engine, [(g.tokens, g.text, g.finish_reason) for g in out]

    def records(engine):
        p = jax.device_get(engine.cache.prefix)
        alive = [r for r in range(len(p.state)) if p.state[r] == 1]
        return p, alive, sorted((bytes(np.asarray(p.key[r])), int(p.length[r])) for r in alive)

    engine, seen = run(True)
    plain, seen1 = run(False)
    assert engine.stats()["decode_dispatched_ahead"] > 0 and seen[0][2] == "stop"
    assert seen == seen1
    assert engine.stats()["generated_tokens"] == plain.stats()["generated_tokens"]
    p, alive, recorded = records(engine)
    assert recorded == records(plain)[2]
    # every cached chain restores exactly: a prompt extending each leaf chain, twice (the first call
    # adds the snapshot its last record lacks, the second restores the whole chain)
    for r in [r for r in alive if not any(int(p.parent[x]) == r for x in alive)]:
        chain, x = [], r
        while x >= 0:
            chain[:0], x = np.asarray(p.tokens[x]).tolist(), int(p.parent[x])
        prompt = chain + [5, 6, 7]
        (want,), _ = greedy_stateless(model, [prompt], 3)
        for _ in range(2):
            assert engine.generate([prompt], 3)[0].tokens == want
    _idle_ok(engine)


def test_batched_prefill_of_several_requests_is_exact(model, truth):
    engine = _engine(model, prefill_batch=2)
    gens = engine.generate([A, C], 8)
    assert [g.tokens for g in gens] == [truth[tuple(A)][0], truth[tuple(C)][0]]
    assert any(n.startswith("prefill[2x") for n in engine.compilations)


def test_abandoned_stream_frees_its_slot(model, truth):
    engine = _engine(model)
    h = engine.submit(C, 8)
    for i, _ in enumerate(h):
        if i == 1:
            break  # closing the iterator cancels the request
    assert h.cancelled
    with pytest.raises(hkv.RequestCancelledError):
        h.result()
    engine.step()
    _idle_ok(engine)
    assert engine.generate([A], 8)[0].tokens == truth[tuple(A)][0]


def test_calls_between_steps_drop_abandoned_streams_and_refuse_while_the_engine_is_driven(model, truth, tmp_path):
    """evict_prefixes and save right after a stream was abandoned drop its request first (they
    used to refuse: "while 1 sequences run" until some later step freed the slot); called while
    the engine is being driven (here from a progress callback of a running generate) they, and
    flush_disk / write_through, are EngineBusyError instead of racing the driving thread's
    transitions on the same cache."""
    engine = _engine(model)
    for call in (engine.evict_prefixes, lambda: engine.save(tmp_path / "ck")):
        h = engine.submit(C, 8)
        for k, _ in enumerate(h):
            if k == 1:
                break  # abandoned: cancelled, its slot still held until something reaps it
        call()
        assert h.cancelled and engine.pending == 0
        _idle_ok(engine)
    seen = []

    def progress(msg):
        if msg.startswith("prefilled") and not seen:
            for call in (busy.evict_prefixes, busy.flush_disk, busy.write_through, lambda: busy.save(tmp_path / "x")):
                try:
                    call()
                    seen.append(None)
                except Exception as e:  # recorded and asserted below
                    seen.append(type(e).__name__)

    busy = _engine(model, progress=progress, disk=hkv.DiskTier(str(tmp_path / "store")))
    assert busy.generate([A], 8)[0].tokens == truth[tuple(A)][0]
    assert seen == ["EngineBusyError"] * 4
    _idle_ok(busy)
    assert not (tmp_path / "x").exists()


def test_a_second_driving_thread_gets_engine_busy_while_submit_and_generate_queue(model, truth):
    entered, release = threading.Event(), threading.Event()

    def progress(msg):
        if msg.startswith("prefilled"):
            entered.set()
            release.wait(30)

    engine = _engine(model, progress=progress)
    results = {}
    worker = threading.Thread(target=lambda: results.setdefault("a", engine.generate([A], 8)))
    worker.start()
    assert entered.wait(60)
    with pytest.raises(hkv.EngineBusyError):
        engine.step()
    h = engine.submit(B, 8)  # thread-safe while the worker drives
    # a second generate joins the worker's queue and waits for it (issue 44: no EngineBusyError)
    queued = threading.Thread(target=lambda: results.setdefault("c", engine.generate([C], 8)))
    queued.start()
    queued.join(0.5)
    assert queued.is_alive()
    release.set()
    worker.join(60)
    queued.join(60)
    engine.progress = None
    assert results["a"][0].tokens == truth[tuple(A)][0]
    assert results["c"][0].tokens == truth[tuple(C)][0]
    assert h.result().tokens == truth[tuple(B)][0]
    _idle_ok(engine)


def test_handles_fed_by_a_driving_thread(model, truth):
    engine = _engine(model)
    handles = [engine.submit(p, 8) for p in (A, B, C)]
    stop = threading.Event()

    def drive():
        while not stop.is_set():
            with contextlib.suppress(hkv.EngineBusyError):  # a handle in this thread drove meanwhile
                engine.run_until_idle()

    t = threading.Thread(target=drive)
    t.start()
    try:
        got = [h.result(timeout=300).tokens for h in handles]
    finally:
        stop.set()
        t.join(60)
    assert got == [truth[tuple(p)][0] for p in (A, B, C)]


# --------------------------------------------------------------------------- interrupt safety
def _interrupt_after(engine, name, n):
    steps, name = engine.steps, name.lstrip("_")  # the engine's compiled transition `name`
    real = getattr(steps, name)
    calls = {"n": 0}

    def wrapped(*args, **kw):
        out = real(*args, **kw)
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return out

    setattr(steps, name, wrapped)
    return lambda: setattr(steps, name, real)


@pytest.mark.parametrize(
    "name, n", [("_claim", 2), ("_prefill", 3), ("_decode", 2), ("_release", 1), ("_record_many", 2)]
)
def test_interrupted_step_requeues_its_requests_and_the_next_step_is_exact(model, truth, name, n):
    engine = _engine(model)
    handles = [engine.submit(A, 8), engine.submit(B, 8, sampling=HOT)]
    undo = _interrupt_after(engine, name, n)
    try:
        with pytest.raises(KeyboardInterrupt), pytest.warns(RuntimeWarning, match="re-initialised"):
            engine.run_until_idle()
    finally:
        undo()
    assert int(np.asarray(engine.cache.active).sum()) == 0 and engine.pending == 2
    engine.run_until_idle()
    assert handles[0].result().tokens == truth[tuple(A)][0]
    assert handles[1].result().tokens == _engine(model).generate([B], 8, sampling=HOT)[0].tokens
    _idle_ok(engine)


@pytest.mark.parametrize("n", [10, 13])
def test_an_interrupt_while_decoding_through_the_prefill_step_requeues_and_stays_exact(model, truth, monkeypatch, n):
    """A KeyboardInterrupt landing after a prefill step that decoded a row (`decode_while_building`,
    the decode step still building): the engine recovers its cache, re-queues both requests, and
    the next run is exact."""
    monkeypatch.setattr(hkv.Engine, "decode_while_building", True)
    engine = _engine(model)
    DecodeStillBuilding(engine)
    handles = [engine.submit(A, 8), engine.submit(B, 8, sampling=HOT)]
    undo = _interrupt_after(engine, "_prefill", n)
    try:
        with pytest.raises(KeyboardInterrupt), pytest.warns(RuntimeWarning, match="re-initialised"):
            engine.run_until_idle()
    finally:
        undo()
    assert engine.stats()["decode_via_prefill"] >= 1  # it landed while rows decoded through prefill
    assert int(np.asarray(engine.cache.active).sum()) == 0 and engine.pending == 2
    engine.run_until_idle()
    assert handles[0].result().tokens == truth[tuple(A)][0]
    assert handles[1].result().tokens == _engine(model).generate([B], 8, sampling=HOT)[0].tokens
    _idle_ok(engine)
    wait_for_ahead()  # (the last engine built its decode step in the background: not into the next test)


def _interrupt_around_ahead(engine, where: str):
    """A KeyboardInterrupt right after a decode was dispatched ahead (its results not handed over
    yet), or when the next step is about to take (or has taken) those results."""
    name = "_dispatch_ahead" if where == "after_dispatch" else "_finish_ahead"
    real = getattr(engine.scheduler, name)

    def wrapped(*args, **kw):
        if where == "before_finish":
            raise KeyboardInterrupt
        out = real(*args, **kw)
        if where == "after_finish" or engine.scheduler.ahead is not None:
            raise KeyboardInterrupt
        return out

    setattr(engine.scheduler, name, wrapped)
    return lambda: setattr(engine.scheduler, name, real)


@pytest.mark.parametrize("where", ["after_dispatch", "before_finish", "after_finish"])
def test_an_interrupt_around_a_decode_dispatched_ahead_requeues_and_stays_exact(model, truth, where):
    """The decode sent ahead has changed the cache before its tokens reach their requests: an
    interrupt there must drop that dispatch with the rest of the step (requests re-queued with the
    tokens they had), never hand its results to the re-queued requests later."""
    engine = _engine(model)
    handles = [engine.submit(A, 40), engine.submit(C, 40, sampling=HOT)]
    undo = _interrupt_around_ahead(engine, where)
    try:
        with pytest.raises(KeyboardInterrupt), pytest.warns(RuntimeWarning, match="re-initialised"):
            engine.run_until_idle()
    finally:
        undo()
    assert engine.stats()["decode_dispatched_ahead"] >= 1 and engine.scheduler.ahead is None
    assert int(np.asarray(engine.cache.active).sum()) == 0 and engine.pending == 2
    engine.run_until_idle()
    fresh = _engine(model)
    assert handles[0].result().tokens == fresh.generate([A], 40)[0].tokens
    assert handles[1].result().tokens == fresh.generate([C], 40, sampling=HOT)[0].tokens
    _idle_ok(engine)


# --------------------------------------------------------------------------- input validation
def test_generate_accepts_arrays_and_numpy_scalars_and_refuses_bad_input(model, truth):
    engine = _engine(model)
    arr = np.asarray([A[:41], B])
    assert [g.tokens for g in engine.generate(arr, np.int32(2))] == [g.tokens for g in engine.generate([A[:41], B], 2)]
    for bad, match in [
        (dict(prompts=[A], max_new_tokens=True), "max_new_tokens"),
        (dict(prompts=[[True, False]], max_new_tokens=2), "integer token ids"),
        (dict(prompts=[[1, 2], [3, [4]]], max_new_tokens=2), "prompt 1"),
        (dict(prompts=[A], max_new_tokens=2, stop_token_ids=[CFG.vocab_size]), "stop token id"),
        (dict(prompts=[A], max_new_tokens=2, sampling=0.5), "sampling"),
        ({"prompts": [5, 6, 7], "max_new_tokens": 2}, r"prompts is a batch: one prompt is \[\[5, \.\.\.\]\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.generate(**bad)
    for bad in ({"decode_steps": 0}, {"block_tokens": 0}, {"block_tokens": 16.0}, {"block_tokens": True}):
        # (block_tokens=0 was a ZeroDivisionError, 16.0 an error from inside JAX; True was accepted)
        with pytest.raises(ValueError, match=f"{next(iter(bad))}=.* must be a positive integer"):
            _engine(model, **bad)


# ----------------------------------------------------------------- your own jit + prefix reuse
def test_user_jit_loop_with_prefix_restore_and_record(model, truth):
    """The README's example: restore a prefix, prefill to the last block boundary and record it (the
    snapshot is taken where the slot's length ends), prefill the rest, decode on device."""
    layout = hkv.CacheLayout(
        hkv.Engine(model, CONFIG, block_tokens=BT, compilation_cache=False).spec, CONFIG
    )  # the engine's spec: the ABI fingerprint covers the weights
    graphdef, weights = nnx.split(model)
    traces = {"prefill": 0, "decode": 0}

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
    def prefill(layout, cache, weights, chunk, slot, n_valid):
        traces["prefill"] += 1
        m = nnx.merge(graphdef, weights)
        return hkv.step_and_sample(m, layout, cache, chunk[None], slot[None], n_valid[None], sampling=HOT)

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
    def decode(layout, cache, weights, first, slot):
        traces["decode"] += 1
        m = nnx.merge(graphdef, weights)
        return hkv.decode_loop(m, layout, cache, first, slot[None], steps=7, sampling=HOT)

    def run(cache, ids, slot):
        buf = np.zeros(128, np.int32)
        buf[: len(ids)] = ids
        cache, first, _, st = prefill(layout, cache, weights, jnp.asarray(buf), slot, jnp.int32(len(ids)))
        assert int(st) == Status.OK
        return cache, first

    def serve(cache, prompt):
        q = hkv.PrefixQuery.of(prompt, layout)
        cache, slot, _ = hkv.transitions.claim_slot(layout, cache)
        cache, dplan = jax.jit(hkv.restore_prefix, static_argnums=0)(layout, cache, slot, *q.args)
        plan = q.plan(dplan)
        edge = (len(prompt) - 1) // BT * BT  # the last block boundary before the prompt's end
        if plan.restored_tokens < edge:
            cache, _ = run(cache, prompt[plan.restored_tokens : edge], slot)
            cache, last = hkv.record_prefix(layout, cache, slot, prompt[:edge])  # snapshot at `edge`
            assert last >= 0
        cache, first = run(cache, prompt[max(edge, plan.restored_tokens) :], slot)
        cache, new, n_new, st = decode(layout, cache, weights, first, slot)
        assert int(st) == Status.OK
        cache, _ = hkv.transitions.release_slot(layout, cache, slot)
        return cache, plan, [int(first[0])] + np.asarray(new[0, : int(n_new[0])]).tolist()

    cache = hkv.init_cache(layout)
    cache, cold, toks = serve(cache, C)
    cache, warm, again = serve(cache, C + [1, 2, 3])
    assert cold.restored_tokens == 0 and warm.restored_tokens == 96
    engine = _engine(model)
    assert toks == engine.generate([C], 8, sampling=HOT)[0].tokens
    assert again == engine.generate([C + [1, 2, 3]], 8, sampling=HOT)[0].tokens
    assert traces == {"prefill": 1, "decode": 1}  # one compilation each for every request
    hkv.check_invariants(layout, cache)


def test_record_prefix_refuses_a_bad_slot_parent_start_or_token(model):
    """`hkv.record_prefix` (the host piece of a custom loop) names a bad argument before it records
    anything: a slot outside the layout was once recorded from another slot (JAX wraps -1)."""
    layout = hkv.CacheLayout(model.cache_spec(block_tokens=BT), CONFIG)
    cache = hkv.init_cache(layout)
    cache, slot, _ = hkv.transitions.claim_slot(layout, cache)
    prompt = A[:BT]
    for kw, match in [
        (dict(slot=-1), r"slot=-1 must be an integer in \[0, 2\)"),
        (dict(slot=2), r"slot=2 must be an integer in \[0, 2\)"),
        (dict(slot=True), "slot=True"),
        (dict(slot=0.0), "slot=0.0"),
        (dict(parent=-2), r"parent=-2 must be an integer in \[-1, 32\)"),
        (dict(parent=32), "parent=32"),
        (dict(start_block=2), r"start_block=2 must be an integer in \[0, 2\)"),
        (dict(tokens=prompt[:-1] + [1.5]), r"tokens\[15\]=1.5"),
        (dict(tokens=[True] * BT), r"tokens\[0\]=True"),
    ]:
        args = dict(slot=slot, tokens=prompt) | kw
        with pytest.raises(ValueError, match=match):
            hkv.record_prefix(layout, cache, args.pop("slot"), args.pop("tokens"), **args)
    assert int(np.asarray(cache.prefix.clock)) == 0  # nothing was recorded (the cache is still live)


def test_decode_loop_refuses_out_of_vocabulary_tokens(model):
    layout = hkv.CacheLayout(
        model.cache_spec(block_tokens=BT), hkv.CacheConfig(slots=1, max_context=32, page_size=8, prefix_records=0)
    )
    cache = hkv.init_cache(layout)
    cache, slot, _ = hkv.transitions.claim_slot(layout, cache)
    lengths = np.asarray(cache.lengths).copy()
    cache, _, n, st = hkv.decode_loop(model, layout, cache, jnp.array([CFG.vocab_size]), slot[None], steps=2)
    assert int(st) == Status.BAD_TOKEN and int(n[0]) == 0
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)


# --------------------------------------------------------------------------------- text in, text out
def test_generate_text_with_a_checkpoint_tokenizer_and_stop_strings(model, tmp_path):
    from hkv.engine.text import tiny_tokenizer

    codec = tiny_tokenizer(CFG.vocab_size)
    codec.save(tmp_path)
    engine = _engine(model, tokenizer=tmp_path)  # a checkpoint folder with tokenizer.json
    prompt = "the quick brown fox jumps over the lazy dog and the cat"
    (full,) = engine.generate_text([prompt], 12, stop_token_ids=[])
    ids = codec.encode([prompt])[0]
    greedy = engine.generate([ids], 12)[0].tokens
    assert full.tokens == greedy and full.text == codec.decode(greedy) and full.finish_reason == "length"
    # a stop string taken from the middle of that output: the text ends before it, tokens after the
    # token that completed it, and the request stops there
    cut = next(i for i in range(3, 12) if codec.decode(greedy[:i]).strip())
    stop = codec.decode(greedy[:cut])[-1]
    (g,) = engine.generate_text([prompt], 12, stop=[stop], stop_token_ids=[])
    assert g.finish_reason == "stop" and stop not in g.text and full.text.startswith(g.text)
    assert g.tokens == greedy[: len(g.tokens)] and len(g.tokens) <= cut
    # stop strings from a generator are read once (the check used to use it up: no stop at all);
    # None is no stop string (it was a TypeError)
    (gen,) = engine.generate_text([prompt], 12, stop=(x for x in [stop]), stop_token_ids=[])
    assert (gen.text, gen.tokens, gen.finish_reason) == (g.text, g.tokens, "stop")
    (none,) = engine.generate_text([prompt], 12, stop=None, stop_token_ids=[])
    assert none.text == full.text and none.finish_reason == "length"
    with pytest.raises(ValueError, match="texts"):
        engine.generate_text("not a list", 4)
    with pytest.raises(ValueError, match=r"texts\[1\]='' encodes to no tokens \(this tokenizer adds no BOS\)"):
        engine.generate_text([prompt, ""], 4)  # (it said "prompt 1 is empty", naming no text)
    for bad in ("x", 5, [""], [3]):
        with pytest.raises(ValueError, match="stop="):
            engine.generate_text([prompt], 4, stop=bad)
    with pytest.raises(ValueError, match="tokenizer"):
        _engine(model).generate_text(["x"], 4)
    # a tokenizer with ids the model has no embedding for is refused when the engine is built
    # (it failed in the first generate_text: "token ids range [3, 297] must lie in [0, 128)")
    with pytest.raises(
        ValueError, match=f"tokenizer has 300 token ids but the model's vocabulary has {CFG.vocab_size}"
    ):
        _engine(model, tokenizer=tiny_tokenizer(300))
    _idle_ok(engine)


def test_generate_text_with_a_tokenizer_smaller_than_the_model_vocabulary(model):
    """A model whose vocabulary is padded past its tokenizer's (DeepSeek-V4: 129,280 rows) may sample
    an id the tokenizer has no token for. Its text is empty (as `tokenizers` decodes it) and the
    generation goes on; it was a ValueError "ids[0]=... must lie in [0, vocab_size=...)" from the
    incremental decoder, raised in the middle of the run."""
    from hkv.engine.text import tiny_tokenizer

    codec = tiny_tokenizer(110)  # the model has 128 ids: 110 .. 127 have no token
    engine = _engine(model, tokenizer=codec)
    hot = hkv.SamplingParams(temperature=8.0, seed=11)  # nearly uniform: padded ids are drawn
    (g,) = engine.generate_text(["the quick brown fox"], 24, sampling=hot, stop_token_ids=[])
    assert any(t >= codec.vocab_size for t in g.tokens)  # the case under test happened
    assert g.finish_reason == "length" and len(g.tokens) == 24
    assert g.text == codec.tokenizer.decode(g.tokens)
    (s,) = engine.generate_text(["the quick brown fox"], 24, sampling=hot, stop=["\x00never"], stop_token_ids=[])
    assert (s.tokens, s.text) == (g.tokens, g.text)
    _idle_ok(engine)


def test_stats_count_prefilled_tokens_after_each_admissions_restore(model):
    """prefill_tokens counts what an admission ran: the prompt minus what its restore brought back."""
    engine = _engine(model)
    engine.generate([C], 2)
    before = engine.stats()["prefill_tokens"]
    (g,) = engine.generate([C + [4, 5]], 2)
    assert g.plan.restored_tokens == 96
    assert engine.stats()["prefill_tokens"] - before == len(C) + 2 - 96
    assert engine.stats()["compile_seconds"] >= 0 and engine.stats()["decode_dispatches"] >= 2


def test_compilations_name_every_bucket_once(model, truth):
    """Stop-id tables of more columns are another program: each is named, and compiled once."""
    engine = _engine(model)
    toks = truth[tuple(B)][0]
    engine.generate([B], 8, stop_token_ids=[toks[5], toks[6], toks[7]])  # 3 ids -> a 4-column table
    engine.generate([B], 8, stop_token_ids=[toks[7], toks[6], toks[5], toks[4]])
    names = engine.compilations
    assert "decode[1x4]+stops4" in names and set(names.values()) == {1}  # (one request: a 1-row step)


def test_decoding_through_the_prefill_step_while_the_decode_step_builds_is_exact(model, truth, monkeypatch):
    """`Engine.decode_while_building`: while the decode step is not built, a decoding request
    advances one token per step through the prefill step it ran, and what a user gets is what the
    decode step gives: greedy tokens equal to the stateless forward, logprobs and logits, stop ids,
    seeded sampling, and block records a later request restores (the decode step here reads as
    building throughout: `DecodeStillBuilding`; preemption: tests/hkv/engine/test_engine.py)."""
    monkeypatch.setattr(hkv.Engine, "decode_while_building", True)
    stop = truth[tuple(B)][0][5]
    results = {}
    for mode in ("decode", "prefill"):
        engine = _engine(model)
        if mode == "prefill":
            held = DecodeStillBuilding(engine)
        else:
            engine.decode_while_building = False
        out = engine.generate([A, B, C], 8, return_logits=True)
        out += engine.generate([B, A + out[0].tokens[:4]], 12, sampling=HOT, stop_token_ids=[stop])
        results[mode] = out
        _idle_ok(engine)
        if mode == "prefill":
            st = engine.stats()
            assert st["decode_dispatches"] == 0 and st["decode_via_prefill"] > 0
            assert not any(name.startswith("decode") for name in engine.compilations)
            # the decode step was asked for (per variant: with and then without logits, for one and for
            # two rows) after a prefill step ran
            assert len(held.asked) == 4 and all(held.asked)
    want, got = results["decode"], results["prefill"]
    for w, g in zip(want, got, strict=True):
        assert g.tokens == w.tokens and g.finish_reason == w.finish_reason and g.seed == w.seed
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
        if w.logits is not None:
            np.testing.assert_allclose(g.logits, w.logits, atol=1e-5)
        assert g.plan.restored_tokens == w.plan.restored_tokens
    for g, p in zip(got[:3], [A, B, C], strict=True):
        assert g.tokens == truth[tuple(p)][0]
        assert np.abs(g.logits - truth[tuple(p)][1]).max() < 1e-4
    assert got[4].plan.restored_tokens > 0  # its prefix: blocks recorded while decoding through prefill
    assert any(g.finish_reason == "stop" for g in got[3:5])
    wait_for_ahead()  # (background builds end here, not in the next test)


@contextlib.contextmanager
def _watched_builds(monkeypatch):
    """While in scope: (threads [(step name, the thread that built or loaded it)], xla Counter of XLA
    compilations or persistent-cache reads by function name)."""
    from hkv.engine import compiled

    threads, xla = [], collections.Counter()
    count = compiled.CompiledSteps.count

    def logged(self, name):
        threads.append((name, threading.current_thread().name))
        count(self, name)

    def compiled_one(event, seconds, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            xla[fun_name] += 1

    monkeypatch.setattr(compiled.CompiledSteps, "count", logged)
    jax.monitoring.register_event_duration_secs_listener(compiled_one)
    try:
        yield threads, xla
    finally:
        jax.monitoring.unregister_event_duration_listener(compiled_one)


def test_decoding_through_prefill_builds_the_decode_step_once_it_has_cost_a_build(model, truth, monkeypatch):
    """With `decode_while_building` on, the decode step builds on a background thread only once
    decoding through the prefill step has cost, or would cost for the rows' remaining tokens, what
    a step's compile cost (`CompilePlan.build_seconds`): a short request under a long compile never builds it;
    with nothing costly to build it starts at the first decode. Decoding goes through the prefill
    step meanwhile and through the decode step once built, compiled once (the background build is
    the program the calls run). Tokens stay exact throughout."""
    from hkv.engine import compiled

    monkeypatch.setattr(hkv.Engine, "decode_while_building", True)
    engine = _engine(model, decode_steps=5)  # a decode variant no other test of this module builds
    said = []
    engine.progress = said.append
    with _watched_builds(monkeypatch) as (threads, xla):
        engine.compile_plan.build_seconds = 1e9  # as if a compile took forever: 7 tokens through prefill cost less
        (g,) = engine.generate([A], 8)
        assert g.tokens == truth[tuple(A)][0]
        first = engine.stats()
        assert first["decode_via_prefill"] == 7 and first["decode_dispatches"] == 0
        assert not any(v[0] == "decode" for v in engine.compile_plan.asked) and xla["jit(decode)"] == 0
        # one message says why these tokens are slow and how to avoid it (once per engine)
        hint = [m for m in said if "through the prefill step" in m]
        assert hint == [
            (
                "decoding one token per step through the prefill step while decode[1x5] is not built (several "
                "times slower per token; it builds once this has cost about a compile; Engine.warmup() or "
                "decode_while_building=False build it first)"
            )
        ]
        engine.compile_plan.build_seconds = 0.0  # nothing costly to build: the first decode starts the build
        (g,) = engine.generate([C], 8)
        assert g.tokens == truth[tuple(C)][0]
        assert ("decode", 1, False, "1x") in engine.compile_plan.asked
        compiled.wait_for_ahead()  # the decode build ends; the next call decodes with it
        via = engine.stats()["decode_via_prefill"]
        (g,) = engine.generate([B], 8)
    assert g.tokens == truth[tuple(B)][0]
    st = engine.stats()
    assert st["decode_via_prefill"] == via and st["decode_dispatches"] >= 2
    assert sum("through the prefill step" in m for m in said) == 1
    built = {name.split("[")[0]: thread.rsplit("_", 1)[0] for name, thread in threads}
    assert built["decode"] == "hkv-step-ahead"
    assert engine.compilations["decode[1x5]"] == 1 and xla["jit(decode)"] == 1
    _idle_ok(engine)


def test_the_decode_step_builds_on_another_thread_while_the_first_prefill_builds(model, truth, monkeypatch):
    """With `decode_while_building` off (the suite's setting, tests/conftest.py), before a first prefill
    the engine starts building the decode step that follows it on a background thread
    (`_Step.build_ahead`), so the two compile at once; the calls then use those
    programs: one compilation each (not one ahead and one at the call: the uncommitted slot scalar
    lowered as a spec with a sharding was another jit key), the same tokens."""
    from hkv.engine import compiled

    compiled.wait_for_ahead()  # (builds earlier tests started would hold the two threads)
    engine = _engine(model, decode_steps=3)  # a decode variant no other test of this module builds
    with _watched_builds(monkeypatch) as (threads, xla):
        (g,) = engine.generate([A], 8)
    assert g.tokens == truth[tuple(A)][0]
    built = {name.split("[")[0]: thread.rsplit("_", 1)[0] for name, thread in threads}
    assert built["decode"] == "hkv-step-ahead"  # (the prefill step, when not built by an earlier test: here)
    assert built.get("prefill", "MainThread") == "MainThread"
    assert engine.compilations["decode[1x3]"] == 1 and xla["jit(decode)"] == 1
    # the slot release and the record step are built ahead too (unless an earlier test built them)
    assert xla["jit(release_slot)"] <= 1 and xla["jit(record_many)"] <= 1
    _idle_ok(engine)


def test_warmup_compiles_every_step_and_changes_nothing(model, truth):
    """After warmup() a request compiles nothing: prefill, decode, claim, release, restore, the metrics
    update (count_plan: it was compiled inside the first request, 0.56 s of TTFT on the e2e model), record
    and evict programs exist for this layout; the warmup leaves the cache's contents and counters as they were."""
    engine = _engine(model, compilation_cache=False)
    before = jax.device_get(engine.cache)
    times = engine.warmup(logits=True)
    assert {"prefill[1x16]", "decode[4]", "decode[4]+logits", "claim", "restore", "record_many"} <= set(times)
    after = jax.device_get(engine.cache)
    for name in ("lengths", "active"):
        np.testing.assert_array_equal(getattr(before, name), getattr(after, name))
    for a, b in zip(jax.tree.leaves(before.groups), jax.tree.leaves(after.groups), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(before.prefix.state, after.prefix.state)
    for a, b in zip(jax.tree.leaves(before.counters), jax.tree.leaves(after.counters), strict=True):
        np.testing.assert_array_equal(a, b)
    t = engine.steps
    jits = [t.prefill, t.decode, t.claim, t.release, t.restore, t.record_many, t.count_plan]
    sizes = [f._cache_size() for f in jits]
    traces = sum(engine._steps.traces.values())
    assert [g.tokens for g in engine.generate([A, C], 8)] == [truth[tuple(A)][0], truth[tuple(C)][0]]
    assert [f._cache_size() for f in jits] == sizes and sum(engine._steps.traces.values()) == traces
    assert set(engine.compilations.values()) == {1}
    hkv.check_invariants(engine.layout, engine.cache)


def test_shared_compiled_steps_keep_a_few_recent_layouts(model):
    """Engines of the same model and layout share one CompiledSteps; the process keeps only the
    MAX_SHARED most recent (on CPU each layout's programs map ~5,000 memory regions of the 65,530 a
    process may have), while an engine keeps its own alive."""
    from hkv.engine import compiled

    a = _engine(model)
    assert _engine(model)._steps is a._steps
    graphdef = a._graphdef
    layouts = [hkv.CacheLayout(a.spec, dataclasses.replace(CONFIG, max_context=160 + 16 * i)) for i in range(1, 6)]
    for layout in layouts:
        compiled.compiled_steps(graphdef, None, layout)
    assert len(compiled._SHARED) <= compiled.MAX_SHARED
    assert _engine(model)._steps is not a._steps  # a's entry was dropped; a still holds it
    with pytest.raises(ValueError, match="compilation_cache"):
        _engine(model, compilation_cache=3)
