"""Load a script of `benchmarks/` as a module, as it runs (its folder on sys.path for `_machine`)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load(monkeypatch, name: str):
    """benchmarks/<name>.py as the module `<name>_benchmark`, registered in sys.modules for the test
    (its dataclasses look their module up there); `monkeypatch` undoes both afterwards."""
    script = BENCHMARKS / f"{name}.py"
    monkeypatch.syspath_prepend(str(script.parent))
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module
