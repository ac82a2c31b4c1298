"""The `hkv` command line: `python -m hkv serve` as a real process (health, a request, SIGTERM -> exit 0),
`python -m hkv generate` streaming the engine's greedy text (slow), and the commands' refusals."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import jax
import pytest

from hkv.serve.cli import build_parser, main, parse_mesh

from .server import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT = 300  # seconds for a process to load, compile (a cold cache) and listen
STOP_TIMEOUT = 60  # seconds SIGTERM may take (nothing runs: it drains nothing)
SMALL = ["--max-context", "128"]  # the same cache layout in both processes: their compiled steps are shared


def _env() -> dict[str, str]:
    """The test process's environment (XLA flags included) and its compilation cache, so the children
    load the programs compiled before instead of compiling them again."""
    return {**os.environ, "HKV_COMPILATION_CACHE": jax.config.jax_compilation_cache_dir or "0", "PYTHONPATH": ROOT}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"hkv serve exited with {proc.returncode}:\n{proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"hkv serve did not answer /health within {START_TIMEOUT} s")


def test_serve_answers_then_exits_0_on_sigterm():
    port = _free_port()
    cmd = [sys.executable, "-m", "hkv", "serve", "tiny-gemma3", "--port", str(port), "--slots", "1", *SMALL]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url)
        body = {"model": "tiny-gemma3", "prompt": "Hello the", "max_tokens": 6, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert r["usage"]["completion_tokens"] == 6 and r["choices"][0]["finish_reason"] == "length"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=STOP_TIMEOUT)
        assert proc.returncode == 0, err
        assert "warmed up" in err and "serving tiny-gemma3 on http://127.0.0.1" in err and "stopped" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
def test_generate_streams_the_engines_greedy_text():
    import hkv
    from hkv.serve import load_model

    gen = subprocess.run(
        [sys.executable, "-m", "hkv", "generate", "tiny-gemma3", "--prompt", "Hello the", "--max-tokens", "6", *SMALL],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
    )
    assert gen.returncode == 0, gen.stderr
    assert "6 tokens, finish_reason=length" in gen.stderr
    loaded = load_model("tiny-gemma3")
    engine = hkv.Engine(loaded.model, hkv.CacheConfig(slots=1, max_context=128), tokenizer=loaded.tokenizer)
    (want,) = engine.generate_text(["Hello the"], 6)
    assert gen.stdout == want.text + "\n"


def test_refusals_and_store(capsys):
    assert main([]) == 2
    assert main(["serve", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert main(["serve", "tiny-gemma3", "--dtype", "int4"]) == 2  # argparse's choices
    assert main(["store", "verify", "/no/such/store"]) == 2  # hkv.store.cli: an unopenable store
    assert "no such directory" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "tiny-gemma3"])
    assert (args.host, args.port, args.max_queue, args.mesh) == ("127.0.0.1", 8000, 256, None)


def test_parse_mesh():
    assert parse_mesh(None) is None
    mesh = parse_mesh("2x4")
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert dict(parse_mesh("2").shape) == {"data": 2, "model": 1}
    for bad in ("2x", "x2", "0x1", "2x2x2", "two"):
        with pytest.raises(ValueError, match="must be DATA or DATAxMODEL"):
            parse_mesh(bad)
    with pytest.raises(ValueError, match="needs 64 devices"):
        parse_mesh("8x8")
