"""benchmarks/fp8_kv.py: its bytes table is the one docs/cache.md shows, and its accuracy run works end to end
(slow)."""

from __future__ import annotations

import pathlib
import re

import pytest

import hkv

from . import benchmark_script

CACHE_DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "cache.md"


def load(monkeypatch):
    # benchmarks/workload.py (which fp8_kv imports) sets Engine.decode_while_building for its figures:
    # monkeypatch puts the class attribute back after the test
    monkeypatch.setattr(hkv.Engine, "decode_while_building", hkv.Engine.decode_while_building)
    return benchmark_script.load(monkeypatch, "fp8_kv")


def test_the_bytes_table_is_the_one_the_manual_shows(monkeypatch, capsys):
    load(monkeypatch).main(["--bytes-only"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 5, rows  # header + bf16 and fp8 at 128K and 1M
    doc = CACHE_DOC.read_text()
    for row in rows:
        assert row in doc, f"docs/cache.md lacks the row the benchmark prints:\n{row}"


@pytest.mark.slow
def test_the_accuracy_run_compares_three_engines_on_one_prompt(monkeypatch, capsys):
    load(monkeypatch).main(["--contexts", "256", "--new", "20"])
    out = capsys.readouterr().out
    for pair in ("bf16 vs fp8", "f32 vs bf16", "f32 vs fp8"):
        row = rf"^\| 256 \| {pair} \| (none|\d+) \| \d+\.\d% \| \d+\.\d{{4}} \| .* \| \d+\.\d\d / \d+\.\d\d \|$"
        assert re.search(row, out, re.M), out
