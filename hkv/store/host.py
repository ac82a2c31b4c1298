"""`HostTier`: sealed prefix blocks kept in host memory, with the disk tier's lookups, values and checks.

The tier between device memory and `hkv.store.tier.DiskTier` (compose them with
`hkv.store.tiered.TieredStore`), or on its own as `Engine(..., disk=HostTier(...))` (a bounded,
volatile prefix tier: what it evicts is gone). It speaks the disk tier's protocol and returns its
values (`BlockPayload`, `BlockRef`, `ChainLookup`, `ReadResult`): blocks are found by (ABI
fingerprint, block key) with equal token ids, a key may be held with and without its snapshot, and a
read verifies every block before returning it, stopping at the first bad one with a reason the
engine already knows (`disk_missing`: evicted since the lookup; `disk_checksum`: the bytes or the
objects the engine needs disagree), so a damaged host block is a shorter plan, never a wrong token.

Storage and integrity: a block entering the tier (written, or promoted from disk) is copied into one
buffer (its objects at 64-byte aligned offsets, as a segment lays them out on disk) and its digest
computed; every read checks the digest, then each object's dtype and shape against the block's entry
and the engine's expectation, and returns read-only views of the buffer (no copy: restoring a block
costs one digest pass over its bytes). The default digest is `sum64` (`hkv.store.digest`: a
lane-weighted 64-bit sum at memory-read speed; zlib's crc32 alone would hold a restore to ~30% of
this machine's memcpy); `check="crc32"` uses zlib's crc32 instead (~4x slower). Host memory is private to this
process, so there is no authentication (a keyed `DiskTier` still authenticates what is spilled to it).

Budget: over `budget_bytes`, blocks leave leaves-first (a block no stored block extends), least
recently used first (a hit or write makes a block most recent: promotion on hit), and among equally
recent ones the shortest prefix first (the cheapest to recompute). A block already copied below is
dropped at once; others are handed to `spill` (set by `TieredStore`: written to the disk tier) and
stay readable until that write resolves, then dropped (a failed spill drops them too, counted in
`spill_failures`). Without `spill`, an evicted block is gone.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import heapq
import threading
from collections.abc import Callable

import numpy as np

from .blocks import ABI, CHECKSUM, MISSING, BlockPayload, BlockRef, ChainLookup, ReadResult, dtype_of
from .digest import CHECKS, digest, digest_many
from .tier import DiskTierClosedError

HOST_SEGMENT = "@host"  # BlockRef.segment of a host-tier block ('@' never starts a disk segment name)
# (abi, payloads) -> a future that resolves once they are stored below (raises if they are not)
Spill = Callable[[str, list[BlockPayload]], concurrent.futures.Future]


ALIGN = 64  # objects start at multiples of this many bytes in a block's buffer


def pack(
    objects: dict[str, tuple[np.ndarray, int]],
) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, int]], list[dict]]:
    """One block's objects copied into one buffer (so that one digest pass covers the block).

    Args:
        objects: name -> (array, row_start), as in `BlockPayload.objects`.
    Returns:
        (the buffer: uint8[total bytes, each object at a multiple of `ALIGN`], name -> (a read-only
        view of the buffer with the array's dtype and shape, row_start), the objects as listed in a
        host entry: {"name", "dtype", "shape", "row_start", "offset", "nbytes"}).
    Raises:
        ValueError: an object whose dtype no manifest names.
    """
    listed, off = [], 0
    for name, (a, row) in objects.items():
        a = np.asarray(a)
        dtype_of(a.dtype.name)  # a dtype a manifest can name (ValueError otherwise)
        listed.append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape), "row_start": int(row),
                       "offset": off, "nbytes": int(a.nbytes)})  # fmt: skip
        off += -(-a.nbytes // ALIGN) * ALIGN
    buf = np.empty(off, np.uint8)
    views = {}
    for o, (a, _) in zip(listed, objects.values(), strict=True):
        part = buf[o["offset"] : o["offset"] + o["nbytes"]]
        part[:] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        v = part.view(np.asarray(a).dtype).reshape(o["shape"])
        v.flags.writeable = False
        views[o["name"]] = (v, o["row_start"])
    return buf, views, listed


def mismatch(ref: BlockRef, objects: dict[str, tuple[np.ndarray, int]], expect) -> str | None:
    """Why a block's objects are not what the engine needs (None: they are, or `expect` is None).

    Args:
        ref: the block's ref (passed to `expect`).
        objects: name -> (array, row_start), as in `BlockPayload.objects`.
        expect: `BlockRef` -> {object name: (dtype, shape)}, or None.
    Returns:
        A sentence naming the objects, dtypes or shapes that differ, or None.
    """
    if expect is None:
        return None
    want = expect(ref)
    if set(want) != set(objects):
        return f"block {ref.entry['index']} holds objects {sorted(objects)}, the engine needs {sorted(want)}"
    for name, (a, _) in objects.items():
        dt, shape = want[name]
        if np.dtype(dt) != a.dtype or tuple(shape) != a.shape:
            need = f"{np.dtype(dt).name}{list(shape)}"
            return (
                f"object {name} of block {ref.entry['index']} is {a.dtype.name}{list(a.shape)}, the engine needs {need}"
            )
    return None


@dataclasses.dataclass
class HostBlock:
    """One block held by a `HostTier`.

    abi: its ABI fingerprint. buf: its objects' bytes (`pack`). payload: the block, its objects
    read-only views of `buf`. entry: its manifest-like entry (the `BlockRef.entry` lookups return:
    objects with their offsets, and the digest of `buf`). nbytes: bytes held (`buf`). serial: unique
    per insertion (a ref to an evicted and re-added block is stale). last_used: the tier's clock at
    its last write or hit. clean: a copy is stored below (promoted from the disk tier, or spilled).
    leaving: handed to `spill`, dropped once that resolves.
    """

    abi: str
    buf: np.ndarray
    payload: BlockPayload
    entry: dict
    nbytes: int
    serial: int
    last_used: int
    clean: bool
    leaving: bool = False


class HostTier:
    """Sealed prefix blocks in host memory (see the module docstring).

    Args:
        budget_bytes: object bytes the tier may hold (None: unbounded); over it, blocks leave
            leaves-first, least recently used first, shortest prefix first.
        check: the per-object digest, one of `CHECKS` ("sum64": memory speed; "crc32": zlib's).
        spill: (abi, payloads) -> future, called with evicted blocks that have no copy below (None:
            they are dropped). `TieredStore` sets it to write them to its disk tier.
        progress: called with a line per eviction pass (None: silent).

    Attributes: `budget_bytes`, `check`, `spill`, `progress` (reassignable), `spec` ("host"),
    `counters` (writes, reads, evictions, spills, rejections per reason; the keys the engine's disk
    metrics read are those of `DiskTier.counters`).
    """

    spec = "host"

    def __init__(
        self,
        budget_bytes: int | None = None,
        *,
        check: str = "sum64",
        spill: Spill | None = None,
        progress: Callable[[str], None] | None = None,
    ):
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
            raise ValueError(f"{budget_bytes=} must be an integer >= 0 or None")
        if check not in CHECKS:
            raise ValueError(f"check={check!r} must be one of {CHECKS}")
        self.budget_bytes, self.check, self.spill, self.progress = budget_bytes, check, spill, progress
        self._lock = threading.RLock()
        self._blocks: dict[tuple[str, bytes, bool], HostBlock] = {}
        self._abis: dict[bytes, set[str]] = {}  # key -> the ABIs holding it
        self._kids: dict[tuple[str, bytes], int] = {}  # (abi, key) -> staying blocks naming it as parent
        self._bytes = self._leaving = 0
        self._clock = self._serial = 0
        self._spills: set[concurrent.futures.Future] = set()
        self._closed = False
        self.counters = {
            "blocks_written": 0,
            "bytes_written": 0,
            "write_failures": 0,
            "writes_dropped": 0,
            "blocks_read": 0,
            "bytes_read": 0,
            "blocks_evicted": 0,
            "bytes_evicted": 0,
            "blocks_spilled": 0,
            "spill_failures": 0,
            "blocks_promoted": 0,
            "rejected_disk_missing": 0,
            "rejected_disk_checksum": 0,
        }

    # ------------------------------------------------------------------------------ state
    @property
    def closed(self) -> bool:
        """Whether `close()` was called (the tier then holds nothing; writes, reads and lookups raise
        `DiskTierClosedError`)."""
        return self._closed

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise DiskTierClosedError(f"HostTier.{op}: this HostTier was closed (close() was called); build a new one")

    def stored_bytes(self) -> int:
        """Object bytes held now (blocks being spilled included)."""
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        """Blocks held now (a key held with and without its snapshot counts twice)."""
        with self._lock:
            return len(self._blocks)

    def holds(self, abi: str, key: bytes, snapshot: bool | None = None) -> bool:
        """Whether block `key` is held under `abi` (with its snapshot / without / either: None)."""
        with self._lock:
            snaps = (True, False) if snapshot is None else (snapshot,)
            return any((abi, bytes(key), s) in self._blocks for s in snaps)

    def contains(self, abi: str, key: bytes) -> tuple[bool, bool]:
        """(held under `abi`, held with a snapshot) for block `key` (`DiskTier.contains`).

        Args:
            abi: the ABI fingerprint.
            key: the engine's block key.
        Returns:
            (held, held with a snapshot).
        """
        with self._lock:
            snap = (abi, bytes(key), True) in self._blocks
            return snap or (abi, bytes(key), False) in self._blocks, snap

    # ----------------------------------------------------------------------------- lookup
    def find_chain(self, abi: str, keys: list[bytes], tokens: list[list[int]], start: int = 0) -> ChainLookup:
        """The held blocks keys[start], keys[start + 1], ... as long as each is held under `abi` with
        equal token ids and index (`DiskTier.find_chain`; a copy with its snapshot preferred). No
        data is read.

        Args:
            abi: the ABI fingerprint.
            keys: the prompt's block keys.
            tokens: the token ids of each block.
            start: the first block looked up.
        Returns:
            A `ChainLookup`: stop None (every key held), "absent", "collision", or `disk_abi` (held
            only under another ABI).
        """
        self._check_open("find_chain")
        refs: list[BlockRef] = []
        with self._lock:
            for i in range(start, len(keys)):
                k = bytes(keys[i])
                cands = [b for s in (True, False) if (b := self._blocks.get((abi, k, s))) is not None]
                if not cands:
                    return ChainLookup(refs, ABI if self._abis.get(k) else "absent")
                want = [int(t) for t in tokens[i]]
                same = [b for b in cands if b.payload.index == i and b.payload.tokens == want]
                if not same:
                    return ChainLookup(refs, "collision")
                b = same[0]
                parent = bytes(keys[i - 1]) if i > 0 and b.payload.parent == bytes(keys[i - 1]) else None
                refs.append(BlockRef(abi, HOST_SEGMENT, b.entry, raw_key=k, raw_parent=parent, raw_tokens=tuple(want)))
        return ChainLookup(refs, None)

    def ref_of(self, abi: str, key: bytes, snapshot: bool) -> BlockRef | None:
        """The host ref of block `key` held under `abi` with (or without) its snapshot, or None.

        Args:
            abi: the ABI fingerprint.
            key: the block key.
            snapshot: which copy.
        Returns:
            A `BlockRef` (segment `HOST_SEGMENT`) or None.
        """
        with self._lock:
            b = self._blocks.get((abi, bytes(key), snapshot))
            if b is None:
                return None
            p = b.payload
            return BlockRef(abi, HOST_SEGMENT, b.entry, p.key, p.parent, tuple(p.tokens))

    # ------------------------------------------------------------------------------- read
    def read(
        self,
        refs: list[BlockRef],
        expect: Callable[[BlockRef], dict[str, tuple[np.dtype, tuple]]] | None = None,
        count: bool = True,
    ) -> ReadResult:
        """Verify and return the blocks `refs` (in order; `DiskTier.read`): the leading blocks that
        passed every check, and why the first failing one did not: `disk_missing` (not a host ref,
        or evicted since the lookup), `disk_checksum` (an object's digest, or the objects, dtypes or
        shapes the engine needs, disagree). A verified block becomes the most recently used.

        Args:
            refs: blocks from `find_chain` / `ref_of`.
            expect: `BlockRef` -> {object name: (dtype, shape)} the running engine needs for it.
            count: False: no hit or rejection is counted, and recency is left alone.
        Returns:
            A `ReadResult` whose payloads hold read-only views of the stored arrays.
        """
        self._check_open("read")
        with self._lock:  # the blocks as they are now (verified outside the lock: their bytes never change)
            held = [self._held(ref) for ref in refs]
        out: list[BlockPayload] = []
        reason = detail = None
        sums = digest_many([None if b is None else b.buf for b in held], self.check)  # the costly pass, every core
        for ref, b, got in zip(refs, held, sums, strict=True):
            reason, detail, payload = self._verified(ref, b, expect, got)
            if reason is not None:
                break
            out.append(payload)
        if count:
            with self._lock:
                if reason is not None:
                    self.counters[f"rejected_{reason}"] += 1
                for b in held[: len(out)]:
                    self._clock += 1
                    b.last_used = self._clock
                self.counters["blocks_read"] += len(out)
                self.counters["bytes_read"] += sum(b.nbytes for b in held[: len(out)])
        return ReadResult(out, reason, detail or "")

    def _held(self, ref: BlockRef) -> HostBlock | None:
        """The block `ref` names if it is still held (lock held), else None."""
        e = ref.entry
        if ref.segment != HOST_SEGMENT or "serial" not in e:
            return None
        b = self._blocks.get((ref.abi, bytes.fromhex(e["key"]), bool(e["snapshot"])))
        return b if b is not None and b.serial == e["serial"] else None

    def _verified(
        self, ref: BlockRef, b: HostBlock | None, expect, got: int | None
    ) -> tuple[str | None, str, BlockPayload | None]:
        """(None, "", payload) when block `b` (`ref`'s, None: not held) whose buffer's digest is `got`
        passes every check, else (reason, detail, None)."""
        e = ref.entry
        if ref.segment != HOST_SEGMENT or "serial" not in e:
            return MISSING, f"host tier: block {e.get('index')} is not a host-tier ref ({ref.segment})", None
        if b is None:
            return MISSING, f"host tier: block {e['index']} was evicted since it was looked up", None
        if got != e["digest"]:
            return CHECKSUM, f"host tier: block {e['index']} fails its {self.check} (host memory changed)", None
        objects = b.payload.objects
        for o in e["objects"]:
            a = objects[o["name"]][0]
            if a.dtype.name != o["dtype"] or list(a.shape) != o["shape"]:
                return (
                    CHECKSUM,
                    f"host tier: object {o['name']} of block {e['index']} is {a.dtype.name}{list(a.shape)}, "
                    f"its entry says {o['dtype']}{o['shape']}",
                    None,
                )
        bad = mismatch(ref, objects, expect)
        if bad is not None:
            return CHECKSUM, f"host tier: {bad}", None
        p = b.payload
        return (
            None,
            "",
            BlockPayload(
                p.key, p.parent, p.index, p.length, list(p.tokens), p.indexer_version, p.snapshot, dict(objects)
            ),
        )

    # ------------------------------------------------------------------------------ write
    def put(self, abi: str, blocks: list[BlockPayload], clean: bool = False) -> list[bytes]:
        """Hold a packed copy of `blocks` (replacing a held copy of the same key and snapshot) with its
        digest (`pack`, `digest`), then evict down to the budget.

        Args:
            abi: the ABI fingerprint (32 hex digits).
            blocks: the blocks (`BlockPayload`s with host arrays).
            clean: a copy is already stored below (promoted from the disk tier): evicting them
                writes nothing.
        Returns:
            The block keys, in order.
        Raises:
            ValueError: an `abi` that is not 32 hex digits, or a block whose dtype no manifest names.
        """
        if not isinstance(abi, str) or len(abi) != 32 or any(c not in "0123456789abcdef" for c in abi):
            raise ValueError(f"abi={abi!r} must be 32 lowercase hex digits (CacheSpec.fingerprint())")
        made = [self._block(abi, pl, clean) for pl in blocks]
        with self._lock:
            self._check_open("put")
            for b in made:
                self._clock += 1
                self._serial += 1
                b.serial = b.entry["serial"] = self._serial
                b.last_used = self._clock
                old = self._blocks.get((abi, b.payload.key, b.payload.snapshot))
                if old is not None:
                    self._remove(old)
                self._add(b)
                self.counters["blocks_written" if not clean else "blocks_promoted"] += 1
                self.counters["bytes_written"] += (not clean) * b.nbytes
        self.enforce_budget()
        return [pl.key for pl in blocks]

    def _block(self, abi: str, pl: BlockPayload, clean: bool) -> HostBlock:
        """A `HostBlock` holding a packed copy of payload `pl` and its digest."""
        buf, objects, listed = pack(pl.objects)
        payload = dataclasses.replace(pl, key=bytes(pl.key), parent=None if pl.parent is None else bytes(pl.parent),
                                      tokens=[int(t) for t in pl.tokens], objects=objects)  # fmt: skip
        entry = {
            "key": payload.key.hex(),
            "parent": payload.parent.hex() if payload.parent is not None else "",
            "index": int(pl.index),
            "length": int(pl.length),
            "tokens": payload.tokens,
            "indexer_version": int(pl.indexer_version),
            "snapshot": bool(pl.snapshot),
            "serial": 0,
            "digest": digest(buf, self.check),
            "objects": listed,
        }
        return HostBlock(abi, buf, payload, entry, int(buf.nbytes), 0, 0, clean)

    def write_async(self, abi: str, blocks: list[BlockPayload]) -> concurrent.futures.Future:
        """`put` now (host memory: no queue), as `DiskTier.write_async`'s future.

        Args:
            abi: the ABI fingerprint (32 hex digits).
            blocks: at least one block.
        Returns:
            A resolved future: the block keys, or the exception `put` raised.
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            fut.set_result(self.put(abi, blocks))
        except Exception as e:  # the engine reads failures from the future, as from the disk tier
            with self._lock:
                self.counters["write_failures"] += 1
            fut.set_exception(e)
        return fut

    def write(self, abi: str, blocks: list[BlockPayload]) -> list[bytes]:
        """`put` (`DiskTier.write`'s signature). Returns the block keys."""
        return self.put(abi, blocks)

    def _add(self, b: HostBlock) -> None:
        p = b.payload
        self._blocks[(b.abi, p.key, p.snapshot)] = b
        self._abis.setdefault(p.key, set()).add(b.abi)
        if p.parent is not None:
            self._kids[(b.abi, p.parent)] = self._kids.get((b.abi, p.parent), 0) + 1
        self._bytes += b.nbytes

    def _remove(self, b: HostBlock) -> None:
        """Forget `b` (lock held)."""
        p = b.payload
        if self._blocks.get((b.abi, p.key, p.snapshot)) is not b:
            return
        del self._blocks[(b.abi, p.key, p.snapshot)]
        if not any((b.abi, p.key, s) in self._blocks for s in (True, False)):
            self._abis[p.key].discard(b.abi)
            if not self._abis[p.key]:
                del self._abis[p.key]
        if b.leaving:
            self._leaving -= b.nbytes
        elif p.parent is not None:
            self._unkid(b.abi, p.parent)
        self._bytes -= b.nbytes

    def _unkid(self, abi: str, parent: bytes) -> None:
        n = self._kids[(abi, parent)] - 1
        if n:
            self._kids[(abi, parent)] = n
        else:
            del self._kids[(abi, parent)]

    # ----------------------------------------------------------------------------- budget
    def enforce_budget(self) -> int:
        """Evict until the bytes that stay fit `budget_bytes` (see the module docstring): clean
        blocks are dropped, the others handed to `spill` (dropped once it resolves) or, without
        one, dropped. Returns the blocks evicted."""
        by_abi: dict[str, list[HostBlock]] = {}
        dropped = 0
        with self._lock:
            if self.budget_bytes is None or self._bytes - self._leaving <= self.budget_bytes:
                return 0
            heap = [self._rank(b) for b in self._blocks.values() if not b.leaving and self._leaf(b)]
            heapq.heapify(heap)
            while heap and self._bytes - self._leaving > self.budget_bytes:
                *_, b = heapq.heappop(heap)
                if b.leaving or self._blocks.get((b.abi, b.payload.key, b.payload.snapshot)) is not b:
                    continue
                self.counters["blocks_evicted"] += 1
                self.counters["bytes_evicted"] += b.nbytes
                parent = b.payload.parent
                if b.clean or self.spill is None:
                    self._remove(b)
                    dropped += 1
                else:
                    b.leaving = True
                    self._leaving += b.nbytes
                    if parent is not None:
                        self._unkid(b.abi, parent)
                    by_abi.setdefault(b.abi, []).append(b)
                if parent is not None:  # its parent may have become a leaf
                    for s in (True, False):
                        q = self._blocks.get((b.abi, parent, s))
                        if q is not None and not q.leaving and self._leaf(q):
                            heapq.heappush(heap, self._rank(q))
        for abi, gone in by_abi.items():
            self._hand_off(abi, gone)
        n = dropped + sum(map(len, by_abi.values()))
        if n and self.progress is not None:
            self.progress(f"host tier: evicted {n} blocks ({sum(map(len, by_abi.values()))} spilled below)")
        return n

    def _leaf(self, b: HostBlock) -> bool:
        return (b.abi, b.payload.key) not in self._kids

    @staticmethod
    def _rank(b: HostBlock) -> tuple:
        """Eviction order: least recently used, then shortest prefix (cheapest to recompute)."""
        return (b.last_used, b.payload.length, b.serial, b)

    def _hand_off(self, abi: str, gone: list[HostBlock]) -> None:
        """Spill `gone` (marked leaving) and drop them once the spill resolves."""
        try:
            fut = self.spill(abi, [b.payload for b in gone])
        except Exception as e:  # a closed or failing tier below: the blocks are dropped
            fut = concurrent.futures.Future()
            fut.set_exception(e)

        def done(f: concurrent.futures.Future) -> None:
            with self._lock:
                self._spills.discard(f)
                failed = f.cancelled() or f.exception() is not None
                self.counters["spill_failures" if failed else "blocks_spilled"] += len(gone)
                for b in gone:
                    self._remove(b)

        with self._lock:
            self._spills.add(fut)
        fut.add_done_callback(done)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the spills in flight (their blocks are then dropped).

        Args:
            timeout: seconds at most (None: no limit).
        """
        with self._lock:
            pending = list(self._spills)
        concurrent.futures.wait(pending, timeout)

    def dirty(self) -> dict[str, list[BlockPayload]]:
        """The held blocks with no copy below and not being spilled, per ABI, parents first.

        Returns:
            {abi: payloads in order of prefix length}.
        """
        with self._lock:
            out: dict[str, list[BlockPayload]] = {}
            for b in sorted(self._blocks.values(), key=lambda b: b.payload.length):
                if not b.clean and not b.leaving:
                    out.setdefault(b.abi, []).append(b.payload)
            return out

    def mark_clean(self, abi: str, keys: list[bytes]) -> None:
        """Record that blocks `keys` held under `abi` now have a copy below (evicting them writes nothing).

        Args:
            abi: the ABI fingerprint.
            keys: block keys.
        """
        with self._lock:
            for k in keys:
                for s in (True, False):
                    b = self._blocks.get((abi, bytes(k), s))
                    if b is not None:
                        b.clean = True

    def close(self) -> None:
        """Wait for the spills in flight and drop every block; `closed` is then True (a second call does nothing)."""
        if self._closed:
            return
        self.flush()
        with self._lock:
            self._closed = True
            self._blocks.clear()
            self._abis.clear()
            self._kids.clear()
            self._bytes = self._leaving = 0


__all__ = ["ALIGN", "CHECKS", "HOST_SEGMENT", "HostBlock", "HostTier", "digest", "mismatch", "pack"]
