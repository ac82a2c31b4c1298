"""The Colab notebooks in colab/: stored clean, paired with their jupytext sources, public API only,
and executed top to bottom headless in small mode (HKV_NOTEBOOK_SMALL=1), plots included.

A notebook is edited as its `colab/NN_name.py` (jupytext py:percent) and the `.ipynb` is regenerated
with `jupytext --to ipynb colab/NN_name.py` (or `make notebooks`); the tests here fail when the two
disagree, when the `.ipynb` holds outputs, or when a notebook raises.
"""

from __future__ import annotations

import base64
import os
import re
from pathlib import Path

import pytest

COLAB = Path(__file__).resolve().parents[1] / "colab"
# name -> the least number of figures the notebook must render
NOTEBOOKS = {
    "01_quickstart": 1,
    "02_prefix_reuse": 2,
    "03_bring_your_own_model": 0,
    "04_disk_tier": 0,
    "05_your_jit_loop": 1,
}
# the repository the "Open in Colab" badges point at (one place to change when it moves)
REPO = "hkv-project/hkv"
BADGE = "https://colab.research.google.com/assets/colab-badge.svg"

nbformat = pytest.importorskip("nbformat", reason="needs the `notebooks` extra")
jupytext = pytest.importorskip("jupytext", reason="needs the `notebooks` extra")


def _read(name: str):
    return nbformat.read(COLAB / f"{name}.ipynb", as_version=4)


def _code(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def test_the_five_notebooks_and_their_pairs_are_there():
    have = {p.stem for p in COLAB.glob("*.ipynb")}
    assert have == set(NOTEBOOKS), f"colab/ holds {sorted(have)}, expected {sorted(NOTEBOOKS)}"
    assert {p.stem for p in COLAB.glob("[0-9]*.py")} == set(NOTEBOOKS)


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_stored_without_outputs(name):
    nb = _read(name)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{name}.ipynb cell {i} has stored outputs: clear them (jupytext --to ipynb)"
            assert cell.execution_count is None, f"{name}.ipynb cell {i} has an execution count"
    assert "widgets" not in nb.metadata, f"{name}.ipynb stores widget state"


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_ipynb_agrees_with_its_jupytext_pair(name):
    py = jupytext.read(COLAB / f"{name}.py")
    nb = _read(name)
    want = [(c.cell_type, c.source) for c in py.cells]
    have = [(c.cell_type, c.source) for c in nb.cells]
    assert have == want, f"colab/{name}.ipynb differs from colab/{name}.py: run `jupytext --to ipynb colab/{name}.py`"


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_public_api_only(name):
    """No `obj._private` access and no `import _private`: a notebook teaches what users can rely on."""
    for src in _code(_read(name)):
        for line in src.splitlines():
            code = line.split("#", 1)[0]
            assert not re.search(r"\._[A-Za-z]", code), f"{name}: private access in {line.strip()!r}"
            assert not re.search(r"\bimport\s+_|\bimport\s.*\b_[a-z]\w*", code), f"{name}: private import {line!r}"


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_opens_with_badge_summary_and_colab_only_install(name):
    nb = _read(name)
    first = nb.cells[0]
    assert first.cell_type == "markdown"
    assert f"https://colab.research.google.com/github/{REPO}/blob/main/colab/{name}.ipynb" in first.source
    assert BADGE in first.source
    assert "What you will see" in first.source
    install = [s for s in _code(nb) if "pip" in s and "install" in s]
    assert len(install) == 1, f"{name}: expected one install cell"
    assert '"google.colab" in sys.modules' in install[0], f"{name}: the install must run only on Colab"
    extras = re.findall(r"hkv\[([^\]]*)\]", install[0])
    assert extras and all("parity" not in e for e in extras), f"{name}: install hkv[notebooks], not the parity extra"
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "HKV_NOTEBOOK_SMALL" in params[0].source, f"{name}: one parameters cell"


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_runs_headless_in_small_mode(name, tmp_path, monkeypatch):
    """Top to bottom in a fresh kernel; fails on any exception; counts the rendered figures (the kernel's
    inline matplotlib backend is non-interactive, as on Colab)."""
    nbclient = pytest.importorskip("nbclient", reason="needs the `notebooks` extra")
    pytest.importorskip("matplotlib", reason="needs the `notebooks` extra")
    from tests.conftest import _CACHE_DIR

    monkeypatch.setenv("HKV_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("HKV_COMPILATION_CACHE", _CACHE_DIR)  # share compiled steps with the suite
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
    nb = _read(name)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    pngs = [
        o.data["image/png"]
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type in ("display_data", "execute_result") and "image/png" in o.get("data", {})
    ]
    assert len(pngs) >= NOTEBOOKS[name], f"{name} rendered {len(pngs)} figures, expected {NOTEBOOKS[name]}"
    for png in pngs:
        assert base64.b64decode(png)[:8] == b"\x89PNG\r\n\x1a\n"


def test_readme_lists_every_notebook_with_its_badge():
    readme = (COLAB.parent / "README.md").read_text()
    section = readme.split("## Notebooks", 1)[1].split("\n## ", 1)[0]
    for name in NOTEBOOKS:
        assert f"https://colab.research.google.com/github/{REPO}/blob/main/colab/{name}.ipynb" in section, name
        assert f"`{name}`" in section, name
