"""`Engine`: batched generation over the hybrid cache — chunked prefill, jitted batched decode.

The engine owns one `HybridCache` value and replaces it with the result of each jitted transition
(the cache argument is donated). The model is any object with
    cfg.vocab_size, check_tokens(int[B, T]), cache_spec(dtype=..., block_tokens=..., model_id=...),
    cached_step(layout, cache, tokens int32[B, C], slots int32[B], n_valid int32[B])
        -> (cache, float32[B, C, vocab] logits, status)
and an `nnx.Module` (its weights are passed to the jitted step as data, not baked in as constants).

Scheduling: prompts are admitted into free slots; each is prefilled in chunks of `prefill_chunk`
tokens (one compilation, the last chunk padded); all decoding slots then advance together in one
decode step of static batch `slots` (one compilation for every length). If the pools run out of
pages (`Status.NO_PAGES`, cache unchanged), the most recently admitted sequence is preempted: its
slot is released and it is re-queued with the tokens it has generated, to be recomputed later —
greedy decoding is deterministic, so its output does not change.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import transitions as tr
from .memory import architectural_minimum, memory_report
from .state import CacheConfig, CacheLayout, Status, init_cache


class CacheCapacityError(RuntimeError):
    """A request cannot fit in the cache even with every other sequence preempted."""


@dataclasses.dataclass
class Generation:
    """One prompt's result: `tokens` the new ids, `logits` float32[len(tokens), vocab] that chose them."""

    tokens: list[int]
    logits: np.ndarray
    plan: Any = None


@dataclasses.dataclass
class _Seq:
    index: int
    prompt: list[int]
    max_new: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    slot: int = -1
    admitted_at: int = 0

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new


class Engine:
    """Generation with the hybrid cache.

    model: see the module docstring (e.g. `models.deepseek_v4.DeepseekV4`).
    config: static cache capacities. block_tokens: state-table / prefix block size.
    prefill_chunk: tokens per prefill step. model_id: weights identity for the ABI fingerprint.
    kernel_options: keyword arguments for the model's cached step, e.g. {"kernel_backend": "gpu",
    "interpret": True} to run the Pallas decode kernels in the interpreter on CPU.
    """

    def __init__(self, model, config: CacheConfig, *, block_tokens: int = 16, prefill_chunk: int = 32,
                 model_id: str = "unknown", progress: Callable[[str], None] | None = None,
                 kernel_options: dict | None = None):
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"{prefill_chunk=} must be a positive integer")
        self.model = model
        self.spec = model.cache_spec(block_tokens=block_tokens, model_id=model_id)
        self.layout = CacheLayout(self.spec, config)
        self.cache = init_cache(self.layout)
        self.prefill_chunk = prefill_chunk
        self.progress = progress
        self._graphdef, self._weights = nnx.split(model)
        self.compilations = {"prefill": 0, "decode": 0}
        self._stats = {"prompts": 0, "prefill_tokens": 0, "prefill_steps": 0, "decode_steps": 0,
                       "generated_tokens": 0, "preemptions": 0, "prefill_seconds": 0.0, "decode_seconds": 0.0}
        graphdef = self._graphdef
        kernels = dict(kernel_options or {})

        def make_step(kind: str):
            def step(layout, cache, weights, tokens, slots, n_valid):
                self.compilations[kind] += 1  # runs at trace time only: counts compilations
                return nnx.merge(graphdef, weights).cached_step(layout, cache, tokens, slots, n_valid, **kernels)

            return jax.jit(step, static_argnums=0, donate_argnums=1)

        self._prefill = make_step("prefill")
        self._decode = make_step("decode")
        self._claim = jax.jit(tr.claim_slot, static_argnums=0, donate_argnums=1)
        self._release = jax.jit(tr.release_slot, static_argnums=0, donate_argnums=1)

    # ---------------------------------------------------------------------------------- api
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[Generation]:
        """Greedy continuation of each prompt (lengths may differ). Inputs are validated before
        anything runs: an invalid request raises `ValueError` and leaves the cache untouched."""
        self._validate(prompts, max_new_tokens)
        queue = deque(_Seq(i, list(map(int, p)), max_new_tokens) for i, p in enumerate(prompts))
        done: dict[int, _Seq] = {}
        running: dict[int, _Seq] = {}
        clock = 0
        while queue or running:
            # admit while slots are free
            while queue and len(running) < self.layout.slots:
                seq = queue.popleft()
                if seq.done:
                    done[seq.index] = seq
                    continue
                clock += 1
                if not self._admit(seq, clock):
                    queue.appendleft(seq)
                    if not running:
                        raise CacheCapacityError(
                            f"prompt {seq.index} ({len(seq.prompt) + len(seq.tokens)} tokens) does not fit in the "
                            f"cache's pools even alone; raise CacheConfig.pool_pages or lower max_context")
                    break
                running[seq.slot] = seq
                if seq.done:
                    self._finish(seq, running, done)
            if running:
                self._decode_all(running, queue, done)
        return [Generation(tokens=d.tokens, logits=np.stack(d.logits) if d.logits
                           else np.zeros((0, self.model.cfg.vocab_size), np.float32)) for d in
                [done[i] for i in range(len(prompts))]]

    def stats(self) -> dict[str, Any]:
        """Engine counters and the cache's transition counters (a host snapshot)."""
        counters = {k: int(v) for k, v in jax.device_get(self.cache.counters).items()}
        return {**self._stats, "compilations": dict(self.compilations), "cache": counters,
                "active_slots": int(np.asarray(self.cache.active).sum()),
                "abi_fingerprint": self.spec.fingerprint()}

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes allocated and live per object kind; see `hkv.memory.memory_report`."""
        return memory_report(self.layout, self.cache)

    def architectural_minimum(self, context: int) -> dict[str, int]:
        return architectural_minimum(self.spec, context)

    # ------------------------------------------------------------------------------ internals
    def _validate(self, prompts, max_new_tokens) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"{max_new_tokens=} must be an integer >= 0")
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        cap = self.layout.config.max_context
        vocab = self.model.cfg.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs >= 1 token")
            if len(p) + max_new_tokens > cap:
                raise ValueError(f"prompt {i}: {len(p)} tokens + max_new_tokens={max_new_tokens} = "
                                 f"{len(p) + max_new_tokens} exceeds max_context={cap}")
            arr = np.asarray(p)
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"prompt {i} must be a flat list of integer token ids")
            if arr.min() < 0 or arr.max() >= vocab:
                raise ValueError(f"prompt {i}: token ids range [{arr.min()}, {arr.max()}] must lie in "
                                 f"[0, vocab_size={vocab})")

    def _say(self, msg: str) -> None:
        if self.progress is not None:
            self.progress(msg)

    def _admit(self, seq: _Seq, clock: int) -> bool:
        """Claim a slot and prefill prompt (+ tokens generated before a preemption). False if the
        pools cannot hold it now (slot released again, cache as before)."""
        self.cache, slot, status = self._claim(self.layout, self.cache)
        if int(status) != Status.OK:
            return False
        slot = int(slot)
        ids = seq.prompt + seq.tokens
        c = self.prefill_chunk
        t0 = time.perf_counter()
        last = None
        for start in range(0, len(ids), c):
            chunk = ids[start:start + c]
            buf = np.zeros((1, c), np.int32)
            buf[0, :len(chunk)] = chunk
            self.cache, logits, status = self._prefill(self.layout, self.cache, self._weights, jnp.asarray(buf),
                                                       jnp.array([slot], jnp.int32),
                                                       jnp.array([len(chunk)], jnp.int32))
            st = int(status)
            if st != Status.OK:
                self.cache, _ = self._release(self.layout, self.cache, jnp.int32(slot))
                if st == Status.NO_PAGES:
                    return False
                raise CacheCapacityError(f"prefill of prompt {seq.index} failed: {Status(st).name}")
            last = np.asarray(logits[0, len(chunk) - 1])
            self._stats["prefill_steps"] += 1
        self._stats["prefill_tokens"] += len(ids)
        self._stats["prompts"] += 0 if seq.tokens else 1
        self._stats["prefill_seconds"] += time.perf_counter() - t0
        seq.slot, seq.admitted_at = slot, clock
        self._emit(seq, last)
        self._say(f"prefilled prompt {seq.index} ({len(ids)} tokens) into slot {slot}")
        return True

    def _emit(self, seq: _Seq, logits: np.ndarray) -> None:
        seq.logits.append(logits.astype(np.float32))
        seq.tokens.append(int(np.argmax(logits)))
        self._stats["generated_tokens"] += 1

    def _finish(self, seq: _Seq, running: dict, done: dict) -> None:
        self.cache, _ = self._release(self.layout, self.cache, jnp.int32(seq.slot))
        running.pop(seq.slot)
        done[seq.index] = seq

    def _decode_all(self, running: dict, queue: deque, done: dict) -> None:
        s = self.layout.slots
        tokens = np.zeros((s, 1), np.int32)
        n_valid = np.zeros((s,), np.int32)
        for slot, seq in running.items():
            tokens[slot, 0] = seq.tokens[-1]
            n_valid[slot] = 1
        t0 = time.perf_counter()
        self.cache, logits, status = self._decode(self.layout, self.cache, self._weights, jnp.asarray(tokens),
                                                  jnp.arange(s, dtype=jnp.int32), jnp.asarray(n_valid))
        st = int(status)
        if st == Status.NO_PAGES:  # preempt the youngest sequence; it is recomputed later
            victim = max(running.values(), key=lambda q: q.admitted_at)
            self.cache, _ = self._release(self.layout, self.cache, jnp.int32(victim.slot))
            running.pop(victim.slot)
            victim.slot = -1
            queue.appendleft(victim)
            self._stats["preemptions"] += 1
            self._say(f"preempted prompt {victim.index}: pools full")
            return
        if st != Status.OK:
            raise CacheCapacityError(f"decode step failed: {Status(st).name}")
        logits = np.asarray(logits[:, 0])
        self._stats["decode_steps"] += 1
        self._stats["decode_seconds"] += time.perf_counter() - t0
        for slot, seq in list(running.items()):
            self._emit(seq, logits[slot])
            if seq.done:
                self._finish(seq, running, done)
