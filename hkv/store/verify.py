"""The disk tier's whole-store check (`verify_store`) and its statistics (`store_stats`): every problem
is reported and the check goes on; nothing in the store raises out of either. `DiskTier.verify` and
`DiskTier.stats` return their reports as dicts (`VerifyReport.as_dict`, `StoreStats.as_dict`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Callable

import tensorstore as ts

from ..core.reasons import DISK_REASONS
from .blocks import MALFORMED, MISSING, BlockRef, ReadResult, Segment
from .context import TierContext, manifest_where
from .hits import HitCounts
from .index import SegmentIndex


@dataclasses.dataclass
class VerifyReport:
    """What `verify_store` found.

    Attributes:
        segments: published segments indexed (not those unpublished while the check ran).
        blocks_ok: blocks that passed every check.
        reasons: per reason in `DISK_REASONS`: blocks, bad manifests and bad hit files.
        orphaned_segments: data folders with no manifest.
        problems: one line each: "<key>: <reason>: <why>", ..., "data/<abi>/<segment>/: no manifest ...".
    """

    segments: int = 0
    blocks_ok: int = 0
    reasons: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(DISK_REASONS, 0))
    orphaned_segments: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    def add(self, reason: str, problem: str) -> None:
        """Count one problem under `reason` and list it."""
        self.reasons[reason] += 1
        self.problems.append(problem)

    def as_dict(self) -> dict:
        """The report as `DiskTier.verify` returns it.

        Returns:
            {"segments", "blocks_ok", one key per reason in `DISK_REASONS`, "orphaned_segments", "problems"}.
        """
        return {
            "segments": self.segments,
            "blocks_ok": self.blocks_ok,
            **self.reasons,
            "orphaned_segments": self.orphaned_segments,
            "problems": self.problems,
        }


def _segment_problems(refs: list[BlockRef], read: Callable[..., ReadResult]) -> tuple[int, list[tuple[str, str, str]]]:
    """Read every block of one segment, past failures: (blocks ok, [(reason, "block <i>", detail)])."""
    ok, problems = 0, []
    while refs:
        try:
            res = read(refs, count=False)
        except Exception as e:  # never expected; still reported, and the check goes on
            res = ReadResult([], MALFORMED, f"{type(e).__name__}: {e}")
        ok += len(res.payloads)
        if res.reason is None:
            break
        problems.append((res.reason, f"block {refs[len(res.payloads)].entry['index']}", res.detail))
        refs = refs[len(res.payloads) + 1 :]
    return ok, problems


def _unpublished(ctx: TierContext, seg: Segment) -> bool:
    """Whether `seg`'s manifest is no longer in the store (deleted since it was listed)."""
    try:
        return ctx.kv.read(seg.manifest_key).result().state == "missing"
    except Exception:  # an unreadable store proves nothing: the problems stand
        return False


def _orphans(ctx: TierContext, published: set, gone: set) -> list[tuple[str, ...]]:
    """(abi, segment) of every data folder with no manifest: neither `published` (nor published since
    the listing: a write in flight then) nor `gone` (unpublished while the check ran)."""
    data = {
        tuple(k.decode(errors="replace").split("/")[1:3])
        for k in ctx.kv.list(ts.KvStore.KeyRange("data/", "data0")).result()
    }
    if data - published - gone:  # published since the listing (a write in flight then), or not at all
        published = published | {
            w
            for k in ctx.kv.list(ts.KvStore.KeyRange("manifests/", "manifests0")).result()
            if (w := manifest_where(k.decode(errors="replace"))) is not None
        }
    return sorted(d for d in data if len(d) == 2 and d not in published and d not in gone)


def verify_store(
    ctx: TierContext, index: SegmentIndex, hits: HitCounts, read: Callable[..., ReadResult]
) -> VerifyReport:
    """Check every manifest, hit file and object's bytes (see `DiskTier.verify`).

    Args:
        ctx: the tier's shared state.
        index: the segment index (refreshed by the caller).
        hits: the hit counts (their files are re-read here).
        read: `DiskTier.read` (called with count=False).
    Returns:
        A `VerifyReport`.
    """
    hits.saved()
    report = VerifyReport()
    for key, (reason, why) in sorted({**index.bad, **hits.bad}.items()):
        report.add(reason, f"{key}: {reason}: {why}")
    segs = index.listed()
    gone: set[tuple[str, str]] = set()  # unpublished by another writer while this check ran
    for s in segs:
        ok, problems = _segment_problems(index.refs_of(s), read)
        if problems and all(p[0] == MISSING for p in problems) and _unpublished(ctx, s):
            # evicted (manifest first, then data) by another writer sharing the store since the
            # listing: a segment that is gone, not a bad one (`hkv store verify` on a live store)
            gone.add(s.sid)
            index.drop(s.sid)
            continue
        report.segments += 1
        report.blocks_ok += ok
        for reason, where, detail in problems:
            report.add(reason, f"{s.manifest_key} {where}: {reason}: {detail}")
    published = {s.sid for s in segs}
    published |= {w for w in map(manifest_where, list(index.bad)) if w}  # rejected above, not orphans
    orphans = _orphans(ctx, published, gone)
    report.orphaned_segments = len(orphans)
    report.problems += [f"data/{a}/{s}/: no manifest (an interrupted write; ignored)" for a, s in orphans]
    return report


@dataclasses.dataclass
class AbiStats:
    """One ABI's share of the store: segments, distinct blocks, blocks with a snapshot, stored bytes
    and restores (all writers')."""

    segments: int = 0
    blocks: int = 0
    snapshots: int = 0
    stored_bytes: int = 0
    hits: int = 0


@dataclasses.dataclass
class StoreStats:
    """What `store_stats` found.

    Attributes:
        store: the kvstore spec (a URL, or the spec dict as JSON).
        segments: published segments.
        stored_bytes: their shard files' bytes.
        budget_bytes: the tier's budget (None = unbounded).
        abis: per ABI fingerprint, an `AbiStats`.
        counters: a copy of `DiskTier.counters`.
        bad_files: {reason: manifests and hit files skipped}.
    """

    store: str
    segments: int
    stored_bytes: int
    budget_bytes: int | None
    abis: dict[str, AbiStats]
    counters: dict[str, int]
    bad_files: dict[str, int]

    def as_dict(self) -> dict:
        """The statistics as `DiskTier.stats` returns them.

        Returns:
            {"store", "segments", "stored_bytes", "budget_bytes", "abis": {abi: {"segments", "blocks",
            "snapshots", "stored_bytes", "hits"}}, "counters", "bad_files"}.
        """
        return dataclasses.asdict(self)


def store_stats(ctx: TierContext, index: SegmentIndex, hits: HitCounts) -> StoreStats:
    """Size, segments, blocks (per ABI) and restore hit counts (all writers that saved them).

    Args:
        ctx: the tier's shared state.
        index: the segment index (refreshed by the caller).
        hits: the hit counts (every writer's files are read here).
    Returns:
        A `StoreStats`.
    """
    total_hits = hits.all_writers()
    with ctx.lock:
        segs = list(index.segments.values())
        per_abi: dict[str, AbiStats] = {}
        for s in segs:
            d = per_abi.setdefault(s.abi, AbiStats())
            d.segments += 1
            d.stored_bytes += s.stored_bytes
        for refs in index.blocks.values():
            for abi in {r.abi for r in refs}:
                per_abi[abi].blocks += 1
                per_abi[abi].snapshots += any(r.snapshot for r in refs if r.abi == abi)
    for abi, h in total_hits.items():
        if abi in per_abi:
            per_abi[abi].hits = sum(h.values())
    return StoreStats(
        store=ctx.spec if isinstance(ctx.spec, str) else json.dumps(ctx.spec),
        segments=len(segs),
        stored_bytes=sum(s.stored_bytes for s in segs),
        budget_bytes=ctx.budget_bytes,
        abis=per_abi,
        counters=dict(ctx.counters),
        bad_files=dict(collections.Counter(r for r, _ in [*index.bad.values(), *hits.bad.values()])),
    )
