"""Test-session setup: a persistent XLA compilation cache, so identical programs (the same decode
step built by several engines, the same stateless forward) compile once per session."""

from __future__ import annotations

import os
import tempfile

# Eight CPU devices for the mesh tests (`hkv.MeshEngine`): read when JAX's backend starts (first use),
# so this must run before any test touches a device. Single-device code runs on device 0 as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

# The step store (hkv.engine.step_store) stays off in the suite: tests count traces and compilations
# of steps they build; tests/hkv/test_step_store.py turns it on in directories of its own.
os.environ.setdefault("HKV_STEP_STORE", "0")

import jax
import pytest

from hkv.engine.engine import Engine

# Engines in the suite decode with the decode step only, never through a prefill step while the decode
# step builds (`Engine.decode_while_building`): which program produced a token would otherwise depend on
# how fast a background compile ran, and tests count decode dispatches, intercept the decode step and
# name the programs an engine used. Tests of that path turn it on (tests/hkv/test_generation.py); the
# notebooks and the demo run in their own processes with the default (on).
Engine.decode_while_building = False

_CACHE_DIR = os.environ.get("HKV_TEST_COMPILATION_CACHE") or os.path.join(tempfile.gettempdir(), "hkv-test-xla-cache")
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop in-memory compiled programs after each test module (the persistent cache keeps them on
    disk). On CPU each compiled engine layout maps ~5,000 memory regions and a process may have 65,530
    (vm.max_map_count): a session holding the programs of every test's engines crashed inside XLA
    (abort/segfault) after ~140 tests. `hkv.engine.compiled` keeps only a few recent layouts; this
    also drops what JAX's own caches hold."""
    yield
    from hkv.engine import compiled

    compiled.clear()


# The heaviest test files first (measured: seconds of their slowest tests on 2 cores). `make test` runs
# files in worker processes (pytest-xdist --dist loadfile) that take the next file when they finish
# one, so a long file collected last would run alone at the end. Only the order changes.
HEAVY_FIRST = (
    "test_notebooks.py",
    "test_engine.py",
    "test_disk.py",
    "test_multihost.py",  # ~100 s: its host processes compile (JAX caches process 0's programs only)
    "test_conformance.py",
    "test_engine_safety.py",
    "test_state_machine.py",
    "test_chaos.py",
    "test_generation.py",
    "test_prefix.py",
    "test_random_specs.py",
    "test_prefix_interleavings.py",
    "test_request_streams.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FIRST)))  # stable: files stay whole
