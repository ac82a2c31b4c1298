"""The disk tier's in-memory index of published segments (`SegmentIndex`): the listing of the store's
manifests (`refresh`), every block they list by key, and the chain lookups (`contains`, `find_chain`).
A manifest that cannot be read or parsed is recorded as bad with its reason, never indexed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time

import tensorstore as ts

from . import manifest as mf
from .blocks import ABI, MALFORMED, BlockRef, ChainLookup, Segment
from .context import Rejection, TierContext, manifest_where


class SegmentIndex:
    """The published segments of the store as of the last `refresh`, and the blocks they list.

    Args:
        ctx: the tier's shared state.
        refresh_seconds: how stale the in-memory view of other writers' manifests may get.

    Attributes:
        segments: {(abi, segment): `Segment`} (guarded by `ctx.lock`).
        blocks: {block key hex: [`BlockRef`] in any ABI} (guarded by `ctx.lock`).
        bad: {manifest key: `Rejection`} of the manifests refused when listed.
        refresh_seconds: as above (assignable).
    """

    def __init__(self, ctx: TierContext, refresh_seconds: float):
        self.ctx = ctx
        self.refresh_seconds = refresh_seconds
        self.segments: dict[tuple[str, str], Segment] = {}
        self.blocks: dict[str, list[BlockRef]] = {}  # key hex -> refs in any ABI
        self.bad: dict[str, Rejection] = {}  # manifest key -> (reason, why) it was rejected
        self._refreshed = -math.inf

    def refresh(self, force: bool = False) -> None:
        """`DiskTier.refresh`: re-list the published manifests; a bad one is recorded in `bad`, never
        indexed, and nothing it holds raises out of here.

        Args:
            force: list even when the last listing is younger than `refresh_seconds`.
        """
        if not force and time.monotonic() - self._refreshed < self.refresh_seconds:
            return
        ctx = self.ctx
        names = [
            k.decode(errors="replace") for k in ctx.kv.list(ts.KvStore.KeyRange("manifests/", "manifests0")).result()
        ]
        names = [n for n in names if n.endswith(".json")]
        with ctx.lock:
            known = {s.manifest_key: sid for sid, s in self.segments.items()}
            for gone in set(known) - set(names):
                self.drop(known[gone])
            for gone in set(self.bad) - set(names):  # a rejected manifest deleted since
                del self.bad[gone]
            new = [n for n in names if n not in known and n not in self.bad]
        where = {}
        for n in new:
            w = manifest_where(n)
            if w is None:
                self.bad[n] = Rejection(MALFORMED, "not a manifest name (manifests/<32 hex abi>/<segment>.json)")
            else:
                where[n] = w
        for n, (raw, why) in ctx.read_bounded(list(where), mf.MAX_MANIFEST_BYTES).items():
            if raw is None:
                if why is not None:
                    self.bad[n] = Rejection(MALFORMED, why)
                continue
            try:
                doc = mf.parse(raw, key=ctx.key, abi=where[n][0], segment=where[n][1], max_data_bytes=ctx.budget_bytes)
            except mf.ManifestError as e:
                self.bad[n] = Rejection(e.reason, str(e))
                continue
            self.add(n, doc, raw)
        self._refreshed = time.monotonic()

    def add(self, manifest_key: str, doc: dict, raw: bytes) -> None:
        """Index a published segment (once: a second add of it does nothing).

        Args:
            manifest_key: where its manifest is.
            doc: the checked manifest.
            raw: the manifest's bytes, as published.
        """
        seg = Segment(
            abi=doc["abi"],
            name=doc["segment"],
            manifest_key=manifest_key,
            manifest_bytes=len(raw),
            digest=hashlib.blake2b(raw, digest_size=16).digest(),
            doc=doc,
            stored_bytes=doc["stored_bytes"],
            created=float(doc.get("created", 0.0)),
            keys=tuple(b["key"] for b in doc["blocks"]),
            parents=tuple(b["parent"] for b in doc["blocks"]),
        )
        with self.ctx.lock:
            if seg.sid in self.segments:  # a refresh and the writer thread both saw it published
                return
            self.segments[seg.sid] = seg
            for b in doc["blocks"]:
                self.blocks.setdefault(b["key"], []).append(BlockRef(seg.abi, seg.name, b))

    def drop(self, sid: tuple[str, str]) -> None:
        """Forget a segment and its blocks (nothing if it is not indexed).

        Args:
            sid: (abi, segment).
        """
        with self.ctx.lock:
            seg = self.segments.pop(sid, None)
            if seg is None:
                return
            for k in seg.keys:
                refs = [r for r in self.blocks.get(k, []) if (r.abi, r.segment) != sid]
                if refs:
                    self.blocks[k] = refs
                else:
                    self.blocks.pop(k, None)

    def get(self, sid: tuple[str, str]) -> Segment | None:
        """The indexed segment `sid` ((abi, segment)), or None."""
        with self.ctx.lock:
            return self.segments.get(sid)

    def listed(self) -> list[Segment]:
        """Every indexed segment (a copy of the list, taken under the lock)."""
        with self.ctx.lock:
            return list(self.segments.values())

    def touch(self, sid: tuple[str, str]) -> None:
        """Record a restore from segment `sid` now (the budget evicts the least recently hit first)."""
        with self.ctx.lock:
            if sid in self.segments:
                self.segments[sid].last_hit = time.time()

    def stored_bytes(self) -> int:
        """Bytes of every indexed segment's shard files."""
        with self.ctx.lock:
            return sum(s.stored_bytes for s in self.segments.values())

    def refs_of(self, seg: Segment) -> list[BlockRef]:
        """The refs of every block `seg` lists, one per distinct key (as `find_chain` would find them).

        Args:
            seg: an indexed segment.
        Returns:
            Its blocks' refs in manifest order.
        """
        with self.ctx.lock:
            return [
                BlockRef(seg.abi, seg.name, r.entry)
                for k in dict.fromkeys(seg.keys)
                for r in self.blocks.get(k, [])
                if (r.abi, r.segment) == seg.sid
            ]

    def contains(self, abi: str, key: bytes) -> tuple[bool, bool]:
        """(stored under `abi`, stored with a snapshot) for block `key`, as of the last refresh."""
        refs = [r for r in self.blocks.get(self.ctx.block_id(key), []) if r.abi == abi]
        return bool(refs), any(r.snapshot for r in refs)

    def find_chain(self, abi: str, keys: list[bytes], tokens: list[list[int]], start: int = 0) -> ChainLookup:
        """`DiskTier.find_chain` (same arguments, same `ChainLookup`) as of the last refresh (the caller's)."""
        ctx = self.ctx
        refs: list[BlockRef] = []
        with ctx.lock:
            for i in range(start, len(keys)):
                cands = self.blocks.get(ctx.block_id(keys[i]), [])
                ours = [r for r in cands if r.abi == abi]
                if not ours:
                    return ChainLookup(refs, ABI if cands else "absent")
                want = ctx.tokens_field(tokens[i])
                same = [r for r in ours if r.entry["tokens"] == want and r.entry["index"] == i]
                if not same:
                    return ChainLookup(refs, "collision")
                best = max(same, key=lambda r: (r.snapshot, self.segments[(r.abi, r.segment)].created))
                parent = keys[i - 1] if i > 0 and best.entry["parent"] == ctx.block_id(keys[i - 1]) else None
                refs.append(
                    dataclasses.replace(
                        best, raw_key=bytes(keys[i]), raw_parent=parent, raw_tokens=tuple(int(t) for t in tokens[i])
                    )
                )
        return ChainLookup(refs, None)
