"""docs/scaling.md quotes exactly what `benchmarks/scaling.py --json` prints, and those numbers pass sanity
checks that would catch a unit error (shape arithmetic only: nothing is allocated)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import pathlib
import re

import pytest

import hkv
from hkv.core.memory import allocated_bytes

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "scaling.py"
DOC = ROOT / "docs" / "scaling.md"
K128, M1 = 128 * 1024, 1024 * 1024


def _script():
    spec = importlib.util.spec_from_file_location("scaling_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run():
    """(the script module, what `scaling.py --json` prints, parsed)."""
    module = _script()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main(["--json"])
    return module, json.loads(out.getvalue())


def test_every_table_of_the_doc_is_what_the_script_prints(run):
    _, data = run
    doc = DOC.read_text(encoding="utf-8")
    assert "produced by `python benchmarks/scaling.py`" in doc
    for name, table in data["tables"].items():
        assert table in doc, f"docs/scaling.md: table {name!r} differs from `python benchmarks/scaling.py`:\n{table}"
    # no stale table: every table row in the doc is one the scripts print (this one and memory_plan.py)
    printed = {line for table in data["tables"].values() for line in table.splitlines()}
    printed |= set(_memory_plan_output().splitlines())
    stale = [line for line in doc.splitlines() if line.startswith("| ") and line not in printed]
    assert not stale, f"docs/scaling.md has table rows the script does not print: {stale}"


@functools.cache
def _memory_plan_output() -> str:
    """What `python benchmarks/memory_plan.py` prints (abstract models: seconds)."""
    spec = importlib.util.spec_from_file_location("memory_plan_benchmark", ROOT / "benchmarks" / "memory_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main([])
    return out.getvalue()


def test_the_memory_plan_section_is_what_memory_plan_prints():
    doc = DOC.read_text(encoding="utf-8")
    printed = _memory_plan_output()
    table = "\n".join(line for line in printed.splitlines() if line.startswith("|"))
    largest = "\n".join(line for line in printed.splitlines() if line.startswith("* "))
    assert table in doc, f"docs/scaling.md: the memory plan differs from `python benchmarks/memory_plan.py`:\n{table}"
    assert largest in doc
    # the release kept quantized: its weights on one device of (8, 1) are the whole 155.69 GB of table 2
    assert "| DeepSeek-V4-Flash, release (FP8 + FP4) | (8, 1) | 155.7 GB |" in table


def test_kv_figures_agree_with_hkv_and_the_readme(run):
    _, data = run
    kv128, kv1m = data["kv"][str(K128)], data["kv"][str(M1)]
    # minimum < allocation < uniform full KV, per token, at both contexts
    for k in (kv128, kv1m):
        assert k["minimum_per_token"] < k["allocated_per_token"] < k["uniform_full_kv_per_token"]
    # the README's memory table quotes the uniform full-KV cache at 1M as 6.7x hkv's allocation
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ratio = kv1m["uniform_full_kv"] / kv1m["allocated"]["total"]
    assert f"({ratio:.1f}x hkv)" in readme and f"{ratio:.1f}" == "6.7"
    assert kv128["minimum_per_token"] * 6.5 < kv128["uniform_full_kv_per_token"]
    # bf16 K=V rows of 512 values on 43 layers: 44,032 bytes per token for a full-KV cache
    assert kv128["uniform_full_kv_per_token"] == 43 * 512 * 2


def test_contexts_fit_in_what_is_left(run):
    module, data = run
    for row in data["capacity"]:
        left = row["cache_per_device"]
        assert 0 < row["weights_per_device"] < row["usable"] < row["hbm"]
        for n, c in row["contexts"].items():
            kv = data["kv"][n]
            assert c["per_device"] * kv["minimum"]["total"] <= c["per_device"] * kv["allocated"]["total"] <= left
            assert (c["per_device"] + 1) * kv["allocated"]["total"] > left
            assert c["per_node"] == c["per_device"] * row["devices"]
    # pools are linear in slots: n contexts allocate n x one context (the script relies on it)
    _, spec = module.flash()
    one = allocated_bytes(module.layout_for(spec, K128))["total"]
    assert allocated_bytes(module.layout_for(spec, K128, slots=7))["total"] == 7 * one


def test_weights_and_restore_bytes_have_sane_units(run):
    module, data = run
    w = data["weights"]
    assert 2.0 <= w["bytes_total"]["bf16"] / w["params_total"] < 2.01  # bf16, a few float32 tensors
    assert 0.5 < w["bytes_total"]["release"] / w["params_total"] < 0.6  # mostly FP4 experts
    assert w["params_active_per_token"] < w["params_total"] / 10
    _, spec = module.flash()
    for r in data["restore"]:
        minimum = hkv.architectural_minimum(spec, r["length"])
        # what the disk tier reads for the rows is exactly the minimum's COMPRESSED + INDEXER
        assert r["rows"] == minimum["COMPRESSED"] + minimum["INDEXER"]
        assert r["snapshot"] < 16 * 2**20 and r["total"] < r["uniform_full_kv"]


def test_doc_names_what_exists_and_what_is_planned():
    doc = DOC.read_text(encoding="utf-8")
    for heading in ("## What exists today", "## What changes at 1,000 hosts"):
        assert heading in doc
    assert len(doc.splitlines()) < 300
    assert not re.search(r"\d{5,}(?![\d,])", doc.replace("|", " ")), "numbers need thousands separators"
