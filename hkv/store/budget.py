"""The disk tier's budget (`Budget`): whole segments deleted until the stored bytes fit
`budget_bytes`, leaves of the block chains first, least recently hit first; a deleted segment's
manifest goes first, so a concurrent reader sees `disk_missing`, never half a segment.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import tensorstore as ts

from .blocks import Segment
from .context import TierContext, manifest_key, manifest_where
from .index import SegmentIndex
from .layout import data_prefix


def _victim(segments: list[Segment]) -> Segment:
    """The segment to evict first: one no other segment's blocks extend (a leaf of the chains), least
    recently hit (or written) first."""
    # (abi, key) -> segments holding a block whose parent is that key
    extended: dict[tuple[str, str], set[str]] = {}
    for s in segments:
        for p in s.parents:
            extended.setdefault((s.abi, p), set()).add(s.name)
    covered = {}
    for s in segments:
        for k in s.keys:
            covered[(s.abi, k)] = covered.get((s.abi, k), 0) + 1

    def rank(s: Segment, extended=extended, covered=covered):
        inner = any(extended.get((s.abi, k), set()) - {s.name} and covered[(s.abi, k)] == 1 for k in s.keys)
        return (inner, max(s.last_hit, s.created))

    return min(segments, key=rank)


class Budget:
    """Keeps the store within `ctx.budget_bytes`.

    Args:
        ctx: the tier's shared state (its `budget_bytes`, None = unbounded).
        index: the segment index.
    """

    def __init__(self, ctx: TierContext, index: SegmentIndex):
        self.ctx, self.index = ctx, index

    def enforce(self, delete: Callable[[str, str], None] | None = None) -> int:
        """`DiskTier.enforce_budget`: delete whole segments (`_victim` first) until the stored bytes fit.

        Args:
            delete: deletes one segment (abi, segment); `delete_segment` by default.
        Returns:
            The number of segments deleted.
        """
        delete = delete or self.delete_segment
        n = 0
        while True:
            with self.ctx.lock:
                budget = self.ctx.budget_bytes
                if budget is None:
                    return n
                segments = list(self.index.segments.values())
                if sum(s.stored_bytes for s in segments) <= budget or not segments:
                    return n
                victim = _victim(segments)
            delete(victim.abi, victim.name)
            n += 1

    def delete_segment(self, abi: str, segment: str) -> None:
        """`DiskTier.delete_segment`: the manifest first, then the data and (in a `file` store) the folders.

        Args:
            abi: the ABI fingerprint (32 hex digits).
            segment: the segment name.
        Raises:
            ValueError: an `abi` or `segment` that cannot name a segment.
        """
        ctx = self.ctx
        if manifest_where(manifest_key(abi, segment)) is None:
            raise ValueError(f"abi={abi!r} / segment={segment!r} must be 32 hex digits / a segment name")
        seg = self.index.get((abi, segment))
        ctx.kv.write(manifest_key(abi, segment), None).result()  # None: delete the key
        prefix = data_prefix(abi, segment)
        ctx.kv.delete_range(ts.KvStore.KeyRange(prefix, prefix[:-1] + "0")).result()
        self._remove_folders(abi, segment)
        self.index.drop((abi, segment))
        if seg is not None:
            with ctx.lock:
                ctx.counters["segments_evicted"] += 1
                ctx.counters["bytes_evicted"] += seg.stored_bytes
            ctx.say(f"disk tier: evicted segment {segment} ({seg.stored_bytes:,} bytes) over budget")

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
