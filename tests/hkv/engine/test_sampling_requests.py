"""The serving knobs through the engine (issue 44, part 2): per-prompt `SamplingParams`, penalties,
logit bias and min_tokens computed on device, top-N logprobs, `n` choices sharing one prefill, stop
strings and text events in `submit`, and `generate` from a second thread while another drives.

One tiny Gemma 3 engine with the built-in tokenizer serves the file (each sampling variant compiles
its own prefill and decode program once)."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

import hkv
from hkv.engine.chat import tiny_chat_template
from hkv.engine.text import tiny_tokenizer
from models import gemma3
from models.stateless import forward_fn

PROMPT = [5, 17, 42, 9, 11, 3, 88, 21]


@pytest.fixture(scope="module")
def model():
    return gemma3.init(gemma3.tiny_config(), seed=0)


@pytest.fixture(scope="module")
def engine(model):
    cfg = hkv.CacheConfig(slots=4, max_context=128, page_size=16, prefix_records=32)
    return hkv.Engine(model, cfg, prefill_chunk=16, tokenizer=tiny_tokenizer(model.vocab_size))


def _penalized_greedy(model, prompt, steps, *, rep=1.0, freq=0.0, pres=0.0):
    """Greedy decoding with vLLM's penalty rules applied on the host to the stateless forward's logits."""
    fwd, ids, out = forward_fn(model), list(prompt), []
    for _ in range(steps):
        x = np.array(fwd(np.asarray([ids], np.int32))[0, -1], np.float64)
        counts = np.bincount(np.asarray(out, int), minlength=x.size)
        hit = counts > 0
        hit[prompt] = True
        x = np.where(hit, np.where(x > 0, x / rep, x * rep), x) - freq * counts - pres * (counts > 0)
        out.append(int(np.argmax(x)))
        ids.append(out[-1])
    return out


def test_penalties_on_device_follow_the_rules(engine, model):
    s = hkv.SamplingParams(repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.4)
    got = engine.generate([PROMPT], 10, sampling=s)[0]
    assert got.tokens == _penalized_greedy(model, PROMPT, 10, rep=1.8, freq=0.7, pres=0.4)
    plain = engine.generate([PROMPT], 10)[0]
    assert plain.tokens != got.tokens  # (the penalties change this continuation)
    # the logprobs stay those of the raw distribution
    raw = jax.nn.log_softmax(forward_fn(model)(np.asarray([PROMPT + got.tokens[:1]], np.int32))[0, -2])
    np.testing.assert_allclose(got.logprobs[0], raw[got.tokens[0]], rtol=1e-5)


def test_companions_never_change_a_row(engine):
    """A greedy row and a seeded row give the same tokens alone and beside penalized, biased and
    min_tokens companions (their neutral settings leave their logits bitwise as they were)."""
    seeded = hkv.SamplingParams(temperature=0.9, top_k=20, seed=7)
    alone = [engine.generate([PROMPT], 8)[0].tokens, engine.generate([PROMPT[:5]], 8, sampling=seeded)[0].tokens]
    loud = [
        hkv.SamplingParams(),
        seeded,
        hkv.SamplingParams(repetition_penalty=1.3, logit_bias={4: 3.0}),
        hkv.SamplingParams(min_tokens=4, stop_token_ids=[alone[0][1]], logprobs=2),
    ]
    together = engine.generate([PROMPT, PROMPT[:5], [9, 9, 9], [1, 2, 3, 4]], 8, sampling=loud)
    assert [g.tokens for g in together[:2]] == alone


def test_logit_bias_and_min_tokens(engine):
    first = engine.generate([PROMPT], 6)[0].tokens
    forced = engine.generate([PROMPT], 4, sampling=hkv.SamplingParams(logit_bias={"99": 100}))[0]
    assert forced.tokens == [99] * 4
    # stopping at the greedy first token ends at once; min_tokens=3 holds it back for 3 tokens
    stop = [first[0]]
    assert engine.generate([PROMPT], 6, stop_token_ids=stop)[0].tokens == first[:1]
    held = engine.generate([PROMPT], 6, sampling=hkv.SamplingParams(min_tokens=3, stop_token_ids=stop))[0]
    assert len(held.tokens) >= 3 and first[0] not in held.tokens[:3]
    with pytest.raises(ValueError, match=r"logit_bias id 100000 must lie in \[0, vocab_size="):
        engine.generate([PROMPT], 2, sampling=hkv.SamplingParams(logit_bias={100000: 1.0}))


def test_top_logprobs_are_the_raw_top_n(engine):
    g = engine.generate([PROMPT], 5, sampling=hkv.SamplingParams(logprobs=3), return_logits=True)[0]
    assert len(g.top_logprobs) == 5
    for top, logits, tok, lp in zip(g.top_logprobs, g.logits, g.tokens, g.logprobs, strict=True):
        full = np.asarray(jax.nn.log_softmax(logits))
        want = np.argsort(-full, kind="stable")[:3]
        assert [i for i, _ in top] == want.tolist()
        np.testing.assert_allclose([v for _, v in top], full[want], rtol=1e-5)
        assert top[0][0] == tok and top[0][1] == pytest.approx(float(lp), rel=1e-6)  # greedy: the best
    assert engine.generate([PROMPT], 2)[0].top_logprobs is None


def test_per_prompt_sampling_and_budgets(engine):
    rows = [hkv.SamplingParams(max_tokens=3), hkv.SamplingParams(max_tokens=5, temperature=1.0, seed=1)]
    gens = engine.generate([PROMPT, PROMPT], sampling=rows)
    assert [len(g.tokens) for g in gens] == [3, 5] and gens[1].seed == 1
    with pytest.raises(ValueError, match="sampling is a list of 2 settings for 1 prompts"):
        engine.generate([PROMPT], 3, sampling=rows)
    with pytest.raises(ValueError, match=r"max_new_tokens=4 and SamplingParams.max_tokens=3 disagree"):
        engine.generate([PROMPT], 4, sampling=rows[0])
    with pytest.raises(ValueError, match="no new-token budget"):
        engine.generate([PROMPT])


def test_n_choices_share_one_prefill(engine):
    engine.evict_prefixes()
    prompt = list(range(3, 3 + 40))  # two whole blocks of 16 and a partial one
    s = hkv.SamplingParams(n=3, temperature=1.0, seed=11)
    before = engine.stats()["prefill_tokens"]
    gens = engine.generate([prompt], 6, sampling=s)
    assert [g.choice for g in gens] == [0, 1, 2] and [g.seed for g in gens] == [11, 12, 13]
    assert [g.plan.restored_tokens for g in gens] == [0, 32, 32]  # the later choices restore choice 0's blocks
    assert engine.stats()["prefill_tokens"] - before == 40 + 8 + 8
    again = engine.generate([prompt], 6, sampling=s)
    assert [g.tokens for g in again] == [g.tokens for g in gens]  # seeded: reproducible
    assert len({tuple(g.tokens) for g in gens}) > 1
    # each choice equals that seed drawn alone
    alone = engine.generate([prompt], 6, sampling=hkv.SamplingParams(temperature=1.0, seed=12))[0]
    assert alone.tokens == gens[1].tokens
    with pytest.raises(ValueError, match=r"use Engine\.submit_choices"):
        engine.submit(prompt, 2, sampling=s)
    handles = engine.submit_choices(prompt, 6, sampling=s)
    assert [h.result().tokens for h in handles] == [g.tokens for g in gens]


def test_submit_text_with_stop_strings_streams_text(engine):
    tok = engine.tokenizer
    full = engine.submit("the fox", 12, sampling=hkv.SamplingParams(ignore_eos=True)).result()
    assert full.text == tok.decode(full.tokens) and len(full.tokens) == 12
    stop = full.text[2:4]
    h = engine.submit("the fox", 12, sampling=hkv.SamplingParams(stop=[stop], ignore_eos=True, logprobs=1))
    events = list(h.events())
    g = h.result()
    assert g.finish_reason == "stop" and g.stop_string == stop
    assert g.text == full.text[: full.text.index(stop)]
    assert "".join(e.text for e in events) == g.text
    assert [e.token for e in events] == g.tokens == full.tokens[: len(g.tokens)]
    assert all(len(e.top_logprobs) == 1 for e in events)
    codec, engine.tokenizer = engine.tokenizer, None
    try:
        with pytest.raises(ValueError, match=r"stop strings \['x'\] need a tokenizer"):
            engine.generate([PROMPT], 2, sampling=hkv.SamplingParams(stop="x"))
        with pytest.raises(ValueError, match="text prompts need a tokenizer"):
            engine.submit("the fox", 2)
    finally:
        engine.tokenizer = codec


def test_generate_from_a_second_thread_queues(engine):
    """A `generate` while another thread holds the engine joins its queue (no EngineBusyError) and
    returns once the engine runs again."""
    want = engine.generate([PROMPT], 24)[0].tokens
    out, errors = {}, []

    def other():
        try:
            out["tokens"] = engine.generate([PROMPT], 24)[0].tokens
        except BaseException as e:
            errors.append(e)

    with engine.held():  # this thread holds the engine: the other one's call cannot drive
        t = threading.Thread(target=other)
        t.start()
        t.join(1.0)
        assert t.is_alive() and engine.pending == 1  # queued, waiting
    t.join(120)
    assert not errors and out["tokens"] == want


def test_chat_renders_the_template_and_stops_at_eos(engine):
    template = tiny_chat_template()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    got = engine.chat(msgs, 8, template=template)[0]
    ids = template.encode(engine.tokenizer, msgs)
    want = engine.generate([ids], 8, stop_token_ids=engine.tokenizer.eos_token_ids)[0]
    assert got.tokens == want.tokens and got.text == engine.tokenizer.decode(want.tokens)
    two = engine.chat([msgs, msgs[1:]], 4, template=template)
    assert len(two) == 2 and two[0].tokens == got.tokens[:4]
    with pytest.raises(ValueError, match="chat needs a tokenizer and a chat template"):
        engine.chat(msgs, 2)
    with pytest.raises(ValueError, match=r"messages\[0\].role='bot' must be one of"):
        engine.chat([{"role": "bot", "content": "x"}], 2, template=template)


def test_prompt_logprobs_equal_the_stateless_forward(engine, model):
    prompt = list(range(3, 3 + 40))  # three prefill chunks of 16: positions across chunk ends
    engine.generate([prompt], 2)  # cached now; a prompt-logprobs request computes every position anyway
    g = engine.generate([prompt], 2, sampling=hkv.SamplingParams(prompt_logprobs=2))[0]
    assert g.plan.restored_tokens == 0 and g.top_logprobs is None
    full = np.asarray(jax.nn.log_softmax(forward_fn(model)(np.asarray([prompt], np.int32))[0], axis=-1))
    assert g.prompt_logprobs[0] is None and g.prompt_top_logprobs[0] is None and len(g.prompt_logprobs) == 40
    want = [full[t, prompt[t + 1]] for t in range(39)]
    np.testing.assert_allclose(g.prompt_logprobs[1:], want, rtol=1e-5, atol=1e-6)
    for t in range(39):
        order = np.argsort(-full[t], kind="stable")[:2]
        assert [i for i, _ in g.prompt_top_logprobs[t + 1]] == order.tolist()
    assert engine.generate([prompt], 2)[0].prompt_logprobs is None
