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

import concurrent.futures
import contextlib
import dataclasses
import inspect
import itertools
import os
import signal
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..core import prefix as px
from ..core.layers import default_read_buckets, read_size
from ..core.layout import CacheConfig, CacheLayout, Status
from ..core.memory import allocated_bytes, architectural_minimum, memory_report
from ..core.plan import DevicePlan, RestorePlan
from ..core.policy import RetentionPolicy, eviction_order, window_rebuild_tokens
from ..core.protocol import check_protocol
from ..core.reasons import STAGES, Reason
from ..core.sampling import GREEDY, SEED_RANGE, Sampling, SamplingParams
from ..core.state import init_cache
from ..core.weights import weights_digest
from ..store.tier import DiskTier, DiskTierClosedError
from . import block_keys
from . import offload as swap
from .block_keys import ROOT, key_bytes, key_words
from .checkpoint import restore_engine, save_engine
from .compiled import builds_on_this_thread, compiled_steps, enable_compilation_cache, step_name, unpack_decode
from .prefix_tools import RECORD_BATCH, PrefixQuery, pack_records
from .progress import Bars
from .requests import EngineBusyError, EngineClosedError, Generation, RequestCancelledError, RequestHandle

__all__ = [
    "CacheCapacityError",
    "Engine",
    "EngineBusyError",
    "EngineClosedError",
    "Generation",
    "RequestCancelledError",
    "RequestHandle",
]


_could_match = jax.jit(px.could_match)  # see Engine._could_hit


class CacheCapacityError(RuntimeError):
    """A request cannot fit in the cache's pools even with nothing else running and every cached
    prefix evicted. The message lists each pool's capacity and what holds its pages."""


class _DeferredInterrupt:
    """Defers SIGINT (Ctrl-C, a notebook's stop button) to `deliver()`, called between two transitions,
    so an interrupt never lands between a donating transition and the engine installing its result.
    Active only in the main thread and only over Python's default SIGINT handler; a second SIGINT
    before delivery interrupts at once (the engine then recovers in `_abort`). A signal still pending
    when the scope ends is raised there."""

    def __init__(self):
        self.pending = False
        self._previous = None

    def __enter__(self):
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True

    def deliver(self) -> None:
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if exc[0] is None:
            self.deliver()


@dataclasses.dataclass
class _Seq:
    index: int  # position in a generate call, or the request id of a submitted request
    prompt: list[int]
    max_new: int
    sampling: Sampling = GREEDY
    seed: int = 0  # resolved seed (the request's own, or drawn by the engine)
    stop_ids: tuple[int, ...] = ()
    keep_logits: bool = False
    handle: RequestHandle | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None
    cancelled: bool = False
    slot: int = -1
    admitted_at: int = 0
    t_admit: float = 0.0
    ids: list[int] = dataclasses.field(default_factory=list)  # prompt + tokens at admission (what prefill runs)
    fed: int = 0  # tokens written into the cache
    start: int = 0  # tokens this admission restored (its prefill runs ids[start:])
    keys: list = dataclasses.field(default_factory=list)  # block keys of the fed tokens
    parent_record: int = -1  # prefix record of the last recorded block
    plan: RestorePlan | None = None
    # admission control for record slots (hkv.core.policy): fixed at the request's first recorded step — the
    # prefix clock of its own previous use and the length it restored (None: it restored nothing)
    admission_set: bool = False
    prev_use: int | None = None
    prev_len: int | None = None
    record_stopped: bool = False  # refused a record slot: this request caches no more blocks
    shard: int | None = None  # data shard of an `hkv.MeshEngine` (None: a single-device engine)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or len(self.tokens) >= self.max_new

    @property
    def over(self) -> bool:
        """Finished, failed or cancelled: nothing more will happen to it."""
        return self.done or self.error is not None or self.cancelled

    def generation(self, vocab: int) -> Generation:
        logits = None
        if self.keep_logits:
            logits = np.stack(self.logits) if self.logits else np.zeros((0, vocab), np.float32)
        return Generation(
            tokens=list(self.tokens),
            logprobs=np.asarray(self.logprobs, np.float32),
            finish_reason=self.finish_reason or "length",
            plan=dataclasses.replace(self.plan or RestorePlan.cold(len(self.prompt)), shard=self.shard),
            logits=logits,
            seed=None if self.sampling.greedy else self.seed,
        )


def _codec(tokenizer):
    """A `TextCodec` from a codec, a folder with tokenizer.json, or a tokenizer.json path (None: None)."""
    if tokenizer is None:
        return None
    from pathlib import Path

    from .text import TextCodec

    if isinstance(tokenizer, TextCodec):
        return tokenizer
    path = Path(tokenizer)
    return TextCodec.from_pretrained(path) if path.is_dir() else TextCodec.from_file(path)


def accepts_read_tokens(model) -> bool:
    """Whether `model.cached_step` takes the optional `read_tokens` keyword (`hkv.Step.read_tokens`)."""
    try:
        params = inspect.signature(model.cached_step).parameters
    except (TypeError, ValueError):
        return False
    return "read_tokens" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


RESTORE_CHOICES = ("cheapest", "longest")  # `Engine(restore_choice=...)`


def _device_bytes() -> int | None:
    """Memory of the default device in bytes (the host's physical memory on CPU), or None if unknown."""
    dev = jax.devices()[0]
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # a backend without memory stats
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if dev.platform == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def _check_fits(layout: CacheLayout) -> None:
    """`ValueError` (in the config's terms) when the cache of `layout` cannot fit the device's memory,
    before anything is allocated (a raw RESOURCE_EXHAUSTED from inside XLA otherwise)."""
    have = _device_bytes()
    if have is None:
        return
    need = allocated_bytes(layout)["total"]
    if need > have:
        c = layout.config
        raise ValueError(
            f"the cache of CacheConfig(slots={c.slots}, max_context={c.max_context}, page_size={c.page_size}, "
            f"pool_pages={c.pool_pages}, prefix_records={c.prefix_records}) takes {need / 2**30:.1f} GiB, more than "
            f"the device's {have / 2**30:.1f} GiB; lower slots, max_context, pool_pages or prefix_records, or size it "
            f"with memory_bytes="
        )


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _device_zeros(shape: tuple[int, ...], dtype) -> jax.Array:
    """Zeros on the default device (uncommitted, as a step's inputs are) without running a program:
    `jnp.zeros` compiles a broadcast per new shape on a first call in a process, which a
    first request waited for when the placeholders of the steps built ahead were made that way."""
    return jax.device_put(np.zeros(shape, dtype))


def _cancelled(seq) -> bool:
    """Whether a request was cancelled: by its handle (`RequestHandle.cancel`, an abandoned stream) or
    on the request itself (`generate_text`'s stop strings, an abandoned call), before `_reap` sees it."""
    return seq.cancelled or (seq.handle is not None and seq.handle.cancelled)


def _stop_width(rows) -> int:
    """Columns of a decode step's stop-id table for these requests: their most stop ids, padded to
    a power of two (one compiled variant per width)."""
    return _pow2(max([len(q.stop_ids) for q in rows] + [1]))


class _Chunk(NamedTuple):
    """What one prefill step returned for the rows it ran (`Engine._run_chunk`).

    Attributes:
      rows: the requests that ran, in row order (fewer than asked when some were preempted).
      ids: int32[b] the token sampled for each row.
      logprobs: float32[b] its log-probability.
      logits: float32[b, vocab] each row's last logits, or None when no row keeps them.
      fed: int32[b] tokens fed per row.
      seconds: the step's wall time.
      compiled: whether the call built (traced and compiled, or loaded) its program.
    """

    rows: list
    ids: np.ndarray
    logprobs: np.ndarray
    logits: np.ndarray | None
    fed: np.ndarray
    seconds: float
    compiled: bool

    def row(self, j: int) -> tuple[list[int], list[float], np.ndarray | None]:
        """Row `j`'s token, logprob and last logits [1, vocab] (or None), as `Engine._emit` takes them."""
        return [int(self.ids[j])], [float(self.logprobs[j])], None if self.logits is None else self.logits[j : j + 1]


class Engine:
    """Generation with the hybrid cache.

    model: see the module docstring (e.g. `models.deepseek_v4.DeepseekV4`).
    config: static cache capacities. block_tokens: state-table / prefix block size.
    prefill_chunk: tokens per prefill step. prefill_batch: most requests prefilled in one step
    (default 1; larger batches are padded to a power of two, one compilation each).
    prefill_buckets: narrower prefill widths (each in [1, prefill_chunk), one compilation each) for
    the step that finishes a prompt: it runs the narrowest that holds every row's remaining tokens
    instead of a full padded chunk. A warm request whose restore leaves a 64-token suffix then costs
    one 64-wide step, not one of prefill_chunk (default: none).
    read_buckets: prefill read sizes in tokens (each in [1, max_context], one compilation per prefill
    width each): a prefill step reads compressed entries (and full-attention rows) for the smallest
    size holding every row's tokens after the step, not for max_context, so a chunk's cost follows the
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
    verification (needs the prefix cache).
    seed: seeds the engine's draws of per-request seeds for sampled requests without their own.
    compilation_cache: JAX's persistent compilation cache (see `hkv.engine.compiled`): None = on in
    the default directory unless $HKV_COMPILATION_CACHE=0, False = leave off, a path = that directory.
    progress: a callable receiving one-line messages (admissions, restores, evictions, compiles).
    tokenizer: for `generate_text`: an `hkv.engine.text.TextCodec`, a checkpoint folder holding
    `tokenizer.json`, or the path of a tokenizer.json (None: token ids only).
    progress_bars: tqdm bars for compilations and long `generate` calls (None: when stderr is a
    terminal or in a notebook; see `hkv.engine.progress`).
    warmup: call `warmup()` at the end of construction (compile every step now, not on first use).
    restore_choice: how a lookup picks among its routes to a prompt's end when the device cache is
    short of the hash hit (`RESTORE_CHOICES`): "cheapest" (default) takes the least estimated time
    from costs measured as the engine runs (prefill seconds per chunk, disk seconds per token), so a
    model whose prefill is cheap may recompute rather than read the disk; "longest" takes the route
    that restores the most tokens (disk over a window rebuild over recomputing; ties: the cheaper),
    whatever the timings: reproducible plans, e.g. to exercise the disk tier.

    Attribute `decode_while_building` (default True; set it on an engine or on the class): while the
    decode step a batch needs is still building, decode one token per step through a prefill step
    already run instead of waiting (see the module docstring). False: every decoded token comes
    from the decode step (the first decode waits for its compile).
    """

    # send a decode before the host has handed the previous one's tokens over, when nothing else can
    # run in between (`_dispatch_ahead`); False: strictly one dispatch at a time (same results)
    _PIPELINE = True
    # while the decode step a batch needs is still building (a process's first decode of it, cold),
    # decode one token per step through a prefill step already run (`_decode_via_prefill`), so a
    # first request does not wait for the decode compile; False (per engine or for the class): wait
    decode_while_building: bool = True
    _closed = False  # set by close()

    def __init__(
        self,
        model,
        config: CacheConfig,
        *,
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
        progress_bars: bool | None = None,
        warmup: bool = False,
        restore_choice: str = "cheapest",
    ):
        def positive(name, v):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
            return int(v)

        prefill_chunk = positive("prefill_chunk", prefill_chunk)
        block_tokens = positive("block_tokens", block_tokens)
        if isinstance(prefill_buckets, (int, np.integer)) or not all(
            isinstance(w, (int, np.integer)) and not isinstance(w, (bool, np.bool_)) and 1 <= w < prefill_chunk
            for w in prefill_buckets
        ):
            raise ValueError(
                f"prefill_buckets={prefill_buckets!r} must be a sequence of integers in [1, {prefill_chunk}) "
                f"(narrower than prefill_chunk={prefill_chunk})"
            )
        decode_steps = positive("decode_steps", decode_steps)
        if read_buckets is None:
            read_buckets = default_read_buckets(config.max_context)
        if isinstance(read_buckets, (int, np.integer)) or not all(
            isinstance(r, (int, np.integer)) and not isinstance(r, (bool, np.bool_)) and 1 <= r <= config.max_context
            for r in read_buckets
        ):
            raise ValueError(
                f"read_buckets={read_buckets!r} must be a sequence of integers in [1, {config.max_context}] "
                f"(token counts up to max_context={config.max_context})"
            )
        if config.prefix_records is None and config.memory_bytes is None and prefill_chunk % block_tokens:
            # the default (sized) prefix cache needs chunks that end on block boundaries: without them
            # it is left off, with a warning, instead of refusing a config that never asked for it
            warnings.warn(
                f"{prefill_chunk=} is not a multiple of {block_tokens=}: the prefix cache is off (chunks must "
                f"end on block boundaries, where records are taken); pass CacheConfig(prefix_records=0) to "
                f"silence this, or a prefill_chunk that block_tokens divides to turn it on",
                stacklevel=2,
            )
            config = dataclasses.replace(config, prefix_records=0)
        if disk is not None and not isinstance(disk, DiskTier):
            raise ValueError(f"disk={disk!r} must be an hkv.DiskTier")
        if restore_choice not in RESTORE_CHOICES:
            raise ValueError(f"restore_choice={restore_choice!r} must be one of {RESTORE_CHOICES}")
        check_protocol(model)
        self._bind_model(model, block_tokens, model_id)  # _graphdef, _weights, spec
        self.layout = CacheLayout(self.spec, config)
        # checked on the resolved config: memory_bytes may leave no room for records (prefix off)
        records = self.layout.config.prefix_records
        if records and prefill_chunk % block_tokens:
            raise ValueError(
                f"{prefill_chunk=} must be a multiple of {block_tokens=} when the prefix cache is on "
                f"(chunks end on block boundaries, where records are taken; CacheConfig.prefix_records=0 "
                f"turns it off)"
            )
        if disk is not None and records == 0:
            raise ValueError(
                "the disk tier holds prefix blocks: it needs the prefix cache "
                f"(CacheConfig.prefix_records={config.prefix_records}"
                f"{f', memory_bytes={config.memory_bytes:,}' if config.memory_bytes else ''} leaves 0 records; "
                f"prefix_records must be > 0, or None to size it)"
            )
        self.compilation_cache = enable_compilation_cache(compilation_cache)
        self.tokenizer = _codec(tokenizer)
        if self.tokenizer is not None and self.tokenizer.vocab_size > model.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.tokenizer.vocab_size} token ids but the model's vocabulary has "
                f"{model.vocab_size}: its ids >= {model.vocab_size} could not be fed to the model (use the "
                f"checkpoint's own tokenizer)"
            )
        self._bars = Bars(progress_bars)
        self.model = model
        self.disk = disk
        _check_fits(self.layout)
        self.cache = self._new_cache()
        self.prefill_chunk = prefill_chunk
        self.prefill_widths = tuple(sorted({int(w) for w in prefill_buckets})) + (prefill_chunk,)
        # prefill read sizes, ascending, the last max_context (None: the model reads max_context always)
        self.read_sizes: tuple[int | None, ...] = (
            tuple(sorted({int(r) for r in read_buckets} | {config.max_context}))
            if accepts_read_tokens(model)
            else (None,)
        )
        self.prefill_batch = positive("prefill_batch", prefill_batch)
        self.decode_steps = decode_steps
        self.progress = progress
        self._stats = {
            "prompts": 0,
            "prefill_tokens": 0,
            "prefill_steps": 0,
            "decode_steps": 0,
            "decode_dispatches": 0,
            "decode_dispatched_ahead": 0,
            "decode_via_prefill": 0,
            "generated_tokens": 0,
            "preemptions": 0,
            "prefill_seconds": 0.0,
            "decode_seconds": 0.0,
            "compile_seconds": 0.0,
        }
        self._kernel_options = dict(kernel_options or {})
        self._seeded = seed is not None
        self._steps = self._make_steps(kernel_options)
        # what the model steps get as weights: the leaves (cheap per call) where the steps take them
        flat = getattr(self._steps, "flat_weights", None)
        self._step_weights = flat(self._weights) if flat is not None else self._weights
        self._names: set[str] = set()  # compiled step names this engine used (for `compilations`)
        self._asked_ahead: set[tuple] = set()  # the step variants `_build_ahead` asked for
        self._prefill_variants: set[tuple] = set()  # (rows, width, read bound, logits) of prefill steps run
        self._build_seconds = 0.0  # the longest prefill step that compiled (`_decode_via_prefill`)
        self._via_prefill_seconds = 0.0  # time spent decoding through the prefill step
        self._recorded = False  # whether this engine has recorded a prefix block (`_restore_ahead`)
        self._prefill = self._steps.prefill
        self._decode = self._steps.decode
        self._restore_window = self._steps.restore_window
        t = self._steps
        self._claim, self._release = t.claim, t.release
        self.prefix_enabled = self.layout.config.prefix_records > 0
        self.retention = retention or RetentionPolicy()
        self.cache_salt = bytes(cache_salt)
        self._restore, self._count_plan = t.restore, t.count_plan
        self._record_many, self._evict = t.record_many, t.evict
        self._swap_in, self._mark_on_disk = t.swap_in, t.mark_on_disk
        self.window_recompute_tokens = window_rebuild_tokens(self.spec)  # 0: no exact rebuild route
        self.restore_choice = restore_choice
        self._stats.update(
            ttft_seconds=[], window_recomputes=0, disk_restores=0, disk_restored_tokens=0, disk_blocks_offloaded=0
        )
        self._disk_futures: list = []
        self._disk_inflight: set[tuple[bytes, bool]] = set()
        # scheduler state (touched only by the driving thread, except `_inbox`, guarded by `_inbox_lock`)
        self._queue: deque[_Seq] = deque()  # waiting for a slot, oldest first
        self._prefilling: dict[int, _Seq] = {}  # slot -> request still running its prompt
        self._running: dict[int, _Seq] = {}  # slot -> decoding request
        self._inbox: list[_Seq] = []
        self._inbox_lock = threading.Lock()
        # a decode dispatched ahead (`_dispatch_ahead`), its results not yet handed to its requests
        self._ahead: tuple | None = None
        self._drive_lock = threading.Lock()
        self._ids = itertools.count()
        self._seeds = np.random.default_rng(seed)
        self._clock = 0
        self._interrupt: _DeferredInterrupt | None = None  # set while a public call runs transitions
        self._record_stamps: dict[int, int] = {}  # record -> prefix clock when it was last recorded
        # measured costs for restore choices: seconds per prefill chunk, seconds per token from disk
        self._cost = {"chunk": None, "disk_token": None}
        if warmup:
            self.warmup()

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
        """Compilations of each compiled step this engine has used, e.g. {"prefill[1x32]": 1,
        "decode[8]": 1}: one per bucket (steps are shared with other engines of the same model,
        layout and kernel options, so a second engine reports the first one's single compilation)."""
        return {n: self._steps.traces[n] for n in sorted(self._names)}

    def generate(
        self,
        prompts,
        max_new_tokens: int,
        *,
        sampling: Sampling | None = None,
        stop_token_ids: Sequence[int] = (),
        return_logits: bool = False,
    ) -> list[Generation]:
        """Continue each prompt (lengths may differ).

        Args:
          prompts: a non-empty list of token-id sequences (lists, tuples or 1-D integer arrays) or a
            2-D integer array [batch, tokens]; ids in [0, vocab_size).
          max_new_tokens: an integer >= 0 (Python or numpy; not a bool).
          sampling: an `hkv.Sampling` for every prompt (None: greedy, exact against the stateless
            forward). Sampled prompts without a seed get one each from the engine's generator.
          stop_token_ids: ids that end a prompt's generation (the stop id is its last token,
            finish_reason "stop").
          return_logits: also return each token's float32[vocab] logits (`Generation.logits`).
        Returns:
          one `Generation` per prompt, in order.

        Inputs are validated before anything runs: an invalid request raises `ValueError` and leaves
        the cache untouched. Requests submitted with `submit` run alongside. An exception or
        interrupt while it runs (a raising progress callback, Ctrl-C / a notebook's stop button)
        propagates after the engine has released the aborted requests' slots and pages;
        `engine.cache` stays a live, consistent value and the next call works. A SIGINT in the main
        thread is deferred to the next point between two transitions. Raises `CacheCapacityError`
        when a prompt cannot fit the pools even with nothing else running and every cached prefix
        evicted (the message says what holds each pool's pages), `EngineBusyError` when another
        thread is driving the engine.
        """
        prompts, max_new_tokens = self._validate(prompts, max_new_tokens)
        sampling, stops = self._validate_options(sampling, stop_token_ids, return_logits)
        with self._drive():
            seqs = [self._new_seq(i, p, max_new_tokens, sampling, stops, return_logits) for i, p in enumerate(prompts)]
            self._queue.extend(seqs)
            self._run(seqs)
        return [s.generation(self.model.vocab_size) for s in seqs]

    def _run(self, seqs: list[_Seq], after_step: Callable[[], None] | None = None) -> None:
        """Step until every one of `seqs` is over (a progress bar over their tokens when long); the
        first request error is raised; an exception abandons them all (`_abort` frees their slots)."""
        total = sum(len(s.prompt) + s.max_new for s in seqs)
        bar = self._bars.tokens(total, f"hkv: {len(seqs)} request(s)")
        shown = 0
        try:
            while not all(s.over for s in seqs):
                self._step()
                for s in seqs:
                    if s.error is not None:
                        raise s.error
                if after_step is not None:
                    after_step()
                if bar is not None:
                    done = sum(len(s.prompt) if s.tokens else min(s.fed, len(s.prompt)) for s in seqs)
                    done += sum(len(s.tokens) for s in seqs)
                    bar.update(max(done - shown, 0))
                    shown = max(done, shown)
            self._reap()
        except BaseException:
            for s in seqs:
                s.cancelled = True  # the call is abandoned: `_abort` drops them, frees their slots
            raise
        finally:
            if bar is not None:
                bar.close()

    def submit(
        self,
        prompt,
        max_new_tokens: int,
        *,
        sampling: Sampling | None = None,
        stop_token_ids: Sequence[int] = (),
        return_logits: bool = False,
    ) -> RequestHandle:
        """Queue one request; returns its `RequestHandle` at once (nothing runs here).

        Thread-safe: any thread may submit at any time, also while another thread is inside `step`,
        `run_until_idle` or `generate` (the request joins at the next step). Arguments as in
        `generate`, for one prompt (a sequence of token ids). Invalid input raises `ValueError`.
        """
        self._check_open()
        (prompt,), max_new = self._validate([prompt], max_new_tokens)
        sampling, stops = self._validate_options(sampling, stop_token_ids, return_logits)
        rid = next(self._ids)
        handle = RequestHandle(self, rid)
        seq = self._new_seq(rid, prompt, max_new, sampling, stops, return_logits, handle)
        with self._inbox_lock:
            self._inbox.append(seq)
        return handle

    def step(self) -> bool:
        """Advance every request once: admit waiting requests into free slots (with their prefix
        restores), run one prefill chunk for the requests still prefilling, and up to `decode_steps`
        tokens for the decoding ones. Returns True while requests remain (queued or running).

        Raises `EngineBusyError` if another thread is driving the engine. An exception or interrupt
        inside frees the slots of the requests in flight and re-queues them (they are recomputed
        exactly by a later step); a request that cannot fit fails alone (its handle raises
        `CacheCapacityError`)."""
        with self._drive():
            return self._step()

    def run_until_idle(self) -> None:
        """Call `step` until no request is queued or running."""
        with self._drive():
            while self._step():
                pass

    def generate_text(
        self,
        texts: Sequence[str],
        max_new_tokens: int,
        *,
        sampling: Sampling | None = None,
        stop: Iterable[str] | None = (),
        stop_token_ids: Sequence[int] | None = None,
        include_stop: bool = False,
    ) -> list[Generation]:
        """Text in, text out (needs `Engine(tokenizer=...)`): each text is encoded, continued and decoded.

        Args:
          texts: a non-empty list of strings.
          max_new_tokens, sampling: as in `generate`.
          stop: strings (any iterable; None = none) that end a text's generation as soon as they appear
            in its decoded output; the request stops there (its slot is freed at once) and its text
            ends before the stop string (with it when include_stop). Tokens are cut after the one
            that completed it.
          stop_token_ids: ids that end generation; None = the tokenizer's end-of-sequence ids.
        Returns:
          one `Generation` per text with `.text` set (finish_reason "stop" for a stop string or id).
          An id the tokenizer has no token for (a model vocabulary padded past the tokenizer's, as
          DeepSeek-V4's) stays in `.tokens` and adds no text.
        """
        from .text import StopStrings

        if self.tokenizer is None:
            raise ValueError("generate_text needs a tokenizer: hkv.Engine(..., tokenizer=<checkpoint folder>)")
        if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts:
            raise ValueError(f"texts must be a non-empty list of strings; got {type(texts).__name__}")
        if stop is None:
            stop = ()
        if isinstance(stop, str) or not isinstance(stop, Iterable):
            raise ValueError(f"stop={stop!r} must be a list of non-empty strings (or None)")
        stop = tuple(stop)  # once: a generator would be used up by the check below and read empty after
        if any(not isinstance(x, str) or not x for x in stop):
            raise ValueError(f"stop={stop!r} must be a list of non-empty strings (or None)")
        encoded = self.tokenizer.encode(list(texts))
        for i, (text, p) in enumerate(zip(texts, encoded, strict=True)):
            if not p:
                raise ValueError(
                    f"texts[{i}]={text!r:.60} encodes to no tokens (this tokenizer adds no BOS); every prompt "
                    "needs >= 1 token"
                )
        prompts, max_new = self._validate(encoded, max_new_tokens)
        ids = self.tokenizer.eos_token_ids if stop_token_ids is None else stop_token_ids
        sampling, stops = self._validate_options(sampling, ids, False)
        with self._drive():
            seqs = [self._new_seq(i, p, max_new, sampling, stops, False) for i, p in enumerate(prompts)]
            vocab = self.model.vocab_size  # ids past the tokenizer's decode to no text
            readers = [
                StopStrings(self.tokenizer, list(stop), include_stop=include_stop, vocab_size=vocab, context=p)
                for p in prompts
            ]
            fed = [0] * len(seqs)
            self._queue.extend(seqs)

            def read():
                for j, s in enumerate(seqs):
                    if len(s.tokens) > fed[j] and not readers[j].stopped:
                        readers[j].feed(s.tokens[fed[j] :])
                        fed[j] = len(s.tokens)
                        if readers[j].stopped and not s.done:
                            s.cancelled = True  # a stop string: free the slot now

            self._run(seqs, read)
        out = []
        for s, r in zip(seqs, readers, strict=True):
            r.finish()
            s.cancelled = False
            g = s.generation(self.model.vocab_size)
            if r.stopped:
                g.tokens, g.logprobs, g.finish_reason = g.tokens[: r.consumed], g.logprobs[: r.consumed], "stop"
            g.text = r.text
            out.append(g)
        return out

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
            if self._live() or self._queue:
                raise ValueError("warmup() needs an idle engine (no request queued or running)")
            before = dict(self._stats)
            counters = jax.tree.map(jnp.copy, self.cache.counters)  # (the cache is donated to each step)
            times: dict[str, float] = {}

            def run(fn, *args, name):
                t0 = time.perf_counter()
                out = self._tx(fn, *args)
                jax.block_until_ready(out)
                times[name] = times.get(name, 0.0) + time.perf_counter() - t0
                return out

            keeps = (False, True) if logits else (False,)
            rows = sorted({_pow2(n) for n in range(1, self.prefill_batch + 1)})
            model_steps = []  # (jitted step, its arguments after (layout, cache), name)
            for keep in keeps:
                bounds = [self._read_bound(r or 1) for r in self.read_sizes]
                for b, w, r in itertools.product(rows, self.prefill_widths, bounds):
                    z = np.zeros((b,), np.int32)
                    args = (
                        self._step_weights,
                        np.zeros((b, w), np.int32),
                        z,
                        z,
                        SamplingParams.stack([GREEDY] * b),
                        keep,
                        r,
                    )
                    name = step_name("prefill", f"{b}x{w}", logits=keep, read=r)
                    model_steps.append((self._prefill, args, name))
                for n_stop in sorted({_pow2(n) for n in range(1, max(stop_ids, 1) + 1)}):
                    args = self._idle_decode_args(n_stop, keep)
                    model_steps.append(
                        (self._decode, args, step_name("decode", str(self.decode_steps), stops=n_stop, logits=keep))
                    )

            keys, toks = self._lookup_placeholders()
            disk_inputs = (
                swap.swap_in_warmup_inputs(self.layout) if self.prefix_enabled and self.disk is not None else []
            )

            def slot_steps(slot):
                """The transitions run on a claimed slot (device arrays, as requests pass them: numpy
                inputs would be another jit key); built twice, for the slot compiled and the slot run."""
                out = []
                if not self.prefix_enabled:
                    return out
                out.append((self._restore, (slot, keys, toks, jnp.int32(0)), "restore"))
                # the per-request metrics update: compiling it is part of a first request's TTFT otherwise
                # (it counts into the cache's counters: restored below)
                out.append((self._count_plan, (jax.tree.map(jnp.int32, DevicePlan.make().host()),), "count_plan"))
                if self.window_recompute_tokens:
                    ids = jnp.zeros((self.layout.config.max_context,), jnp.int32)
                    out.append(
                        (
                            self._restore_window,
                            (self._step_weights, slot, keys, toks, jnp.int32(0), ids),
                            "restore_window",
                        )
                    )
                out.append((self._record_many, self._record_args(slot), "record_many"))
                none = jnp.zeros((self.layout.config.prefix_records,), bool)
                out.append((self._evict, (none, none, none), "evict"))
                if self.disk is not None:
                    for k in (1, 2, 4, 8):
                        out.append(
                            (self._mark_on_disk, (jnp.zeros((k, 4), jnp.uint32), jnp.arange(k) < 0), "mark_on_disk")
                        )
                    for rows_, tails in disk_inputs:  # l0 == l1: BAD_REQUEST, no change
                        name = step_name("swap_in", swap.swap_in_size(rows_))
                        out.append((self._swap_in, (slot, jnp.int32(0), jnp.int32(0), rows_, tails), name))
                return out

            placeholder = jnp.int32(0)
            every = [*model_steps, (self._claim, (), "claim"), *slot_steps(placeholder)]
            every.append((self._release, (placeholder,), "release"))
            self._names.update(n for _, _, n in every if n.startswith(("prefill[", "decode[", "swap_in[")))
            self._precompile(every, times)
            for fn, args, name in model_steps:
                run(fn, *args, name=name)
            slot, _ = run(self._claim, name="claim")
            slot = jnp.int32(int(slot))  # as requests pass it (a committed device scalar is another jit key)
            for fn, args, name in slot_steps(slot):
                run(fn, *args, name=name)
            run(self._release, slot, name="release")
            self.cache = self.cache.replace(counters=counters)
            self._stats.update({k: v for k, v in before.items() if k != "compile_seconds"})
            self._stats["compile_seconds"] += sum(times.values())
            self._say(f"warmed up {len(times)} steps in {sum(times.values()):.1f}s")
            return times

    def _precompile(self, calls: list, times: dict[str, float]) -> None:
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
            with self._bars.compiling(name):
                try:
                    if hasattr(fn, "prepare"):  # a CompiledSteps step: from the step store, else built and stored
                        fn.prepare(self.layout, self.cache, *args)
                    else:
                        fn.lower(self.layout, self.cache, *args).compile()
                except Exception:  # the call itself compiles it and raises what is wrong
                    return name, 0.0
            return name, time.perf_counter() - t0

        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="hkv-compile") as pool:
            for name, seconds in pool.map(one, calls):
                times[name] = times.get(name, 0.0) + seconds

    @property
    def pending(self) -> int:
        """Requests submitted or queued and not yet finished."""
        with self._inbox_lock:
            inbox = len(self._inbox)
        return inbox + len(self._queue) + len(self._prefilling) + len(self._running)

    def write_through(self) -> int:
        """Copy every cached block that ends in an SWA + TAIL snapshot (and the blocks of its chain
        the disk tier lacks) to the disk tier, without evicting anything; asynchronous (see
        `flush_disk`). Returns the number of blocks queued. E.g. before a planned shutdown."""
        if self.disk is None:
            raise ValueError("write_through needs a disk tier (Engine(..., disk=hkv.DiskTier(path)))")
        with self._exclusive():
            return self._offload(jax.device_get(self._view.prefix), ahead=False)  # (often before an exit)

    def evict_prefixes(self) -> int:
        """Evict every cached prefix record from device memory (between `generate` calls), writing the
        snapshot blocks the disk tier lacks first when there is one. Returns the records evicted.
        Requests cancelled since the last step (e.g. an abandoned stream) are dropped first; a
        ValueError if others still run, `EngineBusyError` if another thread drives the engine."""
        with self._exclusive():
            self._drop_cancelled()
            if self._live():
                raise ValueError(f"evict_prefixes while {len(self._live())} sequences run; call it between steps")
            if not self.prefix_enabled:
                return 0
            p = jax.device_get(self._view.prefix)
            alive = np.asarray(p.state) == px.RecordState.ALIVE
            if self.disk is not None:
                self._offload(p)
            every = jnp.asarray(alive)
            with self._guard():
                self._tx(self._evict, every, every, every)
        self._say(f"evicted {int(alive.sum())} cached prefix records from device memory")
        return int(alive.sum())

    def flush_disk(self) -> None:
        """Wait for every disk write issued so far and mark the committed blocks on disk (nothing to
        wait for once the tier was closed: `DiskTier.close` finished its writes). `EngineBusyError`
        if another thread drives the engine (marking blocks is a transition of the cache)."""
        with self._exclusive():
            self._flush_disk()

    def _flush_disk(self) -> None:
        if self.disk is not None:
            if not self.disk.closed:
                self.disk.flush()
            self._poll_disk()

    def save(self, path, *, overwrite: bool = False) -> None:
        """Warm-restart checkpoint: the whole `HybridCache` (orbax) and the engine's settings (JSON),
        written atomically; pending disk-tier writes are finished first so the saved prefix index's
        `on_disk` bits match the store. Only between `generate` calls (requests cancelled since the
        last step are dropped first); `EngineBusyError` if another thread drives the engine. See
        `hkv.engine.checkpoint`."""
        with self._exclusive():
            self._drop_cancelled()  # (save_engine refuses while others run)
            self._flush_disk()
            save_engine(self, path, overwrite=overwrite)

    @classmethod
    def restore(cls, path, model, **engine_kwargs) -> Engine:
        """An engine rebuilt from `save(path)` with its device cache verified (per-array checksums,
        ABI fingerprint, `check_invariants`) before use. engine_kwargs override the saved settings or
        add runtime ones (`disk=hkv.DiskTier(...)`, `progress=`, `kernel_options=`)."""
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
            **self._stats,
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
    def _validate(self, prompts, max_new_tokens) -> tuple[list[list[int]], int]:
        """(prompts as lists of Python ints, max_new_tokens as an int), or `ValueError` naming the bad
        value and the allowed range."""
        if (
            isinstance(max_new_tokens, (bool, np.bool_))
            or not isinstance(max_new_tokens, (int, np.integer))
            or max_new_tokens < 0
        ):
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0 (Python or numpy, not a bool)")
        max_new = int(max_new_tokens)
        if isinstance(prompts, (np.ndarray, jax.Array)):
            if prompts.ndim != 2:
                raise ValueError(f"prompts given as an array must be 2-D [batch, tokens]; got shape {prompts.shape}")
            prompts = list(np.asarray(prompts))
        elif not isinstance(prompts, (list, tuple)):
            raise ValueError(
                f"prompts must be a non-empty list of token-id sequences or a 2-D integer array; got "
                f"{type(prompts).__name__}"
            )
        if not prompts:
            raise ValueError("prompts must be a non-empty list of token-id sequences")
        cap = self.layout.config.max_context
        vocab = self.model.vocab_size
        out = []
        for i, p in enumerate(prompts):
            if p is None or isinstance(p, (str, bytes, dict)):
                raise ValueError(f"prompt {i} is a {type(p).__name__}; it must be a sequence of integer token ids")
            try:
                arr = np.asarray(p)
            except (ValueError, TypeError) as e:
                raise ValueError(f"prompt {i} must be a flat sequence of integer token ids (ragged: {e})") from None
            if arr.size == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs >= 1 token")
            if arr.ndim != 1 or arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
                hint = (
                    f" (prompts is a batch: one prompt is [[{int(arr)}, ...]], not [{int(arr)}, ...])"
                    if arr.ndim == 0 and np.issubdtype(arr.dtype, np.integer)
                    else ""
                )
                raise ValueError(
                    f"prompt {i} must be a flat sequence of integer token ids; got shape {arr.shape}, "
                    f"dtype {arr.dtype}{hint}"
                )
            if arr.size + max_new > cap:
                raise ValueError(
                    f"prompt {i}: {arr.size} tokens + max_new_tokens={max_new} = {arr.size + max_new} "
                    f"exceeds max_context={cap}"
                )
            if arr.min() < 0 or arr.max() >= vocab:
                raise ValueError(
                    f"prompt {i}: token ids range [{arr.min()}, {arr.max()}] must lie in [0, vocab_size={vocab})"
                )
            out.append(arr.tolist())
        return out, max_new

    def _validate_options(self, sampling, stop_token_ids, return_logits) -> tuple[Sampling, tuple[int, ...]]:
        """(sampling, stop ids as a tuple of ints), or `ValueError` naming the bad value."""
        if sampling is None:
            sampling = GREEDY
        if not isinstance(sampling, Sampling):
            raise ValueError(f"sampling={sampling!r} must be an hkv.Sampling or None")
        if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, (Sequence, np.ndarray, set)):
            raise ValueError(f"stop_token_ids={stop_token_ids!r} must be a sequence of token ids")
        vocab = self.model.vocab_size
        stops = []
        for t in stop_token_ids:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
                raise ValueError(f"stop token id {t!r} must be an integer in [0, vocab_size={vocab})")
            stops.append(int(t))
        if not isinstance(return_logits, (bool, np.bool_)):
            raise ValueError(f"return_logits={return_logits!r} must be a bool")
        return sampling, tuple(dict.fromkeys(stops))

    def _new_seq(self, index, prompt, max_new, sampling, stops, keep_logits, handle=None) -> _Seq:
        seed = sampling.seed if sampling.seed is not None else int(self._seeds.integers(0, SEED_RANGE))
        return _Seq(index, prompt, max_new, sampling, seed, stops, bool(keep_logits), handle)

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

    def _drop_cancelled(self) -> None:
        """For a call allowed only between steps (inside `_exclusive`): drop the requests cancelled
        since the last step now (an abandoned stream's slot would otherwise wait for the next step)."""
        with self._guard():
            self._reap()

    def _try_step(self) -> bool:
        """One `step` if no other thread drives the engine (a handle waiting for its tokens); False if busy."""
        try:
            with self._drive():
                self._step()
            return True
        except EngineBusyError:
            return False

    def _cancel(self, handle: RequestHandle) -> None:
        """Called by `RequestHandle.cancel` (any thread): the handle's flag is all it sets; the driving
        thread drops the request at its next step (`_reap`), so no other thread touches the queues."""

    def _live(self) -> list[_Seq]:
        """Requests holding a slot (prefilling or decoding), oldest admission first."""
        return sorted([*self._prefilling.values(), *self._running.values()], key=lambda q: q.admitted_at)

    # ------------------------------------------------------------------------------ scheduler
    def _step(self) -> bool:
        self._poll_disk()
        with self._inbox_lock:
            self._queue.extend(self._inbox)
            self._inbox.clear()
        if self._ahead is not None:
            # the running requests' decode of this step is already on its way: hand its results
            # over (dispatching the next one first when nothing else waits), then admit and
            # prefill what arrived meanwhile; no second decode in this step
            self._finish_ahead()
            self._step_admit_prefill()
        else:
            self._step_admit_prefill()
            if self._running:
                self._decode_step()
        self._reap()
        return bool(self._queue or self._prefilling or self._running)

    def _step_admit_prefill(self) -> None:
        """The part of a step before decoding: drop cancelled requests, admit waiting ones, one
        prefill chunk."""
        self._reap()
        self._admit_waiting()
        if self._prefilling:
            self._prefill_step()

    def _reap(self) -> None:
        """Drop cancelled requests: queued ones leave the queue, live ones release their slots."""
        for seq in itertools.chain(self._queue, self._live()):
            if seq.handle is not None and seq.handle.cancelled:
                seq.cancelled = True
        for seq in [q for q in self._queue if q.cancelled]:
            self._queue.remove(seq)
            self._close(seq, RequestCancelledError(f"request {seq.index} was cancelled"))
        for seq in [q for q in self._live() if q.cancelled]:
            self._close(seq, RequestCancelledError(f"request {seq.index} was cancelled"))

    def _admit_waiting(self) -> None:
        """Claim a slot for each waiting request while slots are free, and restore its prefix."""
        while self._queue and len(self._prefilling) + len(self._running) < self.layout.slots:
            seq = self._queue[0]
            if seq.done:
                self._queue.popleft()
                self._close(seq)
                continue
            slot, status = self._tx(self._claim)  # interrupted here, seq is still queued
            if int(status) != Status.OK:  # no free slot after all (should not happen): try later
                return
            self._queue.popleft()
            self._clock += 1
            seq.slot, seq.fed, seq.keys, seq.parent_record = int(slot), 0, [], -1
            seq.ids, seq.admitted_at, seq.t_admit = seq.prompt + seq.tokens, self._clock, time.perf_counter()
            self._prefilling[seq.slot] = seq  # pinned while it restores (`_make_room`)
            if self.prefix_enabled:
                before = seq.slot
                seq.fed = self._lookup(seq, seq.ids)
                if seq.slot != before:  # a window rebuild re-claimed the slot
                    self._prefilling.pop(before, None)
                    self._prefilling[seq.slot] = seq
            seq.start = seq.fed  # where this admission's prefill begins (after its restore)

    def _timed(self, fn, *args, name: str) -> tuple[tuple, float, bool]:
        """Run transition `fn`; returns (outputs, seconds, whether it compiled). Compile time goes to
        stats["compile_seconds"], with a progress message on the first use of a bucket."""
        self._names.add(name)
        fresh = not self._built(fn, name, args)
        if fresh:
            self._say(f"compiling {name} (once per process; cached on disk)")
        t0 = time.perf_counter()
        with self._bars.compiling(name) if fresh else contextlib.nullcontext():
            out = self._tx(fn, *args)
            jax.block_until_ready(out)
        dt = time.perf_counter() - t0
        if fresh:
            self._stats["compile_seconds"] += dt
        return out, dt, fresh

    def _built(self, fn, name: str, args: tuple) -> bool:
        """Whether step `fn` (named `name`) is built for a call with `args` (after layout, cache):
        traced or loaded in this process and not still building ahead on another thread (a call
        would wait for that build)."""
        return self._steps.traces[name] > 0 and not self._building_ahead(fn, args)

    def _building_ahead(self, fn, args: tuple) -> bool:
        """Whether step `fn` is still building ahead on another thread (`_Step.build_ahead`) for a
        call with `args` (after layout, cache): such a call waits for that build."""
        building = getattr(fn, "building", None)
        return building is not None and building(self.layout, *args)

    def _read_bound(self, tokens: int) -> int | None:
        """The `read_tokens` of a prefill step whose rows hold at most `tokens` after it: the smallest
        of `read_sizes` holding them, None at max_context (the unbounded program, named without @)."""
        read = read_size(self.read_sizes, tokens)
        return None if read is None or read >= self.layout.config.max_context else read

    def _prefill_step(self) -> None:
        """One chunk for up to `prefill_batch` prefilling requests, in one batched step."""
        rows = self._live_prefilling()[: self.prefill_batch]
        if not rows:
            return
        left = max(len(seq.ids) - seq.fed for seq in rows)
        c = next(w for w in self.prefill_widths if w >= left or w == self.prefill_chunk)
        self._build_ahead(rows)
        ran = self._run_chunk(rows, c, lambda seq: seq.ids[seq.fed : seq.fed + c])
        if ran is None:
            return
        if not ran.compiled:
            self._measure("chunk" if c == self.prefill_chunk else f"chunk{c}", ran.seconds)
        else:  # what building a model step costs here (`_decode_via_prefill` weighs it)
            self._build_seconds = max(self._build_seconds, ran.seconds)
        self._stats["prefill_steps"] += 1
        self._stats["prefill_seconds"] += 0.0 if ran.compiled else ran.seconds
        for j, seq in enumerate(ran.rows):
            seq.fed += int(ran.fed[j])
            self._after_step(seq)
            if seq.fed < len(seq.ids):
                continue
            self._stats["prefill_tokens"] += len(seq.ids) - seq.start
            if not seq.tokens:
                self._stats["prompts"] += 1
                self._stats["ttft_seconds"].append(time.perf_counter() - seq.t_admit)
            self._prefilling.pop(seq.slot)
            self._running[seq.slot] = seq
            self._say(f"prefilled prompt {seq.index} ({len(seq.ids)} tokens) into slot {seq.slot}")
            self._emit(seq, *ran.row(j))
            if seq.done:
                self._close(seq)

    def _run_chunk(
        self, rows: list[_Seq], c: int, chunk: Callable[[_Seq], list[int]], variant: tuple | None = None
    ) -> _Chunk | None:
        """Run the prefill step on `rows` (each row's next tokens: `chunk(seq)`, at most `c`), making
        room or preempting the youngest live request while the pools are short of pages.

        variant: (rows b, read bound, logits kept) of the compiled program to run (`_decode_via_prefill`);
        None: the smallest for these rows (b a power of two, `_read_bound`, logits when a row keeps them).
        Returns a `_Chunk` (the rows that ran, their sampled ids and logprobs, last logits or None,
        tokens fed, seconds, whether it compiled), or None when no row is left to run (preempted, or
        closed with a `CacheCapacityError`).
        """
        while rows:
            if variant is None:
                b, keep = _pow2(len(rows)), any(q.keep_logits for q in rows)
            else:
                b, read, keep = variant
            tokens = np.zeros((b, c), np.int32)
            slots = np.zeros((b,), np.int32)
            n_valid = np.zeros((b,), np.int32)
            for j, seq in enumerate(rows):
                ids = chunk(seq)
                tokens[j, : len(ids)], slots[j], n_valid[j] = ids, seq.slot, len(ids)
            params = SamplingParams.stack(
                [q.sampling for q in rows] + [GREEDY] * (b - len(rows)), [q.seed for q in rows] + [0] * (b - len(rows))
            )
            if variant is None:
                fed = [seq.fed + int(n) for seq, n in zip(rows, n_valid, strict=False)]  # n_valid: b >= rows
                read = self._read_bound(max(fed))
            name = step_name("prefill", f"{b}x{c}", logits=keep, read=read)
            out, dt, fresh = self._timed(
                self._prefill, self._step_weights, tokens, slots, n_valid, params, keep, read, name=name
            )
            status = int(out[2])
            if status == Status.OK:
                self._prefill_variants.add((b, c, read, keep))
                tok, lp = jax.device_get((out[0], out[1]))  # [b] ids and logprobs: all that crosses by default
                return _Chunk(rows, tok, lp, np.asarray(out[3]) if keep else None, n_valid, dt, fresh)
            if status == Status.NO_PAGES and self._make_room():
                continue
            if status != Status.NO_PAGES:
                err = CacheCapacityError(f"prefill step failed: {Status(status).name}")
                for seq in rows:
                    self._close(seq, err)
                return None
            live = self._live()
            if len(live) == 1:  # alone, with every cached prefix evicted: it can never fit
                seq = rows[0]
                self._close(
                    seq,
                    CacheCapacityError(
                        f"prompt {seq.index} ({len(seq.ids)} tokens) does not fit in the cache's pools even alone, "
                        f"with every cached prefix evicted; raise CacheConfig.pool_pages or lower max_context. "
                        f"Pools now: {self._pool_report()}"
                    ),
                )
                return None
            victim = live[-1]
            self._preempt(victim)
            rows = [q for q in rows if q is not victim]
        return None

    def _live_prefilling(self) -> list[_Seq]:
        return sorted(self._prefilling.values(), key=lambda q: q.admitted_at)

    def _decode_step(self) -> None:
        """Up to `decode_steps` tokens for every decoding request, in one on-device loop; one token
        each through the prefill step while the decode step is still building (`_decode_via_prefill`)."""
        rows, args, name = self._decode_inputs()
        if self.decode_while_building and self._decode_via_prefill(rows, args, name):
            return
        out, dt, fresh = self._timed(self._decode, *args, name=name)
        host = unpack_decode(jax.device_get(out[0]), self.decode_steps)
        self._dispatch_ahead(rows, args, host)
        self._decode_outputs(rows, host, out[1], dt, fresh)

    def _finish_ahead(self) -> None:
        """Wait for the decode `_dispatch_ahead` sent and hand its results to its requests (after
        sending the next one when it may)."""
        rows, args, out, t0 = self._ahead
        self._ahead = None
        host = unpack_decode(jax.device_get(out[0]), self.decode_steps)
        dt = time.perf_counter() - t0
        self._dispatch_ahead(rows, args, host)
        # a request cancelled since (its handle, or `generate_text`'s stop string) would not have run
        # this dispatch: its tokens are dropped (`_reap` releases its slot next); one released since
        # gets nothing either (its slot may hold another request now)
        rows = [q for q in rows if not _cancelled(q) and self._running.get(q.slot) is q]
        self._decode_outputs(rows, host, out[1], dt, False)

    def _dispatch_ahead(self, rows: list[_Seq], args: tuple, host: tuple) -> None:
        """Send the next decode before the host hands these results (`host`, of a dispatch made with
        `args`) to their requests, so that bookkeeping (tokens, streams, finished requests'
        releases) runs while the device decodes instead of after it.

        Only when the next step would run nothing but this decode: the same requests, none ending
        here (its slot is released first), nothing waiting to be admitted or prefilled, no
        cancellation, a successful step, no logits kept, no block boundary reached with the prefix
        cache on (its record reads the cache at the boundary), the same stop-id width. Inputs are
        computed as `_decode_inputs` would after `_decode_outputs`, so tokens, logprobs, finish
        reasons and compiled programs are those of one dispatch at a time, and so is the order of
        the cache's transitions unless a request arrives or is cancelled while a dispatch is ahead
        (it is admitted, or released, after that dispatch: other page ids, same tokens)."""
        toks, _, n_new, stopped, status = host
        weights, tokens, slots, params, last_budget, stop_ids, k, keep = args
        if not self._PIPELINE or status != Status.OK or keep or self._queue or self._prefilling:
            return
        with self._inbox_lock:
            if self._inbox:
                return
        if len(rows) != len(self._running):
            return
        bt = self.spec.block_tokens
        tokens, budget = tokens.copy(), np.zeros_like(last_budget)
        for q in rows:
            if self._running.get(q.slot) is not q or _cancelled(q):
                return
            n = int(n_new[q.slot])
            made, fed = len(q.tokens) + n, q.fed + n
            if stopped[q.slot] or n != last_budget[q.slot] or made >= q.max_new:
                return  # ends here: `_decode_outputs` releases its slot before the next decode
            if self.prefix_enabled and fed % bt == 0:
                return  # `_after_step` records this boundary
            budget[q.slot] = self._decode_budget(q, made, fed)
            tokens[q.slot] = toks[q.slot, n - 1]
        if not rows or _stop_width(rows) != stop_ids.shape[1]:
            return
        nxt = (weights, tokens, slots, params, budget, stop_ids, k, keep)
        t0 = time.perf_counter()
        out = self._tx(self._decode, *nxt)
        self._ahead = (rows, nxt, out, t0)
        self._stats["decode_dispatched_ahead"] += 1

    def _decode_via_prefill(self, rows: list[_Seq], args: tuple, name: str) -> bool:
        """While the decode step these rows need is not built (a first decode in a process), advance
        each row by one token through a prefill step this engine has already run, instead of waiting
        for the decode compile. The decode step builds on a background thread (`_build_decode_ahead`)
        once the time spent here so far plus what these rows' remaining tokens would take here
        reaches the longest prefill compile this engine has seen (at once where nothing compiled,
        e.g. a process whose steps come from the caches); until then nothing competes with the
        request for the CPU, and a short first `generate` returns without a decode compile.

        A decoding row is a prefill of one token (its last sampled one) at its position: the same
        cached step, the same sampling key (seed, position), the same stop-id and length checks
        (`_emit`), block recording (`_after_step`) and page handling (`_run_chunk`). Only the
        compiled program differs (one padded `prefill_chunk`-wide row per token instead of
        `decode_steps` tokens per dispatch), as it does between prefill widths. Returns False (the
        caller runs the decode step, waiting for its build) when the decode step is built, or when no
        prefill variant run so far holds these rows (rows, logits, read bound).
        """
        if self._built(self._decode, name, args):
            return False
        keep = any(q.keep_logits for q in rows)
        read_needed = self._read_bound(max(q.fed + 1 for q in rows))
        fits = [
            (b, c, read, k)
            for b, c, read, k in self._prefill_variants
            if (k or not keep) and (read is None or (read_needed is not None and read >= read_needed))
        ]
        if not fits:
            return False
        # build the decode step once decoding through prefill has cost, or is about to cost, what
        # building a step costs (ski rental: never more than twice the better choice in hindsight).
        # A first short generate returns without compiling it; a long one starts it at once.
        left = max(q.max_new - len(q.tokens) for q in rows)
        if self._via_prefill_seconds + left * self._cost.get("via_prefill", 0.0) >= self._build_seconds:
            self._build_decode_ahead(rows)
        b, c, read, k = max(fits, key=lambda v: (v[0], -v[1], v[2] is not None, -(v[2] or 0), not v[3]))
        if not self._stats["decode_via_prefill"]:  # once: a short benchmark would see a slow decode, no reason
            self._say(
                f"decoding one token per step through the prefill step while {name} is not built "
                f"(several times slower per token; it builds once this has cost about a compile; "
                f"Engine.warmup() or decode_while_building=False build it first)"
            )
        t0 = time.perf_counter()
        for i in range(0, len(rows), b):
            group = [q for q in rows[i : i + b] if self._running.get(q.slot) is q and not q.done]
            ran = self._run_chunk(group, c, lambda q: q.tokens[-1:], variant=(b, read, k)) if group else None
            if ran is None:
                continue
            for j, q in enumerate(ran.rows):
                self._emit(q, *ran.row(j))
                q.fed += 1
                self._after_step(q)
                if q.done:
                    self._close(q)
            self._stats["decode_via_prefill"] += 1
        dt = time.perf_counter() - t0
        self._measure("via_prefill", dt)
        self._via_prefill_seconds += dt
        self._stats["decode_steps"] += 1
        self._stats["decode_seconds"] += dt
        return True

    def _decode_budget(self, q: _Seq, made: int, fed: int) -> int:
        """Tokens request `q` may decode in its next dispatch, having generated `made` and holding
        `fed` in its slot: at most `decode_steps`, its `max_new`, and (prefix cache on) up to its
        next block boundary, which is recorded there."""
        room = q.max_new - made
        if self.prefix_enabled:
            bt = self.spec.block_tokens
            room = min(room, bt - fed % bt)
        return min(self.decode_steps, room)

    def _idle_decode_args(self, n_stop: int, keep: bool) -> tuple:
        """Arguments (after layout, cache) of a decode step with every row idle (zero budgets): the
        shapes and types `_decode_inputs` gives for stop width `n_stop` and logits `keep`."""
        s = self.layout.slots
        z = np.zeros((s,), np.int32)
        return (self._step_weights, z, np.arange(s, dtype=np.int32), SamplingParams.stack([GREEDY] * s), z,
                np.full((s, n_stop), -1, np.int32), self.decode_steps, keep)  # fmt: skip

    def _record_args(self, slot: jax.Array) -> tuple:
        """Arguments (after layout, cache) of a record step for `slot` that records nothing: the
        shapes and types `_after_step` gives (`pack_records` pads every batch to RECORD_BATCH rows)."""
        k, bt = RECORD_BATCH, self.spec.block_tokens
        zeros = _device_zeros
        return (slot, zeros((k, 4), np.uint32), jnp.int32(-1), zeros((k, bt), np.int32), zeros((k,), bool),
                zeros((k,), np.int32), zeros((k,), bool))  # fmt: skip

    def _build_ahead(self, rows: list[_Seq]) -> None:
        """Before their prefill, start building the steps these requests run next on background
        threads (`_Step.build_ahead`): once per engine, the prefix cache's record step and the slot
        release, so that they compile while the prefill step compiles and runs (or, in a new
        process, load from the step store while it loads). Each variant is asked for once per
        engine; one already built is not built again. The decode step too when
        `decode_while_building` is off (with it on, `_decode_via_prefill` decides when)."""
        if not self.decode_while_building:
            self._build_decode_ahead(rows)  # first: the longest build (two threads build ahead)
        ahead = {("release",): (self._release, lambda: (jnp.int32(0),))}  # the slot as requests pass it
        if self.prefix_enabled:
            ahead[("record_many",)] = (self._record_many, lambda: self._record_args(jnp.int32(0)))
        self._ask_ahead(ahead)

    def _build_decode_ahead(self, rows: list[_Seq]) -> None:
        """Start building (`_Step.build_ahead`) the decode step these requests need (their stop
        width and logits choice), unless none of them decodes."""
        if not any(q.max_new > 1 for q in rows):
            return
        keep, n_stop = any(q.keep_logits for q in rows), _stop_width(rows)
        self._ask_ahead({("decode", n_stop, keep): (self._decode, lambda: self._idle_decode_args(n_stop, keep))})

    def _ask_ahead(self, ahead: dict) -> None:
        """`build_ahead` each {variant: (step, () -> its arguments after (layout, cache))} not asked
        for before by this engine."""
        for variant in sorted(ahead.keys() - self._asked_ahead):
            fn, args = ahead[variant]
            self._asked_ahead.add(variant)
            build = getattr(fn, "build_ahead", None)
            if build is not None:
                build(self.layout, self.cache, *args())

    def _restore_ahead(self) -> None:
        """At the end of a call that advanced the engine, once it has recorded prefix blocks and
        nothing is left to run: start building the prefix lookup's restore step on a background
        thread (`_Step.build_ahead`, speculative: it starts after a short delay and not at all when
        the process exits first). A first call never needs the step (its prompts start no cached
        chain: `_could_hit`), the next one that shares a prefix does, and compiling it then was
        most of that call in a fresh process. Once per engine; nothing
        when the step is built already. A failure here is left to the call that needs the step
        (which builds it and raises what is wrong): the call that just ended has succeeded."""
        if not (self.prefix_enabled and self._recorded) or ("restore",) in self._asked_ahead or self.pending:
            return
        self._asked_ahead.add(("restore",))
        build = getattr(self._restore, "build_ahead", None)
        if build is None:
            return
        with contextlib.suppress(Exception):  # see the docstring
            build(self.layout, self.cache, jnp.int32(0), *self._lookup_placeholders(), jnp.int32(0), speculative=True)

    def _lookup_placeholders(self) -> tuple[jax.Array, jax.Array]:
        """Zero (keys uint32[NB, 4], tokens int32[NB, block_tokens]) shaped as every `PrefixQuery`'s
        (NB = max_context // block_tokens): the restore step's inputs for a build without a prompt."""
        bt = self.spec.block_tokens
        nb = self.layout.config.max_context // bt
        return _device_zeros((nb, 4), np.uint32), _device_zeros((nb, bt), np.int32)

    def _decode_inputs(self) -> tuple[list[_Seq], tuple, str]:
        """(the decoding requests, the decode step's arguments after (layout, cache), its name)."""
        s, k = self.layout.slots, self.decode_steps
        rows = list(self._running.values())
        tokens = np.zeros((s,), np.int32)
        budget = np.zeros((s,), np.int32)
        sampling, seeds = [GREEDY] * s, [0] * s
        n_stop = _stop_width(rows)
        stop_ids = np.full((s, n_stop), -1, np.int32)
        for q in rows:
            tokens[q.slot], budget[q.slot] = q.tokens[-1], self._decode_budget(q, len(q.tokens), q.fed)
            sampling[q.slot], seeds[q.slot] = q.sampling, q.seed
            stop_ids[q.slot, : len(q.stop_ids)] = q.stop_ids
        keep = any(q.keep_logits for q in rows)
        name = step_name("decode", str(k), stops=n_stop, logits=keep)
        args = (self._step_weights, tokens, np.arange(s, dtype=np.int32), SamplingParams.stack(sampling, seeds), budget,
                stop_ids, k, keep)  # fmt: skip
        return rows, args, name

    def _decode_outputs(self, rows: list[_Seq], host: tuple, lg, dt: float, fresh: bool) -> None:
        """Hand a decode step's results to its requests: `host` = (tokens, logprobs, n_new, stopped,
        status) on the host, `lg` its logits (device; used only when a row keeps them)."""
        toks, lps, n_new, _, status = host
        keep = any(q.keep_logits for q in rows)
        status = int(status)
        produced = int(np.sum(n_new))
        self._stats["decode_dispatches"] += 1
        self._stats["decode_steps"] += int(np.max(n_new)) if produced else 0
        self._stats["decode_seconds"] += 0.0 if fresh else dt
        if keep and produced:
            lg = np.asarray(lg)
        for q in rows:
            n = int(n_new[q.slot])
            if n:  # fed: its last token and the first n - 1 new ones
                self._emit(q, toks[q.slot, :n].tolist(), lps[q.slot, :n].tolist(), lg[q.slot, :n] if keep else None)
                q.fed += n
                self._after_step(q)
            if q.done:
                self._close(q)
        if status == Status.NO_PAGES and not self._make_room() and self._running:
            victim = self._live()[-1]  # the youngest request gives way; it is recomputed later
            self._preempt(victim)
        elif status not in (Status.OK, Status.NO_PAGES):
            raise CacheCapacityError(f"decode step failed: {Status(status).name}")

    def _emit(self, seq: _Seq, tokens: list[int], logprobs: list[float], logits) -> None:
        """Append new tokens (the stop id that ends a request is kept as its last token)."""
        for j, t in enumerate(tokens):
            seq.tokens.append(t)
            seq.logprobs.append(logprobs[j])
            if seq.keep_logits:
                seq.logits.append(np.asarray(logits[j], np.float32))
            if t in seq.stop_ids:
                seq.finish_reason = "stop"
            elif len(seq.tokens) >= seq.max_new:
                seq.finish_reason = "length"
            if seq.finish_reason:
                tokens = tokens[: j + 1]
                break
        self._stats["generated_tokens"] += len(tokens)
        if seq.handle is not None:
            seq.handle._push(tokens)

    def _preempt(self, seq: _Seq) -> None:
        """Release seq's slot and re-queue it first, with the tokens it has (recomputed exactly later)."""
        self._tx(self._release, jnp.int32(seq.slot))
        self._prefilling.pop(seq.slot, None)
        self._running.pop(seq.slot, None)
        seq.slot = -1
        self._queue.appendleft(seq)
        self._stats["preemptions"] += 1
        self._say(f"preempted prompt {seq.index}: pools full")

    def _close(self, seq: _Seq, error: BaseException | None = None) -> None:
        """Finish seq (error None: done) — release its slot, hand its result or error to its handle."""
        if seq.slot >= 0:  # released first: interrupted here, it is still live and `_abort` re-queues it
            self._tx(self._release, jnp.int32(seq.slot))
            self._prefilling.pop(seq.slot, None)
            self._running.pop(seq.slot, None)
            seq.slot = -1
        if error is not None and seq.error is None and not (seq.cancelled and seq.handle is None):
            seq.error = error
        if seq.handle is not None:
            if error is None:
                seq.handle._finish(seq.generation(self.model.vocab_size))
            else:
                seq.handle._finish(None, error)

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
    def _guard(self):
        """Scope of a public call that runs transitions: SIGINT (main thread, default handler) is
        deferred to the next point between two transitions (a second SIGINT interrupts at once); any
        exception or interrupt frees what the call held (`_abort`) before it propagates."""
        deferred = _DeferredInterrupt()
        self._interrupt = deferred
        try:
            with deferred:
                yield
        except BaseException:
            self._interrupt = None
            self._abort()
            raise
        finally:
            self._interrupt = None

    def _cache_alive(self) -> bool:
        return not any(leaf.is_deleted() for leaf in jax.tree.leaves(self.cache))

    def _abort(self) -> None:
        """After an exception inside a call: release every active slot (pages return to the pools,
        cached prefixes stay as they are) and re-queue the requests that held them, first and in
        admission order, to be recomputed exactly by a later step (those of an abandoned `generate`
        call, and cancelled ones, are dropped). If `engine.cache` was lost (an interrupt landed
        between a donating transition and its result, or a transition failed after its input was
        donated), a fresh cache replaces it: cached prefixes on device are dropped (the disk tier
        keeps its blocks), with a `RuntimeWarning`."""
        live = self._live()
        for seq in itertools.chain(self._queue, live):
            if seq.handle is not None and seq.handle.cancelled:
                seq.cancelled = True
        self._prefilling, self._running = {}, {}
        self._ahead = None  # its requests are re-queued below: its results are dropped
        for seq in reversed(live):
            seq.slot = -1
            if seq.cancelled:
                self._close(seq, RequestCancelledError(f"request {seq.index} was cancelled"))
            else:
                self._queue.appendleft(seq)
        for seq in [q for q in self._queue if q.cancelled]:
            self._queue.remove(seq)
            self._close(seq, RequestCancelledError(f"request {seq.index} was cancelled"))
        try:
            if self._cache_alive():
                for slot in np.nonzero(np.asarray(self._view.active))[0]:
                    self._tx(self._release, jnp.int32(slot))
                return
        except Exception:  # a cache that cannot even release a slot is replaced below
            pass
        self._reset_cache()
        self._record_stamps = {}
        warnings.warn(
            "hkv.Engine: the device cache was lost to an interrupted transition and has been "
            "re-initialised; cached prefixes on device were dropped",
            RuntimeWarning,
            stacklevel=3,
        )

    def _pool_report(self) -> str:
        """Per pool: capacity, free pages, pages mapped by running slots, pages held only by cached prefix
        records, and what one sequence of max_context tokens maps at most."""
        c = self._view  # only page bookkeeping crosses to the host, never the pools' rows
        active, state = jax.device_get((c.active, c.prefix.state))
        alive = np.asarray(state) == px.RecordState.ALIVE
        parts = []
        for gi, grp in enumerate(self.layout.groups):
            refc, table, held = (
                np.asarray(a)
                for a in jax.device_get((c.groups[gi].refcount, c.groups[gi].page_table, c.prefix.pages[gi]))
            )
            slot_pages = np.unique(table[np.asarray(active)])
            slot_pages = slot_pages[slot_pages >= 0]
            rec_pages = np.unique(held[alive]) if self.prefix_enabled else np.zeros(0, int)
            rec_only = np.setdiff1d(rec_pages[rec_pages >= 0], slot_pages)
            parts.append(
                f"pool {gi} ({grp.kind.name}, layers {list(grp.layers)}): {refc.shape[0]} pages, "
                f"{int((refc == 0).sum())} free, {len(slot_pages)} mapped by running sequences, "
                f"{len(rec_only)} held only by cached prefix records; one sequence maps up to "
                f"{self.layout.logical_pages(gi)}"
            )
        return "; ".join(parts)

    def _say(self, msg: str) -> None:
        if self.progress is not None:
            self.progress(msg)

    # ------------------------------------------------------------------------- prefix cache
    def _measure(self, what: str, seconds: float) -> None:
        old = self._cost.get(what)
        self._cost[what] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def _restore_costs(self, prompt: int, l0: int, window_at: int | None, disk_at: int) -> dict[str, float]:
        """Estimated seconds to reach the prompt's end from each option: recompute from l0 ("shrink"),
        rebuild the window at `window_at` ("window"), or install [l0, disk_at) from disk ("disk").
        Prefill costs per chunk and disk costs per token are measured as the engine runs; until a disk
        restore has been timed it is assumed 10x cheaper per token than prefill (the case for any
        real model: reading a block moves bytes, recomputing it runs every layer)."""
        c = self.prefill_chunk
        chunk = self._cost["chunk"] or 1.0
        disk_tok = self._cost["disk_token"] if self._cost["disk_token"] is not None else 0.1 * chunk / c

        def compute(n: int) -> float:
            """Full chunks, then the narrowest width holding the rest (measured, else pro rata)."""
            n = max(n, 0)
            full, rest = divmod(n, c)
            if not rest:
                return full * chunk
            w = next(w for w in self.prefill_widths if w >= rest)
            last = self._cost.get(f"chunk{w}") if w < c else chunk
            return full * chunk + (last if last is not None else chunk * w / c)

        out = {"shrink": compute(prompt - l0)}
        if window_at is not None:
            # one step over exactly R tokens (not padded to a chunk), then the chunks after window_at
            out["window"] = self.window_recompute_tokens / c * chunk + compute(prompt - window_at)
        if disk_at > l0:
            out["disk"] = (disk_at - l0) * disk_tok + compute(prompt - disk_at)
        return out

    def _lookup(self, seq: _Seq, ids: list[int]) -> int:
        """Restore the longest verified prefix of `ids` into seq's fresh slot; returns its length."""
        bt = self.spec.block_tokens
        query = PrefixQuery.of(ids, self.layout, self.cache_salt)
        keys, toks, usable = query.keys, query.tokens, query.n_blocks  # usable: leaves >= 1 token to compute
        while True:
            if not self._could_hit(keys, usable):
                vec = DevicePlan.miss(usable)  # what the device lookup would return, without running it
            else:
                (vec,) = self._tx(
                    self._restore, jnp.int32(seq.slot), jnp.asarray(keys), jnp.asarray(toks), jnp.int32(usable)
                )
                vec = vec.host()  # one device-to-host transfer per try
            plan = RestorePlan.from_device(vec, bt, len(ids))
            if plan.status != "NO_PAGES" or not self._make_room():
                break
        abi_ok = plan.tokens_after_stage["abi"]
        r = self.window_recompute_tokens
        window_ok = (
            plan.reason in ("swa_missing", "tail_missing") and 0 < r <= abi_ok and abi_ok - plan.restored_tokens > r
        )
        probe = self._disk_probe(seq, keys, ids, usable, plan.restored_tokens) if self.disk is not None else None
        reach = {"shrink": plan.restored_tokens, "window": abi_ok, "disk": probe["reach"] if probe else 0}
        costs = self._restore_costs(len(ids), plan.restored_tokens, abi_ok if window_ok else None, reach["disk"])
        if self.restore_choice == "longest":
            choice = max(costs, key=lambda k: (reach[k], -costs[k]))
        else:
            choice = min(costs, key=costs.get)
        if probe is not None and (choice == "disk" or "disk" not in costs):
            plan, vec = self._disk_extend(seq, ids, probe, plan, vec)  # also names disk failures
        if choice == "window" or (choice == "disk" and plan.disk_tokens is None and window_ok):
            # Cheaper to rebuild the missing window (R tokens) than to recompute the gap: restart the
            # slot and restore the entries at the longer boundary, then recompute its window.
            padded = np.zeros((self.layout.config.max_context,), np.int32)
            padded[: len(ids)] = ids
            while True:
                self._restart_slot(seq)
                vec, st = self._tx(
                    self._restore_window,
                    self._step_weights,
                    jnp.int32(seq.slot),
                    jnp.asarray(keys),
                    jnp.asarray(toks),
                    jnp.int32(usable),
                    jnp.asarray(padded),
                )
                vec = vec.host()
                no_pages = int(st) == Status.NO_PAGES or vec.status == Status.NO_PAGES
                if not no_pages or not self._make_room():  # pools full: cached objects give way, then retry
                    break
            window_plan = RestorePlan.from_device(vec, bt, len(ids))
            if int(st) == Status.OK and window_plan.status == "OK" and window_plan.restored_tokens:
                plan = dataclasses.replace(
                    window_plan, window_recomputed=(window_plan.restored_tokens - r, window_plan.restored_tokens)
                )
                self._stats["window_recomputes"] += 1
            else:  # could not map the window: start this sequence cold
                self._restart_slot(seq)
                plan = dataclasses.replace(plan, restored_tokens=0, recompute=(0, len(ids)))
                vec = vec.replace(byte_blocks=0)
        self._tx(self._count_plan, jax.tree.map(jnp.int32, vec))  # once per request
        if seq.plan is None:  # a preempted request keeps the plan of its first admission
            seq.plan = plan
        restored = plan.restored_tokens
        on_device = plan.disk_tokens[0] if plan.disk_tokens else restored
        seq.fed = restored
        seq.parent_record = vec.record if on_device else -1
        seq.keys = [key_bytes(k) for k in keys[: on_device // bt]]
        if plan.disk_tokens:
            self._after_step(seq)  # the blocks that came from disk are cached on device again
        self._say(
            f"prompt {seq.index}: hash hit {plan.hash_hit_tokens} tokens, restored {restored}"
            + (f" (stopped at stage {plan.first_failed_stage}: {plan.reason})" if plan.reason else "")
        )
        return restored

    def _could_hit(self, keys: np.ndarray, usable: int) -> bool:
        """Whether the device lookup can find anything for a prompt with block keys `keys` of which
        `usable` may be restored: no when none may, or when no record is a chain root with the first
        block's key (`hkv.core.prefix.could_match`, a small program reading the index's keys). Then
        admission builds the miss plan on the host (`DevicePlan.miss`) instead of running — and, in a
        fresh process, compiling — the whole lookup, so requests that
        share no prefix with anything cached never pay for it."""
        if usable == 0:
            return False
        p = self._view.prefix
        return bool(_could_match(p.key, p.parent, p.state, keys[0]))

    def _restart_slot(self, seq: _Seq) -> None:
        """Release seq's slot (and whatever a restore mapped into it) and claim a fresh one."""
        self._tx(self._release, jnp.int32(seq.slot))
        slot, _ = self._tx(self._claim)
        seq.slot = int(slot)

    def _after_step(self, seq: _Seq) -> None:
        """Record every block boundary the last step crossed; the one at the step's end may keep an
        SWA + TAIL snapshot (retention policy), earlier ones only their COMPRESSED/INDEXER rows."""
        if not self.prefix_enabled:
            return
        bt = self.spec.block_tokens
        ids = seq.prompt + seq.tokens
        final = len(seq.prompt) + seq.max_new - 1  # tokens this request will have written in the end
        # admission control (record slots): record -> prefix clock it was last recorded at; a sequence's
        # own previous use is that of the record its restore ended at, its own standing the length
        # restored. A sequence that restored nothing may displace only never-reused chains.
        stamps = self._record_stamps
        if not seq.admission_set:
            seq.admission_set = True
            r0 = seq.parent_record
            seq.prev_use = stamps.get(r0, -1) if r0 >= 0 else None
            seq.prev_len = int(self._view.prefix.length[r0]) if r0 >= 0 else None
        todo = []  # (block number n, retain) of every boundary this step crossed
        for n in range(len(seq.keys) + 1, seq.fed // bt + 1):
            seq.keys.append(
                block_keys.next_key(seq.keys[-1] if seq.keys else ROOT, ids[(n - 1) * bt : n * bt], self.cache_salt)
            )
            at_end = n * bt == seq.fed
            todo.append(
                (
                    n,
                    at_end
                    and self.retention.retain(
                        n,
                        request_end=(n == final // bt),
                        branch_point=seq.plan is not None
                        and seq.plan.hash_hit_tokens == seq.fed
                        and seq.plan.restored_tokens < seq.fed,
                    ),
                )
            )
        if seq.record_stopped or not todo:
            return
        if todo[-1][1] and not bool(np.any(~np.asarray(self._view.prefix.snap_used))):
            self._make_room(kinds=("snapshot",))
        i = 0
        while i < len(todo):
            # one transition for up to RECORD_BATCH boundaries (padded to RECORD_BATCH rows: one compile)
            batch = todo[i : i + RECORD_BATCH]
            keys, toks, retain, lengths, valid = pack_records(
                [(seq.keys[n - 1], ids[(n - 1) * bt : n * bt], n * bt, ret) for n, ret in batch], bt
            )
            recs, _, done = self._tx(
                self._record_many, jnp.int32(seq.slot), keys, jnp.int32(seq.parent_record), toks, retain, lengths, valid
            )
            recs, done, last_used = jax.device_get((recs, done, self._view.prefix.last_used))
            self._recorded = self._recorded or int(done) > 0
            for r in recs[: int(done)]:
                seq.parent_record = int(r)
                if r >= 0:
                    stamps[int(r)] = int(last_used[r])
            i += int(done)
            # block todo[i] got NO_PAGES (no free record slot) when done < len(batch). Admission control:
            # for a record slot evict only chains last used before this sequence's own previous use,
            # shorter than what it restored, or never reused.
            if int(done) < len(batch) and not self._make_room(
                kinds=("record",),
                used_before=seq.prev_use,
                shorter_than=seq.prev_len,
                never_hit=True,
                need=len(batch) - int(done),
            ):
                seq.record_stopped = True  # keep what it has; no self-eviction, no cascade
                return

    def _make_room(
        self,
        kinds=("snapshot", "record"),
        used_before: int | None = None,
        shorter_than: int | None = None,
        never_hit: bool = False,
        need: int | None = None,
    ) -> bool:
        """Evict the cheapest-to-reconstruct cached objects (see hkv.core.policy); False if nothing was.
        used_before, shorter_than, never_hit: admission control — only objects of chains last used
        before this prefix clock, shorter than this many tokens, or never reused (hkv.core.policy.eviction_order).
        need: whole records wanted (record slots for a batch of boundaries; None: one pass, room of
        any kind). The policy's passes are repeated on the host snapshot, each taking what a pass
        takes (an eighth of the candidates, at least one) and marking its records evicted (a parent
        whose last child went becomes a leaf, a candidate of the next pass), until `need` records
        are chosen; then ONE eviction step runs. The same records go as `need` rounds of
        evict-and-record would evict (the records a sequence adds in between extend its own pinned
        chain, never candidates), without a device round trip per block."""
        if not self.prefix_enabled:
            return False
        fields = ("state", "parent", "length", "last_used", "swa_held", "tail_slot", "hits")
        if self.disk is not None:  # the write-behind below copies blocks from the whole index
            p = jax.device_get(self._view.prefix)
            meta = {k: np.asarray(getattr(p, k)) for k in fields}
        else:  # the policy's columns only (not the token, page and TAIL snapshot arrays)
            index = self._view.prefix
            got = jax.device_get(tuple(getattr(index, k) for k in fields))
            meta = dict(zip(fields, map(np.asarray, got), strict=True))
        live = self._live()
        pinned = {q.parent_record for q in live if q.parent_record >= 0}  # chains being extended

        def candidates(pins) -> list:
            """The policy's order over `meta` (as it stands), of the kinds asked for."""
            order = eviction_order(self.spec, meta, pins, used_before, shorter_than, never_hit)
            return [(k, r) for k, r in order if k in kinds]

        order = candidates(pinned)
        unpinned = False
        if (
            not order
            and pinned
            and len(live) == 1
            and "record" in kinds
            and used_before is None
            and shorter_than is None
            and not never_hit
        ):
            # Idle but for the request being admitted, whose own pinned chain holds the pages it needs
            # (e.g. it re-records blocks it hashed to but could not restore, so its slot shares none of
            # their pages): cached chains give way, pinned or not; it stops caching if its parent goes.
            order = candidates(set())  # (no admission control here: its arguments are all unset)
            unpinned = True
        if not order:
            return False
        nr = meta["state"].shape[0]
        snap, whole = np.zeros(nr, bool), np.zeros(nr, bool)
        chosen, freed = [], 0
        while order:
            batch = order[: max(1, len(order) // 8)]
            for kind, r in batch:
                (snap if kind == "snapshot" else whole)[r] = True
                freed += kind == "record"
            chosen += batch
            if unpinned or need is None or freed >= need:
                break
            # the next pass sees this one's evictions: the records tombstones, their snapshots gone
            # (`meta` is rebound to copies: the arrays read back from the device are read-only)
            gone = snap | whole
            meta = dict(
                meta,
                state=np.where(whole, np.int8(px.RecordState.TOMBSTONE), meta["state"]),
                swa_held=meta["swa_held"] & ~gone,
                tail_slot=np.where(gone, -1, meta["tail_slot"]),
            )
            order = candidates(pinned)
        if self.disk is not None:  # write-behind: host copies now, before the donated eviction step
            self._offload(p, [r for _, r in chosen])
        self._tx(self._evict, jnp.asarray(snap), jnp.asarray(snap), jnp.asarray(whole))
        if unpinned:
            for q in live:
                if q.parent_record >= 0 and whole[q.parent_record]:
                    q.record_stopped = True  # its chain is gone: never extend a record slot reused later
        self._say(f"evicted {int(snap.sum())} snapshots, {int(whole.sum())} records")
        return True

    # ----------------------------------------------------------------------------- disk tier
    def _offload(self, p, records: list[int] | None = None, ahead: bool = True) -> int:
        """Queue one disk segment with the snapshot blocks of `records` (default: every alive record;
        only those holding an SWA + TAIL snapshot end a restorable block) and every block of their
        chains the tier lacks. p: host snapshot of the prefix index. ahead: also start building the
        step that restores them from disk (`_disk_ahead`)."""
        bt = self.spec.block_tokens
        abi = self.spec.fingerprint()
        held = (np.asarray(p.state) == px.RecordState.ALIVE) & np.asarray(p.swa_held) & (np.asarray(p.tail_slot) >= 0)
        records = [int(r) for r in (np.nonzero(held)[0] if records is None else records) if held[r]]
        payloads, seen = [], set()
        lasts = {key_bytes(p.key[r]) for r in records}  # blocks written with their snapshot
        for r in records:
            chain, q = {}, int(r)  # block index -> its record on r's parent chain
            while q >= 0:
                chain[int(p.length[q]) // bt - 1] = q
                q = int(p.parent[q])
            last = int(p.length[r]) // bt - 1
            need = []
            for b in sorted(chain):
                k = key_bytes(p.key[chain[b]])
                stored, with_snap = self.disk.contains(abi, k)
                if b == last:
                    if not with_snap and (k, True) not in self._disk_inflight and (k, True) not in seen:
                        need.append(b)
                elif not stored and k not in lasts and not ({(k, True), (k, False)} & (seen | self._disk_inflight)):
                    need.append(b)
            if need:
                for pl in swap.swap_out(self.layout, self._view, p, int(r), need, chain):
                    seen.add((pl.key, pl.snapshot))
                    payloads.append(pl)
        if not payloads:
            return 0
        marks = {(pl.key, pl.snapshot) for pl in payloads}
        self._disk_inflight |= marks
        fut = self.disk.write_async(abi, payloads)
        self._disk_futures.append((fut, marks))
        self._stats["disk_blocks_offloaded"] += len(payloads)
        self._say(f"disk tier: queued {len(payloads)} blocks")
        if ahead:
            self._disk_ahead(payloads)
        return len(payloads)

    def _disk_ahead(self, payloads: list) -> None:
        """Start building, on a background thread (`_Step.build_ahead`, speculative), the `swap_in`
        bucket that installs the longest chain these blocks end, restored into an empty slot (every
        block from disk: the restore after `evict_prefixes`, or of a conversation whose records all
        left the device), so that a first restore from disk does not compile its install step on
        the request's path (most of a cold disk restore's time was that compile). A
        restore from l0 > 0 may need a smaller bucket, built at first use (`warmup` builds every
        bucket from 0). Once per bucket and engine; nothing when the step is built already; a
        failure is left to the restore that needs the step. It starts at once (a restore often
        follows an eviction at once), but not once the interpreter exits."""
        longest = max((pl.length for pl in payloads if pl.snapshot), default=0)
        build = getattr(self._swap_in, "build_ahead", None)
        if not longest or build is None:
            return
        variant = ("swap_in", swap.swap_in_shapes(self.layout, 0, longest)[0])  # the bucket: its rows' shapes
        if variant in self._asked_ahead:
            return
        self._asked_ahead.add(variant)
        with contextlib.suppress(Exception):  # see the docstring
            rows, tails = swap.swap_in_zero_inputs(self.layout, 0, longest)
            build(
                self.layout,
                self.cache,
                jnp.int32(0),
                jnp.int32(0),
                jnp.int32(0),
                rows,
                tails,
                speculative=True,
                delay=0.0,
            )  # no delay: a restore from disk often follows the eviction at once (`make demo`'s third turn)

    def _poll_disk(self) -> None:
        """Mark the blocks of completed disk writes `on_disk` in the prefix index (only once their
        manifest is published); a failed write is reported and its blocks stay device-only."""
        if not self._disk_futures:
            return
        done = [(f, m) for f, m in self._disk_futures if f.done()]
        if not done:
            return
        self._disk_futures = [(f, m) for f, m in self._disk_futures if not f.done()]
        keys = []
        for fut, marks in done:
            self._disk_inflight -= marks
            if fut.exception() is not None:
                self._say(f"disk tier write failed, its blocks are not on disk: {fut.exception()}")
                continue
            keys += fut.result()
        if keys:
            k = swap.bucket(len(keys))
            arr = np.zeros((k, 4), np.uint32)
            arr[: len(keys)] = [key_words(x) for x in keys]
            self._tx(self._mark_on_disk, jnp.asarray(arr), jax.device_put(np.arange(k) < len(keys)))

    def _disk_probe(self, seq: _Seq, keys: np.ndarray, ids: list[int], usable: int, l0: int) -> dict:
        """What the disk tier's index holds past the device-restored prefix [0, l0) (no data read):
        the stored chain from block l0 / block_tokens, and `reach`, the longest boundary with a stored
        snapshot. A store that fails to answer is an empty chain with `error` set."""
        bt = self.spec.block_tokens
        kb = [key_bytes(k) for k in keys[:usable]]
        toks = [ids[i * bt : (i + 1) * bt] for i in range(usable)]
        try:
            chain = self.disk.find_chain(self.spec.fingerprint(), kb, toks, start=l0 // bt)
        except Exception as e:  # a store that fails to answer is a miss, never a crash
            self._disk_unavailable(seq, e)
            return {"kb": kb, "refs": [], "stop": None, "snaps": [], "reach": l0, "error": True}
        snaps = [j for j, r in enumerate(chain.refs) if r.snapshot]
        return {
            "kb": kb,
            "refs": chain.refs,
            "stop": chain.stop,
            "snaps": snaps,
            "error": False,
            "reach": l0 + (snaps[-1] + 1) * bt if snaps else l0,
        }

    def _disk_unavailable(self, seq: _Seq, e: Exception) -> None:
        self._say(f"prompt {seq.index}: disk tier unavailable ({type(e).__name__}: {e}); computing instead")

    def _disk_extend(
        self, seq: _Seq, ids: list[int], probe: dict, plan: RestorePlan, vec: np.ndarray
    ) -> tuple[RestorePlan, np.ndarray]:
        """Extend the device-restored prefix [0, L0) with verified blocks from the disk tier, up to
        the longest boundary where a stored snapshot lies and every block before it passes stages 2
        and 4; install them with one `swap_in` transition. A bad or missing block shortens the plan
        and names the reason; nothing unverified is installed."""
        bt = self.spec.block_tokens
        l0 = plan.restored_tokens
        i0 = l0 // bt
        kb, refs, stop, snaps = probe["kb"], probe["refs"], probe["stop"], probe["snaps"]
        usable = len(kb)
        t0 = time.perf_counter()
        built = builds_on_this_thread()  # a read timed with a compilation is not measured
        try:
            reason, payloads = ("disk_missing", []) if probe["error"] else self._disk_read(refs, snaps)
        except Exception as e:  # a store that fails to answer is a miss, never a crash
            self._disk_unavailable(seq, e)
            reason, payloads = "disk_missing", []
        l1 = l0 + len(payloads) * bt
        if payloads:
            rows, tails = swap.swap_in_inputs(self.layout, payloads, l0)
            self._names.add(step_name("swap_in", swap.swap_in_size(rows)))
            args = (jnp.int32(seq.slot), jnp.int32(l0), jnp.int32(l1), rows, tails)
            waited = self._building_ahead(self._swap_in, args)  # the call waits for its build ahead
            while True:
                (st,) = self._tx(self._swap_in, *args)
                if int(st) != Status.NO_PAGES or not self._make_room():
                    break
            if int(st) != Status.OK:
                self._say(f"prompt {seq.index}: disk blocks verified but not installed ({Status(int(st)).name})")
                l1 = l0
            elif builds_on_this_thread() == built and not waited:  # (builds on other threads do not count)
                self._measure("disk_token", (time.perf_counter() - t0) / (l1 - l0))
        found = (i0 + len(refs)) * bt
        if reason is None and stop == "disk_abi":
            reason = "disk_abi"
        if reason is None and stop == "absent" and i0 + len(refs) < usable:
            # a tombstone that says its block went to disk, but the tier has no such block
            rec_keys, on_disk = jax.device_get((self._view.prefix.key, self._view.prefix.on_disk))
            want = key_words(kb[i0 + len(refs)])
            if np.any(np.all(np.asarray(rec_keys) == want, axis=1) & np.asarray(on_disk)):
                reason = "disk_missing"
        hash_hit = max(plan.hash_hit_tokens, found)
        if l1 == l0 and reason is None:
            return plan, vec
        after = dict(plan.tokens_after_stage)
        disk_stage = {
            "lifecycle": found,
            "abi": found,
            "intersection": (i0 + snaps[-1] + 1) * bt if snaps else l0,
            "byte": l1,
        }
        after = {k: max(v, disk_stage[k]) for k, v in after.items()}
        if l1 >= hash_hit:
            stage, why = None, None
        elif reason is not None:
            why = reason
            why = Reason(why)
            stage = why.stage
        else:
            stage, why = plan.first_failed_stage, plan.reason
        vec = vec.replace(
            hash_blocks=hash_hit // bt,
            byte_blocks=l1 // bt,
            disk_blocks=(l1 - l0) // bt,
            reason=Reason(why).code if why else 0,
            first_failed_stage=STAGES.index(stage) if stage else -1,
        )
        if l1 > l0:
            self._stats["disk_restores"] += 1
            self._stats["disk_restored_tokens"] += l1 - l0
        plan = dataclasses.replace(
            plan,
            hash_hit_tokens=hash_hit,
            tokens_after_stage=after,
            restored_tokens=l1,
            first_failed_stage=stage,
            reason=why,
            recompute=(l1, len(ids)),
            disk_tokens=(l0, l1) if l1 > l0 else None,
        )
        return plan, vec

    def _disk_read(self, refs: list, snaps: list[int]) -> tuple[str | None, list]:
        """(why verification stopped, the verified payloads up to the last usable snapshot)."""
        if not snaps:
            return None, []
        res = self.disk.read(
            refs[: snaps[-1] + 1], expect=lambda e: swap.expected_objects(self.layout, e["length"], e["snapshot"])
        )
        got, reason = res.payloads, res.reason
        if swap.has_indexer(self.layout):
            iver = int(self._view.indexer_version)
            for j, pl in enumerate(got):
                if pl.indexer_version != iver:  # written under older indexer weights
                    got, reason = got[:j], reason or "indexer_version"
                    break
        ok = [j for j in snaps if j < len(got)]
        return reason, got[: ok[-1] + 1] if ok else []

    def prefix_stats(self) -> dict[str, Any]:
        """Hash-hit vs complete-restoration tokens, rejections per stage and reason, occupancy, evictions."""
        c = {k: int(v) for k, v in jax.device_get(self._view.counters).items()}
        p = jax.device_get(self._view.prefix)
        state = np.asarray(p.state)
        rejections: dict[str, dict[str, int]] = {}
        for reason in Reason:
            n = c[f"prefix_rejected_{reason}"]
            if n and reason != Reason.NO_HASH_MATCH:  # no_hash_match is a miss, not a rejection
                rejections.setdefault(reason.stage, {})[str(reason)] = n
        held = {}
        for gi, grp in enumerate(self.layout.groups):
            rows = np.asarray(p.pages[gi])[state == px.RecordState.ALIVE]
            held[grp.kind.name] = held.get(grp.kind.name, 0) + len(np.unique(rows[rows >= 0]))
        hh, rt = c["prefix_hash_hit_tokens"], c["prefix_restored_tokens"]
        return {
            "lookups": c["prefix_lookups"],
            "hash_hit_tokens": hh,
            "restored_tokens": rt,
            "disk_restored_tokens": c["prefix_disk_restored_tokens"],
            "lookups_ending_in_hash_miss": c["prefix_rejected_no_hash_match"],
            "complete_restoration_ratio": rt / hh if hh else None,
            "rejections": rejections,
            "occupancy": {
                "records": int((state == px.RecordState.ALIVE).sum()),
                "tombstones": int((state == px.RecordState.TOMBSTONE).sum()),
                "record_capacity": int(state.shape[0]),
                "snapshots": int(np.asarray(p.snap_used).sum()),
                "snapshot_capacity": int(np.asarray(p.snap_used).shape[0]),
                "records_on_disk": int(np.asarray(p.on_disk)[state != px.RecordState.EMPTY].sum()),
                "pages_held_by_records": held,
            },
            "evictions": {
                "swa_snapshots": c["evicted_swa_snapshots"],
                "tail_snapshots": c["evicted_tail_snapshots"],
                "records": c["evicted_records"],
            },
        }

    def metrics_text(self) -> str:
        """Prometheus text exposition of the cache and prefix metrics."""
        c = {k: int(v) for k, v in jax.device_get(self._view.counters).items()}
        ps = self.prefix_stats()
        lines = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
                lines.append(f"{name}{lab} {value}")

        metric("hkv_prefix_lookups_total", "counter", "Prefix lookups.", [({}, ps["lookups"])])
        metric(
            "hkv_prefix_hash_hit_tokens_total",
            "counter",
            "Tokens matched by the chained block hash.",
            [({}, ps["hash_hit_tokens"])],
        )
        metric(
            "hkv_prefix_restored_tokens_total",
            "counter",
            "Tokens restored after all four validation stages.",
            [({}, ps["restored_tokens"])],
        )
        metric(
            "hkv_prefix_disk_restored_tokens_total",
            "counter",
            "Tokens installed from the disk tier after verification.",
            [({}, ps["disk_restored_tokens"])],
        )
        metric(
            "hkv_prefix_rejections_total",
            "counter",
            "Plans shrunk, by validation stage and reason.",
            [({"stage": st, "reason": r}, n) for st, rs in ps["rejections"].items() for r, n in rs.items()],
        )
        metric(
            "hkv_prefix_records",
            "gauge",
            "Cached block records by state.",
            [({"state": "alive"}, ps["occupancy"]["records"]), ({"state": "tombstone"}, ps["occupancy"]["tombstones"])],
        )
        metric("hkv_prefix_snapshots", "gauge", "SWA+TAIL snapshots held.", [({}, ps["occupancy"]["snapshots"])])
        metric(
            "hkv_evictions_total",
            "counter",
            "Evictions by object kind.",
            [({"kind": k}, v) for k, v in ps["evictions"].items()],
        )
        used = {}
        for gi, grp in enumerate(self.layout.groups):
            rc = np.asarray(jax.device_get(self._view.groups[gi].refcount))
            used.setdefault(grp.kind.name, [0, 0])
            used[grp.kind.name][0] += int((rc > 0).sum())
            used[grp.kind.name][1] += int(rc.shape[0])
        metric(
            "hkv_pages",
            "gauge",
            "Pool pages by object kind and state.",
            [({"kind": k, "state": "used"}, u) for k, (u, _) in used.items()]
            + [({"kind": k, "state": "capacity"}, t) for k, (_, t) in used.items()],
        )
        metric("hkv_transitions_total", "counter", "Cache transitions.", [({}, c["transitions"])])
        metric(
            "hkv_failed_transitions_total",
            "counter",
            "Transitions that returned the cache unchanged.",
            [({"reason": r}, c[f"failed_{r}"]) for r in ("no_pages", "slot_cap", "context_cap")],
        )
        if self.disk is not None:
            d = self.disk.counters
            metric(
                "hkv_disk_bytes_total",
                "counter",
                "Disk tier bytes by direction.",
                [
                    ({"op": "written"}, d["bytes_written"]),
                    ({"op": "read"}, d["bytes_read"]),
                    ({"op": "evicted"}, d["bytes_evicted"]),
                ],
            )
            metric(
                "hkv_disk_blocks_total",
                "counter",
                "Disk tier blocks by operation.",
                [({"op": "written"}, d["blocks_written"]), ({"op": "read"}, d["blocks_read"])],
            )
            metric(
                "hkv_disk_write_failures_total",
                "counter",
                "Disk tier writes that published nothing.",
                [({}, d["write_failures"])],
            )
            metric(
                "hkv_disk_writes_dropped_total",
                "counter",
                "Disk tier writes refused because the writer's queue was full (max_queued_bytes).",
                [({}, d["writes_dropped"])],
            )
            metric("hkv_disk_stored_bytes", "gauge", "Bytes the disk tier holds.", [({}, self.disk.stored_bytes())])
        return "\n".join(lines) + "\n"
