"""The README is the front door: short, with the two quick-start commands, the layout map, one short
example per surface, a link to every page of the manual, and links that resolve. Its examples run in
tests/test_docs.py with the manual's (one module, so that they share compiled steps): those of "Using
it", in order in one namespace, there; the mesh example and host.py in tests/hkv/engine/test_sharded.py and
tests/hkv/engine/test_multihost.py."""

from __future__ import annotations

from tests.test_docs import DOCS, README, blocks, broken_links


def _section(text: str, heading: str) -> str:
    return text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 250, "the README is the front door: move details into docs/"
    assert blocks(_section(text, "## Quick start")) == [("", "bash", "make demo\nmake test\n")]
    layout = _section(text, "## Layout")
    for path in ("hkv/core/", "hkv/engine/", "hkv/store/", "pallas_kernels/", "models/", "tests/", "colab/"):
        assert f"| `{path}` |" in layout, path
    for path in ("benchmarks/", "docs/"):
        assert f"| `{path}` |" in layout, path
    assert "(docs/numerics.md)" in _section(text, "## Same tokens every time")
    for page in DOCS.glob("*.md"):
        assert f"(docs/{page.name})" in text, f"the README does not link docs/{page.name}"
    assert "(benchmarks/README.md)" in text


def test_readme_links_resolve():
    assert not broken_links(README), f"README.md: broken links {broken_links(README)}"
