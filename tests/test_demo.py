"""`make demo` as users run it: a fresh process at XLA's default CPU codegen (the suite compiles at -O0,
tests/conftest.py), the persistent compilation cache and step store on. The demo raises SystemExit when
a cached generation disagrees with the stateless forward (tokens or logits > 1e-4), when the third
turn's prefix does not come from the disk tier, or when a seeded sampled run does not reproduce."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import _CACHE_DIR

ROOT = Path(__file__).resolve().parents[1]


# slow: the demo compiles at the default codegen in a process of its own (~60 s on 2 cores); `make test`
# runs the same exactness checks at the suite's codegen (tests/models, tests/hkv/engine/test_engine.py)
@pytest.mark.slow
def test_make_demo_is_exact_at_the_default_codegen():
    env = dict(os.environ, JAX_PLATFORMS="cpu", HKV_COMPILATION_CACHE=os.path.join(_CACHE_DIR, "demo"))
    env["XLA_FLAGS"] = env.get("HKV_TEST_USER_XLA_FLAGS", "")
    env.pop("HKV_STEP_STORE", None)
    out = subprocess.run(
        [sys.executable, "-m", "models.deepseek_v4.demo"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any("tokens identical = True" in line and "max |logit diff|" in line for line in lines), out.stdout
    assert sum("tokens identical to the stateless forward = True" in line for line in lines) == 2, out.stdout
    assert any("identical tokens = True" in line for line in lines), out.stdout
