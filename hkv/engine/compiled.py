"""Compiled steps shared by the engines of a process, and JAX's persistent compilation cache.

`compiled_steps(graphdef, kernel_options, layout)` returns one `CompiledSteps` per (model
structure, kernel options, cache layout): its jitted functions take the layout as a static argument
and the weights as data, so a second engine built on the same model, layout and options reuses every
compilation of the first. `traces` counts compilations per step name, which `Engine.compilations`
reports. The process keeps the `MAX_SHARED` most recently built entries (engines keep their own
alive); older ones are dropped so their programs can be freed. That matters on CPU: each compiled
engine layout maps ~5,000 memory regions (XLA's JIT'd code) and Linux allows 65,530 per process
(`vm.max_map_count`) — a process that held every program of ~12 layouts crashed inside XLA.
`clear()` drops every entry and JAX's own caches (`jax.clear_caches`), which hold ~30% of it.

`enable_compilation_cache(setting)` turns on JAX's persistent compilation cache so a second process
starts decoding without compiling again: by default in `$HKV_COMPILATION_CACHE` or
`~/.cache/hkv/jax` (`$XDG_CACHE_HOME/hkv/jax`); `HKV_COMPILATION_CACHE=0` (or `Engine(...,
compilation_cache=False)`) turns it off. A directory the user already configured
(`jax.config.update("jax_compilation_cache_dir", ...)`) is left alone.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import os
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import numerics as nm

from ..core import install
from ..core import prefix as px
from ..core import transitions as tr
from ..core.decode import decode_steps, step_and_sample
from . import offload
from . import step_store as ss

ENV = "HKV_COMPILATION_CACHE"
MAX_SHARED = 4  # most recently built (model, options, layout) entries kept for engines built later
_LOCK = threading.Lock()
_SHARED: collections.OrderedDict = collections.OrderedDict()


def default_cache_dir() -> Path:
    """`$HKV_COMPILATION_CACHE`, else `$XDG_CACHE_HOME/hkv/jax`, else `~/.cache/hkv/jax`."""
    env = os.environ.get(ENV)
    if env and env.lower() not in ("0", "off", "false", "no"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hkv" / "jax"


def enable_compilation_cache(setting: bool | str | os.PathLike | None = None) -> Path | None:
    """Turn on JAX's persistent compilation cache; returns the directory in use (None: off).

    Args:
      setting: None — on in `default_cache_dir()` unless `$HKV_COMPILATION_CACHE` is 0/off/false/no;
        True — on in `default_cache_dir()`; False — leave it off; a path — on in that directory.
    A directory already configured in `jax.config` wins over every setting but False.
    """
    if not isinstance(setting, (type(None), bool, str, os.PathLike)):
        raise ValueError(f"compilation_cache={setting!r} must be None, a bool or a directory path")
    if setting is False:
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    if setting is None and os.environ.get(ENV, "").lower() in ("0", "off", "false", "no"):
        return None
    path = default_cache_dir() if setting in (None, True) else Path(os.fspath(setting)).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # an unwritable home: run without the cache rather than fail
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def step_name(
    kind: str, size: str, *, stops: int = 1, logits: bool = False, read: int | None = None, variant: str = ""
) -> str:
    """The name a compiled step is counted under: "prefill[1x32]", "prefill[1x512@2048]" (a prefill
    with read_tokens=2048; the engine passes None at max_context), "decode[8]+stops4+logits",
    "decode[8]+pen+top4" (`SamplingBatch.variant`), ... (the engine, its warmup and the trace
    counter must spell it the same way)."""
    size = size if read is None else f"{size}@{read}"
    return f"{kind}[{size}]" + (f"+stops{stops}" if stops > 1 else "") + ("+logits" if logits else "") + variant


def decode_size(rows: int, slots: int, steps: int) -> str:
    """The size part of a decode step's name: "8" (`steps` tokens) for a dispatch over every slot,
    "2x8" for one over `rows` < `slots` rows (`CompilePlan.decode_rows`)."""
    return str(steps) if rows == slots else f"{rows}x{steps}"


_TLS = threading.local()  # .log: the step names traced by this thread inside `_traced_names()`;
# .jax_hits: persistent-cache hits of this thread's compiles inside `_jax_cache_hits()`


def _on_jax_event(name: str, **_) -> None:
    hits = getattr(_TLS, "jax_hits", None)
    if hits is not None and name == "/jax/compilation_cache/cache_hits":
        hits.append(name)


jax.monitoring.register_event_listener(_on_jax_event)


@contextlib.contextmanager
def _jax_cache_hits():
    """Collect this thread's JAX persistent-cache hits. An executable JAX read back from its cache
    does not serialize whole (a step store entry made from one failed to run: "Function ... not
    found"), so the step store keeps only executables compiled afresh."""
    _TLS.jax_hits = hits = []
    try:
        yield hits
    finally:
        _TLS.jax_hits = None


_LATER: list = []  # the step store's background executor (created on first use)


def _later() -> concurrent.futures.ThreadPoolExecutor:
    """One background thread for the step store's fresh compiles (one compile at a time: XLA's CPU
    compiler already uses every core). Its pending jobs finish before the interpreter exits."""
    with _LOCK:
        if not _LATER:
            _LATER.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hkv-step-store"))
        return _LATER[0]


_AHEAD_POOL: list = []  # the threads of `_Step.build_ahead` (created on first use)
_AHEAD: list = []  # their futures, until `wait_for_ahead`


SPECULATIVE_DELAY_S = 0.25  # how long a speculative `build_ahead` waits before it starts building
_EXITING = threading.Event()  # set when the interpreter starts to exit (`_on_exit`)
_WAITING: set = set()  # the events speculative jobs wait on (`_on_exit` sets them all)


def _on_exit() -> None:
    """Interpreter exit, before the background pools are joined: speculative builds that have not
    started yet return at once instead of compiling a step no call will run."""
    _EXITING.set()
    with _LOCK:
        waiting = list(_WAITING)
    for event in waiting:
        event.set()


def _ahead(job) -> concurrent.futures.Future:
    """Run `job` on one of two threads that build or load steps ahead of their first call
    (`_Step.build_ahead`): with the caller's own compile, that keeps two cores busy.
    RuntimeError once the interpreter is exiting (the pool takes no new work)."""
    with _LOCK:
        if not _AHEAD_POOL:
            _AHEAD_POOL.append(concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="hkv-step-ahead"))
            register = getattr(threading, "_register_atexit", None)  # runs before the pools are joined
            if register is not None:
                register(_on_exit)
        future = _AHEAD_POOL[0].submit(job)
        _AHEAD[:] = [f for f in _AHEAD if not f.done()] + [future]
        return future


def abandon_background() -> None:
    """For a process about to exit (a server that has drained): drop the step store's queued
    background compiles (the one running finishes; its program is stored) and let speculative
    builds that have not started return at once, so the interpreter's exit waits for at most one
    compile instead of every queued one. Calls after this still compile what they need."""
    _on_exit()
    with _LOCK:
        later = _LATER[0] if _LATER else None
        if later is not None:
            _LATER.clear()  # a later `_later()` starts a fresh pool
    if later is not None:
        later.shutdown(wait=False, cancel_futures=True)


def wait_for_ahead() -> None:
    """Block until every build or load started by `_Step.build_ahead` so far is done."""
    with _LOCK:
        pending = list(_AHEAD)
    concurrent.futures.wait(pending)


def wait_for_store() -> None:
    """Block until the step store's background compiles (see `_Step`) are done and stored."""
    if _LATER:
        _later().submit(lambda: None).result()


def _spec(x):
    """An array leaf as its `jax.ShapeDtypeStruct`, so a later lowering needs no live (possibly
    donated) buffer; other leaves as they are. A jax.Array keeps its sharding only when it is
    committed to it: the lowering then takes the jit cache key the array itself would (an
    uncommitted array given as a spec with a sharding is another key: compiled again at the call)."""
    if isinstance(x, jax.Array):
        sharding = x.sharding if x.committed else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)
    if isinstance(x, (np.ndarray, np.generic)):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


@contextlib.contextmanager
def _quiet():
    """This thread's traces are not counted (`CompiledSteps.count`): the step store's background
    rebuild of a step the foreground already built."""
    _TLS.quiet = True
    try:
        yield
    finally:
        _TLS.quiet = False


@contextlib.contextmanager
def counting_into(counter: collections.Counter):
    """Steps this thread traces inside the block are counted in `counter`, not in their
    `CompiledSteps.traces`: a mesh engine's programs trace the shared single-device steps inside
    `shard_map`, which are other programs than a single-device engine's calls of the same steps
    (`hkv.engine.sharded.ShardedSteps` counts them apart)."""
    outer = getattr(_TLS, "counter", None)
    _TLS.counter = counter
    try:
        yield
    finally:
        _TLS.counter = outer


@contextlib.contextmanager
def _traced_names():
    """Collect the names `CompiledSteps` counts while this thread traces (threads trace separately)."""
    outer = getattr(_TLS, "log", None)
    _TLS.log = log = []
    try:
        yield log
    finally:
        _TLS.log = outer
        if outer is not None:
            outer.extend(log)


def builds_on_this_thread() -> int:
    """How many step builds (traces, or loads from the step store) this thread has counted so far:
    compare two readings to tell whether a span of work on this thread built a step (builds on the
    background threads of `_Step.build_ahead` are theirs)."""
    return getattr(_TLS, "builds", 0)


def pack_decode(o) -> jax.Array:
    """A `DecodeOutput`'s host-bound fields as one int32[B, 2 * steps + 3 (+ 2 * steps * N)] array
    (one transfer instead of five per decode dispatch): tokens, logprobs (float32 bits), n_new,
    stopped, status (repeated on every row), then the top-N ids and logprobs (bits) when kept.
    `unpack_decode` reads it back."""
    b = o.tokens.shape[0]
    parts = [
        o.tokens,
        jax.lax.bitcast_convert_type(o.logprobs, jnp.int32),
        o.n_new[:, None],
        o.stopped[:, None].astype(jnp.int32),
        jnp.broadcast_to(o.status.astype(jnp.int32), (b, 1)),
    ]
    if o.top_ids is not None:
        parts += [o.top_ids.reshape(b, -1), jax.lax.bitcast_convert_type(o.top_logprobs, jnp.int32).reshape(b, -1)]
    return jnp.concatenate(parts, axis=1)


def per_slot(slots: np.ndarray, host: tuple, lg, s: int) -> tuple:
    """A decode step's outputs per row (`unpack_decode`'s tuple; the logits, or None where no row
    keeps them) -> per slot: row i's at `slots[i]` of arrays over the `s` slots (the rest zeros), as
    `Scheduler.decode_outputs` reads them. Returns (host tuple, logits)."""
    if len(slots) == s and np.array_equal(slots, np.arange(s)):
        return host, lg

    def spread(a):
        a = np.asarray(a)
        out = np.zeros((s, *a.shape[1:]), a.dtype)
        out[slots] = a
        return out

    toks, lps, n_new, stopped, status, tops = host
    tops = None if tops is None else tuple(spread(t) for t in tops)
    host = (spread(toks), spread(lps), spread(n_new), spread(stopped), status, tops)
    return host, (None if lg is None else spread(lg))


def unpack_decode(host: np.ndarray, steps: int, top_n: int = 0) -> tuple:
    """`pack_decode`'s array on the host -> (tokens int32[B, steps], logprobs float32[B, steps],
    n_new int32[B], stopped bool[B], status int, tops): tops is None, or (ids int32[B, steps, N],
    logprobs float32[B, steps, N]) when `top_n` N > 0."""
    b, at = host.shape[0], 2 * steps + 3
    tops = None
    if top_n:
        w = steps * top_n
        tops = (host[:, at : at + w].reshape(b, steps, top_n),
                host[:, at + w : at + 2 * w].view(np.float32).reshape(b, steps, top_n))  # fmt: skip
    return (
        host[:, :steps],
        host[:, steps : 2 * steps].view(np.float32),
        host[:, 2 * steps],
        host[:, 2 * steps + 1].astype(bool),
        int(host[0, 2 * steps + 2]),
        tops,
    )


class _Step:
    """One jitted step `(layout, cache, *args)` that first asks the step store (`step_store`) for an
    executable built by an earlier process, so a hit neither traces nor lowers nor compiles.

    Calls are keyed in memory by the layout, the static arguments and the avals of the other
    arguments (the weights by identity); each key resolves once to a loaded executable, or to the
    plain jitted function (store off, a model without source files, a multi-device argument). Inside
    another trace (the mesh engine's shard_map) it is the jitted function. `lower` is the jitted
    function's; `prepare` resolves a call's executable without running it (`Engine.warmup`);
    `build_ahead` does so on a background thread, and the call waits for it (`Engine`, before a
    first prefill, for the steps that follow it).
    """

    def __init__(self, steps: CompiledSteps, name: str, fn, static_argnums: tuple[int, ...]):
        self._steps, self.__name__ = steps, name
        self._fn = fn  # the traced function (the step store rebuilds it under another name)
        self._static = frozenset(static_argnums)
        self._jitted = self._jit(fn)
        self._resolved: dict = {}
        self._names: dict = {}  # call key -> names traced by `lower` (the jit reuses that trace later)
        # call key -> (Future of its `build_ahead` job, the Event that starts a speculative job now),
        # until the job ends or the call joins it
        self._building: dict = {}
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._jitted, name)

    def _jit(self, fn):
        """`fn` jitted as every step is: layout and the other static arguments static, cache donated,
        compiled with the numerical contract's options (`pallas_kernels.numerics.jit`)."""
        return nm.jit(fn, static_argnums=tuple(sorted(self._static)), donate_argnums=1)

    @functools.cached_property
    def _nested(self):
        """`fn` jitted for calls inside another trace (no compiler options: they belong to the outer program)."""
        return jax.jit(self._fn, static_argnums=tuple(sorted(self._static)), donate_argnums=1)

    def _key(self, layout, args) -> tuple[tuple, list]:
        dyn = [a for i, a in enumerate(args, 2) if i not in self._static]
        statics = tuple(a for i, a in enumerate(args, 2) if i in self._static)
        return (layout, statics, tuple(self._steps.arg_sig(a) for a in dyn)), dyn

    def lower(self, layout, cache, *args):
        with _traced_names() as log:
            lowered = self._jitted.lower(layout, cache, *args)
        if log and ss.store_dir() is not None:
            self._names[self._key(layout, args)[0]] = tuple(log)
        return lowered

    def prepare(self, layout, cache, *args) -> None:
        """Load or build (and store) the executable of this call without running it."""
        key, dyn = self._key(layout, args)
        if ss.store_dir() is None:
            self._jitted.lower(layout, cache, *args).compile()
            self._resolved[key] = self._jitted  # (held by the jitted function: `build_ahead` leaves it)
            return
        self._get(key, layout, cache, args, dyn)

    def __call__(self, layout, cache, *args):
        if self._building:
            self._join(layout, args)
        if isinstance(getattr(cache, "lengths", None), jax.core.Tracer):
            # inside another trace (the mesh engine's shard_map): a nested jit takes no compiler
            # options; the outer program carries them (`numerics.jit`)
            return self._nested(layout, cache, *args)
        if ss.store_dir() is None:
            return self._jitted(layout, cache, *args)
        key, dyn = self._key(layout, args)
        run = self._resolved.get(key) or self._get(key, layout, cache, args, dyn)
        if run is self._jitted:
            return run(layout, cache, *args)
        return run(cache, *dyn)

    def _get(self, key, layout, cache, args, dyn):
        with self._lock:
            run = self._resolved.get(key)
            if run is None:
                disk = self._disk(key, layout, cache, dyn)
                run = self._resolved[key] = self._resolve(key, layout, cache, args, disk)
            return run

    def _disk(self, key, layout, cache, dyn):
        """(store, disk key, device) of a call, or None where the store does not apply (store off,
        a model without source files, a multi-device argument)."""
        steps = self._steps
        graph = steps.graph_key
        directory = ss.store_dir()
        device = ss.single_device((cache, dyn))
        if graph is None or directory is None or device is None:
            return None
        store = ss.StepStore(directory)
        disk_key = store.key(
            self.__name__, graph, repr(steps.kernels), repr(layout), repr(key[1]), repr(ss.aval_sig(cache)),
            str(device), *map(repr, key[2]),
        )  # fmt: skip
        return store, disk_key, device

    def _stored(self, store, disk_key: str, device):
        """(executable, names it counts as: those traced when it was built) from this process's
        loads or from the store; `()` when this process held it once and dropped it (never read
        back: see step_store); None on a miss."""
        with ss._PROCESS_LOCK:
            held = ss._LOADED.get(disk_key)
            seen = disk_key in ss._SEEN
        if held is not None:  # another engine (another CompiledSteps) of this process has it
            return held
        if seen:
            return ()
        hit = store.load(disk_key, device)
        if hit is None:
            return None
        with ss._PROCESS_LOCK:
            ss._LOADED[disk_key] = hit
            ss._SEEN.add(disk_key)
        return hit

    def _resolve(self, key, layout, cache, args, disk):
        """The loaded executable for `key` (built and stored on a miss), or the jitted function.
        `disk`: the call's `_disk` (computed from the live arguments: `cache` and `args` may be
        their specs, `_spec`)."""
        if disk is None:
            return self._jitted
        store, disk_key, device = disk
        got = self._stored(store, disk_key, device)
        if got == ():
            return self._jitted
        if got is None:
            with _traced_names() as log, _jax_cache_hits() as from_jax_cache:
                compiled = self._jitted.lower(layout, cache, *args).compile()
            built = tuple(log) or self._names.get(key, ())  # (a trace cached by `lower` logs nothing)
            if not from_jax_cache:
                store.save(disk_key, compiled, built)
            else:
                self._store_later(store, disk_key, built, layout, cache, args)
            with ss._PROCESS_LOCK:
                ss._LOADED[disk_key] = (compiled, built)
                ss._SEEN.add(disk_key)
            return compiled  # the trace counted itself
        compiled, names = got
        for name in names:
            self._steps.count(name)  # counted as the build it replaces
        return compiled

    def build_ahead(self, layout, cache, *args, speculative: bool = False, delay: float | None = None) -> bool:
        """Start building this call's executable on a background thread without running it, so
        that its first call finds it built (or waits for the rest of its build) instead of building
        it then: loaded from the step store when the store holds it, else traced and compiled (and
        stored, as a call would). The live arguments are read only here, on the caller's thread
        (the cache may be donated by the caller's next step): the build lowers their specs. Nothing
        inside another trace or for a call already built or building. Returns whether a job started.

        What it is for: a first request compiles its prefill step, then its decode step, one after
        the other, and one XLA compile does not keep every core busy (serial passes, Python
        tracing). Built ahead, the decode step compiles beside the prefill step, and a new process
        with the step store loads the decode step while the prefill step loads. (That is `Engine`'s path with
        `decode_while_building` off; with it on, the engine decodes through the prefill step and
        builds the decode step later, once that has cost about a compile: `Scheduler._decode_via_prefill`.)

        `speculative=True` is for a step that a later call may or may not run (the prefix lookup
        after a first call, a disk install after an offload): the job waits `delay` seconds first
        (default `SPECULATIVE_DELAY_S`; a call that needs the step cuts the wait short) and builds
        nothing if the process has started to exit by then, so a script that ends right after its
        call does not wait for a compile it will never use.
        """
        if isinstance(getattr(cache, "lengths", None), jax.core.Tracer):
            return False
        key, dyn = self._key(layout, args)
        if key in self._resolved or key in self._building:
            return False
        disk = None if ss.store_dir() is None else self._disk(key, layout, cache, dyn)
        specs = [a if i in self._static else jax.tree.map(_spec, a) for i, a in enumerate(args, 2)]
        cache_spec = jax.tree.map(_spec, cache)

        go = threading.Event()  # set by a call that needs the step now, or at exit

        def job():
            try:
                if speculative:
                    go.wait(SPECULATIVE_DELAY_S if delay is None else delay)
                    if _EXITING.is_set() or not threading.main_thread().is_alive():
                        return  # the process is exiting: no call will run this step
                if disk is None:  # the jitted function's own cache keeps what this compiles for its call
                    self._jitted.lower(layout, cache_spec, *specs).compile()
                    self._resolved[key] = self._jitted
                    return
                with self._lock:
                    if key not in self._resolved:
                        self._resolved[key] = self._resolve(key, layout, cache_spec, specs, disk)
            finally:
                self._building.pop(key, None)
                with _LOCK:
                    _WAITING.discard(go)

        if speculative:
            with _LOCK:
                _WAITING.add(go)
        try:
            self._building[key] = (_ahead(job), go)
        except RuntimeError:  # the interpreter is exiting: the pool takes no new work
            with _LOCK:
                _WAITING.discard(go)
            return False
        return True

    def building(self, layout, *args) -> bool:
        """Whether this call's `build_ahead` job is still queued or running (its call will wait)."""
        return bool(self._building) and self._key(layout, args)[0] in self._building

    def _join(self, layout, args) -> None:
        """Before a call: wait for its `build_ahead` job, or take the job back if it has not started
        (the call then builds the step itself). A job that failed is left to the call, which
        builds the step again and raises what is wrong."""
        entry = self._building.pop(self._key(layout, args)[0], None)
        if entry is None:
            return
        future, go = entry
        go.set()  # a speculative build waiting out its delay starts now
        if not future.cancel():
            concurrent.futures.wait([future])

    def _store_later(self, store, disk_key: str, built: tuple, layout, cache, args) -> None:
        """Compile this call afresh in the background and store it: JAX's persistent cache had the
        program (a cache filled before the step store, or one whose store was removed), and an
        executable read back from that cache does not serialize whole. The same function under a
        name derived from the store key is another program for JAX's cache, so it compiles; that
        costs one compile and one more entry in JAX's cache, once per program, and the next
        process loads the step from the store without tracing."""
        fn, name = self._fn, f"{self.__name__}_stored_{disk_key[:16]}"

        def renamed(*a):
            return fn(*a)

        renamed.__name__ = renamed.__qualname__ = name
        jitted = self._jit(renamed)
        specs = [a if i in self._static else jax.tree.map(_spec, a) for i, a in enumerate(args, 2)]
        cache_spec = jax.tree.map(_spec, cache)

        def job():
            with _quiet(), _jax_cache_hits() as hits:
                compiled = jitted.lower(layout, cache_spec, *specs).compile()
            if not hits:  # (the renamed program too was in JAX's cache: this store lost it before)
                store.save(disk_key, compiled, built)

        try:
            _later().submit(job)
        except RuntimeError:  # the interpreter is exiting (a build ahead that ends at exit): store it here
            job()


class CompiledSteps:
    """The jitted transitions of engines on one model structure, one set of kernel options and one
    layout (dropping the object frees its programs).

    Every function takes `(layout, cache, ...)` with the layout static and the cache donated.
    Attributes:
      traces: Counter {name: compilations}; names are "prefill[rows x chunk]" ("prefill[rows x
        chunk@read]" for a prefill with read_tokens), "decode[steps]" ("decode[steps@read]" with
        read_tokens; "+stopsN" for N
        stop-id columns > 1, "+logits" when logits are kept)
        "restore_window" and "swap_in[rows per group]" (the disk tier's install step).
    """

    def __init__(self, graphdef, kernels: tuple):
        self.traces: collections.Counter = collections.Counter()
        self.graphdef, self.kernels = graphdef, kernels
        self._arg_sig: dict = {}
        self.weights_treedef = None  # the structure of the weights passed as leaves (`flat_weights`)
        opts = dict(kernels)

        def merged(weights):
            """The model of `weights`: an `nnx.State`, or its leaves in `flat_weights` order."""
            if isinstance(weights, tuple):
                weights = jax.tree.unflatten(self.weights_treedef, weights)
            return nnx.merge(graphdef, weights)

        def count(layout, name: str) -> None:
            self.count(name)  # runs at trace time only

        def prefill(layout, cache, weights, tokens, slots, n_valid, params, keep_logits, read_tokens=None, snaps=None):
            count(
                layout,
                step_name(
                    "prefill",
                    f"{tokens.shape[0]}x{tokens.shape[1]}",
                    logits=keep_logits,
                    read=read_tokens,
                    variant=params.variant,
                ),
            )
            model = merged(weights)
            extra = {} if read_tokens is None else {"read_tokens": read_tokens}
            return step_and_sample(
                model, layout, cache, tokens, slots, n_valid, sampling=params, keep_logits=keep_logits, snapshots=snaps,
                **opts, **extra,
            )  # fmt: skip

        def decode(
            layout, cache, weights, tokens, slots, params, budget, stop_ids, steps, keep_logits, read_tokens=None
        ):
            n_stop = stop_ids.shape[1]
            count(
                layout,
                step_name(
                    "decode",
                    decode_size(tokens.shape[0], layout.slots, steps),
                    stops=n_stop,
                    logits=keep_logits,
                    read=read_tokens,
                    variant=params.variant,
                ),
            )
            model = merged(weights)
            extra = {} if read_tokens is None else {"read_tokens": read_tokens}
            o = decode_steps(
                model, layout, cache, tokens, slots, params, budget, stop_ids, steps=steps, keep_logits=keep_logits,
                **opts, **extra,
            )  # fmt: skip
            return o.cache, pack_decode(o), o.logits

        def restore_window(layout, cache, weights, slot, keys, toks, n_blocks, ids, force):
            """`hkv.core.prefix.restore_window` with this engine's model and kernels."""
            count(layout, "restore_window")
            return px.restore_window(merged(weights), layout, cache, slot, keys, toks, n_blocks, ids, force, **opts)

        def step(fn, static=(0,), name=None):
            name = name or fn.__name__
            return _Step(self, name, fn, static)

        self.prefill = step(prefill, (0, 7, 8))
        self.decode = step(decode, (0, 8, 9, 10))
        self.restore_window = step(restore_window)
        jit = step

        # the model-independent transitions (claim, release, restore, record, evict, offload)
        self.claim = jit(tr.claim_slot)
        self.release = jit(tr.release_slot)

        def restore(layout, cache, slot, keys, toks, n_blocks):
            count(layout, "restore")  # (built ahead once an engine has recorded: `Engine._restore_ahead`)
            return px.restore(layout, cache, slot, keys, toks, n_blocks, count=False)

        self.restore = jit(restore)
        self.count_plan = jit(px.count_plan)
        self.record_many = jit(px.record_many)
        self.evict = jit(px.evict)

        def swap_in(layout, cache, slot, l0, l1, rows, tails):
            count(layout, step_name("swap_in", offload.swap_in_size(rows)))  # one per row bucket
            return install.swap_in(layout, cache, slot, l0, l1, rows, tails)

        self.swap_in = jit(swap_in)
        self.mark_on_disk = jit(install.mark_on_disk)

    def flat_weights(self, weights):
        """`weights` (an `nnx.State`) as the tuple of its leaves, what the model steps (prefill,
        decode, restore_window) are cheapest to call with: a State flattens in Python on every call
        (one Python callback per variable), a tuple in C++.
        The first engine fixes the structure; weights of another structure are returned as they are
        (the steps take both)."""
        leaves, treedef = jax.tree.flatten(weights)
        with _LOCK:
            if self.weights_treedef is None:
                self.weights_treedef = treedef
        return tuple(leaves) if treedef == self.weights_treedef else weights

    def count(self, name: str) -> None:
        """One more build of step `name` (a trace, or a load from the step store), counted in
        `traces`, or in the counter of an enclosing `counting_into`."""
        if getattr(_TLS, "quiet", False):
            return
        _TLS.builds = getattr(_TLS, "builds", 0) + 1
        traces = getattr(_TLS, "counter", None)
        with _LOCK:  # (`_Step.build_ahead` counts its builds and loads on another thread)
            (self.traces if traces is None else traces)[name] += 1
        log = getattr(_TLS, "log", None)
        if log is not None:
            log.append(name)

    @functools.cached_property
    def graph_key(self) -> str | None:
        """The step store's digest of this model structure (None: not storable)."""
        return ss.graph_key(self.graphdef)

    def arg_sig(self, x) -> tuple:
        """`step_store.aval_sig(x)` (hashable: a call's in-memory key), memoized by identity for
        pytrees (the weights are re-passed every call; the memo holds the object it is keyed by)."""
        if isinstance(x, (jax.Array, np.ndarray, int, float, bool, np.generic)):
            return ss.aval_sig(x)
        hit = self._arg_sig.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        sig = ss.aval_sig(x)
        if len(self._arg_sig) > 64:
            self._arg_sig.clear()
        self._arg_sig[id(x)] = (x, sig)
        return sig


def clear() -> None:
    """Forget every shared compiled step and JAX's in-memory compilation caches (`jax.clear_caches`);
    engines built before keep working (they recompile, or read the persistent cache, on next use)."""
    with _LOCK:
        _SHARED.clear()
    ss.forget_loaded()
    jax.clear_caches()


def compiled_steps(graphdef, kernel_options: dict | None, layout) -> CompiledSteps:
    """The shared `CompiledSteps` for this model structure, these kernel options and this layout."""
    kernels = tuple(sorted((kernel_options or {}).items()))
    try:
        key = (graphdef, kernels, layout)
        hash(key)
    except TypeError:  # unhashable options or graph: no sharing
        return CompiledSteps(graphdef, kernels)
    with _LOCK:
        steps = _SHARED.pop(key, None)
        if steps is None:
            steps = CompiledSteps(graphdef, kernels)
        _SHARED[key] = steps  # most recent last
        while len(_SHARED) > MAX_SHARED:
            _SHARED.popitem(last=False)
        return steps
