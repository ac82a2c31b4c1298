"""The step store: compiled engine steps kept on disk under a key computed WITHOUT tracing, so a
second process runs its first `generate` with no tracing, lowering or compiling at all.

JAX's persistent compilation cache (`hkv.engine.compiled.enable_compilation_cache`) skips XLA's
compile in a second process, but its key is the lowered program: every step is still traced (the
whole model, in Python) and lowered to StableHLO first, a large part of a small model's warm first
`generate`. The step store keys a serialized executable
(`jax.experimental.serialize_executable`) by everything the trace depends on, computed from host
values only:

  - the source of the code that is traced: every `.py` file of `hkv`, `models` and `pallas_kernels`,
    and of the top-level package of every module class in the model's graph (a class defined in
    `__main__` or a notebook has no file: such a model does not use the store); installed
    third-party packages by name and version;
  - the model's structure and static attributes (`repr` of its NNX GraphDef, numpy arrays in full);
  - the avals of the weights and of every argument, the static arguments, the cache layout and the
    kernel options;
  - jax and jaxlib versions, the backend (platform, version, device kind, count), the host CPU's
    feature flags, `XLA_FLAGS`, and JAX's configuration values.

Anything not in the key cannot reach the program except through those, so a hit is the program the
trace would have built. A miss (or an unreadable entry) traces and compiles as JAX always does and
then stores the executable -- one compiled afresh: an executable JAX read back from its own
persistent cache does not serialize whole (the next process failed to run it, "Function ... not
found"), so when JAX's cache already held the program (a cache filled before the store existed, or
a store that was deleted) the step is compiled again in one background thread under another name
(another program for JAX's cache) and stored from there; pending background compiles finish
before the process exits (`hkv.engine.compiled.wait_for_store` waits for them). The store is used
by single-device engines only (sharded programs are traced as usual) and only while JAX's
persistent cache is on: it lives in `<cache dir>/hkv-steps` (`HKV_STEP_STORE=<directory>` puts it
elsewhere; `HKV_STEP_STORE=0` turns the step store alone off).
Entries are never evicted: delete the directory to reclaim its space (~10 MB for `make demo`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import pickle
import platform
import re
import sys
import tempfile
import threading
from pathlib import Path

import jax
import numpy as np

ENV = "HKV_STEP_STORE"
SUBDIR = "hkv-steps"
FORMAT = 1
_OWN = ("hkv", "models", "pallas_kernels")  # hashed file by file wherever they are installed
_CONFIG_SKIP = ("cache", "log", "explain", "debug_", "profil", "traceback")  # config values that change no program
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# Executables this process already holds, by key. XLA's CPU runtime failed ("Function ... not found")
# running an entry deserialized in a process that had built or loaded the same program before, so a
# key is deserialized at most once per process: `_LOADED` serves it again while held, and a key in
# `_SEEN` whose executable was dropped (`forget_loaded`, `hkv.engine.compiled.clear`) is rebuilt by
# tracing instead of being read back.
_LOADED: dict = {}
_SEEN: set = set()
_PROCESS_LOCK = threading.Lock()


def store_dir() -> Path | None:
    """The directory of the step store: `$HKV_STEP_STORE` when it is a path, else
    `<JAX persistent cache dir>/hkv-steps`; None when `HKV_STEP_STORE` is 0/off/false/no or JAX's
    persistent cache is off."""
    env = os.environ.get(ENV, "")
    if env.lower() in ("0", "off", "false", "no"):
        return None
    if env and env.lower() not in ("1", "on", "true", "yes"):
        return Path(env).expanduser()
    base = jax.config.jax_compilation_cache_dir
    return Path(base) / SUBDIR if base else None


@functools.cache
def _package_digest(top: str) -> str | None:
    """Digest of a top-level package's source: every .py file under it (ours always, any package
    outside site-packages), else its distribution version. None: no file (e.g. `__main__`)."""
    if top in sys.stdlib_module_names or top == "builtins":
        return f"{top}@{sys.version}"
    mod = sys.modules.get(top)
    path = getattr(mod, "__file__", None)
    if path is None:
        return None
    root = Path(path).parent if Path(path).name == "__init__.py" else Path(path)
    installed = any(part in ("site-packages", "dist-packages") for part in root.parts)
    if installed and top not in _OWN:
        try:
            return f"{top}=={importlib.metadata.version(top)}"
        except importlib.metadata.PackageNotFoundError:
            pass
    h = hashlib.sha256(top.encode())
    files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
    for f in files:
        h.update(str(f.relative_to(root.parent)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


@functools.cache
def _process_key() -> str:
    """What every step of this process shares: versions, backend, host CPU, flags, configuration."""
    import jaxlib

    dev = jax.devices()[0]
    config = sorted((k, repr(v)) for k, v in jax.config.values.items() if not any(s in k for s in _CONFIG_SKIP))
    parts = [
        f"format={FORMAT}",
        jax.__version__,
        jaxlib.__version__,
        dev.platform,
        getattr(dev.client, "platform_version", ""),
        getattr(dev, "device_kind", ""),
        str(jax.device_count()),
        platform.machine(),
        _cpu_flags(),
        os.environ.get("XLA_FLAGS", ""),
        repr(config),
        *(f"{top}:{_package_digest(top)}" for top in _OWN),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def graph_key(graphdef) -> str | None:
    """Digest of a model structure: its GraphDef in full (static attributes included) and the source
    of every package its module classes come from; None when one has no source file."""
    tops = set()
    for node in getattr(graphdef, "nodes", ()):
        t = getattr(node, "type", None)
        if isinstance(t, type):
            tops.add(t.__module__.split(".")[0])
    digests = []
    for top in sorted(tops):
        if top not in sys.modules:
            __import__(top)
        d = _package_digest(top)
        if d is None:
            return None
        digests.append(f"{top}:{d}")
    with np.printoptions(threshold=sys.maxsize, precision=17, floatmode="unique"):
        text = _ADDRESS.sub("", repr(graphdef))  # functions print their address: equal code, other run
    return hashlib.sha256((text + "\n" + "\n".join(digests)).encode()).hexdigest()


def aval_sig(tree) -> tuple:
    """(pytree structure, avals (shape, dtype, weak type) of the leaves) of `tree`: hashable, and its
    `repr` is the same text in every process."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(map(jax.api_util.shaped_abstractify, leaves))


def single_device(tree):
    """The one device every array leaf of `tree` lives on (the default device when none is a
    jax.Array), or None when they span several: the store's executables are single-device."""
    devices = set()
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            devices |= x.sharding.device_set
    if len(devices) > 1:
        return None
    return next(iter(devices)) if devices else jax.devices()[0]


class StepStore:
    """Serialized executables in one directory, one file per key (written atomically)."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)

    def key(self, *parts: str) -> str:
        return hashlib.sha256("\n".join((_process_key(), *parts)).encode()).hexdigest()

    def load(self, key: str, device):
        """(jax.stages.Compiled on `device`, names traced when it was built), or None (absent or
        unreadable: an unreadable entry is removed)."""
        from jax.experimental import serialize_executable

        path = self.dir / f"{key}.step"
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f)
            if entry.get("format") != FORMAT:
                return None
            compiled = serialize_executable.deserialize_and_load(
                entry["payload"], entry["in_tree"], entry["out_tree"], execution_devices=[device]
            )
            return compiled, tuple(entry["names"])
        except FileNotFoundError:
            return None
        except Exception:  # a truncated or foreign file: rebuild it
            path.unlink(missing_ok=True)
            return None

    def save(self, key: str, compiled, names: tuple[str, ...]) -> None:
        """Store `compiled` under `key` (best effort: a full disk or a read-only directory only
        means the next process traces again)."""
        from jax.experimental import serialize_executable

        tmp = None
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            blob = pickle.dumps(
                {"format": FORMAT, "payload": payload, "in_tree": in_tree, "out_tree": out_tree, "names": names}
            )
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self.dir / f"{key}.step")
        except Exception:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)  # a half-written file is no entry


def forget_loaded() -> None:
    """Drop this process's executables served from the store (their keys are rebuilt, not re-read)."""
    with _PROCESS_LOCK:
        _LOADED.clear()
