"""The disk tier's budget (`Budget`): whole segments deleted until the stored bytes fit `budget_bytes`,
leaves of the block chains first, least recently hit (store-wide) first; a deleted segment's manifest
goes first, so a concurrent reader sees `disk_missing`, never half a segment, and the pointers naming
it are updated after (a pointer left naming it is a miss).

Several processes may enforce one store's budget at once; only the holder of the eviction lease
(`hkv.store.coord.Lease`) deletes. The usage ledger says in one GET whether the store is over budget;
the holder then lists the manifests afresh (`hkv.store.listing`, in pages), corrects the ledger, reads
every writer's hot file, ranks every segment in one pass (`rank_victims`, a heap: O(n log n)) and
deletes exactly the bytes over the budget, renewing the lease before each deletion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import math
import os
import time
from collections.abc import Callable

import tensorstore as ts

from . import manifest as mf
from .context import TierContext, manifest_key, manifest_where
from .coord import Lease, Usage, add_usage, read_usage, reconcile_usage
from .index import SegmentIndex
from .layout import data_prefix
from .listing import manifest_pages
from .records import Pointer, update_pointers

SCAN_SECONDS = 60.0  # a tier with a budget lists the store at least this often when it enforces it


@dataclasses.dataclass(frozen=True)
class SegmentInfo:
    """What the ranking needs of one segment: where it is, its size and creation time, and its blocks'
    ids and parents' ids (no token ids, no objects)."""

    abi: str
    name: str
    stored_bytes: int
    created: float
    keys: tuple[str, ...]
    parents: tuple[str, ...]

    @property
    def sid(self) -> tuple[str, str]:
        """(abi, name)."""
        return self.abi, self.name


def rank_victims(segments: list[SegmentInfo], last_hit: dict[tuple[str, str], float], need: int) -> list[SegmentInfo]:
    """The segments to delete, in order, to free at least `need` bytes: repeatedly the one no other
    segment's blocks extend (a leaf of the chains: not *inner*), least recently hit (or written) first,
    the rank of the segments a deletion affects updated as it goes. The same victims as re-ranking every
    segment after each deletion, in O((segments + blocks) log segments).

    A segment is inner while one of its block ids is the parent of a block of another segment and no
    other copy of that block is listed.

    Args:
        segments: every segment of the store (ties go to the earlier one in this list).
        last_hit: {(abi, name): unix seconds of its last restore} (store-wide).
        need: bytes to free (<= 0: nothing).
    Returns:
        The victims, in deletion order.
    """
    extended: dict[tuple[str, str], set[str]] = {}  # (abi, id) -> segments with a block whose parent it is
    covered: dict[tuple[str, str], int] = {}  # (abi, id) -> copies listed
    holding: dict[tuple[str, str], list[int]] = {}  # (abi, id) -> segments holding or extending it
    for n, s in enumerate(segments):
        for p in s.parents:
            extended.setdefault((s.abi, p), set()).add(s.name)
            holding.setdefault((s.abi, p), []).append(n)
        for k in s.keys:
            covered[(s.abi, k)] = covered.get((s.abi, k), 0) + 1
            holding.setdefault((s.abi, k), []).append(n)

    def rank(n: int) -> tuple[bool, float, int]:
        s = segments[n]
        inner = any(covered.get((s.abi, k), 0) == 1 and extended.get((s.abi, k), set()) - {s.name} for k in s.keys)
        return inner, max(last_hit.get(s.sid, 0.0), s.created), n

    ranks = [rank(n) for n in range(len(segments))]
    heap = list(ranks)
    heapq.heapify(heap)
    gone, out, freed = set(), [], 0
    while heap and freed < need:
        r = heapq.heappop(heap)
        n = r[2]
        if n in gone or r != ranks[n]:
            continue  # deleted, or ranked again since
        s = segments[n]
        gone.add(n)
        out.append(s)
        freed += s.stored_bytes
        for k in s.keys:
            covered[(s.abi, k)] -= 1
        for p in s.parents:
            extended.get((s.abi, p), set()).discard(s.name)
        for m in {m for k in (*s.keys, *s.parents) for m in holding[(s.abi, k)]} - gone:
            new = rank(m)
            if new != ranks[m]:
                ranks[m] = new
                heapq.heappush(heap, new)
    return out


class Budget:
    """Keeps the store within `ctx.budget_bytes` (see the module docstring).

    Args:
        ctx: the tier's shared state (its `budget_bytes`, None = unbounded).
        index: the lookup index (this writer's hits; forgets what is deleted).
        lease_seconds: how long the eviction lease lasts without renewal.

    Attributes:
        scan_seconds: a tier lists the store when it enforces the budget at least this often, even when
            the ledger says the store fits (a ledger that drifted is corrected so).
    """

    def __init__(self, ctx: TierContext, index: SegmentIndex, lease_seconds: float = 30.0):
        self.ctx, self.index = ctx, index
        self.lease = Lease(ctx, lease_seconds)
        self.scan_seconds = SCAN_SECONDS
        self._scanned = -math.inf

    def stored_bytes(self) -> int:
        """Bytes of every published segment's shard files, as the usage ledger counts them (one GET)."""
        return read_usage(self.ctx).stored_bytes

    def enforce(self, delete: Callable[[str, str], None] | None = None) -> int:
        """`DiskTier.enforce_budget`: when the ledger says the store is over budget (or its last listing
        here is older than `scan_seconds`), take the eviction lease and delete the victims of a fresh
        listing until the stored bytes fit; another process holding the lease is left to do it.

        Args:
            delete: deletes one segment (abi, segment); `delete_segment` by default.
        Returns:
            The number of segments deleted.
        """
        budget = self.ctx.budget_bytes
        if budget is None:
            return 0
        usage = read_usage(self.ctx)
        if usage.stored_bytes <= budget and time.monotonic() - self._scanned < self.scan_seconds:
            return 0
        if not self.lease.acquire():
            return 0  # another process is evicting (it lists the store itself, this write included)
        try:
            return self._evict(usage, budget, delete)
        finally:
            self.lease.release()

    def _evict(self, usage: Usage, budget: int, delete: Callable[[str, str], None] | None) -> int:
        """Lease held: list, correct the ledger, rank once, delete the victims (renewing the lease)."""
        segments = self.scan(usage)
        if segments is None:
            return 0  # the lease was lost while listing
        self._scanned = time.monotonic()
        total = sum(s.stored_bytes for s in segments)
        if total <= budget:
            return 0
        last_hit = self.index.hot.store_wide()  # every writer's restores, read after the listing
        n = 0
        for v in rank_victims(segments, last_hit, total - budget):
            if not self.lease.renew():
                break  # expired and taken over: the new holder lists and ranks afresh
            if delete is not None:
                delete(v.abi, v.name)
            else:
                self.delete_segment(v.abi, v.name, v)
            n += 1
        return n

    def scan(self, usage: Usage) -> list[SegmentInfo] | None:
        """Every published segment (listed in pages, the lease renewed after each), and the ledger
        corrected to what was found if nobody changed it meanwhile.

        Args:
            usage: the ledger as read before the listing.
        Returns:
            The segments, or None when the lease was lost.
        """
        out: list[SegmentInfo] = []
        counted: dict[str, tuple[int, int]] = {}
        for page in manifest_pages(self.ctx, usage):
            for m in page:
                if m.doc is None:
                    continue
                d = m.doc
                out.append(
                    SegmentInfo(
                        d["abi"],
                        d["segment"],
                        d["stored_bytes"],
                        float(d.get("created", 0.0)),
                        tuple(b["key"] for b in d["blocks"]),
                        tuple(b["parent"] for b in d["blocks"] if b["parent"]),
                    )
                )
                n, b = counted.get(d["abi"], (0, 0))
                counted[d["abi"]] = (n + 1, b + d["stored_bytes"])
            if self.lease.generation is not None and not self.lease.renew():
                return None
        with contextlib.suppress(Exception):  # advisory
            reconcile_usage(self.ctx, usage, counted)
        return out

    def delete_segment(self, abi: str, segment: str, info: SegmentInfo | None = None) -> None:
        """`DiskTier.delete_segment`: the manifest first, then the data, (in a `file` store) the folders,
        the ledger, and the pointers naming it.

        Args:
            abi: the ABI fingerprint (32 hex digits).
            segment: the segment name.
            info: what the caller knows of it (None: its manifest is read first).
        Raises:
            ValueError: an `abi` or `segment` that cannot name a segment.
        """
        ctx = self.ctx
        if manifest_where(manifest_key(abi, segment)) is None:
            raise ValueError(f"abi={abi!r} / segment={segment!r} must be 32 hex digits / a segment name")
        if info is None:
            info = self._info(abi, segment)
        ctx.kv.write(manifest_key(abi, segment), None).result()  # None: delete the key
        prefix = data_prefix(abi, segment)
        ctx.kv.delete_range(ts.KvStore.KeyRange(prefix, prefix[:-1] + "0")).result()
        self._remove_folders(abi, segment)
        self.index.drop((abi, segment), info.keys if info is not None else ())
        if info is None:
            return
        with contextlib.suppress(Exception):  # advisory: the next listing corrects it
            add_usage(ctx, abi, -1, -info.stored_bytes)
        self._unpoint(abi, segment, info.keys)
        with ctx.lock:
            ctx.counters["segments_evicted"] += 1
            ctx.counters["bytes_evicted"] += info.stored_bytes
        ctx.say(f"disk tier: evicted segment {segment} ({info.stored_bytes:,} bytes) over budget")

    def _info(self, abi: str, segment: str) -> SegmentInfo | None:
        """The `SegmentInfo` of a segment from its manifest (None: gone or refused)."""
        seg = self.index.get((abi, segment))
        if seg is None:
            name = manifest_key(abi, segment)
            raw, _ = self.ctx.read_bounded([name], mf.MAX_MANIFEST_BYTES)[name]
            if raw is None:
                return None
            try:
                doc = mf.parse(raw, key=self.ctx.key, abi=abi, segment=segment, max_data_bytes=self.ctx.budget_bytes)
            except mf.ManifestError:
                return None
        else:
            doc = seg.doc
        parents = tuple(b["parent"] for b in doc["blocks"] if b["parent"])
        keys = tuple(b["key"] for b in doc["blocks"])
        return SegmentInfo(abi, segment, doc["stored_bytes"], float(doc.get("created", 0.0)), keys, parents)

    def _unpoint(self, abi: str, segment: str, keys: tuple[str, ...]) -> None:
        """Take segment (abi, segment) out of its blocks' pointers (a pointer left with no holder is
        deleted); a failure leaves pointers naming a deleted segment, which lookups treat as misses."""

        def without(p: Pointer | None) -> Pointer | None:
            if p is None:
                return None
            return Pointer(p.block, tuple(h for h in p.holders if (h.abi, h.segment) != (abi, segment)))

        with contextlib.suppress(Exception):
            update_pointers(self.ctx.kv, self.ctx.key, {k: without for k in dict.fromkeys(keys)})

    def _remove_folders(self, abi: str, segment: str) -> None:
        """A `file` store keeps the folders of deleted keys: remove the (now empty) data/<abi>/<segment>/c/
        and data/<abi>/<segment>/ so a deleted segment leaves nothing behind (other kvstores have no
        folders: the range delete was all)."""
        try:
            spec = self.ctx.kv.spec().to_json()
        except Exception:  # not a local store
            return
        if spec.get("driver") != "file" or not isinstance(spec.get("path"), str):
            return
        seg_dir = os.path.join(spec["path"], "data", abi, segment)
        for d in (os.path.join(seg_dir, "c"), seg_dir):
            with contextlib.suppress(OSError):  # not empty (a concurrent writer's temporary file) or gone
                os.rmdir(d)
