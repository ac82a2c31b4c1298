"""hkv serve's HTTP API, driven by the official `openai` client and raw HTTP: a tiny Gemma 3 served in
this process (uvicorn in a thread on a free port), one engine for the module (its steps compile once).

Completions and chat, streamed (== not streamed, greedy) and not; n with a seed; logprobs; stop
strings; errors with the OpenAI body and the engine serving afterwards; 429; a client disconnecting
mid-stream frees its slot; 64 concurrent requests; the prefix cache in `usage`; /metrics parsed."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import hkv
from hkv.serve import create_app, load_model

from .server import httpx, running

TIMEOUT = 120.0  # seconds for any one HTTP call (a first call may compile a sampling variant)
MODEL = "tiny-gemma3"
CONFIG = hkv.CacheConfig(slots=4, max_context=256, prefix_records=64)


class Served:
    """The module's server: its URL, engine, app and an `openai` client (no retries: a 429 is an answer)."""

    def __init__(self, url: str, engine, app):
        self.url, self.engine, self.app = url, engine, app
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=TIMEOUT, max_retries=0)

    def post(self, path: str, body: dict):
        return httpx.post(f"{self.url}{path}", json=body, timeout=TIMEOUT)

    def idle(self, timeout: float = 30.0) -> bool:
        """Wait until the server holds no request and the engine has none pending."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.app.state.driver.active == 0 and self.engine.pending == 0:
                return True
            time.sleep(0.02)
        return False


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL)


def make_engine(loaded):
    return hkv.Engine(loaded.model, CONFIG, tokenizer=loaded.tokenizer, prefill_chunk=32, decode_steps=8)


@pytest.fixture(scope="module")
def served(loaded):
    engine = make_engine(loaded)
    app = create_app(engine, model_name=MODEL, chat_template=loaded.chat_template, max_queue=64)
    with running(app) as url:
        yield Served(url, engine, app)


def greedy(served, prompt="Hello the world", **kw):
    return served.client.completions.create(model=MODEL, prompt=prompt, temperature=0, **kw)


def sse_events(response) -> list:
    """The `data:` payloads of a server-sent event stream (JSON decoded, "[DONE]" as is)."""
    out = []
    for block in response.text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_health_and_models(served):
    r = httpx.get(f"{served.url}/health", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    (card,) = served.client.models.list().data
    assert card.id == MODEL and card.owned_by == "hkv"


def test_completion_stream_equals_whole(served):
    whole = greedy(served, max_tokens=12)
    (choice,) = whole.choices
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == len(served.engine.tokenizer.encode(["Hello the world"])[0])
    chunks = list(greedy(served, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    raw = served.post("/v1/completions", {"model": MODEL, "prompt": "Hello the world", "max_tokens": 3, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert sse_events(raw)[-1] == "[DONE]"


def test_chat_stream_equals_whole(served):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    whole = served.client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=10)
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    prompt = served.app.state.served.chat_template.encode(served.engine.tokenizer, msgs)
    assert whole.usage.prompt_tokens == len(prompt)
    stream = served.client.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=10, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_default_max_tokens_fills_the_context(served):
    template, codec = served.app.state.served.chat_template, served.engine.tokenizer
    msgs = next(  # a conversation that leaves about 10 tokens of the context
        m for k in range(1, 300) if len(template.encode(codec, m := [{"role": "user", "content": "ab " * k}])) >= 246
    )
    left = CONFIG.max_context - len(template.encode(codec, msgs))
    assert 0 < left <= 10
    r = served.client.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == left and r.choices[0].finish_reason == "length"


def test_n_with_a_seed_is_reproducible(served):
    kw = {"model": MODEL, "prompt": "Once", "max_tokens": 8, "temperature": 1.0, "n": 2, "seed": 11}
    first = served.client.completions.create(**kw)
    again = served.client.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    single = served.client.completions.create(**{**kw, "n": 1, "seed": 12})  # choice i draws with seed + i
    assert single.choices[0].text == first.choices[1].text
    assert first.usage.completion_tokens == 16 and first.usage.prompt_tokens == single.usage.prompt_tokens


def test_completion_logprobs(served):
    r = greedy(served, max_tokens=6, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and top[tok] == pytest.approx(logprob)  # greedy: the chosen token is the top one
        assert logprob == pytest.approx(max(top.values())) and logprob < 0
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = [c.choices[0].logprobs for c in greedy(served, max_tokens=6, logprobs=3, stream=True) if c.choices]
    assert [t for s in streamed if s for t in s.token_logprobs] == pytest.approx(lp.token_logprobs)


def test_chat_logprobs(served):
    msgs = [{"role": "user", "content": "Hi"}]
    r = served.client.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in content) == r.choices[0].message.content
    plain = served.client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=5)
    assert plain.choices[0].logprobs is None


def test_stop_strings(served):
    text = greedy(served, prompt="The quick", max_tokens=24).choices[0].text
    i = next(
        i for i in range(4, len(text) - 2) if text[i : i + 2] not in text[: i + 1] and "\ufffd" not in text[i : i + 2]
    )
    stop = text[i : i + 2]
    cut = greedy(served, prompt="The quick", max_tokens=24, stop=[stop, "never appears"])
    assert cut.choices[0].text == text[:i] and cut.choices[0].finish_reason == "stop"
    streamed = greedy(served, prompt="The quick", max_tokens=24, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text[:i]
    kept = greedy(served, prompt="The quick", max_tokens=24, stop=stop, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[: i + 2]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "x" * 600}, "max_tokens"),  # too long a prompt for the context
        ("/v1/completions", {"prompt": [3, 99999]}, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),  # missing
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ],
)
def test_bad_requests_are_400_with_the_openai_body(served, path, body, param):
    r = served.post(path, {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"]
    assert greedy(served, max_tokens=2).choices[0].finish_reason == "length"  # the engine still serves


def test_openai_client_sees_400_and_404(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    assert e.value.status_code == 400 and "messages[0].role='wizard'" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        served.client.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    assert served.idle()


def test_more_choices_than_the_queue_holds_is_429(served):
    with pytest.raises(openai.RateLimitError) as e:
        served.client.completions.create(model=MODEL, prompt="x", max_tokens=1, n=65)
    assert e.value.status_code == 429 and e.value.body["code"] == "rate_limit_exceeded"
    assert "at most 64" in e.value.message


def _cancelled(served) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{served.url}/metrics", timeout=TIMEOUT).text):
        for s in family.samples:
            if s.name == "hkv_requests_total" and s.labels.get("finish_reason") == "cancelled":
                return s.value
    return 0.0


def test_a_client_disconnecting_mid_stream_frees_its_slot(served):
    before = _cancelled(served)
    body = {"model": MODEL, "prompt": "Go", "max_tokens": 250, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=TIMEOUT) as r:
        got = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                got.append(line)
            if len(got) == 2:
                break
    assert len(got) == 2
    assert served.idle(), "the abandoned request still holds the engine"
    assert _cancelled(served) == before + 1  # cancelled, not run to its 250 tokens
    assert greedy(served, max_tokens=2).choices[0].finish_reason == "length"


def test_a_client_giving_up_on_a_whole_answer_frees_its_slot(served):
    before = _cancelled(served)
    body = {"model": MODEL, "prompt": "Wait", "max_tokens": 250, "temperature": 0, "n": 16}  # 4 waves of 4 slots
    with pytest.raises(httpx.ReadTimeout):  # the client closes its connection after 0.2 s
        httpx.post(f"{served.url}/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.2))
    assert served.idle(), "the abandoned request still holds the engine"
    assert _cancelled(served) > before  # its choices still running were cancelled, not run to the end


def test_64_concurrent_requests_equal_one(served):
    body = {"model": MODEL, "prompt": "Many users say", "max_tokens": 8, "temperature": 0}
    want = served.post("/v1/completions", body).json()["choices"][0]["text"]

    async def all_at_once():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=served.url, timeout=TIMEOUT, limits=limits) as client:
            rs = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(64)))
        return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(all_at_once()) == [want] * 64
    assert served.idle()


def test_usage_reports_prefix_cache_hits(served):
    prompt = np.random.default_rng(7).integers(3, 500, 60).tolist()
    first = greedy(served, prompt=prompt, max_tokens=2)
    second = greedy(served, prompt=[*prompt, 5], max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens  # whole 16-token blocks the first one recorded
    assert 0 < cached <= 48 and cached % 16 == 0


def test_metrics(served):
    greedy(served, max_tokens=3)
    assert served.idle()
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{served.url}/metrics").text)}
    value = lambda name, sample, **labels: next(
        s.value
        for s in families[name].samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )
    assert value("hkv_requests", "hkv_requests_total", endpoint="completions", finish_reason="length") >= 1
    assert value("hkv_prompt_tokens", "hkv_prompt_tokens_total", endpoint="completions") > 0
    assert value("hkv_generation_tokens", "hkv_generation_tokens_total", endpoint="completions") >= 3
    assert (
        value("hkv_time_to_first_token_seconds", "hkv_time_to_first_token_seconds_count", endpoint="completions") >= 1
    )
    assert value("hkv_inter_token_latency_seconds", "hkv_inter_token_latency_seconds_count", endpoint="completions") > 0
    assert value("hkv_requests_running", "hkv_requests_running") == 0
    assert value("hkv_requests_waiting", "hkv_requests_waiting") == 0
    assert value("hkv_server_requests", "hkv_server_requests") == 0
    stats = served.engine.prefix_stats()  # (idle: safe to read here)
    assert value("hkv_prefix_lookups", "hkv_prefix_lookups_total") == stats["lookups"] > 0
    assert value("hkv_prefix_hash_hit_tokens", "hkv_prefix_hash_hit_tokens_total") == stats["hash_hit_tokens"]
    assert value("hkv_prefix_restored_tokens", "hkv_prefix_restored_tokens_total") == stats["restored_tokens"]
    assert families["hkv_prefix_rejections"].type == "counter" and "hkv_transitions" in families


def test_queue_full_429_and_shutdown_drains(loaded):
    """Another app over its own engine (the same compiled steps): two running streams fill a queue of two,
    a third request is refused; then the server is told to exit mid-stream: the stream still runs to
    its end, and the engine is closed."""
    engine = make_engine(loaded)
    app = create_app(engine, model_name=MODEL, chat_template=loaded.chat_template, max_queue=2)
    body = {"model": MODEL, "prompt": "Hold", "max_tokens": 200, "temperature": 0, "stream": True}
    results: dict[int, list[str]] = {}
    first_chunk = [threading.Event(), threading.Event()]

    def stream(i):
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    first_chunk[i].set()
            results[i] = lines

    with running(app) as url:
        readers = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(2)]
        for t in readers:
            t.start()
        assert all(e.wait(TIMEOUT) for e in first_chunk)
        r = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 1}, timeout=TIMEOUT)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    # leaving `running` asked the server to exit and waited for it: the streams ran to their end first
    for t in readers:
        t.join(TIMEOUT)
    for i in range(2):
        assert results[i][-1] == "data: [DONE]"
        finals = [json.loads(x[6:]) for x in results[i][:-1]]
        assert finals[-1]["choices"][0]["finish_reason"] == "length"
    with pytest.raises(hkv.EngineClosedError):
        engine.submit([1, 2, 3], 1)


@pytest.mark.slow
def test_serves_a_mesh_engine(served, loaded):
    """`hkv serve --mesh 2x1`: an hkv.MeshEngine (2 data shards) behind the same API answers greedy
    requests with the single-device engine's text, and n seeded choices as submit_choices seeds them."""
    from hkv.serve.cli import parse_mesh

    mesh = hkv.Engine(loaded.model, CONFIG, mesh=parse_mesh("2x1"), tokenizer=loaded.tokenizer)
    app = create_app(mesh, model_name=MODEL, tokenizer=loaded.tokenizer, chat_template=loaded.chat_template)
    body = {"model": MODEL, "prompt": "Hello the world", "max_tokens": 8, "temperature": 0}
    seeded = {**body, "temperature": 1.0, "seed": 5, "n": 2}
    want = [served.post("/v1/completions", b).json()["choices"] for b in (body, seeded)]
    with running(app) as url:
        got = [httpx.post(f"{url}/v1/completions", json=b, timeout=TIMEOUT).json()["choices"] for b in (body, seeded)]
    assert [[c["text"] for c in g] for g in got] == [[c["text"] for c in w] for w in want]
