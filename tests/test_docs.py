"""The manual's code runs as written: every ```python block of every page in docs/ is executed, the
blocks of one page in order and in one namespace (a page's blocks build on each other)."""

from __future__ import annotations

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(p for p in DOCS.glob("*.md") if "```python" in p.read_text())


def test_docs_have_runnable_examples():
    assert any(p.name == "numerics.md" for p in PAGES), "docs/numerics.md lost its example"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_docs_code_blocks_run(page: pathlib.Path):
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    scope: dict = {"__name__": f"docs.{page.stem}"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{page.relative_to(DOCS.parent)} block {i + 1}", "exec"), scope)  # noqa: S102
