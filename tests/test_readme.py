"""The README's "bring your own model" block is the toy model's real cached path, verbatim."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_shows_the_tested_cached_path():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(class ToyModel\(nnx.Module\):\n    \.\.\.\n\n.*?)```", readme, re.S)
    assert len(blocks) == 1, "the README lost its 'bring your own model' block"
    method = blocks[0].split("    ...\n\n", 1)[1].rstrip("\n")
    assert method.lstrip().startswith("def cached_step(") and "hkv.run_step" in method
    source = (ROOT / "models" / "toy" / "model.py").read_text()
    assert method in source, "README's cached_step differs from models/toy/model.py: copy the method again"


@pytest.mark.slow  # ~80 s on 2 cores: it compiles its own layout; test_generation covers the same calls
def test_readme_generation_examples_run(capsys):
    """The "Generating: three ways" section's code blocks run as written (engine, streaming, your own
    jit loop with prefix reuse), and the user loop's second request restores the first one's prefix."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Generating: three ways, one semantics", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2, "the README's generation section lost a code block"
    scope: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 — the README's own example
    assert scope["gens"][0].finish_reason in ("length", "stop") and len(scope["gens"]) == 2
    assert scope["handle"].result().tokens and scope["plan"].restored_tokens == 64
