"""The README's "bring your own model" block is the toy model's real cached path, verbatim."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_shows_the_tested_cached_path():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(class ToyModel\(nnx.Module\):\n    \.\.\.\n\n.*?)```", readme, re.S)
    assert len(blocks) == 1, "the README lost its 'bring your own model' block"
    method = blocks[0].split("    ...\n\n", 1)[1].rstrip("\n")
    assert method.lstrip().startswith("def cached_step(") and "hkv.run_step" in method
    source = (ROOT / "models" / "toy" / "model.py").read_text()
    assert method in source, "README's cached_step differs from models/toy/model.py: copy the method again"
