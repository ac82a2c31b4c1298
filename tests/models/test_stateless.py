"""`models.stateless`: the jitted stateless forward is shared by models of one structure, weights as data."""

from __future__ import annotations

import jax
import numpy as np

from models.deepseek_v4 import forward_fn, init, tiny_config
from models.stateless import greedy_stateless

IDS = np.random.default_rng(0).integers(0, 128, (2, 12))


def _traces(fn):
    """How many functions JAX traced while `fn()` ran, and its result."""
    n = [0]

    def on(event, seconds, **_):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            n[0] += 1

    jax.monitoring.register_event_duration_secs_listener(on)
    try:
        out = fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(on)
    return n[0], out


def test_a_second_forward_of_the_same_structure_traces_nothing_and_reads_its_own_weights():
    a, b = init(tiny_config(), seed=0), init(tiny_config(), seed=1)
    first, want_b = _traces(lambda: np.asarray(forward_fn(b)(IDS)))
    assert first > 0
    other, got_a = _traces(lambda: np.asarray(forward_fn(a)(IDS)))
    again, got_b = _traces(lambda: np.asarray(forward_fn(b)(IDS)))
    assert other == 0 and again == 0  # one jitted forward per structure and shape, not per call
    assert np.abs(got_a - want_b).max() > 1e-3  # a's weights, not the first caller's
    np.testing.assert_array_equal(got_b, want_b)


def test_greedy_stateless_twice_traces_once():
    model = init(tiny_config(), seed=2)
    prompts = [IDS[0, :5].tolist(), IDS[1].tolist()]
    n1, (tok1, _) = _traces(lambda: greedy_stateless(model, prompts, 3))
    n2, (tok2, _) = _traces(lambda: greedy_stateless(model, prompts, 3))
    assert n1 > 0 and n2 == 0
    assert tok1 == tok2
