"""hkv.serve.driver against an engine whose steps fail: the requests get a 500 with the OpenAI body (not a
hang), and after MAX_STEP_FAILURES failures in a row the driver stops stepping: /health and new requests
answer 503. No model is compiled here."""

from __future__ import annotations

import types

import pytest

import hkv
from hkv.engine.text import tiny_tokenizer
from hkv.serve import create_app
from hkv.serve.driver import MAX_STEP_FAILURES, EngineDriver

from .server import httpx, running


class BrokenEngine:
    """Takes requests like an `hkv.Engine`; every step raises."""

    def __init__(self):
        self.tokenizer = tiny_tokenizer(512)
        self.layout = types.SimpleNamespace(config=types.SimpleNamespace(max_context=64))
        self.model = types.SimpleNamespace(vocab_size=512)
        self.handles: list[hkv.RequestHandle] = []
        self.steps = 0
        self.closed = False

    def submit_choices(self, prompt, budget, *, sampling):
        handles = [hkv.RequestHandle(self, len(self.handles) + i) for i in range(sampling.n)]
        self.handles += handles
        return handles

    @property
    def pending(self) -> int:
        return sum(not h.done for h in self.handles)

    def step(self):
        self.steps += 1
        raise RuntimeError("boom")

    def _try_step(self) -> bool:  # (what a RequestHandle waiting on its own calls; the driver never lets it)
        return False

    def stats(self):
        return {"active_slots": 0}

    def close(self):
        self.closed = True


def test_failing_steps_answer_500_then_503():
    engine = BrokenEngine()
    app = create_app(engine, model_name="broken", max_queue=8)
    body = {"model": "broken", "prompt": "Hi", "max_tokens": 4}
    with running(app) as url:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error" and "RuntimeError: boom" in r.json()["error"]["message"]
        stream = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=60)
        assert stream.status_code == 200 and '"type": "server_error"' in stream.text  # an error event
        assert stream.text.endswith("data: [DONE]\n\n")
        driver = app.state.driver
        for _ in range(200):
            if driver.broken:
                break
            httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert engine.steps >= MAX_STEP_FAILURES and "failed 3 steps in a row" in driver.broken
        health = httpx.get(f"{url}/health", timeout=60)
        assert health.status_code == 503 and "RuntimeError: boom" in health.json()["error"]["message"]
        refused = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
        metrics = httpx.get(f"{url}/metrics", timeout=60).text
        assert 'hkv_requests_total{endpoint="completions",finish_reason="error"}' in metrics
    assert engine.closed


def test_max_queue_must_be_positive():
    with pytest.raises(ValueError, match="max_queue=0 must be an integer >= 1"):
        EngineDriver(BrokenEngine(), max_queue=0)
