"""`hkv.SamplingParams` (the per-request settings, vLLM's names) and the on-device logits processing
behind penalties, logit bias, min_tokens and top-N logprobs (`hkv.core.sampling`), without an engine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hkv
from hkv.core import sampling as S


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"temperature": -0.1}, r"temperature=-0.1 must be a finite number >= 0 \(0 = greedy\)"),
        ({"top_p": 0.0}, r"top_p=0.0 must be a finite number in \(0, 1\]"),
        ({"top_k": -2}, r"top_k=-2 must be an integer >= -1"),
        ({"presence_penalty": 2.5}, r"presence_penalty=2.5 must be a finite number in \[-2, 2\]"),
        ({"frequency_penalty": float("nan")}, r"frequency_penalty=nan must be a finite number"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty=0.0 must be a finite number > 0"),
        ({"logit_bias": {5: 101}}, r"logit_bias\[5\]=101 must be a finite number in \[-100, 100\]"),
        ({"logit_bias": {"x": 1}}, r"logit_bias key 'x'='x' must be an integer >= 0"),
        ({"logit_bias": [1, 2]}, r"logit_bias=\[1, 2\] must be a mapping"),
        ({"min_tokens": -1}, r"min_tokens=-1 must be an integer >= 0"),
        ({"n": 0}, r"n=0 must be an integer \[1, 1024\]"),
        ({"logprobs": 21}, r"logprobs=21 must be None or an integer \[0, 20\]"),
        ({"stop": [""]}, r"stop\[0\]='' must be a non-empty string"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids\[0\]=-1 must be an integer >= 0"),
        ({"ignore_eos": 1}, r"ignore_eos=1 must be a bool"),
        ({"seed": 2**32}, r"seed=4294967296 must be None or an integer"),
        ({"max_tokens": True}, r"max_tokens=True must be None or an integer"),
    ],
)
def test_bad_settings_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        hkv.SamplingParams(**kw)


def test_vllm_spellings_are_normalized():
    s = hkv.SamplingParams(top_k=-1, stop="END", logit_bias={"7": 2}, stop_token_ids=[3, 3, 4])
    assert (s.top_k, s.stop, s.logit_bias, s.stop_token_ids) == (0, ("END",), {7: 2.0}, (3, 4))
    assert hash(s) == hash(hkv.SamplingParams(top_k=0, stop=["END"], logit_bias={7: 2.0}, stop_token_ids=(3, 4)))
    assert hkv.SamplingParams().greedy and not hkv.SamplingParams().penalized
    assert hkv.SamplingParams(repetition_penalty=1.1).penalized


def _reference(logits, *, seen, out, rep, freq, pres, bias, banned):
    """vLLM's rules on the host, one row."""
    x = np.array(logits, np.float64)
    for t in banned:
        x[t] = -np.inf
    for t, v in bias.items():
        x[t] += v
    counts = np.bincount(np.asarray(out, int), minlength=x.size)
    hit = counts > 0
    hit[list(seen)] = True
    x = np.where(hit, np.where(x > 0, x / rep, x * rep), x)
    return x - freq * counts - pres * (counts > 0)


def test_process_logits_matches_the_rules_and_leaves_neutral_rows_bitwise():
    v = 64
    logits = np.asarray(jax.random.normal(jax.random.key(0), (3, v)) * 3, np.float32)
    rows = [
        hkv.SamplingParams(repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=-0.3, logit_bias={9: 5.0}),
        hkv.SamplingParams(),  # neutral: must come back bitwise equal
        hkv.SamplingParams(min_tokens=3, logit_bias={1: -2.0, 2: 1.5}),
    ]
    hist = [
        S.RowHistory(prompt=[1, 2, 3], output=[4, 4, 5]),
        S.RowHistory(prompt=[1, 2], output=[7]),
        S.RowHistory(prompt=[9], output=[8], banned=[0, 63]),
    ]
    batch = S.SamplingBatch.stack(rows, [0, 0, 0], hist, v)
    assert batch.variant == "+pen+bias2+ban2"
    out = np.asarray(S.process_logits(jnp.asarray(logits), batch, jnp.zeros(3, jnp.int32)))
    ref0 = _reference(logits[0], seen=[1, 2, 3], out=[4, 4, 5], rep=1.7, freq=0.4, pres=-0.3, bias={9: 5.0}, banned=[])
    np.testing.assert_allclose(out[0], ref0, rtol=1e-6, atol=1e-6)
    assert out[1].tobytes() == logits[1].tobytes()
    ref2 = _reference(logits[2], seen=[], out=[], rep=1.0, freq=0, pres=0, bias={1: -2.0, 2: 1.5}, banned=[0, 63])
    np.testing.assert_allclose(out[2], ref2, rtol=1e-6, atol=1e-6)
    # min_tokens: once the row has made min_left tokens in the dispatch, the ban lifts
    lifted = np.asarray(S.process_logits(jnp.asarray(logits), batch, jnp.asarray([0, 0, 2], jnp.int32)))
    assert np.isfinite(lifted[2, [0, 63]]).all() and np.isinf(out[2, [0, 63]]).all()


def test_count_tokens_and_top_logprobs():
    v = 16
    rows = [hkv.SamplingParams(frequency_penalty=1.0, logprobs=3), hkv.SamplingParams()]
    batch = S.SamplingBatch.stack(rows, [0, 0], [S.RowHistory(output=[2]), S.RowHistory()], v)
    assert batch.top_n == 4  # bucketed to a power of two; the engine keeps each row's own 3
    counted = S.count_tokens(batch, jnp.asarray([2, 5]), jnp.asarray([True, False]))
    assert np.asarray(counted.counts)[0, 2] == 2 and np.asarray(counted.counts)[1].sum() == 0
    logits = jax.random.normal(jax.random.key(1), (2, v))
    ids, lps = S.top_logprobs(logits, 3)
    full = jax.nn.log_softmax(logits, axis=-1)
    order = np.argsort(-np.asarray(full), axis=-1)[:, :3]
    np.testing.assert_array_equal(np.asarray(ids), order)
    np.testing.assert_allclose(np.asarray(lps), np.take_along_axis(np.asarray(full), order, axis=-1), rtol=1e-6)


def test_widen_all_pads_neutrally():
    a = S.SamplingBatch.stack([hkv.SamplingParams(presence_penalty=1.0)], [0], [S.RowHistory(output=[1])], 8)
    b = S.SamplingBatch.stack([hkv.SamplingParams(logit_bias={3: 1.0}, logprobs=2)], [0])
    wa, wb = S.SamplingBatch.widen_all([a, b])
    assert wa.variant == wb.variant == "+pen+bias1+top2"
    logits = jnp.arange(8, dtype=jnp.float32)[None] - 4.0
    assert np.asarray(S.process_logits(logits, wb)).tobytes() == np.asarray(S.process_logits(logits, b)).tobytes()


def test_broadcast_refuses_what_needs_history():
    with pytest.raises(ValueError, match="penalties or min_tokens, which need each row's tokens"):
        S.SamplingBatch.broadcast(hkv.SamplingParams(repetition_penalty=1.2), 2)
    ok = S.SamplingBatch.broadcast(hkv.SamplingParams(logit_bias={1: 3.0}, logprobs=1), 2)
    assert ok.variant == "+bias1+top1"
