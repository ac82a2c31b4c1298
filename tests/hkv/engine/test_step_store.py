"""The step store (`hkv.engine.step_store`): compiled steps loaded from disk by a later engine (a later
process) without tracing, with the same tokens; keys that change with the model's structure and
source; unreadable entries rebuilt."""

from __future__ import annotations

import importlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest
from flax import nnx

import hkv
from hkv.engine import compiled
from hkv.engine import step_store as ss
from models import toy

CONFIG = hkv.CacheConfig(slots=2, max_context=64, page_size=4, prefix_records=16)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4], [2, 7, 1, 8, 2, 8]]


def _model(window=4):
    return toy.init(toy.ToyConfig(layers=(toy.Attn(window=window), toy.Compressed(ratio=4))), seed=0)


def _engine(model):
    return hkv.Engine(model, CONFIG, block_tokens=4, prefill_chunk=8, decode_steps=4)


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv(ss.ENV, str(tmp_path / "steps"))
    compiled.clear()
    yield tmp_path / "steps"
    compiled.clear()


def _traces_of_cached_step(monkeypatch) -> list:
    """Count every trace of the toy model's cached_step (a step loaded from the store traces nothing)."""
    calls = []
    original = toy.ToyModel.cached_step

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(toy.ToyModel, "cached_step", counted)
    return calls


_CHILD = """
import json, sys, threading
import hkv
from hkv.engine import step_store as ss
from models import toy
calls, loaded = [], []
original = toy.ToyModel.cached_step
def counted(self, *a, **k):
    calls.append(threading.current_thread().name)
    return original(self, *a, **k)
toy.ToyModel.cached_step = counted
load = ss.StepStore.load
def logged(self, key, device):
    out = load(self, key, device)
    if out is not None:
        loaded.extend([name, threading.current_thread().name] for name in out[1])
    return out
ss.StepStore.load = logged
model = toy.init(toy.ToyConfig(layers=(toy.Attn(window=4), toy.Compressed(ratio=4))), seed=0)
hkv.Engine.decode_while_building = False  # the decode step builds beside the first prefill (tests/conftest.py)
config = hkv.CacheConfig(slots=2, max_context=64, page_size=4, prefix_records=16)
engine = hkv.Engine(model, config, block_tokens=4, prefill_chunk=8, decode_steps=4)
tokens = [g.tokens for g in engine.generate(json.loads(sys.argv[1]), int(sys.argv[2]))]
print(json.dumps({"tokens": tokens, "compilations": engine.compilations, "traced": len(calls), "loaded": loaded,
                  "traced_on": sorted(set(calls))}))
"""


def _child(store, jax_cache, new_tokens: int = 6) -> dict:
    """A new process generating PROMPTS with the step store in `store` and JAX's cache in `jax_cache`
    (the store keeps only executables compiled afresh, not ones JAX's cache read back). "loaded":
    [step name, thread] of every step read from the store; "traced_on": the threads that traced the
    model."""
    env = dict(os.environ, HKV_STEP_STORE=str(store), JAX_PLATFORMS="cpu", HKV_COMPILATION_CACHE=str(jax_cache))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(PROMPTS), str(new_tokens)], check=False, env=env,
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[3],
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_new_process_loads_every_step_without_tracing_and_an_unreadable_entry_is_dropped(tmp_path):
    store = tmp_path / "steps"
    first = _child(store, tmp_path / "jax")  # an empty store: traces, compiles and stores every step
    assert first["traced"] > 0
    # the decode step is built on a background thread while the first prefill step builds and runs
    assert sorted({t.rsplit("_", 1)[0] for t in first["traced_on"]}) == ["MainThread", "hkv-step-ahead"]
    entries = sorted(p.name for p in store.iterdir())
    assert entries and all(name.endswith(".step") for name in entries)
    # the prefix lookup is built ahead only speculatively: a process that exits right after its one
    # call does not wait to build (and store) it
    assert not any("restore" in pickle.loads((store / name).read_bytes())["names"] for name in entries)
    second = _child(store, tmp_path / "jax")
    assert second["tokens"] == first["tokens"]
    assert second["traced"] == 0  # neither prefill nor decode was traced: loaded from the store
    assert second["compilations"] == first["compilations"]  # a load counts as the build it replaces
    assert sorted(p.name for p in store.iterdir()) == entries  # nothing new stored
    # the decode step loads on a background thread while the first prefill step loads and runs
    threads = {name.split("[")[0]: thread for name, thread in second["loaded"]}
    assert threads["prefill"] == "MainThread" and threads["decode"].startswith("hkv-step-ahead")
    one = _child(store, tmp_path / "jax", new_tokens=1)  # no request decodes: nothing prefetched
    assert [name.split("[")[0] for name, _ in one["loaded"]] == ["prefill"] and one["traced"] == 0
    for path in store.iterdir():
        path.write_bytes(path.read_bytes()[:100])  # truncated by a crash
    third = _child(store, tmp_path / "jax")
    assert third["tokens"] == first["tokens"] and third["traced"] > 0  # rebuilt by tracing
    assert third["compilations"] == first["compilations"]  # the background rebuilds are not counted
    # every entry is whole again before the process exits: steps too quick for JAX's cache compiled
    # afresh, and those JAX read back from its cache (which do not serialize whole) compiled again
    # in the background under another name -- the upgrade path from a cache filled before the store
    again = sorted(p.name for p in store.iterdir())
    assert again == entries and all((store / name).stat().st_size > 1000 for name in again)
    fourth = _child(store, tmp_path / "jax")
    assert fourth["tokens"] == first["tokens"] and fourth["traced"] == 0


def test_a_later_engine_of_the_same_process_reuses_the_executables_it_holds(store, monkeypatch):
    first = _engine(_model())
    want = [g.tokens for g in first.generate(PROMPTS, 6)]
    built = first.compilations
    # the first engine's background work ends first: a step JAX's cache held is compiled again for
    # the store on a background thread (`_Step._store_later`), which traces the model
    compiled.wait_for_ahead()
    compiled.wait_for_store()
    calls = _traces_of_cached_step(monkeypatch)
    compiled._SHARED.clear()  # a new CompiledSteps, as when the shared entry was pushed out
    second = _engine(_model())
    assert second._steps is not first._steps
    assert [g.tokens for g in second.generate(PROMPTS, 6)] == want
    assert calls == [] and second.compilations == built
    compiled.clear()  # dropped: the next engine traces again (it never re-reads a key it held)
    third = _engine(_model())
    assert [g.tokens for g in third.generate(PROMPTS, 6)] == want
    assert calls


def test_a_model_with_other_static_attributes_does_not_load_the_stored_steps(store, monkeypatch):
    _engine(_model(window=4)).generate(PROMPTS, 6)
    compiled.clear()
    calls = _traces_of_cached_step(monkeypatch)
    other = _engine(_model(window=8))  # same weights' shapes, another window: another program
    got = [g.tokens for g in other.generate(PROMPTS, 6)]
    assert calls  # traced: the stored steps were not taken for it
    monkeypatch.setenv(ss.ENV, "0")
    compiled.clear()
    assert got == [g.tokens for g in _engine(_model(window=8)).generate(PROMPTS, 6)]  # the store off


def test_store_off_switch_and_directory(monkeypatch, tmp_path):
    monkeypatch.setenv(ss.ENV, "0")
    assert ss.store_dir() is None
    monkeypatch.setenv(ss.ENV, str(tmp_path))
    assert ss.store_dir() == tmp_path
    monkeypatch.setenv(ss.ENV, "1")
    base = jax.config.jax_compilation_cache_dir
    assert ss.store_dir() == (ss.Path(base) / ss.SUBDIR if base else None)


def test_graph_key_changes_with_the_source_of_the_models_package(tmp_path, monkeypatch):
    pkg = tmp_path / "hkv_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    body = textwrap.dedent(
        """
        from flax import nnx

        SCALE = {scale}

        class Probe(nnx.Module):
            def __init__(self):
                self.w = nnx.Param(nnx.initializers.ones(nnx.Rngs(0).params(), (2,)))

            def __call__(self, x):
                return x * self.w * SCALE
        """
    )
    (pkg / "probe.py").write_text(body.format(scale=1))
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("hkv_probe_pkg.probe")
    graph, _ = nnx.split(mod.Probe())
    before = ss.graph_key(graph)
    assert before is not None and ss.graph_key(graph) == before
    (pkg / "probe.py").write_text(body.format(scale=2))  # the traced code changes, the graph does not
    ss._package_digest.cache_clear()
    assert ss.graph_key(graph) != before
    for name in [m for m in sys.modules if m.startswith("hkv_probe_pkg")]:
        del sys.modules[name]
    ss._package_digest.cache_clear()


def test_abandon_background_drops_queued_store_compiles():
    """A server that has drained calls `abandon_background` so that its exit waits for at most the
    store compile already running, not every queued one (`hkv serve` took minutes to exit after
    SIGTERM on a first run after a source change)."""
    import threading

    from hkv.engine import compiled

    started, release = threading.Event(), threading.Event()
    pool = compiled._later()
    running = pool.submit(lambda: (started.set(), release.wait(30)))
    queued = pool.submit(lambda: None)
    assert started.wait(30)
    compiled.abandon_background()
    assert queued.cancelled()
    release.set()
    running.result(30)
    assert compiled._later() is not pool  # a later compile gets a fresh pool
    compiled._EXITING.clear()  # (this process goes on: speculative builds may wait again)
