"""benchmarks/decode_kernels.py runs end to end (tiny shapes), so the device check does not find it broken."""

import importlib.util
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "decode_kernels.py"


@pytest.mark.slow  # ~30 s on 2 CPU cores: compiles every op for two context lengths
def test_kernels_benchmark_runs_and_checks(capsys):
    spec = importlib.util.spec_from_file_location("kernels_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    status = module.main(
        [
            "--contexts",
            "96,160",
            "--heads",
            "16",
            "--head-dim",
            "32",
            "--window",
            "16",
            "--page-size",
            "16",
            "--topk",
            "16",
            "--idx-heads",
            "16",
            "--idx-dim",
            "16",
            "--hca-ratio",
            "32",
            "--iters",
            "1",
            "--check",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "backend=cpu" in out and "# checks: all PASS" in out
    for op in ("swa", "hca", "csa_attention", "csa_step"):
        assert f"{op:14s} ctx=   160  reference" in out
    assert "step time at 160 tokens / at 96 tokens" in out
