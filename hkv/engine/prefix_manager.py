"""`PrefixManager`: the host side of prefix reuse — lookup and the restore route, recording after
each step, making room, and the disk tier's probe, read, install, offload and polling.

The `Engine` schedules requests; for each it asks this manager to restore the longest verified prefix
into the request's fresh slot (`admit`), to record the block boundaries each step crossed
(`after_step`), and to make room when the pools run short (`make_room`). Every device change is a
transition of the engine's cache run through `EngineHooks.tx`, so the engine keeps its one rule:
it installs each transition's result at once.

A lookup runs the device restore (`hkv.core.prefix.restore`: hash, lifecycle, ABI and intersection
stages, then the claim), then picks among the routes to the prompt's end by estimated cost
(`hkv.core.plan.RestoreCosts`): recompute from the device hit, rebuild the sliding window at the
ABI-stage boundary, or install verified blocks from the disk tier. The plan is extended by the pure
functions of `hkv.core.plan` (`extend_with_disk`, `with_window_rebuilt`, `started_cold`), and the
device counters count the final plan once per request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core import prefix as px
from ..core.layers import InteriorSnapshots
from ..core.layout import CacheLayout, Status
from ..core.plan import (
    DevicePlan,
    DiskStage,
    MeasuredCosts,
    RestoreCosts,
    RestorePlan,
    RouteReach,
    estimate_restore_costs,
    extend_with_disk,
    started_cold,
    with_window_rebuilt,
)
from ..core.policy import RetentionPolicy, eviction_order, window_rebuild_tokens
from ..core.reasons import DISK_REASONS, Reason
from ..core.spec import CacheSpec
from ..store.tier import BlockRef, DiskTier
from . import offload as swap
from .block_keys import key_bytes, key_words
from .compile_plan import CompilePlan, EngineSteps
from .compiled import builds_on_this_thread, step_name
from .hooks import EngineHooks
from .options import EngineOptions
from .page_budget import fits, free_pages_after
from .prefix_tools import RECORD_BATCH, PrefixQuery, pack_records
from .recording import AdmissionMemory, crossed, interior_snapshots, retains, wanted_snapshots
from .requests import LiveRequest

__all__ = ["DiskProbe", "PrefixCounters", "PrefixManager"]

_could_match = jax.jit(px.could_match)  # see PrefixManager.could_hit

# Plans a window rebuild can lengthen: the records to `tokens_after_stage["abi"]` passed lifecycle and
# ABI, only the SWA window / TAIL at that boundary is missing — because no snapshot was kept there
# (intersection) or because the chain is cut just after it (a record evicted or its page reused).
WINDOW_REASONS = ("swa_missing", "tail_missing", "freed", "page_reused")


@dataclasses.dataclass
class PrefixCounters:
    """Host counters of the prefix routes (they appear in `Engine.stats()`).

    Attributes:
      window_recomputes: restores that rebuilt the sliding window instead of recomputing the gap.
      disk_restores: restores that installed blocks from the disk tier; disk_restored_tokens: their tokens.
      disk_blocks_offloaded: blocks queued for writing to the disk tier.
    """

    window_recomputes: int = 0
    disk_restores: int = 0
    disk_restored_tokens: int = 0
    disk_blocks_offloaded: int = 0


@dataclasses.dataclass(frozen=True)
class DiskProbe:
    """What the disk tier's index holds past the device-restored prefix [0, l0) (no data read).

    Attributes:
      keys: the prompt's usable block keys (bytes), from block 0.
      refs: the stored chain from block l0 // block_tokens on (`hkv.store.tier.BlockRef`s).
      stop: why the stored chain ended ("absent", "disk_abi", ...; `ChainLookup.stop`), or None.
      snaps: indices into `refs` of blocks stored with an SWA + TAIL snapshot.
      reach: the longest boundary (tokens) with a stored snapshot (l0 when none).
      error: the store failed to answer (then the chain is empty).
    """

    keys: list[bytes]
    refs: list[BlockRef]
    stop: str | None
    snaps: list[int]
    reach: int
    error: bool = False


def policy_columns(index: px.PrefixIndex, whole: bool) -> tuple[dict[str, np.ndarray], Any]:
    """The eviction policy's columns of the prefix index on the host, and with `whole` (a disk tier,
    whose write-behind copies blocks from the whole index) the whole index's host snapshot (else None)."""
    fields = ("state", "parent", "length", "last_used", "swa_held", "tail_slot", "hits")
    if whole:
        p = jax.device_get(index)
        return {k: np.asarray(getattr(p, k)) for k in fields}, p
    got = jax.device_get(tuple(getattr(index, k) for k in fields))  # not the token, page and TAIL arrays
    return dict(zip(fields, map(np.asarray, got), strict=True)), None


class PrefixManager:
    """The prefix cache's host side for one engine (one cache, or one data shard of a mesh).

    Args:
      layout, spec: the engine's cache layout and cache spec.
      steps: the engine's compiled transitions (`EngineSteps`). plan: its compile plan (steps built
        ahead, step names used).
      hooks: what the manager uses of its engine (`EngineHooks`).
      opts: the engine's options (restore choice, prefill widths: the cost model's unit of work).
      retention: where SWA + TAIL snapshots are kept. cache_salt: extra bytes in every block key.
      disk: the disk tier (None: none).
      interior: the model's cached_step takes `snapshots` (`hkv.InteriorSnapshots`): prefill steps
        prepare the snapshots of the block boundaries inside them (else only a step's last boundary
        can keep one).
    """

    def __init__(
        self,
        layout: CacheLayout,
        spec: CacheSpec,
        steps: EngineSteps,
        plan: CompilePlan,
        hooks: EngineHooks,
        opts: EngineOptions,
        *,
        retention: RetentionPolicy,
        cache_salt: bytes,
        disk: DiskTier | None,
        interior: bool = False,
    ):
        self.layout, self.spec, self.steps, self.plan, self.hooks = layout, spec, steps, plan, hooks
        self.enabled = layout.config.prefix_records > 0
        self.interior = self.enabled and interior and layout.tail_snapshots > 0
        plan.interior_snapshots = self.interior  # (warm-up builds the prefill steps with them)
        self.retention, self.cache_salt, self.disk = retention, bytes(cache_salt), disk
        self.restore_choice = opts.restore_choice
        self.prefill_chunk, self.prefill_widths = opts.prefill_chunk, opts.prefill_widths
        self.window_tokens = window_rebuild_tokens(spec)  # 0: no exact rebuild route
        self.costs = MeasuredCosts()
        self.counters = PrefixCounters()
        self.recorded = False  # whether a prefix block was recorded (the engine builds `restore` ahead then)
        self.admission = AdmissionMemory(layout.config.prefix_records)
        self._disk_futures: list = []
        self._disk_inflight: set[tuple[bytes, bool]] = set()

    def forget(self) -> None:
        """The device cache was replaced by a fresh one: forget what was known of its records."""
        self.admission.forget()

    # -------------------------------------------------------------------------------- lookup
    def estimate(self, prompt: int, l0: int, window_at: int | None, disk_at: int) -> RestoreCosts:
        """Estimated seconds of each route to the prompt's end (`hkv.core.plan.estimate_restore_costs`
        with this engine's measured costs)."""
        return estimate_restore_costs(
            self.costs,
            chunk=self.prefill_chunk,
            widths=self.prefill_widths,
            window_tokens=self.window_tokens,
            prompt=prompt,
            l0=l0,
            window_at=window_at,
            disk_at=disk_at,
        )

    def admit(self, seq: LiveRequest) -> RestorePlan:
        """Restore the longest verified prefix of `seq.ids` into seq's fresh slot, by the route the
        restore choice picks; set seq's `fed`, `parent_record`, `keys` (and `plan`, on a first
        admission; a window rebuild may move it to another `slot`). Returns this admission's plan."""
        ids, bt = seq.ids, self.spec.block_tokens
        query = PrefixQuery.of(ids, self.layout, self.cache_salt)
        keys, usable = query.keys, query.n_blocks  # usable: leaves >= 1 token to compute
        plan, vec = self._device_restore(seq, query)
        abi_ok = plan.tokens_after_stage["abi"]
        r = self.window_tokens
        window_ok = plan.reason in WINDOW_REASONS and 0 < r <= abi_ok and abi_ok - plan.restored_tokens > r
        probe = self.disk_probe(seq, keys, ids, usable, plan.restored_tokens) if self.disk is not None else None
        reach = RouteReach(shrink=plan.restored_tokens, window=abi_ok, disk=probe.reach if probe else 0)
        costs = self.estimate(len(ids), plan.restored_tokens, abi_ok if window_ok else None, reach.disk)
        choice = costs.choose(self.restore_choice, reach)
        if probe is not None and (choice == "disk" or costs.disk is None):
            plan, vec = self.disk_install(seq, probe, plan, vec)  # also names disk failures
        if choice == "window" or (choice == "disk" and plan.disk_tokens is None and window_ok):
            plan, vec = self._rebuild_window(seq, query, plan, vec)
        self.hooks.tx(self.steps.count_plan, jax.tree.map(jnp.int32, vec))  # once per request
        if seq.plan is None:  # a preempted request keeps the plan of its first admission
            seq.plan = plan
        restored = plan.restored_tokens
        on_device = plan.disk_tokens[0] if plan.disk_tokens else restored
        seq.fed = restored
        seq.parent_record = vec.record if on_device else -1
        seq.keys = [key_bytes(k) for k in keys[: on_device // bt]]
        if plan.disk_tokens:
            self.after_step(seq)  # the blocks that came from disk are cached on device again
        self.hooks.say(
            f"prompt {seq.index}: hash hit {plan.hash_hit_tokens} tokens, restored {restored}"
            + (f" (stopped at stage {plan.first_failed_stage}: {plan.reason})" if plan.reason else "")
        )
        return plan

    def _device_restore(self, seq: LiveRequest, query: PrefixQuery) -> tuple[RestorePlan, DevicePlan]:
        """The device lookup (or the miss plan, when it cannot hit), retried after making room while
        the pools are short of pages. Returns (plan, the host `DevicePlan`)."""
        keys, toks, usable = query.keys, query.tokens, query.n_blocks
        while True:
            if not self.could_hit(keys, usable):
                vec = DevicePlan.miss(usable)  # what the device lookup would return, without running it
            else:
                (vec,) = self.hooks.tx(
                    self.steps.restore, jnp.int32(seq.slot), np.asarray(keys), np.asarray(toks), jnp.int32(usable)
                )
                vec = vec.host()  # one device-to-host transfer per try
            plan = RestorePlan.from_device(vec, self.spec.block_tokens, query.prompt_tokens)
            if plan.status != "NO_PAGES" or not self.make_room():
                return plan, vec

    def _rebuild_window(
        self, seq: LiveRequest, query: PrefixQuery, plan: RestorePlan, vec: DevicePlan
    ) -> tuple[RestorePlan, DevicePlan]:
        """Cheaper to rebuild the missing window (R tokens) than to recompute the gap: restart the
        slot, restore the entries at the longer boundary, then recompute its window. A window that
        cannot be mapped starts the request cold."""
        padded = np.zeros((self.layout.config.max_context,), np.int32)
        padded[: query.prompt_tokens] = seq.ids
        while True:
            self.restart_slot(seq)
            t0 = time.perf_counter()
            vec, st = self.hooks.tx(
                self.steps.restore_window,
                self.hooks.weights(),
                jnp.int32(seq.slot),
                np.asarray(query.keys),
                np.asarray(query.tokens),
                jnp.int32(query.n_blocks),
                padded,
                np.bool_(False),
            )
            vec = vec.host()
            no_pages = int(st) == Status.NO_PAGES or vec.status == Status.NO_PAGES
            if not no_pages:  # what the route costs: the estimate's "window"
                self.costs.measure("window", time.perf_counter() - t0)
            if not no_pages or not self.make_room():  # pools full: cached objects give way, then retry
                break
        window_plan = RestorePlan.from_device(vec, self.spec.block_tokens, query.prompt_tokens)
        if int(st) == Status.OK and window_plan.status == "OK" and window_plan.restored_tokens:
            self.counters.window_recomputes += 1
            return with_window_rebuilt(window_plan, self.window_tokens), vec
        self.restart_slot(seq)  # could not map the window: start this sequence cold
        return started_cold(plan, vec)

    def warm(self) -> None:
        """Compile what a first prefix lookup runs besides the engine's steps (`could_hit`'s small
        program), so that `Engine.warmup` leaves nothing to compile on a request's path."""
        if self.enabled:
            self.could_hit(np.zeros((1, 4), np.uint32), 1)

    def could_hit(self, keys: np.ndarray, usable: int) -> bool:
        """Whether the device lookup can find anything for a prompt with block keys `keys` of which
        `usable` may be restored: no when none may, or when no record is a chain root with the first
        block's key (`hkv.core.prefix.could_match`, a small program reading the index's keys). Then
        admission builds the miss plan on the host (`DevicePlan.miss`) instead of running — and, in a
        fresh process, compiling — the whole lookup, so requests that share no prefix with anything
        cached never pay for it."""
        if usable == 0:
            return False
        p = self.hooks.view().prefix
        return bool(_could_match(p.key, p.parent, p.state, keys[0]))

    def restart_slot(self, seq: LiveRequest) -> None:
        """Release seq's slot (and whatever a restore mapped into it) and claim a fresh one."""
        self.hooks.tx(self.steps.release, jnp.int32(seq.slot))
        slot, _ = self.hooks.tx(self.steps.claim)
        seq.slot = int(slot)

    # ------------------------------------------------------------------------------- record
    def plan_snapshots(self, rows: list[LiveRequest], ends: list[int], b: int, c: int) -> InteriorSnapshots | None:
        """The `InteriorSnapshots` of a prefill step of width c over `rows` (padded to b rows), each
        row going from `seq.fed` to `ends[j]` tokens: every block boundary in it the retention policy
        keeps gets a free snapshot slot (making room when there are too few; the boundaries that end
        a step first, then the later ones). Sets each row's `staged`. None: this engine stages none."""
        if not self.interior:
            return None
        wanted = wanted_snapshots(rows, ends, self.spec.block_tokens, self._retain)
        free = np.zeros((0,), np.int32)
        if wanted:
            free = np.flatnonzero(~np.asarray(self.hooks.view().prefix.snap_used))
            if len(free) < len(wanted) and self.make_room(kinds=("snapshot",)):
                free = np.flatnonzero(~np.asarray(self.hooks.view().prefix.snap_used))
        return interior_snapshots(rows, wanted, free, b, c, self.spec.block_tokens)

    def _retain(self, seq: LiveRequest, n: int) -> bool:
        return retains(self.retention, self.spec.block_tokens, seq, n)

    def _release_held(self, seq: LiveRequest, staged: dict | None) -> None:
        """Slide away the windows seq's last step held for the snapshots `staged` it did not record
        (a `record_many` with no block)."""
        if staged:
            self.hooks.tx(self.steps.record_many, *self.plan.record_args(jnp.int32(seq.slot)))

    def after_step(self, seq: LiveRequest) -> None:
        """Record every block boundary the last step crossed; the one at the step's end may keep an
        SWA + TAIL snapshot (retention policy), earlier ones only their COMPRESSED/INDEXER rows."""
        if not self.enabled:
            return
        if not seq.admission_set:
            # admission control (record slots): record -> prefix clock it was last recorded at; a
            # sequence's own previous use is that of the record its restore ended at, its own standing
            # the length restored. A sequence that restored nothing may displace only never-reused chains.
            seq.admission_set = True
            r0 = seq.parent_record
            seq.prev_use = self.admission.stamps.get(r0, -1) if r0 >= 0 else None
            seq.prev_len = int(np.asarray(self.hooks.view().prefix.length)[r0]) if r0 >= 0 else None
        # (block number n, retain) of every boundary this step crossed
        todo = crossed(seq, self.spec.block_tokens, self.cache_salt, self._retain)
        staged, seq.staged = seq.staged, None
        if seq.record_stopped or not todo:
            self._release_held(seq, staged)
            return
        if staged is None and todo[-1][1] and not bool(np.any(~np.asarray(self.hooks.view().prefix.snap_used))):
            self.make_room(kinds=("snapshot",))
        if staged is not None:  # the step prepared the snapshots it keeps (`plan_snapshots`)
            todo = [(n, n in staged) for n, _ in todo]
        bt, ids = self.spec.block_tokens, seq.prompt + seq.tokens
        i = 0
        while i < len(todo):
            # one transition for up to RECORD_BATCH boundaries (padded to RECORD_BATCH rows: one compile)
            batch = todo[i : i + RECORD_BATCH]
            keys, toks, retain, lengths, valid = pack_records(
                [(seq.keys[n - 1], ids[(n - 1) * bt : n * bt], n * bt, ret) for n, ret in batch], bt
            )
            snap_slots = np.full((RECORD_BATCH,), -1, np.int32)
            snap_slots[: len(batch)] = [(staged or {}).get(n, -1) for n, _ in batch]
            recs, _, done = self.hooks.tx(
                self.steps.record_many,
                jnp.int32(seq.slot),
                keys,
                jnp.int32(seq.parent_record),
                toks,
                retain,
                lengths,
                valid,
                snap_slots,
                np.bool_(i + len(batch) >= len(todo)),  # the last batch slides the held windows away
            )
            recs, done, last_used = jax.device_get((recs, done, self.hooks.view().prefix.last_used))
            self.recorded = self.recorded or int(done) > 0
            for r in recs[: int(done)]:
                seq.parent_record = int(r)
                if r >= 0:
                    self.admission.stamps[int(r)] = int(last_used[r])
            i += int(done)
            # block todo[i] got NO_PAGES (no free record slot) when done < len(batch). Admission control:
            # for a record slot evict only chains last used before this sequence's own previous use,
            # shorter than what it restored, or never reused.
            if int(done) < len(batch) and not self.make_room(
                kinds=("record",),
                used_before=self.admission.previous_use(seq),
                shorter_than=seq.prev_len,
                never_hit=True,
                need=len(batch) - int(done),
            ):
                seq.record_stopped = True  # keep what it has; no self-eviction, no cascade
                self.admission.refuse(seq, int(np.asarray(self.hooks.view().prefix.clock)))
                self._release_held(seq, staged)  # (the record step stopped before sliding)
                return

    # ----------------------------------------------------------------------------- eviction
    def make_room(
        self,
        kinds=("snapshot", "record"),
        used_before: int | None = None,
        shorter_than: int | None = None,
        never_hit: bool = False,
        need: int | None = None,
        pages: Sequence[int] | None = None,
    ) -> bool:
        """Evict the cheapest-to-reconstruct cached objects (see hkv.core.policy); False if nothing was.
        used_before, shorter_than, never_hit: admission control — only objects of chains last used
        before this prefix clock, shorter than this many tokens, or never reused (hkv.core.policy.eviction_order).
        need: whole records wanted (record slots for a batch of boundaries); pages: free pages wanted
        per layout group (`page_budget.pages_wanted`); neither: one pass, room of any kind. The
        policy's passes are repeated on the host snapshot, each taking an eighth of the candidates
        (at least one) and marking its records evicted (a parent whose last child went becomes a
        leaf, a candidate of the next pass), until `need` records are chosen or the chosen objects
        leave `pages` free (`page_budget.free_pages_after`); then ONE eviction step runs. The same
        objects go as that many rounds of one pass and one step would evict (the records a sequence
        adds in between extend its own pinned chain, never candidates)."""
        if not self.enabled:
            return False
        meta, p = policy_columns(self.hooks.view().prefix, whole=self.disk is not None)
        free_after = None if pages is None else free_pages_after(self.layout, self.hooks.view(), meta)
        live = self.hooks.live()
        pinned = {q.parent_record for q in live if q.parent_record >= 0}  # chains being extended

        def candidates(pins) -> list:
            """The policy's order over `meta` (as it stands), of the kinds asked for."""
            order = eviction_order(self.spec, meta, pins, used_before, shorter_than, never_hit)
            return [(k, r) for k, r in order if k in kinds]

        order = candidates(pinned)
        unpinned = False
        admission = used_before is not None or shorter_than is not None or never_hit
        if not order and pinned and len(live) == 1 and "record" in kinds and not admission:
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
            if unpinned or (need is None and pages is None):
                break
            if (need is not None and freed >= need) or (pages is not None and fits(pages, free_after(snap, whole))):
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
            self.offload(p, [r for _, r in chosen])
        self.hooks.tx(self.steps.evict, np.asarray(snap), np.asarray(snap), np.asarray(whole))
        if unpinned:
            for q in live:
                if q.parent_record >= 0 and whole[q.parent_record]:
                    q.record_stopped = True  # its chain is gone: never extend a record slot reused later
        self.hooks.say(f"evicted {int(snap.sum())} snapshots, {int(whole.sum())} records")
        return True

    def evict_all(self) -> int:
        """Evict every cached record from device memory, writing the snapshot blocks the disk tier
        lacks first when there is one. Returns the records evicted (the engine checks it is idle)."""
        if not self.enabled:
            return 0
        p = jax.device_get(self.hooks.view().prefix)
        alive = np.asarray(p.state) == px.RecordState.ALIVE
        if self.disk is not None:
            self.offload(p)
        self.hooks.tx(self.steps.evict, alive, alive, alive)
        return int(alive.sum())

    # ---------------------------------------------------------------------------- disk tier
    def offload(self, p=None, records: list[int] | None = None, ahead: bool = True) -> int:
        """Queue one disk segment with the snapshot blocks of `records` (default: every alive record;
        only those holding an SWA + TAIL snapshot end a restorable block) and every block of their
        chains the tier lacks. p: host snapshot of the prefix index (None: read it now). ahead: also
        start building the step that restores them from disk (`disk_ahead`). Returns the blocks queued."""
        if p is None:
            p = jax.device_get(self.hooks.view().prefix)
        abi = self.spec.fingerprint()
        held = (np.asarray(p.state) == px.RecordState.ALIVE) & np.asarray(p.swa_held) & (np.asarray(p.tail_slot) >= 0)
        records = [int(r) for r in (np.nonzero(held)[0] if records is None else records) if held[r]]
        payloads, seen = [], set()
        lasts = {key_bytes(p.key[r]) for r in records}  # blocks written with their snapshot
        for r in records:
            chain, need = self._chain_needs(p, r, abi, lasts, seen)
            if need:
                for pl in swap.swap_out(self.layout, self.hooks.view(), p, int(r), need, chain):
                    seen.add((pl.key, pl.snapshot))
                    payloads.append(pl)
        if not payloads:
            return 0
        marks = {(pl.key, pl.snapshot) for pl in payloads}
        self._disk_inflight |= marks
        fut = self.disk.write_async(abi, payloads)
        self._disk_futures.append((fut, marks))
        self.counters.disk_blocks_offloaded += len(payloads)
        self.hooks.say(f"disk tier: queued {len(payloads)} blocks")
        if ahead:
            self.disk_ahead(payloads)
        return len(payloads)

    def _chain_needs(self, p, r: int, abi: str, lasts: set, seen: set) -> tuple[dict[int, int], list[int]]:
        """({block index: record} of record r's chain, the block indices the tier still needs: r's
        own block with its snapshot, and chain blocks neither stored, in flight nor written now)."""
        bt = self.spec.block_tokens
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
        return chain, need

    def disk_ahead(self, payloads: list) -> None:
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
        build = getattr(self.steps.swap_in, "build_ahead", None)
        if not longest or build is None:
            return
        variant = ("swap_in", swap.swap_in_shapes(self.layout, 0, longest)[0])  # the bucket: its rows' shapes
        if not self.plan.ask_once(variant):
            return
        with contextlib.suppress(Exception):  # see the docstring
            rows, tails = swap.swap_in_zero_inputs(self.layout, 0, longest)
            zero = jnp.int32(0)
            # no delay: a restore from disk often follows the eviction at once (`make demo`'s third turn)
            build(self.layout, self.hooks.cache(), zero, zero, zero, rows, tails, speculative=True, delay=0.0)

    def poll_disk(self) -> None:
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
                self.hooks.say(f"disk tier write failed, its blocks are not on disk: {fut.exception()}")
                continue
            keys += fut.result()
        if keys:
            k = swap.bucket(len(keys))
            arr = np.zeros((k, 4), np.uint32)
            arr[: len(keys)] = [key_words(x) for x in keys]
            self.hooks.tx(self.steps.mark_on_disk, arr, np.arange(k) < len(keys))

    def flush_disk(self) -> None:
        """Wait for every disk write issued so far (nothing once the tier was closed: `DiskTier.close`
        finished its writes) and mark the committed blocks on disk."""
        if self.disk is not None:
            if not self.disk.closed:
                self.disk.flush()
            self.poll_disk()

    def disk_probe(self, seq: LiveRequest, keys: np.ndarray, ids: list[int], usable: int, l0: int) -> DiskProbe:
        """What the disk tier's index holds past the device-restored prefix [0, l0) (no data read).
        A store that fails to answer is an empty chain with `error` set."""
        bt = self.spec.block_tokens
        kb = [key_bytes(k) for k in keys[:usable]]
        toks = [ids[i * bt : (i + 1) * bt] for i in range(usable)]
        try:
            chain = self.disk.find_chain(self.spec.fingerprint(), kb, toks, start=l0 // bt)
        except Exception as e:  # a store that fails to answer is a miss, never a crash
            self._disk_unavailable(seq, e)
            return DiskProbe(keys=kb, refs=[], stop=None, snaps=[], reach=l0, error=True)
        snaps = [j for j, r in enumerate(chain.refs) if r.snapshot]
        reach = l0 + (snaps[-1] + 1) * bt if snaps else l0
        return DiskProbe(keys=kb, refs=chain.refs, stop=chain.stop, snaps=snaps, reach=reach)

    def _disk_unavailable(self, seq: LiveRequest, e: Exception) -> None:
        self.hooks.say(f"prompt {seq.index}: disk tier unavailable ({type(e).__name__}: {e}); computing instead")

    def disk_install(
        self, seq: LiveRequest, probe: DiskProbe, plan: RestorePlan, vec: DevicePlan
    ) -> tuple[RestorePlan, DevicePlan]:
        """Extend the device-restored prefix [0, L0) with verified blocks from the disk tier, up to
        the longest boundary where a stored snapshot lies and every block before it passes stages 2
        and 4; install them with one `swap_in` transition. A bad or missing block shortens the plan
        and names the reason; nothing unverified is installed."""
        bt, l0 = self.spec.block_tokens, plan.restored_tokens
        i0 = l0 // bt
        t0 = time.perf_counter()
        built = builds_on_this_thread()  # a read timed with a compilation is not measured
        try:
            reason, payloads = ("disk_missing", []) if probe.error else self.disk_read(probe.refs, probe.snaps)
        except Exception as e:  # a store that fails to answer is a miss, never a crash
            self._disk_unavailable(seq, e)
            reason, payloads = "disk_missing", []
        l1 = l0 + len(payloads) * bt
        if payloads:
            installed, waited = self._swap_in(seq, payloads, l0, l1)
            if not installed:
                l1 = l0
            elif builds_on_this_thread() == built and not waited:  # (builds on other threads do not count)
                self.costs.measure("disk_token", (time.perf_counter() - t0) / (l1 - l0))
        if reason is None and probe.stop in DISK_REASONS:  # the index's own refusal (ABI, a bad pointer)
            reason = probe.stop
        if reason is None and probe.stop == "absent" and i0 + len(probe.refs) < len(probe.keys):
            # a tombstone that says its block went to disk, but the tier has no such block
            rec_keys, on_disk = jax.device_get((self.hooks.view().prefix.key, self.hooks.view().prefix.on_disk))
            want = key_words(probe.keys[i0 + len(probe.refs)])
            if np.any(np.all(np.asarray(rec_keys) == want, axis=1) & np.asarray(on_disk)):
                reason = "disk_missing"
        stage = DiskStage(
            found=(i0 + len(probe.refs)) * bt,
            snapshot_end=(i0 + probe.snaps[-1] + 1) * bt if probe.snaps else l0,
            installed=l1,
            reason=reason,
        )
        if l1 > l0:
            self.counters.disk_restores += 1
            self.counters.disk_restored_tokens += l1 - l0
        return extend_with_disk(plan, vec, stage, bt)

    def _swap_in(self, seq: LiveRequest, payloads: list, l0: int, l1: int) -> tuple[bool, bool]:
        """Install verified blocks [l0, l1) into seq's slot (making room while pages are short).
        Returns (whether they were installed, whether the call waited for its step's build ahead)."""
        rows, tails = swap.swap_in_inputs(self.layout, payloads, l0)
        self.plan.names.add(step_name("swap_in", swap.swap_in_size(rows)))
        args = (jnp.int32(seq.slot), jnp.int32(l0), jnp.int32(l1), rows, tails)
        waited = self.plan.building_ahead(self.steps.swap_in, args)  # the call waits for its build ahead
        while True:
            (st,) = self.hooks.tx(self.steps.swap_in, *args)
            if int(st) != Status.NO_PAGES or not self.make_room():
                break
        if int(st) != Status.OK:
            self.hooks.say(f"prompt {seq.index}: disk blocks verified but not installed ({Status(int(st)).name})")
            return False, waited
        return True, waited

    def disk_read(self, refs: list[BlockRef], snaps: list[int]) -> tuple[str | None, list]:
        """(why verification stopped, the verified payloads up to the last usable snapshot)."""
        if not snaps:
            return None, []
        res = self.disk.read(
            refs[: snaps[-1] + 1], expect=lambda ref: swap.expected_objects(self.layout, ref.length, ref.snapshot)
        )
        got, reason = res.payloads, res.reason
        if swap.has_indexer(self.layout):
            iver = int(self.hooks.view().indexer_version)
            for j, pl in enumerate(got):
                if pl.indexer_version != iver:  # written under older indexer weights
                    got, reason = got[:j], reason or "indexer_version"
                    break
        ok = [j for j in snaps if j < len(got)]
        return reason, got[: ok[-1] + 1] if ok else []

    # -------------------------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """Hash-hit vs complete-restoration tokens, rejections per stage and reason, occupancy,
        evictions (`Engine.prefix_stats`)."""
        view = self.hooks.view()
        c = {k: int(v) for k, v in jax.device_get(view.counters).items()}
        p = jax.device_get(view.prefix)
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
