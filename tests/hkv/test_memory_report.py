"""Memory accounting for both model families: hkv's allocation vs the architectural minimum vs a uniform
full-KV cache, as `benchmarks/memory.py` prints it (no arrays are allocated)."""

from __future__ import annotations

import importlib.util
import pathlib

import hkv
from hkv.core.memory import allocated_bytes

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "memory.py"
MIB = 2**20


def _script():
    spec = importlib.util.spec_from_file_location("memory_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gemma3_27b_minimum_is_the_hand_computed_kv_of_its_layers():
    _, spec = _script().gemma3()
    n = 131_072
    row = 2 * 16 * 128 * 2  # K and V of 16 heads x 128, bf16
    assert [l.window for l in spec.layers].count(None) == 10 and len(spec.layers) == 62
    want = (52 * 1023 + 10 * n) * row  # sliding layers keep window - 1 rows, full layers every row
    assert hkv.architectural_minimum(spec, n) == {"SWA": want, "COMPRESSED": 0, "INDEXER": 0, "TAIL": 0, "total": want}
    assert hkv.uniform_full_kv_bytes(spec, n, page_size=64) == 62 * n * row
    layout = hkv.CacheLayout(spec, hkv.CacheConfig(slots=1, max_context=n, page_size=64))
    alloc = allocated_bytes(layout)["total"]
    # full layers' pages exactly; sliding layers: old + new window pages mapped during a step
    assert alloc == (10 * n + 52 * 2 * (1024 // 64 + 1) * 64) * row
    assert alloc / want < 1.05


def test_script_prints_both_families(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["memory.py", "--contexts", "4096"])
    _script().main()
    out = capsys.readouterr().out
    assert "DeepSeek-V4-Flash: 43 layers" in out and "Gemma-3-27B: 62 layers (52 sliding, window 1024; 10 full)" in out
    assert out.count("hkv allocation / architectural minimum") == 2
