"""`Engine`: generation over the hybrid cache — continuous batching, on-device sampling and decode.

The engine owns one `HybridCache` value and replaces it with the result of each jitted transition
(the cache argument is donated). The model implements `hkv.CachedModel` (vocab_size, cache_spec,
cached_step; see hkv.core.protocol) and is an `nnx.Module` (its weights are passed to the jitted
steps as data, not baked in as constants). Compiled steps are shared by every engine built on the
same model structure, layout and kernel options in a process (`hkv.engine.compiled`), and JAX's
persistent compilation cache is on by default, so a second process does not compile again.

Three ways to generate, one semantics (DESIGN §10):
- `generate(prompts, max_new_tokens, ...)`: a batch, returned when every prompt is done;
- `submit(prompt, ...) -> RequestHandle` (thread-safe, also while the engine runs) and `step()` /
  `run_until_idle()`; a handle streams its tokens and has `.result()`;
- `hkv.decode_loop` inside the caller's own `jax.jit` (the engine runs the same loop).

Scheduling (`step`): queued requests are admitted into free slots (claim, prefix lookup and
restore); every request still prefilling then runs its next chunk of `prefill_chunk` tokens — up to
`prefill_batch` of them in one batched step — and every decoding request advances by up to
`decode_steps` tokens in one on-device loop (sampling, stop ids, budgets on device; only the chosen
ids and their logprobs cross to the host). A long prompt therefore never stalls decoding: decode
dispatches run between its chunks. With the prefix cache on, a decode dispatch stops each row at its
next block boundary, where the boundary is recorded (and its snapshot kept, per the retention policy).
While only decoding happens (nothing queued or prefilling, no boundary to record), the next decode
is sent before the host hands the last one's tokens to their requests, so that bookkeeping overlaps
the device's work (`stats()["decode_dispatched_ahead"]` counts those dispatches); the results, the
pages and the compiled programs are those of one dispatch at a time.
In a process whose decode step is not built yet (cold: no compilation cache, no step store),
decoding requests advance one token per step through the prefill step they ran
(`decode_while_building`, `stats()["decode_via_prefill"]`): the same cached step and sampling at
the same positions in another compiled program, so a first `generate` does not wait for the decode
compile. The decode step then builds on a background thread once that detour has cost about what
compiling costs (a short first `generate` returns without compiling it; a long one starts it at
once and switches to it when it is built).
If the pools run out of pages (`Status.NO_PAGES`, cache unchanged), cached prefixes give way first;
then the most recently admitted request is preempted: its slot is released and it is re-queued with
the tokens it has generated, to be recomputed later. Every token is drawn from (seed, position), so a
preempted request continues exactly as it would have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..core.layout import CacheConfig, CacheLayout
from ..core.memory import architectural_minimum, memory_report
from ..core.policy import RetentionPolicy
from ..core.protocol import check_protocol
from ..core.sampling import SEED_RANGE, SamplingParams
from ..core.state import init_cache
from ..core.weights import weights_digest
from ..store.tier import DiskTier, DiskTierClosedError
from .checkpoint import restore_engine, save_engine
from .compile_plan import CompilePlan, EngineSteps
from .compiled import compiled_steps, enable_compilation_cache
from .hooks import EngineHooks, Forward
from .intake import Intake, RequestSpec, link_choices
from .interrupts import DeferredInterrupt
from .metrics import metrics_text
from .options import EngineOptions, accepts_read_tokens, accepts_snapshots, chat_template_of, check_fits, text_codec
from .prefix_manager import PrefixManager
from .progress import Bars
from .requests import (
    EngineBusyError,
    EngineClosedError,
    Generation,
    LiveRequest,
    RequestCancelledError,
    RequestHandle,
)
from .scheduler import CacheCapacityError, Scheduler
from .text_api import TextMethods

__all__ = [
    "CacheCapacityError",
    "Engine",
    "EngineBusyError",
    "EngineClosedError",
    "Generation",
    "RequestCancelledError",
    "RequestHandle",
]


class Engine(TextMethods):
    """Generation with the hybrid cache.

    model: see the module docstring (e.g. `models.deepseek_v4.DeepseekV4`).
    config: static cache capacities. block_tokens: state-table / prefix block size.
    prefill_chunk: tokens per prefill step. prefill_batch: most requests prefilled in one step
    (default 1; larger batches are padded to a power of two, one compilation each).
    prefill_buckets: narrower prefill widths (each in [1, prefill_chunk), one compilation each) for
    the step that finishes a prompt: it runs the narrowest that holds every row's remaining tokens
    instead of a full padded chunk. A warm request whose restore leaves a 64-token suffix then costs
    one 64-wide step, not one of prefill_chunk (default: none).
    read_buckets: prefill and decode read sizes in tokens (each in [1, max_context], one compilation
    per prefill width, and per decode variant, each): a step reads compressed entries (and
    full-attention rows) for the smallest size holding every row's tokens after the step (a decode
    dispatch: after its `decode_steps` tokens), not for max_context, so its cost follows the
    context held (`hkv.Step.read_tokens`; needs a model whose cached_step takes `read_tokens`,
    `accepts_read_tokens`). None (default): `default_read_buckets(max_context)`,
    powers of two from 1024 to 3/4 of max_context; () reads max_context always.
    decode_steps: tokens per decode dispatch (the on-device loop's bound; the host syncs once per
    dispatch). model_id: a display label (the ABI fingerprint covers the weights themselves,
    `hkv.weights_digest`).
    kernel_options: keyword arguments for the model's cached step, e.g. {"kernel_backend": "gpu",
    "interpret": True} to run the Pallas decode kernels in the interpreter on CPU.
    retention: where SWA + TAIL snapshots are kept (the prefix cache is on unless config.prefix_records == 0).
    cache_salt: extra bytes in every block key (adapter id, tenant salt).
    disk: an `hkv.DiskTier`: cached blocks the eviction policy moves out of device memory are written
    there (write-behind, never waited on by a step) and restored from there on a later hit, after
    verification (needs the prefix cache). An `hkv.HostTier` (host memory) or an
    `hkv.TieredStore(HostTier(...), DiskTier(...))` (host memory over disk) speaks the same protocol.
    seed: seeds the engine's draws of per-request seeds for sampled requests without their own.
    compilation_cache: JAX's persistent compilation cache (see `hkv.engine.compiled`): None = on in
    the default directory unless $HKV_COMPILATION_CACHE=0, False = leave off, a path = that directory.
    progress: a callable receiving one-line messages (admissions, restores, evictions, compiles).
    tokenizer: for `generate_text`: an `hkv.engine.text.TextCodec`, a checkpoint folder holding
    `tokenizer.json`, or the path of a tokenizer.json (None: token ids only).
    chat_template: for `chat`: an `hkv.engine.chat.ChatTemplate` or a folder holding one (None: the
    template of the tokenizer's checkpoint folder, if any).
    progress_bars: tqdm bars for compilations and long `generate` calls (None: when stderr is a
    terminal or in a notebook; see `hkv.engine.progress`).
    warmup: call `warmup()` at the end of construction (compile every step now, not on first use).
    restore_choice: how a lookup picks among its routes to a prompt's end when the device cache is
    short of the hash hit (`RESTORE_CHOICES`): "cheapest" (default) takes the least estimated time
    from costs measured as the engine runs (prefill seconds per chunk, disk seconds per token), so a
    model whose prefill is cheap may recompute rather than read the disk; "longest" takes the route
    that restores the most tokens (disk over a window rebuild over recomputing; ties: the cheaper),
    whatever the timings: reproducible plans, e.g. to exercise the disk tier.
    mesh: a `jax.sharding.Mesh` to serve from many devices: `Engine(..., mesh=m)` returns an
    `hkv.MeshEngine` (see `__new__`); None (default): one device.

    Attribute `decode_while_building` (default True; set it on an engine or on the class): while the
    decode step a batch needs is still building, decode one token per step through a prefill step
    already run instead of waiting (see the module docstring). False: every decoded token comes
    from the decode step (the first decode waits for its compile).
    """

    decode_while_building: bool = True  # see the class docstring (`Scheduler._decode_via_prefill`)
    shard: int | None = None  # the data shard of an `hkv.MeshEngine` this engine serves (None: alone)
    mesh_class: type | None = None  # what `Engine(mesh=)` builds: `hkv.MeshEngine` (hkv.engine.sharded sets it)
    _closed = False  # set by close()

    def __new__(cls, model=None, config=None, *args, mesh=None, **kwargs):
        """`Engine(model, config, mesh=m, ...)` with a `jax.sharding.Mesh` builds an `hkv.MeshEngine`
        over it (its `data_axis`, `model_axis`, `tensor_parallel`, `expert_axes` and `route` keywords, and every
        other `Engine` keyword; docs/mesh.md); without one, an `Engine` on one device."""
        if mesh is not None and cls is Engine:
            return Engine.mesh_class(model, config, *args, mesh=mesh, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        model,
        config: CacheConfig,
        *,
        mesh: None = None,
        block_tokens: int = 16,
        prefill_chunk: int = 32,
        prefill_batch: int = 1,
        prefill_buckets: Sequence[int] = (),
        read_buckets: Sequence[int] | None = None,
        decode_steps: int = 8,
        model_id: str = "unknown",
        progress: Callable[[str], None] | None = None,
        kernel_options: dict | None = None,
        retention: RetentionPolicy | None = None,
        cache_salt: bytes = b"",
        disk: DiskTier | None = None,
        seed: int | None = None,
        compilation_cache: bool | str | None = None,
        tokenizer=None,
        chat_template=None,
        progress_bars: bool | None = None,
        warmup: bool = False,
        restore_choice: str = "cheapest",
    ):
        opts, config = EngineOptions.check(
            config, block_tokens=block_tokens, prefill_chunk=prefill_chunk, prefill_batch=prefill_batch,
            prefill_buckets=prefill_buckets, read_buckets=read_buckets, decode_steps=decode_steps,
            restore_choice=restore_choice, disk=disk,
        )  # fmt: skip
        check_protocol(model)
        self._bind_model(model, opts.block_tokens, model_id)  # _graphdef, _weights, spec
        self.layout = CacheLayout(self.spec, config)
        opts.check_layout(self.layout, config, disk)
        self.compilation_cache = enable_compilation_cache(compilation_cache)
        self.tokenizer = text_codec(tokenizer, model.vocab_size)
        self.chat_template = chat_template_of(chat_template, tokenizer)
        self._bars = Bars(progress_bars)
        self.model = model
        check_fits(self.layout)
        self.cache = self._new_cache()
        self.prefill_chunk, self.prefill_widths = opts.prefill_chunk, opts.prefill_widths
        self.read_sizes = opts.read_sizes(config, accepts_read_tokens(model))
        self.prefill_batch, self.decode_steps = opts.prefill_batch, opts.decode_steps
        self.progress = progress
        self._kernel_options = dict(kernel_options or {})
        self._seeded = seed is not None
        self._steps = self._make_steps(kernel_options)
        # what the model steps get as weights: the leaves (cheap per call) where the steps take them
        flat = getattr(self._steps, "flat_weights", None)
        self._step_weights = flat(self._weights) if flat is not None else self._weights
        self.steps = EngineSteps.of(self._steps)
        hooks = EngineHooks(
            tx=self._tx,
            view=lambda: self._view,
            cache=lambda: self.cache,
            weights=lambda: self._step_weights,
            say=self._say,
            live=lambda: self.scheduler.live(),
            while_building=lambda: self.decode_while_building,
            vocab_size=model.vocab_size,
        )
        self.compile_plan = CompilePlan(self.steps, self.layout, opts, self.read_sizes, self._bars, hooks)
        self.prefix_manager = PrefixManager(self.layout, self.spec, self.steps, self.compile_plan, hooks, opts,
            retention=retention or RetentionPolicy(), cache_salt=cache_salt, disk=disk,
            interior=accepts_snapshots(model))  # fmt: skip
        self.scheduler = Scheduler(
            self.layout, self.spec, opts, self.steps, self.prefix_manager, self.compile_plan, hooks
        )
        self._drive_lock = threading.Lock()
        self._ids = itertools.count()
        self._seeds = np.random.default_rng(seed)
        self._interrupt: DeferredInterrupt | None = None  # set while a public call runs transitions
        if warmup:
            self.warmup()

    # ------------------------------------------------------- prefix settings (`prefix_manager`'s)
    prefix_enabled = Forward("prefix_manager", "enabled", "Whether the prefix cache is on.", read_only=True)
    disk = Forward("prefix_manager", "disk", "The disk tier (None: none); it may be replaced between calls.")
    retention = Forward("prefix_manager", "retention", "Where SWA + TAIL snapshots are kept (from the next step).")
    cache_salt = Forward("prefix_manager", "cache_salt", "Extra bytes in every block key (adapter id, tenant salt).")
    restore_choice = Forward("prefix_manager", "restore_choice", "How a lookup picks its route (`RESTORE_CHOICES`).")
    window_recompute_tokens = Forward(
        "prefix_manager", "window_tokens", "Tokens one window rebuild runs (0: no exact rebuild route).", read_only=True
    )

    # ------------------------------------------------- device bindings (`hkv.MeshEngine` overrides)
    def _bind_model(self, model, block_tokens: int, model_id: str) -> None:
        """Set `_graphdef`, `_weights` (a snapshot: later changes to `model` cannot alter it) and
        `spec` (its ABI covers the weights)."""
        self._graphdef, weights = nnx.split(model)
        self._weights = jax.tree.map(lambda x: x, weights)
        self.spec = dataclasses.replace(
            model.cache_spec(block_tokens=block_tokens, model_id=model_id), weights_digest=weights_digest(self._weights)
        )

    def _new_cache(self):
        """The value transitions run on (`_tx` passes it and installs what they return)."""
        return init_cache(self.layout)

    def _make_steps(self, kernel_options: dict | None):
        """The compiled transitions (`CompiledSteps`' names and signatures)."""
        return compiled_steps(self._graphdef, kernel_options, self.layout)

    @property
    def _view(self):
        """This engine's `HybridCache` for host reads (prefix index, counters, page bookkeeping)."""
        return self.cache

    def _reset_cache(self) -> None:
        """Replace a cache lost to an interrupted transition with a fresh one."""
        self.cache = init_cache(self.layout)

    # ---------------------------------------------------------------------------------- api
    @property
    def compilations(self) -> dict[str, int]:
        """Compilations of each step this engine has used, e.g. {"prefill[1x32]": 1, "decode[8]": 1, "decode[2x8@1024]":
        1 (2 rows reading 1024 tokens)}: one per bucket (shared with engines of the same model, layout and kernels)."""
        return self.compile_plan.compilations()

    def generate(
        self,
        prompts,
        max_new_tokens: int | None = None,
        *,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        stop_token_ids: Sequence[int] = (),
        return_logits: bool = False,
    ) -> list[Generation]:
        """Continue each prompt (lengths may differ).

        Args:
          prompts: a non-empty list of token-id sequences (lists, tuples or 1-D integer arrays) or a
            2-D integer array [batch, tokens]; ids in [0, vocab_size).
          max_new_tokens: an integer >= 0 (Python or numpy; not a bool); None: each prompt's
            `SamplingParams.max_tokens`.
          sampling: an `hkv.SamplingParams` for every prompt, a list of them (one per prompt), or
            None (greedy, exact against the stateless forward). Sampled prompts without a seed get
            one each from the engine's generator.
          stop_token_ids: ids that end a prompt's generation (the stop id is its last token,
            finish_reason "stop"), with each sampling's own `stop_token_ids`.
          return_logits: also return each token's float32[vocab] logits (`Generation.logits`).
        Returns:
          one `Generation` per prompt and choice, in order: a prompt whose sampling has n > 1 gives
          n in a row (`Generation.choice` 0 .. n - 1).

        Inputs are validated before anything runs: an invalid request raises `ValueError` and leaves
        the cache untouched. Requests submitted with `submit` run alongside. An exception or
        interrupt while it runs (a raising progress callback, Ctrl-C / a notebook's stop button)
        propagates after the engine has released the aborted requests' slots and pages;
        `engine.cache` stays a live, consistent value and the next call works. A SIGINT in the main
        thread is deferred to the next point between two transitions. Raises `CacheCapacityError`
        when a prompt cannot fit the pools even with nothing else running and every cached prefix
        evicted (the message says what holds each pool's pages). Called while another thread drives
        the engine, its requests join that thread's batch and this call waits for them.
        """
        return self._generate(self._intake().requests(prompts, max_new_tokens, sampling, stop_token_ids, return_logits))

    def _intake(self) -> Intake:
        """This engine's `Intake` (its limits, tokenizer and seed generator)."""
        draw = lambda _: int(self._seeds.integers(0, SEED_RANGE))
        cap, vocab = self.layout.config.max_context, self.model.vocab_size
        return Intake(max_context=cap, vocab_size=vocab, tokenizer=self.tokenizer, draw_seed=draw)

    def _generate(self, specs: list[RequestSpec]) -> list[Generation]:
        """Run checked requests to the end: driving the engine, or (another thread drives it) queued
        into that thread's batch and awaited."""
        intake, vocab = self._intake(), self.model.vocab_size
        try:
            with self._drive():
                seqs = [intake.live(spec, i) for i, spec in enumerate(specs)]
                link_choices(specs, seqs)
                self.scheduler.queue.extend(seqs)
                self._run(seqs)
            return [s.generation(vocab) for s in seqs]
        except EngineBusyError:  # (raised on entry only: nothing was queued)
            handles = self._submit_specs(specs)
        try:
            return [h.result() for h in handles]
        finally:
            for h in handles:
                h.cancel()  # (a no-op once done; an interrupted wait frees the others' slots)

    def _submit_specs(self, specs: list[RequestSpec]) -> list[RequestHandle]:
        """Queue checked requests for the next step (any thread); one handle each."""
        intake = self._intake()
        handles = [RequestHandle(self, next(self._ids)) for _ in specs]
        seqs = [
            intake.live(spec, h.request_id, handle=h, shard=self.shard) for spec, h in zip(specs, handles, strict=True)
        ]
        link_choices(specs, seqs)
        for seq in seqs:
            self.scheduler.submit(seq)
        return handles

    def _run(self, seqs: list[LiveRequest], after_step: Callable[[], None] | None = None) -> None:
        """`Scheduler.run` with this engine's progress bars."""
        self.scheduler.run(seqs, after_step, self._bars)

    def submit(
        self,
        prompt,
        max_new_tokens: int | None = None,
        *,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] = (),
        return_logits: bool = False,
    ) -> RequestHandle:
        """Queue one request; returns its `RequestHandle` at once (nothing runs here).

        Thread-safe: any thread may submit at any time, also while another thread is inside `step`,
        `run_until_idle` or `generate` (the request joins at the next step). Arguments as in
        `generate`, for one prompt: a sequence of token ids, or a string (needs a tokenizer; the
        request then also stops at the tokenizer's end-of-sequence ids unless
        `SamplingParams.ignore_eos`). Invalid input raises `ValueError`; `sampling.n > 1` asks for
        `submit_choices`.
        """
        handles = self.submit_choices(prompt, max_new_tokens, sampling=sampling, stop_token_ids=stop_token_ids,
                                      return_logits=return_logits, _one=True)  # fmt: skip
        return handles[0]

    def submit_choices(
        self,
        prompt,
        max_new_tokens: int | None = None,
        *,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] = (),
        return_logits: bool = False,
        _one: bool = False,
    ) -> list[RequestHandle]:
        """Queue `sampling.n` completions of one prompt; one `RequestHandle` per choice, in order.
        The choices after the first wait for its prefill and restore it from the prefix cache (one
        prefill for the prompt); choice i of a seeded request draws with seed + i. Arguments as in
        `submit`."""
        self._check_open()
        text = isinstance(prompt, str)
        ids = self._intake().encode([prompt]) if text else [prompt]
        specs = self._intake().requests(ids, max_new_tokens, sampling, stop_token_ids, return_logits, text=text)
        if _one and len(specs) > 1:
            raise ValueError(f"sampling.n={len(specs)} asks for several completions: use Engine.submit_choices")
        return self._submit_specs(specs)

    def step(self) -> bool:
        """Advance every request once: admit waiting requests into free slots (with their prefix
        restores), run one prefill chunk for the requests still prefilling, and up to `decode_steps`
        tokens for the decoding ones. Returns True while requests remain (queued or running).

        Raises `EngineBusyError` if another thread is driving the engine. An exception or interrupt
        inside frees the slots of the requests in flight and re-queues them (they are recomputed
        exactly by a later step); a request that cannot fit fails alone (its handle raises
        `CacheCapacityError`)."""
        with self._drive():
            return self.scheduler.step()

    def run_until_idle(self) -> None:
        """Call `step` until no request is queued or running."""
        with self._drive():
            while self.scheduler.step():
                pass

    def warmup(self, *, logits: bool = False, stop_ids: int = 1) -> dict[str, float]:
        """Compile every step a request can use (or load it from the persistent compilation cache)
        by running each once on the live cache with inputs that change nothing (idle rows, zero
        budgets, empty masks, a slot claimed and released), so the first request pays only its own
        work. Only while the engine is idle. With a disk tier, its install step (`swap_in`) is
        compiled for every restore from disk (one shape per power-of-two block count:
        `hkv.engine.offload.swap_in_warmup_inputs`; with full-attention layers a restore that
        continues a prefix restored on device may need another, compiled at first use). The device
        metrics counters are left as they were.

        Args:
          logits: also compile the `return_logits=True` variants.
          stop_ids: also compile the decode step for requests with up to this many stop ids.
        Returns:
          seconds per compiled step name (what `compilations` will list).
        """
        with self._drive():
            if self.scheduler.busy():
                raise ValueError("warmup() needs an idle engine (no request queued or running)")
            before = dataclasses.replace(self.scheduler.stats)
            counters = jax.tree.map(jnp.copy, self.cache.counters)  # (the cache is donated to each step)
            times = self.compile_plan.warmup(
                logits=logits,
                stop_ids=stop_ids,
                prefix=self.prefix_enabled,
                window=bool(self.window_recompute_tokens),
                disk=self.disk is not None,
            )
            self.prefix_manager.warm()
            self.cache = self.cache.replace(counters=counters)
            self.scheduler.stats = before
            self._say(f"warmed up {len(times)} steps in {sum(times.values()):.1f}s")
            return times

    @property
    def pending(self) -> int:
        """Requests submitted or queued and not yet finished."""
        return self.scheduler.pending()

    def write_through(self) -> int:
        """Copy every cached block that ends in an SWA + TAIL snapshot (and the blocks of its chain
        the disk tier lacks) to the disk tier, without evicting anything; asynchronous (see
        `flush_disk`). Returns the number of blocks queued. E.g. before a planned shutdown."""
        if self.disk is None:
            raise ValueError("write_through needs a disk tier (Engine(..., disk=hkv.DiskTier(path)))")
        with self._exclusive():
            return self.prefix_manager.offload(ahead=False)  # (often before an exit)

    def evict_prefixes(self) -> int:
        """Evict every cached prefix record from device memory (between `generate` calls), writing the
        snapshot blocks the disk tier lacks first when there is one. Returns the records evicted.
        Requests cancelled since the last step (e.g. an abandoned stream) are dropped first; a
        ValueError if others still run, `EngineBusyError` if another thread drives the engine."""
        with self._exclusive():
            self._drop_cancelled()
            if self.scheduler.live():
                n = len(self.scheduler.live())
                raise ValueError(f"evict_prefixes while {n} sequences run; call it between steps")
            with self._guard():
                n = self.prefix_manager.evict_all()
        if self.prefix_enabled:
            self._say(f"evicted {n} cached prefix records from device memory")
        return n

    def flush_disk(self) -> None:
        """Wait for every disk write issued so far and mark the committed blocks on disk (nothing to
        wait for once the tier was closed: `DiskTier.close` finished its writes). `EngineBusyError`
        if another thread drives the engine (marking blocks is a transition of the cache)."""
        with self._exclusive():
            self.prefix_manager.flush_disk()

    def save(self, path, *, overwrite: bool = False) -> None:
        """Warm-restart checkpoint: the whole `HybridCache` (orbax) and the engine's settings (JSON),
        written atomically; pending disk-tier writes are finished first so the saved prefix index's
        `on_disk` bits match the store. Only between `generate` calls (requests cancelled since the
        last step are dropped first); `EngineBusyError` if another thread drives the engine. See
        `hkv.engine.checkpoint`."""
        with self._exclusive():
            self._drop_cancelled()  # (save_engine refuses while others run)
            self.prefix_manager.flush_disk()
            save_engine(self, path, overwrite=overwrite)

    @classmethod
    def restore(cls, path, model, **engine_kwargs) -> Engine:
        """An engine rebuilt from `save(path)` with its device cache verified (per-array checksums,
        ABI fingerprint, `check_invariants`) before use. engine_kwargs override the saved settings or
        add runtime ones (`disk=hkv.DiskTier(...)`, `progress=`, `kernel_options=`). With `mesh=` (a
        `jax.sharding.Mesh`): a saved `hkv.MeshEngine`, restored over that mesh (`MeshEngine.restore`)."""
        if engine_kwargs.get("mesh") is not None and cls is Engine:
            return Engine.mesh_class.restore(path, model, **engine_kwargs)
        return restore_engine(cls, path, model, **engine_kwargs)

    def unsaved_settings(self) -> dict[str, bool]:
        """Which settings a checkpoint (`save`) cannot hold are set on this engine: {name: set}.
        `Engine.restore` warns, naming those not given to it again."""
        return {
            "disk": self.disk is not None,
            "tokenizer": self.tokenizer is not None,
            "kernel_options": bool(self._kernel_options),
            "progress": self.progress is not None,
            "seed": self._seeded,
        }

    def close(self) -> None:
        """Finish pending disk writes and retire the engine: every later call (generate, submit, step,
        warmup, save, ...) raises `EngineClosedError`. Calling close() again does nothing."""
        if self._closed:
            return
        self.flush_disk()
        self._closed = True

    def stats(self) -> dict[str, Any]:
        """Engine counters, the cache's transition counters and the prefix metrics (a host snapshot)."""
        counters = {k: int(v) for k, v in jax.device_get(self._view.counters).items()}
        return {
            **dataclasses.asdict(self.scheduler.stats),
            **dataclasses.asdict(self.prefix_manager.counters),
            "compile_seconds": self.compile_plan.compile_seconds,
            "compilations": dict(self.compilations),
            "cache": counters,
            "prefix": self.prefix_stats() if self.prefix_enabled else None,
            "active_slots": int(np.asarray(self._view.active).sum()),
            "abi_fingerprint": self.spec.fingerprint(),
        }

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes allocated and live per object kind; see `hkv.memory.memory_report`."""
        return memory_report(self.layout, self._view)

    def architectural_minimum(self, context: int) -> dict[str, int]:
        return architectural_minimum(self.spec, context)

    # ------------------------------------------------------------------------------ internals
    @contextlib.contextmanager
    def _exclusive(self):
        """One thread at a time in a call that runs transitions or reads the cache between them
        (`EngineBusyError` otherwise): step / generate / run_until_idle / a handle's stream, and
        evict_prefixes / write_through / flush_disk / save. `EngineClosedError` after `close()`."""
        self._check_open()
        if not self._drive_lock.acquire(blocking=False):
            raise EngineBusyError(
                "another thread is driving this engine (step / generate / run_until_idle / a handle's "
                "stream / evict_prefixes / write_through / flush_disk / save); drive it from one thread and "
                "submit() from any"
            )
        try:
            yield
        finally:
            self._drive_lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(
                "this engine was closed (Engine.close()); build a new one, or Engine.restore a saved one"
            )

    @contextlib.contextmanager
    def _drive(self):
        """Scope of a call that advances the engine: `_exclusive`, a live disk tier, and `_guard`'s
        exception safety."""
        with self._exclusive():
            if self.disk is not None and self.disk.closed:
                raise DiskTierClosedError(
                    f"this engine's disk tier ({self.disk.spec!r}) was closed; build the engine "
                    "with an open hkv.DiskTier (or disk=None) to generate"
                )
            with self._guard():
                yield
            self._restore_ahead()

    @contextlib.contextmanager
    def held(self, deferred: DeferredInterrupt | None = None):
        """This engine driven by an owner along with others (an `hkv.MeshEngine`'s shards): held
        exclusively (`EngineBusyError`; `EngineClosedError` after `close()`). With the owner's
        `deferred` (entered by the owner): SIGINT deferred through it, and an exception releases and
        re-queues this engine's requests (`_abort`) before it propagates. Without: a call between
        steps (e.g. `save`), the requests cancelled since the last step dropped first."""
        with self._exclusive(), contextlib.nullcontext() if deferred is None else self._guard(deferred):
            if deferred is None:
                self._drop_cancelled()
            yield

    def _drop_cancelled(self) -> None:
        """For a call allowed only between steps (inside `_exclusive`): drop the requests cancelled
        since the last step now (an abandoned stream's slot would otherwise wait for the next step)."""
        with self._guard():
            self.scheduler.reap()

    def _try_step(self) -> bool:
        """One `step` if no other thread drives the engine (a handle waiting for its tokens); False if busy."""
        try:
            with self._drive():
                self.scheduler.step()
            return True
        except EngineBusyError:
            return False

    def _restore_ahead(self) -> None:
        """At the end of a call that advanced the engine, once it has recorded prefix blocks and
        nothing is left to run: start building the prefix lookup's restore step ahead
        (`CompilePlan.restore_ahead`)."""
        if self.prefix_enabled and self.prefix_manager.recorded and not self.pending:
            self.compile_plan.restore_ahead()

    # ------------------------------------------------------------------ transitions and safety
    def _tx(self, fn, *args) -> tuple:
        """Run the donating transition `fn(layout, cache, *args)` and install its cache at once, so the
        engine never holds a donated buffer outside a transition. Returns fn's other outputs (a tuple).
        Then delivers a SIGINT deferred by `_guard`: this is a point between two transitions."""
        out = fn(self.layout, self.cache, *args)
        self.cache, rest = (out[0], tuple(out[1:])) if isinstance(out, tuple) else (out, ())
        if self._interrupt is not None:
            self._interrupt.deliver()
        return rest

    @contextlib.contextmanager
    def _guard(self, deferred: DeferredInterrupt | None = None):
        """Scope of a public call that runs transitions: SIGINT (main thread, default handler) is
        deferred to the next point between two transitions (a second SIGINT interrupts at once); any
        exception or interrupt frees what the call held (`_abort`) before it propagates. `deferred`:
        an owner's (`held`), which the owner enters, instead of one of this engine's own."""
        own = deferred is None
        self._interrupt = deferred = deferred or DeferredInterrupt()
        try:
            with deferred if own else contextlib.nullcontext():
                yield
        except BaseException:
            self._interrupt = None
            self._abort()
            raise
        finally:
            self._interrupt = None

    def _abort(self) -> None:
        """After an exception inside a call: release every active slot (pages return to the pools,
        cached prefixes stay as they are) and re-queue the requests that held them, first and in
        admission order, to be recomputed exactly by a later step (those of an abandoned `generate`
        call, and cancelled ones, are dropped). If `engine.cache` was lost (an interrupt landed
        between a donating transition and its result, or a transition failed after its input was
        donated), a fresh cache replaces it: cached prefixes on device are dropped (the disk tier
        keeps its blocks), with a `RuntimeWarning`."""
        self.scheduler.requeue_live()
        try:
            if not any(leaf.is_deleted() for leaf in jax.tree.leaves(self.cache)):
                for slot in np.nonzero(np.asarray(self._view.active))[0]:
                    self._tx(self.steps.release, jnp.int32(slot))
                return
        except Exception:  # a cache that cannot even release a slot is replaced below
            pass
        self._reset_cache()
        self.prefix_manager.forget()
        warnings.warn(
            "hkv.Engine: the device cache was lost to an interrupted transition and has been "
            "re-initialised; cached prefixes on device were dropped",
            RuntimeWarning,
            stacklevel=3,
        )

    def _say(self, msg: str) -> None:
        if self.progress is not None:
            self.progress(msg)

    # ------------------------------------------------------------------------- prefix cache
    def prefix_stats(self) -> dict[str, Any]:
        """Hash-hit vs complete-restoration tokens, rejections per stage and reason, occupancy, evictions."""
        return self.prefix_manager.stats()

    def metrics_text(self) -> str:
        """Prometheus text exposition of the cache and prefix metrics (`hkv.engine.metrics`)."""
        return metrics_text(self.layout, self._view, self.prefix_stats(), self.disk)
