"""`python -m tests.compile_report`: a compile log (HKV_TEST_COMPILE_LOG) summed up as documented."""

from __future__ import annotations

import json
import subprocess
import sys

from tests import compile_report


def _log(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_lookups_pair_with_their_compiles_and_the_report_sums_misses_per_file_and_program(tmp_path):
    a, b = "tests/hkv/test_a.py::test_one", "tests/hkv/test_b.py::test_two"
    _log(
        tmp_path / "gw0-1.jsonl",
        [
            {"event": "trace", "module": "prefill", "seconds": 1.25, "test": a},
            {"event": "lower", "module": "jit(prefill)", "seconds": 0.5, "test": a},
            {"event": "lookup", "hit": False, "module": "jit_prefill", "key": "jit_prefill-k1", "test": a},
            {"event": "lookup", "hit": True, "module": "jit__lanes", "key": "jit__lanes-k2", "test": a},
            {"event": "compile", "module": "jit(_lanes)", "seconds": 0.01, "test": a},  # pairs by name, not order
            {"event": "compile", "module": "jit(prefill)", "seconds": 9.0, "test": a},
        ],
    )
    _log(
        tmp_path / "gw1-2.jsonl",
        [
            {"event": "lookup", "hit": False, "module": "jit_prefill", "key": "jit_prefill-k1", "test": b},
            {"event": "compile", "module": "jit(prefill)", "seconds": 7.0, "test": b},
            {"event": "lookup", "hit": False, "module": "jit_prefill", "key": "jit_prefill-k3", "test": b},
            {"event": "compile", "module": "jit(prefill)", "seconds": 0.25, "test": b},
        ],
    )
    compiles, stages = compile_report.load(str(tmp_path))
    by_key = {(c["key"], c["test"]): (c["hit"], c["seconds"]) for c in compiles}
    assert by_key == {
        ("jit_prefill-k1", a): (False, 9.0),
        ("jit__lanes-k2", a): (True, 0.01),
        ("jit_prefill-k1", b): (False, 7.0),
        ("jit_prefill-k3", b): (False, 0.25),
    }
    assert [s["event"] for s in stages] == ["trace", "lower"]
    text = compile_report.report(compiles, stages, top=5)
    lines = text.splitlines()
    assert lines[0] == "4 compile requests; 3 misses, 16 s compiling; 1 cache hits, 0 s loading"
    assert lines[1] == "programs >= 0.5 s compiled: 2"
    assert lines[2] == "tracing 1 s, lowering 0 s (no cache saves these)"
    assert "       9.0 s     1  tests/hkv/test_a.py" in lines
    assert "      16.2 s     3  jit_prefill" in lines
    assert "     2 keys      16.2 s  jit_prefill" in lines
    assert "keys compiled more than once: 1 (16 s in all those compiles)" in lines


def test_a_missing_directory_is_a_clear_error(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tests.compile_report", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode != 0 and "no such directory" in out.stderr
