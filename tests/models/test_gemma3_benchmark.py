"""benchmarks/e2e_gemma3.py runs end to end: the tiny Gemma 3 served by transformers and by hkv side by
side (one short context, no hkv-only context, two alternating rounds), its tables printed, `--json`
written, tokens equal."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "e2e_gemma3.py"

pytestmark = pytest.mark.parity


@pytest.mark.slow  # a benchmark's smoke run, like the other benchmark scripts' tests
def test_side_by_side_benchmark_runs_on_the_tiny_model(tmp_path):
    """~15 s on 2 cores: a subprocess importing jax, torch and transformers, one engine's warmup() (the
    suite's fast-compile XLA_FLAGS reach it through the environment)."""
    out_json = tmp_path / "figures.json"
    args = ["--tiny", "--contexts", "96", "--hkv-only-contexts", "", "--new-tokens", "12", "--rounds", "2"]
    args += ["--json", str(out_json)]
    run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    for heading in ("## Side by side", "## hkv decode per context", "## Against the issue's targets (at 96)"):
        assert heading in run.stdout
    assert "identical in transformers" in run.stdout
    assert "0 mismatches (target 0: met)" in run.stdout
    assert "over 2 alternating rounds (medians in the tables)" in run.stdout
    figures = json.loads(out_json.read_text())
    (ctx,) = figures["contexts"]
    assert ctx["ctx"] == 96 and figures["hkv_only"] == []
    assert ctx["cold"]["tokens"] == ctx["hf"]["tokens"] and len(ctx["hf"]["tokens"]) == 12
    assert ctx["cold"]["ttft"] > 0 and ctx["hf"]["prefill"] > 0 and ctx["cold"]["decode_ms"] > 0
    # --rounds 2: both engines' cold figures per round, the tables' figures their medians
    rounds = ctx["rounds"]
    assert [len(rounds[k]) for k in ("hf_prefill", "hf_decode_ms", "ttft", "decode_ms")] == [2, 2, 2, 2]
    assert ctx["cold"]["ttft"] == pytest.approx(sum(rounds["ttft"]) / 2)
    assert ctx["hf"]["prefill"] == pytest.approx(sum(rounds["hf_prefill"]) / 2)
    assert figures["meta"]["hkv_revision"] and figures["meta"]["command"].startswith("python benchmarks/e2e_gemma3.py")
