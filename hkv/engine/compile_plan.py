"""`CompilePlan`: every compiled step an engine runs, in one home — its buckets, the steps built
ahead on background threads, `warmup`'s list, and when decoding goes through the prefill step while
the decode step builds.

The steps themselves are shared by every engine on the same model structure, layout and kernel
options (`hkv.engine.compiled.compiled_steps`), loaded from the step store or JAX's persistent
compilation cache when a previous process built them. This object is one engine's view of them:
which names it used (`Engine.compilations`), which variants it asked to build ahead, which prefill
variants it ran (decoding through prefill reuses one), and what compiling cost it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.layers import InteriorSnapshots, read_size
from ..core.layout import CacheLayout
from ..core.plan import DevicePlan
from ..core.sampling import GREEDY, SamplingBatch
from . import offload as swap
from .compiled import decode_size, step_name
from .hooks import EngineHooks
from .options import EngineOptions
from .prefix_tools import RECORD_BATCH
from .progress import Bars
from .requests import LiveRequest

__all__ = ["CompilePlan", "EngineSteps", "pow2", "stop_width"]


def pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1): batch rows and stop widths are bucketed so."""
    return 1 << max(n - 1, 0).bit_length()


def stop_width(rows: list[LiveRequest]) -> int:
    """Columns of a decode step's stop-id table for these requests: their most stop ids, padded to
    a power of two (one compiled variant per width)."""
    return pow2(max([len(q.stop_ids) for q in rows] + [1]))


def _device_zeros(shape: tuple[int, ...], dtype) -> jax.Array:
    """Zeros on the default device (uncommitted, as a step's inputs are) without running a program:
    `jnp.zeros` compiles a broadcast per new shape on a first call in a process, which a
    first request waited for when the placeholders of the steps built ahead were made that way."""
    return jax.device_put(np.zeros(shape, dtype))


@dataclasses.dataclass
class EngineSteps:
    """One engine's compiled transitions (`hkv.engine.compiled.CompiledSteps`' names, or a mesh
    shard's view of them), shared by its scheduler, prefix manager and compile plan; a test may
    replace one with a spy (`engine.steps.decode = ...`) without touching other engines.

    Attributes:
      traces: step name -> builds so far (the shared programs' counter).
      prefill, decode: the model steps. claim, release: slots. restore, restore_window, count_plan,
      record_many, evict: the prefix cache. swap_in, mark_on_disk: the disk tier.
    """

    traces: Any
    prefill: Any
    decode: Any
    claim: Any
    release: Any
    restore: Any
    restore_window: Any
    count_plan: Any
    record_many: Any
    evict: Any
    swap_in: Any
    mark_on_disk: Any

    @classmethod
    def of(cls, steps) -> EngineSteps:
        """The transitions of a `CompiledSteps` (or anything with the same attributes)."""
        return cls(**{f.name: getattr(steps, f.name) for f in dataclasses.fields(cls)})


class CompilePlan:
    """One engine's compiled steps: names used, builds ahead, warm-up, decoding through prefill.

    Args:
      steps: the engine's compiled transitions (`EngineSteps`).
      layout: the cache layout. opts: the engine's options (block size, prefill and decode buckets).
      read_sizes: the prefill read sizes (`EngineOptions.read_sizes`).
      bars: progress bars for compilations. hooks: what it uses of the engine (`EngineHooks`).
    """

    def __init__(
        self,
        steps: EngineSteps,
        layout: CacheLayout,
        opts: EngineOptions,
        read_sizes: tuple[int | None, ...],
        bars: Bars,
        hooks: EngineHooks,
    ):
        self.steps, self.layout, self.block_tokens = steps, layout, opts.block_tokens
        self.prefill_batch, self.prefill_widths = opts.prefill_batch, opts.prefill_widths
        self.read_sizes, self.decode_steps = read_sizes, opts.decode_steps
        self.bars, self.say, self.tx, self.cache, self.weights = bars, hooks.say, hooks.tx, hooks.cache, hooks.weights
        self.names: set[str] = set()  # compiled step names this engine used (for `compilations`)
        self.asked: set[tuple] = set()  # the step variants asked to build ahead
        self.prefill_variants: set[tuple] = set()  # (rows, width, read bound, logits) of prefill steps run
        self.interior_snapshots = False  # prefill steps take `InteriorSnapshots` (set by the prefix manager)
        self.build_seconds = 0.0  # the longest prefill step that compiled (`via_prefill`)
        self.via_prefill_seconds = 0.0  # time spent decoding through the prefill step
        self.compile_seconds = 0.0  # time spent compiling (or loading) steps, `Engine.stats()`
        # decode dispatches run only as many rows as `decode_rows` picks (False: every slot, a
        # `MeshEngine`'s shards, whose decode runs every shard's slots at once)
        self.compact = True
        self.decode_rows_used: set[int] = set()  # row counts of the decode dispatches run (`decode_rows`)

    def compilations(self) -> dict[str, int]:
        """Compilations of each step name this engine used (one per bucket when shared)."""
        return {n: self.steps.traces[n] for n in sorted(self.names)}

    # ----------------------------------------------------------------------------- buckets
    def read_bound(self, tokens: int) -> int | None:
        """The `read_tokens` of a prefill step whose rows hold at most `tokens` after it: the smallest
        of `read_sizes` holding them, None at max_context (the unbounded program, named without @)."""
        read = read_size(self.read_sizes, tokens)
        return None if read is None or read >= self.layout.config.max_context else read

    def decode_row_sizes(self) -> tuple[int, ...]:
        """The row counts a decode dispatch may have: powers of two below `slots`, and `slots`."""
        s = self.layout.slots
        return tuple(sorted({pow2(n) for n in range(1, s + 1) if pow2(n) < s} | {s}))

    def decode_rows(self, n: int) -> int:
        """Rows of a decode dispatch for `n` running requests (the rest idle): the smallest row count
        this engine has dispatched, built ahead or warmed up that holds them, else the smallest of
        `decode_row_sizes` that does (recorded as used). Idle rows cost a decode step what a running
        one does (the weights' products and the MoE of every row), so one request in an 8-slot cache
        decodes about as fast as in a 1-slot cache. Reusing a larger program already built, rather
        than compiling the exact size when requests finish, keeps compilations to one per size
        reached (and a decode never waits for a compile a built program spares); after warmup()
        every size is built, so a dispatch always takes the smallest."""
        fits = [b for b in self.decode_rows_used if b >= n]
        b = min(fits) if fits else next(b for b in self.decode_row_sizes() if b >= n)
        self.decode_rows_used.add(b)
        return b

    def idle_decode_args(self, n_stop: int, keep: bool, read: int | None = None, rows: int | None = None) -> tuple:
        """Arguments (after layout, cache) of a decode step with every row idle (zero budgets): the
        shapes and types a decode dispatch of `rows` rows (None: every slot) gives for stop width
        `n_stop`, logits `keep` and read bound `read` (`read_bound`)."""
        b = self.layout.slots if rows is None else rows
        z = np.zeros((b,), np.int32)
        return (self.weights(), z, np.arange(b, dtype=np.int32), SamplingBatch.stack([GREEDY] * b), z,
                np.full((b, n_stop), -1, np.int32), self.decode_steps, keep, read)  # fmt: skip

    @staticmethod
    def unclaimed_decode_args(idle_args: tuple, slot: int) -> tuple:
        """`idle_decode_args` with one token of budget for a row running `slot`, a slot nobody
        claimed: the decode loop's body runs once, its step fails with SLOT_INACTIVE and changes
        nothing. With every row idle the body runs zero times, and XLA:CPU sets up the body's matmul
        kernels at their first run: the first request's first decode dispatch paid for it (~130 ms
        on the small Gemma 3)."""
        slots, budget = np.array(idle_args[2]), np.zeros_like(idle_args[4])
        slots[0], budget[0] = slot, 1
        return idle_args[:2] + (slots, idle_args[3], budget) + idle_args[5:]

    def record_args(self, slot: jax.Array) -> tuple:
        """Arguments (after layout, cache) of a record step for `slot` that records nothing: the
        shapes and types the prefix manager gives (`pack_records` pads every batch to RECORD_BATCH rows,
        numpy arrays: device arrays here made the first request's record another jit dispatch entry)."""
        k, bt = RECORD_BATCH, self.block_tokens
        zeros = np.zeros
        return (slot, zeros((k, 4), np.uint32), jnp.int32(-1), zeros((k, bt), np.int32), zeros((k,), bool),
                zeros((k,), np.int32), zeros((k,), bool), np.full((k,), -1, np.int32), np.bool_(True))  # fmt: skip

    def lookup_placeholders(self) -> tuple[jax.Array, jax.Array]:
        """Zero (keys uint32[NB, 4], tokens int32[NB, block_tokens]) shaped as every `PrefixQuery`'s
        (NB = max_context // block_tokens): the restore step's inputs for a build without a prompt."""
        bt = self.block_tokens
        nb = self.layout.config.max_context // bt
        return _device_zeros((nb, 4), np.uint32), _device_zeros((nb, bt), np.int32)

    # -------------------------------------------------------------------- built, or building
    def timed(self, fn, *args, name: str) -> tuple[tuple, float, bool]:
        """Run transition `fn`; returns (outputs, seconds, whether it compiled). Compile time goes to
        `compile_seconds`, with a progress message on the first use of a bucket."""
        self.names.add(name)
        fresh = not self.built(fn, name, args)
        if fresh:
            self.say(f"compiling {name} (once per process; cached on disk)")
        t0 = time.perf_counter()
        with self.bars.compiling(name) if fresh else contextlib.nullcontext():
            out = self.tx(fn, *args)
            jax.block_until_ready(out)
        dt = time.perf_counter() - t0
        if fresh:
            self.compile_seconds += dt
        return out, dt, fresh

    def built(self, fn, name: str, args: tuple) -> bool:
        """Whether step `fn` (named `name`) is built for a call with `args` (after layout, cache):
        traced or loaded in this process and not still building ahead on another thread (a call
        would wait for that build)."""
        return self.steps.traces[name] > 0 and not self.building_ahead(fn, args)

    def building_ahead(self, fn, args: tuple) -> bool:
        """Whether step `fn` is still building ahead on another thread (`_Step.build_ahead`) for a
        call with `args` (after layout, cache): such a call waits for that build."""
        building = getattr(fn, "building", None)
        return building is not None and building(self.layout, *args)

    def ask_once(self, variant: tuple) -> bool:
        """True the first time this engine asks for step `variant` to be built ahead (recorded)."""
        if variant in self.asked:
            return False
        self.asked.add(variant)
        return True

    def ask_ahead(self, ahead: dict) -> None:
        """`build_ahead` each {variant: (step, () -> its arguments after (layout, cache))} not asked
        for before by this engine."""
        for variant in sorted(ahead.keys() - self.asked):
            fn, args = ahead[variant]
            self.asked.add(variant)
            build = getattr(fn, "build_ahead", None)
            if build is not None:
                build(self.layout, self.cache(), *args())

    # --------------------------------------------------------------------------- build ahead
    def build_ahead(self, rows: list[LiveRequest], *, decode: bool, prefix: bool, decoding: int = 0) -> None:
        """Before their prefill, start building the steps these requests run next on background
        threads (`_Step.build_ahead`): once per engine, the prefix cache's record step (`prefix`)
        and the slot release, so that they compile while the prefill step compiles and runs (or,
        in a new process, load from the step store while it loads). Each variant is asked for once
        per engine; one already built is not built again. The decode step too when `decode` (an
        engine that does not decode while building; otherwise `via_prefill` decides when), for
        `decoding` requests (those holding slots) decoding at once."""
        if decode:
            self.build_decode_ahead(rows, decoding)  # first: the longest build (two threads build ahead)
        ahead = {("release",): (self.steps.release, lambda: (jnp.int32(0),))}  # the slot as requests pass it
        if prefix:
            ahead[("record_many",)] = (self.steps.record_many, lambda: self.record_args(jnp.int32(0)))
        self.ask_ahead(ahead)

    def build_decode_ahead(self, rows: list[LiveRequest], decoding: int = 0) -> None:
        """Start building (`_Step.build_ahead`) the decode step these requests need first (their stop
        width, logits choice, the read bound of their first dispatch and the rows of `decoding`
        requests, at least theirs: `decode_rows`), unless none of them decodes."""
        if not any(q.max_new > 1 for q in rows):
            return
        keep, n_stop = any(q.keep_logits for q in rows), stop_width(rows)
        read = self.read_bound(max(len(q.prompt) + self.decode_steps for q in rows))
        b = self.decode_rows(max(decoding, len(rows))) if self.compact else self.layout.slots
        b = None if b == self.layout.slots else b
        args = lambda: self.idle_decode_args(n_stop, keep, read, b)
        variant = ("decode", n_stop, keep) + (() if read is None else (read,)) + (() if b is None else (f"{b}x",))
        self.ask_ahead({variant: (self.steps.decode, args)})

    def restore_ahead(self) -> None:
        """Start building the prefix lookup's restore step on a background thread (`_Step.build_ahead`,
        speculative: it starts after a short delay and not at all when the process exits first).
        The engine asks at the end of a call that recorded prefix blocks with nothing left to run:
        a first call never needs the step (its prompts start no cached chain), the next one that
        shares a prefix does, and compiling it then was most of that call in a fresh process. Once
        per engine; nothing when the step is built already. A failure here is left to the call that
        needs the step (which builds it and raises what is wrong): the call that just ended has
        succeeded."""
        if not self.ask_once(("restore",)):
            return
        build = getattr(self.steps.restore, "build_ahead", None)
        if build is None:
            return
        with contextlib.suppress(Exception):  # see the docstring
            zero = jnp.int32(0)
            build(self.layout, self.cache(), zero, *self.lookup_placeholders(), zero, speculative=True)

    # ------------------------------------------------------------------ decode through prefill
    def via_prefill(self, rows: list[LiveRequest], args: tuple, name: str, per_token: float) -> tuple | None:
        """The prefill variant (rows b, width c, read bound, logits) to decode these rows through,
        one token per step, while their decode step (`name`, called with `args`) is not built; None
        when it is built, or when no prefill variant run so far holds these rows. Starts building
        the decode step ahead once the time spent decoding through prefill, plus what these rows'
        remaining tokens would take at `per_token` seconds each, reaches the longest prefill compile
        this engine has seen (ski rental: never more than twice the better choice in hindsight; at
        once where nothing compiled, e.g. a process whose steps come from the caches). A first short
        `generate` returns without compiling it; a long one starts it at once."""
        if self.built(self.steps.decode, name, args):
            return None
        keep = any(q.keep_logits for q in rows)
        read_needed = self.read_bound(max(q.fed + 1 for q in rows))
        fits = [
            (b, c, read, k)
            for b, c, read, k in self.prefill_variants
            if (k or not keep) and (read is None or (read_needed is not None and read >= read_needed))
        ]
        if not fits:
            return None
        left = max(q.max_new - len(q.tokens) for q in rows)
        if self.via_prefill_seconds + left * per_token >= self.build_seconds:
            self.build_decode_ahead(rows)
        return max(fits, key=lambda v: (v[0], -v[1], v[2] is not None, -(v[2] or 0), not v[3]))

    # -------------------------------------------------------------------------------- warmup
    def model_steps(self, *, logits: bool, stop_ids: int) -> list[tuple]:
        """[(step, arguments after (layout, cache), name)] of every prefill and decode bucket, run
        with inputs that change nothing (idle rows, zero budgets)."""
        out = []
        rows = sorted({pow2(n) for n in range(1, self.prefill_batch + 1)})
        s = self.layout.slots
        for keep in (False, True) if logits else (False,):
            bounds = [self.read_bound(r or 1) for r in self.read_sizes]
            for b, w, r in itertools.product(rows, self.prefill_widths, bounds):
                z = np.zeros((b,), np.int32)
                args = (self.weights(), np.zeros((b, w), np.int32), z, z, SamplingBatch.stack([GREEDY] * b), keep, r)
                if self.interior_snapshots:  # as `PrefixManager.plan_snapshots` passes them
                    none = np.full((b, w // self.block_tokens + 1), -1, np.int32)
                    args += (InteriorSnapshots(none, none.copy()),)
                out.append((self.steps.prefill, args, step_name("prefill", f"{b}x{w}", logits=keep, read=r)))
            stops = sorted({pow2(n) for n in range(1, max(stop_ids, 1) + 1)})
            for n_stop, r, b in itertools.product(stops, bounds, self.decode_row_sizes() if self.compact else (s,)):
                size = decode_size(b, s, self.decode_steps)
                name = step_name("decode", size, stops=n_stop, logits=keep, read=r)
                out.append((self.steps.decode, self.idle_decode_args(n_stop, keep, r, b), name))
        return out

    def slot_steps(
        self, slot: jax.Array, placeholders: tuple, *, prefix: bool, window: bool, disk_inputs: list | None
    ) -> list[tuple]:
        """[(step, arguments after (layout, cache), name)] of the transitions run on a claimed slot
        with inputs that change nothing (device arrays, as requests pass them: numpy inputs would be
        another jit key): the prefix cache's (`prefix`; `placeholders`: `lookup_placeholders()`), its
        window rebuild (`window`) and the disk tier's install and marks (`disk_inputs`:
        `swap_in_warmup_inputs`, None without a disk tier)."""
        if not prefix:
            return []
        t, zero = self.steps, jnp.int32(0)
        keys, toks = placeholders
        # the per-request metrics update: compiling it is part of a first request's TTFT otherwise
        # (it counts into the cache's counters: `Engine.warmup` restores them)
        out = [
            (t.restore, (slot, keys, toks, zero), "restore"),
            (t.count_plan, (jax.tree.map(jnp.int32, DevicePlan.make().host()),), "count_plan"),
        ]
        if window:
            # forced: the rebuild's model step runs once (no valid token: nothing written), since its
            # first run in a process costs several times a later one (`hkv.core.prefix.restore_window`)
            ids = jnp.zeros((self.layout.config.max_context,), jnp.int32)
            args = (self.weights(), slot, keys, toks, zero, ids, np.bool_(True))
            out.append((t.restore_window, args, "restore_window"))
        out.append((t.record_many, self.record_args(slot), "record_many"))
        none = jnp.zeros((self.layout.config.prefix_records,), bool)
        out.append((t.evict, (none, none, none), "evict"))
        if disk_inputs is not None:
            for k in (1, 2, 4, 8):
                out.append((t.mark_on_disk, (jnp.zeros((k, 4), jnp.uint32), jnp.arange(k) < 0), "mark_on_disk"))
            for rows, tails in disk_inputs:  # l0 == l1: BAD_REQUEST, no change
                out.append((t.swap_in, (slot, zero, zero, rows, tails), step_name("swap_in", swap.swap_in_size(rows))))
        return out

    def precompile(self, calls: list, times: dict[str, float]) -> None:
        """Compile `calls` [(jitted step, arguments after (layout, cache), name)] in parallel threads
        (one XLA compile does not keep every core busy; JAX keeps each for the step's next call with the same
        argument types, so `warmup` then only runs them). An optimization only: a step that fails
        to compile here compiles at its call."""
        workers = min(len(calls), os.cpu_count() or 1)
        if workers < 2:
            return

        def one(call):
            fn, args, name = call
            t0 = time.perf_counter()
            with self.bars.compiling(name):
                try:
                    if hasattr(fn, "prepare"):  # a CompiledSteps step: from the step store, else built and stored
                        fn.prepare(self.layout, self.cache(), *args)
                    else:
                        fn.lower(self.layout, self.cache(), *args).compile()
                except Exception:  # the call itself compiles it and raises what is wrong
                    return name, 0.0
            return name, time.perf_counter() - t0

        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="hkv-compile") as pool:
            for name, seconds in pool.map(one, calls):
                times[name] = times.get(name, 0.0) + seconds

    def warmup(self, *, logits: bool, stop_ids: int, prefix: bool, window: bool, disk: bool) -> dict[str, float]:
        """Compile every step a request can use (or load it) and run each once with inputs that
        change nothing, a slot claimed and released (`Engine.warmup`, which checks the engine is
        idle and restores its counters). Returns seconds per compiled step name."""
        times: dict[str, float] = {}

        def run(fn, *args, name):
            t0 = time.perf_counter()
            out = self.tx(fn, *args)
            jax.block_until_ready(out)
            times[name] = times.get(name, 0.0) + time.perf_counter() - t0
            return out

        model_steps = self.model_steps(logits=logits, stop_ids=stop_ids)
        placeholder, t = jnp.int32(0), self.steps
        disk_inputs = swap.swap_in_warmup_inputs(self.layout) if prefix and disk else None
        on_slot = dict(prefix=prefix, window=window, disk_inputs=disk_inputs)
        keys_tokens = self.lookup_placeholders()  # (one set for the slot compiled and the slot run)
        every = [*model_steps, (t.claim, (), "claim"), *self.slot_steps(placeholder, keys_tokens, **on_slot)]
        every.append((t.release, (placeholder,), "release"))
        self.names.update(n for _, _, n in every if n.startswith(("prefill[", "decode[", "swap_in[")))
        self.precompile(every, times)
        if self.compact:  # every decode row count is built: dispatches take the smallest that fits
            self.decode_rows_used.update(self.decode_row_sizes())
        free = np.flatnonzero(~np.asarray(jax.device_get(self.cache().active)))
        for fn, args, name in model_steps:
            run(fn, *args, name=name)
            if name.startswith("decode[") and free.size:
                run(fn, *self.unclaimed_decode_args(args, int(free[0])), name=name)
        slot, _ = run(t.claim, name="claim")
        slot = jnp.int32(int(slot))  # as requests pass it (a committed device scalar is another jit key)
        for fn, args, name in self.slot_steps(slot, keys_tokens, **on_slot):
            run(fn, *args, name=name)
        run(t.release, slot, name="release")
        self.compile_seconds += sum(times.values())
        return times
