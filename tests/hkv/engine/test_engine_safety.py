"""Engine liveness and exception safety (issue 11, defects 2, 3 and 10's input checks).

* An idle engine admits every prompt that fits `max_context` and the pools: cached chains give way,
  pinned or not, when nothing runs; a genuine `CacheCapacityError` says what holds the pages.
* An exception or `KeyboardInterrupt` anywhere inside `generate` (a raising progress callback, a
  notebook's stop button landing between a donated transition and its result) leaves the engine
  usable: `engine.cache` is a live value, the aborted request's slots and pages are freed, and the
  next call is exact.
* Public inputs are checked with named errors before anything runs.
"""

from __future__ import annotations

import signal
import threading

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hkv
from hkv.core import prefix as px
from models.deepseek_v4 import init, tiny_config
from models.stateless import greedy_stateless

CFG = tiny_config()
BT = 16
RNG = np.random.default_rng(11)
BASE = RNG.integers(0, CFG.vocab_size, 300).tolist()
OTHER = RNG.integers(0, CFG.vocab_size, 300).tolist()


@pytest.fixture(scope="module")
def model():
    return init(CFG, seed=0)


@pytest.fixture(scope="module")
def truth(model):
    """Greedy continuations (4 tokens) of the prompts these tests use, from the stateless forward."""
    prompts = [BASE[:280], BASE[:100], OTHER[:90], BASE[:64] + OTHER[:30]]
    toks, _ = greedy_stateless(model, prompts, 4)
    return {tuple(p): t for p, t in zip(prompts, toks, strict=True)}


# The two-slot layout of every two-slot test here (the property test's long-lived engine included):
# one layout compiles its steps once for the module (~22 s of compiling on a cold cache per layout).
TWO_SLOTS = dict(slots=2, max_context=320, prefix_records=24)


def _engine(model, **kw):
    cfg = dict(slots=1, max_context=320, page_size=8, prefix_records=64)
    cfg.update(kw.pop("config", {}))
    return hkv.Engine(model, hkv.CacheConfig(**cfg), block_tokens=BT, prefill_chunk=16, **kw)


def _idle_ok(engine):
    """The engine is idle and consistent: no active slot, no page held by a slot, invariants hold."""
    hkv.check_invariants(engine.layout, engine.cache)
    assert int(np.asarray(engine.cache.active).sum()) == 0
    assert not engine.scheduler.running
    for leaf in jax.tree.leaves(engine.cache):
        assert not leaf.is_deleted()


# ------------------------------------------------------------------------------------ liveness
def test_idle_engine_admits_a_prompt_whose_pinned_chain_holds_the_pages(model, truth):
    """Defect 2: a hash hit that restores 0 makes the recomputing request re-record the existing
    chain, pinning records whose pages its slot does not share. With pools for one sequence and the
    chain holding most of them, the request used to fail with 'does not fit even alone'."""
    engine = _engine(model)
    p = BASE[:280]
    assert engine.generate([p], 4)[0].tokens == truth[tuple(p)]
    # indexer keys of the cached chain are now stale: stage 3 rejects every block (restores 0) while
    # the hash still matches, so the request re-records the very same blocks (and pins them)
    engine.cache = px.bump_indexer_version(engine.cache)
    g = engine.generate([p], 4)[0]
    assert g.plan.hash_hit_tokens == 272 and g.plan.restored_tokens == 0  # the swa_missing case
    assert g.plan.first_failed_stage == "intersection" and g.plan.reason in ("swa_missing", "indexer_version")
    assert g.tokens == truth[tuple(p)]
    _idle_ok(engine)


def test_capacity_error_names_what_holds_the_pages(model):
    """A prompt that cannot fit the pools even with every cached chain evicted is refused with an
    error that says which pool is short and who holds its pages; the engine stays usable."""
    layout = hkv.CacheLayout(
        model.cache_spec(block_tokens=BT), hkv.CacheConfig(slots=1, max_context=320, page_size=8, prefix_records=0)
    )
    pages = [layout.reserved_pages(g) for g in range(len(layout.groups))]
    pages[0] = 1  # the first SWA pool: one page of 8 rows, too few for a 16-token prefill chunk
    engine = _engine(model, config=dict(pool_pages=tuple(pages)))
    with pytest.raises(hkv.CacheCapacityError) as e:
        engine.generate([BASE[:100]], 2)
    msg = str(e.value)
    assert "prompt 0" in msg and "pool_pages" in msg and "free" in msg and "records" in msg
    _idle_ok(engine)


# --------------------------------------------------------------------------- exception safety
class _Boom(Exception):
    pass


def _raise_on_call(n, exc):
    calls = {"n": 0}

    def progress(msg):
        calls["n"] += 1
        if calls["n"] == n:
            raise exc

    return progress, calls


@pytest.mark.parametrize("exc", [_Boom("callback failed"), KeyboardInterrupt()])
def test_exception_in_progress_callback_frees_the_slots(model, truth, exc):
    """Defect 3: a progress callback raising mid-generate used to leak the slot with its pages (the
    next call failed with 'does not fit even alone'). Every stage's callback is hit in turn."""
    a, b = BASE[:100], OTHER[:90]
    engine = _engine(model, config=TWO_SLOTS)
    raised = 0
    for n in range(1, 40):
        engine.progress, calls = _raise_on_call(n, exc)
        try:
            gens = engine.generate([a, b], 4)
        except type(exc):
            raised += 1
        else:
            assert calls["n"] < n  # ran to the end without reaching call n
            assert [g.tokens for g in gens] == [truth[tuple(a)], truth[tuple(b)]]
            break
        _idle_ok(engine)
        engine.progress = None
        gens = engine.generate([a, b], 4)
        assert [g.tokens for g in gens] == [truth[tuple(a)], truth[tuple(b)]]
    assert raised >= 4


def _interrupt_after(engine, name, n):
    """Wrap the engine's jitted transition `name` so that its n-th call returns and then raises
    KeyboardInterrupt, as a SIGINT delivered right after a donating call would: the input cache is
    already donated, the new one never reaches `engine.cache`."""
    steps, name = engine.steps, name.lstrip("_")
    real = getattr(steps, name)
    calls = {"n": 0}

    class Wrapped:
        def __call__(self, *args, **kw):
            out = real(*args, **kw)
            calls["n"] += 1
            if calls["n"] == n:
                raise KeyboardInterrupt
            return out

        def __getattr__(self, item):
            return getattr(real, item)

    setattr(steps, name, Wrapped())
    return lambda: setattr(steps, name, real)


@pytest.mark.parametrize("name", ["_decode", "_prefill", "_claim", "_release", "_restore", "_record_many"])
def test_interrupt_between_a_donated_transition_and_its_result(model, truth, name):
    """Defect 3: a KeyboardInterrupt landing after a donating transition returned left engine.cache
    pointing at donated buffers ('Array has been deleted' on every later call). Now the engine
    recovers a live, consistent cache and the next generate is exact."""
    a = BASE[:100]
    engine = _engine(model)
    engine.generate([a], 4)  # something cached, so lookups restore and records exist
    undo = _interrupt_after(engine, name, 1)
    try:
        with pytest.raises(KeyboardInterrupt), pytest.warns(RuntimeWarning, match="re-initialised"):
            engine.generate([a, BASE[:64] + OTHER[:30]], 4)
    finally:
        undo()
    _idle_ok(engine)
    gens = engine.generate([a, BASE[:64] + OTHER[:30]], 4)
    assert [g.tokens for g in gens] == [truth[tuple(a)], truth[tuple(BASE[:64] + OTHER[:30])]]


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_sigint_during_generate_is_delivered_at_a_safe_point(model, truth):
    """A real SIGINT (the notebook stop button) during generate raises KeyboardInterrupt; the engine
    stays usable and exact."""
    a = BASE[:100]
    engine = _engine(model)
    sent = {"n": 0}

    def progress(msg):
        sent["n"] += 1
        if sent["n"] == 2:
            signal.raise_signal(signal.SIGINT)

    engine.progress = progress
    # (it failed once in a full run, not since: "DID NOT RAISE". The engine defers SIGINT only over
    # Python's default handler; if an earlier test left another one installed, say which.)
    found = signal.getsignal(signal.SIGINT)
    assert found is signal.default_int_handler, f"SIGINT handler left installed by an earlier test: {found!r}"
    try:
        engine.generate([a, OTHER[:90]], 4)
    except KeyboardInterrupt:
        pass
    else:
        pytest.fail(f"no KeyboardInterrupt after {sent['n']} progress message(s) (SIGINT sent at the 2nd)")
    engine.progress = None
    _idle_ok(engine)
    assert engine.generate([a], 4)[0].tokens == truth[tuple(a)]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.fixture(scope="module")
def shared_engine(model):
    """One engine across every example of the property test: its prefix cache and pools carry the
    history of all earlier streams and interrupts, as a long-lived server's would."""
    return _engine(model, config=TWO_SLOTS)


def _random_streams(engine, truth, data):
    """Random request streams (shared bases, random cut points) with interrupts injected at random
    progress calls keep check_invariants, never leak a slot, and admit every prompt that fits; every
    completed generation is exact."""
    prompts = list(truth)
    for _ in range(data.draw(st.integers(2, 4), label="requests")):
        batch = data.draw(st.lists(st.sampled_from(prompts), min_size=1, max_size=3), label="batch")
        stop_at = data.draw(st.one_of(st.none(), st.integers(1, 8)), label="interrupt at progress call")
        engine.progress, calls = _raise_on_call(stop_at or 10**9, KeyboardInterrupt())
        try:
            gens = engine.generate([list(p) for p in batch], 4)
        except KeyboardInterrupt:
            assert stop_at is not None and calls["n"] == stop_at
        else:
            assert [g.tokens for g in gens] == [truth[p] for p in batch]
        finally:
            engine.progress = None
        _idle_ok(engine)
    gens = engine.generate([list(p) for p in prompts], 4)
    assert [g.tokens for g in gens] == [truth[p] for p in prompts]


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_random_streams_with_random_interrupts_stay_live(shared_engine, truth, data):
    """Property (4 examples, one long-lived engine): see `_random_streams`."""
    _random_streams(shared_engine, truth, data)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_random_streams_with_random_interrupts_stay_live_long(shared_engine, truth, data):
    """The same property over 40 examples (`make test-slow`)."""
    _random_streams(shared_engine, truth, data)


# --------------------------------------------------------------------------------- input checks
@pytest.mark.parametrize("bad", [True, False, 2.0, "3", None, -1])
def test_max_new_tokens_refuses_bools_and_non_integers(model, bad):
    engine = _engine(model)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([BASE[:20]], bad)


def test_numpy_integers_and_2d_arrays_are_accepted(model, truth):
    engine = _engine(model, config=TWO_SLOTS)
    a = BASE[:100]
    g1 = engine.generate([np.asarray(a, np.int64)], np.int64(4))
    assert g1[0].tokens == truth[tuple(a)]
    g2 = engine.generate(np.asarray([a, a], np.int32), np.int32(4))
    assert [g.tokens for g in g2] == [truth[tuple(a)]] * 2
    g3 = engine.generate(jax.numpy.asarray([a]), 4)
    assert g3[0].tokens == truth[tuple(a)]


@pytest.mark.parametrize(
    "bad,match",
    [
        (None, "prompts"),
        ([None], "prompt 0"),
        ([[1, 2], None], "prompt 1"),
        ([[True, False]], "prompt 0"),
        (np.ones((1, 4), bool), "prompt 0"),
        ([[1, [2, 3]]], "prompt 0"),
        ([[1.0, 2.0]], "prompt 0"),
        ([], "non-empty"),
        ("1 2 3", "prompts"),
        ([[1, 2**40]], "prompt 0"),
    ],
)
def test_bad_prompts_raise_named_errors_with_the_cache_untouched(model, bad, match):
    engine = _engine(model)
    before = [np.asarray(x).copy() for x in jax.tree.leaves(jax.device_get(engine.cache))]
    with pytest.raises(ValueError, match=match):
        engine.generate(bad, 2)
    after = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(engine.cache))]
    assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))


def test_generate_after_the_disk_tier_was_closed_names_it(model, tmp_path):
    """Defect 10: an engine whose DiskTier was closed raised a bare RuntimeError from the writer; now
    generate refuses up front with `DiskTierClosedError`, nothing run, and a new engine works."""
    tier = hkv.DiskTier(str(tmp_path / "store"))
    engine = _engine(model, disk=tier)
    tier.close()
    with pytest.raises(hkv.DiskTierClosedError, match="closed"):
        engine.generate([BASE[:20]], 2)
    _idle_ok(engine)
