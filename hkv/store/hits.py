"""Restore hit counts of a disk tier (`HitCounts`): per ABI and block key, how often `DiskTier.read`
restored a block. Each writer keeps its own in memory and saves them as `hits/<abi>/<writer>.json`
({"hits": {block key: restores}}); `stats` adds up every writer's. A hit file is statistics only:
one that is bad or unreadable is skipped with its reason, never fatal.
"""

from __future__ import annotations

import dataclasses
import json

import tensorstore as ts

from . import manifest as mf
from .blocks import MALFORMED
from .context import Rejection, TierContext, manifest_where

MAX_HITS_BYTES = 16 << 20  # a hit file: {"hits": {block key: restores}}
MAX_HITS = 1 << 20  # block keys in one hit file


def parse_hits(raw: bytes) -> dict[str, int]:
    """A hit file's {block key hex: restores}, bounded like a manifest.

    Args:
        raw: the file's bytes (at most `MAX_HITS_BYTES`).
    Returns:
        The counts.
    Raises:
        ManifestError: not JSON (`disk_checksum`), too deep or outside the schema (`disk_malformed`).
    """
    doc = mf.load_json(raw, "hit file", MAX_HITS_BYTES, max_depth=2)
    mf.need(
        isinstance(doc, dict) and set(doc) == {"hits"} and isinstance(doc["hits"], dict),
        'a hit file must be {"hits": {block key: restores}}',
    )
    h = doc["hits"]
    mf.need(len(h) <= MAX_HITS, f"a hit file lists {len(h)} blocks, more than {MAX_HITS}")
    for k, n in h.items():
        mf.check_hex(k, 32, "hit block key")
        mf.check_int(n, f"hits of block {k}", 0, 1 << 62)
    return h


@dataclasses.dataclass(frozen=True)
class HitFile:
    """One valid hit file: the restores per block key (hex) of `writer`'s blocks under `abi`."""

    abi: str
    writer: str
    hits: dict[str, int]


class HitCounts:
    """This writer's restore counts, and the hit files of every writer in the store.

    Args:
        ctx: the tier's shared state.

    Attributes:
        counts: {abi: {block key hex: restores}} of this writer (guarded by `ctx.lock`).
        bad: {hit file key: `Rejection`} of the files the last `saved` skipped.
    """

    def __init__(self, ctx: TierContext):
        self.ctx = ctx
        self.counts: dict[str, dict[str, int]] = {}
        self.bad: dict[str, Rejection] = {}

    def record(self, abi: str, key: str) -> None:
        """Count one restore of block `key` (the id its manifest lists) under `abi`.

        Args:
            abi: the ABI fingerprint.
            key: the block id (hex).
        """
        with self.ctx.lock:
            h = self.counts.setdefault(abi, {})
            h[key] = h.get(key, 0) + 1

    def copy(self) -> dict[str, dict[str, int]]:
        """A copy of `counts`, taken under the lock.

        Returns:
            {abi: {block key hex: restores}}.
        """
        with self.ctx.lock:
            return {abi: dict(h) for abi, h in self.counts.items()}

    def saved(self) -> list[HitFile]:
        """Every valid hit file in the store; a bad or unreadable one only loses statistics: it is
        skipped and recorded in `bad` (reported by `verify` and `stats`).

        Returns:
            The files, in no particular order.
        """
        kv = self.ctx.kv
        names = [k.decode(errors="replace") for k in kv.list(ts.KvStore.KeyRange("hits/", "hits0")).result()]
        bad, where = {}, {}
        for n in names:
            parts = n.split("/")
            if not n.endswith(".json"):
                continue
            if len(parts) != 3 or manifest_where(f"manifests/{parts[1]}/{parts[2]}") is None:
                bad[n] = Rejection(MALFORMED, "not a hit file name (hits/<32 hex abi>/<writer>.json)")
                continue
            where[n] = (parts[1], parts[2][:-5])
        out = []
        for n, (raw, why) in self.ctx.read_bounded(list(where), MAX_HITS_BYTES).items():
            if raw is None:
                if why:
                    bad[n] = Rejection(MALFORMED, why)
                continue
            try:
                out.append(HitFile(*where[n], parse_hits(raw)))
            except mf.ManifestError as e:
                bad[n] = Rejection(e.reason, str(e))
        self.bad = bad
        return out

    def load_own(self) -> None:
        """A writer reopened under the same `writer_id` continues its saved hit counts."""
        for f in self.saved():
            if f.writer == self.ctx.writer_id:
                self.counts[f.abi] = f.hits

    def save(self) -> None:
        """Persist this writer's restore counts (read by `stats` of any process); raises what the
        kvstore raises (`flush` and `close` call it through `save_advisory`)."""
        for abi, h in self.copy().items():
            self.ctx.kv.write(f"hits/{abi}/{self.ctx.writer_id}.json", json.dumps({"hits": h}).encode()).result()

    def save_advisory(self) -> None:
        """`save` for `flush` / `close`: hit counts are statistics, so a write that fails (a full
        disk, a read-only store) is counted in `counters["hit_write_failures"]`, never raised."""
        try:
            self.save()
        except Exception as e:  # statistics must not fail a flush (or the engine calling it)
            self.ctx.counters["hit_write_failures"] += 1
            self.ctx.say(f"disk tier: hit counts not saved ({type(e).__name__}: {str(e)[:200]})")

    def all_writers(self) -> dict[str, dict[str, int]]:
        """This writer's in-memory counts plus every other writer's saved ones (refreshes `bad`).

        Returns:
            {abi: {block key hex: restores}}.
        """
        saved = self.saved()
        total = self.copy()
        for f in saved:
            if f.writer == self.ctx.writer_id:
                continue  # this writer's counts are the in-memory ones
            for key, n in f.hits.items():
                total.setdefault(f.abi, {})
                total[f.abi][key] = total[f.abi].get(key, 0) + n
        return total
