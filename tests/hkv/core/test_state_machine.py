"""Hypothesis state-machine tests of the hkv core (`hkv.core.transitions` + `hkv.core.invariants`).

Long random sequences of claim / append / release — including transitions that must fail — run
under `jax.jit` (layout static) on a DeepSeek-like spec (SWA window 8 everywhere, a CSA-like
overlapping ratio-4 compressor with an indexer, an HCA-like ratio-16 compressor) and on a
non-DeepSeek spec (Gemma-style: window-6 layers alternating with full-attention layers, no
compressors). After every rule:

* `check_invariants` holds;
* an independent host model predicts every status (claim: OK / SLOT_CAP; release: OK /
  SLOT_INACTIVE / UNKNOWN_SLOT; reserve: CONTEXT_CAP > SLOT_INACTIVE > NO_PAGES), the pages each
  slot maps, and every counter;
* a failed transition returned the input cache bit for bit, except the failure counter it bumps;
* a model-free oracle of every row written (values encode sequence, object, layer and row) equals
  what `read_rows` returns for every row still held; unmapped rows read 0; the TAIL state is the
  one last written — so after a release and a re-claim, a slot never reads the previous
  occupant's rows.

An "append" mimics one model step (`models.deepseek_v4.cached.cached_step`): reserve the new
lengths, then the typed writes of the new rows (`write_swa`; `seal_compressed` / `write_indexer`
for the windows the step closes; `append_tail` with the open window's rows and the overlap slice),
then `advance` and `slide`. Rows the writes must ignore (invalid positions, masked batch rows) are
filled with a poison value, so a write that lands where it should not is caught by the oracle.
"""

from __future__ import annotations

import collections
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from hkv.core import transitions as tr
from hkv.core.invariants import InvariantError, check_invariants
from hkv.core.layout import CacheConfig, CacheLayout, Status
from hkv.core.spec import CacheSpec, CompressorSpec, LayerSpec, ObjectKind
from hkv.core.state import COUNTERS, init_cache

# ------------------------------------------------------------------------------------- specs
B = 3  # static batch of every append (= slots; padded rows are idle)
C = 10  # static chunk: an append writes 1..C tokens per slot (C > window: rows leave the window mid-chunk)
POISON = -7.0  # written where a write must drop the value (invalid rows, masked batch rows)


def deepseek_like_spec() -> CacheSpec:
    """SWA window 8 on every layer; CSA-like (overlapping ratio 4 + indexer) on layers 1 and 3;
    HCA-like (ratio 16, no overlap) on layer 2; layer 0 sliding-window only."""
    csa = CompressorSpec(ratio=4, entry_dim=4, proj_width=8, overlap=True)
    idx = CompressorSpec(ratio=4, entry_dim=2, proj_width=4, overlap=True)
    hca = CompressorSpec(ratio=16, entry_dim=4, proj_width=4, overlap=False)
    layers = (LayerSpec(4, 8), LayerSpec(4, 8, csa, idx), LayerSpec(4, 8, hca), LayerSpec(4, 8, csa, idx))
    return CacheSpec(layers=layers, block_tokens=8, model_id="test-deepseek-like")


def gemma_like_spec() -> CacheSpec:
    """Not DeepSeek: window-6 sliding layers alternating with full-attention layers, no compressor."""
    layers = tuple(LayerSpec(4, 6 if i % 2 == 0 else None) for i in range(4))
    return CacheSpec(layers=layers, block_tokens=8, model_id="test-gemma-like")


def layout_of(spec: CacheSpec, pool_pages=None) -> CacheLayout:
    return CacheLayout(spec, CacheConfig(slots=3, max_context=48, page_size=4, pool_pages=pool_pages, prefix_records=0))


# groups: SWA(keep 7), COMPRESSED r4, COMPRESSED r16, INDEXER r4 — sized so that pools run out
DEEPSEEK_TIGHT = layout_of(deepseek_like_spec(), pool_pages=(8, 5, 2, 5))
DEEPSEEK_FULL = layout_of(deepseek_like_spec())
# groups: SWA(keep 5), SWA(full attention)
GEMMA_TIGHT = layout_of(gemma_like_spec(), pool_pages=(6, 12))


# ------------------------------------------------------------------------- jitted transitions
claim_j = jax.jit(tr.claim_slot, static_argnums=0)
release_j = jax.jit(tr.release_slot, static_argnums=0)
reserve_j = jax.jit(tr.reserve, static_argnums=0)
advance_j = jax.jit(tr.advance, static_argnums=0)
slide_j = jax.jit(tr.slide, static_argnums=0)


def _write_step(layout: CacheLayout, cache, slots, mask, positions, valid, swa_kv, sealed, tails):
    """Every typed write of one step, per object kind (what `cached_step` does per layer)."""
    for layer in range(len(layout.spec.layers)):
        cache = tr.write_swa(layout, cache, layer, slots, positions, swa_kv[layer], valid)
    for ti, (layer, name, _) in enumerate(layout.spec.compressors()):
        first, entries, count = sealed[ti]
        write = tr.seal_compressed if name == "compressor" else tr.write_indexer
        cache = write(layout, cache, layer, slots, first, entries, count)
        cache = tr.append_tail(layout, cache, ti, slots, *tails[ti], mask)
    return cache


write_j = jax.jit(_write_step, static_argnums=0)


def _fused_step(layout: CacheLayout, cache, slots, new_lengths, mask, writes):
    """reserve -> writes -> advance -> slide as one jitted transition (`cached_step`'s shape)."""
    reserved, status = tr.reserve(layout, cache, slots, new_lengths, mask)

    def run(c):
        c = _write_step(layout, c, slots, mask, *writes)
        c = tr.advance(layout, c, slots, new_lengths, mask)
        return tr.slide(layout, c, slots, mask)

    return jax.lax.cond(status == Status.OK, run, lambda c: c, reserved), status


fused_j = jax.jit(_fused_step, static_argnums=0)


def _read_all(layout: CacheLayout, cache):
    """read_rows of every row of every (group, layer), for every slot: list of [S, R_g, D_g]."""
    s = layout.slots
    out = []
    for gi, grp in enumerate(layout.groups):
        r = layout.logical_pages(gi) * layout.page_size
        rows = jnp.broadcast_to(jnp.arange(r)[None, :], (s, r))
        for layer in grp.layers:
            out.append(tr.read_rows(layout, cache, grp.kind, layer, jnp.arange(s), rows, jnp.ones((s, r), bool)))
    return out


read_j = jax.jit(_read_all, static_argnums=0)


# ------------------------------------------------------------------------------ host helpers
TAG = {"swa": 0, "compressor": 1, "indexer": 2, "tail_kv": 3, "tail_gate": 4, "overlap_kv": 5, "overlap_gate": 6}


def val(seq: int, tag: str, layer: int, row: int, dim: int) -> np.ndarray:
    """The row a sequence writes: distinct small integers (exact in float32), never 0 or POISON."""
    assert 0 < seq < 512 and 0 <= row < 64 and layer < 8 and dim <= 8
    base = ((seq * 8 + TAG[tag]) * 8 + layer) * 64 + row
    return (base * 8 + np.arange(dim) + 1).astype(np.float32)


def held_rows(layout: CacheLayout, gi: int, n: int) -> range:
    """Rows group gi holds for a slot of n tokens: a window's last `keep` rows, else all."""
    grp = layout.groups[gi]
    hi = n // grp.unit
    return range(0 if grp.keep is None else max(hi - grp.keep, 0), hi)


def required_pages(layout: CacheLayout, gi: int, n: int) -> frozenset[int]:
    """Logical pages group gi must map for a slot of n tokens: those of its held rows."""
    rows, ps = held_rows(layout, gi, n), layout.page_size
    return frozenset(range(rows.start // ps, -(-rows.stop // ps)))


def leaves(cache) -> list[tuple[str, np.ndarray]]:
    flat = jax.tree_util.tree_leaves_with_path(jax.device_get(cache))
    return [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in flat]


def assert_bit_identical_except(before, after, counter_deltas: dict[str, int]) -> None:
    """`after` equals `before` bit for bit (NaN-safe: bytes are compared), except counters that
    moved by exactly `counter_deltas`."""
    lb, la = leaves(before), leaves(after)
    assert [p for p, _ in lb] == [p for p, _ in la]
    for (path, x), (_, y) in zip(lb, la, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        if path.startswith(".counters"):
            name = path.split("'")[1]
            assert int(y) - int(x) == counter_deltas.get(name, 0), (path, int(x), int(y))
        else:
            assert x.tobytes() == y.tobytes(), f"failed transition changed {path}"


def empty_tail(spec: CompressorSpec):
    ov = spec.ratio if spec.overlap else 0
    return (
        np.zeros((spec.ratio, spec.proj_width), np.float32),
        np.zeros((spec.ratio, spec.proj_width), np.float32),
        np.zeros((ov, spec.entry_dim), np.float32),
        np.full((ov, spec.entry_dim), -np.inf, np.float32),
    )


class Harness:
    """A cache driven through jitted transitions, with a host model that predicts and checks it."""

    def __init__(self, layout: CacheLayout):
        self.layout = layout
        self.cache = init_cache(layout)
        s = layout.slots
        self.active = [False] * s
        self.length = [0] * s
        self.seq = [0] * s  # sequence occupying the slot (new id at each claim)
        self.next_seq = 1
        self.counters = collections.Counter({k: 0 for k in COUNTERS})
        self.rows = [self._no_rows() for _ in range(s)]  # oracle: slot -> [(group, layer) -> [R, D], NaN = never]
        self.tails = [self._no_tails() for _ in range(s)]
        self.statuses = collections.Counter()
        self._required = {}
        self.groups = layout.groups

    def _no_rows(self):
        out = {}
        for gi, grp in enumerate(self.layout.groups):
            r = self.layout.logical_pages(gi) * self.layout.page_size
            for layer in grp.layers:
                out[(gi, layer)] = np.full((r, grp.dim), np.nan, np.float32)
        return out

    def _no_tails(self):
        return [empty_tail(c) for _, _, c in self.layout.spec.compressors()]

    def _record(self, status: int) -> None:
        self.statuses[Status(status).name] += 1
        if currently_in_test_context():
            event(f"status {Status(status).name}")

    def required(self, gi: int, n: int) -> frozenset[int]:
        key = (gi, n)  # memoised: `layout.groups` recomputes the spec's groups on every access
        if key not in self._required:
            self._required[key] = required_pages(self.layout, gi, n)
        return self._required[key]

    def mapped(self, slot: int, gi: int) -> frozenset[int]:
        return self.required(gi, self.length[slot]) if self.active[slot] else frozenset()

    # ---------------------------------------------------------------------------- transitions
    def claim(self) -> int:
        before = self.cache
        cache, slot, status = claim_j(self.layout, before)
        slot, status = int(slot), int(status)
        self._record(status)
        free = [s for s in range(self.layout.slots) if not self.active[s]]
        if free:
            assert (status, slot) == (Status.OK, free[0])
            self.active[slot], self.length[slot] = True, 0
            self.seq[slot], self.next_seq = self.next_seq, self.next_seq + 1
            self.counters["transitions"] += 1
        else:
            assert (status, slot) == (Status.SLOT_CAP, -1)
            assert_bit_identical_except(before, cache, {"failed_slot_cap": 1})
            self.counters["failed_slot_cap"] += 1
        self.cache = cache
        return slot

    def release(self, slot: int) -> int:
        before = self.cache
        cache, status = release_j(self.layout, before, jnp.int32(slot))
        status = int(status)
        self._record(status)
        if self.active[slot]:
            assert status == Status.OK
            self.counters["pages_released"] += sum(len(self.mapped(slot, g)) for g in range(len(self.groups)))
            self.counters["transitions"] += 1
            self.active[slot], self.length[slot] = False, 0
            self.rows[slot], self.tails[slot] = self._no_rows(), self._no_tails()
        else:
            assert status == Status.SLOT_INACTIVE
            assert_bit_identical_except(before, cache, {})
        self.cache = cache
        return status

    def unknown_slot(self, slot: int, reserve: bool) -> None:
        """reserve / release with a slot id outside [0, slots): UNKNOWN_SLOT, cache unchanged (a
        valid row next to it in the batch is not applied either)."""
        before = self.cache
        if reserve:
            live = [s for s in range(self.layout.slots) if self.active[s] and self.length[s] < 40]
            good = live[0] if live else 0
            cache, status = reserve_j(
                self.layout,
                before,
                jnp.array([slot, good, 0], jnp.int32),
                jnp.array([1, self.length[good] + 8, 0], jnp.int32),
                jnp.array([True, bool(live), False]),
            )
        else:
            cache, status = release_j(self.layout, before, jnp.int32(slot))
        self._record(int(status))
        assert int(status) == Status.UNKNOWN_SLOT
        assert_bit_identical_except(before, cache, {})
        self.cache = cache

    def expected_status(self, slots, new, mask) -> tuple[int, list[int]]:
        """Host prediction of reserve's status, and the pages it allocates per group."""
        live = [(int(s), int(n)) for s, n, m in zip(slots, new, mask, strict=True) if m]
        if any(n > self.layout.config.max_context for _, n in live):
            return Status.CONTEXT_CAP, []
        if any(not self.active[s] for s, _ in live):
            return Status.SLOT_INACTIVE, []
        need = []
        for gi in range(len(self.groups)):
            used = sum(len(self.mapped(s, gi)) for s in range(self.layout.slots))
            n_need = sum(len(self.required(gi, n) - self.mapped(s, gi)) for s, n in live)
            if n_need > self.layout.pool_pages(gi) - used:
                return Status.NO_PAGES, []
            need.append(n_need)
        return Status.OK, need

    def writes(self, slots, old, n, mask):
        """Host arrays of one step's typed writes (values from `val`, poison where ignored)."""
        lay = self.layout
        # rows that can succeed get real values; the others only matter if a failed step wrote them
        mask = (
            mask
            & (n <= C)
            & (old + n <= lay.config.max_context)
            & np.array([0 <= s < lay.slots and self.active[s] for s in slots])
        )
        positions = old[:, None] + np.arange(C)[None, :]
        valid = (np.arange(C)[None, :] < n[:, None]) & mask[:, None]
        seqs = [self.seq[s] if m else 0 for s, m in zip(slots, mask, strict=True)]
        swa = []
        for layer, ls in enumerate(lay.spec.layers):
            kv = np.full((B, C, ls.kv_dim), POISON, np.float32)
            for b in range(B):
                for c in range(C):
                    if valid[b, c]:
                        kv[b, c] = val(seqs[b], "swa", layer, positions[b, c], ls.kv_dim)
            swa.append(kv)
        sealed, tails = [], []
        new = old + n
        for ti, (layer, name, cs) in enumerate(lay.spec.compressors()):
            r = cs.ratio
            w_max = -(-(r - 1 + C) // r)
            first = old // r
            count = np.where(mask, new // r - old // r, 0)
            entries = np.full((B, w_max, cs.entry_dim), POISON, np.float32)
            kv = np.full((B, r, cs.proj_width), POISON, np.float32)
            gate = np.full((B, r, cs.proj_width), POISON, np.float32)
            ov = r if cs.overlap else 0
            ov_kv = np.full((B, ov, cs.entry_dim), POISON, np.float32)
            ov_gate = np.full((B, ov, cs.entry_dim), POISON, np.float32)
            for b in range(B):
                if not mask[b]:
                    continue
                for w in range(count[b]):
                    entries[b, w] = val(seqs[b], name, layer, first[b] + w, cs.entry_dim)
                open_rows, start = new[b] % r, (new[b] // r) * r
                kv[b], gate[b] = 0, 0
                for i in range(open_rows):
                    kv[b, i] = val(seqs[b], "tail_kv", layer, start + i, cs.proj_width)
                    gate[b, i] = val(seqs[b], "tail_gate", layer, start + i, cs.proj_width)
                if cs.overlap:
                    if count[b] > 0:  # Ca slice of the last window closed by this step
                        last = (new[b] // r - 1) * r
                        for i in range(r):
                            ov_kv[b, i] = val(seqs[b], "overlap_kv", layer, last + i, cs.entry_dim)
                            ov_gate[b, i] = val(seqs[b], "overlap_gate", layer, last + i, cs.entry_dim)
                    else:
                        ov_kv[b], ov_gate[b] = self.tails[slots[b]][ti][2], self.tails[slots[b]][ti][3]
            sealed.append((first.astype(np.int32), entries, count.astype(np.int32)))
            tails.append((kv, gate, ov_kv, ov_gate))
        return positions.astype(np.int32), valid, swa, sealed, tails

    def append(
        self,
        rows: list[tuple[int, int]],
        pad_slots: list[int] | None = None,
        pad_len: int = 0,
        fused: bool = False,
        perm: list[int] | None = None,
    ) -> int:
        """One step: rows (slot, n >= 1) of the batch, padded to B with idle rows (n = 0) whose
        slot ids are `pad_slots` (default: -1) and whose new length is `pad_len` (ignored); the
        batch rows are then permuted by `perm`."""
        lay = self.layout
        assert 1 <= len(rows) <= B and len({s for s, _ in rows}) == len(rows)
        pads = list(pad_slots or [])[: B - len(rows)]
        pads += [-1] * (B - len(rows) - len(pads))
        perm = list(range(B)) if perm is None else perm
        slots = np.array([s for s, _ in rows] + pads, np.int32)[perm]
        n = np.array([k for _, k in rows] + [0] * len(pads), np.int32)[perm]
        mask = n > 0
        old = np.array(
            [self.length[s] if (m and self.active[s]) else 0 for s, m in zip(slots, mask, strict=True)], np.int32
        )
        new = np.where(mask, old + n, pad_len).astype(np.int32)
        want, need = self.expected_status(slots, new, mask)
        writes = self.writes(slots, old, np.where(mask, n, 0), mask)
        before = self.cache
        if fused:
            cache, status = fused_j(lay, before, slots, new, mask, writes)
        else:
            cache, status = reserve_j(lay, before, slots, new, mask)
            if int(status) == Status.OK:
                cache = write_j(lay, cache, slots, mask, *writes)
                cache = advance_j(lay, cache, slots, new, mask)
                cache = slide_j(lay, cache, slots, mask)
        status = int(status)
        self._record(status)
        assert status == want, f"status {Status(status).name}, host model expects {Status(want).name}"
        if status != Status.OK:
            failed = {Status.NO_PAGES: "failed_no_pages", Status.CONTEXT_CAP: "failed_context_cap"}.get(status)
            assert_bit_identical_except(before, cache, {failed: 1} if failed else {})
            if failed:
                self.counters[failed] += 1
            self.cache = cache
            return status
        # commit to the host model
        positions, valid, swa, sealed, tails = writes
        tail_of = {(layer, name): ti for ti, (layer, name, _) in enumerate(lay.spec.compressors())}
        for b in np.nonzero(mask)[0]:
            s = int(slots[b])
            for gi in range(len(self.groups)):
                self.counters["pages_released"] += len(self.mapped(s, gi) - self.required(gi, int(new[b])))
            for gi, grp in enumerate(self.groups):
                for layer in grp.layers:
                    dst = self.rows[s][(gi, layer)]
                    if grp.kind == ObjectKind.SWA:
                        p = positions[b][valid[b]]
                        dst[p] = swa[layer][b][valid[b]]
                    else:
                        name = "compressor" if grp.kind == ObjectKind.COMPRESSED else "indexer"
                        first, entries, count = sealed[tail_of[(layer, name)]]
                        dst[first[b] : first[b] + count[b]] = entries[b, : count[b]]
            for ti, (_, name, _) in enumerate(lay.spec.compressors()):
                self.tails[s][ti] = tuple(np.array(a[b], np.float32) for a in tails[ti])
                if name == "compressor":
                    self.counters["entries_sealed"] += int(sealed[ti][2][b])
            self.length[s] = int(new[b])
        self.counters["pages_allocated"] += sum(need)
        self.counters["tokens_written"] += int(n.sum())
        self.counters["transitions"] += 1
        self.cache = cache
        return status

    # -------------------------------------------------------------------------------- checks
    def check(self) -> None:
        """check_invariants, and the host model == the cache (pages, counters, rows, tails)."""
        lay = self.layout
        check_invariants(lay, self.cache)
        # the fields compared below (a fetch costs per leaf: the pools are read through read_j)
        c = jax.device_get(
            self.cache.replace(groups=tuple(g.replace(pool=None) for g in self.cache.groups), prefix=None)
        )
        assert np.asarray(c.active).tolist() == self.active
        assert np.asarray(c.lengths).tolist() == self.length
        for gi in range(len(self.groups)):
            pt = np.asarray(c.groups[gi].page_table)
            for s in range(lay.slots):
                assert set(np.nonzero(pt[s] >= 0)[0].tolist()) == self.mapped(s, gi), (gi, s)
        assert {k: int(v) for k, v in c.counters.items()} == dict(self.counters)
        # every free bumps one page's generation: generations count the releases
        assert sum(int(np.asarray(g.generation).sum()) for g in c.groups) == self.counters["pages_released"]
        reads = iter(jax.device_get(read_j(lay, self.cache)))
        ps = lay.page_size
        for gi, grp in enumerate(self.groups):
            for layer in grp.layers:
                got = np.asarray(next(reads))  # [S, R, D]
                for s in range(lay.slots):
                    want = self.rows[s][(gi, layer)]
                    held = held_rows(lay, gi, self.length[s]) if self.active[s] else range(0)
                    held = slice(held.start, held.stop)
                    where = f"group {gi} ({grp.kind.name}) layer {layer} slot {s}"
                    assert not np.isnan(want[held]).any(), f"test bug: held rows never written: {where}"
                    np.testing.assert_array_equal(got[s, held], want[held], err_msg=where)
                    mapped = np.zeros(got.shape[1] // ps, bool)
                    mapped[list(self.mapped(s, gi))] = True
                    assert not got[s][~np.repeat(mapped, ps)].any(), f"{where}: unmapped rows read nonzero"
        for ti, _ in enumerate(lay.spec.compressors()):
            t = c.tails[ti]
            for s in range(lay.slots):
                for got, want in zip(
                    (t.tail_kv, t.tail_gate, t.overlap_kv, t.overlap_gate), self.tails[s][ti], strict=True
                ):
                    assert np.asarray(got[s]).tobytes() == want.tobytes(), f"tail {ti} slot {s}"


# --------------------------------------------------------------------------- state machine
class CacheMachine(RuleBasedStateMachine):
    """Random claim / append / release sequences; `Harness.check` after every rule."""

    LAYOUT: CacheLayout = DEEPSEEK_TIGHT
    SEEN: ClassVar[collections.Counter] = collections.Counter()  # statuses across a whole run (per subclass)

    def __init__(self):
        super().__init__()
        self.h = Harness(self.LAYOUT)

    def teardown(self):
        self.SEEN.update(self.h.statuses)

    def _active(self):
        return [s for s in range(self.LAYOUT.slots) if self.h.active[s]]

    def _inactive(self):
        return [s for s in range(self.LAYOUT.slots) if not self.h.active[s]]

    @rule()
    def claim(self):
        self.h.claim()

    @precondition(lambda self: any(self.h.active))
    @rule(data=st.data())
    def release(self, data):
        self.h.release(data.draw(st.sampled_from(self._active()), label="slot"))

    @precondition(lambda self: any(self.h.active))
    @rule(data=st.data())
    def append(self, data):
        """Append 1..C tokens to one or two active slots (may hit NO_PAGES / CONTEXT_CAP)."""
        act = self._active()
        slots = data.draw(
            st.lists(st.sampled_from(act), min_size=1, max_size=min(B, len(act)), unique=True), label="slots"
        )
        ns = [data.draw(st.integers(1, C), label="n") for _ in slots]
        pads = data.draw(
            st.lists(st.sampled_from([-1, *range(self.LAYOUT.slots)]), min_size=B, max_size=B), label="pad slots"
        )
        pad_len = data.draw(st.sampled_from([0, 5, 10**6]), label="pad length")
        perm = data.draw(st.permutations(range(B)), label="row order")
        self.h.append(
            list(zip(slots, ns, strict=True)), pads, pad_len, fused=data.draw(st.booleans(), label="fused"), perm=perm
        )

    @precondition(lambda self: any(self.h.active))
    @rule(data=st.data())
    def prefill(self, data):
        """A prompt's chunked prefill: up to 4 full chunks into one slot, checked after each."""
        s = data.draw(st.sampled_from(self._active()), label="slot")
        for _ in range(data.draw(st.integers(1, 4), label="chunks")):
            if self.h.append([(s, C)], fused=data.draw(st.booleans(), label="fused")) != Status.OK:
                break
            self.h.check()

    @precondition(lambda self: any(self.h.active))
    @rule(data=st.data())
    def decode(self, data):
        """The engine's decode step: slots = arange(S), one token for every active slot, idle rows 0."""
        rows = [(s, 1) for s in self._active()]
        pads = [s for s in range(self.LAYOUT.slots) if not self.h.active[s]]
        self.h.append(rows, pads, fused=data.draw(st.booleans(), label="fused"))

    @rule(data=st.data())
    def bad_request(self, data):
        """Requests that must fail and change nothing: release an unclaimed slot; reserve or
        release a slot id outside [0, slots)."""
        kinds = ["unknown reserve", "unknown release"] + (["release inactive"] if self._inactive() else [])
        kind = data.draw(st.sampled_from(kinds), label="request")
        if kind == "release inactive":
            assert self.h.release(data.draw(st.sampled_from(self._inactive()), label="slot")) == Status.SLOT_INACTIVE
        else:
            slot = data.draw(
                st.sampled_from([-2, -1, self.LAYOUT.slots, self.LAYOUT.slots + 1, 2**31 - 1]), label="slot"
            )
            self.h.unknown_slot(slot, reserve=kind == "unknown reserve")

    @rule(data=st.data())
    def append_bad(self, data):
        """A batch with a row that must fail (an inactive slot, a length past max_context), alone or
        next to a valid row: the whole batch fails."""
        act, inact = self._active(), self._inactive()
        cap = self.LAYOUT.config.max_context
        kind = data.draw(
            st.sampled_from((["inactive"] if inact else []) + (["past context"] if act else [])), label="bad row"
        )
        if kind == "inactive":
            bad = (data.draw(st.sampled_from(inact), label="slot"), data.draw(st.integers(1, C), label="n"))
        else:
            s = data.draw(st.sampled_from(act), label="slot")
            bad = (s, cap - self.h.length[s] + data.draw(st.integers(1, 3), label="excess"))
        rows = [bad]
        good = [a for a in act if a != bad[0] and self.h.length[a] < cap]
        if good and data.draw(st.booleans(), label="with a valid row"):
            rows.insert(data.draw(st.integers(0, 1), label="position"), (data.draw(st.sampled_from(good)), 1))
        want = Status.SLOT_INACTIVE if kind == "inactive" else Status.CONTEXT_CAP
        assert self.h.append(rows, fused=data.draw(st.booleans(), label="fused")) == want

    @invariant()
    def consistent(self):
        self.h.check()


class GemmaMachine(CacheMachine):
    LAYOUT = GEMMA_TIGHT
    SEEN: ClassVar[collections.Counter] = collections.Counter()


class DeepseekFullPoolMachine(CacheMachine):
    """Pools sized for every slot at max_context: NO_PAGES must never happen."""

    LAYOUT = DEEPSEEK_FULL
    SEEN: ClassVar[collections.Counter] = collections.Counter()


FAST = settings(
    max_examples=30,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.parametrize(
    "machine",
    [CacheMachine, GemmaMachine, pytest.param(DeepseekFullPoolMachine, marks=pytest.mark.slow)],  # slow: test-slow
    ids=lambda m: getattr(m, "__name__", str(m)),
)
def test_state_machine(machine):
    machine.SEEN.clear()
    run_state_machine_as_test(machine, settings=FAST)
    seen = machine.SEEN
    # the run exercised what it claims to: successes and every failure the layout can produce
    for name in ("OK", "SLOT_CAP", "SLOT_INACTIVE", "CONTEXT_CAP", "UNKNOWN_SLOT"):
        assert seen[name] > 0, (name, dict(seen))
    if machine is DeepseekFullPoolMachine:
        assert seen["NO_PAGES"] == 0
    else:
        assert seen["NO_PAGES"] > 0, dict(seen)


@pytest.mark.slow
@pytest.mark.parametrize("machine", [CacheMachine, GemmaMachine], ids=lambda m: m.__name__)
def test_state_machine_soak(machine):
    run_state_machine_as_test(
        machine, settings=settings(FAST, max_examples=200, stateful_step_count=80, derandomize=False)
    )


# ------------------------------------------------------------------------ focused unit tests
def _filled(layout=DEEPSEEK_TIGHT, chunks=(10, 10)) -> tuple[Harness, int]:
    h = Harness(layout)
    s = h.claim()
    for n in chunks:
        assert h.append([(s, n)]) == Status.OK
    h.check()
    return h, s


@pytest.mark.parametrize("fused", [False, True], ids=["stepwise", "fused"])
@pytest.mark.parametrize("pad", [-1, 0, 3])
def test_idle_rows_may_repeat_a_live_slot(pad, fused):
    """Padding rows (n = 0) may carry any slot id, including the live row's own slot, before or
    after it in the batch (regression: reserve leaked pages, advance lost lengths)."""
    h = Harness(DEEPSEEK_TIGHT)
    s = h.claim()
    for perm in ([0, 1, 2], [2, 1, 0], [1, 0, 2]):
        assert h.append([(s, 5)], [pad, pad], pad_len=10**6, fused=fused, perm=perm) == Status.OK
        h.check()
    assert h.length[s] == 15


def test_no_pages_fails_the_whole_batch_and_leaves_the_cache_unchanged():
    """Tight pools (COMPRESSED ratio 4: 5 pages, ratio 16: 2 pages): the batch that needs one page
    too many fails as a whole — the row that fits is not applied either — and fits after a release."""
    h, a = _filled(chunks=(10, 10, 10, 10))  # 40 tokens: 10 ratio-4 entries on 3 pages
    b = h.claim()
    for _ in range(3):
        assert h.append([(b, 10)]) == Status.OK  # 30 tokens: 7 entries on 2 pages; pool now full
    h.check()
    before = jax.device_get(h.cache)
    assert h.append([(a, 1), (b, 10)]) == Status.NO_PAGES  # a fits (41 tokens), b would need a 3rd page
    h.check()
    assert h.length == [40, 30, 0]
    assert int(h.cache.counters["failed_no_pages"]) == 1
    assert_bit_identical_except(before, h.cache, {"failed_no_pages": 1})
    old_pages = {
        gi: set(np.asarray(g.page_table[a])[np.asarray(g.page_table[a]) >= 0].tolist())
        for gi, g in enumerate(before.groups)
    }
    h.release(a)
    assert h.append([(b, 10)]) == Status.OK
    h.check()
    # b's new ratio-4 page is one a released, mapped at the page's new generation
    g = jax.device_get(h.cache.groups[1])
    new = [p for p in np.asarray(g.page_table[b]) if p >= 0 and p in old_pages[1]]
    assert new and all(g.generation[p] == 1 for p in new)


def test_first_failure_reports_the_first_failed_check_in_order():
    """reserve's status priority (UNKNOWN_SLOT, BAD_REQUEST, CONTEXT_CAP, SLOT_INACTIVE, NO_PAGES)
    comes from the order of the checks, not from the codes' values."""
    order = [Status.UNKNOWN_SLOT, Status.BAD_REQUEST, Status.CONTEXT_CAP, Status.SLOT_INACTIVE, Status.NO_PAGES]
    first = jax.jit(lambda flags: tr.first_failure(*[(flags[i], c) for i, c in enumerate(order)]))
    for bits in range(2 ** len(order)):
        flags = np.array([(bits >> i) & 1 for i in range(len(order))], bool)
        want = order[int(np.argmax(flags))] if flags.any() else Status.OK
        got = first(jnp.asarray(flags))
        assert got.dtype == jnp.int32 and int(got) == want, (flags, int(got), want)
    rev = tr.first_failure((jnp.array(True), Status.NO_PAGES), (jnp.array(True), Status.UNKNOWN_SLOT))
    assert int(rev) == Status.NO_PAGES
    with pytest.raises(ValueError, match=r"codes \[0\] must be failure Status values in \[1, 15\]"):
        tr.first_failure((jnp.array(True), Status.OK))


def test_release_then_reclaim_reads_only_the_new_sequence():
    """After a release, the slot reads nothing; re-claimed and written by a new sequence it reads
    that sequence's rows only, though it maps pages the old one had."""
    h, s = _filled(GEMMA_TIGHT, chunks=(10, 10))
    pages_before = [np.asarray(g.page_table[s]).copy() for g in jax.device_get(h.cache.groups)]
    h.release(s)
    h.check()
    reads = jax.device_get(read_j(h.layout, h.cache))
    assert not any(np.asarray(r[s]).any() for r in reads)
    s2 = h.claim()
    assert s2 == s and h.seq[s2] != 1
    assert h.append([(s2, 6)]) == Status.OK
    h.check()
    full = jax.device_get(read_j(h.layout, h.cache))[2]  # full-attention group, layer 1: [S, R, D]
    np.testing.assert_array_equal(full[s2, :6], np.stack([val(h.seq[s2], "swa", 1, r, 4) for r in range(6)]))
    reused = set(np.asarray(h.cache.groups[1].page_table[s2]).tolist()) & set(pages_before[1].tolist()) - {-1}
    assert reused, "the test meant to exercise page reuse"


def test_rows_past_the_length_do_not_show_a_previous_occupant():
    # reserve clears every page it maps, so a reused page never shows its previous occupant's rows
    h, s = _filled(GEMMA_TIGHT, chunks=(10, 10))
    h.release(s)
    s = h.claim()
    assert h.append([(s, 5)]) == Status.OK
    full = jax.device_get(read_j(h.layout, h.cache))[2]
    assert not full[s, 5:8].any(), full[s, 5:8, 0]  # rows 5..7 share page 1 with the held row 4


# forged caches: check_invariants must name what was forged
def _forge(cache, gi: int, **fields):
    groups = list(cache.groups)
    groups[gi] = groups[gi].replace(**{k: jnp.asarray(v) for k, v in fields.items()})
    return cache.replace(groups=tuple(groups))


def _refs(page_table, pool: int) -> np.ndarray:
    pt = np.asarray(page_table)
    return np.bincount(pt[pt >= 0], minlength=pool).astype(np.int32)


def test_a_mapping_from_before_a_release_is_stale():
    """Copy a slot's page-table row from before its release back (refcounts made consistent): the
    pages' generations moved on, so the mapping is recognised as stale — also once another
    sequence has reused and released the pages again."""
    h, s = _filled()
    before = jax.device_get(h.cache)
    h.release(s)
    for _ in range(2):
        c = jax.device_get(h.cache)
        check_invariants(h.layout, c)
        for gi, old in enumerate(before.groups):
            pt = np.asarray(c.groups[gi].page_table).copy()
            pt[s] = old.page_table[s]
            pg = np.asarray(c.groups[gi].page_gen).copy()
            pg[s] = old.page_gen[s]
            forged = _forge(c, gi, page_table=pt, page_gen=pg, refcount=_refs(pt, old.refcount.shape[0]))
            with pytest.raises(InvariantError, match=rf"group {gi}: slot {s} .* older generation"):
                check_invariants(h.layout, forged)
        # a new sequence takes the same slot and pages, then leaves: generations move on again
        s2 = h.claim()
        assert h.append([(s2, 10)]) == Status.OK
        h.release(s2)


def test_double_ownership_is_caught():
    """Fork a slot by copying its page-table row into another live slot without copying pages
    (refcounts bumped to match): the partially filled page both would write next is owned twice."""
    h, s = _filled(chunks=(10, 10, 2))  # 22 tokens: the SWA rows end mid-page
    t = h.claim()
    c = jax.device_get(h.cache)
    g = c.groups[0]
    pt, pg = np.asarray(g.page_table).copy(), np.asarray(g.page_gen).copy()
    pt[t], pg[t] = pt[s], pg[s]
    forged = _forge(c, 0, page_table=pt, page_gen=pg, refcount=_refs(pt, g.refcount.shape[0]))
    with pytest.raises(InvariantError, match=r"group 0: .*owned twice"):
        check_invariants(h.layout, forged)
    with pytest.raises(InvariantError, match=r"group 0: refcount != references"):  # refcounts left as they were
        check_invariants(h.layout, _forge(c, 0, page_table=pt, page_gen=pg))


@pytest.mark.parametrize("delta", [1, -1])
@pytest.mark.parametrize("used", [True, False], ids=["used-page", "free-page"])
def test_forged_refcount_is_caught(delta, used):
    h, _ = _filled()
    c = jax.device_get(h.cache)
    gi = 1  # COMPRESSED ratio 4
    rc = np.asarray(c.groups[gi].refcount).copy()
    page = int(np.nonzero(rc > 0)[0][0] if used else np.nonzero(rc == 0)[0][0])
    rc[page] += delta
    msg = "negative refcounts" if rc[page] < 0 else r"refcount != references"
    with pytest.raises(InvariantError, match=rf"group {gi}: {msg} at pages \[{page}"):
        check_invariants(h.layout, _forge(c, gi, refcount=rc))


@pytest.mark.parametrize("layout", [DEEPSEEK_TIGHT, GEMMA_TIGHT], ids=["deepseek", "gemma"])
def test_block_forms_on_the_host_equal_the_transitions(layout):
    """`check_invariants` computes the expected state-table forms with numpy; transitions with
    jax.numpy. Both agree at every length, for every slot."""
    cap = layout.config.max_context
    for start in range(0, cap + 1, layout.slots):
        lengths = np.minimum(np.arange(start, start + layout.slots), cap).astype(np.int32)
        host = tr.block_forms(layout, lengths)
        assert isinstance(host, np.ndarray) and host.dtype == np.uint8
        np.testing.assert_array_equal(host, np.asarray(tr.block_forms(layout, jnp.asarray(lengths))), str(lengths))


@pytest.mark.parametrize("kind", ["form", "residency", "indexer_version"])
def test_a_forged_state_table_entry_is_caught(kind):
    """One state-table entry of a live block that disagrees with the slot's length is named."""
    h, s = _filled()
    c = jax.device_get(h.cache)
    table = {k: np.asarray(getattr(c.table, k)).copy() for k in ("form", "residency", "indexer_version")}
    if kind == "form":
        table["form"][s, 1] ^= 0x1  # drop (or add) one object bit of the slot's second block
        match = rf"state table form of slot {s} block 1"
    elif kind == "residency":
        table["residency"][s, 0] = 0  # ABSENT while its objects are on device
        match = "residency disagrees"
    else:
        table["indexer_version"][s, 0] = 0  # a written block without a version
        match = "indexer versions"
    forged = c.replace(table=c.table.replace(**{kind: jnp.asarray(table[kind])}))
    with pytest.raises(InvariantError, match=match):
        check_invariants(h.layout, forged)
    check_invariants(h.layout, c)  # the untouched copy passes


def test_reads_past_capacity_are_not_aliased():
    """Row ids past the page table read 0 and are never written (they used to be clipped onto the
    last logical page: row m*ps aliased row (m-1)*ps)."""
    h, s = _filled(GEMMA_TIGHT, chunks=(10, 10, 10, 10, 8))  # 48 tokens = capacity of the full group
    lay = h.layout
    cap = lay.logical_pages(1) * lay.page_size
    past = jnp.array([[cap, cap + 1, cap + 5, 10**6]], jnp.int32)
    slots = jnp.array([s], jnp.int32)
    got = tr.read_rows(lay, h.cache, ObjectKind.SWA, 1, slots, past, jnp.ones(past.shape, bool))
    assert not np.asarray(got).any()
    cache = jax.jit(tr.write_swa, static_argnums=(0, 2))(
        lay, h.cache, 1, slots, past, jnp.full((1, 4, 4), 5.0), jnp.ones(past.shape, bool)
    )
    assert_bit_identical_except(h.cache, cache, {})


def test_layout_is_a_stable_static_argument():
    """An equal layout built again hits the same compilation; new values never retrace."""
    traces = []

    def counted(layout, cache, slots, new, mask):
        traces.append(layout)
        return tr.reserve(layout, cache, slots, new, mask)

    f = jax.jit(counted, static_argnums=0)
    for _ in range(2):
        lay = layout_of(deepseek_like_spec(), pool_pages=(8, 5, 2, 5))
        cache = init_cache(lay)
        for n in (1, 7):
            f(lay, cache, jnp.zeros(B, jnp.int32), jnp.full(B, n, jnp.int32), jnp.zeros(B, bool))
    assert len(traces) == 1
