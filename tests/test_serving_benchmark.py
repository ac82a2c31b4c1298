"""benchmarks/serving.py: its workload and figures (fast), and the whole benchmark end to end in a tiny
configuration (slow: `hkv serve` as a process, the same requests straight to an engine)."""

from __future__ import annotations

import json

import jax
import pytest

from . import benchmark_script


@pytest.fixture
def serving(monkeypatch):
    """benchmarks/serving.py as a module."""
    return benchmark_script.load(monkeypatch, "serving")


def test_workload_is_seeded_and_shares_prefixes(serving):
    wl = serving.make_workload(seed=3, users=6, turns=3, system_prompts=2, system_words=20, user_words=4)
    assert wl == serving.make_workload(seed=3, users=6, turns=3, system_prompts=2, system_words=20, user_words=4)
    assert wl != serving.make_workload(seed=4, users=6, turns=3, system_prompts=2, system_words=20, user_words=4)
    assert wl.requests == 18 and len(wl.systems) == 2
    assert [s for s, _ in wl.users] == [0, 1, 0, 1, 0, 1]
    first = serving.messages(wl, 2, [])
    second = serving.messages(wl, 2, ["a reply"])
    assert first[0] == {"role": "system", "content": wl.systems[0]} and len(first) == 2
    assert second[: len(first)] == first and second[2] == {"role": "assistant", "content": "a reply"}
    assert second[3]["content"] == wl.users[2][1][1]


def test_figures_and_the_reusable_bound(serving):
    R = serving.Record
    a = R(0, 0, [1, 2, 3, 4, 5], sent=0.0, chunks=[1.0, 1.5, 2.5], text="x", tokens=3, prompt_tokens=5)
    a.gen_ids = [6, 7, 8]
    b = R(1, 0, [1, 2, 3, 9], sent=0.5, chunks=[2.0, 3.0], tokens=3, prompt_tokens=4, cached_tokens=2)
    c = R(0, 1, [1, 2, 3, 4, 5, 6, 7, 10], sent=3.0, chunks=[4.0], tokens=3, prompt_tokens=8, cached_tokens=6)
    bad = R(2, 0, [1], sent=0.0, error="RuntimeError: boom")
    serving.reusable([a, b, c, bad])
    f = serving.figures([a, b, c, bad], 4.0)
    assert (a.reusable_tokens, b.reusable_tokens, c.reusable_tokens) == (0, 3, 7)  # c: a's prompt + reply
    assert f["requests"] == 4 and f["errors"] == 1 and f["error_messages"] == ["RuntimeError: boom"]
    assert f["generated_tokens"] == 9 and f["tokens_per_s"] == 9 / 4 and f["requests_per_s"] == 3 / 4
    assert f["ttft_p50_ms"] == pytest.approx(1000.0)  # TTFTs 1.0, 1.5, 1.0 s
    assert f["itl_p50_ms"] == pytest.approx(1000.0)  # gaps 0.5, 1.0 (a) and 1.0 (b)
    assert f["prefix_hit_rate"] == pytest.approx(8 / 17) and f["reusable_rate"] == pytest.approx(10 / 17)


def test_quick_is_small(serving):
    args = serving.parse_args(["--quick"])
    assert (args.users, args.turns, args.concurrency, args.rounds) == (16, 3, 16, 1)
    assert serving.parse_args(["--quick", "--rounds", "3"]).rounds == 3  # an explicit flag wins
    full = serving.parse_args([])
    assert (full.users * full.turns, full.concurrency, full.rounds) == (256, 64, 2)


@pytest.mark.slow  # ~40 s on 2 cores: starts `hkv serve` twice (compiled steps from the test compilation cache)
def test_benchmark_runs_end_to_end(serving, monkeypatch, tmp_path, capsys):
    # the server process loads the programs this test session compiled (as tests/serve/test_cli.py's do)
    monkeypatch.setenv("HKV_COMPILATION_CACHE", jax.config.jax_compilation_cache_dir or "0")
    out = tmp_path / "serving.json"
    # test_cli's cache layout (one slot, 128 tokens), so both share their compiled steps
    argv = ["--model", "tiny-gemma3", "--slots", "1", "--max-context", "128", "--users", "3", "--turns", "2",
            "--concurrency", "3", "--system-prompts", "1", "--system-words", "6", "--user-words", "2",
            "--max-tokens", "4", "--rounds", "2", "--request-timeout", "120", "--timeout", "300",
            "--json", str(out)]  # fmt: skip
    status = serving.main(argv)
    printed = capsys.readouterr().out
    assert status == 0, printed
    figures = json.loads(out.read_text())
    assert figures["failures"] == [] and figures["replies_differ"] == 0
    for side in ("http", "direct"):
        f = figures[side]
        assert f["requests"] == 12 and f["errors"] == 0 and f["generated_tokens"] == 48, (side, f)
        assert 0 < f["prefix_hit_rate"] <= f["reusable_rate"], (side, f)  # turn 2 restores turn 1's prompt
        assert f["cached_tokens"] == f["engine_restored_tokens"]
    assert set(figures["ratios"]) >= {"ttft_p50_ms", "itl_p50_ms", "tokens_per_s"}
    order = [(p["mode"], p["round"]) for p in figures["phases"]]
    assert order == [("http", 0), ("direct", 0), ("direct", 1), ("http", 1)]  # alternating: drift cancels
    assert figures["http"]["phases"] == figures["direct"]["phases"] == 2
    assert "TTFT p50 (ms)" in printed and "replies equal to the first phase's: 18 of 18" in printed
    assert not jax.config.jax_log_compiles  # the benchmark put JAX's settings back
