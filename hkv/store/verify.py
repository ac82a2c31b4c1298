"""The disk tier's whole-store check (`verify_store`) and its statistics (`store_stats`): every problem
is reported and the check goes on; nothing in the store raises out of either. `DiskTier.verify` and
`DiskTier.stats` return their reports as dicts (`VerifyReport.as_dict`, `StoreStats.as_dict`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Callable

from ..core.reasons import DISK_REASONS
from .blocks import MALFORMED, MISSING, BlockRef, ReadResult
from .context import TierContext, manifest_where
from .coord import Usage, read_usage
from .hits import HitCounts
from .index import SegmentIndex, refs_of
from .listing import listed_keys, manifest_pages
from .manifest import ManifestError
from .records import POINTER_BYTES, fixed_result, parse_pointer, pointer_key, read_fixed


@dataclasses.dataclass
class VerifyReport:
    """What `verify_store` found.

    Attributes:
        segments: published segments indexed (not those unpublished while the check ran).
        blocks_ok: blocks that passed every check (their bytes, and the pointer a lookup reads).
        reasons: per reason in `DISK_REASONS`: blocks, bad manifests and bad hit files.
        orphaned_segments: data folders with no manifest.
        unindexed_blocks: blocks of a published segment that lookups do not reach, their bytes intact:
            their pointer is missing or no longer names the segment (a writer stopped between
            publishing a manifest and its pointers, or a block held by more than
            `hkv.store.records.MAX_HOLDERS` segments). Not a failure; not in `blocks_ok`.
        unindexed: one line per unindexed block: "<manifest key> block <i>: not indexed: <why>".
        problems: one line each: "<key>: <reason>: <why>", ..., "data/<abi>/<segment>/: no manifest ...".
    """

    segments: int = 0
    blocks_ok: int = 0
    reasons: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(DISK_REASONS, 0))
    orphaned_segments: int = 0
    unindexed_blocks: int = 0
    unindexed: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)

    def add(self, reason: str, problem: str) -> None:
        """Count one problem under `reason` and list it."""
        self.reasons[reason] += 1
        self.problems.append(problem)

    def as_dict(self) -> dict:
        """The report as `DiskTier.verify` returns it.

        Returns:
            {"segments", "blocks_ok", one key per reason in `DISK_REASONS`, "orphaned_segments",
            "unindexed_blocks", "unindexed", "problems"}.
        """
        return {
            "segments": self.segments,
            "blocks_ok": self.blocks_ok,
            **self.reasons,
            "orphaned_segments": self.orphaned_segments,
            "unindexed_blocks": self.unindexed_blocks,
            "unindexed": self.unindexed,
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


def _pointer_problems(
    ctx: TierContext, sid: tuple[str, str], blocks: list[dict]
) -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
    """The block pointers of one segment's blocks as a lookup reads them.

    Args:
        ctx: the tier's shared state.
        sid: the segment's (abi, name).
        blocks: its manifest's blocks.
    Returns:
        (damaged: [(reason, "block <i>", detail)] for each pointer that is unreadable or refused
        (`disk_malformed`, `disk_auth`: a lookup stops there), unindexed: [("block <i>", detail)] for
        each block whose pointer is missing or does not name the segment: a lookup does not reach it).
    """
    reads = [(b, read_fixed(ctx.kv, pointer_key(b["key"]), POINTER_BYTES)) for b in blocks]
    damaged, unindexed = [], []
    for b, fut in reads:
        where, name = f"block {b['index']}", pointer_key(b["key"])
        raw, _, why = fixed_result(fut)
        if raw is None:
            if why is not None:
                damaged.append((MALFORMED, where, f"pointer {name}: {why}"))
            else:
                unindexed.append((where, f"pointer {name} is missing"))
            continue
        try:
            p = parse_pointer(raw, b["key"], ctx.key)
        except ManifestError as e:
            damaged.append((e.reason, where, f"pointer {name}: {e}"))
            continue
        if all(h.sid != sid for h in p.holders):
            unindexed.append((where, f"pointer {name} does not name the segment"))
    return damaged, unindexed


def _unpublished(ctx: TierContext, manifest: str) -> bool:
    """Whether the manifest `manifest` is no longer in the store (deleted since it was listed)."""
    try:
        return ctx.kv.read(manifest).result().state == "missing"
    except Exception:  # an unreadable store proves nothing: the problems stand
        return False


def _orphans(ctx: TierContext, published: set, gone: set, usage: Usage) -> list[tuple[str, ...]]:
    """(abi, segment) of every data folder with no manifest: neither `published` (nor published since
    the listing: a write in flight then) nor `gone` (unpublished while the check ran). The data and
    manifest listings are cut into key ranges (`hkv.store.listing`); only segment names are kept."""
    data = {tuple(k.split("/")[1:3]) for keys in listed_keys(ctx, "data/", usage) for k in keys}
    if data - published - gone:  # published since the listing (a write in flight then), or not at all
        published = published | {
            w for keys in listed_keys(ctx, "manifests/", usage) for k in keys if (w := manifest_where(k)) is not None
        }
    return sorted(d for d in data if len(d) == 2 and d not in published and d not in gone)


def verify_store(
    ctx: TierContext, index: SegmentIndex, hits: HitCounts, read: Callable[..., ReadResult]
) -> VerifyReport:
    """Check every manifest, hit file and object's bytes (see `DiskTier.verify`). The manifests are
    listed and read a page at a time (`hkv.store.listing.manifest_pages`); only segment names are kept
    across pages (to tell orphaned data).

    Args:
        ctx: the tier's shared state.
        index: the lookup index (a segment found unpublished is dropped from it).
        hits: the hit counts (their files are re-read here).
        read: `DiskTier.read` (called with count=False).
    Returns:
        A `VerifyReport`.
    """
    hits.saved()
    report = VerifyReport()
    bad = dict(hits.bad)
    usage = read_usage(ctx)
    published: set[tuple[str, str]] = set()
    gone: set[tuple[str, str]] = set()  # unpublished by another writer while this check ran
    lines: list[tuple[str, str]] = []
    for page in manifest_pages(ctx, usage):
        for m in page:
            if m.sid is not None:
                published.add(m.sid)  # a rejected manifest's data is not an orphan either
            if m.doc is None:
                bad[m.key] = m.rejection
                continue
            ok, problems = _segment_problems(refs_of(*m.sid, m.doc), read)
            if problems and all(p[0] == MISSING for p in problems) and _unpublished(ctx, m.key):
                # evicted (manifest first, then data) by another writer sharing the store since the
                # listing: a segment that is gone, not a bad one (`hkv store verify` on a live store)
                gone.add(m.sid)
                index.drop(m.sid)
                continue
            pointers, unindexed = _pointer_problems(ctx, m.sid, m.doc["blocks"])
            problems += pointers
            report.segments += 1
            report.blocks_ok += max(ok - len(pointers) - len(unindexed), 0)
            report.unindexed_blocks += len(unindexed)
            lines += [(reason, f"{m.key} {where}: {reason}: {detail}") for reason, where, detail in problems]
            report.unindexed += [f"{m.key} {w}: not indexed: {d}" for w, d in unindexed]
    for key, (reason, why) in sorted(bad.items()):
        report.add(reason, f"{key}: {reason}: {why}")
    for reason, line in lines:
        report.add(reason, line)
    orphans = _orphans(ctx, published, gone, usage)
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


def store_stats(ctx: TierContext, hits: HitCounts) -> StoreStats:
    """Size, segments, blocks (per ABI) and restore hit counts (all writers that saved them). The
    manifests are listed and read a page at a time; while it runs, one id per distinct block is kept
    (to count each block once).

    Args:
        ctx: the tier's shared state.
        hits: the hit counts (every writer's files are read here).
    Returns:
        A `StoreStats`.
    """
    total_hits = hits.all_writers()
    per_abi: dict[str, AbiStats] = {}
    snapshot: dict[str, dict[str, bool]] = {}  # abi -> block id -> any copy with a snapshot
    bad = collections.Counter(r for r, _ in hits.bad.values())
    for page in manifest_pages(ctx):
        for m in page:
            if m.doc is None:
                bad[m.rejection.reason] += 1
                continue
            d = per_abi.setdefault(m.doc["abi"], AbiStats())
            d.segments += 1
            d.stored_bytes += m.doc["stored_bytes"]
            seen = snapshot.setdefault(m.doc["abi"], {})
            for b in m.doc["blocks"]:
                seen[b["key"]] = seen.get(b["key"], False) or b["snapshot"]
    for abi, seen in snapshot.items():
        per_abi[abi].blocks = len(seen)
        per_abi[abi].snapshots = sum(seen.values())
    for abi, h in total_hits.items():
        if abi in per_abi:
            per_abi[abi].hits = sum(h.values())
    return StoreStats(
        store=ctx.spec if isinstance(ctx.spec, str) else json.dumps(ctx.spec),
        segments=sum(d.segments for d in per_abi.values()),
        stored_bytes=sum(d.stored_bytes for d in per_abi.values()),
        budget_bytes=ctx.budget_bytes,
        abis=per_abi,
        counters=dict(ctx.counters),
        bad_files=dict(bad),
    )
