"""The architecture is visible in the imports: no cycles, and dependencies point one way.

hkv.serve -> models -> hkv.engine -> hkv.core -> pallas_kernels, hkv.engine -> hkv.store; hkv.serve
(the HTTP server and the `hkv` command line, with hkv/__main__.py, its entry point) sits on top and
nothing imports it; hkv.core never imports the host layers, hkv.store never imports the engine,
pallas_kernels knows nothing of hkv. Every import counts, including the ones inside functions (a lazy
import is still a dependency).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("hkv", "pallas_kernels", "models")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (relative imports resolved; `from p import m` counts
    m when it is a module, else p)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:  # `import hkv.core.spec` -> hkv.core.spec; unknown -> parent
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def _layer(module: str) -> str:
    parts = module.split(".")
    if module == "hkv.__main__":  # `python -m hkv`: the command line, hkv.serve's entry point
        return "hkv.serve"
    if parts[0] == "hkv" and len(parts) > 1 and parts[1] in ("core", "engine", "store", "serve"):
        return f"hkv.{parts[1]}"
    return parts[0] if parts[0] != "hkv" else "hkv"


# what each layer may import (besides itself)
ALLOWED = {
    "pallas_kernels": set(),
    "hkv.core": {"pallas_kernels"},
    "hkv.store": {"hkv.core"},  # only the Reason enum, in practice
    "hkv.engine": {"hkv.core", "hkv.store", "pallas_kernels"},
    "hkv": {"hkv.core", "hkv.engine", "hkv.store", "pallas_kernels"},  # the facade and hkv.testing
    "models": {"hkv", "hkv.core", "hkv.engine", "pallas_kernels"},
    "hkv.serve": {"models", "hkv", "hkv.engine", "hkv.core", "hkv.store"},  # the server and CLI, on top
}


def test_finds_a_planted_cycle():  # the checker itself can fail
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_dependencies_point_one_way():
    bad = []
    for mod, deps in import_graph().items():
        src = _layer(mod)
        for d in deps:
            dst = _layer(d)
            if dst != src and dst not in ALLOWED[src]:
                bad.append(f"{mod} imports {d} ({src} may import only {sorted(ALLOWED[src])})")
    assert not bad, "\n".join(bad)


def test_core_imports_only_jax_flax_numpy_and_kernels():
    allowed_roots = {"jax", "flax", "numpy", "pallas_kernels", "hkv", "__future__", "typing", "dataclasses",
                     "enum", "functools", "math", "hashlib", "json", "threading", "weakref", "collections",
                     "contextlib", "itertools", "inspect"}  # fmt: skip
    bad = []
    for path in sorted((ROOT / "hkv" / "core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            bad += [f"{path.relative_to(ROOT)} imports {r}" for r in roots if r not in allowed_roots]
    assert not bad, "\n".join(bad)


def test_one_formatter():
    ruff = pathlib.Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    out = subprocess.run([str(ruff), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"files not formatted with `ruff format` (run it):\n{out.stdout}{out.stderr}"


def test_one_linter():
    """`ruff check .` finds nothing under the rule set of pyproject.toml's [tool.ruff.lint]."""
    ruff = pathlib.Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    out = subprocess.run([str(ruff), "check", "--output-format=concise", "."], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"`ruff check .` findings (fix them, or `ruff check --fix`):\n{out.stdout}{out.stderr}"


def test_no_script_folder_shadows_an_installed_package():
    """`python benchmarks/X.py` puts benchmarks/ first on sys.path, so a script named like an installed
    top-level package hides it from everything the script imports: benchmarks/kernels.py hid the
    `kernels` package transformers imports, and benchmarks/e2e.py failed to import transformers."""
    import importlib.metadata

    installed = {
        name.split(".")[0]
        for dist in importlib.metadata.distributions()
        for name in (dist.read_text("top_level.txt") or "").split()
    } | {(dist.metadata["Name"] or "").replace("-", "_").lower() for dist in importlib.metadata.distributions()}
    for folder in ("benchmarks", "colab"):
        stems = {p.stem for p in (ROOT / folder).glob("*.py")}
        assert not stems & installed, f"{folder}/ scripts named like installed packages: {sorted(stems & installed)}"
