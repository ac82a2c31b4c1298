"""benchmarks/prefix_decode.py end to end on the tiny model (slow): both engines decode the same tokens
and the ratio table is printed."""

from __future__ import annotations

import re

import pytest

from . import benchmark_script


@pytest.mark.slow
def test_prefix_decode_benchmark_runs_with_equal_tokens(monkeypatch, capsys):
    pd = benchmark_script.load(monkeypatch, "prefix_decode")
    assert pd.main(["--model", "tiny", "--contexts", "192", "--new", "24", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("tokens equal") == 2 and "DIFFER" not in out
    assert re.search(r"^\s+192 \| \d+\.\d{3}$", out, re.M), out
