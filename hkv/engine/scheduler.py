"""`Scheduler`: the requests of one cache (or of one data shard of a mesh) and the steps that
advance them — admission with prefix restore, batched prefill chunks, decode dispatches (one sent
ahead while the host hands the last one's tokens over), decoding through the prefill step while the
decode step builds, preemption when the pools run short.

The `Engine` owns the cache, the public API and exception safety; it calls `step()` (or, on a mesh,
`admit_and_prefill()` per shard, one decode for every shard from `decode_inputs()`, then
`decode_outputs()` per shard). Every device change is a transition run through the engine's hook
(`EngineHooks.tx`), which installs its result at once. Prefix lookup, recording and eviction are
the prefix manager's (`hkv.engine.prefix_manager`); which compiled program runs and what is built
ahead are the compile plan's (`hkv.engine.compile_plan`).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..core import prefix as px
from ..core.layout import CacheLayout, Status
from ..core.sampling import GREEDY, RowHistory, SamplingBatch
from .compile_plan import CompilePlan, EngineSteps, pow2, stop_width
from .compiled import decode_size, per_slot, step_name, unpack_decode
from .hooks import EngineHooks
from .options import EngineOptions
from .page_budget import fits, free_pages, pages_wanted
from .prefix_manager import PrefixManager
from .progress import Bars
from .requests import LiveRequest, RequestCancelledError

__all__ = ["CacheCapacityError", "Chunk", "Scheduler", "SchedulerStats", "cancelled"]


class CacheCapacityError(RuntimeError):
    """A request cannot fit in the cache's pools even with nothing else running and every cached
    prefix evicted. The message lists each pool's capacity and what holds its pages."""


def cancelled(seq: LiveRequest) -> bool:
    """Whether a request was cancelled: by its handle (`RequestHandle.cancel`, an abandoned stream) or
    on the request itself (`generate_text`'s stop strings, an abandoned call), before `_reap` sees it."""
    return seq.cancelled or (seq.handle is not None and seq.handle.cancelled)


class Chunk(NamedTuple):
    """What one prefill step returned for the rows it ran (`Scheduler._run_chunk`).

    Attributes:
      rows: the requests that ran, in row order (fewer than asked when some were preempted).
      ids: int32[b] the token sampled for each row.
      logprobs: float32[b] its log-probability.
      logits: float32[b, vocab] each row's last logits, or None when no row keeps them.
      tops: (ids int32[b, N], logprobs float32[b, N]) each row's top-N, or None when no row asks.
      fed: int32[b] tokens fed per row.
      seconds: the step's wall time.
      compiled: whether the call built (traced and compiled, or loaded) its program.
    """

    rows: list
    ids: np.ndarray
    logprobs: np.ndarray
    logits: np.ndarray | None
    tops: tuple | None
    fed: np.ndarray
    seconds: float
    compiled: bool

    def row(self, j: int) -> tuple:
        """Row `j`'s token, logprob, last logits [1, vocab] (or None) and top-N ([1, N] ids and
        logprobs, or None), as `LiveRequest.emit` takes them."""
        tops = None if self.tops is None else (self.tops[0][j : j + 1], self.tops[1][j : j + 1])
        return ([int(self.ids[j])], [float(self.logprobs[j])],
                None if self.logits is None else self.logits[j : j + 1], tops)  # fmt: skip


@dataclasses.dataclass
class SchedulerStats:
    """Request and step counters (`Engine.stats()` shows them).

    Attributes:
      prompts: prompts prefilled; prefill_tokens: tokens prefilled; prefill_steps: prefill steps run.
      decode_steps: decode loop iterations (tokens per row) run; decode_dispatches: decode dispatches;
      decode_dispatched_ahead: those sent before the last one's tokens were handed over;
      decode_via_prefill: tokens decoded through the prefill step while the decode step built.
      generated_tokens: tokens handed to requests; preemptions: requests preempted (pools full).
      prefill_seconds, decode_seconds: time in steps that did not compile.
      ttft_seconds: each prompt's time from admission to its first token.
    """

    prompts: int = 0
    prefill_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    decode_dispatches: int = 0
    decode_dispatched_ahead: int = 0
    decode_via_prefill: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    ttft_seconds: list[float] = dataclasses.field(default_factory=list)


class Scheduler:
    """The requests of one cache and the steps that advance them (see the module docstring).

    Args:
      layout, spec: the cache layout and spec. opts: the engine's checked options.
      steps: the engine's compiled steps. prefix: its prefix manager. plan: its compile plan.
      hooks: what it uses of the engine (`EngineHooks`).

    Attributes:
      queue: requests waiting for a slot, oldest first. prefilling / running: slot -> request still
        running its prompt / decoding. inbox: requests submitted from any thread (`inbox_lock`),
        queued at the next step. stats: `SchedulerStats`. pipeline: send a decode before the host
        has handed the previous one's tokens over when nothing else can run in between (False:
        strictly one dispatch at a time; same results).
    """

    def __init__(
        self,
        layout: CacheLayout,
        spec,
        opts: EngineOptions,
        steps: EngineSteps,
        prefix: PrefixManager,
        plan: CompilePlan,
        hooks: EngineHooks,
    ):
        self.layout, self.spec, self.opts, self.steps = layout, spec, opts, steps
        self.prefix, self.plan, self.hooks = prefix, plan, hooks
        self.vocab_size = hooks.vocab_size
        self.stats = SchedulerStats()
        self.pipeline = True
        # touched only by the driving thread, except `inbox`, guarded by `inbox_lock`
        self.queue: deque[LiveRequest] = deque()
        self.prefilling: dict[int, LiveRequest] = {}
        self.running: dict[int, LiveRequest] = {}
        self.inbox: list[LiveRequest] = []
        self.inbox_lock = threading.Lock()
        # a decode dispatched ahead (`_dispatch_ahead`), its results not yet handed to its requests
        self.ahead: tuple | None = None
        self.clock = 0  # admissions so far (orders `live`)

    def run(self, seqs: list[LiveRequest], after_step: Callable[[], None] | None, bars: Bars) -> None:
        """Step until every one of `seqs` is over (a progress bar from `bars` over their tokens when
        long), calling `after_step` after each step; the first request error is raised; an exception
        abandons them all (the engine's `_abort` frees their slots)."""
        total = sum(len(s.prompt) + s.max_new for s in seqs)
        bar = bars.tokens(total, f"hkv: {len(seqs)} request(s)")
        shown = 0
        try:
            while not all(s.over for s in seqs):
                self.step()
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
            self.reap()
        except BaseException:
            for s in seqs:
                s.cancelled = True  # the call is abandoned: `_abort` drops them, frees their slots
            raise
        finally:
            if bar is not None:
                bar.close()

    def pending(self) -> int:
        """Requests submitted or queued and not yet finished."""
        with self.inbox_lock:
            inbox = len(self.inbox)
        return inbox + len(self.queue) + len(self.prefilling) + len(self.running)

    def submit(self, seq: LiveRequest) -> None:
        """Queue `seq` at the next step (any thread)."""
        with self.inbox_lock:
            self.inbox.append(seq)

    def take_inbox(self) -> None:
        """Move the requests submitted since the last step to the queue."""
        with self.inbox_lock:
            self.queue.extend(self.inbox)
            self.inbox.clear()

    def busy(self) -> bool:
        """Whether requests remain queued, prefilling or decoding."""
        return bool(self.queue or self.prefilling or self.running)

    def requeue_live(self) -> list[LiveRequest]:
        """After an exception inside a call: forget every slot's request and re-queue them first, in
        admission order (cancelled ones are closed with `RequestCancelledError`); a decode sent
        ahead is dropped (its requests are re-queued). Returns the requests that held slots. The
        engine releases the slots (or replaces a lost cache) itself."""
        live = self._mark_cancelled()
        self.prefilling, self.running = {}, {}
        self.ahead = None
        for seq in reversed(live):
            seq.slot = -1
            if seq.cancelled:
                self._close_cancelled(seq)
            else:
                self.queue.appendleft(seq)
        self._drop_cancelled_queued()
        return live

    def _mark_cancelled(self) -> list[LiveRequest]:
        """Mark the requests whose handle was cancelled (queued or live); returns the live ones."""
        live = self.live()
        for seq in itertools.chain(self.queue, live):
            if seq.handle is not None and seq.handle.cancelled:
                seq.cancelled = True
        return live

    def _close_cancelled(self, seq: LiveRequest) -> None:
        self.close(seq, RequestCancelledError(f"request {seq.index} was cancelled"))

    def _drop_cancelled_queued(self) -> None:
        """Take the cancelled requests out of the queue and close them."""
        for seq in [q for q in self.queue if q.cancelled]:
            self.queue.remove(seq)
            self._close_cancelled(seq)

    def live(self) -> list[LiveRequest]:
        """Requests holding a slot (prefilling or decoding), oldest admission first."""
        return sorted([*self.prefilling.values(), *self.running.values()], key=lambda q: q.admitted_at)

    def step(self) -> bool:
        """Poll the disk tier, queue what was submitted, admit and prefill, decode (or hand over the
        decode sent ahead), drop cancelled requests. Returns whether requests remain."""
        self.prefix.poll_disk()
        self.take_inbox()
        if self.ahead is not None:
            # the running requests' decode of this step is already on its way: hand its results
            # over (dispatching the next one first when nothing else waits), then admit and
            # prefill what arrived meanwhile; no second decode in this step
            self._finish_ahead()
            self.admit_and_prefill()
        else:
            self.admit_and_prefill()
            if self.running:
                self._decode_step()
        self.reap()
        return self.busy()

    def admit_and_prefill(self) -> None:
        """The part of a step before decoding: drop cancelled requests, admit waiting ones, one
        prefill chunk."""
        self.reap()
        self._admit_waiting()
        if self.prefilling:
            self._prefill_step()

    def reap(self) -> None:
        """Drop cancelled requests: queued ones leave the queue, live ones release their slots."""
        self._mark_cancelled()
        self._drop_cancelled_queued()
        for seq in [q for q in self.live() if q.cancelled]:
            self._close_cancelled(seq)

    def _admit_waiting(self) -> None:
        """Claim a slot for each waiting request while slots are free, and restore its prefix."""
        while self.queue and len(self.prefilling) + len(self.running) < self.layout.slots:
            seq = next((q for q in self.queue if not (self.prefix.enabled and q.waiting)), None)
            if seq is None:  # only later choices waiting for their first one's prefill
                return
            if seq.done:
                self.queue.remove(seq)
                self.close(seq)
                continue
            slot, status = self.hooks.tx(self.steps.claim)  # interrupted here, seq is still queued
            if int(status) != Status.OK:  # no free slot after all (should not happen): try later
                return
            self.queue.remove(seq)
            self.clock += 1
            seq.slot, seq.fed, seq.keys, seq.parent_record = int(slot), 0, [], -1
            seq.ids, seq.admitted_at, seq.t_admit = seq.prompt + seq.tokens, self.clock, time.perf_counter()
            self.prefilling[seq.slot] = seq  # pinned while it restores (`_make_room`)
            if self.prefix.enabled and seq.sampling.prompt_logprobs is None:  # (those compute every position)
                before = seq.slot
                seq.fed = self.prefix.admit(seq).restored_tokens
                if seq.slot != before:  # a window rebuild re-claimed the slot
                    self.prefilling.pop(before, None)
                    self.prefilling[seq.slot] = seq
            seq.start = seq.fed  # where this admission's prefill begins (after its restore)

    def _prefill_step(self) -> None:
        """One chunk for up to `prefill_batch` prefilling requests, in one batched step."""
        rows = self._live_prefilling()[: self.opts.prefill_batch]
        if not rows:
            return
        left = max(len(seq.ids) - seq.fed for seq in rows)
        c = next(w for w in self.opts.prefill_widths if w >= left or w == self.opts.prefill_chunk)
        decoding = len(self.running) + len(self.prefilling)  # (the requests holding slots)
        self.plan.build_ahead(rows, decode=not self.hooks.while_building(), prefix=self.prefix.enabled,
                              decoding=decoding)  # fmt: skip
        ran = self._run_chunk(rows, c, lambda seq: seq.ids[seq.fed : seq.fed + c])
        if ran is None:
            return
        if not ran.compiled:
            self.prefix.costs.measure("chunk", ran.seconds, width=None if c == self.opts.prefill_chunk else c)
        else:  # what building a model step costs here (`_decode_via_prefill` weighs it)
            self.plan.build_seconds = max(self.plan.build_seconds, ran.seconds)
        self.stats.prefill_steps += 1
        self.stats.prefill_seconds += 0.0 if ran.compiled else ran.seconds
        for j, seq in enumerate(ran.rows):
            seq.fed += int(ran.fed[j])
            self.prefix.after_step(seq)
            if seq.fed < len(seq.ids):
                continue
            self.stats.prefill_tokens += len(seq.ids) - seq.start
            if not seq.tokens:
                self.stats.prompts += 1
                self.stats.ttft_seconds.append(time.perf_counter() - seq.t_admit)
            self.prefilling.pop(seq.slot)
            self.running[seq.slot] = seq
            self.hooks.say(f"prefilled prompt {seq.index} ({len(seq.ids)} tokens) into slot {seq.slot}")
            self.stats.generated_tokens += seq.emit(*ran.row(j))
            if seq.done:
                self.close(seq)

    def _run_chunk(
        self, rows: list[LiveRequest], c: int, chunk: Callable[[LiveRequest], list[int]], variant: tuple | None = None
    ) -> Chunk | None:
        """Run the prefill step on `rows` (each row's next tokens: `chunk(seq)`, at most `c`), making
        room or preempting the youngest live request while the pools are short of pages.

        variant: (rows b, read bound, logits kept) of the compiled program to run (`_decode_via_prefill`);
        None: the smallest for these rows (b a power of two, `_read_bound`, logits when a row keeps them).
        Returns a `Chunk` (the rows that ran, their sampled ids and logprobs, last logits or None,
        tokens fed, seconds, whether it compiled), or None when no row is left to run (preempted, or
        closed with a `CacheCapacityError`).
        """
        while rows:
            if variant is None:
                b, keep = pow2(len(rows)), any(q.keep_logits for q in rows)
            else:
                b, read, keep = variant
            tokens = np.zeros((b, c), np.int32)
            slots = np.zeros((b,), np.int32)
            n_valid = np.zeros((b,), np.int32)
            for j, seq in enumerate(rows):
                ids = chunk(seq)
                tokens[j, : len(ids)], slots[j], n_valid[j] = ids, seq.slot, len(ids)
            prompt_next = None
            if any(q.sampling.prompt_logprobs is not None and q.fed < len(q.prompt) for q in rows):
                ends = [q.fed + int(n) for q, n in zip(rows, n_valid, strict=False)]
                prompt_next = [q.prompt[e] if e < len(q.prompt) else -1 for q, e in zip(rows, ends, strict=True)]
                prompt_next += [-1] * (b - len(rows))
            params = self.sampling_batch(rows + [None] * (b - len(rows)), prompt_next)
            ends = [seq.fed + int(n) for seq, n in zip(rows, n_valid, strict=False)]  # n_valid: b >= rows
            snaps = self.prefix.plan_snapshots(rows, ends, b, c)  # (None: the step prepares none)
            if variant is None:
                read = self.plan.read_bound(max(ends))
                # room first: a step short of pages computes the whole chunk before it reports NO_PAGES
                # (the pages of the windows it keeps for its snapshots included: older snapshots give way)
                view = self.hooks.view
                slots_now = slots[: len(rows)]
                holds = [min(q.staged or (), default=None) for q in rows]
                holds = [None if h is None else h * self.spec.block_tokens for h in holds]
                while self.prefix.enabled:
                    # one eviction step that leaves the pages the chunk maps (the policy's passes
                    # simulated on the host), not one pass of the policy per round trip
                    wanted = pages_wanted(self.layout, view(), slots_now, ends, holds)
                    if fits(wanted, free_pages(view())) or not self.prefix.make_room(pages=wanted):
                        break
            name = step_name("prefill", f"{b}x{c}", logits=keep, read=read, variant=params.variant)
            out, dt, fresh = self.plan.timed(
                self.steps.prefill, self.hooks.weights(), tokens, slots, n_valid, params, keep, read,
                *(() if snaps is None else (snaps,)), name=name,
            )  # fmt: skip
            status = int(out[2])
            if status != Status.OK:
                for seq in rows:
                    seq.staged = None  # (nothing was staged)
            if status == Status.OK:
                self.plan.prefill_variants.add((b, c, read, keep))
                tok, lp = jax.device_get((out[0], out[1]))  # [b] ids and logprobs: all that crosses by default
                at = 4 if keep else 3
                tops = tuple(np.asarray(a) for a in jax.device_get(out[at : at + 2])) if params.top_n else None
                if prompt_next is not None:
                    self._prompt_logprobs(rows, n_valid, jax.device_get(out[at + (2 if tops else 0) :]))
                return Chunk(rows, tok, lp, np.asarray(out[3]) if keep else None, tops, n_valid, dt, fresh)
            if status == Status.NO_PAGES and self.prefix.make_room():
                continue
            if status != Status.NO_PAGES:
                err = CacheCapacityError(f"prefill step failed: {Status(status).name}")
                for seq in rows:
                    self.close(seq, err)
                return None
            live = self.live()
            if len(live) == 1:  # alone, with every cached prefix evicted: it can never fit
                seq = rows[0]
                self.close(
                    seq,
                    CacheCapacityError(
                        f"prompt {seq.index} ({len(seq.ids)} tokens) does not fit in the cache's pools even alone, "
                        f"with every cached prefix evicted; raise CacheConfig.pool_pages or lower max_context. "
                        f"Pools now: {self.pool_report()}"
                    ),
                )
                return None
            victim = live[-1]
            self._preempt(victim)
            rows = [q for q in rows if q is not victim]
        return None

    @staticmethod
    def _prompt_logprobs(rows: list[LiveRequest], n_valid: np.ndarray, got: tuple) -> None:
        """Keep what a prefill step computed of its rows' prompt logprobs (`LiveRequest.prompt_lps`:
        prompt position -> (logprob, top pairs)), for the rows that asked."""
        lps, ids, tops = (np.asarray(a) for a in got)
        for j, q in enumerate(rows):
            n_top = q.sampling.prompt_logprobs
            if n_top is None:
                continue
            for t in range(int(n_valid[j])):
                pos = q.fed + t + 1
                if pos < len(q.prompt):
                    top = tuple((int(i), float(v)) for i, v in zip(ids[j, t, :n_top], tops[j, t, :n_top], strict=True))
                    q.prompt_lps[pos] = (float(lps[j, t]), top)

    def _live_prefilling(self) -> list[LiveRequest]:
        return sorted(self.prefilling.values(), key=lambda q: q.admitted_at)

    def _decode_step(self) -> None:
        """Up to `decode_steps` tokens for every decoding request, in one on-device loop; one token
        each through the prefill step while the decode step is still building (`_decode_via_prefill`)."""
        rows, args, name = self.decode_inputs()
        plain = not args[3].variant  # (the prefill variants decoding through prefill reuses sample plainly)
        if plain and self.hooks.while_building() and self._decode_via_prefill(rows, args, name):
            return
        out, dt, fresh = self.plan.timed(self.steps.decode, *args, name=name)
        host = unpack_decode(jax.device_get(out[0]), self.opts.decode_steps, args[3].top_n)
        host, lg = per_slot(args[2], host, out[1] if args[7] else None, self.layout.slots)
        self._dispatch_ahead(rows, args, host)
        self.decode_outputs(rows, host, lg, dt, fresh)

    def _finish_ahead(self) -> None:
        """Wait for the decode `_dispatch_ahead` sent and hand its results to its requests (after
        sending the next one when it may)."""
        rows, args, out, t0 = self.ahead
        self.ahead = None
        host = unpack_decode(jax.device_get(out[0]), self.opts.decode_steps, args[3].top_n)
        dt = time.perf_counter() - t0
        host, lg = per_slot(args[2], host, out[1] if args[7] else None, self.layout.slots)
        self._dispatch_ahead(rows, args, host)
        # a request cancelled since (its handle, or `generate_text`'s stop string) would not have run
        # this dispatch: its tokens are dropped (`_reap` releases its slot next); one released since
        # gets nothing either (its slot may hold another request now)
        rows = [q for q in rows if not cancelled(q) and self.running.get(q.slot) is q]
        self.decode_outputs(rows, host, lg, dt, False)

    def _dispatch_ahead(self, rows: list[LiveRequest], args: tuple, host: tuple) -> None:
        """Send the next decode before the host hands these results (`host`, of a dispatch made with
        `args`) to their requests, so that bookkeeping (tokens, streams, finished requests'
        releases) runs while the device decodes instead of after it.

        Only when the next step would run nothing but this decode: the same requests, none ending
        here (its slot is released first), nothing waiting to be admitted or prefilled, no
        cancellation, a successful step, no logits kept, no block boundary reached with the prefix
        cache on (its record reads the cache at the boundary), the same stop-id width, no penalty
        or min_tokens row (their sampling inputs change with every token). Inputs are
        computed as `_decode_inputs` would after `_decode_outputs`, so tokens, logprobs, finish
        reasons and compiled programs are those of one dispatch at a time, and so is the order of
        the cache's transitions unless a request arrives or is cancelled while a dispatch is ahead
        (it is admitted, or released, after that dispatch: other page ids, same tokens)."""
        toks, _, n_new, stopped, status, _ = host
        weights, tokens, slots, params, last_budget, stop_ids, k, keep, read = args
        if not self.pipeline or status != Status.OK or keep or self.queue or self.prefilling:
            return
        if params.counts.shape[1] or params.ban_ids.shape[1]:
            return  # penalties count the tokens this dispatch made; min_tokens counts down: new params
        with self.inbox_lock:
            if self.inbox:
                return
        if len(rows) != len(self.running):
            return
        bt = self.spec.block_tokens
        tokens, budget = tokens.copy(), np.zeros_like(last_budget)
        row = {int(x): i for i, x in enumerate(slots)}  # (host: per slot; the step's inputs: per row)
        held = []
        for q in rows:
            if self.running.get(q.slot) is not q or cancelled(q):
                return
            n, i = int(n_new[q.slot]), row[q.slot]
            made, fed = len(q.tokens) + n, q.fed + n
            if stopped[q.slot] or n != last_budget[i] or made >= q.max_new:
                return  # ends here: `_decode_outputs` releases its slot before the next decode
            if self.prefix.enabled and fed % bt == 0:
                return  # `_after_step` records this boundary
            budget[i] = self._decode_budget(q, made, fed)
            tokens[i] = toks[q.slot, n - 1]
            held.append(fed + int(budget[i]))
        if not rows or stop_width(rows) != stop_ids.shape[1]:
            return
        if self.decode_read(held) != read:  # another program: dispatched (and built) in turn
            return
        nxt = (weights, tokens, slots, params, budget, stop_ids, k, keep, read)
        t0 = time.perf_counter()
        out = self.hooks.tx(self.steps.decode, *nxt)
        self.ahead = (rows, nxt, out, t0)
        self.stats.decode_dispatched_ahead += 1

    def _decode_via_prefill(self, rows: list[LiveRequest], args: tuple, name: str) -> bool:
        """While the decode step these rows need is not built (a first decode in a process), advance
        each row by one token through a prefill step this engine has already run, instead of waiting
        for the decode compile (`CompilePlan.via_prefill` picks the variant and starts the decode
        step's build when decoding this way has cost about what compiling costs).

        A decoding row is a prefill of one token (its last sampled one) at its position: the same
        cached step, the same sampling key (seed, position), the same stop-id and length checks
        (`LiveRequest.emit`), block recording (`PrefixManager.after_step`) and page handling (`_run_chunk`).
        Only the compiled program differs (one padded `prefill_chunk`-wide row per token instead of
        `decode_steps` tokens per dispatch), as it does between prefill widths. Returns False (the
        caller runs the decode step, waiting for its build) when the decode step is built, or when no
        prefill variant run so far holds these rows (rows, logits, read bound).
        """
        plan = self.plan
        variant = plan.via_prefill(rows, args, name, self.prefix.costs.via_prefill or 0.0)
        if variant is None:
            return False
        b, c, read, k = variant
        if not self.stats.decode_via_prefill:  # once: a short benchmark would see a slow decode, no reason
            self.hooks.say(
                f"decoding one token per step through the prefill step while {name} is not built "
                f"(several times slower per token; it builds once this has cost about a compile; "
                f"Engine.warmup() or decode_while_building=False build it first)"
            )
        t0 = time.perf_counter()
        for i in range(0, len(rows), b):
            group = [q for q in rows[i : i + b] if self.running.get(q.slot) is q and not q.done]
            ran = self._run_chunk(group, c, lambda q: q.tokens[-1:], variant=(b, read, k)) if group else None
            if ran is None:
                continue
            for j, q in enumerate(ran.rows):
                self.stats.generated_tokens += q.emit(*ran.row(j))
                q.fed += 1
                self.prefix.after_step(q)
                if q.done:
                    self.close(q)
            self.stats.decode_via_prefill += 1
        dt = time.perf_counter() - t0
        self.prefix.costs.measure("via_prefill", dt)
        plan.via_prefill_seconds += dt
        self.stats.decode_steps += 1
        self.stats.decode_seconds += dt
        return True

    def _decode_budget(self, q: LiveRequest, made: int, fed: int) -> int:
        """Tokens request `q` may decode in its next dispatch, having generated `made` and holding
        `fed` in its slot: at most `decode_steps`, its `max_new`, and (prefix cache on) up to its
        next block boundary, which is recorded there."""
        room = q.max_new - made
        if self.prefix.enabled:
            bt = self.spec.block_tokens
            room = min(room, bt - fed % bt)
        return min(self.opts.decode_steps, room)

    def decode_inputs(self) -> tuple[list[LiveRequest], tuple, str]:
        """(the decoding requests, the decode step's arguments after (layout, cache), its name).
        The step's rows: the running requests' slots, then idle rows on free slots, as many as
        `CompilePlan.decode_rows` picks (every slot, row i on slot i, when the plan does not compact:
        a `MeshEngine` shard). Its outputs are per row: `compiled.per_slot` puts them per slot."""
        s, k = self.layout.slots, self.opts.decode_steps
        rows = list(self.running.values())
        if self.plan.compact:
            taken = [q.slot for q in rows]
            free = sorted(set(range(s)) - set(taken))
            slots = np.asarray(taken + free[: self.plan.decode_rows(len(rows)) - len(taken)], np.int32)
        else:
            slots = np.arange(s, dtype=np.int32)
        row = {int(x): i for i, x in enumerate(slots)}
        b = len(slots)
        tokens = np.zeros((b,), np.int32)
        budget = np.zeros((b,), np.int32)
        by_row: list[LiveRequest | None] = [None] * b
        n_stop = stop_width(rows)
        stop_ids = np.full((b, n_stop), -1, np.int32)
        for q in rows:
            i = row[q.slot]
            tokens[i], budget[i] = q.tokens[-1], self._decode_budget(q, len(q.tokens), q.fed)
            by_row[i] = q
            stop_ids[i, : len(q.stop_ids)] = q.stop_ids
        keep = any(q.keep_logits for q in rows)
        params = self.sampling_batch(by_row)
        read = self.decode_read(q.fed + int(budget[row[q.slot]]) for q in rows)
        size = decode_size(b, s, k)
        name = step_name("decode", size, stops=n_stop, logits=keep, read=read, variant=params.variant)
        args = (self.hooks.weights(), tokens, slots, params, budget, stop_ids, k, keep, read)
        return rows, args, name

    def decode_read(self, held) -> int | None:
        """The `read_tokens` of a decode dispatch after which its rows hold `held` tokens (an iterable
        of ints: each row's tokens in its slot plus its budget): the smallest read size holding them
        all (`CompilePlan.read_bound`; None at max_context), so that its full-attention and
        compressed reads follow the context held, not max_context."""
        return self.plan.read_bound(max(held, default=1))

    def sampling_batch(self, rows: list[LiveRequest | None], prompt_next: list[int] | None = None) -> SamplingBatch:
        """The `SamplingBatch` of a step's rows (None: an idle row, greedy). Penalized rows pass their
        prompt and tokens so far; rows under `min_tokens` their stop ids; a prefill whose rows ask for
        prompt logprobs the prompt token after each row's chunk (`prompt_next`)."""
        settings = [GREEDY if q is None else q.sampling for q in rows]
        seeds = [0 if q is None else q.seed for q in rows]
        hist = None
        if any(s.penalized or s.min_tokens for s in settings):
            hist = [RowHistory() if q is None else RowHistory(q.prompt, q.tokens, q.stop_ids) for q in rows]
        return SamplingBatch.stack(settings, seeds, hist, self.vocab_size, prompt_next)

    def decode_outputs(self, rows: list[LiveRequest], host: tuple, lg, dt: float, fresh: bool) -> None:
        """Hand a decode step's results to its requests: `host` = (tokens, logprobs, n_new, stopped,
        status, tops) on the host, `lg` its logits (device; used only when a row keeps them)."""
        toks, lps, n_new, _, status, tops = host
        keep = any(q.keep_logits for q in rows)
        status = int(status)
        produced = int(np.sum(n_new))
        self.stats.decode_dispatches += 1
        self.stats.decode_steps += int(np.max(n_new)) if produced else 0
        self.stats.decode_seconds += 0.0 if fresh else dt
        if keep and produced:
            lg = np.asarray(lg)
        for q in rows:
            n = int(n_new[q.slot])
            if n:  # fed: its last token and the first n - 1 new ones
                top = None if tops is None else (tops[0][q.slot, :n], tops[1][q.slot, :n])
                self.stats.generated_tokens += q.emit(
                    toks[q.slot, :n].tolist(), lps[q.slot, :n].tolist(), lg[q.slot, :n] if keep else None, top
                )
                q.fed += n
                self.prefix.after_step(q)
            if q.done:
                self.close(q)
        if status == Status.NO_PAGES and not self.prefix.make_room() and self.running:
            victim = self.live()[-1]  # the youngest request gives way; it is recomputed later
            self._preempt(victim)
        elif status not in (Status.OK, Status.NO_PAGES):
            raise CacheCapacityError(f"decode step failed: {Status(status).name}")

    def _preempt(self, seq: LiveRequest) -> None:
        """Release seq's slot and re-queue it first, with the tokens it has (recomputed exactly later)."""
        self.hooks.tx(self.steps.release, jnp.int32(seq.slot))
        self.prefilling.pop(seq.slot, None)
        self.running.pop(seq.slot, None)
        seq.slot = -1
        self.queue.appendleft(seq)
        self.stats.preemptions += 1
        self.hooks.say(f"preempted prompt {seq.index}: pools full")

    def close(self, seq: LiveRequest, error: BaseException | None = None) -> None:
        """Finish seq (error None: done) — release its slot, hand its result or error to its handle."""
        if seq.slot >= 0:  # released first: interrupted here, it is still live and `_abort` re-queues it
            self.hooks.tx(self.steps.release, jnp.int32(seq.slot))
            self.prefilling.pop(seq.slot, None)
            self.running.pop(seq.slot, None)
            seq.slot = -1
        if error is not None and seq.error is None and not (seq.cancelled and seq.handle is None):
            seq.error = error
        if seq.handle is not None:
            if error is None:
                seq.handle._finish(seq.generation(self.vocab_size))
            else:
                seq.handle._finish(None, error)

    def pool_report(self) -> str:
        """Per pool: capacity, free pages, pages mapped by running slots, pages held only by cached prefix
        records, and what one sequence of max_context tokens maps at most."""
        c = self.hooks.view()  # only page bookkeeping crosses to the host, never the pools' rows
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
            rec_pages = np.unique(held[alive]) if self.prefix.enabled else np.zeros(0, int)
            rec_only = np.setdiff1d(rec_pages[rec_pages >= 0], slot_pages)
            parts.append(
                f"pool {gi} ({grp.kind.name}, layers {list(grp.layers)}): {refc.shape[0]} pages, "
                f"{int((refc == 0).sum())} free, {len(slot_pages)} mapped by running sequences, "
                f"{len(rec_only)} held only by cached prefix records; one sequence maps up to "
                f"{self.layout.logical_pages(gi)}"
            )
        return "; ".join(parts)
