"""The disk tier's lookup index (`SegmentIndex`): a bounded cache over the store, never a copy of it.

A lookup of a prompt's chain reads computed keys only, never a listing: the block pointer of every
block id (`blocks/<id[:2]>/<id>.json`, `hkv.store.records`, one ranged GET each, issued together),
then the manifests of the segments they name (one ranged GET each, of the size the pointer states),
for the ones not cached. Pointers are cached for `refresh_seconds` (as stale as the view may get;
a missing pointer too), manifests (immutable once published) until they fall out of the LRU; both
caches are bounded (`max_entries` pointers, `max_entries // 16` manifests, at least 16), so a
process's memory does not grow with the store. A pointer naming a segment whose manifest is gone (it
was evicted) or that fails its checks gives a ref that `read` refuses with the reason
(`disk_missing`, `disk_checksum`, ...); a damaged or forged pointer stops the chain with its reason
(`disk_malformed`, `disk_auth`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import time
from collections.abc import Iterable
from typing import Generic, TypeVar

from . import manifest as mf
from .blocks import ABI, MALFORMED, BlockRef, ChainLookup, Segment
from .context import Rejection, SmallFile, TierContext, manifest_key
from .coord import HotSegments
from .records import POINTER_BYTES, Holder, Pointer, fixed_result, parse_pointer, pointer_key, read_fixed

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """A dict of at most `cap` entries that forgets the least recently used first (not thread-safe:
    callers hold the tier's lock).

    Args:
        cap: the most entries held (>= 1).
    """

    def __init__(self, cap: int):
        self.cap = cap
        self.data: collections.OrderedDict[K, V] = collections.OrderedDict()

    def get(self, k: K) -> V | None:
        """The value of `k` (now the most recently used), or None."""
        v = self.data.get(k)
        if v is not None:
            self.data.move_to_end(k)
        return v

    def put(self, k: K, v: V) -> None:
        """Set `k`, forgetting the least recently used entries beyond `cap`."""
        self.data[k] = v
        self.data.move_to_end(k)
        while len(self.data) > self.cap:
            self.data.popitem(last=False)

    def pop(self, k: K) -> V | None:
        """Forget `k`; its value, or None."""
        return self.data.pop(k, None)

    def clear(self) -> None:
        """Forget everything."""
        self.data.clear()

    def __len__(self) -> int:
        return len(self.data)


@dataclasses.dataclass(frozen=True)
class Cached:
    """A block's pointer as last read: when (monotonic seconds), the pointer (None: none is stored),
    or why it was refused."""

    at: float
    pointer: Pointer | None
    rejection: Rejection | None = None


@dataclasses.dataclass(frozen=True)
class IndexSize:
    """What the lookup index holds now, and its bounds."""

    pointers: int
    segments: int
    max_pointers: int
    max_segments: int


def entry_map(doc: dict) -> dict[str, list[dict]]:
    """{block id: its entries in the manifest `doc`, in manifest order}.

    Args:
        doc: a checked manifest.
    Returns:
        The map.
    """
    out: dict[str, list[dict]] = {}
    for b in doc["blocks"]:
        out.setdefault(b["key"], []).append(b)
    return out


def segment_of(manifest_key_: str, doc: dict, raw: bytes) -> Segment:
    """The `Segment` of a checked manifest read as `raw`.

    Args:
        manifest_key_: where it is stored.
        doc: the checked manifest.
        raw: its bytes.
    Returns:
        The segment (its entries by block id included).
    """
    return Segment(
        abi=doc["abi"],
        name=doc["segment"],
        manifest_key=manifest_key_,
        manifest_bytes=len(raw),
        digest=hashlib.blake2b(raw, digest_size=16).digest(),
        doc=doc,
        stored_bytes=doc["stored_bytes"],
        created=float(doc.get("created", 0.0)),
        keys=tuple(b["key"] for b in doc["blocks"]),
        parents=tuple(b["parent"] for b in doc["blocks"]),
        entries=entry_map(doc),
    )


class SegmentIndex:
    """Bounded caches of block pointers and manifests, and the chain lookups over them.

    Args:
        ctx: the tier's shared state.
        refresh_seconds: how long a read pointer is trusted (how stale other writers' view may get).
        max_entries: the most pointers cached (manifests: `max_entries // 16`, at least 16).

    Attributes:
        pointers: LRU {block id: `Cached`} (guarded by `ctx.lock`).
        segments: LRU {(abi, segment): `Segment`} (guarded by `ctx.lock`).
        bad: LRU {manifest key: `Rejection`} of manifests a lookup refused (for diagnostics).
        hot: this writer's recently hit segments (`hkv.store.coord.HotSegments`).
        refresh_seconds: as above (assignable).
    """

    def __init__(self, ctx: TierContext, refresh_seconds: float, max_entries: int = 65536):
        if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 1:
            raise ValueError(f"max_index_entries={max_entries!r} must be an integer >= 1")
        self.ctx = ctx
        self.refresh_seconds = refresh_seconds
        self.pointers: LRU[str, Cached] = LRU(max_entries)
        self.segments: LRU[tuple[str, str], Segment] = LRU(max(16, max_entries // 16))
        self.bad: LRU[str, Rejection] = LRU(max(16, max_entries // 16))
        self.hot = HotSegments(ctx)

    def size(self) -> IndexSize:
        """What the caches hold now (`IndexSize`)."""
        with self.ctx.lock:
            return IndexSize(len(self.pointers), len(self.segments), self.pointers.cap, self.segments.cap)

    def refresh(self, force: bool = False) -> None:
        """`DiskTier.refresh`: with `force`, forget every cached pointer (the next lookup reads them
        again); without, nothing (cached pointers expire after `refresh_seconds` on their own).

        Args:
            force: forget the cached pointers now.
        """
        if force:
            with self.ctx.lock:
                self.pointers.clear()

    # ------------------------------------------------------------------------- caches
    def add(self, manifest_key_: str, doc: dict, raw: bytes, pointers: dict[str, Pointer | None] | None = None) -> None:
        """Cache a segment this tier published (and the pointers it wrote for it).

        Args:
            manifest_key_: where its manifest is.
            doc: the checked manifest.
            raw: the manifest's bytes, as published.
            pointers: {block id: the pointer as written}.
        """
        seg = segment_of(manifest_key_, doc, raw)
        now = time.monotonic()
        with self.ctx.lock:
            self.segments.put(seg.sid, seg)
            for b, p in (pointers or {}).items():
                self.pointers.put(b, Cached(now, p))

    def drop(self, sid: tuple[str, str], keys: Iterable[str] = ()) -> None:
        """Forget a segment and the cached pointers of its blocks `keys` (they are read again).

        Args:
            sid: (abi, segment).
            keys: its block ids.
        """
        with self.ctx.lock:
            seg = self.segments.pop(sid)
            for k in {*keys, *(seg.keys if seg is not None else ())}:
                self.pointers.pop(k)

    def get(self, sid: tuple[str, str]) -> Segment | None:
        """The cached segment `sid` ((abi, segment)), or None."""
        with self.ctx.lock:
            return self.segments.get(sid)

    def touch(self, sid: tuple[str, str]) -> None:
        """Record a restore from segment `sid` now (the evictor ranks least recently hit first)."""
        self.hot.touch(sid)

    def pointers_of(self, ids: list[str]) -> dict[str, Cached]:
        """The pointers of block `ids`: cached ones younger than `refresh_seconds`, the others read now
        (all reads issued together).

        Args:
            ids: block ids.
        Returns:
            {block id: `Cached`}.
        """
        now = time.monotonic()
        out: dict[str, Cached] = {}
        with self.ctx.lock:
            for b in ids:
                c = self.pointers.get(b)
                if c is not None and now - c.at < self.refresh_seconds:
                    out[b] = c
        reads = {b: read_fixed(self.ctx.kv, pointer_key(b), POINTER_BYTES) for b in dict.fromkeys(ids) if b not in out}
        fresh = {}
        for b, fut in reads.items():
            raw, _, why = fixed_result(fut)
            if raw is None:
                fresh[b] = Cached(
                    now, None, None if why is None else Rejection(MALFORMED, f"pointer of block {b}: {why}")
                )
                continue
            try:
                fresh[b] = Cached(now, parse_pointer(raw, b, self.ctx.key))
            except mf.ManifestError as e:
                fresh[b] = Cached(now, None, Rejection(e.reason, str(e)))
        with self.ctx.lock:
            for b, c in fresh.items():
                self.pointers.put(b, c)
        return out | fresh

    def segments_of(self, holders: Iterable[Holder]) -> dict[tuple[str, str], Segment]:
        """The checked manifests of the segments `holders` name: cached ones, the others read now (one
        ranged GET of the size the pointer states, all issued together; a bounded read where that
        fails). A missing or refused manifest is left out (a refused one is recorded in `bad`).

        Args:
            holders: pointer holders.
        Returns:
            {(abi, segment): `Segment`}.
        """
        out: dict[tuple[str, str], Segment] = {}
        want: dict[tuple[str, str], Holder] = {}
        with self.ctx.lock:
            for h in holders:
                seg = self.segments.get(h.sid)
                if seg is not None:
                    out[h.sid] = seg
                else:
                    want.setdefault(h.sid, h)
        futs = {
            sid: self.ctx.kv.read(manifest_key(*sid), byte_range=slice(0, h.manifest_bytes))
            for sid, h in want.items()
            if h.manifest_bytes > 0
        }
        for sid in want:
            got: SmallFile | None = None
            if sid in futs:
                try:
                    r = futs[sid].result()
                    got = SmallFile(bytes(r.value), None) if r.state == "value" else SmallFile(None, None)
                except Exception:  # shorter than the pointer says: read it bounded
                    got = None
            seg = self._checked(sid, got) if got is not None else None
            if seg is None and (got is None or got.raw is not None):  # another size than the pointer says
                name = manifest_key(*sid)
                seg = self._checked(sid, self.ctx.read_bounded([name], mf.MAX_MANIFEST_BYTES)[name], record=True)
            if seg is not None:
                out[sid] = seg
        return out

    def _checked(self, sid: tuple[str, str], got: SmallFile, record: bool = False) -> Segment | None:
        """Parse one read manifest; cache it, or (with `record`) record why it was refused."""
        name = manifest_key(*sid)
        if got.raw is None:
            if got.why is not None and record:
                with self.ctx.lock:
                    self.bad.put(name, Rejection(MALFORMED, got.why))
            return None
        try:
            doc = mf.parse(got.raw, key=self.ctx.key, abi=sid[0], segment=sid[1], max_data_bytes=self.ctx.budget_bytes)
        except mf.ManifestError as e:
            if record:
                with self.ctx.lock:
                    self.bad.put(name, Rejection(e.reason, str(e)))
            return None
        seg = segment_of(name, doc, got.raw)
        with self.ctx.lock:
            self.segments.put(sid, seg)
            self.bad.pop(name)
        return seg

    # ------------------------------------------------------------------------ lookups
    def contains(self, abi: str, key: bytes) -> tuple[bool, bool]:
        """(stored under `abi`, stored with a snapshot) for block `key`, as its pointer says (read at most
        `refresh_seconds` ago)."""
        c = self.pointers_of([self.ctx.block_id(key)])[self.ctx.block_id(key)]
        hs = [h for h in (c.pointer.holders if c.pointer is not None else ()) if h.abi == abi]
        live = self.segments_of(hs) if hs else {}  # a holder whose manifest is gone holds nothing
        hs = [h for h in hs if h.sid in live]
        return bool(hs), any(h.snapshot for h in hs)

    def find_chain(self, abi: str, keys: list[bytes], tokens: list[list[int]], start: int = 0) -> ChainLookup:
        """`DiskTier.find_chain` (same arguments, same `ChainLookup`) by GETs of computed keys: the
        chain's pointers, then the manifests they name. A pointer that is damaged or forged stops the
        chain with its reason (`disk_malformed`, `disk_auth`), counted as a rejection."""
        ctx = self.ctx
        ids = [ctx.block_id(keys[i]) for i in range(start, len(keys))]
        ptrs = self.pointers_of(ids)
        ours = {
            h.sid: h for b in ids if (p := ptrs[b].pointer) is not None for h in p.holders if h.abi == abi
        }  # every segment the chain's pointers name under `abi`, read together
        segs = self.segments_of(ours.values()) if ours else {}
        refs: list[BlockRef] = []
        for i, b in zip(range(start, len(keys)), ids, strict=True):
            c = ptrs[b]
            if c.rejection is not None:
                with ctx.lock:
                    ctx.counters[f"rejected_{c.rejection.reason}"] += 1
                return ChainLookup(refs, c.rejection.reason)
            holders = c.pointer.holders if c.pointer is not None else ()
            mine = [h for h in holders if h.abi == abi]
            if not mine:
                return ChainLookup(refs, ABI if holders else "absent")
            cands = [(segs[h.sid], e) for h in mine if h.sid in segs for e in segs[h.sid].entries.get(b, ())]
            gone = [h for h in mine if h.sid not in segs]
            if not cands and gone:  # its manifest is gone or refused: a ref the read refuses with the reason
                refs.append(self._gone_ref(gone[-1], b, i, keys, tokens))
                continue
            if not cands:  # the segments it names do not list it
                return ChainLookup(refs, "absent")
            want = ctx.tokens_field(tokens[i])
            same = [(s, e) for s, e in cands if e["tokens"] == want and e["index"] == i]
            if not same:
                return ChainLookup(refs, "collision")
            seg, entry = max(same, key=lambda x: (x[1]["snapshot"], x[0].created))
            parent = keys[i - 1] if i > 0 and entry["parent"] == ctx.block_id(keys[i - 1]) else None
            refs.append(
                BlockRef(
                    seg.abi,
                    seg.name,
                    entry,
                    raw_key=bytes(keys[i]),
                    raw_parent=parent,
                    raw_tokens=tuple(map(int, tokens[i])),
                )
            )
        return ChainLookup(refs, None)

    def _gone_ref(self, h: Holder, b: str, i: int, keys: list[bytes], tokens: list[list[int]]) -> BlockRef:
        """A ref to block i in segment `h`, whose manifest is gone (deleted since its pointer was
        written) or refused (damaged, forged): `read` re-reads the manifest first and refuses it with
        its reason (`disk_missing`, `disk_checksum`, `disk_abi`, `disk_auth`, `disk_malformed`); a
        manifest that passes would not list this entry (built here, objects unknown): never a block."""
        ctx = self.ctx
        entry = {
            "key": b,
            "parent": ctx.block_id(keys[i - 1]) if i > 0 else "",
            "index": i,
            "length": (i + 1) * len(tokens[i]),
            "tokens": ctx.tokens_field(tokens[i]),
            "indexer_version": 0,
            "snapshot": h.snapshot,
            "objects": [],
        }
        return BlockRef(h.abi, h.segment, entry, bytes(keys[i]), keys[i - 1] if i > 0 else None, tuple(tokens[i]))


def refs_of(abi: str, segment: str, doc: dict) -> list[BlockRef]:
    """The refs of every block a checked manifest lists, grouped by block id in first-listed order (a
    block listed twice, with and without its snapshot, gives two refs).

    Args:
        abi: its ABI fingerprint.
        segment: its name.
        doc: the checked manifest.
    Returns:
        The refs.
    """
    return [BlockRef(abi, segment, e) for es in entry_map(doc).values() for e in es]


__all__ = ["LRU", "Cached", "IndexSize", "SegmentIndex", "entry_map", "refs_of", "segment_of"]
