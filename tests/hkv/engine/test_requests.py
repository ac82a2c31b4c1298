"""Adversarial property test of the request API (`submit` / `step` / streams / `cancel`).

One engine is driven through random sequences of submits (prompts with shared prefixes, greedy or
seeded sampling, optional stop ids), steps, cancels, streams abandoned after k tokens, waits, runs
until idle, blocking `generate` calls alongside, and a KeyboardInterrupt (lost-cache or deferred)
injected after the n-th call of one of the engine's transitions. After every operation: the cache's
invariants hold, every active slot belongs to a live request, an idle engine holds no slot, and every
handle's tokens so far are a prefix of what the same request produces alone on a fresh engine. At the
end every completed handle has exactly those tokens and every cancelled one raises
`RequestCancelledError`; nothing waits forever (`result(timeout=...)`).

Same model and layout as test_generation, so the compiled steps are shared. The slow twins run more
and longer sequences, and one under page pressure (cached prefixes evicted, requests preempted)."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hkv
from models.deepseek_v4 import init, tiny_config

CFG = tiny_config()
BT = 16
RNG = np.random.default_rng(7)
A = RNG.integers(0, CFG.vocab_size, 70).tolist()
B = RNG.integers(0, CFG.vocab_size, 41).tolist()
CONFIG = hkv.CacheConfig(slots=2, max_context=160, page_size=8, prefix_records=32)
# a small fixed set with shared prefixes: A's first 2 blocks, A itself, A extended, A's branch, B
PROMPTS = [tuple(A[:33]), tuple(A), tuple(A + [1, 2, 3]), tuple(A[:48] + [5, 6, 7, 8, 9]), tuple(B)]
SAMPLINGS = [
    None,
    hkv.SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=1234),
    hkv.SamplingParams(temperature=0.9, seed=7),
]
HOOKS = ["prefill", "decode", "claim", "release", "record_many", "restore"]  # `engine.steps` transitions
WAIT_S = 120.0


@pytest.fixture(scope="module")
def model():
    return init(CFG, seed=5)


def _engine(model, config=CONFIG, **kw):
    kw.setdefault("decode_steps", 4)
    return hkv.Engine(model, config, block_tokens=BT, prefill_chunk=16, **kw)


def _tight(model):
    """CONFIG with the CSA compressed pool cut to what one max_context sequence maps: two long requests
    (and cached prefixes) contend for it, so cached prefixes are evicted and requests preempted."""
    layout = hkv.CacheLayout(model.cache_spec(block_tokens=BT), CONFIG)
    pages = [layout.reserved_pages(g) for g in range(len(layout.groups))]
    for g, grp in enumerate(layout.groups):
        if grp.kind == hkv.ObjectKind.COMPRESSED and grp.unit == 4:
            pages[g] = layout.logical_pages(g) - 1  # 4 pages: two ~80-token requests need 6
    return dataclasses.replace(CONFIG, pool_pages=tuple(pages))


@pytest.fixture(scope="module")
def expected(model):
    """(prompt index, max_new, sampling index, stops) -> tokens of that request alone on a fresh engine."""
    memo: dict = {}

    def get(key):
        if key not in memo:
            p, n, s, stops = key
            memo[key] = (
                _engine(model).generate([list(PROMPTS[p])], n, sampling=SAMPLINGS[s], stop_token_ids=stops)[0].tokens
            )
        return memo[key]

    return get


class _Interrupt:
    """A KeyboardInterrupt after the n-th call of engine.<name>: raised at once (a signal landing between
    a transition and the engine installing its result: the cache is lost), or deferred (a SIGINT the
    engine delivers once the result is installed: the cache survives); disarmed once fired or on `disarm()`."""

    def __init__(self, engine):
        self.engine, self.name, self.real = engine, None, None

    def arm(self, name, n, deferred=False):
        self.disarm()
        real = getattr(self.engine.steps, name)
        calls = {"n": 0}

        def wrapped(*args, **kw):
            out = real(*args, **kw)
            calls["n"] += 1
            if calls["n"] == n:
                self.disarm()
                if deferred and self.engine._interrupt is not None:
                    self.engine._interrupt.pending = True  # a deferred SIGINT: delivered once the cache is installed
                else:
                    raise KeyboardInterrupt  # lands before the engine installs the result: the cache is lost
            return out

        self.name, self.real = name, real
        setattr(self.engine.steps, name, wrapped)

    def disarm(self):
        if self.name is not None:
            setattr(self.engine.steps, self.name, self.real)
            self.name = self.real = None


def _check(engine, handles, expected):
    hkv.check_invariants(engine.layout, engine.cache)
    active = set(np.nonzero(np.asarray(engine.cache.active))[0].tolist())
    live = {**engine.scheduler.prefilling, **engine.scheduler.running}
    assert not set(engine.scheduler.prefilling) & set(engine.scheduler.running)
    assert active == set(live), f"active slots {active} vs live requests' slots {set(live)}"
    assert all(q.slot == s for s, q in live.items())
    if not engine.pending:
        assert not active
    for h, key in handles:
        want = expected(key)
        assert h.tokens == want[: len(h.tokens)], f"request {h.request_id} {key}: {h.tokens} vs {want}"


def _drive(fn, irq):
    """Run a driving call; an injected interrupt propagates as KeyboardInterrupt and is absorbed here."""
    try:
        fn()
    except KeyboardInterrupt:
        assert irq.name is None  # it fired, so it disarmed itself
    except hkv.RequestCancelledError:
        pass


def _scenario(model, expected, data, n_ops, config=CONFIG):
    engine = _engine(model, config)
    irq = _Interrupt(engine)
    handles: list = []  # (handle, key)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "device cache ... re-initialised"
        try:
            for _ in range(n_ops):
                op = data.draw(
                    st.sampled_from(["submit", "submit", "step", "cancel", "stream", "wait", "irq", "idle", "generate"])
                )
                live = [(h, k) for h, k in handles if not h.done]
                if op == "submit":
                    p = data.draw(st.integers(0, len(PROMPTS) - 1))
                    n = data.draw(st.integers(1, 12))
                    s = data.draw(st.integers(0, len(SAMPLINGS) - 1))
                    stops = ()
                    if data.draw(st.booleans()):
                        # a stop id the request would produce (else it rarely matters)
                        full = expected((p, n, s, ()))
                        stops = (full[data.draw(st.integers(0, len(full) - 1))],)
                    key = (p, n, s, stops)
                    handles.append(
                        (engine.submit(list(PROMPTS[p]), n, sampling=SAMPLINGS[s], stop_token_ids=stops), key)
                    )
                elif op == "step":
                    _drive(engine.step, irq)
                elif op == "idle":
                    _drive(engine.run_until_idle, irq)
                elif op == "cancel" and live:
                    h, _ = data.draw(st.sampled_from(live))
                    h.cancel()
                    assert h.cancelled or h.done
                elif op == "stream" and live:
                    h, _ = data.draw(st.sampled_from(live))
                    k = data.draw(st.integers(1, 6))
                    it = iter(h)

                    def pull(it=it, k=k):
                        for _ in range(k):
                            if next(it, None) is None:
                                break

                    try:
                        _drive(pull, irq)
                    finally:
                        it.close()  # abandoning the stream cancels the request unless it is done
                    assert h.done or h.cancelled
                elif op == "wait" and live:
                    h, _ = data.draw(st.sampled_from(live))
                    _drive(lambda h=h: h.result(timeout=WAIT_S), irq)
                elif op == "generate":
                    p, n, s = (
                        data.draw(st.integers(0, len(PROMPTS) - 1)),
                        data.draw(st.integers(1, 8)),
                        data.draw(st.integers(0, len(SAMPLINGS) - 1)),
                    )
                    out = []
                    _drive(
                        lambda p=p, n=n, s=s, out=out: out.extend(
                            engine.generate([list(PROMPTS[p])], n, sampling=SAMPLINGS[s])
                        ),
                        irq,
                    )
                    if out:
                        assert out[0].tokens == expected((p, n, s, ()))
                elif op == "irq":
                    irq.arm(data.draw(st.sampled_from(HOOKS)), data.draw(st.integers(1, 4)), data.draw(st.booleans()))
                _check(engine, handles, expected)
        finally:
            irq.disarm()
        engine.run_until_idle()
    _check(engine, handles, expected)
    assert engine.pending == 0 and not engine.scheduler.prefilling and not engine.scheduler.running
    for h, key in handles:
        assert h.done
        if h.cancelled:
            with pytest.raises(hkv.RequestCancelledError):
                h.result(timeout=WAIT_S)
        else:
            g = h.result(timeout=WAIT_S)
            assert g.tokens == expected(key), f"request {h.request_id} {key}"
            assert g.finish_reason == ("stop" if key[3] and g.tokens[-1] in key[3] else "length")
    # the engine still serves exactly afterwards
    h = engine.submit(list(PROMPTS[1]), 4)
    assert h.result(timeout=WAIT_S).tokens == expected((1, 4, 0, ()))
    assert not np.asarray(engine.cache.active).any()


_SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
}


@settings(max_examples=3, derandomize=True, **_SETTINGS)
@given(data=st.data())
def test_random_request_streams_are_exact_and_leak_nothing(model, expected, data):
    _scenario(model, expected, data, n_ops=14)


@pytest.mark.slow
@settings(max_examples=30, **_SETTINGS)
@given(data=st.data())
def test_random_request_streams_are_exact_and_leak_nothing_slow(model, expected, data):
    _scenario(model, expected, data, n_ops=30)


@pytest.mark.slow
@settings(max_examples=8, **_SETTINGS)
@given(data=st.data())
def test_random_request_streams_under_page_pressure_slow(model, expected, data):
    _scenario(model, expected, data, n_ops=30, config=_tight(model))
