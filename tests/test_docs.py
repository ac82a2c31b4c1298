"""The manual's code runs as written: every ```python block of every page in docs/, and of the README,
is executed, the blocks of one page in order and in one namespace (a page's blocks build on each other).
The README's mesh and host.py examples are run by tests/hkv/engine/test_sharded.py and
tests/hkv/engine/test_multihost.py (`RUN_ELSEWHERE`). All pages run in this one module, so that the
engines of pages that use the same model and cache configuration share their compiled steps
(tests/conftest.py frees them per module).

Conventions (docs/testing.md):
* ```python runs. ```python norun is Python that cannot run in a test (a real checkpoint's path,
  S3, several hosts): it is compiled (a syntax error fails), not run. ```bash and ```text (or a bare
  fence) are not Python; any other info string fails, so a typo (```py, ```Python) cannot skip an
  example silently.
* A page whose first line is `<!-- test: slow -->` runs its blocks under `pytest -m slow` only.
* Some pages' results are checked after their blocks ran (`CHECKS`): what the page says they show.
* Relative links (and their #anchors) in docs/ and the README point at files and headings that exist.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCES = ("python", "python norun", "bash", "text", "")
SLOW = "<!-- test: slow -->"


def _parse(text: str) -> tuple[list[tuple[str, str, str]], list[str], str]:
    """(every fenced block as (heading, info string, code), every heading, the text outside blocks), in
    order; a block's heading is the last `#` line outside code before it (or "")."""
    out, headings, prose, info, lines = [], [""], [], None, []
    for line in text.splitlines(keepends=True):
        bare = line.rstrip("\n")
        if info is None:
            if re.fullmatch(r"```[^`]*", bare):
                info, lines = bare[3:].strip(), []
                continue
            prose.append(line)
            if bare.startswith("#"):
                headings.append(bare)
        elif bare == "```":
            out.append((headings[-1], info, "".join(lines)))
            info = None
        else:
            lines.append(line)
    assert info is None, f"an unclosed ```{info} fence"
    return out, headings[1:], "".join(prose)


def blocks(text: str) -> list[tuple[str, str, str]]:
    """(heading, info string, code) of every fenced block of a markdown text, in order."""
    return _parse(text)[0]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces -> hyphens."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def broken_links(page: pathlib.Path) -> list[str]:
    """Relative links of a markdown page whose file, or #anchor in a markdown file, does not exist."""
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _parse(page.read_text())[2]):  # links outside code
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        anchors = {slug(h) for h in _parse(file.read_text())[1]} if file.suffix == ".md" and file.exists() else None
        if not file.exists() or (anchor and anchors is not None and anchor not in anchors):
            bad.append(target)
    return bad


def _is_slow(page: pathlib.Path) -> bool:
    return page.read_text().startswith(SLOW)


PAGES = sorted(DOCS.glob("*.md"))
README = ROOT / "README.md"
RUN_ELSEWHERE = ("### One engine over a mesh", "### Many hosts")  # tests/hkv/engine/test_sharded.py, test_multihost.py


def _runs(page: pathlib.Path) -> list[tuple[int, str]]:
    """(block number, code) of the blocks of a page this module runs."""
    skip = RUN_ELSEWHERE if page == README else ()
    return [(i + 1, c) for i, (h, info, c) in enumerate(blocks(page.read_text())) if info == "python" and h not in skip]


RUNNABLE = [pytest.param(p, marks=pytest.mark.slow) if _is_slow(p) else p for p in [README, *PAGES] if _runs(p)]


def _check_readme(scope):
    # the engine generates and streams, your own jit loop gives the engine's tokens (bit for bit on CPU),
    # the toy model conforms, and a prefix comes back from disk
    assert scope["gens"][0].finish_reason == "length" and len(scope["gens"][0].tokens) == 16
    assert scope["handle"].result().plan.restored_tokens == 96
    assert scope["mine"] == scope["gens"][0].tokens
    assert scope["report"].routes
    assert scope["g"].plan.disk_tokens == (0, 96)


def _check_generation(scope):
    # the batch, the stream, and the user loop's second request restoring the first one's prefix
    assert scope["gens"][0].finish_reason in ("length", "stop") and len(scope["gens"]) == 2
    assert scope["handle"].result().tokens and scope["plan"].restored_tokens == 64


def _check_prefix_reuse(scope):
    assert scope["g"].plan.restored_tokens == 160 and scope["g"].plan.reason is None


def _check_disk_tier(scope):
    assert scope["g"].plan.disk_tokens == (0, 160)


def _check_bring_your_own_model(scope):
    routes = scope["report"].routes  # the toy model has a full-attention layer: no window rebuild
    assert "snapshot" in routes and "disk" in routes and "window_refused" in routes


def _check_serving(scope):
    # greedy streamed == whole, n seeded choices with top logprobs, the stop string, a 400 naming its field,
    # the chat template, the metrics read, and the server stopped
    whole, cut = scope["whole"].choices[0], scope["cut"].choices[0]
    assert scope["streamed"] == whole.text and cut.finish_reason == "stop"
    assert whole.text.startswith(cut.text + scope["stop"])
    assert len(scope["chat"].choices) == 2 and len(scope["chat"].choices[0].logprobs.content[0].top_logprobs) == 3
    assert scope["error"]["param"] == "max_tokens" and scope["error"]["type"] == "invalid_request_error"
    assert scope["prompt"] == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert "messages[1].role='robot'" in scope["bad_message"]
    assert scope["served"] >= 4 and scope["hits"] >= scope["restored"] >= 0
    assert not scope["thread"].is_alive()


CHECKS = {
    "README.md": _check_readme,
    "generation.md": _check_generation,
    "prefix-reuse.md": _check_prefix_reuse,
    "disk-tier.md": _check_disk_tier,
    "bring-your-own-model.md": _check_bring_your_own_model,
    "serving.md": _check_serving,
}


def test_docs_have_runnable_examples():
    names = {getattr(p, "values", [p])[0].name for p in RUNNABLE}
    assert {"README.md", "numerics.md", "generation.md", "disk-tier.md", "bring-your-own-model.md"} <= names
    assert set(CHECKS) <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_docs_fences_are_known_and_norun_blocks_compile(page: pathlib.Path):
    for i, (_, info, code) in enumerate(blocks(page.read_text())):
        assert info in FENCES, f"{page.name} block {i + 1}: fence ```{info} is not one of {FENCES}"
        if info == "python norun":
            compile(code, f"{page.name} block {i + 1}", "exec")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_docs_links_resolve(page: pathlib.Path):
    assert not broken_links(page), f"{page.name}: broken links {broken_links(page)}"


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.name)
def test_docs_code_blocks_run(page: pathlib.Path):
    scope: dict = {"__name__": f"docs.{page.stem}"}
    for i, code in _runs(page):
        exec(compile(code, f"{page.relative_to(ROOT)} block {i}", "exec"), scope)  # the page's example, as written
    if page.name in CHECKS:
        CHECKS[page.name](scope)


def test_readme_runs_every_example_of_using_it():
    """The README's examples run here are those of "Using it" but the two run elsewhere."""
    headings = [h for h, info, _ in blocks(README.read_text()) if info == "python"]
    assert headings == [
        "### Generate with the engine",
        "### Your own `jax.jit` loop",
        "### Your own model",
        "### Disk tier",
        *RUN_ELSEWHERE,
    ]


def test_bring_your_own_model_shows_the_tested_cached_path():
    """The toy model's cached path on docs/bring-your-own-model.md is models/toy/model.py's, verbatim."""
    page = (DOCS / "bring-your-own-model.md").read_text()
    shown = [c for _, _, c in blocks(page) if c.startswith("class ToyModel(nnx.Module):\n    ...\n\n")]
    assert len(shown) == 1, "docs/bring-your-own-model.md lost its toy cached_step block"
    method = shown[0].split("    ...\n\n", 1)[1].rstrip("\n")
    assert method.lstrip().startswith("def cached_step(") and "hkv.run_step" in method
    source = (ROOT / "models" / "toy" / "model.py").read_text()
    assert method in source, "the page's cached_step differs from models/toy/model.py: copy the method again"


def test_mesh_page_shows_the_readme_examples():
    """docs/mesh.md shows the README's mesh example and host.py (run there by tests/hkv/engine/test_sharded.py and
    tests/hkv/engine/test_multihost.py) unchanged."""
    readme = {h: c for h, info, c in blocks((ROOT / "README.md").read_text()) if info == "python"}
    page = [c for _, info, c in blocks((DOCS / "mesh.md").read_text()) if info == "python norun"]
    assert page == [readme["### One engine over a mesh"], readme["### Many hosts"]]
