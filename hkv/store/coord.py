"""How the processes sharing a disk tier store coordinate its budget without a shared view of every
manifest: the usage ledger (`budget/usage.json`), the eviction lease (`budget/lease.json`) and each
writer's recently hit segments (`budget/hot/<writer>.json`).

    budget/usage.json         {"format": "hkv-disk-ledger", "version": 1,
                               "abis": {"<abi>": [segments, stored bytes]}, "checksum": crc32}
    budget/lease.json         {"format": "hkv-disk-lease", "version": 1, "holder": "<writer>",
                               "token": "<random>", "expires": unix seconds, "checksum": crc32}
    budget/hot/<writer>.json  {"hits": {"<abi>/<segment>": unix seconds of its last restore}}

The ledger and the lease are fixed-size records updated by compare-and-swap (`hkv.store.records`).
A writer adds a segment to the ledger before publishing its manifest and an evictor subtracts it after
deleting it; the ledger only *triggers* eviction (one GET says whether the store is over budget): the
evictor decides from a fresh listing and then corrects the ledger, so a ledger that drifted (a writer
killed between the two) never makes anyone evict more than needed. Only the holder of an unexpired
lease evicts, and it renews the lease (a conditional write) before each deletion: two processes never
evict at once. A lease expires when another process has seen it unchanged (the same storage
generation: no renewal) for `ttl` seconds of its own monotonic clock, so no two hosts' wall clocks
are compared (a host whose clock runs ahead cannot take a live lease; "expires" is written for
readers only). Hot files carry every writer's restores into the evictor's ranking (least recently
hit first, store-wide). All three are advisory: unreadable or damaged, they read as empty.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import time
import uuid

import tensorstore as ts

from . import manifest as mf
from .context import TierContext, manifest_where
from .records import Fixed, fixed_result, open_record, pad, read_fixed, seal_record, update_record

LEDGER_KEY = "budget/usage.json"
LEDGER_BYTES = 8192
MAX_LEDGER_ABIS = 64
LEASE_KEY = "budget/lease.json"
LEASE_BYTES = 512
HOT_PREFIX = "budget/hot/"
MAX_HOT = 4096  # segments one hot file lists (the most recently hit)
MAX_HOT_BYTES = 1 << 20
HOT_REPUBLISH_SECONDS = 10.0  # a hit on a segment published as hot this recently writes nothing
HOT_EXPIRES_SECONDS = 7 * 86400  # a hot file whose newest hit is older is deleted by the evictor


@dataclasses.dataclass(frozen=True)
class Usage:
    """The ledger: {abi: (segments, stored bytes)} and the generation it was read at (b"": unknown)."""

    abis: dict[str, tuple[int, int]]
    generation: bytes = b""

    @property
    def stored_bytes(self) -> int:
        """Stored bytes over every ABI."""
        return sum(b for _, b in self.abis.values())

    @property
    def segments(self) -> int:
        """Segments over every ABI."""
        return sum(n for n, _ in self.abis.values())


def _usage_of(cur: Fixed) -> Usage:
    """The `Usage` a ledger read holds (empty when missing, unreadable or damaged)."""
    if cur.raw is None:
        return Usage({}, cur.generation)
    try:
        doc = open_record(cur.raw, "ledger", LEDGER_KEY, None, max_depth=3)
        mf.need(doc.get("format") == "hkv-disk-ledger" and isinstance(doc.get("abis"), dict), "not a ledger")
        abis = {}
        for abi, v in doc["abis"].items():
            mf.check_hex(abi, 32, "ledger abi")
            mf.need(isinstance(v, list) and len(v) == 2, "a ledger entry is [segments, bytes]")
            abis[abi] = (mf.check_int(v[0], "segments"), mf.check_int(v[1], "stored bytes"))
        return Usage(abis, cur.generation)
    except mf.ManifestError:
        return Usage({}, cur.generation)


def _seal_usage(abis: dict[str, tuple[int, int]]) -> bytes:
    live = sorted(((a, v) for a, v in abis.items() if v[0] > 0 or v[1] > 0), key=lambda x: -x[1][1])
    doc = {"format": "hkv-disk-ledger", "version": 1, "abis": {a: list(v) for a, v in live[:MAX_LEDGER_ABIS]}}
    return pad(seal_record(doc, "ledger", LEDGER_KEY, None), LEDGER_BYTES)


def read_usage(ctx: TierContext) -> Usage:
    """The ledger as stored now (one GET of `LEDGER_BYTES`).

    Args:
        ctx: the tier's shared state.
    Returns:
        The `Usage` (empty for a store without one).
    """
    return _usage_of(fixed_result(read_fixed(ctx.kv, LEDGER_KEY, LEDGER_BYTES)))


def add_usage(ctx: TierContext, abi: str, segments: int, nbytes: int) -> None:
    """Add (or, negative, subtract) segments and bytes under `abi` (compare-and-swap; never below 0).

    Args:
        ctx: the tier's shared state.
        abi: the ABI fingerprint.
        segments: segments added.
        nbytes: stored bytes added.
    """

    def change(cur: Fixed) -> bytes:
        abis = dict(_usage_of(cur).abis)
        n, b = abis.get(abi, (0, 0))
        abis[abi] = (max(0, n + segments), max(0, b + nbytes))
        return _seal_usage(abis)

    update_record(ctx.kv, LEDGER_KEY, LEDGER_BYTES, change)


def reconcile_usage(ctx: TierContext, seen: Usage, counted: dict[str, tuple[int, int]]) -> bool:
    """Replace the ledger by what a listing counted, if nobody changed it since `seen` was read
    (before the listing began): then every segment a writer added was either listed or not yet
    published, so the correction can only under-count a segment in flight (never over-count).

    Args:
        ctx: the tier's shared state.
        seen: the ledger read before the listing.
        counted: {abi: (segments, stored bytes)} the listing found.
    Returns:
        Whether the ledger was replaced.
    """
    if seen.generation == b"" or seen.abis == counted:
        return False
    return ctx.kv.write(LEDGER_KEY, _seal_usage(counted), if_equal=seen.generation).result().generation != b""


class Lease:
    """The eviction lease of one tier: only its holder deletes segments over the budget.

    Args:
        ctx: the tier's shared state.
        ttl: seconds a lease lasts without renewal: another holder's lease is taken over once this
            tier has seen it unchanged for that long (by `clock`); a killed holder's lease is thus
            taken over within ttl of its being first seen.
        clock: this process's monotonic seconds (`time.monotonic`; tests pass their own).
    """

    def __init__(self, ctx: TierContext, ttl: float = 30.0, clock=time.monotonic):
        self.ctx, self.ttl, self.clock = ctx, ttl, clock
        self.generation: bytes | None = None  # ours while held
        self.token = ""
        self.seen: tuple[bytes, float] | None = None  # (another holder's generation, when first seen)

    def _seal(self) -> bytes:
        doc = {
            "format": "hkv-disk-lease",
            "version": 1,
            "holder": self.ctx.writer_id,
            "token": self.token,
            "expires": time.time() + self.ttl,
        }
        return pad(seal_record(doc, "lease", LEASE_KEY, None), LEASE_BYTES)

    def acquire(self) -> bool:
        """Take the lease if it is free or expired (one conditional write).

        Returns:
            Whether this tier holds it now.
        """
        cur = fixed_result(read_fixed(self.ctx.kv, LEASE_KEY, LEASE_BYTES))
        if cur.raw is not None:
            try:
                open_record(cur.raw, "lease", LEASE_KEY, None, max_depth=2)
                if not self._expired(cur.generation):
                    return False  # another holder's, renewed less than ttl ago as far as we have seen
            except mf.ManifestError:
                pass  # a damaged lease is free
        self.seen = None
        self.token = uuid.uuid4().hex
        if cur.generation == b"":  # unreadable: overwrite it, then check that ours stands
            self.ctx.kv.write(LEASE_KEY, self._seal()).result()
            return self.renew()
        gen = self.ctx.kv.write(LEASE_KEY, self._seal(), if_equal=cur.generation).result().generation
        self.generation = bytes(gen) if gen != b"" else None
        return self.generation is not None

    def _expired(self, generation: bytes) -> bool:
        """Whether another holder's lease at `generation` has been seen unchanged for `ttl` seconds of
        this process's clock (the first sighting of a generation starts the count; an unknown
        generation, b"", never expires: the lease is then treated as alive)."""
        now = self.clock()
        if not generation or self.seen is None or self.seen[0] != generation:
            self.seen = (generation, now) if generation else None
            return False
        return now - self.seen[1] >= self.ttl

    def renew(self) -> bool:
        """Extend the lease (a conditional write on the generation this tier last wrote).

        Returns:
            Whether it is still ours (False: it expired and another tier took it).
        """
        cur = fixed_result(read_fixed(self.ctx.kv, LEASE_KEY, LEASE_BYTES))
        if cur.raw is None or (self.generation is not None and cur.generation != self.generation):
            self.generation = None
            return False
        try:
            doc = open_record(cur.raw, "lease", LEASE_KEY, None, max_depth=2)
        except mf.ManifestError:
            doc = {}
        if doc.get("token") != self.token:
            self.generation = None
            return False
        gen = self.ctx.kv.write(LEASE_KEY, self._seal(), if_equal=cur.generation).result().generation
        self.generation = bytes(gen) if gen != b"" else None
        return self.generation is not None

    def release(self) -> None:
        """Give the lease back (deleted only if it is still this tier's)."""
        if self.generation is not None:
            with contextlib.suppress(Exception):  # it expires on its own
                self.ctx.kv.write(LEASE_KEY, None, if_equal=self.generation).result()
        self.generation = None


class HotSegments:
    """This writer's recently hit segments (bounded), published for every evictor's ranking.

    Args:
        ctx: the tier's shared state.
    """

    def __init__(self, ctx: TierContext):
        self.ctx = ctx
        self.hits: collections.OrderedDict[tuple[str, str], float] = collections.OrderedDict()
        self.published: dict[tuple[str, str], float] = {}

    def touch(self, sid: tuple[str, str]) -> None:
        """Record a restore from segment `sid` now (under the tier's lock).

        Args:
            sid: (abi, segment).
        """
        with self.ctx.lock:
            self.hits[sid] = time.time()
            self.hits.move_to_end(sid)
            while len(self.hits) > MAX_HOT:
                self.hits.popitem(last=False)

    def last_hit(self, sid: tuple[str, str]) -> float:
        """This writer's last restore from `sid` (0.0 if none it remembers)."""
        with self.ctx.lock:
            return self.hits.get(sid, 0.0)

    def publish(self, force: bool = False) -> None:
        """Write `budget/hot/<writer>.json` when a segment was hit that it does not list as hit within
        `HOT_REPUBLISH_SECONDS` (or with `force`); a failed write is only statistics lost.

        Args:
            force: write even when nothing new was hit.
        """
        with self.ctx.lock:
            due = force or any(
                self.published.get(sid, 0.0) < t - HOT_REPUBLISH_SECONDS or sid not in self.published
                for sid, t in self.hits.items()
            )
            if not due or not self.hits:
                return
            snap = dict(self.hits)
        doc = {"hits": {f"{a}/{s}": round(t, 3) for (a, s), t in snap.items()}}
        try:
            self.ctx.kv.write(f"{HOT_PREFIX}{self.ctx.writer_id}.json", json.dumps(doc).encode()).result()
        except Exception:  # statistics: never fails a read
            return
        with self.ctx.lock:
            self.published = snap

    def store_wide(self) -> dict[tuple[str, str], float]:
        """Every writer's published last hits (the newest per segment), this writer's in memory too;
        hot files older than `HOT_EXPIRES_SECONDS` are deleted on the way.

        Returns:
            {(abi, segment): unix seconds}.
        """
        kv = self.ctx.kv
        names = [k.decode(errors="replace") for k in kv.list(ts.KvStore.KeyRange(HOT_PREFIX, "budget/hot0")).result()]
        out: dict[tuple[str, str], float] = {}
        for name, (raw, _) in self.ctx.read_bounded(names, MAX_HOT_BYTES).items():
            if raw is None:
                continue
            try:
                doc = mf.load_json(raw, "hot file", MAX_HOT_BYTES, max_depth=2)
                hits = doc["hits"] if isinstance(doc, dict) and isinstance(doc.get("hits"), dict) else {}
            except mf.ManifestError:
                continue
            newest = 0.0
            for where, t in list(hits.items())[:MAX_HOT]:
                sid = manifest_where(f"manifests/{where}.json") if isinstance(where, str) else None
                if sid is None or not isinstance(t, (int, float)) or isinstance(t, bool):
                    continue
                out[sid] = max(out.get(sid, 0.0), float(t))
                newest = max(newest, float(t))
            if newest < time.time() - HOT_EXPIRES_SECONDS:
                with contextlib.suppress(Exception):  # garbage collection only
                    kv.write(name, None).result()
        with self.ctx.lock:
            for sid, t in self.hits.items():
                out[sid] = max(out.get(sid, 0.0), t)
        return out


__all__ = [
    "LEASE_KEY",
    "LEDGER_KEY",
    "HotSegments",
    "Lease",
    "Usage",
    "add_usage",
    "read_usage",
    "reconcile_usage",
]
