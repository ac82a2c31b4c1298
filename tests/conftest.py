"""Test-session setup: a persistent XLA compilation cache, so identical programs (the same decode
step built by several engines, the same stateless forward) compile once per session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
import zlib
from importlib import metadata, util

_CACHE_DIR = os.environ.get("HKV_TEST_COMPILATION_CACHE") or os.path.join(tempfile.gettempdir(), "hkv-test-xla-cache")

# Fast-compile codegen for the suite on CPU: the suite is compile-bound (tiny models, thousands of programs),
# and XLA's CPU backend at LLVM -O0 with its classic emitters compiles a DeepSeek-V4 prefill/decode step
# ~2.5x faster than the default (-O2, fusion emitters) while running it ~2x slower. Measured on a cold
# cache, 2 cores: `make test` 22-26 min -> 9.5 min (compiling 2,110 -> 548 CPU-s). Both sides of every
# exactness check (engine vs stateless forward) compile under the same flags; `tests/test_demo.py` runs
# `make demo`'s exactness checks in a process at the default codegen, as users run it.
# HKV_TEST_FULL_OPT=1 runs the whole suite at the default codegen. Off on accelerators (GPU/TPU codegen
# is theirs to choose) and when this jaxlib does not know a flag (XLA aborts on unknown flags).
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
FULL_OPT = os.environ.get("HKV_TEST_FULL_OPT", "") not in ("", "0")


def _cpu_only() -> bool:
    """True when JAX can only run on the CPU here: JAX_PLATFORMS=cpu, or no accelerator plugin installed."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return platforms == "cpu"
    return util.find_spec("jax_plugins") is None and util.find_spec("libtpu") is None


def _flags_accepted(flags: tuple[str, ...]) -> bool:
    """Whether this jaxlib's XLA parses `flags` (a CPU backend starts with them in a child process); the
    answer is kept per jaxlib version and flag set in the compilation-cache directory."""
    tag = f"{metadata.version('jaxlib')}-{zlib.crc32(' '.join(flags).encode()):08x}"
    marker = os.path.join(_CACHE_DIR, f"xla-flags-accepted-{tag}")
    if os.path.exists(marker):
        return True
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, timeout=300, check=False
    )
    if probe.returncode != 0:
        print(f"tests/conftest.py: this jaxlib refuses {' '.join(flags)}; the suite compiles at the default codegen")
        return False
    os.makedirs(_CACHE_DIR, exist_ok=True)
    open(marker, "w").close()
    return True


_flags = os.environ.get("XLA_FLAGS", "")
# What XLA_FLAGS was before this file added to it (the first test process sets it; workers inherit it):
# tests/test_demo.py runs the demo with it.
os.environ.setdefault("HKV_TEST_USER_XLA_FLAGS", _flags)
if (
    not FULL_OPT
    and not any(f.split("=")[0] in _flags for f in FAST_COMPILE_FLAGS)  # set already (a parent process) or by hand
    and _cpu_only()
    and _flags_accepted(FAST_COMPILE_FLAGS)
):
    os.environ["XLA_FLAGS"] = (_flags + " " + " ".join(FAST_COMPILE_FLAGS)).strip()

# Eight CPU devices for the mesh tests (`hkv.MeshEngine`): read when JAX's backend starts (first use),
# so this must run before any test touches a device. Single-device code runs on device 0 as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

# The step store (hkv.engine.step_store) stays off in the suite: tests count traces and compilations
# of steps they build; tests/hkv/engine/test_step_store.py turns it on in directories of its own.
os.environ.setdefault("HKV_STEP_STORE", "0")

import jax
import pytest

from hkv.engine.engine import Engine

# Engines in the suite decode with the decode step only, never through a prefill step while the decode
# step builds (`Engine.decode_while_building`): which program produced a token would otherwise depend on
# how fast a background compile ran, and tests count decode dispatches, intercept the decode step and
# name the programs an engine used. Tests of that path turn it on (tests/hkv/engine/test_generation.py); the
# notebooks and the demo run in their own processes with the default (on).
Engine.decode_while_building = False

jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
# Every program is kept, however quick its compile: the suite builds ~4,500 small programs (jitted
# helpers, transitions, per-shape ops) of 20-100 ms each. Under the former 0.5 s floor a warm run
# compiled them all again: 216 of its 990 CPU seconds (measured with HKV_TEST_COMPILE_LOG, below).
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# A process started in the background of a non-interactive shell (`make test &`, nohup) inherits SIGINT
# ignored, and Python then leaves it ignored: the engine's SIGINT deferral (and its test) assume Python's
# default handler, which every interactive or CI run has.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _sigint_handler_restored(request):
    """A test (or a library it drives) that leaves SIGINT's handler changed is named in a warning and
    the handler is put back: the engine defers SIGINT only over Python's default handler, so a later
    test of that (tests/hkv/engine/test_engine_safety.py) would otherwise fail for the wrong reason."""
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not before and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, before)
        warnings.warn(f"{request.node.nodeid} left SIGINT's handler at {after!r}; put back {before!r}", stacklevel=1)


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


# The heaviest test files first. `make test` runs files in worker processes (pytest-xdist --dist
# loadfile) that take the next file when they finish one, so a long file collected last would run
# alone at the end. Only the order changes.
HEAVY_FIRST = (  # seconds of each file's tests, 2 workers, warm compilation cache (2026-12-05; cold: more)
    "test_engine.py",  # 85 (148 cold)
    "test_notebooks.py",  # 57 (94 cold): each notebook runs in a kernel process of its own
    "test_numerical_contract.py",  # 67
    "test_prefix.py",  # 65
    "test_disk.py",  # 63
    "test_docs.py",  # 42: every docs code block
    "test_generation.py",  # 41
    "test_step_store.py",  # 40: new processes load the steps
    "test_demo.py",  # 10 (33 cold): the demo compiles at the default codegen
    "test_conformance.py",  # 29
    "test_sharded.py",  # 29
    "test_state_machine.py",  # 28
    "test_interior_snapshots.py",  # 26
    "test_scan_layers.py",  # 26
    "test_engine_safety.py",  # 22
    "test_engine_contract_defects.py",  # 21
    "test_sampling_requests.py",  # 20
    "test_tier_processes.py",  # 18
    "test_weights.py",  # 18
    "test_chaos.py",  # 17
    "test_server.py",  # 12 (35 alone): tests/serve, an HTTP server over a tiny Gemma 3 engine
    "test_gemma3_engine.py",  # 15
)


def pytest_configure(config):
    """Keep HEAVY_FIRST's order under pytest-xdist: its `--dist loadfile` sorts files by their number of
    tests by default (`--loadscope-reorder`), which put heavy files with few tests (the demo, the
    notebooks, the mesh engine) last, running alone at the end."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FIRST)))  # stable: files stay whole


# `HKV_TEST_COMPILE_LOG=DIR`: each test process writes DIR/<worker>.jsonl, one line per XLA compile
# request with the test that made it (module fixtures count for their module's first test), the
# program's name and persistent-cache key, whether the cache had it, and the backend compile seconds;
# and one line per trace (Python to jaxpr) and lowering (jaxpr to MLIR), which no cache saves.
# `python -m tests.compile_report DIR` sums it up: which tests compile most on a cold cache, and which
# programs compile under several keys (the same function at other shapes or configs).
_COMPILE_LOG = os.environ.get("HKV_TEST_COMPILE_LOG")
_current_test = ["<collection>"]

if _COMPILE_LOG:
    import atexit
    import json
    import logging
    import threading

    os.makedirs(_COMPILE_LOG, exist_ok=True)
    _log_file = open(  # noqa: SIM115 - one line per event for the whole session
        os.path.join(_COMPILE_LOG, f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}.jsonl"), "a"
    )
    _log_lock = threading.Lock()
    atexit.register(_log_file.close)

    def _write(record):
        record["test"] = _current_test[0]
        with _log_lock:
            _log_file.write(json.dumps(record) + "\n")
            _log_file.flush()

    class _CacheLog(logging.Handler):
        def emit(self, rec):
            msg = rec.getMessage()
            for prefix, hit in (
                ("Persistent compilation cache hit for ", True),
                ("PERSISTENT COMPILATION CACHE MISS for ", False),
            ):
                if msg.startswith(prefix):
                    name, _, key = msg[len(prefix) :].partition(" with key ")
                    _write({"event": "lookup", "hit": hit, "module": name.strip("'"), "key": key.strip("'")})

    _compiler_logger = logging.getLogger("jax._src.compiler")
    _compiler_logger.setLevel(logging.DEBUG)
    _compiler_logger.addHandler(_CacheLog(logging.DEBUG))
    _compiler_logger.propagate = False

    _STAGES = {
        "/jax/core/compile/backend_compile_duration": "compile",
        "/jax/core/compile/jaxpr_trace_duration": "trace",
        "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    }

    def _on_duration(event, duration, **kwargs):
        if event in _STAGES:
            _write({"event": _STAGES[event], "module": kwargs.get("fun_name", "?"), "seconds": round(duration, 3)})

    jax.monitoring.register_event_duration_secs_listener(_on_duration)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _current_test[0] = item.nodeid
        yield
